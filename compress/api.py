"""`compress(config)`: what `dstool compress` does, callable from Python.

A list of steps (`dstool.steps`), each with a correctness gate:
  baseline   fp32 ONNX of the input, both graphs (parity-checked) -> perplexity, top-1 predictions, cloze task, size
  prune      heads / MLP channels removed        gate: transformers reloads the saved folder, same logits
  sparsity   N:M magnitude masks                 gate: every group of M has >= M-N zeros
             or unstructured (a fraction)        gate: every masked weight holds that share of zeros
  recover    fine-tune with the training engine  gate: kept only if it lowers the calibration perplexity
  export     fp32 ONNX of the result: the logits graph and the key/value-cache decoder (parity-checked)
  quantize   int8 dynamic / 4-bit weight-only, the same weights recipe on both graphs
             gate: both hold integer ops, and the decoder's prefill agrees with the logits graph
  store      unstructured sparsity: bitmask + nonzero values in model/ and the fp32 graphs
             gate: the masks held through recovery; both load back to the dense logits
  measure    held-out perplexity, top-1 agreement, cloze accuracy, ONNX Runtime prefill latency and decoding
             tokens/s     gate (opt-in, --speed-gate): quantized must not be slower on that figure
  write      the manifest (dstool.json: graphs, recipe, figures, source) and report.md / report.png
The steps are objects (compress/steps.py says what each reads and writes). Everything is written to OUTPUT.tmp and
renamed into place at the end; a failed run leaves OUTPUT.tmp (with compress.log) for inspection, and the next run
replaces it.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from dstool import artifacts, gguf, models
from dstool import log as dlog
from dstool.artifacts import CompressedModel
from dstool.compress import prune, sparse
from dstool.compress.config import CompressConfig
from dstool.compress.steps import Work, plan
from dstool.errors import UsageError
from dstool.files import replace_folder
from dstool.steps import run_steps


def _check_input(cfg: CompressConfig) -> Path:
    src = Path(cfg.model)
    if not src.is_dir():
        raise UsageError(f"model {cfg.model} is not a folder: pass a Hugging Face causal-LM folder")
    models.check_model_folder(src)
    out = Path(cfg.output)
    if out.exists() and not out.is_dir():
        raise UsageError(f"output {out} is a file: pass a folder for --output")
    if out.is_dir() and any(out.iterdir()) and artifacts.kind_of(out) != "compressed-model":
        raise UsageError(f"output {out} exists and holds files dstool did not write: choose a new --output")
    _check_modes(cfg, src)
    return src


def _check_modes(cfg: CompressConfig, src: Path) -> None:
    """What the model's architecture and shapes rule out, refused before any work: read from its config (weights
    on the meta device, nothing loaded)."""

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src))
    try:
        if cfg.prunes and not prune.family_of(model).has_experts and cfg.prune_experts:
            raise ValueError(f"--prune-experts removes routed experts, and {type(model).__name__} has none: use "
                             "--prune-heads/--prune-mlp or --prune")
        if cfg.prune and not prune.candidate_layouts(model, cfg.prune):
            raise ValueError(prune.no_layout_message(cfg.prune))
        if cfg.sparsity and ":" in cfg.sparsity:
            n, m = map(int, cfg.sparsity.split(":"))
            sparse.check_n_m_fits(model, n, m)
    except ValueError as e:
        raise UsageError(str(e)) from None


def compress(cfg: CompressConfig) -> CompressedModel:
    """Run the steps; returns the manifest (also written to OUTPUT/dstool.json)."""
    cfg = cfg.model_copy(update={"model": gguf.resolve(cfg.model)})
    src = _check_input(cfg)
    out = Path(cfg.output)
    stage = out.with_name(out.name + ".tmp")
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    dlog.to_file(stage / "compress.log")
    work = Path(tempfile.mkdtemp(prefix="dstool-compress-"))
    try:
        job = Work.load(cfg, src, stage, work)
        run_steps([step.step(job) for step in plan(cfg)], "compress")
    except UsageError:
        shutil.rmtree(stage, ignore_errors=True)  # bad input: nothing written
        raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    replace_folder(stage, out)
    assert job.manifest is not None  # the write step ran
    return job.manifest
