"""The fp32 baseline a compress run starts from: its input exported to ONNX (both graphs, each parity-checked
against PyTorch) and measured (perplexity and top-1 predictions on the held-out tokens, cloze accuracy, size).

Exporting is most of a small model's compress run (docs/compress.md), and several recipes are usually tried on one
input, so a baseline is kept between runs, keyed by everything that makes it: the input's weights and config, the
held-out tokens and cloze items, the versions of the libraries that export and run it, and the source of dstool's
exporter and measurements. A kept entry is reused only when its graphs still have the sha256 it recorded. It lives
in compress-baselines/ of dstool's cache folder (dstool.files.cache_dir: ~/.cache/dstool), the newest KEEP entries
kept; a baseline whose graphs exceed MAX_BYTES is not kept; `--no-baseline-cache` neither reads nor
writes it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import uuid
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import numpy as np

from dstool import log as dlog
from dstool import logits_graph, onnx_export
from dstool.compress import measure, quality
from dstool.files import cache_dir, replace_folder, sha256_file, write_json_atomic
from dstool.onnx_export import OnnxExport, export_decoder_model

log = dlog.log
KEEP = 4
MAX_BYTES = 2 << 30
LIBRARIES = ("torch", "transformers", "onnx", "onnxscript", "onnxruntime", "onnx-ir", "dstool")
CODE = tuple(Path(str(m.__file__)) for m in (measure, quality, onnx_export, logits_graph)) + (Path(__file__),)


@dataclass
class Baseline:
    logits: OnnxExport
    decoder: OnnxExport
    figures: dict  # what `Measured` holds but the speeds
    top1: np.ndarray  # predictions at the held-out positions the perplexity scores


def baseline(model, src: Path, weights: str, heldout: np.ndarray, cloze: quality.Cloze, work: Path,
             cached: bool) -> Baseline:
    """The baseline of `model` (loaded from `src`, unchanged; `weights`: its weights' sha256, as the manifest
    records it): a kept one when `cached` and there is one, else exported and measured under `work` (and kept when
    `cached`)."""
    key = _key(src, weights, heldout, cloze) if cached else None
    entry = _root() / key if key else None
    if entry is not None and (found := _read(entry)) is not None:
        model.eval().config.use_cache = False  # as the logits export leaves it
        log.info(f"baseline graphs and figures reused: {entry} (the same input, data and exporter)")
        return found
    decoder = export_decoder_model(model, work / "baseline-decoder")  # decoding speed
    logits = logits_graph.from_decoder(model, decoder, work / "baseline")
    made = Baseline(logits, decoder, *measured(logits.path, model, heldout, cloze))
    if entry is not None:
        _write(entry, made)
    return made


def measured(onnx_path: Path, model, heldout: np.ndarray, cloze: quality.Cloze) -> tuple[dict, np.ndarray]:
    """What `Measured` holds but the speeds (timed later, the two models interleaved), and the top-1 predictions on
    the held-out positions the perplexity scores."""
    ppl, top1 = measure.score_onnx(onnx_path, heldout)
    return {"parameters": sum(p.numel() for p in model.parameters()), "onnx_bytes": measure.onnx_bytes(onnx_path),
            "perplexity": ppl, "zero_shot_accuracy": quality.cloze_accuracy(onnx_path, cloze)}, top1


def _root() -> Path:
    return cache_dir() / "compress-baselines"


def _key(src: Path, weights: str, heldout: np.ndarray, cloze: quality.Cloze) -> str:
    h = hashlib.sha256()
    h.update(weights.encode())
    h.update((src / "config.json").read_bytes())
    for array in (heldout, cloze.contexts, cloze.candidates):
        h.update(f"{array.dtype}{array.shape}".encode())
        h.update(np.ascontiguousarray(array).tobytes())
    for name in LIBRARIES:
        try:
            h.update(f"{name}={metadata.version(name)}\n".encode())
        except metadata.PackageNotFoundError:
            h.update(f"{name}=none\n".encode())
    for path in CODE:
        h.update(path.read_bytes())
    return h.hexdigest()[:32]


def _files(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): sha256_file(p) for p in sorted(folder.rglob("*")) if p.is_file()
            and p.name != "baseline.json"}


def _read(entry: Path) -> Baseline | None:
    try:
        record = json.loads((entry / "baseline.json").read_text())
        if _files(entry) != record["files"]:
            log.warning(f"kept baseline {entry} no longer matches its sha256: made again")
            return None
        graphs = {role: OnnxExport(**{**record[role], "path": entry / record[role]["path"]})
                  for role in ("logits", "decoder")}
        top1 = np.load(entry / "top1.npy")
    except (OSError, ValueError, KeyError, TypeError):
        return None
    os.utime(entry)  # the newest KEEP are kept
    return Baseline(graphs["logits"], graphs["decoder"], record["figures"], top1)


def _write(entry: Path, made: Baseline) -> None:
    """Keep `made` as `entry` (written aside, then renamed into place), unless too big; the oldest entries beyond
    KEEP go. A cache that cannot be written costs the next run its reuse, nothing else."""
    graphs = {"logits": made.logits, "decoder": made.decoder}
    size = sum(p.stat().st_size for e in graphs.values() for p in e.path.parent.rglob("*") if p.is_file())
    if size > MAX_BYTES:
        return
    staging = entry.with_name(f".{entry.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        record: dict = {"figures": {k: v if v is None else float(v) if isinstance(v, float | np.floating) else int(v)
                                    for k, v in made.figures.items()}}  # None: a figure the data cannot give
        for role, e in graphs.items():
            shutil.copytree(e.path.parent, staging / role)
            record[role] = {**dataclasses.asdict(e), "path": f"{role}/{e.path.name}"}
        np.save(staging / "top1.npy", made.top1)
        record["files"] = _files(staging)
        write_json_atomic(staging / "baseline.json", record)
        replace_folder(staging, entry)
        entries = sorted((p for p in entry.parent.iterdir() if not p.name.startswith(".")),
                         key=lambda p: p.stat().st_mtime, reverse=True)
        for old in entries[KEEP:]:
            shutil.rmtree(old, ignore_errors=True)
    except OSError as e:
        shutil.rmtree(staging, ignore_errors=True)
        log.warning(f"the baseline could not be kept in {entry.parent}: {e}")
