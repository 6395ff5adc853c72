"""`serve(config)`: what `dstool serve` does, callable from Python — a real Triton on a repository, alone or
behind the cache gateway, until Ctrl-C/SIGTERM. Triton dying on its own is a failure (exit 1), so a
supervisor that restarts on failure restarts it."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

from dstool import log as dlog
from dstool.errors import EngineFailed, UsageError
from dstool.proc import check_port_free, free_port
from dstool.serve.config import ServeConfig
from dstool.serve.runtime import triton

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
    server = triton.start(repo, binary, *ports, cfg.metrics_port, Path(cfg.log_file), cache_config=cfg.cache_config,
                          timeout=cfg.timeout)
    where = "on internal ports " if cached else ""
    log.info(f"dstool serve: Triton ready {where}— HTTP {server.http_url}, gRPC {server.grpc_url}, metrics "
             f"127.0.0.1:{cfg.metrics_port}; log: {cfg.log_file}" + ("" if cached else "; Ctrl-C to stop"))
    stopped_by_us = False
    try:
        if cached:
            from dstool.serve.gateway import run_gateway

            run_gateway(cfg.gateway(server.http_url, server.grpc_url), while_true=lambda: server.proc.poll() is None)
        else:
            stop = threading.Event()
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda *_: stop.set())
            while not stop.is_set() and server.proc.poll() is None:
                stop.wait(0.5)
        stopped_by_us = server.proc.poll() is None
    finally:
        code = server.stop()
        log.info(f"dstool serve: Triton stopped (exit code {code})")
    if not stopped_by_us:
        raise EngineFailed(f"Triton exited on its own with code {code}; last log lines: {server.log_tail(3)!r}",
                           log=cfg.log_file)
    return 0
