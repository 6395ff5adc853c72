"""The one logging setup of dstool, called once by the CLI entry point (`setup`) and by each training rank.

dstool speaks through the `dstool` logger: INFO lines on stdout, warnings and errors on stderr. Other
libraries' logs and Python warnings (torch, transformers, DeepSpeed, onnxruntime ...) and their progress
bars are kept out of the console unless `-v`; they go to the run's log file (`to_file`) when there is one.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import importlib.abc
import importlib.util
import io
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger("dstool")

# Libraries that install their own console handlers (propagate=False): taken over by `adopt_libraries`.
LIBRARY_LOGGERS = ("torch", "torch.onnx", "transformers", "DeepSpeed", "deepspeed", "onnxruntime", "onnxscript",
                   "torchao", "accelerate", "matplotlib", "urllib3", "filelock", "redis", "grpc")
# Read by the libraries when they load, here and in every process dstool starts (ranks, Triton's python models).
QUIET_ENV = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
             "TRANSFORMERS_VERBOSITY": "error", "TQDM_DISABLE": "1", "TF_CPP_MIN_LOG_LEVEL": "3",
             "TORCH_CPP_LOG_LEVEL": "ERROR"}
VERBOSE_ENV = "DSTOOL_VERBOSE"

_indent: contextvars.ContextVar[str] = contextvars.ContextVar("dstool_log_indent", default="")
_state: dict = {"verbose": False, "console": None, "held": None, "file": None}


class _Console(logging.Handler):
    """dstool's own lines: INFO on stdout as they are, warnings/errors on stderr prefixed `dstool: ` (the streams of
    when logging was set up, so that `prints_to_log` can take sys.stdout from the libraries)."""

    def __init__(self, level: int):
        super().__init__(level)
        self.out, self.err = sys.stdout, sys.stderr

    def emit(self, record: logging.LogRecord) -> None:
        try:
            prefix = _indent.get()
            text = "\n".join(prefix + line for line in record.getMessage().splitlines() or [""])
            stream = self.out
            if record.levelno >= logging.WARNING:
                label = "warning: " if record.levelno == logging.WARNING else ""
                text, stream = f"dstool: {label}{text}", self.err
            tqdm = sys.modules.get("tqdm")
            if tqdm is not None and getattr(tqdm.tqdm, "_instances", None):
                tqdm.tqdm.write(text, file=stream)  # above the progress bar, which stays at the bottom
            else:
                stream.write(text + "\n")
                stream.flush()
        except Exception:  # noqa: BLE001 (logging must never raise)
            self.handleError(record)


class _NotDstool(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.name.startswith("dstool")


class _Held(logging.Handler):
    """Holds the newest records until the run's log file is known (`to_file`), then hands them to it."""

    def __init__(self, capacity: int = 20_000):
        super().__init__()
        self.records: collections.deque[logging.LogRecord] = collections.deque(maxlen=capacity)

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def setup(verbose: bool = False) -> None:
    """Configure logging for this process: call once, at the entry point, before the work starts (`shutdown`
    undoes it, for a program that calls the CLI's `main` in-process)."""
    shutdown()
    verbose = verbose or os.environ.get(VERBOSE_ENV) == "1"
    root = logging.getLogger()
    _state["saved"] = (list(root.handlers), root.level, {k: os.environ.get(k) for k in (*QUIET_ENV, VERBOSE_ENV)})
    for h in list(root.handlers):
        root.removeHandler(h)
    _state.update(verbose=verbose, file=None, held=_Held())
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    root.addHandler(_state["held"])  # everything, third-party included, until the run's log file is known
    if verbose:
        os.environ[VERBOSE_ENV] = "1"  # the ranks and other dstool processes started from here speak up too
        third_party = logging.StreamHandler(sys.stderr)
        third_party.addFilter(_NotDstool())
        third_party.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        root.addHandler(third_party)
    else:
        for key, value in QUIET_ENV.items():
            os.environ.setdefault(key, value)
    console = _Console(logging.DEBUG if verbose else logging.INFO)
    log.handlers = [console]
    log.setLevel(logging.DEBUG)
    log.propagate = True  # dstool's lines go to the log file too
    _state["console"] = console
    logging.captureWarnings(True)
    adopt_libraries()
    if not any(isinstance(f, _AdoptAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AdoptAfterImport())


class _AdoptAfterImport(importlib.abc.MetaPathFinder):
    """When one of these libraries has been imported (they add console handlers as they load), adopt its loggers
    at once, before what imports it next can log through them."""

    # deepspeed.utils.logging: DeepSpeed creates its logger there and logs through it while its own import goes on.
    WATCHED = frozenset({"torch", "transformers", "deepspeed", "deepspeed.utils.logging", "onnxruntime", "onnxscript",
                         "torchao"})

    def __init__(self) -> None:
        self._finding: set[str] = set()

    def find_spec(self, name, path=None, target=None):
        if name not in self.WATCHED or name in self._finding:
            return None
        self._finding.add(name)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self._finding.discard(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _AdoptingLoader(spec.loader)
        return spec


class _AdoptingLoader(importlib.abc.Loader):
    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        adopt_libraries()

    def __getattr__(self, name):  # get_resource_reader, is_package, ... as the real loader has them
        return getattr(self.loader, name)


def shutdown() -> None:
    """Undo `setup`: close the log file, give the root logger and the environment back as they were."""
    saved = _state.pop("saved", None)
    if _state.get("file") is not None:
        _state["file"].close()
    log.handlers = []
    log.setLevel(logging.NOTSET)
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _AdoptAfterImport)]
    if saved is not None:
        handlers, level, env = saved
        root = logging.getLogger()
        for h in list(root.handlers):
            root.removeHandler(h)
        for h in handlers:
            root.addHandler(h)
        root.setLevel(level)
        for key, value in env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    _state.update(verbose=False, console=None, held=None, file=None)


def adopt_libraries() -> None:
    """Route the libraries' own loggers through the root logger (the log file; the console with -v). Libraries
    add their handlers when they are imported: dstool calls this again after importing them."""
    level = logging.INFO if _state["verbose"] else logging.WARNING
    for name in LIBRARY_LOGGERS:
        lib = logging.getLogger(name)
        for h in list(lib.handlers):
            lib.removeHandler(h)
        lib.propagate = True
        lib.setLevel(level)
    if "transformers" in sys.modules and not _state["verbose"]:
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()


def to_file(path: Path) -> Path | None:
    """Write this process's log, from its start (held until now), to `path` (appending). The first call wins:
    a stage run inside another (train inside compress inside the pipeline) logs to the outer run's file. Without
    `setup` (dstool used as a library) the application's own logging is left alone and this does nothing."""
    if _state.get("file") is not None or _state.get("console") is None:
        return log_file()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    held = _state.pop("held", None)
    if held is not None:
        root.removeHandler(held)
        for record in held.records:
            handler.handle(record)
    root.addHandler(handler)
    _state["file"] = handler
    return path


def log_file() -> Path | None:
    handler = _state.get("file")
    return Path(handler.baseFilename) if handler is not None else None


def verbose() -> bool:
    return bool(_state["verbose"])


@contextlib.contextmanager
def indented(prefix: str = "    ") -> Iterator[None]:
    """dstool's console lines inside this block are indented (a stage run inside the pipeline)."""
    token = _indent.set(_indent.get() + prefix)
    try:
        yield
    finally:
        _indent.reset(token)


@contextlib.contextmanager
def details_to_file() -> Iterator[None]:
    """Inside this block dstool's INFO lines go to the log file only (warnings still show); -v shows them all."""
    console = _state.get("console")
    if console is None or _state["verbose"]:
        yield
        return
    previous = console.level
    console.setLevel(logging.WARNING)
    try:
        yield
    finally:
        console.setLevel(previous)


def quiet_console() -> None:
    """From now on dstool's INFO lines go to the log file only (warnings still show), unless -v."""
    console = _state.get("console")
    if console is not None and not _state["verbose"]:
        console.setLevel(logging.WARNING)


def console_shows_info() -> bool:
    console = _state.get("console")
    return console is None or console.level <= logging.INFO


class _PrintsToLog(io.TextIOBase):
    """A stdout whose lines go to a logger (the log file; the console with -v)."""

    def __init__(self, name: str):
        super().__init__()
        self.logger, self.pending = logging.getLogger(name), ""

    def write(self, text: str) -> int:
        *lines, self.pending = (self.pending + text).split("\n")
        for line in lines:
            if line.strip():
                self.logger.info(line)
        return len(text)

    def isatty(self) -> bool:
        return False


def prints_to_log(name: str = "stdout") -> None:
    """From now on what libraries print (DeepSpeed's pipeline partitioning, for one) goes to logger `name`; dstool's
    own lines keep the console (a training rank: only dstool's lines on the console)."""
    sys.stdout = _PrintsToLog(name)


def console_stream():
    """The stream dstool's INFO lines go to (stdout as it was when logging was set up)."""
    console = _state.get("console")
    return console.out if console is not None else sys.stdout


@contextlib.contextmanager
def captured_stdout(name: str) -> Iterator[None]:
    """Lines a library prints (not logs) inside this block go to logger `name` (the log file; the console with -v)."""
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        try:
            yield
        finally:
            for line in buffer.getvalue().splitlines():
                if line.strip():
                    logging.getLogger(name).info(line)


def progress(total: int, desc: str, initial: int = 0, stream=None):
    """A progress bar on `stream` (default stderr) when it is a terminal, else None (the log lines tell it)."""
    stream = stream or sys.stderr
    if not stream.isatty():
        return None
    from tqdm import tqdm  # noqa: PLC0415 (tqdm: 60 ms, only on a terminal; every command imports this module)

    return tqdm(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True, leave=False, disable=False,
                file=stream)
