from __future__ import annotations

import pytest

from dstool.errors import UsageError
from dstool.manifest import ManifestError, verify_manifest, write_manifest
from dstool.train import checkpoint


def _fake_tag(root, step, payload=b"weights" * 100):
    tag = root / checkpoint.tag_for(step)
    tag.mkdir(parents=True)
    (tag / "mp_rank_00_model_states.pt").write_bytes(payload)
    write_manifest(tag, checkpoint.KIND, step=step)
    (root / "latest").write_text(tag.name)
    return tag


def test_manifest_detects_change_truncation_and_loss(tmp_path):
    tag = _fake_tag(tmp_path, 10)
    verify_manifest(tag, checkpoint.KIND)
    f = tag / "mp_rank_00_model_states.pt"
    f.write_bytes(b"x" + f.read_bytes()[1:])
    with pytest.raises(ManifestError, match="sha256"):
        verify_manifest(tag)
    f.write_bytes(b"short")
    with pytest.raises(ManifestError, match="bytes"):
        verify_manifest(tag)
    f.unlink()
    with pytest.raises(ManifestError, match="missing"):
        verify_manifest(tag)


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
