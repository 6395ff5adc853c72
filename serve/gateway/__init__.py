"""A KServe v2 gateway with a result cache in front of one or more Triton servers, for HTTP and gRPC.

    from dstool.serve.gateway import GatewayConfig, run_gateway
    run_gateway(GatewayConfig(upstreams=["127.0.0.1:8000"], cache="redis://127.0.0.1:6379/0"))

Files: tensors (the protocol-neutral request/result), keys (cache keys), cache (front LRU + Redis),
upstream (HTTP pool to Triton), core (versions, lookup, misses), grpc (the gRPC protocol), transport (the HTTP/1.1
server), kserve (KServe v2's JSON codec), http (the HTTP routes),
generation (Triton's generate extension, cached), protocol + openai (the OpenAI API: typed requests, serving),
auth + guard (tenants' API keys, limits and usage, --auth keys), metrics (Prometheus), workers (several gateway
processes on the same ports).
"""

from __future__ import annotations

import asyncio
import errno
import signal
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from dstool import log as dlog
from dstool.errors import UsageError
from dstool.serve.config.gateway_config import GatewayConfig

if TYPE_CHECKING:
    import grpc

__all__ = ["Gateway", "GatewayConfig", "run_gateway"]
log = dlog.log
GRPC_METADATA_BYTES = 16 << 10  # a call's metadata, all headers together (RESOURCE_EXHAUSTED beyond)


class Gateway:
    """The HTTP and gRPC servers and what they share. `await start()`, then `await stop()`."""

    def __init__(self, config: GatewayConfig, reuse_port: bool = False):
        self.config = config
        self.reuse_port = reuse_port  # one of several worker processes on the same ports
        self._http_server: asyncio.Server | None = None
        self._grpc_server: grpc.aio.Server | None = None

    async def _open_cache(self):
        from dstool.serve.gateway.cache.store import RedisStore, ResultCache  # noqa: PLC0415 (the package's __init__: its modules load when the gateway starts)

        c = self.config
        url, asked = c.cache.chosen()
        self.redis_url = url
        store = None
        if url.is_redis:
            store = RedisStore(url, c.redis_timeout, self.metrics.error, connections=c.max_connections)
            answers = await store.reachable()
            if answers and await store.cluster_node():
                await store.close()
                url = self.redis_url = url.as_cluster()
                store = RedisStore(url, c.redis_timeout, self.metrics.error, connections=c.max_connections)
                answers = await store.reachable()
            if answers:
                kind = "Redis Cluster" if url.kind == "cluster" else "Redis"
                log.info(f"dstool gateway: cache: {kind} {url.redacted()} (front: in-process LRU)")
            elif asked:
                log.warning(f"gateway: Redis {url.redacted()} does not answer; requests go to Triton until it does")
            else:
                await store.close()
                store = None
                log.warning(f"gateway: no --cache given and no Redis answering at {url.redacted()}: using an "
                            "in-process LRU cache (not shared, lost on exit)")

        def held(nbytes: int, entries: int) -> None:
            self.metrics.memory_bytes.set(nbytes)
            self.metrics.memory_entries.set(entries)

        return ResultCache(store, c.cache_ttl, c.max_entry_bytes, c.memory_cache_bytes, self.metrics.error, held)

    async def _open_guard(self):
        """--auth keys: the guard, on a Redis connection of its own (its own timeout back-off)."""
        from dstool.serve.gateway.cache.store import RedisStore  # noqa: PLC0415 (the package's __init__: its modules load when the gateway starts)
        from dstool.serve.gateway.tenancy.guard import Guard  # noqa: PLC0415 (the package's __init__: its modules load when the gateway starts)

        c = self.config
        if c.auth != "keys":
            return None
        if not self.redis_url.is_redis:
            raise UsageError("--auth keys keeps keys, limits and usage in Redis: give --cache a redis:// URL (the "
                             f"cache here is {self.redis_url.redacted()})")
        store = RedisStore(self.redis_url, c.auth_redis_timeout, self.metrics.error,
                           connections=c.max_connections)
        if not await store.reachable():
            message = f"Redis {self.redis_url.redacted()} does not answer: "
            log.warning(message + ("keys validated before are admitted until it does" if c.auth_fallback == "cached"
                                   else "every key is refused until it does"))
        log.info("dstool gateway: --auth keys: tenants' API keys checked in Redis on every request"
                 + (" (--token-file is the admin key)" if c.token else ""))
        return Guard(store, c.token, c.auth_fallback, c.auth_stale, c.limits_fail, self.metrics, c.tenant_concurrency)

    def _response_store(self):
        """The Responses API's store (openai/stored.py): on the cache's Redis, else in this process."""
        from dstool.serve.gateway.openai.stored import MemoryResponses, RedisResponses  # noqa: PLC0415 (the package's __init__: its modules load when the gateway starts)

        c = self.config
        if self.cache.redis is None:
            return MemoryResponses(c.responses_ttl, c.max_response_bytes, c.memory_cache_bytes)
        return RedisResponses(self.redis_url, c.responses_redis_timeout, c.responses_ttl, c.max_response_bytes,
                              c.max_connections)

    async def start(self) -> None:
        import grpc  # noqa: PLC0415 (grpc: loaded when the gateway starts, not with the package)

        from dstool.serve.gateway.core import GatewayCore  # noqa: PLC0415 (the package's __init__: its modules load when the gateway starts)
        from dstool.serve.gateway.http import HttpFrontend  # noqa: PLC0415 (the package's __init__: its modules load when the gateway starts)
        from dstool.serve.gateway.kserve.grpc import GrpcFrontend  # noqa: PLC0415 (the package's __init__: its modules load when the gateway starts)
        from dstool.serve.gateway.metrics import Metrics  # noqa: PLC0415 (the package's __init__: its modules load when the gateway starts)
        from dstool.serve.gateway.transport import HttpConnection, HttpLimits  # noqa: PLC0415 (the package's __init__: its modules load when the gateway starts)
        from dstool.serve.gateway.upstream import Upstreams  # noqa: PLC0415 (the package's __init__: its modules load when the gateway starts)

        c = self.config
        self.metrics = Metrics()
        self.cache = await self._open_cache()
        self.guard = await self._open_guard()
        self.upstreams = Upstreams(c.upstreams, c.upstream_timeout, c.health_timeout)
        self.core = GatewayCore(self.upstreams, self.cache, self.metrics, c.version_check_interval,
                                Path(c.repository) if c.repository else None)
        limits = HttpLimits(**{name: getattr(c, name) for name in HttpLimits.__dataclass_fields__})
        shared = frozenset(c.shared_cache_models)
        self.http_frontend = HttpFrontend(self.core, self.metrics, c.token, limits, c.forward_headers, self.guard,
                                          shared, c.max_tokens_limit)
        self.http_frontend.openai.reasoning_parser = c.reasoning_parser  # DeepSeek's formats (openai/deepseek.py)
        self.http_frontend.openai.tool_call_parser = c.tool_call_parser
        self.http_frontend.openai.responses.store = self._response_store()
        loop = asyncio.get_running_loop()
        try:
            self._http_server = await loop.create_server(lambda: HttpConnection(self.http_frontend), c.host,
                                                         c.http_port, reuse_address=True, backlog=1024,
                                                         reuse_port=self.reuse_port)
        except OSError as e:
            raise UsageError(_bind_error(c.host, c.http_port, e)) from None
        self.http_port = self._http_server.sockets[0].getsockname()[1]
        self.grpc_frontend = GrpcFrontend(self.core, self.metrics, c.grpc_targets(), c.token, c.upstream_timeout,
                                          c.health_timeout, c.forward_headers, self.guard, shared)
        self._grpc_server = grpc.aio.server(options=[("grpc.so_reuseport", int(self.reuse_port)),
                                                     ("grpc.max_receive_message_length", c.max_request_bytes),
                                                     ("grpc.max_send_message_length", -1),
                                                     # one bound, not grpc's band (8-16 KiB) where metadata is
                                                     # refused at random: below it a call reaches the key check
                                                     ("grpc.max_metadata_size", GRPC_METADATA_BYTES),
                                                     ("grpc.absolute_max_metadata_size", GRPC_METADATA_BYTES)])
        self._grpc_server.add_generic_rpc_handlers((self.grpc_frontend,))
        try:
            self.grpc_port = self._grpc_server.add_insecure_port(f"{c.host}:{c.grpc_port}")
        except RuntimeError as e:
            await self.stop()
            raise UsageError(_bind_error(c.host, c.grpc_port, OSError(errno.EADDRINUSE, str(e)))) from None
        await self._grpc_server.start()
        if not self.reuse_port:
            log.info(ready_line(c, self.http_port, self.grpc_port))

    async def stop(self, grace: float = 0.0) -> None:
        """Drain, then stop: no new connection or call is accepted, idle HTTP connections close, requests in flight
        get up to `grace` seconds to finish (their answers close the connection), then everything closes."""
        http_server, grpc_server = self._http_server, self._grpc_server
        self._http_server = self._grpc_server = None
        if http_server is not None:
            self.http_frontend.draining = True
            http_server.close()  # no new connections
            for conn in list(self.http_frontend.connections):
                if conn.idle():
                    conn._close()
        if grpc_server is not None:
            grpc_stopped = asyncio.ensure_future(grpc_server.stop(grace))  # new calls refused, in-flight ones finish
        deadline = asyncio.get_running_loop().time() + grace
        while http_server is not None and self.http_frontend.connections \
                and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        if grpc_server is not None:
            await grpc_stopped
            await self.grpc_frontend.close()
        if http_server is not None:
            for conn in list(self.http_frontend.connections):
                conn._close()
            # background responses: what is left of the grace to finish, then stored as failed
            await self.http_frontend.openai.responses.close(max(0.0, deadline - asyncio.get_running_loop().time()))
            self.upstreams.close()
            await self.cache.close()
            if self.guard is not None:
                await self.guard.close()
                await self.guard.store.close()


def ready_line(c: GatewayConfig, http_port: int, grpc_port: int) -> str:
    workers = f"; {c.workers} worker processes" if c.workers > 1 else ""
    return (f"dstool gateway: ready — HTTP {c.host}:{http_port}, gRPC {c.host}:{grpc_port}, metrics "
            f"http://{c.host}:{http_port}/metrics; upstream Triton {', '.join(c.upstreams)}; TTL {c.cache_ttl:g} s"
            + ("; tenants' API keys required" if c.auth == "keys" else "; bearer token required" if c.token else "")
            + workers)


def _bind_error(host: str, port: int, e: OSError) -> str:
    if e.errno == errno.EADDRINUSE:
        return f"port {port} on {host} is already in use"
    return f"cannot listen on {host}:{port}: {e.strerror or e}"


def event_loop_policy():
    """uvloop when installed, else asyncio's default. Measured here for cache hits (wrk, 16 connections):
    the gateway's own HTTP server 7,700 vs 8,200 requests/s (a tie within this loaded machine's noise), the
    same frontend behind aiohttp 7,400 vs 4,000; a bare grpc.aio echo server flipped between runs (2,600 vs
    4,600, then 5,000 vs 2,800 requests/s with h2load). Kept for the HTTP side, where it never lost."""
    try:
        import uvloop  # noqa: PLC0415 (optional: asyncio's own loop without uvloop)
    except ImportError:
        return asyncio.DefaultEventLoopPolicy()
    return uvloop.EventLoopPolicy()


def run_gateway(config: GatewayConfig, while_true: Callable[[], bool] | None = None) -> int:
    """Run the gateway until SIGINT/SIGTERM (or until `while_true()`, checked twice a second, is false); with
    `config.workers` > 1, as that many processes on the same ports (see `dstool.serve.gateway.workers`)."""
    if config.workers > 1:
        from dstool.serve.gateway.workers import run_workers  # noqa: PLC0415 (a cycle: dstool.serve.gateway.workers imports this package)

        return run_workers(config, while_true)
    return _run(config, while_true)


def _run(config: GatewayConfig, while_true: Callable[[], bool] | None = None, reuse_port: bool = False,
         started: Callable[[Gateway], None] | None = None) -> int:
    async def main() -> int:
        gateway = Gateway(config, reuse_port)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await gateway.start()
        if started is not None:
            started(gateway)
        try:
            while not stop.is_set() and (while_true is None or while_true()):
                try:
                    await asyncio.wait_for(stop.wait(), 0.5)
                except asyncio.TimeoutError:
                    pass
        finally:
            drain = config.shutdown_grace if stop.is_set() else 0.0  # Triton gone: nothing left to finish
            if drain and not reuse_port:
                log.info(f"dstool gateway: stopping — requests in flight have {drain:g} s to finish")
            await gateway.stop(drain)
        if not reuse_port:
            log.info("dstool gateway: stopped")
        return 0

    asyncio.set_event_loop_policy(event_loop_policy())
    return asyncio.run(main())
