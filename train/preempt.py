"""Preemption and time-based checkpoints: SIGTERM/SIGUSR1 (what Kubernetes, spot reclaim and SLURM send) ends a run
with a checkpoint of the step the ranks were on, and an exit code schedulers retry.

The launching `dstool train` answers the signal by creating STOP in the run folder rather than passing the signal
on (the launchers' own kill timers stay out of it) and stops the ranks itself when the grace period is over. A rank
that gets the signal directly (SLURM signals every process) counts it the same as the file. At every step boundary
the ranks agree in one all-reduce whether any of them was asked to stop, or whether rank 0's clock says a
checkpoint is due; then all of them checkpoint that step, the first rank of each node writes PREEMPTED, the ranks
exit 0, and `dstool train` exits EXIT_CODE.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import psutil

from dstool import log as dlog
from dstool.errors import Failed
from dstool.files import write_json_atomic

log = dlog.log
STOP = "stop-requested"
PREEMPTED = "preempted.json"
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
EXIT_CODE = 128 + signal.SIGTERM  # 143: what a SIGTERM'd process returns; Kubeflow's ExitCode policy retries 128-255


class Preempted(Failed):
    """The run stopped on a preemption signal (with a checkpoint, or past the grace period with the last one)."""

    def __init__(self, message: str, log: Path | None = None):
        super().__init__(message, log=log, exit_code=EXIT_CODE)


class StepGate:
    """A rank's view of the two reasons to checkpoint outside --save-every, agreed by all ranks at each step."""

    def __init__(self, out: Path, every_minutes: float | None, clock_rank: bool):
        self.stop_file, self.clock_rank = out / STOP, clock_rank
        self.every_s = every_minutes * 60 if every_minutes else None
        self.last_saved = time.monotonic()
        self.signal: str | None = None
        for sig in SIGNALS:
            signal.signal(sig, self._caught)

    def _caught(self, signum, _frame) -> None:
        self.signal = self.signal or signal.Signals(signum).name

    def check(self, device) -> tuple[bool, bool]:
        """(a checkpoint is due by the clock, the ranks must stop): a collective, every rank calls it each step."""
        import torch
        import torch.distributed as dist

        stop = self.signal is not None or self.stop_file.exists()
        due = self.clock_rank and self.every_s is not None and time.monotonic() - self.last_saved >= self.every_s
        flags = torch.tensor([float(due), float(stop)], device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return bool(flags[0]), bool(flags[1])

    def saved(self) -> None:
        self.last_saved = time.monotonic()

    def reason(self) -> str:
        return self.signal or f"{self.stop_file.name} (a signal to dstool train)"


class Watch:
    """The launching side: on the first SIGTERM/SIGUSR1 create STOP and give the ranks `grace_s`; past it, or on a
    second signal, kill the launcher's process tree."""

    def __init__(self, out: Path, proc, grace_s: float):
        self.out, self.proc, self.grace_s = out, proc, grace_s
        self.signal: str | None = None
        self.killed = False
        self.previous = {sig: signal.signal(sig, self._caught) for sig in SIGNALS}

    def _caught(self, signum, _frame) -> None:
        if self.signal is not None:
            log.warning("dstool train: a second signal: stopping the ranks now")
            self._kill()
            return
        self.signal = signal.Signals(signum).name
        (self.out / STOP).touch()
        log.warning(f"dstool train: {self.signal}: the ranks finish their step and write a checkpoint (up to "
                    f"{self.grace_s:g} s, --preempt-grace-s)")
        timer = threading.Timer(self.grace_s, self._late)
        timer.daemon = True
        timer.start()

    def _late(self) -> None:
        if self.proc.poll() is None:
            log.error(f"dstool train: no checkpoint within {self.grace_s:g} s of {self.signal}: stopping the ranks")
            self._kill()

    def _kill(self) -> None:
        self.killed = True
        try:
            procs = [*psutil.Process(self.proc.pid).children(recursive=True), psutil.Process(self.proc.pid)]
        except psutil.NoSuchProcess:
            return
        for p in procs:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def clear(out: Path) -> None:
    """Before the ranks start: no stop request or preemption record left from an earlier launch."""
    (out / STOP).unlink(missing_ok=True)
    (out / PREEMPTED).unlink(missing_ok=True)


def record(out: Path, step: int, tag: Path, reason: str) -> None:
    """The ranks' side, once the checkpoint is written: what `dstool train` reports."""
    write_json_atomic(out / PREEMPTED, {"step": step, "checkpoint": str(tag), "reason": reason})
