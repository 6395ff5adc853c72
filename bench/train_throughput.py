"""Training throughput: `dstool train` vs Hugging Face Trainer (DeepSpeed integration) vs a minimal
hand-written DeepSpeed loop — same model, same data, same DeepSpeed JSON, same ranks, one run.

    .venv/bin/python bench/train_throughput.py [--nproc 2] [--zero 2] [--steps 40] [--rounds 2]

Tokens/s = global batch x sequence length / median optimizer-step time (first steps skipped).
Targets (issue #2): dstool >= 1.0x Trainer and >= 0.97x the minimal loop.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from dstool.proc import free_port

HERE = Path(__file__).resolve().parent


def _env(nproc: int) -> dict:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    env.setdefault("DS_ACCELERATOR", "cpu")
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    return env


def run_dstool(a, out: Path) -> list[float]:
    cmd = [sys.executable, "-m", "dstool.cli", "train", "--output", str(out), "--model", a.model,
           "--nproc", str(a.nproc), "--zero", str(a.zero), "--precision", a.precision, "--max-steps", str(a.steps),
           "--save-every", str(a.steps), "--log-every", "1", "--seq-len", str(a.seq_len),
           "--micro-batch-size", str(a.micro_batch_size), "--no-tensorboard", "--resume", "none"]
    subprocess.run(cmd, check=True, env=_env(a.nproc), stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["step_time_s"] for r in rows if "step_time_s" in r]


def run_peer(a, which: str, run_dir: Path) -> list[float]:
    result = run_dir / f"{which}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={a.nproc}",
           f"--master_port={free_port()}", str(HERE / "_peers.py"), which, str(run_dir), str(a.steps), str(result)]
    proc = subprocess.run(cmd, env=_env(a.nproc), capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{which} failed:\n{proc.stderr[-3000:]}")
    return json.loads(result.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--zero", type=int, default=2)
    p.add_argument("--precision", default="fp32")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--skip", type=int, default=5, help="first steps left out of the median")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2, help="each contender runs this many times, interleaved")
    a = p.parse_args()

    times: dict[str, list[float]] = {"dstool train": [], "HF Trainer + DeepSpeed": [], "minimal DeepSpeed loop": []}
    with tempfile.TemporaryDirectory(prefix="dstool-bench-") as tmp:
        for r in range(a.rounds):
            run_dir = Path(tmp) / f"round{r}"
            times["dstool train"] += run_dstool(a, run_dir)[a.skip:]
            times["HF Trainer + DeepSpeed"] += run_peer(a, "trainer", run_dir)[a.skip:]
            times["minimal DeepSpeed loop"] += run_peer(a, "minimal", run_dir)[a.skip:]
            ds = json.loads((run_dir / "ds_config.json").read_text())
    tokens_per_step = ds["train_batch_size"] * a.seq_len
    tok_s = {k: tokens_per_step / statistics.median(v) for k, v in times.items()}
    print(f"model {a.model}, {a.nproc} ranks, ZeRO-{a.zero}, {a.precision}, global batch {ds['train_batch_size']} x "
          f"{a.seq_len} tokens, {a.steps} steps x {a.rounds} rounds (median step, first {a.skip} skipped)")
    print(f"{'':26s} {'tokens/s':>10s} {'median step ms':>15s}")
    for k, v in times.items():
        print(f"{k:26s} {tok_s[k]:10,.0f} {1000 * statistics.median(v):15.1f}")
    vs_trainer = tok_s["dstool train"] / tok_s["HF Trainer + DeepSpeed"]
    vs_minimal = tok_s["dstool train"] / tok_s["minimal DeepSpeed loop"]
    print(f"dstool / Trainer       = {vs_trainer:.3f}x  (target >= 1.0)  {'PASS' if vs_trainer >= 1.0 else 'MISS'}")
    print(f"dstool / minimal loop  = {vs_minimal:.3f}x  (target >= 0.97) {'PASS' if vs_minimal >= 0.97 else 'MISS'}")


if __name__ == "__main__":
    main()
