"""The artefacts the suite keeps between runs (tests/artefacts.py): made once for a key, made again when their code,
inputs or files change."""

from __future__ import annotations

from pathlib import Path

import artefacts

from conftest import EXPORT_CODE, TRAIN_CODE


def test_kept_made_again_on_a_changed_input_file_or_code(tmp_path, monkeypatch):
    monkeypatch.setenv("DSTOOL_CACHE_DIR", str(tmp_path / "cache"))
    made: list[Path] = []

    def build(out: Path) -> None:
        made.append(out)
        (out / "sub").mkdir(parents=True)
        (out / "sub" / "weights").write_text("w")

    first = artefacts.built("thing", build, TRAIN_CODE, ("--steps", "2"))
    assert artefacts.built("thing", build, TRAIN_CODE, ("--steps", "2")) == first and len(made) == 1
    assert first.parent == tmp_path / "cache" / "test-artefacts" and (first / "sub" / "weights").read_text() == "w"

    other = artefacts.built("thing", build, TRAIN_CODE, ("--steps", "3"))
    assert other != first and len(made) == 2
    assert artefacts.built("thing", build, ("dstool.compress",), ("--steps", "2")) not in (first, other)
    assert len(made) == 3

    (first / "sub" / "weights").write_text("written by a test")
    assert artefacts.built("thing", build, TRAIN_CODE, ("--steps", "2")) == first and len(made) == 4
    assert (first / "sub" / "weights").read_text() == "w"


def test_a_child_is_made_again_with_its_parent(tmp_path, monkeypatch):
    """An export of a kept trained model names it by path: the path stays when the model is made again (a test wrote
    into it), and the export must follow."""
    monkeypatch.setenv("DSTOOL_CACHE_DIR", str(tmp_path / "cache"))
    made: list[str] = []

    def parent(out: Path) -> None:
        made.append("parent")
        out.mkdir(parents=True)
        (out / "weights").write_text(str(len(made)))

    def child(out: Path) -> None:
        made.append("child")
        out.mkdir(parents=True)

    model = artefacts.built("model", parent, TRAIN_CODE, ())
    export = artefacts.built("export", child, EXPORT_CODE, (f"--model={model / 'weights'}",))
    assert artefacts.built("export", child, EXPORT_CODE, (f"--model={model / 'weights'}",)) == export
    (model / "weights").write_text("written by a test")
    assert artefacts.built("model", parent, TRAIN_CODE, ()) == model and made == ["parent", "child", "parent"]
    assert artefacts.built("export", child, EXPORT_CODE, (f"--model={model / 'weights'}",)) != export
    assert made[-1] == "child"


def test_a_stage_key_covers_what_it_imports_and_what_export_copies():
    train, export = artefacts.modules(TRAIN_CODE), artefacts.modules(EXPORT_CODE)
    assert {"dstool.train.worker", "dstool.models", "dstool.cli.commands"} <= train
    assert not any(m.startswith(("dstool.serve", "dstool.compress")) for m in train)
    assert {"dstool.serve.export.repository", "dstool.serve.triton_models.llm", "dstool.decoding.sampling",
            "dstool.onnx_export"} <= export
    assert not any(m.startswith("dstool.serve.gateway") for m in export)
    assert all(artefacts._file(m) is not None for m in train | export)  # each read from this checkout

