"""The one ONNX exporter of dstool (used by `compress` and `export`): transformers' own exporter,
dynamic batch and sequence axes, weights in a `model.onnx.data` sidecar (no 2 GB protobuf limit),
and a parity gate against PyTorch on a shape other than the one traced."""

from __future__ import annotations

import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch


class ParityError(RuntimeError):
    """ONNX Runtime's logits disagree with PyTorch's beyond the tolerance."""


@dataclass
class OnnxExport:
    path: Path
    max_abs_diff: float
    inputs: list[str]
    outputs: list[str]


def export_logits_model(model, out_dir: Path, tolerance: float = 1e-3) -> OnnxExport:
    """Export `model` (a transformers causal LM, fp32, eval) as `out_dir/model.onnx`: input_ids and
    attention_mask [batch, seq] -> logits [batch, seq, vocab]; verified against PyTorch."""
    from transformers.exporters.configs import OnnxConfig
    from transformers.exporters.exporter_onnx import OnnxExporter
    from transformers.utils import logging as transformers_logging

    model = model.eval()
    model.config.use_cache = False
    vocab = model.config.vocab_size
    sample = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    axes = {0: torch.export.Dim.DYNAMIC, 1: torch.export.Dim.DYNAMIC}  # batch, sequence; nothing else varies
    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            exported = OnnxExporter().export(
                model, {"input_ids": sample, "attention_mask": torch.ones_like(sample)},
                config=OnnxConfig(dynamic=True, dynamic_shapes={"input_ids": axes, "attention_mask": axes}))
            exported.save_pretrained(str(tmp))
    finally:
        transformers_logging.set_verbosity(verbosity)
    diff = parity(model, tmp / "model.onnx")
    if not diff <= tolerance:
        raise ParityError(f"ONNX export disagrees with PyTorch: max |logit diff| {diff:.3g} > {tolerance}")
    session = ort_session(tmp / "model.onnx")
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return OnnxExport(out_dir / "model.onnx", diff, [i.name for i in session.get_inputs()],
                      [o.name for o in session.get_outputs()])


def ort_session(path: Path, threads: int | None = None):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    if threads:
        opts.intra_op_num_threads = threads
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def run_logits(session, input_ids: np.ndarray) -> np.ndarray:
    feeds = {"input_ids": input_ids.astype(np.int64)}
    if any(i.name == "attention_mask" for i in session.get_inputs()):
        feeds["attention_mask"] = np.ones_like(feeds["input_ids"])
    return session.run(["logits"], feeds)[0]


def parity(model, onnx_path: Path) -> float:
    """max |logits(ONNX Runtime) - logits(PyTorch)| on a batch/sequence shape unlike the traced one."""
    ids = torch.randint(0, model.config.vocab_size, (3, 37), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(input_ids=ids).logits.float().numpy()
    return float(np.abs(run_logits(ort_session(onnx_path), ids.numpy()) - ref).max())
