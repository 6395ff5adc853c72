from __future__ import annotations

import json

import pytest

from dstool.artifacts import Checkpoint, CompressedModel, HFModel, ManifestError, TrainRun
from dstool.errors import UsageError
from dstool.train import checkpoint


def _fake_tag(root, step, payload=b"weights" * 100):
    tag = root / checkpoint.tag_for(step)
    tag.mkdir(parents=True)
    (tag / "mp_rank_00_model_states.pt").write_bytes(payload)
    Checkpoint(step=step).write(tag)
    (root / "latest").write_text(tag.name)
    return tag


def test_manifest_detects_change_truncation_and_loss(tmp_path):
    tag = _fake_tag(tmp_path, 10)
    Checkpoint.read(tag, verify=True)
    f = tag / "mp_rank_00_model_states.pt"
    f.write_bytes(b"x" + f.read_bytes()[1:])
    with pytest.raises(ManifestError, match="sha256"):
        Checkpoint.read(tag, verify=True)
    f.write_bytes(b"short")
    with pytest.raises(ManifestError, match="bytes"):
        Checkpoint.read(tag, verify=True)
    f.unlink()
    with pytest.raises(ManifestError, match="missing"):
        Checkpoint.read(tag, verify=True)


def test_manifests_refuse_another_kind_schema_or_shape(tmp_path):
    tag = _fake_tag(tmp_path, 10)
    with pytest.raises(ManifestError, match="is a 'deepspeed-checkpoint', not a 'compressed-model'"):
        CompressedModel.read(tag)
    raw = json.loads((tag / "dstool.json").read_text())
    (tag / "dstool.json").write_text(json.dumps({**raw, "schema_version": 99}))
    with pytest.raises(ManifestError, match="schema 99; this dstool reads schema 1: re-run `dstool train`"):
        Checkpoint.read(tag)
    (tag / "dstool.json").write_text(json.dumps({**raw, "step": "ten"}))
    with pytest.raises(ManifestError, match="does not fit the 'deepspeed-checkpoint' schema"):
        Checkpoint.read(tag)
    (tag / "dstool.json").write_text("{not json")
    with pytest.raises(ManifestError, match="not valid JSON"):
        Checkpoint.read(tag)
    with pytest.raises(ManifestError, match="has no dstool.json"):
        HFModel.read(tmp_path / "nowhere")


def test_manifests_before_schema_versions(tmp_path):
    """A run, model or checkpoint written before manifests had schema versions still reads (its fields are the
    same); a compress output of then does not (export would guess), and the error says how to redo it."""
    (tmp_path / "dstool.json").write_text(json.dumps({"kind": "train-run", "dstool_version": "0.1.0",
                                                      "created": "x", "data_fingerprint": "abc"}))
    assert TrainRun.read(tmp_path).data is None
    (tmp_path / "dstool.json").write_text(json.dumps({"kind": "compressed-model", "dstool_version": "0.1.0",
                                                      "created": "x", "source": "m", "settings": {}}))
    with pytest.raises(ManifestError, match="re-run `dstool compress` to redo it"):
        CompressedModel.read(tmp_path)


def test_resume_skips_damaged_and_partial(tmp_path):
    _fake_tag(tmp_path, 10)
    newest = _fake_tag(tmp_path, 20)
    (tmp_path / ".partial-step-00000030").mkdir()  # a save that a crash interrupted
    (newest / "mp_rank_00_model_states.pt").write_bytes(b"corrupt")
    warnings = []
    assert checkpoint.find_resume(tmp_path, warn=warnings.append) == tmp_path / "step-00000010"
    assert "step-00000020" in warnings[0]
    with pytest.raises(UsageError, match="damaged"):
        checkpoint.resolve_explicit(str(newest))
    with pytest.raises(UsageError, match="damaged"):
        checkpoint.resolve_explicit(str(tmp_path))  # `latest` points at the damaged one
    assert checkpoint.resolve_explicit(str(tmp_path / "step-00000010")).name == "step-00000010"
