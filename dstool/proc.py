"""Process, port and signal helpers every stage shares."""

from __future__ import annotations

import ctypes
import errno
import signal
import socket
import subprocess
from pathlib import Path

from dstool.errors import UsageError


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the OS picks it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_port_free(host: str, port: int) -> None:
    """UsageError (one line) unless this process could listen on host:port."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise UsageError(f"port {port} on {host} is already in use") from None
            raise UsageError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def die_with_parent(sig: int) -> None:
    """Linux: this process receives `sig` when its parent dies (launcher or rank), so no child is orphaned."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(sig))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def process_stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (its state first, its exit status last), or None when
    there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()


def how_it_ended(code: int) -> str:
    """A child's exit code (negative: the signal that killed it, as subprocess and multiprocessing give it) in
    words: "died of SIGSEGV", "exited with code 3"."""
    if code < 0:
        try:
            return f"died of {signal.Signals(-code).name}"
        except ValueError:
            return f"died of signal {-code}"
    return f"exited with code {code}"


def stop_process(proc: subprocess.Popen, grace: float = 15.0) -> int:
    """SIGTERM, then SIGKILL after `grace` seconds; the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode
