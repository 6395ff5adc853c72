"""Measurements every compression report is built from: held-out perplexity, ONNX Runtime latency, sizes."""

from __future__ import annotations

import math
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from dstool import corpus
from dstool.artifacts import HFModel, ManifestError, kind_of
from dstool.errors import UsageError
from dstool.onnx_export import ort_session, run_logits


def heldout_tokens(model_dir: Path, tokenizer, calibration: str | None) -> tuple[np.ndarray, np.ndarray, str]:
    """(calibration tokens, held-out tokens, which held-out tokens). A `dstool train` model folder names its run's
    data split in its manifest: its training split calibrates, its held-out split measures. Otherwise (or with
    `calibration`) that text (or the embedded corpus) is tokenized and its last 5 % held out."""
    split = None
    if calibration is None and kind_of(model_dir) == "hf-model":
        try:
            split = HFModel.read(model_dir).data
        except ManifestError:
            split = None
    if split is not None and (Path(model_dir) / split.folder / "val.bin").is_file():
        folder = Path(model_dir) / split.folder
        train, val = (corpus.read_split(folder, s, split.dtype) for s in ("train", "val"))
        return (np.asarray(train[:200_000], dtype=np.int64), np.asarray(val, dtype=np.int64),
                f"the training run's held-out split ({len(val):,} tokens)")
    docs = corpus.read_documents(calibration)
    ids: list[int] = []
    for enc in tokenizer(docs, add_special_tokens=False)["input_ids"]:
        ids.extend(enc)
        ids.append(tokenizer.eos_token_id)
    arr = np.asarray(ids, dtype=np.int64)
    n_val = max(len(arr) // 20, 1)
    where = f"the last 5 % of {calibration or 'the embedded corpus'} ({n_val:,} tokens)"
    return arr[:-n_val][:200_000], arr[-n_val:], where


def windows(tokens: np.ndarray, seq_len: int, limit: int) -> np.ndarray:
    n = min(len(tokens) // seq_len, limit)
    if n == 0:
        raise UsageError(f"only {len(tokens)} tokens of text to measure on: fewer than one {seq_len}-token window; "
                         "give more --calibration text")
    return tokens[: n * seq_len].reshape(n, seq_len)


def _nll(logits: np.ndarray, ids: np.ndarray) -> tuple[float, int]:
    logits = torch.from_numpy(logits[:, :-1]).float()
    target = torch.from_numpy(ids[:, 1:])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="sum")
    return float(loss), target.numel()


def perplexity_onnx(onnx_path: Path, heldout: np.ndarray, seq_len: int = 128, limit: int = 64, batch: int = 8) -> float:
    session = ort_session(onnx_path)
    rows = windows(heldout, seq_len, limit)
    total, count = 0.0, 0
    for i in range(0, len(rows), batch):
        nll, n = _nll(run_logits(session, rows[i:i + batch]), rows[i:i + batch])
        total, count = total + nll, count + n
    return math.exp(total / count)


@torch.no_grad()
def perplexity_torch(model, heldout: np.ndarray, seq_len: int = 128, limit: int = 64, batch: int = 8) -> float:
    rows = windows(heldout, seq_len, limit)
    total, count = 0.0, 0
    for i in range(0, len(rows), batch):
        ids = torch.from_numpy(rows[i:i + batch])
        nll, n = _nll(model(input_ids=ids).logits.float().numpy(), rows[i:i + batch])
        total, count = total + nll, count + n
    return math.exp(total / count)


def latency_ms(onnx_paths: list[Path], vocab: int, batch: int, seq_len: int = 128, repeats: int = 20) -> list[float]:
    """Median wall time of one ONNX Runtime forward (CPU provider) for each model, after 3 warm-up runs.
    The models are timed in alternation, so a busy moment of the machine slows all of them alike, and each
    round starts with the next model, so none always runs right after the same neighbour (caches, clocks)."""
    sessions = [ort_session(p) for p in onnx_paths]
    ids = np.random.default_rng(0).integers(0, vocab, (batch, seq_len))
    for s in sessions:
        for _ in range(3):
            run_logits(s, ids)
    times: list[list[float]] = [[] for _ in sessions]
    for round_ in range(repeats):
        for i in range(len(sessions)):
            k = (round_ + i) % len(sessions)
            t0 = time.perf_counter()
            run_logits(sessions[k], ids)
            times[k].append(time.perf_counter() - t0)
    return [1000 * statistics.median(t) for t in times]


@torch.no_grad()
def latency_torch_ms(models: list, vocab: int, batch: int, seq_len: int = 128, repeats: int = 5) -> list[float]:
    """As latency_ms, for PyTorch models (eval mode, CPU): median of `repeats` forwards, in alternation."""
    ids = torch.from_numpy(np.random.default_rng(0).integers(0, vocab, (batch, seq_len)))
    for m in models:
        m(input_ids=ids)
    times: list[list[float]] = [[] for _ in models]
    for _ in range(repeats):
        for m, t in zip(models, times):
            t0 = time.perf_counter()
            m(input_ids=ids)
            t.append(time.perf_counter() - t0)
    return [1000 * statistics.median(t) for t in times]


def safetensors_bytes(folder: Path) -> int:
    """Bytes of a Hugging Face folder's weight files."""
    return sum(f.stat().st_size for f in Path(folder).glob("*.safetensors"))


def onnx_bytes(onnx_path: Path) -> int:
    """The model file plus its external-data sidecar, if any."""
    sidecar = Path(str(onnx_path) + ".data")
    return onnx_path.stat().st_size + (sidecar.stat().st_size if sidecar.exists() else 0)
