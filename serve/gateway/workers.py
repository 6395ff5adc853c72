"""Several gateway processes on the same ports (`--workers N`): the kernel spreads connections over them
(SO_REUSEPORT, on HTTP and gRPC alike), so hits are answered by N event loops instead of one. Each worker has its
own in-process LRU and connection pools; Redis holds what they share, and /metrics adds up every worker's counts
(prometheus-client's multiprocess mode). This process only supervises: it starts the workers, says ready once all
are, starts a new worker when one dies (a line naming it and how it died), and on SIGINT/SIGTERM passes the signal
on and waits for them to drain. `dstool serve --cache` runs its gateway so, one worker or more."""

from __future__ import annotations

import multiprocessing
import os
import queue
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from prometheus_client import multiprocess

from dstool import log as dlog
from dstool.errors import UsageError
from dstool.proc import free_port, how_it_ended
from dstool.serve.config.gateway_config import GatewayConfig
from dstool.serve.gateway import _run, ready_line

log = dlog.log
START_TIMEOUT = 120.0


def _worker(config: dict, index: int, events, verbose: bool, parent: int, log_file: Path | None) -> None:
    dlog.setup(verbose)
    if log_file is not None:  # the supervisor's: `dstool serve`'s beside Triton's
        dlog.to_file(log_file)
    try:
        code = _run(GatewayConfig(**config), while_true=lambda: os.getppid() == parent, reuse_port=True,
                    started=lambda gateway: events.put(("ready", index, "")))
    except UsageError as e:
        events.put(("usage", index, str(e)))
        code = 2
    except Exception as e:  # reported by the supervisor in one line
        events.put(("error", index, f"{type(e).__name__}: {e}"))
        code = 1
    raise SystemExit(code)


def run_workers(config: GatewayConfig, while_true: Callable[[], bool] | None = None) -> int:

    c = config.model_copy(update={"http_port": config.http_port or free_port(),
                                  "grpc_port": config.grpc_port or free_port()})  # all workers bind the same
    metrics_dir = tempfile.mkdtemp(prefix="dstool-gateway-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # read by the workers as they start
    context = multiprocessing.get_context("spawn")
    events = context.Queue()
    procs: dict[int, multiprocessing.process.BaseProcess] = {}
    stopping: list[int] = []
    previous = {sig: signal.signal(sig, lambda s, _: stopping.append(s)) for sig in (signal.SIGINT, signal.SIGTERM)}

    def start(index: int) -> None:
        procs[index] = context.Process(target=_worker, name=f"dstool-gateway-{index}", args=(
            c.model_dump(), index, events, dlog.verbose(), os.getpid(), dlog.log_file()))
        procs[index].start()

    def stop_all(grace: float) -> None:
        for p in procs.values():
            if p.is_alive() and p.pid is not None:
                os.kill(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace + 10
        for p in procs.values():
            p.join(max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()

    code = 0
    try:
        for i in range(c.workers):
            start(i)
        waiting, deadline = set(procs), time.monotonic() + START_TIMEOUT
        while waiting:
            try:
                kind, index, message = events.get(timeout=0.5)
            except queue.Empty:
                if stopping or time.monotonic() > deadline or any(not procs[i].is_alive() for i in waiting):
                    stop_all(0)
                    if stopping:
                        return 0
                    raise UsageError("gateway workers did not start: see the lines above") from None
                continue
            if kind != "ready":
                stop_all(0)
                if kind == "usage":
                    raise UsageError(message)
                raise RuntimeError(f"gateway worker {index}: {message}")
            waiting.discard(index)
        log.info(ready_line(c, c.http_port, c.grpc_port))
        while not stopping and (while_true is None or while_true()):
            try:
                kind, index, message = events.get(timeout=0.5)
                if kind != "ready":
                    log.error(f"gateway worker {index} could not start again: {message}")
                    code = 1
                    break
            except queue.Empty:
                pass
            for index, p in list(procs.items()):
                if not p.is_alive():
                    who = "the gateway process" if c.workers == 1 else f"worker {index}"
                    log.warning(f"gateway: {who} (pid {p.pid}) {how_it_ended(p.exitcode or 0)}; starting another")
                    multiprocess.mark_process_dead(p.pid)
                    start(index)
        if stopping and c.shutdown_grace:
            log.info(f"dstool gateway: stopping — requests in flight have {c.shutdown_grace:g} s to finish")
        stop_all(c.shutdown_grace if stopping else 0.0)
        log.info("dstool gateway: stopped")
        return code
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
        shutil.rmtree(metrics_dir, ignore_errors=True)
