"""Shared helpers: run the real `dstool` CLI in a subprocess, as a user would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

DSTOOL = [sys.executable, "-m", "dstool.cli"]
# Small but real: 2 DeepSpeed ranks over gloo, the tiny preset, short sequences.
FAST = ["--seq-len", "64", "--micro-batch-size", "4", "--log-every", "1", "--no-tensorboard"]


def dstool(*args: str, timeout: float = 600, check: bool = True, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run([*DSTOOL, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
    if check and proc.returncode != 0:
        raise AssertionError(f"dstool {' '.join(args)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}"
                             f"\n--- stderr\n{proc.stderr[-6000:]}")
    return proc


def losses(output: Path) -> dict[int, float]:
    """Per-step training loss from metrics.jsonl (a resumed run's later rows win)."""
    rows = [json.loads(l) for l in (Path(output) / "metrics.jsonl").read_text().splitlines() if l.strip()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


@pytest.fixture(scope="session")
def session_tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("dstool")


@pytest.fixture(scope="session")
def trained(session_tmp) -> Path:
    """A tiny-preset model trained 40 steps by `dstool train` (1 rank): the input of compress and export."""
    out = session_tmp / "trained_tiny"
    dstool("train", "--output", str(out), "--nproc", "1", "--zero", "0", "--max-steps", "40", "--save-every", "40",
           "--lr", "3e-3", *FAST)
    return out / "model"
