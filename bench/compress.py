"""Compression benchmark on a model big enough for the matmuls to dominate (~42 M parameters).

    .venv/bin/python bench/compress.py [--train-steps 200] [--recover-steps 120] [--model RUN/model]
                                       [--moe-train-steps 200]

1. builds a 12-layer Llama-architecture model (hidden 512, GQA 8/4 heads), trains it with `dstool train`
   (2 ranks) so perplexity means something (or takes `--model`, a `dstool train` model/);
2. `dstool compress` on it: `--bits 8`, `--bits 4`, and `--prune 0.4 --recover-steps N` three ways: the
   default (the fastest layout within 50 % calibration perplexity), that with `--distill`, and the lowest-loss
   layout (`--prune-ppl-tolerance 0`); and `--sparsity 0.65 --recover-steps N` (unstructured, stored as bitmask +
   nonzero values: its stored sizes against fp32 are printed);
2b. the DeepSeek-V3 MoE preset (`tiny-moe`) trained by `dstool train` `--moe-train-steps` steps, then `--bits 8`,
   `--prune 0.4` and `--sparsity 2:4` (recovered) on it: the "MoE" rows;
3. a control: the unpruned model fine-tuned the same N steps, so the pruned models' perplexity can be read
   against what the recovery training alone gives;
4. side by side, on the same fp32 ONNX file from dstool's exporter: Hugging Face Optimum's
   ORTQuantizer (run in bench/.optimum-venv, since optimum-onnx needs transformers<4.58) and
   dstool's int8 (the choice `dstool compress --bits 8` made), latencies measured interleaved in one process.
Targets (issue #3): int8 size <= 0.27x, >= 2x faster at batch 8, perplexity +<= 1 %, at least as fast and
accurate as Optimum; 40 % pruning >= 1.6x faster, perplexity +<= 5 % after recovery; 65 % unstructured sparsity:
stored size <= 0.5x of fp32, perplexity +<= 5 % after recovery.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def sh(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "dstool.cli", *args], check=True, stdout=subprocess.DEVNULL)


def build_model(folder: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from dstool.corpus import read_documents
    from dstool.train import data

    tok = data.train_tokenizer(read_documents(None), 4096)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=512, intermediate_size=1536, num_hidden_layers=12,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
                      tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, architectures=["LlamaForCausalLM"])
    LlamaForCausalLM(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)


def optimum_side_by_side(model_dir: Path, int8, heldout, work: Path) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from dstool.compress import measure, quantize
    from dstool.onnx_export import export_logits_model

    fp32 = export_logits_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), work / "fp32")
    choice = quantize.int8_choice_for_this_cpu()
    choice.activation_matmuls = bool(int8.recipe.quantization.activation_matmuls)  # as compress chose
    ours = quantize.quantize_int8(fp32.path, work / "dstool_int8.onnx", choice)
    venv_py = HERE / ".optimum-venv" / "bin" / "python"
    paths = {"fp32": fp32.path, "dstool int8": ours}
    if venv_py.exists():
        subprocess.run([str(venv_py), str(HERE / "_optimum_quantize.py"), str(fp32.path.parent), str(work / "opt")],
                       check=True)
        paths["Optimum ORTQuantizer int8"] = next((work / "opt").glob("*quantized*.onnx"))
    else:
        print("bench/.optimum-venv missing: create it with "
              "`python3 -m venv bench/.optimum-venv && bench/.optimum-venv/bin/pip install torch==2.13.0 "
              "'optimum-onnx[onnxruntime]'` to include Optimum")
    # dstool's file timed twice, in two sessions: the spread between those is this run's timing noise
    paths["dstool int8, second session"] = ours
    vocab = AutoModelForCausalLM.from_pretrained(model_dir).config.vocab_size
    lat = {b: measure.latency_ms(list(paths.values()), vocab, b, repeats=30) for b in (1, 8)}
    rows = {}
    for i, (name, path) in enumerate(paths.items()):
        rows[name] = {"bytes": measure.onnx_bytes(path), "perplexity": measure.perplexity_onnx(path, heldout),
                      "latency_ms_batch1": lat[1][i], "latency_ms_batch8": lat[8][i]}
    if "Optimum ORTQuantizer int8" in paths:
        rows["Optimum ORTQuantizer int8"]["same_graph"] = same_graph(ours, paths["Optimum ORTQuantizer int8"])
    return rows


def same_graph(a: Path, b: Path) -> bool:
    """The same nodes (op, inputs, outputs, attributes) and the same initializers, per-node metadata aside."""
    import onnx

    def content(path: Path):
        model = onnx.load(str(path))
        for node in model.graph.node:
            del node.metadata_props[:]
            node.name = ""
        return ([n.SerializeToString() for n in model.graph.node],
                sorted(i.SerializeToString() for i in model.graph.initializer))

    return content(a) == content(b)


MODES = {"int8": ["--bits", "8"], "int4": ["--bits", "4"],
         "prune 0.4 (default: fastest within 50 %) + recovery": ["--prune", "0.4"],
         "prune 0.4 (default) + distilled recovery": ["--prune", "0.4", "--distill"],
         "prune 0.4 (lowest-loss layout, --prune-ppl-tolerance 0) + recovery": ["--prune", "0.4",
                                                                                "--prune-ppl-tolerance", "0"],
         "sparsity 0.65 (unstructured) + recovery": ["--sparsity", "0.65"]}
# The DeepSeek-V3 MoE preset, trained here by `dstool train` (issue 17's MoE targets: int8 <= 0.30x, +<= 1 %, >= 1.5x)
MOE_MODES = {"MoE int8": ["--bits", "8"], "MoE prune 0.4 (experts' channels, MLA heads) + recovery": ["--prune", "0.4"],
             "MoE sparsity 2:4 (expert weights too) + recovery": ["--sparsity", "2:4"]}
PRUNED = [name for name, args in MODES.items() if "--prune" in args]
SPARSE = [name for name, args in MODES.items() if "--sparsity" in args]


def recovery_control(model_dir: Path, steps: int, heldout, work: Path) -> float:
    """Held-out perplexity of the unpruned model after the recovery fine-tuning alone (same steps, same lr)."""
    import torch
    from transformers import AutoModelForCausalLM

    from dstool.compress import CompressConfig, measure
    from dstool.compress.steps import recovery_train_config
    from dstool.train import train

    lr = CompressConfig.model_fields["recover_lr"].default
    run = train(recovery_train_config(model_dir, work, steps, lr))
    return measure.perplexity_torch(AutoModelForCausalLM.from_pretrained(run.model_dir, dtype=torch.float32).eval(),
                                    heldout)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train-steps", type=int, default=200)
    p.add_argument("--recover-steps", type=int, default=120)
    p.add_argument("--model", help="a `dstool train` model/ folder to use instead of building and training one")
    p.add_argument("--keep", help="keep the work folder here")
    p.add_argument("--moe-train-steps", type=int, default=200, help="train the tiny-moe preset this long and compress "
                   "it too (0: skip the MoE rows)")
    a = p.parse_args()
    work = Path(a.keep) if a.keep else Path(tempfile.mkdtemp(prefix="dstool-bench-compress-"))
    work.mkdir(parents=True, exist_ok=True)
    from dstool.artifacts import CompressedModel

    reports: dict[str, CompressedModel] = {}
    try:
        if a.model:
            model_dir = Path(a.model)
        else:
            build_model(work / "init")
            sh("train", "--model", str(work / "init"), "--output", str(work / "run"), "--nproc", "2",
               "--max-steps", str(a.train_steps), "--save-every", str(a.train_steps), "--seq-len", "128",
               "--micro-batch-size", "8", "--lr", "1e-3", "--no-tensorboard", "--resume", "none")
            model_dir = work / "run" / "model"
        for i, (name, args) in enumerate(MODES.items()):
            recover = ["--recover-steps", str(a.recover_steps)] if name in PRUNED + SPARSE else []
            sh("compress", str(model_dir), *args, *recover, "--output", str(work / f"mode{i}"))
            reports[name] = CompressedModel.read(work / f"mode{i}")
        if a.moe_train_steps:
            sh("train", "--model", "tiny-moe", "--output", str(work / "moe"), "--nproc", "2", "--max-steps",
               str(a.moe_train_steps), "--save-every", str(a.moe_train_steps), "--seq-len", "128",
               "--micro-batch-size", "8", "--no-tensorboard", "--resume", "none")
            for i, (name, args) in enumerate(MOE_MODES.items()):
                recover = ["--recover-steps", str(a.recover_steps)] if "--bits" not in args else []
                sh("compress", str(work / "moe" / "model"), *args, *recover, "--output", str(work / f"moe{i}"))
                reports[name] = CompressedModel.read(work / f"moe{i}")
        from transformers import AutoTokenizer

        from dstool.compress import measure

        _, heldout, _ = measure.heldout_tokens(model_dir, AutoTokenizer.from_pretrained(model_dir), None)
        control = recovery_control(model_dir, a.recover_steps, heldout, work / "control")
        side = optimum_side_by_side(model_dir, reports["int8"], heldout, work / "side")
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)

    from dstool.compress.report import recipe_lines

    print(f"\nmodel: {reports['int8'].figures.before.parameters:,} parameters")
    print("| mode | size | perplexity | top-1 agreement | cloze accuracy | speed-up: prefill b1 | prefill b8 | "
          "decode b1 | decode b16 | decode tokens/s b1, b16 (fp32 -> after) | choice |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for name, m in reports.items():
        f, chosen = m.figures, recipe_lines(m.recipe)[0].split(";")[0]
        fb, fa = f.before, f.after
        print(f"| dstool {name} | {f.compression_ratio:.3f}x | {f.perplexity_change_pct:+.2f} % | "
              f"{f.top1_agreement:.1%} | {fb.zero_shot_accuracy:.1%} -> {fa.zero_shot_accuracy:.1%} | "
              f"{f.speedup['1']:.2f}x | {f.speedup['8']:.2f}x | {f.decode_speedup['1']:.2f}x | "
              f"{f.decode_speedup['16']:.2f}x | {fb.decode_tokens_per_s_batch1:.0f} -> "
              f"{fa.decode_tokens_per_s_batch1:.0f}, {fb.decode_tokens_per_s_batch16:.0f} -> "
              f"{fa.decode_tokens_per_s_batch16:.0f} | {chosen} |")
    base_ppl = reports["int8"].figures.before.perplexity
    print(f"\ncontrol, unpruned + the same {a.recover_steps} recovery steps: perplexity {base_ppl:.3f} -> "
          f"{control:.3f} ({100 * (control / base_ppl - 1):+.2f} %); pruned or sparse, against this control: "
          + ", ".join(f"{name} {100 * (reports[name].figures.after.perplexity / control - 1):+.2f} %"
                      for name in PRUNED + SPARSE))
    for name in SPARSE:
        s = reports[name].recipe.sparsity
        t = s.storage
        print(f"\n{name}: {s.decoder_zero_share:.1%} of the decoder Linear weights zero ({s.total_zero_share:.1%} of "
              f"all parameters), held-out perplexity {s.perplexity_masked:.3f} before recovery; stored: model/ "
              f"{t.model_bytes / t.model_dense_bytes:.3f}x of fp32, " + ", ".join(
                  f"{role} graph {t.onnx_bytes[role] / t.onnx_dense_bytes[role]:.3f}x" for role in t.onnx_bytes)
              + "; kernels: dense (ONNX Runtime rebuilds the dense weights at session load)")
    base = side["fp32"]
    print("\nsame fp32 ONNX, quantized two ways (latencies interleaved in one process):")
    print("| | size | perplexity | batch 1 ms | batch 8 ms |")
    print("|---|---:|---:|---:|---:|")
    for name, r in side.items():
        print(f"| {name} | {r['bytes'] / base['bytes']:.3f}x | {r['perplexity']:.3f} | {r['latency_ms_batch1']:.2f} | "
              f"{r['latency_ms_batch8']:.2f} |")
    i8 = reports["int8"].figures
    checks = [("int8 size <= 0.27x", i8.compression_ratio <= 0.27),
              ("int8 >= 2x faster at batch 8", i8.speedup["8"] >= 2),
              ("int8 perplexity +<= 1 %", i8.perplexity_change_pct <= 1),
              ("int4 decodes faster than fp32 at batch 1 (the default speed gate)",
               reports["int4"].figures.decode_speedup["1"] > 1)]
    for name in PRUNED:
        f = reports[name].figures
        checks += [(f"{name}: perplexity +<= 5 %", f.perplexity_change_pct <= 5)]
        if "lowest-loss" not in name:  # the speed target is the default layout's; lowest-loss is the reference
            checks += [(f"{name}: >= 1.6x faster (batch 8)", f.speedup["8"] >= 1.6)]
    for name in SPARSE:
        t = reports[name].recipe.sparsity.storage
        largest = max([t.model_bytes / t.model_dense_bytes]
                      + [t.onnx_bytes[role] / t.onnx_dense_bytes[role] for role in t.onnx_bytes])
        checks += [(f"{name}: stored size <= 0.5x of fp32 (model/ and both graphs)", largest <= 0.5),
                   (f"{name}: perplexity +<= 5 %", reports[name].figures.perplexity_change_pct <= 5)]
    if "Optimum ORTQuantizer int8" in side:
        opt, ours, again = side["Optimum ORTQuantizer int8"], side["dstool int8"], side["dstool int8, second session"]
        noise = abs(ours["latency_ms_batch8"] - again["latency_ms_batch8"])
        print(f"\nOptimum's file is {'the same graph as' if opt['same_graph'] else 'a different graph from'} "
              f"dstool's; the same file timed in two sessions differed by {noise:.2f} ms at batch 8")
        checks += [("dstool int8 at least as fast as Optimum (batch 8, within the same-file spread)",
                    ours["latency_ms_batch8"] <= opt["latency_ms_batch8"] + noise),
                   ("dstool int8 at least as accurate as Optimum", ours["perplexity"] <= opt["perplexity"]),
                   ("dstool int8 no larger than Optimum's", ours["bytes"] <= opt["bytes"])]
    for label, ok in checks:
        print(f"{'PASS' if ok else 'MISS'}  {label}")


if __name__ == "__main__":
    main()
