"""Measurements every compression report is built from: held-out perplexity and top-1 predictions, ONNX Runtime
prefill latency and decoding throughput, sizes."""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from dstool import corpus
from dstool.artifacts import HFModel, ManifestError, kind_of
from dstool.decoding import engine
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


def score_onnx(onnx_path: Path, heldout: np.ndarray, seq_len: int = 128, limit: int = 64,
               batch: int = 8) -> tuple[float, np.ndarray]:
    """Perplexity on up to `limit` windows of `heldout`, and the top-1 next-token prediction at every position it
    scores ([windows, seq_len - 1])."""
    session = ort_session(onnx_path)
    rows = windows(heldout, seq_len, limit)
    total, count, top1 = 0.0, 0, []
    for i in range(0, len(rows), batch):
        logits = run_logits(session, rows[i:i + batch])
        nll, n = _nll(logits, rows[i:i + batch])
        total, count = total + nll, count + n
        top1.append(logits[:, :-1].argmax(-1))
    return math.exp(total / count), np.concatenate(top1)


def perplexity_onnx(onnx_path: Path, heldout: np.ndarray, seq_len: int = 128, limit: int = 64, batch: int = 8) -> float:
    return score_onnx(onnx_path, heldout, seq_len, limit, batch)[0]


def top1_agreement(reference: np.ndarray, other: np.ndarray) -> float:
    """Share of positions where two models' top-1 next tokens (`score_onnx`'s predictions) are the same."""
    return float((reference == other).mean())


@torch.no_grad()
def perplexity_torch(model, heldout: np.ndarray, seq_len: int = 128, limit: int = 64, batch: int = 8) -> float:
    rows = windows(heldout, seq_len, limit)
    total, count = 0.0, 0
    for i in range(0, len(rows), batch):
        ids = torch.from_numpy(rows[i:i + batch])
        nll, n = _nll(model(input_ids=ids).logits.float().numpy(), rows[i:i + batch])
        total, count = total + nll, count + n
    return math.exp(total / count)


def timed_in_rotation(calls: Sequence[Callable[[], object]], repeats: int, warmup: int = 3) -> list[float]:
    """Median wall time (s) of each call over `repeats` rounds, after `warmup` untimed runs of each. The calls are
    timed in alternation, so a busy moment of the machine slows all of them alike, and each round starts with the
    next one, so none always runs right after the same neighbour (caches, clocks)."""
    for call in calls:
        for _ in range(warmup):
            call()
    times: list[list[float]] = [[] for _ in calls]
    for round_ in range(repeats):
        for i in range(len(calls)):
            k = (round_ + i) % len(calls)
            t0 = time.perf_counter()
            calls[k]()
            times[k].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def latency_ms(onnx_paths: list[Path], vocab: int, batch: int, seq_len: int = 128, repeats: int = 20) -> list[float]:
    """Median wall time of one ONNX Runtime forward (CPU provider) of each logits graph over `batch` x `seq_len`
    tokens (a prefill), timed in rotation after 3 warm-up runs."""
    sessions = [ort_session(p) for p in onnx_paths]
    ids = np.random.default_rng(0).integers(0, vocab, (batch, seq_len))
    return [1000 * s for s in timed_in_rotation([functools.partial(run_logits, s, ids) for s in sessions], repeats)]


class _Generation:
    """Greedy generation with a decoder graph on dstool's decode loop (dstool.decoding.engine, as the served models
    run it): each call prefills the prompts (untimed), then decodes `new_tokens` steps of one token per sequence,
    recording each step's wall time."""

    def __init__(self, session, prompt: np.ndarray, new_tokens: int):
        self.session, self.prompt, self.new_tokens = session, prompt.tolist(), new_tokens
        self.shapes = {i.name: (i.shape[1], i.shape[3]) for i in session.get_inputs()
                       if i.name.startswith("past_key_values.")}
        self.step_s: list[float] = []

    def __call__(self) -> None:
        run = engine.Engine(self.session, self.shapes, max_batch=len(self.prompt),
                            max_prefill_tokens=sum(map(len, self.prompt)))
        for b, ids in enumerate(self.prompt):
            run.add(engine.Sequence(str(b), ids, self.new_tokens + 1, lambda logits, _p, _o: int(logits.argmax()),
                                    set()))
        run.step()  # the prompts, and each one's first token
        while run.busy:
            t0 = time.perf_counter()
            run.step()
            self.step_s.append(time.perf_counter() - t0)


def decode_tokens_per_s(onnx_paths: list[Path], vocab: int, batch: int, prompt_len: int = 128, new_tokens: int = 32,
                        repeats: int = 5) -> list[float]:
    """Generation speed of each key/value-cache decoder graph: `batch` sequences of a `prompt_len`-token prompt,
    prefilled (untimed), then `repeats` generations of `new_tokens` greedy decoding steps, the graphs' generations
    in rotation (`timed_in_rotation`) after a warm-up one each. Tokens per second = batch / the median step: on a
    loaded machine a few steps wait for another process (here 1-2 ms steps, some of 12-30 ms), and the median
    leaves those out. (Rotating single steps instead measured each graph slowed by the other sessions' ONNX Runtime
    threads, which spin a while after their own run: fp32 up to 15x slower than int8 at batch 1, against 1.2-1.6x.)"""
    prompt = np.random.default_rng(0).integers(0, vocab, (batch, prompt_len))
    generations = [_Generation(ort_session(p), prompt, new_tokens) for p in onnx_paths]
    for g in generations:  # warm-up
        g()
        g.step_s.clear()
    timed_in_rotation(generations, repeats, warmup=0)
    return [batch / statistics.median(g.step_s) for g in generations]


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
