"""`dstool plan`'s prediction for this machine against measured `dstool train` runs.

    python bench/plan_check.py [--output DIR] [--steps 40] [--log-every 5] [--max-load 1.0] [--json FILE]

Trains the tiny and tiny-moe presets on 1 and 2 ranks (ZeRO-2, seq 128, micro-batch 8, fp32, the defaults), then
plans each run from each other run's measured MFU (`--from-run`) and prints predicted vs measured tokens/s and step
time with the error. Measured: the median over the logging windows after the first (the warm-up), as `--from-run`
reads them; a finished run already in --output is reused. No assertion on timing: the machine is shared, so each run
waits (up to --wait s) for the 1-minute load average to fall below --max-load, and the load is printed beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dstool.train.config import PlanConfig
from dstool.train.plan import plan, step_windows

RUNS = [("tiny", 1), ("tiny", 2), ("tiny-moe", 1), ("tiny-moe", 2)]


def _quiet(max_load: float, wait_s: float) -> None:
    deadline = time.monotonic() + wait_s
    while os.getloadavg()[0] >= max_load and time.monotonic() < deadline:
        time.sleep(10)


def train(out: Path, model: str, nproc: int, steps: int, log_every: int, max_load: float, wait_s: float) -> dict:
    """One `dstool train` run (or the finished one already in `out`); its measured figures."""
    _quiet(max_load, wait_s)
    load_before = os.getloadavg()[0]
    if not (out / "model").is_dir():
        subprocess.run([sys.executable, "-m", "dstool.cli", "train", "--model", model, "--nproc", str(nproc),
                        "--max-steps", str(steps), "--log-every", str(log_every), "--save-every", str(10 * steps),
                        "--no-tensorboard", "--output", str(out)], check=True, stdout=subprocess.DEVNULL)
    rows = step_windows(out)
    return {"run": str(out), "model": model, "nproc": nproc, "windows": len(rows),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows),
            "step_time_s": statistics.median(r["step_time_s"] for r in rows),
            "mfu": statistics.median(r["mfu"] for r in rows),
            "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--output", type=Path, default=None, help="folder for the runs (default: a new temporary one)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--log-every", type=int, default=5)
    ap.add_argument("--max-load", type=float, default=1.0, help="start a run once the load average is below this")
    ap.add_argument("--wait", type=float, default=1800, help="seconds to wait for that before each run")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = ap.parse_args()
    root = args.output or Path(tempfile.mkdtemp(prefix="dstool-plan-check-"))
    measured = [train(root / f"{m}-{n}", m, n, args.steps, args.log_every, args.max_load, args.wait) for m, n in RUNS]
    print(f"{os.cpu_count()} cores; runs in {root}")
    print(f"{'run':<12} {'windows':>7} {'tokens/s':>9} {'step s':>7} {'MFU':>6}  load average before/after")
    for r in measured:
        print(f"{r['model']}-{r['nproc']:<7} {r['windows']:>7} {r['tokens_per_s']:>9.0f} {r['step_time_s']:>7.3f} "
              f"{r['mfu']:>6.1%}  {r['load_average'][0]:.2f} / {r['load_average'][1]:.2f}")
    print()
    print(f"{'planned from':<13} {'predicts':<11} {'tokens/s':>9} {'measured':>9} {'error':>7} {'step s':>7} "
          f"{'measured':>8}")
    checks, errors = [], []
    for ref in measured:
        for target in measured:
            p = plan(PlanConfig(model=target["model"], gpu="cpu", gpus=str(target["nproc"]), tokens="1M",
                                from_run=ref["run"]))
            predicted = p.clusters[0]
            error = (predicted.tokens_per_s - target["tokens_per_s"]) / target["tokens_per_s"]
            if ref is not target:
                errors.append(abs(error))
            checks.append({"from": f"{ref['model']}-{ref['nproc']}", "predicts": f"{target['model']}-{target['nproc']}",
                           "predicted_tokens_per_s": predicted.tokens_per_s, "measured_tokens_per_s":
                           target["tokens_per_s"], "predicted_step_time_s": predicted.step_time_s,
                           "measured_step_time_s": target["step_time_s"], "error": error})
            print(f"{ref['model'] + '-' + str(ref['nproc']):<13} {target['model'] + '-' + str(target['nproc']):<11} "
                  f"{predicted.tokens_per_s:>9.0f} {target['tokens_per_s']:>9.0f} {error:>+7.1%} "
                  f"{predicted.step_time_s:>7.3f} {target['step_time_s']:>8.3f}")
    print(f"\nerror of the {len(errors)} cross predictions (a run predicting another): median "
          f"{statistics.median(errors):.1%}, max {max(errors):.1%}")
    if args.json:
        args.json.write_text(json.dumps({"cores": os.cpu_count(), "runs": measured, "checks": checks}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
