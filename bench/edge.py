"""Edge packages (`dstool export --target edge`): sizes, peak memory and tokens/s against the unsplit decoder.

    .venv/bin/python bench/edge.py [--new-tokens 32] [--rounds 3] [--layers-per-block 1] [--int8]

1. builds the ~40 M-parameter Llama model of bench/compress.py (12 layers, hidden 512; untrained weights: memory
   and speed do not depend on them), exports its key/value-cache decoder once (`dstool.onnx_export`) and cuts that
   graph into an edge package (`write_package`, what `dstool export --target edge` runs); with --int8, the
   decoder quantized as `dstool compress --bits 8` quantizes it, and its package too;
2. generates --new-tokens greedy tokens from a 24-token prompt in a fresh process per configuration, each
   configuration once per round, the rounds interleaved: the unsplit decoder graph in onnxruntime (the graph
   Triton serves; the runner's session options: no arena, no spinning), the package with every block open, one
   block open at a time (opened, run, released), and under a memory cap halfway between the peaks of those two;
   each process reports its peak resident memory over the process before the model was opened (VmHWM), its
   tokens/s (warm: after one short generation) and its tokens;
3. prints the medians, and whether every configuration generated the same tokens. "peak MB over start" is over the
   process after its imports; "(runner)" is the runner's own figure, over the process just before it opened the
   package (the tokenizer loaded, the manifest checked): what --memory-cap-mb bounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
PROMPT = "ROMEO: But soft, what light through yonder window breaks? It is the east, and Juliet is the sun."


def child(kind: str, path: str, new_tokens: int, option: float | None) -> None:
    """One configuration in this (fresh) process: JSON of its figures on stdout."""
    import time

    import numpy as np
    import onnxruntime as ort

    from dstool.serve import edge

    base = edge.rss_bytes()
    if kind == "unsplit":
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(Path(path).parent / "tokenizer.json"))
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        opts.enable_cpu_mem_arena = False  # the runner's session options, so that only the split differs
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        session = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
        names = [o.name for o in session.get_outputs()]
        cache = {i.name: (i.shape[1], i.shape[3]) for i in session.get_inputs() if i.name.startswith("past_")}

        def generate(n: int) -> list[int]:
            past = {k: np.zeros((1, h, 0, d), np.float32) for k, (h, d) in cache.items()}
            ids, done = np.asarray([tokenizer.encode(PROMPT).ids]), 0
            out: list[int] = []
            while len(out) < n:
                feeds = {"input_ids": ids, "attention_mask": np.ones((1, done + ids.shape[1]), np.int64),
                         "position_ids": np.arange(done, done + ids.shape[1], dtype=np.int64)[None], **past}
                values = dict(zip(names, session.run(names, feeds)))
                past = {k.replace("cache.", "past_key_values.", 1): v for k, v in values.items()
                        if k.startswith("cache.")}
                done += ids.shape[1]
                out.append(int(np.argmax(values["logits"][0, -1])))
                ids = np.asarray([[out[-1]]])
            return out

        generate(2)
        started = time.perf_counter()
        tokens = generate(new_tokens)
        seconds = time.perf_counter() - started
        loads, runner_peak = 0, float("nan")
    else:
        model = edge.EdgeModel(path, memory_cap_mb=option if kind == "cap" else None,
                               keep_open=1 if kind == "one-block" else None)
        model.generate(PROMPT, 2, stop_ids=set())
        result = model.generate(PROMPT, new_tokens, stop_ids=set())
        tokens, seconds, loads = result.ids, result.stats.seconds, result.stats.block_loads
        runner_peak = result.stats.peak_over_baseline_mb
    print(json.dumps({"peak_mb": (edge.peak_rss_bytes() - base) / edge.MB, "tokens_per_s": new_tokens / seconds,
                      "tokens": tokens, "block_loads": loads, "runner_peak_mb": runner_peak}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers-per-block", type=int, default=1)
    parser.add_argument("--int8", action="store_true", help="also the int8 decoder and its package")
    parser.add_argument("--work", type=Path, help="work folder; what an earlier run left there is reused")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, path, n, option = args.child
        child(kind, path, int(n), float(option) if option != "-" else None)
        return 0

    import torch
    from transformers import AutoModelForCausalLM

    from compress import build_model
    from dstool.artifacts import EdgePackage
    from dstool.onnx_export import export_decoder_model
    from dstool.serve import edge
    from dstool.serve.export.edge_package import write_package

    work = args.work or Path(tempfile.mkdtemp(prefix="dstool-bench-edge-"))
    print(f"[model] the 40 M model, its decoder graph and its edge package in {work}", flush=True)
    if not (work / "model").is_dir():
        build_model(work / "model")
    decoders = {"fp32": work / "decoder" / "model.onnx"}
    if not decoders["fp32"].is_file():
        model = AutoModelForCausalLM.from_pretrained(work / "model", dtype=torch.float32).eval()
        export_decoder_model(model, work / "decoder")
    if args.int8:
        from dstool.compress import quantize

        decoders["int8"] = work / "decoder" / "model.int8.onnx"
        if not decoders["int8"].is_file():
            quantize.quantize_int8(decoders["fp32"], decoders["int8"], quantize.int8_choice_for_this_cpu())
    for variant, decoder in decoders.items():
        (work / "decoder" / "tokenizer.json").write_bytes((work / "model" / "tokenizer.json").read_bytes())
        package = work / f"package-{variant}"
        if (package / "dstool.json").is_file():
            m = EdgePackage.read(package)
        else:
            package.mkdir(exist_ok=True)
            m = write_package(decoder, work / "model", package, args.layers_per_block)
        data = Path(str(decoder) + ".data")
        unsplit = decoder.stat().st_size + (data.stat().st_size if data.exists() else 0)
        blocks = [b.bytes for b in m.blocks]
        total = (sum(blocks) + m.resident_bytes) / edge.MB
        print(f"\n[{variant}] unsplit decoder {unsplit / edge.MB:.1f} MB; package {total:.1f} MB: "
              f"resident {m.resident_bytes / edge.MB:.1f} MB (embedding, head), {len(blocks)} blocks of "
              f"{m.layers_per_block} layer(s), {max(blocks) / edge.MB:.1f} MB each; export parity: max |logit diff| "
              f"{m.parity.max_abs_logit_diff:.2g}", flush=True)
        runs = {"unsplit": str(decoder), "all-open": str(package), "one-block": str(package), "cap": str(package)}
        figures: dict[str, list[dict]] = {k: [] for k in runs}
        cap = None
        for r in range(args.rounds):
            for kind, path in runs.items():
                option = f"{cap:.1f}" if kind == "cap" else "-"
                out = subprocess.run([sys.executable, __file__, "--child", kind, path, str(args.new_tokens), option],
                                     capture_output=True, text=True)
                if out.returncode:
                    raise SystemExit(f"{kind}: {out.stderr.strip().splitlines()[-1]}")
                figures[kind].append(json.loads(out.stdout.strip().splitlines()[-1]))
                if kind == "one-block" and cap is None:  # halfway between one block open and all of them
                    cap = (figures["one-block"][0]["runner_peak_mb"] + figures["all-open"][0]["runner_peak_mb"]) / 2
            print(f"  round {r + 1}/{args.rounds} done", flush=True)
        same = len({tuple(f["tokens"]) for runs_ in figures.values() for f in runs_}) == 1
        base = statistics.median(f["tokens_per_s"] for f in figures["unsplit"])
        print(f"  {args.new_tokens} greedy tokens after a {len(PROMPT.split())}-word prompt, medians of {args.rounds} "
              f"interleaved rounds; the same tokens everywhere: {'yes' if same else 'NO'}")
        print(f"  {'configuration':<42} {'peak MB over start':>18} {'(runner)':>8} {'tokens/s':>9} {'vs unsplit':>10} "
              f"{'loads':>6}")
        for kind, label in (("unsplit", "unsplit decoder graph (onnxruntime)"),
                            ("all-open", "package, every block open"),
                            ("one-block", "package, one block open at a time"),
                            ("cap", f"package, --memory-cap-mb {cap:.1f}")):
            peak = statistics.median(f["peak_mb"] for f in figures[kind])
            speed = statistics.median(f["tokens_per_s"] for f in figures[kind])
            loads = statistics.median(f["block_loads"] for f in figures[kind])
            runner = statistics.median(f["runner_peak_mb"] for f in figures[kind])
            print(f"  {label:<42} {peak:>18.1f} {runner:>8.1f} {speed:>9.2f} {speed / base:>9.2f}x {loads:>6.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
