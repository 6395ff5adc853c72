"""Triton's python-backend stub processes, watched: Triton neither reaps nor restarts a stub that dies (a crash),
answers its model's requests with "Stub process '...' is not healthy." and keeps saying the model is ready. The
watcher sees it die (a zombie Triton did not reap, twice in a row: an unload's stub exits and is reaped at once),
logs one line naming the model and how the stub died, and loads the model again through Triton's repository API
(Triton in explicit model control), with its config as served plus a `dstool_restart` parameter (an identical
config would be taken as already loaded; the gateway's fingerprint leaves the parameter out). Until the new stub
is ready, the model's requests fail (the gateway answers 503 / UNAVAILABLE) or wait for it. If the model cannot be
loaded again, `failure` says why and the watcher stops."""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import psutil

from dstool import log as dlog
from dstool.proc import how_it_ended, process_stat
from dstool.serve.gateway.cache.digests import RESTART_PARAMETER
from dstool.serve.runtime.triton import SHM, TritonProcess

log = dlog.log


@dataclass
class Stub:
    """One stub process as first seen alive (a zombie's command line is empty)."""

    model: str
    instance: str
    shm_region: str
    zombie_scans: int = 0


def stub_of(cmdline: list[str]) -> Stub | None:
    """The stub a command line starts (triton_python_backend_stub MODEL_DIR/VERSION/model.py SHM_REGION ...
    INSTANCE ...), or None for another process."""
    if len(cmdline) < 9 or not cmdline[0].endswith("triton_python_backend_stub"):
        return None
    return Stub(Path(cmdline[1]).parent.parent.name, cmdline[8], cmdline[2])


def exit_code(pid: int) -> int | None:
    """A zombie's exit code as subprocess gives it (negative: the signal that killed it); None if unknown."""
    stat = process_stat(pid)
    try:
        return None if stat is None else os.waitstatus_to_exitcode(int(stat[-1]))
    except ValueError:
        return None


class StubWatcher(threading.Thread):
    """Watches `server`'s stubs every `interval` seconds (in a thread of its own, so a reload blocks nothing else)
    until `stop()`; `failure` is set, and the thread ends, when a model could not be loaded again. The stubs
    running when it is made are known at once."""

    def __init__(self, server: TritonProcess, load_timeout: float, interval: float = 0.5):
        super().__init__(name="dstool-stub-watcher", daemon=True)
        self.server, self.load_timeout, self.interval = server, load_timeout, interval
        self.stubs: dict[int, Stub] = {}
        self.restarts = 0
        self.failure: str | None = None
        self._stopping = threading.Event()
        self.scan()

    def stop(self) -> None:
        self._stopping.set()
        self.join()

    def run(self) -> None:
        while not self._stopping.wait(self.interval) and self.failure is None:
            dead = self.scan()
            for pid, stub in dead:
                code = exit_code(pid)
                how = how_it_ended(code) if code is not None else "died"
                if stub.model:
                    log.warning(f"serve: the stub process of model {stub.model} (pid {pid}, instance "
                                f"{stub.instance}) {how}; loading {stub.model} again")
                else:
                    log.warning(f"serve: a process of Triton (pid {pid}) {how} before it was seen running: its "
                                "model is not known, nothing is loaded again")
            for model in dict.fromkeys(stub.model for _, stub in dead if stub.model):  # once for all its instances
                self.restore(model, [stub.shm_region for _, stub in dead if stub.model == model])
                if self.failure is not None:
                    return

    def scan(self) -> list[tuple[int, Stub]]:
        """The stubs found dead in this scan (and the second scan in a row), each once; records the new ones."""
        try:
            children = psutil.Process(self.server.proc.pid).children()
        except psutil.Error:  # Triton is gone: dstool serve sees it
            return []
        dead = []
        for child in children:
            try:
                if child.status() != psutil.STATUS_ZOMBIE:
                    if child.pid not in self.stubs and (stub := stub_of(child.cmdline())) is not None:
                        self.stubs[child.pid] = stub
                    continue
            except psutil.Error:  # gone between the listing and now: reaped by Triton
                continue
            stub = self.stubs.setdefault(child.pid, Stub("", "", ""))  # a zombie never seen alive: model unknown
            if stub.zombie_scans < 2:
                stub.zombie_scans += 1
                if stub.zombie_scans == 2:
                    dead.append((child.pid, stub))
        alive = {c.pid for c in children}
        self.stubs = {pid: s for pid, s in self.stubs.items() if pid in alive}
        return dead

    def restore(self, model: str, regions: list[str]) -> None:
        """Load `model` again; then remove its dead stubs' shared-memory `regions`."""
        started = time.monotonic()
        self.restarts += 1
        try:
            config = json.loads(self._call("GET", f"/v2/models/{model}/config"))
            config["parameters"] = {**config.get("parameters", {}),
                                    RESTART_PARAMETER: {"string_value": str(self.restarts)}}
            self._call("POST", f"/v2/repository/models/{model}/load",
                       json.dumps({"parameters": {"config": json.dumps(config)}}).encode())
        except (OSError, ValueError) as e:  # dstool serve stops, and says so
            self.failure = f"model {model} could not be loaded again after its stub process died: {e}"
            return
        for region in regions:
            (SHM / region).unlink(missing_ok=True)
        log.info(f"dstool serve: model {model} is loaded again ({time.monotonic() - started:.1f} s)")

    def _call(self, method: str, path: str, body: bytes | None = None) -> bytes:
        """One call to Triton's HTTP API (a connection of its own, closed after: Triton's shutdown waits for open
        ones); OSError naming Triton's answer when it is not a success."""
        request = urllib.request.Request(f"http://{self.server.http_url}{path}", body, method=method)
        try:
            with urllib.request.urlopen(request, timeout=self.load_timeout) as answer:
                return answer.read()
        except urllib.error.HTTPError as e:
            text = e.read().decode(errors="replace")
            try:
                message = str(json.loads(text)["error"])
            except (ValueError, KeyError, TypeError):
                message = text
            first = message.strip().splitlines()[0][:300] if message.strip() else "(no message)"
            raise OSError(f"Triton answered {e.code} to {method} {path}: {first}") from None
