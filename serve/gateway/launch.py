"""`dstool serve --cache URL`: Triton on internal ports, the gateway on the ports clients use."""

from __future__ import annotations

import dataclasses
import errno
import socket
from pathlib import Path

from dstool.errors import UsageError
from dstool.serve import triton
from dstool.serve.gateway import GatewayConfig, run_gateway
from dstool.train.launch import free_port


def check_port_free(host: str, port: int) -> None:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise UsageError(f"port {port} on {host} is already in use") from None
            raise UsageError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def serve_cached(repo: str, metrics_port: int, tritonserver: str | None, log_file: str, timeout: float,
                 gateway: GatewayConfig, cache_config: str | None = None, echo=print) -> int:
    """Start Triton on free internal ports of 127.0.0.1 (with `cache_config` as its --cache-config), then the
    gateway on gateway.http_port/grpc_port in front of it, until Ctrl-C/SIGTERM (or until Triton exits);
    Triton is stopped cleanly at the end."""
    if not Path(repo).is_dir():
        raise UsageError(f"repository {repo} does not exist: run dstool export first")
    gateway.check(upstreams_known=False)
    for port in (gateway.http_port, gateway.grpc_port, metrics_port):
        check_port_free(gateway.host if port != metrics_port else "127.0.0.1", port)
    binary = triton.find_tritonserver(tritonserver)
    server = triton.start(Path(repo), binary, free_port(), free_port(), metrics_port, Path(log_file),
                          cache_config=cache_config, timeout=timeout)
    echo(f"dstool serve: Triton ready on internal ports — HTTP {server.http_url}, gRPC {server.grpc_url}, "
         f"metrics 127.0.0.1:{metrics_port}; log: {log_file}")
    config = dataclasses.replace(gateway, upstreams=[server.http_url], upstreams_grpc=[server.grpc_url],
                                 repository=str(Path(repo).resolve()))
    try:
        run_gateway(config, echo, while_true=lambda: server.proc.poll() is None)
    finally:
        code = server.stop()
        echo(f"dstool serve: Triton stopped (exit code {code})")
    return 0
