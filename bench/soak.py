"""Kill-a-rank soak: one `dstool train --max-restarts N` run, SIGKILL a random rank at a random moment
of a random step, N times, and check each recovery.

    python bench/soak.py --trials 10 [--nproc 2] [--save-every 3] [--seed 0] [--output DIR] [--json FILE]

Reports trials recovered, seconds from the kill to the first step after resume (median/max), checkpoints
found corrupt (every complete tag is re-hashed after each recovery; must be 0) and steps lost per
failure (must be <= --save-every).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from dstool.artifacts import Checkpoint, ManifestError
from dstool.train import checkpoint


def _heartbeat(out: Path) -> dict | None:
    try:
        return json.loads((out / "heartbeat.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _restart_rows(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    return [r for r in rows if r.get("event") == "restart"]


def _ranks(launcher: subprocess.Popen) -> dict[int, psutil.Process]:
    procs = psutil.Process(launcher.pid).children(recursive=True)
    found = {}
    for p in procs:
        try:
            env = p.environ()
        except psutil.Error:
            continue
        if "RANK" in env:
            found[int(env["RANK"])] = p
    return found


def _corrupt_tags(out: Path) -> list[str]:
    root = out / "checkpoints"
    bad = []
    for tag in checkpoint.complete_tags(root):
        try:
            Checkpoint.read(root / tag, verify=True)
        except ManifestError as e:
            bad.append(f"{tag}: {e}")
    latest = root / "latest"
    if latest.is_file() and not (root / latest.read_text().strip()).is_dir():
        bad.append(f"latest names {latest.read_text().strip()}, which is not in place")
    return bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--save-every", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output", help="run folder (default: a temporary one)")
    ap.add_argument("--json", help="write the report here too")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    out = Path(a.output or tempfile.mkdtemp(prefix="dstool-soak-")) / "run"
    steps = a.trials * 3 * a.save_every + 2 * a.save_every  # room for every trial's kill and redone steps
    cmd = [sys.executable, "-m", "dstool.cli", "train", "--output", str(out), "--nproc", str(a.nproc),
           "--max-restarts", str(a.trials), "--max-steps", str(steps), "--save-every", str(a.save_every),
           "--keep-checkpoints", "2", "--seq-len", "32", "--micro-batch-size", "2", "--log-every", "1",
           "--zero", "2", "--no-tensorboard", "--eval-batches", "1", "--resume", "none"]
    log = open(out.parent / "soak.log", "w")
    t_start = time.time()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    trials, corrupt = [], []
    try:
        for trial in range(1, a.trials + 1):
            # Wait for the run (or its previous recovery) to be stepping, then pick a step 1..2*save_every ahead.
            while (hb := _heartbeat(out)) is None or len(_restart_rows(out)) < trial - 1:
                if proc.poll() is not None:
                    raise SystemExit(f"run ended early (code {proc.returncode}); see {out.parent / 'soak.log'}")
                time.sleep(0.01)
            target = hb["step"] + rng.randint(1, 2 * a.save_every)
            if target >= steps:
                break
            while (hb := _heartbeat(out)) is None or hb["step"] < target:
                time.sleep(0.002)
            time.sleep(rng.uniform(0, 0.3))  # somewhere inside the next step (or its checkpoint save)
            victim = rng.randrange(a.nproc)
            step_at_kill = _heartbeat(out)["step"]
            killed = time.time()
            _ranks(proc)[victim].kill()
            while len(_restart_rows(out)) < trial:
                if proc.poll() is not None:
                    raise SystemExit(f"trial {trial}: the run ended without recovering (code {proc.returncode})")
                time.sleep(0.01)
            row = _restart_rows(out)[-1]
            bad = _corrupt_tags(out)
            corrupt += bad
            trials.append({"trial": trial, "rank_killed": victim, "step_at_kill": step_at_kill,
                           "resumed_from_step": row["resumed_from_step"], "steps_lost": row["steps_lost"],
                           "recover_s": row["time"] - killed, "corrupt": bad})
            print(f"trial {trial}: killed rank {victim} after step {step_at_kill}; resumed from step "
                  f"{row['resumed_from_step']} ({row['steps_lost']} steps lost), first step after resume "
                  f"{row['time'] - killed:.1f} s after the kill; corrupt checkpoints: {len(bad)}", flush=True)
        rc = proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    recover = [t["recover_s"] for t in trials]
    report = {
        "trials": len(trials), "recovered": len(trials), "run_exit_code": rc,
        "recover_s_median": statistics.median(recover) if recover else None,
        "recover_s_max": max(recover) if recover else None,
        "corrupt_checkpoints": len(corrupt), "steps_lost_max": max((t["steps_lost"] for t in trials), default=None),
        "save_every": a.save_every, "nproc": a.nproc, "max_steps": steps, "wall_s": time.time() - t_start,
        "trial_rows": trials,
    }
    ok = (rc == 0 and len(trials) == a.trials and not corrupt
          and all(t["steps_lost"] <= a.save_every for t in trials))
    print(f"soak: {report['recovered']}/{a.trials} trials recovered, run exit code {rc}; seconds to recover "
          f"median {report['recover_s_median']:.1f} max {report['recover_s_max']:.1f}; corrupt checkpoints "
          f"{report['corrupt_checkpoints']}; steps lost per failure max {report['steps_lost_max']} "
          f"(save every {a.save_every}); {report['wall_s']:.0f} s in all -> {'PASS' if ok else 'FAIL'}")
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
