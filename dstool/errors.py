"""Errors the CLI turns into one line and an exit code: 2 for usage, 1 for a failed gate or a crashed engine."""

from __future__ import annotations

from pathlib import Path


class UsageError(Exception):
    """Bad input from the user: the CLI prints the message on one line and exits with code 2."""

    exit_code = 2

    def __str__(self) -> str:
        return " ".join(super().__str__().split())


class Failed(Exception):
    """The input was fine but the work failed: the CLI prints one line naming what failed and where its log is,
    and exits with `exit_code` (1 unless an engine's own code is more telling)."""

    def __init__(self, message: str, log: Path | str | None = None, exit_code: int = 1):
        super().__init__(message)
        self.log = Path(log) if log else None
        self.exit_code = exit_code

    def __str__(self) -> str:
        return " ".join(super().__str__().split())


class StageFailed(Failed):
    """A correctness gate did not hold (parity, integer ops, a reload, a served answer)."""


class EngineFailed(Failed):
    """An engine dstool drives (DeepSpeed ranks, Triton) exited with an error or died."""


class TrainingFailed(EngineFailed):
    """The training ranks exited with an error (the message says which and where the log is)."""
