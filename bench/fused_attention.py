"""One decoding step of the fused-attention decoder (dstool/fused_decoder.py: ONNX Runtime's GroupQueryAttention
contrib op, rotary embedding inside, packed QKV, the cache one buffer per tensor that the op updates in place)
against the exported decoder as the engine runs it (the cache concatenated into a new tensor every step).

    .venv/bin/python bench/fused_attention.py [--model tiny|bench|deepseek] [--rounds 5] [--steps 20]

Parity against transformers is printed for both graphs (the export gates). Then one decoding step, ms, at 1 and 16
rows and 128 and 512 cached positions, each graph in interleaved rounds, medians; the ratio is fused / exported
(below 1: fused is faster). `--model deepseek` (the tiny-moe preset: DeepSeek-V3's multi-head latent attention
and routed experts) has no fused graph: the exported decoder it keeps is timed alone, the fallback's cost.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def main() -> None:
    import onnxruntime as ort
    import torch
    from transformers import AutoModelForCausalLM

    from compress import build_model
    from dstool.decoding.engine import FusedRunner
    from dstool.fused_decoder import cache_buffers, export_fused_decoder, parity, unsupported
    from dstool.models import preset_config
    from dstool.onnx_export import export_decoder_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=["tiny", "bench", "deepseek"], default="bench",
                    help="tiny preset, the ~42 M Llama, or the tiny-moe preset (DeepSeek-V3)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20, help="decoding steps timed per round")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="dstool-fused-"))
    torch.manual_seed(0)
    if args.model == "bench":
        build_model(work / "model")
        model = AutoModelForCausalLM.from_pretrained(work / "model").float().eval()
    else:
        model = AutoModelForCausalLM.from_config(preset_config("tiny" if args.model == "tiny" else "tiny-moe", 4096,
                                                               {})).eval()
    cfg = model.config
    why = unsupported(cfg)
    fused_path = None if why else export_fused_decoder(model, work / "fused").path
    exported = export_decoder_model(model, work / "exported")
    print(f"parity to transformers: exported {exported.max_abs_diff:.2g}, fused "
          + (f"{parity(model, fused_path):.2g}" if fused_path else f"none ({why}): the exported decoder alone"))
    plain = ort.InferenceSession(str(exported.path), providers=["CPUExecutionProvider"])
    shapes = {i.name: (i.shape[1], i.shape[3]) for i in plain.get_inputs() if i.name.startswith("past_key_values.")}
    names = [o.name for o in plain.get_outputs()]
    print(f"model: {type(model).__name__}, {sum(p.numel() for p in model.parameters()) / 1e6:.0f} M parameters, "
          f"{cfg.num_hidden_layers} layers, {cfg.num_attention_heads} heads, cache per position per layer: "
          f"{sum(h * d for h, d in shapes.values()) // cfg.num_hidden_layers} floats")
    print(f"{'rows':>4} {'cached':>6} {'exported ms':>12} {'fused ms':>9} {'fused/exported':>15}")
    for rows in (1, 16):
        for cached in (128, 512):
            past = {n: np.random.rand(rows, heads, cached, dim).astype(np.float32)
                    for n, (heads, dim) in shapes.items()}
            one = np.ones((rows, 1), np.int64)
            feeds = {"input_ids": one, "attention_mask": np.ones((rows, cached + 1), np.int64),
                     "position_ids": one * cached, **past}
            runs = {"exported": lambda feeds=feeds: plain.run(names, feeds)}
            if fused_path:
                session = ort.InferenceSession(str(fused_path), providers=["CPUExecutionProvider"])
                runner, buffers = FusedRunner(session), cache_buffers(session, rows, cached + 64)
                held = np.full(rows, cached)
                runs["fused"] = lambda r=runner, one=one, h=held, b=buffers: r.run(one, h, b)
            times: dict[str, list[float]] = {k: [] for k in runs}
            for _ in range(args.rounds):
                for name, run in runs.items():
                    run()
                    started = time.perf_counter()
                    for _ in range(args.steps):
                        run()
                    times[name].append((time.perf_counter() - started) / args.steps * 1000)
            a = statistics.median(times["exported"])
            if fused_path:
                b = statistics.median(times["fused"])
                print(f"{rows:>4} {cached:>6} {a:>12.2f} {b:>9.2f} {b / a:>15.2f}")
            else:
                print(f"{rows:>4} {cached:>6} {a:>12.2f} {'-':>9} {'-':>15}")


if __name__ == "__main__":
    main()
