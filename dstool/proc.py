"""Process, port and signal helpers every stage shares."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import random
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from dstool.errors import UsageError

PORTS_FROM = 10000  # free_port draws from here up to the start of the OS's own range
LEDGER_S = 600.0  # seconds a port free_port handed out is not handed out again on this machine


def free_port(host: str = "127.0.0.1", also: tuple[int, ...] = ()) -> int:
    """A TCP port nothing listens on now, for a process about to listen on it. Drawn below the range the OS hands
    out by itself (ip_local_port_range: source ports of outgoing connections, bind to port 0), so no connection
    made between the draw and the bind takes it, and not one another process on this machine was handed in the
    last LEDGER_S seconds (a ledger under a file lock in the temporary folder). `also`: offsets from it that must be
    free too and are handed out with it (a Redis Cluster node's bus port is its port + 10000)."""
    offsets = (0, *also)
    top = _os_range_start() - max(offsets)
    if top - PORTS_FROM < 1000:  # an unusual OS range leaves no room below it
        if not also:
            return _os_port(host)
        top = 65536 - max(offsets)
    draw = random.SystemRandom()
    with _ledger() as handed:
        for _ in range(200):
            port = draw.randrange(PORTS_FROM, top)
            taken = [port + o for o in offsets]
            if not any(t in handed for t in taken) and all(_bindable(host, t) for t in taken):
                handed.update((t, time.time()) for t in taken)
                return port
    if not also:
        return _os_port(host)
    raise OSError(f"no free port on {host} with its offsets {also} free too, after 200 draws")


def _os_range_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _os_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


@contextlib.contextmanager
def _ledger() -> Iterator[dict[int, float]]:
    """The ports handed out in the last LEDGER_S seconds (port -> when), read and written back under an exclusive
    lock; an empty one, kept nowhere, when the file cannot be used (another user's, a read-only folder)."""
    path = Path(tempfile.gettempdir()) / "dstool-ports"
    try:
        f = open(path, "a+")
    except OSError:
        yield {}
        return
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        now, handed = time.time(), {}
        for line in f.read().splitlines():
            port, _, when = line.partition(" ")
            with contextlib.suppress(ValueError):
                if now - float(when) < LEDGER_S:
                    handed[int(port)] = float(when)
        yield handed
        f.seek(0)
        f.truncate()
        f.write("".join(f"{port} {when}\n" for port, when in handed.items()))


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
