"""Steps as objects (as Triton Model Navigator has them): a name, what it does, a run, a gate, a status and a
duration. `run_steps` runs them in order, prints one line per step, and stops at the first that fails;
`cleanup` steps run whatever happened before them."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from dstool import log as dlog
from dstool.errors import StageFailed

Status = Literal["pending", "running", "passed", "failed", "skipped"]


@dataclass
class Step:
    name: str
    what: str
    run: Callable[[], Any]
    gate: Callable[[Any], str | None] | None = None  # the result -> None when it holds, else why not
    cleanup: bool = False  # runs even when an earlier step failed
    status: Status = "pending"
    duration_s: float | None = None
    result: Any = field(default=None, repr=False)
    error: str | None = None

    def summary(self) -> dict:
        return {"name": self.name, "status": self.status, "duration_s": self.duration_s, "error": self.error}


def run_steps(steps: list[Step], label: str) -> list[Step]:
    """Run `steps`; raise StageFailed naming the first step whose run raised or whose gate did not hold."""
    started = time.monotonic()
    failure: BaseException | None = None
    # Inside another stage (compress within the pipeline) the step lines go to the log: a bar shows the progress.
    bar = None if dlog.console_shows_info() else dlog.progress(len(steps), label)
    for i, step in enumerate(steps, 1):
        if failure is not None and not step.cleanup:
            step.status = "skipped"
            continue
        dlog.log.info(f"[{label} {i}/{len(steps)} {step.name}] {step.what} (+{time.monotonic() - started:.0f} s)")
        step.status = "running"
        t0 = time.monotonic()
        try:
            with dlog.indented():
                step.result = step.run()
                why = step.gate(step.result) if step.gate else None
            if why:
                raise StageFailed(f"{label} step '{step.name}': gate failed: {why}")
            step.status = "passed"
        except BaseException as e:  # noqa: BLE001 (recorded, cleanups run, then re-raised)
            step.status, step.error = "failed", str(e).splitlines()[0] if str(e) else type(e).__name__
            if failure is None:
                failure = e
        finally:
            step.duration_s = round(time.monotonic() - t0, 3)
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    if failure is not None:
        raise failure
    return steps
