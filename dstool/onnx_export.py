"""The one ONNX exporter of dstool (used by `compress` and `export`): transformers' own exporter,
dynamic shapes, weights in a `model.onnx.data` sidecar (no 2 GB protobuf limit), and a parity gate
against PyTorch on shapes other than the ones traced.

Two graphs:
  logits model    input_ids, attention_mask [batch, seq] -> logits [batch, seq, vocab]
  decoder model   the same plus position_ids and the key/value cache of the tokens before
                  (`past_key_values.layers.I.{keys,values}` [batch, kv_heads, past, head_dim]) -> logits
                  and the grown cache (`cache.layers.I.{keys,values}`). With an empty cache (past = 0)
                  it is the prefill, with one new token a decoding step: no prefix is recomputed.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import onnx
import onnxruntime as ort
import torch

from dstool import log as dlog
from dstool.errors import StageFailed
from dstool.files import replace_folder


class ParityError(StageFailed):
    """ONNX Runtime's logits disagree with PyTorch's beyond the tolerance."""


RELATIVE = 1e-4  # of the largest |logit|: fp32 kernels' rounding grows with the logits' scale (docs/export-serve.md)


class Parity(NamedTuple):
    """max |logit diff| between ONNX Runtime and PyTorch, and the largest |logit| PyTorch gave."""

    diff: float
    scale: float

    def check(self, tolerance: float, what: str) -> None:
        """Pass when diff <= tolerance + RELATIVE x scale (numpy's allclose rule on the worst logit)."""
        allowed = tolerance + RELATIVE * self.scale
        if not self.diff <= allowed:
            raise ParityError(f"{what} disagrees with PyTorch: max |logit diff| {self.diff:.3g} > {allowed:.3g} "
                              f"({tolerance:g} + {RELATIVE:g} x the largest |logit| {self.scale:.3g})")


@dataclass
class OnnxExport:
    path: Path
    max_abs_diff: float
    inputs: list[str]
    outputs: list[str]


def _export(model, sample: dict, dynamic_shapes: dict | None, out_dir: Path, check, tolerance: float) -> OnnxExport:
    """Run transformers' OnnxExporter into OUT.tmp, gate with `check(path) -> max diff`, rename to `out_dir`."""
    from transformers.exporters.configs import OnnxConfig  # noqa: PLC0415 (transformers' exporters: 2.6 s and torchao's warnings, only when exporting)
    from transformers.exporters.exporter_onnx import OnnxExporter  # noqa: PLC0415 (transformers' exporters: 2.6 s and torchao's warnings, only when exporting)

    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    dlog.adopt_libraries()  # torch.onnx's registration warnings and the exporter's notes: to the log file
    config = OnnxConfig(dynamic=True, dynamic_shapes=dynamic_shapes) if dynamic_shapes else OnnxConfig(dynamic=True)
    with dlog.captured_stdout("torch.onnx"):  # "[torch.onnx] Run decompositions..." progress lines
        OnnxExporter().export(model, sample, config=config).save_pretrained(str(tmp))
    measured = check(tmp / "model.onnx")
    measured.check(tolerance, "ONNX export")
    session = ort_session(tmp / "model.onnx")
    replace_folder(tmp, out_dir)
    return OnnxExport(out_dir / "model.onnx", measured.diff, [i.name for i in session.get_inputs()],
                      [o.name for o in session.get_outputs()])


def export_logits_model(model, out_dir: Path, tolerance: float = 1e-3) -> OnnxExport:
    """Export `model` (a transformers causal LM, fp32, eval) as `out_dir/model.onnx`: input_ids and
    attention_mask [batch, seq] -> logits [batch, seq, vocab]; verified against PyTorch."""
    model = model.eval()
    model.config.use_cache = False
    sample = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    axes = {0: torch.export.Dim.DYNAMIC, 1: torch.export.Dim.DYNAMIC}  # batch, sequence; nothing else varies
    return _export(model, {"input_ids": sample, "attention_mask": torch.ones_like(sample)},
                   {"input_ids": axes, "attention_mask": axes}, out_dir, lambda p: parity(model, p), tolerance)


def export_decoder_model(model, out_dir: Path, tolerance: float = 1e-3) -> OnnxExport:
    """Export `model` with key/value-cache inputs and outputs (the `-with-past` decoder) as
    `out_dir/model.onnx`; verified against PyTorch on a prefill and on single-token decoding steps."""
    model = model.eval()
    ids = torch.randint(0, model.config.vocab_size, (3, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache = model(input_ids=ids[:, :5], use_cache=True).past_key_values
    sample = {"input_ids": ids[:, 5:], "attention_mask": torch.ones_like(ids),
              "position_ids": torch.arange(5, 8).expand(3, 3), "past_key_values": cache, "use_cache": True}
    return _export(model, sample, _decoder_dynamic_shapes(sample), out_dir,
                   lambda p: decoder_parity(model, _pin_numeric_dims(p)), tolerance)


def _decoder_dynamic_shapes(sample: dict) -> dict:
    """Only the axes that vary: batch and new tokens of the ids, batch and length of the mask, batch and past
    length of every cache tensor (heads and head size are fixed, so the graph says so; docs/export-serve.md has
    its export time against torch.export inferring every axis)."""
    from transformers.exporters.exporter_dynamo import get_auto_dynamic_shapes  # noqa: PLC0415 (transformers' exporters: 2.6 s and torchao's warnings, only when exporting)

    dynamic = torch.export.Dim.DYNAMIC

    def cache_axes(spec):  # the cache's structure as the exporter flattens it, every tensor [batch, heads, past, dim]
        if isinstance(spec, dict):
            return {0: dynamic, 2: dynamic}
        return type(spec)(cache_axes(s) for s in spec) if isinstance(spec, (list, tuple)) else spec

    two = {0: dynamic, 1: dynamic}
    return {"input_ids": two, "attention_mask": two, "position_ids": two,
            "past_key_values": cache_axes(get_auto_dynamic_shapes(sample["past_key_values"]))}


def _pin_numeric_dims(onnx_path: Path) -> Path:
    """torch.export names fixed axes of a cache input after their size ("2"): make them real static dims,
    so that the graph says how many key/value heads and which head size the cache has."""
    graph_model = onnx.load(str(onnx_path), load_external_data=False)
    for value in graph_model.graph.input:
        for dim in value.type.tensor_type.shape.dim:
            if dim.HasField("dim_param") and dim.dim_param.isdigit():
                dim.dim_value = int(dim.dim_param)
    onnx.save(graph_model, str(onnx_path))  # the weights stay in the .data file the graph refers to
    return onnx_path


def ort_session(path: Path, threads: int | None = None):
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


def empty_cache(session, batch: int) -> dict[str, np.ndarray]:
    """The decoder model's cache inputs for a prefill: [batch, kv_heads, 0, head_dim] zeros."""
    return {i.name: np.zeros((batch, i.shape[1], 0, i.shape[3]), np.float32)
            for i in session.get_inputs() if i.name.startswith("past_key_values.")}


def run_decoder(session, input_ids: np.ndarray, past: dict[str, np.ndarray], past_len: int):
    """One decoder-model call on `input_ids` after `past_len` cached tokens: (logits, the grown cache)."""
    batch, seq = input_ids.shape
    positions = np.broadcast_to(np.arange(past_len, past_len + seq), (batch, seq)).astype(np.int64)
    feeds = {"input_ids": input_ids.astype(np.int64), "attention_mask": np.ones((batch, past_len + seq), np.int64),
             "position_ids": positions, **past}
    names = [o.name for o in session.get_outputs()]
    values = session.run(names, feeds)
    cache = {n.replace("cache.", "past_key_values.", 1): v for n, v in zip(names, values) if n.startswith("cache.")}
    return values[names.index("logits")], cache


def parity(model, onnx_path: Path) -> Parity:
    """max |logits(ONNX Runtime) - logits(PyTorch)| on a batch/sequence shape unlike the traced one."""
    ids = torch.randint(0, model.config.vocab_size, (3, 37), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(input_ids=ids).logits.float().numpy()
    return Parity(float(np.abs(run_logits(ort_session(onnx_path), ids.numpy()) - ref).max()), float(np.abs(ref).max()))


def decoder_parity(model, onnx_path: Path) -> Parity:
    """Prefill 11 tokens on an empty cache, then 3 single-token steps: max |logit diff| to PyTorch's
    logits for the whole 14-token sequence."""
    ids = torch.randint(0, model.config.vocab_size, (3, 14), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(input_ids=ids).logits.float().numpy()
    session = ort_session(onnx_path)
    logits, cache = run_decoder(session, ids[:, :11].numpy(), empty_cache(session, 3), 0)
    diffs = [np.abs(logits - ref[:, :11]).max()]
    for t in range(11, 14):
        logits, cache = run_decoder(session, ids[:, t:t + 1].numpy(), cache, t)
        diffs.append(np.abs(logits[:, 0] - ref[:, t]).max())
    return Parity(float(max(diffs)), float(np.abs(ref).max()))
