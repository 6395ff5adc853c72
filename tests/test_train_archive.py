"""Checkpoint storage tiers (`dstool train --archive URL`): checkpoints leaving the --keep-checkpoints window are
copied to a cold location, verified against their own sha256 manifest, then deleted from checkpoints/; --resume auto
finds the newest valid one in either tier. Unit tests on real files, and one real DeepSpeed run through the CLI."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import pytest

from dstool.artifacts import Checkpoint, TrainRun
from dstool.errors import UsageError
from dstool.train import archive, checkpoint

from conftest import FAST, TRAIN_CODE, built_once, dstool


def _fake_tag(root, step, payload=b"weights"):
    """A checkpoint folder as `checkpoint.save` leaves it: files (one nested), its manifest, `latest`."""
    tag = root / checkpoint.tag_for(step)
    (tag / "zero").mkdir(parents=True)
    (tag / "mp_rank_00_model_states.pt").write_bytes(payload * 1000 + bytes([step]))
    (tag / "zero" / "optim_states.pt").write_bytes(b"optim" * 300 + bytes([step]))
    Checkpoint(step=step, world_size=1).write(tag)
    (root / "latest").write_text(tag.name)
    return tag


def _run_with(tmp_path, steps=(1, 2, 3)):
    root = tmp_path / "run" / "checkpoints"
    for s in steps:
        _fake_tag(root, s)
    (root / "universal" / "step-00000001").mkdir(parents=True)  # converted for another world size: goes with it
    return root


def _index(root):
    return {e["step"]: e for e in json.loads((root / "index.json").read_text())["checkpoints"]}


def test_prune_archives_verified_copies_then_deletes(tmp_path):
    root, cold = _run_with(tmp_path), tmp_path / "cold"
    originals = {p.relative_to(root): p.read_bytes() for p in root.rglob("*") if p.is_file()}
    checkpoint.prune(root, 1, str(cold), wait=True)
    assert checkpoint.complete_tags(root) == ["step-00000003"]
    assert not (root / "universal" / "step-00000001").exists()
    store = archive.Archive(str(cold))
    assert store.tags() == ["step-00000001", "step-00000002"]
    for tag in store.tags():  # every byte of the checkpoint and its manifest, and the marker
        for rel, data in originals.items():
            if rel.parts[0] == tag:
                assert (cold / rel).read_bytes() == data
        Checkpoint.read(cold / tag, verify=True)
        assert store.marker(tag)["manifest_sha256"]
    assert not list(cold.glob(".partial-*")) and not list(cold.glob(".dstool-probe*"))
    index = _index(root)
    assert sorted(index) == [1, 2, 3]
    for step in (1, 2):
        assert index[step]["hot"] is None and index[step]["archive_status"] == "verified"
        assert index[step]["archive"] == f"file://{cold}/{checkpoint.tag_for(step)}"
    assert index[3]["hot"] == "step-00000003" and index[3]["archive"] is None
    assert json.loads((root / "index.json").read_text())["archive"] == str(cold)


def test_prune_without_archive_deletes_and_indexes(tmp_path):
    root = _run_with(tmp_path)
    checkpoint.prune(root, 2)
    assert checkpoint.complete_tags(root) == ["step-00000002", "step-00000003"]
    assert sorted(_index(root)) == [2, 3]


def test_background_copy_is_waited_for_by_the_next_prune(tmp_path):
    root, cold = _run_with(tmp_path), tmp_path / "cold"
    checkpoint.prune(root, 1, str(cold))  # starts the copy in a thread and returns
    _fake_tag(root, 4)
    checkpoint.prune(root, 1, str(cold))  # waits for it, then archives step 3
    checkpoint.wait_archived()
    assert [t.name for t in threading.enumerate() if t.name == "dstool-archive"] == []
    assert archive.Archive(str(cold)).tags() == [f"step-0000000{s}" for s in (1, 2, 3)]
    assert checkpoint.complete_tags(root) == ["step-00000004"]


def test_resume_finds_the_newest_in_either_tier(tmp_path):
    root, cold = _run_with(tmp_path), tmp_path / "cold"
    url = f"file://{cold}"  # a URL works as a plain folder does
    checkpoint.prune(root, 1, url, wait=True)
    assert checkpoint.find_resume(root, archive=url) == root / "step-00000003"  # hot, newest
    shutil.rmtree(root / "step-00000003")
    warnings: list[str] = []
    found = checkpoint.find_resume(root, warn=warnings.append, archive=url)
    assert found == root / "step-00000002" and not warnings
    Checkpoint.read(found, verify=True)  # copied back, whole
    assert (root / "latest").read_text() == "step-00000002"
    assert not list(root.glob(".partial-*"))
    entry = _index(root)[2]
    assert entry["hot"] == "step-00000002" and entry["archive"] == f"{url}/step-00000002"
    # archived again (when it leaves the window once more): the same checkpoint is not copied twice
    _fake_tag(root, 4)
    before = archive.Archive(url).marker("step-00000002")
    checkpoint.prune(root, 1, url, wait=True)
    assert archive.Archive(url).marker("step-00000002") == before
    assert checkpoint.complete_tags(root) == ["step-00000004"]


def test_hot_wins_at_the_same_step_and_a_damaged_hot_one_is_replaced(tmp_path):
    root, cold = _run_with(tmp_path, steps=(1, 2)), tmp_path / "cold"
    store = archive.Archive(str(cold))
    store.put(root / "step-00000002")  # both tiers hold step 2
    (cold / "step-00000002" / "mp_rank_00_model_states.pt").write_bytes(b"damaged")
    warnings: list[str] = []
    assert checkpoint.find_resume(root, warn=warnings.append, archive=str(cold)) == root / "step-00000002"
    assert not warnings  # the archived copy was never read
    shutil.rmtree(cold / "step-00000002")
    store.put(root / "step-00000002")
    (root / "step-00000002" / "zero" / "optim_states.pt").write_bytes(b"bit rot")
    assert checkpoint.find_resume(root, warn=warnings.append, archive=str(cold)) == root / "step-00000002"
    assert "skipping checkpoint step-00000002" in warnings[0]
    Checkpoint.read(root / "step-00000002", verify=True)  # replaced by the archived copy


def test_damaged_archive_copy_is_skipped_with_a_warning(tmp_path):
    root, cold = _run_with(tmp_path), tmp_path / "cold"
    checkpoint.prune(root, 1, str(cold), wait=True)
    shutil.rmtree(root / "step-00000003")
    f = cold / "step-00000002" / "zero" / "optim_states.pt"
    f.write_bytes(b"X" + f.read_bytes()[1:])  # same size, another sha256
    warnings: list[str] = []
    assert checkpoint.find_resume(root, warn=warnings.append, archive=str(cold)) == root / "step-00000001"
    assert len(warnings) == 1 and "skipping archived checkpoint" in warnings[0]
    assert f"{cold}/step-00000002: file zero/optim_states.pt fails its sha256 check" in warnings[0]
    assert checkpoint.complete_tags(root) == ["step-00000001"]  # nothing of the damaged copy stays here
    assert not list(root.glob(".partial-*"))
    (cold / "step-00000001" / "dstool.json").write_text("{}")  # a manifest that is not the one archived
    (cold / "step-00000001" / "mp_rank_00_model_states.pt").unlink()
    shutil.rmtree(root / "step-00000001")
    warnings.clear()
    assert checkpoint.find_resume(root, warn=warnings.append, archive=str(cold)) is None
    assert "sha256 check" in warnings[0] and "step-00000001" in warnings[1]
    assert "is not the one archived" in warnings[1]


def test_partial_copies_are_never_taken_as_valid(tmp_path, monkeypatch):
    root, cold = _run_with(tmp_path), tmp_path / "cold"
    store = archive.Archive(str(cold))
    # a run killed mid-copy (files under the partial name), and one killed between the rename and the marker
    shutil.copytree(root / "step-00000001", cold / ".partial-step-00000001")
    shutil.copytree(root / "step-00000003", cold / "step-00000003")
    assert store.tags() == []
    shutil.rmtree(root / "step-00000003")
    warnings: list[str] = []
    assert checkpoint.find_resume(root, warn=warnings.append, archive=str(cold)) == root / "step-00000002"
    # a copy that fails midway (the network, a full disk): the checkpoint stays hot, nothing is marked
    calls = []

    def failing_upload(self, src, dest):
        calls.append(dest)
        if len(calls) == 2:
            raise OSError("No space left on device")
        return real_upload(self, src, dest)

    real_upload = archive.Archive._upload
    monkeypatch.setattr(archive.Archive, "_upload", failing_upload)
    checkpoint.prune(root, 1, str(cold), warn=warnings.append, wait=True)
    assert "checkpoint step-00000001 not archived, kept in" in warnings[-1] and "No space left" in warnings[-1]
    assert checkpoint.complete_tags(root) == ["step-00000001", "step-00000002"]
    assert store.tags() == [] and _index(root)[1]["archive_status"].startswith("failed: ")
    # the next prune copies it again, over what the failed and the killed copies left
    monkeypatch.setattr(archive.Archive, "_upload", real_upload)
    _fake_tag(root, 3)
    checkpoint.prune(root, 1, str(cold), wait=True)
    assert store.tags() == ["step-00000001", "step-00000002"]
    assert not (cold / ".partial-step-00000001").exists()
    Checkpoint.read(cold / "step-00000001", verify=True)


def test_a_damaged_hot_checkpoint_is_not_archived_and_is_kept(tmp_path):
    root, cold = _run_with(tmp_path, steps=(1, 2)), tmp_path / "cold"
    (root / "step-00000001" / "mp_rank_00_model_states.pt").write_bytes(b"corrupt")
    warnings: list[str] = []
    checkpoint.prune(root, 1, str(cold), warn=warnings.append, wait=True)
    assert "fails its sha256 check (not archived)" in warnings[0]
    assert checkpoint.complete_tags(root) == ["step-00000001", "step-00000002"]
    assert archive.Archive(str(cold)).tags() == []


def test_settle_archives_what_the_ranks_left(tmp_path):
    root, cold = _run_with(tmp_path), tmp_path / "cold"
    assert checkpoint.settle(root, 1, str(cold)) == ["step-00000001", "step-00000002"]
    assert checkpoint.settle(root, 1, str(cold)) == []


def test_bad_archive_locations_are_refused(tmp_path):
    with pytest.raises(UsageError, match="Protocol not known: nosuch"):
        archive.check("nosuch://bucket/run")
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(UsageError, match="cannot be written"):
        archive.check(str(tmp_path / "a-file" / "cold"))
    archive.check(str(tmp_path / "new" / "cold"))  # created
    assert (tmp_path / "new" / "cold").is_dir() and not list((tmp_path / "new" / "cold").iterdir())


def test_cli_refuses_an_unknown_protocol_before_any_rank_starts(tmp_path):
    proc = dstool("train", "--output", str(tmp_path / "run"), "--archive", "nosuch://x", "--max-steps", "1",
                  check=False)
    assert proc.returncode == 2, proc.stderr
    assert "--archive nosuch://x: Protocol not known: nosuch" in proc.stderr + proc.stdout
    assert len((proc.stderr + proc.stdout).strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


# ---- a real run ----------------------------------------------------------------------------------------------

RUN = ["--nproc", "1", "--zero", "0", "--max-steps", "4", "--save-every", "1", "--keep-checkpoints", "1", *FAST]


@pytest.fixture(scope="module")
def archived_run(tmp_path_factory, worker_id):
    """4 steps saved every step, 1 kept: steps 1-3 are archived. Then every hot checkpoint is deleted and the run
    resumed with --resume auto: from the archive. Kept between runs (keyed by the training code): (the run, its
    archive, what both held after the first run, the resumed run's output)."""
    def build(made: Path) -> None:
        out, cold = made / "run", made / "cold"
        dstool("train", "--output", str(out), "--archive", f"file://{cold}", *RUN)
        root = out / "checkpoints"
        state = {"hot": checkpoint.complete_tags(root), "cold": archive.Archive(str(cold)).tags(),
                 "index": _index(root)}
        for tag in checkpoint.complete_tags(root):
            shutil.rmtree(root / tag)
        resumed = dstool("train", "--output", str(out), "--archive", f"file://{cold}", "--resume", "auto", *RUN)
        (made / "state.json").write_text(json.dumps(state))
        (made / "resumed.out").write_text(resumed.stdout + resumed.stderr)

    made = built_once(tmp_path_factory, worker_id, "archived_run", build, TRAIN_CODE, RUN)
    state = json.loads((made / "state.json").read_text())
    state["index"] = {int(step): entry for step, entry in state["index"].items()}
    return made / "run", made / "cold", state, (made / "resumed.out").read_text()


def test_run_archives_each_checkpoint_leaving_the_window(archived_run):
    out, cold, state, _ = archived_run
    assert state["hot"] == ["step-00000004"]
    assert state["cold"] == ["step-00000001", "step-00000002", "step-00000003"]
    for tag in state["cold"]:
        Checkpoint.read(cold / tag, verify=True)
    index = state["index"]
    assert sorted(index) == [1, 2, 3, 4]
    assert all(index[s]["archive_status"] == "verified" and index[s]["hot"] is None for s in (1, 2, 3))
    assert index[4]["hot"] == "step-00000004"
    run = TrainRun.read(out)
    assert run.archive == f"file://{cold}" and run.checkpoint_index == "checkpoints/index.json"


def test_run_resumes_from_the_archive(archived_run):
    out, cold, _, resumed = archived_run
    assert "resumed at step 3" in resumed and "restored step-00000003 from the archive" in resumed, resumed[-3000:]
    root = out / "checkpoints"
    assert checkpoint.complete_tags(root) == ["step-00000004"]  # step 3 went back to the archive, step 4 is new
    assert archive.Archive(str(cold)).tags() == ["step-00000001", "step-00000002", "step-00000003"]
    Checkpoint.read(root / "step-00000004", verify=True)
