"""Activation checkpointing: peak memory and step time of `dstool train` with and without
`--activation-checkpointing`, same model, data, ranks and steps, interleaved rounds; the losses must agree.

    .venv/bin/python bench/activation_checkpointing.py [--models tiny,tiny-moe] [--nproc 2] [--zero 3]
        [--seq-len 512] [--micro-batch-size 8] [--steps 6] [--rounds 2]

Peak memory: the largest resident set of any rank (getrusage of the run's finished descendants, measured in a
fresh process per run so runs do not mix). Step time: median over the steps after the first two.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from _rss import peak_rss


def run(a, model: str, checkpointing: bool, out: Path) -> tuple[int, list[float], dict[int, float]]:
    cmd = [sys.executable, "-m", "dstool.cli", "train", "--output", str(out), "--model", model,
           "--nproc", str(a.nproc), "--zero", str(a.zero), "--max-steps", str(a.steps), "--save-every", "1000000",
           "--log-every", "1", "--seq-len", str(a.seq_len), "--micro-batch-size", str(a.micro_batch_size),
           "--eval-batches", "1", "--no-tensorboard", "--resume", "none"]
    if checkpointing:
        cmd.append("--activation-checkpointing")
    peak = peak_rss(cmd)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "step_time_s" in r]
    return peak, [r["step_time_s"] for r in steps[2:]], {r["step"]: r["loss"] for r in steps}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="tiny,tiny-moe")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--zero", type=int, default=3)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args()

    results: dict[tuple[str, bool], tuple[list[int], list[float], dict[int, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="dstool-bench-ac-") as tmp:
        for r in range(a.rounds):
            for model in a.models.split(","):
                for checkpointing in (False, True):
                    peak, times, losses = run(a, model, checkpointing, Path(tmp) / f"{model}-{checkpointing}-{r}")
                    peaks, all_times, _ = results.setdefault((model, checkpointing), ([], [], losses))
                    peaks.append(peak)
                    all_times += times
    print(f"{a.nproc} ranks, ZeRO-{a.zero}, micro-batch {a.micro_batch_size} x {a.seq_len} tokens, {a.steps} steps x "
          f"{a.rounds} rounds (peak: largest rank's resident set, median of rounds; step: median)")
    print(f"{'model':10s} {'checkpointing':>13s} {'peak MiB':>9s} {'step ms':>8s} {'memory':>7s} {'time':>6s} "
          f"{'max |loss diff|':>15s}")
    for model in a.models.split(","):
        base_peak, base_times, base_losses = results[(model, False)]
        for checkpointing in (False, True):
            peaks, times, losses = results[(model, checkpointing)]
            diff = max(abs(losses[s] - base_losses[s]) for s in base_losses)
            print(f"{model:10s} {'on' if checkpointing else 'off':>13s} {statistics.median(peaks) / 2**20:9.0f} "
                  f"{1000 * statistics.median(times):8.1f} "
                  f"{statistics.median(peaks) / statistics.median(base_peak):6.2f}x "
                  f"{statistics.median(times) / statistics.median(base_times):5.2f}x {diff:15.2e}")


if __name__ == "__main__":
    main()
