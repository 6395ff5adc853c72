"""`serve(config)`: what `dstool serve` does, callable from Python — a real Triton on a repository, alone or
behind the cache gateway, until Ctrl-C/SIGTERM. This process supervises: the gateway runs in processes of its own
(restarted when one dies), Triton's python-backend stubs are watched (a model whose stub died is loaded again),
and Triton is cleaned up after by its janitor if this process dies. Triton dying on its own, or a model that
cannot be loaded again, is a failure (exit 1), so a supervisor that restarts on failure restarts it."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

from dstool import log as dlog
from dstool.errors import EngineFailed, UsageError
from dstool.proc import check_port_free, free_port
from dstool.serve.config.serve_config import ServeConfig
from dstool.serve.gateway.workers import run_workers
from dstool.serve.runtime import triton
from dstool.serve.runtime.stubs import StubWatcher

log = dlog.log


def serve(cfg: ServeConfig) -> int:
    """Start Triton (and the gateway with `cfg.cache`), block until a stop signal; 0 after a clean stop."""
    repo = Path(cfg.repository)
    if not repo.is_dir():
        raise UsageError(f"repository {repo} does not exist: run dstool export first")
    cached = cfg.cache is not None
    for port, host in ((cfg.http_port, cfg.host if cached else "127.0.0.1"),
                       (cfg.grpc_port, cfg.host if cached else "127.0.0.1"), (cfg.metrics_port, "127.0.0.1")):
        check_port_free(host, port)
    dlog.to_file(Path(cfg.log_file).with_name("dstool-serve.log"))  # beside Triton's own log
    binary = triton.find_tritonserver(cfg.tritonserver)
    ports = (free_port(), free_port()) if cached else (cfg.http_port, cfg.grpc_port)
    # Explicit model control, every model loaded at start: the stub watcher can load a model again.
    server = triton.start(repo, binary, *ports, cfg.metrics_port, Path(cfg.log_file), cache_config=cfg.cache_config,
                          timeout=cfg.timeout, extra_args=["--model-control-mode=explicit", "--load-model=*"])
    watcher = StubWatcher(server, cfg.timeout)
    watcher.start()
    where = "on internal ports " if cached else ""
    log.info(f"dstool serve: Triton ready {where}— HTTP {server.http_url}, gRPC {server.grpc_url}, metrics "
             f"127.0.0.1:{cfg.metrics_port}; log: {cfg.log_file}" + ("" if cached else "; Ctrl-C to stop"))

    def healthy() -> bool:
        return server.proc.poll() is None and watcher.failure is None

    stopped_by_us, gateway_code = False, 0
    try:
        if cached:
            gateway_code = run_workers(cfg.gateway(server.http_url, server.grpc_url), while_true=healthy)
        else:
            stop = threading.Event()
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda *_: stop.set())
            while not stop.is_set() and healthy():
                stop.wait(0.5)
        stopped_by_us = server.proc.poll() is None
    finally:
        watcher.stop()
        code = server.stop()
        log.info(f"dstool serve: Triton stopped (exit code {code})")
    if not stopped_by_us:
        raise EngineFailed(f"Triton exited on its own with code {code}; last log lines: {server.log_tail(3)!r}",
                           log=cfg.log_file)
    if watcher.failure is not None:
        raise EngineFailed(watcher.failure, log=cfg.log_file)
    if gateway_code != 0:
        raise EngineFailed("the gateway could not start again: see the lines above",
                           log=Path(cfg.log_file).with_name("dstool-serve.log"))
    return 0
