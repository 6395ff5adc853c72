"""Bad input: one-line error, exit code 2, nothing on disk changed. No rank is started for any of these, so they
run in this process (`dstool.cli.main`), in a fresh working folder."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from conftest import cli, one_line_usage_error


def _snapshot(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _expect_usage_error(args: list[str], needle: str, tmp_path: Path) -> None:
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        one_line_usage_error(cli(*args), needle)
    finally:
        os.chdir(cwd)


@pytest.mark.parametrize("args,needle", [
    (["--zero", "5"], "zero"),
    (["--model", "no-such-preset"], "unknown model 'no-such-preset'"),
    (["--data", "/nonexistent/corpus.txt"], "does not exist"),
    (["--precision", "fp16"], "fp16 needs a GPU"),
    (["--micro-batch-size", "4", "--nproc", "2", "--global-batch-size", "12"], "not a multiple"),
    (["--offload-params", "--zero", "2"], "offload_params needs zero: 3"),
    (["--env", "NCCL_SOCKET_IFNAME"], "KEY=VALUE"),
    (["--no-such-flag"], "unrecognized arguments"),
    (["--lr", "-1"], "lr"),
    (["--save-every-minutes", "0"], "save_every_minutes"),
    (["--preempt-grace-s", "-5"], "preempt_grace_s"),
])
def test_bad_flags(args, needle, tmp_path):
    _expect_usage_error(["train", "--output", str(tmp_path / "run"), *args], needle, tmp_path)
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


def test_empty_data(tmp_path):
    (tmp_path / "empty.txt").write_text("  \n\n")
    _expect_usage_error(["train", "--data", str(tmp_path / "empty.txt"), "--output", str(tmp_path / "run")],
                        "is empty", tmp_path)


def test_empty_data_folder(tmp_path):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "notes.md").write_text("not a txt or jsonl")
    _expect_usage_error(["train", "--data", str(tmp_path / "corpus"), "--output", str(tmp_path / "run")],
                        "holds no shards", tmp_path)


def test_bad_jsonl(tmp_path):
    (tmp_path / "c.jsonl").write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    _expect_usage_error(["train", "--data", str(tmp_path / "c.jsonl"), "--output", str(tmp_path / "run")],
                        "c.jsonl:2", tmp_path)


def test_hostfile_that_does_not_parse(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node0 slots=2\nnode1 gpus=two\n")
    _expect_usage_error(["train", "--hostfile", str(hostfile), "--output", str(tmp_path / "run")],
                        "line 2 'node1 gpus=two' does not parse", tmp_path)


def test_bad_yaml_config(tmp_path):
    (tmp_path / "c.yaml").write_text("zero: 2\nmax_stepz: 10\n")
    _expect_usage_error(["train", "--config", str(tmp_path / "c.yaml"), "--output", str(tmp_path / "run")],
                        "unknown option 'max_stepz'", tmp_path)


def test_output_with_someone_elses_files_is_untouched(tmp_path):
    out = tmp_path / "precious"
    out.mkdir()
    (out / "thesis.tex").write_text("years of work")
    (out / "sub").mkdir()
    (out / "sub" / "data.bin").write_bytes(b"\x00\x01" * 100)
    before = _snapshot(out)
    _expect_usage_error(["train", "--output", str(out)], "holds files dstool did not write", tmp_path)
    assert _snapshot(out) == before


def test_output_that_is_a_file(tmp_path):
    (tmp_path / "out").write_text("x")
    _expect_usage_error(["train", "--output", str(tmp_path / "out")], "is a file", tmp_path)


def test_deepspeed_json_with_inconsistent_batch(tmp_path):
    (tmp_path / "ds.json").write_text(json.dumps({"train_batch_size": 999}))
    _expect_usage_error(["train", "--deepspeed-config", str(tmp_path / "ds.json"), "--output", str(tmp_path / "run")],
                        "batch sizes disagree", tmp_path)


def test_hostfile_naming_an_unreachable_host(tmp_path):
    (tmp_path / "hostfile").write_text("no-such-host.invalid slots=1\nlocalhost slots=1\n")
    _expect_usage_error(["train", "--hostfile", str(tmp_path / "hostfile"), "--output", str(tmp_path / "run")],
                        "host no-such-host.invalid does not resolve", tmp_path)
    assert not (tmp_path / "run").exists()


def test_world_size_the_batch_cannot_divide(tmp_path):
    (tmp_path / "hostfile").write_text("node0 slots=3\nnode1 slots=3\n")
    _expect_usage_error(["train", "--hostfile", str(tmp_path / "hostfile"), "--node-rank", "0",
                         "--global-batch-size", "8", "--micro-batch-size", "1", "--output", str(tmp_path / "run")],
                        "x world size 6", tmp_path)


def test_checkpoint_of_another_model_shape(trained, tmp_path):
    tag = trained.parent / "checkpoints" / "step-00000040"
    _expect_usage_error(["train", "--model", "tiny-moe", "--resume", str(tag), "--output", str(tmp_path / "run"),
                         "--seq-len", "64"], "holds another model shape", tmp_path)
    assert not list((tmp_path / "run").glob("checkpoints/*")) and not (tmp_path / "run" / "run.json").exists()


def test_max_restarts_needs_torchrun(tmp_path):
    (tmp_path / "hostfile").write_text("localhost slots=2\n")
    _expect_usage_error(["train", "--hostfile", str(tmp_path / "hostfile"), "--max-restarts", "1",
                         "--output", str(tmp_path / "run")], "--launcher torchrun", tmp_path)


def test_packed_data_changed_since_the_run_began(trained, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(trained.parent, run, ignore=shutil.ignore_patterns("checkpoints", "model", "logs"))
    recorded = json.loads((run / "dstool.json").read_text())["data"]["sha256"]
    assert set(recorded) == {"train.bin", "val.bin", "shards/00000/tokens.bin"}
    packed = bytearray((run / "data" / "shards" / "00000" / "tokens.bin").read_bytes())
    packed[100] ^= 1
    (run / "data" / "shards" / "00000" / "tokens.bin").write_bytes(bytes(packed))
    before = _snapshot(run)
    _expect_usage_error(["train", "--output", str(run), "--max-steps", "41", "--seq-len", "64"],
                        "tokens.bin changed since the run packed it", tmp_path)
    after = _snapshot(run)
    assert {k: v for k, v in after.items() if k != "train.log"} == {k: v for k, v in before.items() if k != "train.log"}


@pytest.mark.parametrize("command", ["batch", "infer"])
@pytest.mark.parametrize("args,needle", [
    (["--repetition-penalty", "1000"], "--repetition-penalty must be a number > 0 and <= 100"),
    (["--seed", str(2**64)], "--seed must be an integer from 0 to 9223372036854775807"),
    (["--top-k", str(2**32)], "--top-k must be an integer from 0 to 2147483647"),
    (["--max-new-tokens", str(2**32 + 4)], "max_new_tokens"),
])
def test_sampling_the_models_would_refuse_is_refused_by_their_rule(command, args, needle, tmp_path):
    """What reaches the models' sampler is checked by its own rule before any work (`dstool batch --engine triton`
    would otherwise fail every row, and an INT32 would wrap)."""
    _expect_usage_error([command, *(["hi"] if command == "infer" else []), *args], needle, tmp_path)
