"""The machine a bench ran on, as its figures name it: the CPU's model name (CPU features differ between machines);
and how a bench times alternatives on it: interleaved, medians."""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path


def cpu_name() -> str:
    """/proc/cpuinfo's model name, or what the platform says without one."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    return next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")),
                platform.processor() or platform.machine())


def interleaved_ms(runs: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Milliseconds each of `runs` takes, the median of `repeats` rounds that run each once in turn."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            began = time.perf_counter()
            run()
            times[name].append(1000 * (time.perf_counter() - began))
    return {name: statistics.median(t) for name, t in times.items()}
