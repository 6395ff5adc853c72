"""What one DeepSeek-V3 multi-token-prediction layer costs in training: tokens/s of `dstool train` with --mtp-layers 0
and 1 on the same DeepSeek-V3-shaped model, data, ranks, ZeRO stage, batch and steps, interleaved rounds, medians,
and the ratio; beside it the ratio the matmul FLOPs predict (an MTP depth runs one more decoder layer, eh_proj and
the output head once more).

    .venv/bin/python bench/mtp.py [--layers 3] [--nproc 1] [--zero 1] [--seq-len 128] [--micro-batch-size 4]
        [--steps 12] [--rounds 2]

The model is the tiny-moe preset's shape (MLA attention, hidden 192, one dense layer then MoE layers of 4 routed
experts, top-2, one shared expert) with --layers decoder layers, random weights; the tokenizer a 4,096-entry BPE
trained on the embedded corpus. Tokens/s: the median of the metrics rows after the first two of every run of that
setting (the main model's tokens: the MTP depth adds work, not tokens). Anchor: marin#5772 measured -20 % tokens/s
for one MTP layer.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def _model(folder: Path, layers: int) -> tuple[float, str]:
    """Write the model folder; (the matmul-FLOPs ratio with/without one MTP depth, a one-line description)."""
    import torch
    from transformers import AutoModelForCausalLM

    from dstool import models
    from dstool.corpus import read_documents
    from dstool.train import data, mtp

    tok = data.train_tokenizer(read_documents(None), 4096)
    config = models.preset_config("tiny-moe", len(tok), {"eos_token_id": tok.eos_token_id,
                                                         "pad_token_id": tok.pad_token_id})
    config.num_hidden_layers = layers
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    _, active = models.count_parameters(model)
    embedding = config.vocab_size * config.hidden_size
    with torch.device("meta"):
        extended = AutoModelForCausalLM.from_config(config)
        mtp.attach(extended, 1)
    _, active_mtp = models.count_parameters(extended)
    main = active - embedding  # matmul parameters per token: the layers and the head
    with_mtp = active_mtp - embedding + config.vocab_size * config.hidden_size  # + the shared head run again
    return with_mtp / main, (f"DeepSeek-V3 shape: {layers} decoder layers (1 dense, {layers - 1} MoE x 4 experts "
                             f"top-2 + 1 shared), hidden 192, MLA, vocab {config.vocab_size}; {active / 1e6:.2f} M "
                             "active parameters per token")


def run(a, model: Path, mtp_layers: int, out: Path) -> list[float]:
    cmd = [sys.executable, "-m", "dstool.cli", "train", "--output", str(out), "--model", str(model), "--nproc",
           str(a.nproc), "--zero", str(a.zero), "--max-steps", str(a.steps), "--save-every", str(a.steps),
           "--log-every", "1", "--seq-len", str(a.seq_len), "--micro-batch-size", str(a.micro_batch_size),
           "--eval-batches", "1", "--no-tensorboard", "--resume", "none", "--mtp-layers", str(mtp_layers)]
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["tokens_per_s"] for r in rows if "tokens_per_s" in r][2:]


def _cpu() -> str:
    try:
        names = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")]
        return f"{names[0]} x {len(names)}" if names else platform.processor()
    except OSError:
        return platform.processor()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=3, help="decoder layers of the main model (tiny-moe: 3)")
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--zero", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args()
    rates: dict[int, list[float]] = {0: [], 1: []}
    with tempfile.TemporaryDirectory(prefix="dstool-bench-mtp-") as tmp:
        root = Path(tmp)
        flops_ratio, description = _model(root / "model", a.layers)
        for r in range(a.rounds):
            for depth in (0, 1):
                rates[depth].extend(run(a, root / "model", depth, root / f"mtp{depth}-{r}"))
    print(description)
    print(f"{a.nproc} rank(s), ZeRO-{a.zero}, fp32, micro-batch {a.micro_batch_size} x {a.seq_len} tokens, "
          f"{a.steps} steps x {a.rounds} rounds, interleaved; CPU: {_cpu()}")
    base = statistics.median(rates[0])
    print(f"{'MTP layers':>10s} {'tokens/s (median)':>18s} {'rows':>5s} {'vs 0':>7s}")
    for depth in (0, 1):
        rate = statistics.median(rates[depth])
        print(f"{depth:>10d} {rate:18.0f} {len(rates[depth]):5d} {rate / base:6.3f}x")
    measured = statistics.median(rates[1]) / base
    print(f"one MTP layer: {measured:.3f}x the tokens/s ({(measured - 1) * 100:+.1f} %); the matmul FLOPs predict "
          f"{1 / flops_ratio:.3f}x ({(1 / flops_ratio - 1) * 100:+.1f} %); anchor marin#5772: -20 %")


if __name__ == "__main__":
    main()
