"""Errors that the CLI turns into one-line messages."""


class UsageError(Exception):
    """Bad input from the user: the CLI prints the message on one line and exits with code 2."""

    exit_code = 2

    def __str__(self) -> str:
        return " ".join(super().__str__().split())


class TrainingFailed(RuntimeError):
    """The ranks exited with an error (the message says which and where the log is)."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code
