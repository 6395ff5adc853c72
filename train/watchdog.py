"""Liveness across nodes while the ranks run, so that no node waits forever for one that is gone.

The first rank of every node bumps its node's counter in the run's store (the TCPStore at MASTER_ADDR:MASTER_PORT,
beside rank 0) every few seconds, from a thread; node 0 reads every node's counter. A node whose counter stands
still for --comm-timeout-s (its host stopped, its link cut for good, its ranks killed) is named in the store's abort
key and in failure.json (by the host name every rank shared when the process group formed), and every node's ranks
exit; a node that cannot reach the store for that long, or finds it gone (connection refused), exits too, naming the
master. A rank that exits before the run ends (an exception) posts the abort itself, and a failure.json written in
the shared run folder stops the other nodes as well, so a failed node stops the others at once. Under torchrun
--max-restarts the elastic agents already restart every node's ranks together after a failure: there neither signal
is used, and only node 0's ranks stop on a silent node (its agent then waits for it in the next rendezvous).
"""

from __future__ import annotations

import atexit
import functools
import os
import socket
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from dstool import log as dlog
from dstool.files import write_json_atomic

log = dlog.log
# Every node's ranks reach this point within seconds of each other (their launchers start them together): a node
# that has not reported this long after this one started is not coming.
STARTUP_GRACE_S = 120.0


class Watch:
    """This rank's part: the heartbeat thread (first rank of a node) and the exit hook (every rank)."""

    def __init__(self, out: Path, timeout_s: float, prefix: str, elastic: bool):
        env = os.environ
        self.out, self.timeout_s, self.prefix, self.elastic = out, timeout_s, prefix, elastic
        self.rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        self.per_node = int(env.get("LOCAL_WORLD_SIZE") or env.get("LOCAL_SIZE") or world)
        self.node, self.nodes = self.rank // self.per_node, max(1, world // self.per_node)
        self.master = (env["MASTER_ADDR"], int(env["MASTER_PORT"]))
        self.host = socket.gethostname()
        self.interval = min(5.0, max(0.5, timeout_s / 4))
        # when the process group formed (`joined`; a clean end destroys it again): every node was there then, and
        # reached the store
        self.joined_at: float | None = None
        self.hosts: list[str] = []  # every node's host name, from the process group
        self._store = None
        self._failure = _stat(out / "failure.json")  # one written from now on means a rank failed
        self._done, self._wake = threading.Event(), threading.Event()
        atexit.register(self._at_exit)
        if int(env.get("LOCAL_RANK", "0")) == 0 and self.nodes > 1:
            threading.Thread(target=self._run, name="dstool-watchdog", daemon=True).start()

    def joined(self, hosts: list[str]) -> None:
        """The process group formed; `hosts`: every rank's host name. From now on a silent node has no start-up
        grace (it was there), and this thread beats at once."""
        self.hosts = hosts[::self.per_node]
        self.joined_at = time.monotonic()
        self._wake.set()

    def _key(self, what: str, node: int | None = None) -> str:
        return f"{self.prefix}/watchdog/{what}" + ("" if node is None else f"/{node}")

    def _connect(self, timeout_s: float):
        """A store client of this thread's own, or None while the master does not answer (a plain socket tries
        first: a failed TCPStore connect prints pages of C++ errors). ConnectionRefusedError: the master's host
        answers but nothing listens there any more."""
        if self._store is None:
            try:
                socket.create_connection(self.master, timeout=timeout_s).close()
            except ConnectionRefusedError:
                raise
            except OSError:
                return None
            self._store = dist.TCPStore(*self.master, is_master=False, timeout=timedelta(seconds=timeout_s))
        return self._store

    def _run(self) -> None:
        started = time.monotonic()
        contact = None  # when the store last answered
        refused = 0  # rounds in a row the master's host refused the connection since then
        seen: dict[int, tuple[int, float]] = {}  # node -> (its counter, when it last moved)
        while not self._done.is_set():
            if self.joined_at is not None and not dist.is_initialized():
                return  # this rank ended cleanly: the others may be gone already
            if not self.elastic and _stat(self.out / "failure.json") not in (None, self._failure):
                self._stop("another rank failed (failure.json)", post=False)  # e.g. rank 0 before anyone's beat
            now = time.monotonic()
            try:
                news = _bounded(functools.partial(self._beat, contact is None, now, seen), 2 * self.interval)
                refused = 0
            except ConnectionRefusedError:
                self._store, news, refused = None, None, refused + 1
            except Exception:  # noqa: BLE001 - no answer, or a lost connection: a fresh client next time
                self._store, news = None, None
            if refused >= 2 and contact is not None:  # the store went with the process that held it
                self._stop(f"the run's store at {self.master[0]}:{self.master[1]} is gone (connection refused): the "
                           "process holding it (rank 0, or node 0's torchrun agent) has ended", post=False)
            if news is not None:
                contact = now
                if news:
                    self._stop(*news)
            heard = max(contact or 0.0, self.joined_at or 0.0) or None  # joining took the store
            waited = now - (heard or started)
            if waited > max(self.timeout_s, STARTUP_GRACE_S if heard is None else 0) + self.interval:
                # later than node 0 would be: when node 0 still runs, its message (naming this host) comes first
                self._stop(f"host {self.host} (node {self.node}) lost contact with the master {self.master[0]}:"
                           f"{self.master[1]} (rank 0's host) for {waited:.0f} s: the network between them is down "
                           f"or that host stopped (--comm-timeout-s {self.timeout_s:g})", post=False)
            self._wake.wait(self.interval)
            self._wake.clear()

    def _beat(self, first: bool, now: float, seen: dict[int, tuple[int, float]]) -> tuple | None:
        """One round with the store: this node's beat, an abort another node posted, and on node 0 every node's
        silence. None when the master does not answer; else () or the arguments of `_stop`."""
        store = self._connect(self.interval)
        if store is None:
            return None
        if first:
            store.set(self._key("host", self.node), self.host)
        store.add(self._key("beat", self.node), 1)
        if store.check([self._key("abort")]):
            return store.get(self._key("abort")).decode(), False
        silent = []
        for n in range(1, self.nodes) if self.node == 0 else ():
            count = store.add(self._key("beat", n), 0)
            if n not in seen or seen[n][0] != count:
                seen[n] = (count, now)
            since = max(seen[n][1], self.joined_at or 0.0)
            limit = self.timeout_s if count or self.joined_at else max(self.timeout_s, STARTUP_GRACE_S)
            if now - since > limit and not store.check([self._key("done", n)]):
                name = (self.hosts[n] if n < len(self.hosts) else
                        store.get(self._key("host", n)).decode() if count else "never reported")
                silent.append(f"host {name} (node {n}, rank(s) {n * self.per_node}-{(n + 1) * self.per_node - 1})")
        if silent:
            return (f"{', '.join(silent)} went silent: no heartbeat for {self.timeout_s:g} s (host down or its "
                    "network cut; --comm-timeout-s); every node stops", True)
        return ()

    def _stop(self, message: str, post: bool) -> None:
        """Record why, tell the other nodes (unless elastic: the agents restart everyone), end this process."""
        log.error(f"dstool: {message}")
        if not (self.out / "failure.json").exists():
            write_json_atomic(self.out / "failure.json", {"message": message})
        if post and not self.elastic:
            self._post_abort(message)
        os._exit(1)

    def _post_abort(self, message: str) -> None:
        try:
            if _bounded(lambda: self._set("abort", message), 3.0) and self.rank == 0:
                time.sleep(self.interval + 1)  # the store lives in this process: let the others read it first
        except Exception:  # noqa: BLE001 - they find out from the silence instead
            pass

    def _set(self, what: str, value: str) -> bool:
        self._store = None  # a fresh client: the thread's may be mid-request
        store = self._connect(2.0)
        if store is not None:
            store.set(self._key(what), value)
        return store is not None

    def _at_exit(self) -> None:
        """A clean end (the process group was destroyed) marks this node done; any other exit tells the others."""
        self._done.set()
        self._wake.set()
        clean = self.joined_at is not None and not dist.is_initialized()
        if clean and self.nodes > 1 and int(os.environ.get("LOCAL_RANK", "0")) == 0:
            try:
                _bounded(lambda: self._set(f"done/{self.node}", "1"), 3.0)
            except Exception:  # noqa: BLE001 - rank 0 may have ended first, taking the store along
                pass
        elif not clean and self.nodes > 1 and not self.elastic:
            reason = f"rank {self.rank} on host {self.host} exited before the run ended"
            self._post_abort(f"{reason} (see failure.json and its log)")


def _stat(path: Path) -> tuple[int, int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


def _bounded(fn, timeout_s: float):
    """fn() in a thread of its own: its result, or TimeoutError when it has not returned within `timeout_s` (a
    TCPStore call whose peer vanished waits for good; that thread is left to it)."""
    result: dict = {}

    def call() -> None:
        try:
            result["value"] = fn()
        except Exception as e:  # noqa: BLE001 - raised again in the caller
            result["error"] = e

    thread = threading.Thread(target=call, daemon=True)
    try:
        thread.start()
    except RuntimeError:  # at interpreter exit Python 3.12+ starts no thread: call it here, unbounded
        call()
    else:
        thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"no answer within {timeout_s:g} s")
    if "error" in result:
        raise result["error"]
    return result.get("value")
