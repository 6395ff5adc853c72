"""Quantization quality on the real model, side by side in one run: dstool's ONNX Runtime recipes and llama.cpp's own
formats of the same weights (SmolLM2-135M-Instruct), each as perplexity on the same held-out text by the same
protocol as llama-perplexity (chunks of --ctx tokens, the second half of each scored), and recovery = the engine's
own full-precision perplexity / the variant's x 100.

    .venv/bin/python bench/real_quantization.py [--peers /work/peers] [--text sotu|shakespeare|FILE] [--ctx 512]
        [--int4 rtn|gptq|both] [--no-llama-cpp]

dstool's rows: the fp32 logits graph `dstool compress` exports, then each recipe of compress/quantize.py on it
(weight-only int8 group 128, the default; dynamic int8, the earlier default; 4-bit asymmetric groups 128 and 32 and
symmetric group 32, rounded to nearest; with --int4 gptq or both, 4-bit asymmetric groups 128 and 32 by GPTQ
(compress/gptq.py), calibrated as `dstool compress --int4 gptq` calibrates: on its calibration split of the embedded
corpus, never on the text measured here). llama.cpp's rows (left out with --no-llama-cpp): bench/llama_cpp_quality.py's
files (F32 from dstool's fp32 folder by llama.cpp's convert_hf_to_gguf.py; Q8_0, Q4_K_M, Q4_0 by llama-quantize; the
shipped Q4_1) scored by llama-perplexity. Each engine tokenizes the text itself (the same BPE vocabulary): compare
recoveries across engines, perplexities within one.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llama_cpp_quality as lcq  # noqa: E402  (bench/ is not a package)


def chunk_perplexity(onnx_path: Path, ids: np.ndarray, ctx: int, batch: int = 4) -> float:
    """llama-perplexity's protocol on an ONNX logits graph: non-overlapping chunks of `ctx` tokens, the negative
    log-likelihood of the second half of each."""
    import torch

    from dstool.onnx_export import ort_session, run_logits

    chunks = ids[: len(ids) // ctx * ctx].reshape(-1, ctx)
    session, nll, count = ort_session(onnx_path), 0.0, 0
    for i in range(0, len(chunks), batch):
        part = chunks[i:i + batch]
        logits = torch.from_numpy(run_logits(session, part)).float()
        first = ctx // 2
        logp = logits[:, first - 1:-1].log_softmax(-1)
        target = torch.from_numpy(part[:, first:])
        nll -= float(logp.gather(-1, target.unsqueeze(-1)).sum())
        count += target.numel()
    return float(np.exp(nll / count))


def dstool_rows(hf: Path, text_file: Path, ctx: int, work: Path, int4: str = "both") -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dstool.compress import gptq, quantize
    from dstool.compress.measure import heldout_tokens, onnx_bytes
    from dstool.onnx_export import export_logits_model

    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    fp32 = export_logits_model(model, work / "logits").path
    tokenizer = AutoTokenizer.from_pretrained(hf)
    calibration = heldout_tokens(hf, tokenizer, None)[0]  # what `dstool compress` calibrates on
    ids = np.asarray(tokenizer(text_file.read_text(), add_special_tokens=False)["input_ids"])

    def by_gptq(block: int, out: Path) -> Path:
        started = time.perf_counter()
        codes = gptq.quantize_model(model, calibration, block)
        print(f"  GPTQ group {block}: {time.perf_counter() - started:.0f} s", flush=True)
        return quantize.quantize_nbits_precomputed(fp32, out, block, codes)[0]

    recipes = {
        "fp32": lambda: fp32,
        "int8 weight-only g128 (default)": lambda: quantize.quantize_nbits(fp32, work / "w8.onnx", 8, 128, True, 4),
        "int8 dynamic (per-tensor activations)": lambda: quantize.quantize_int8(
            fp32, work / "dyn.onnx", quantize.int8_choice_for_this_cpu()),
    }
    if int4 in ("rtn", "both"):
        recipes.update({
            "4-bit asymmetric g128, round-to-nearest": lambda: quantize.quantize_nbits(
                fp32, work / "w4a128.onnx", 4, 128, False),
            "4-bit asymmetric g32, round-to-nearest": lambda: quantize.quantize_nbits(
                fp32, work / "w4a32.onnx", 4, 32, False),
            "4-bit symmetric g32, round-to-nearest": lambda: quantize.quantize_nbits(
                fp32, work / "w4s32.onnx", 4, 32, True)})
    if int4 in ("gptq", "both"):
        recipes.update({"4-bit asymmetric g128, GPTQ": lambda: by_gptq(128, work / "gptq128.onnx"),
                        "4-bit asymmetric g32, GPTQ": lambda: by_gptq(32, work / "gptq32.onnx")})
    rows = []
    for label, make in recipes.items():
        path = make()
        started = time.perf_counter()
        ppl = chunk_perplexity(path, ids, ctx)
        rows.append({"engine": "dstool (ONNX Runtime)", "format": label, "ppl": ppl, "bytes": onnx_bytes(path),
                     "seconds": time.perf_counter() - started, "tokens": len(ids)})
        print(f"  dstool {label}: perplexity {ppl:.4f}", flush=True)
    return rows


def llama_rows(peers: Path, text_file: Path, ctx: int, work: Path) -> list[dict]:
    rows = []
    for label, path in lcq.models(peers).items():
        got = lcq.perplexity(peers, path, text_file, ctx, os.cpu_count() or 1, work / f"ppl-{label}.log")
        rows.append({"engine": "llama.cpp", "format": label, "ppl": got["ppl"], "bytes": path.stat().st_size,
                     "seconds": got["seconds"], "tokens": None})
        print(f"  llama.cpp {label}: perplexity {got['ppl']:.4f}", flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", type=Path, default=Path("/work/peers"))
    ap.add_argument("--text", default="sotu")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--int4", choices=("rtn", "gptq", "both"), default="both",
                    help="dstool's 4-bit rows: round-to-nearest, GPTQ, or both")
    ap.add_argument("--no-llama-cpp", action="store_true", help="dstool's rows only (no llama.cpp build needed)")
    args = ap.parse_args()
    _, hf = lcq.real_model()
    text_file, what = lcq.text(args.text, args.peers)
    print(f"text: {what}; ctx {args.ctx}, second half of each chunk scored; CPU: {lcq.cpu()}; llama.cpp "
          f"{'not run' if args.no_llama_cpp else lcq.version(args.peers)}", flush=True)
    with tempfile.TemporaryDirectory(prefix="dstool-real-quant-") as tmp:
        rows = dstool_rows(hf, text_file, args.ctx, Path(tmp), args.int4)
        if not args.no_llama_cpp:
            rows += llama_rows(args.peers, text_file, args.ctx, Path(tmp))
    print("\n| engine | format | perplexity | recovery | size |\n|---|---|---:|---:|---:|")
    for engine in ("dstool (ONNX Runtime)", "llama.cpp"):
        mine = [r for r in rows if r["engine"] == engine]
        if not mine:
            continue
        base = mine[0]["ppl"]  # fp32 / F32 first
        for r in mine:
            print(f"| {engine} | {r['format']} | {r['ppl']:.4f} | {100 * base / r['ppl']:.2f} % | "
                  f"{r['bytes'] / 1e6:.1f} MB |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
