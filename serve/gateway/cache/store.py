"""Result storage: an in-process LRU in front of Redis (the store shared by every gateway process).

The front LRU answers repeated requests without a network round trip; Redis makes entries survive a
gateway restart and shares them between gateways. Redis failures never fail a request: a failed or slow
(timed-out) Redis call counts as a miss, Redis is skipped for a short back-off, and redis-py reconnects
on the next call after it. Entries carry their own expiry time and a CRC, so an entry that does not
decode is dropped and recomputed.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field

import orjson

from dstool.serve.cache_url import CacheURL
from dstool.serve.gateway.tensors import InferResult, Tensor
from dstool.serve.gateway.upstream import within

log = logging.getLogger("dstool.gateway")
MAGIC = b"DSG1"
WARN_EVERY = 10.0  # seconds between warnings that Redis failed
STARTUP_S = 5.0  # seconds the gateway's start waits for a first answer from a Redis that times out


class CorruptEntry(Exception):
    """A stored value that is not a complete, intact encoded result."""


def encode(result: InferResult, expires_at: float) -> bytes:
    """Header (JSON: expiry, model, version, output names/types/shapes/sizes) + raw outputs + CRC32."""
    header = orjson.dumps({"expires_at": expires_at, "model_name": result.model_name,
                           "model_version": result.model_version, "parameters": result.parameters,
                           "outputs": [[t.name, t.datatype, t.shape, len(t.raw)] for t in result.outputs]})
    body = b"".join([MAGIC, struct.pack("<I", len(header)), header, *(t.raw for t in result.outputs)])
    return body + struct.pack("<I", zlib.crc32(body))


def decode(blob: bytes) -> tuple[InferResult, float]:
    """(result, expires_at) from `encode`'s bytes; CorruptEntry if anything does not add up."""
    try:
        if blob[:4] != MAGIC or struct.unpack("<I", blob[-4:])[0] != zlib.crc32(blob[:-4]):
            raise CorruptEntry("bad magic or checksum")
        (n,) = struct.unpack_from("<I", blob, 4)
        header = orjson.loads(blob[8:8 + n])
        offset, outputs = 8 + n, []
        for name, datatype, shape, size in header["outputs"]:
            outputs.append(Tensor(name, datatype, tuple(shape), blob[offset:offset + size]))
            offset += size
        if offset != len(blob) - 4:
            raise CorruptEntry("sizes do not add up")
        result = InferResult(header["model_name"], header["model_version"], outputs, header["parameters"])
        return result, float(header["expires_at"])
    except CorruptEntry:
        raise
    except Exception as e:  # truncated or foreign bytes: any parse error means the same
        raise CorruptEntry(f"{type(e).__name__}: {e}") from None


# What an entry costs besides its bytes (the objects holding them, its key): counted so that many tiny
# results cannot exceed the bound either.
ENTRY_OVERHEAD = 512


@dataclass(slots=True, eq=False)
class Entry:
    result: InferResult
    expires_at: float  # time.time() seconds
    size: int  # bytes counted against the in-process bound: outputs, renderings, overhead
    rendered: dict = field(default_factory=dict)  # protocol-specific encodings, built on first use
    owner: MemoryLRU | None = None  # the LRU that holds it (None once evicted)

    def keep(self, form, value, nbytes: int) -> None:
        """Keep a rendering of the result for the next hit, counting its `nbytes` against the bound."""
        self.rendered[form] = value
        if self.owner is not None:
            self.owner.grow(self, nbytes)


class MemoryLRU:
    """Entries up to `max_bytes` in total — results and every rendering kept with them — least recently used
    evicted first, expired ones dropped on read."""

    def __init__(self, max_bytes: int, on_change=lambda nbytes, entries: None):
        self.max_bytes = max_bytes
        self.bytes = 0
        self.on_change = on_change
        self._entries: OrderedDict[str, Entry] = OrderedDict()

    def get(self, key: str) -> Entry | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry.expires_at <= time.time():
            self.pop(key)
            return None
        self._entries.move_to_end(key)
        return entry

    def put(self, key: str, entry: Entry) -> None:
        self.pop(key)
        if entry.size > self.max_bytes:
            return
        self._entries[key] = entry
        entry.owner = self
        self.bytes += entry.size
        self._evict()

    def grow(self, entry: Entry, nbytes: int) -> None:
        entry.size += nbytes
        if entry.owner is self:
            self.bytes += nbytes
            self._evict()

    def pop(self, key: str) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self._forget(old)
            self.on_change(self.bytes, len(self._entries))

    def _forget(self, entry: Entry) -> None:
        self.bytes -= entry.size
        entry.owner = None

    def _evict(self) -> None:
        while self.bytes > self.max_bytes and self._entries:
            _, old = self._entries.popitem(last=False)
            self._forget(old)
        self.on_change(self.bytes, len(self._entries))


class RedisStore:
    """GET/SET on Redis with a per-call timeout; after a failure Redis is skipped for a back-off that doubles
    up to `max_backoff` while it keeps failing."""

    def __init__(self, url: CacheURL, timeout: float, on_error=lambda kind: None, max_backoff: float = 5.0,
                 connections: int = 1024):
        self.client = _client(url, timeout, connections)
        self.url = url
        self.on_error = on_error
        self.max_backoff = max_backoff
        self.down_until = 0.0
        self.backoff = 0.0
        self.warned, self.warned_at = False, -WARN_EVERY

    @property
    def available(self) -> bool:
        return time.monotonic() >= self.down_until

    def _failed(self, e: BaseException) -> None:
        now = time.monotonic()
        # one warning per outage, and at most one a WARN_EVERY seconds (a cluster's failover fails some calls, not all)
        if self.backoff == 0.0 and not self.warned and now - self.warned_at > WARN_EVERY:
            log.warning("redis %s failed (%s: %s): serving from Triton until it answers again",
                        self.url.redacted(), type(e).__name__, e)
            self.warned, self.warned_at = True, now
        self.backoff = min(self.max_backoff, max(0.1, self.backoff * 2))
        self.down_until = now + self.backoff
        self.on_error("redis")

    def _succeeded(self) -> None:
        if self.warned:
            log.warning("redis %s answers again", self.url.redacted())
            self.warned = False
        self.backoff = 0.0

    async def call(self, method: str, *args):
        """The command's reply, or None when Redis is skipped, fails or times out."""
        if not self.available:
            return None
        try:
            reply = await within(getattr(self.client, method)(*args), None)  # cancellable, whatever redis-py does
        except Exception as e:  # redis.RedisError, socket errors and timeouts alike
            self._failed(e)
            return None
        self._succeeded()
        return reply

    async def ping(self) -> bool:
        return bool(await self.call("ping"))

    async def reachable(self, within_s: float = STARTUP_S) -> bool:
        """Whether Redis answers a PING: the gateway's start, which retries a timed-out one for up to `within_s`
        (a loaded machine's first connection, a TLS handshake, may outlast a call's timeout) and says nothing; a
        refused connection or another error answers at once."""
        from redis.exceptions import TimeoutError as RedisTimeout  # noqa: PLC0415 (redis-py loads with the client)

        deadline = time.monotonic() + within_s
        while True:
            try:
                if await within(self.client.ping(), None):
                    self._succeeded()
                    return True
            except (RedisTimeout, asyncio.TimeoutError, TimeoutError):
                if time.monotonic() < deadline:
                    continue
            except Exception:  # refused, a bad password, TLS refused: nothing to wait for
                pass
            return await self.ping()  # as a request would see it: counted, warned about, backed off

    async def cluster_node(self) -> bool:
        """Whether a redis:// URL names a node of a Redis Cluster (then keys must go by the cluster's slot map)."""
        if self.url.kind == "cluster":
            return False
        info = await self.call("info", "cluster")
        return bool(info and info.get("cluster_enabled"))

    async def close(self) -> None:
        await self.client.aclose()


def _client(url: CacheURL, timeout: float, connections: int):
    """A redis-py asyncio client of `url`: a RedisCluster for redis+cluster:// (keys go to their slot's master; after
    a failover the slot map is read again), else a plain client. Up to `connections` at once (a node): redis-py's
    default pool fails the 101st concurrent call ("Too many connections"), which read as an outage would send every
    request past the cache; the plain client's pool makes a call beyond them wait, up to `timeout`, for a free one."""
    import redis.asyncio as redis
    from redis.asyncio.cluster import ClusterNode, RedisCluster
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    # No redis-py retries: a request must not wait for several timeouts before going to Triton.
    common = {"socket_timeout": timeout, "socket_connect_timeout": timeout, "retry": Retry(NoBackoff(), 0)}
    if url.kind != "cluster":
        pool = redis.BlockingConnectionPool.from_url(url.text, max_connections=connections, timeout=timeout, **common)
        return redis.Redis.from_pool(pool)  # closed with the client
    return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in url.nodes], username=url.username,
                        password=url.password, ssl=url.tls, ssl_ca_certs=url.ca_certs, cluster_error_retry_attempts=0,
                        max_connections=connections, **common)


class ResultCache:
    """Front LRU + optional Redis. `ttl` seconds per entry; results larger than `max_entry_bytes` are not kept."""

    def __init__(self, redis_store: RedisStore | None, ttl: float, max_entry_bytes: int, memory_bytes: int,
                 on_error=lambda kind: None, on_change=lambda nbytes, entries: None):
        self.redis = redis_store
        self.ttl = ttl
        self.max_entry_bytes = max_entry_bytes
        self.front = MemoryLRU(memory_bytes, on_change)
        self.on_error = on_error
        self._writes: set[asyncio.Task] = set()

    def get_front(self, key: str) -> Entry | None:
        return self.front.get(key)

    async def get(self, key: str) -> Entry | None:
        entry = self.front.get(key)
        if entry is not None or self.redis is None:
            return entry
        blob = await self.redis.call("get", key)
        if blob is None:
            return None
        try:
            result, expires_at = decode(blob)
        except CorruptEntry as e:
            log.warning("dropping undecodable cache entry %s (%s)", key, e)
            self.on_error("corrupt_entry")
            self._spawn(self.redis.call("delete", key))
            return None
        entry = Entry(result, expires_at, len(blob) + ENTRY_OVERHEAD)
        self.front.put(key, entry)
        return entry

    def put(self, key: str, result: InferResult) -> Entry | None:
        """Keep `result` (front at once, Redis in the background); None if it is larger than allowed."""
        size = sum(len(t.raw) for t in result.outputs)
        if size > self.max_entry_bytes:
            return None
        expires_at = time.time() + self.ttl
        entry = Entry(result, expires_at, size + ENTRY_OVERHEAD)
        self.front.put(key, entry)
        if self.redis is not None and self.redis.available:
            self._spawn(self.redis.call("set", key, encode(result, expires_at), None, max(1, int(self.ttl * 1000))))
        return entry

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def drain(self) -> None:
        """Wait for background Redis writes (used on shutdown and by tests)."""
        while self._writes:
            await asyncio.gather(*list(self._writes), return_exceptions=True)

    async def close(self) -> None:
        await self.drain()
        if self.redis is not None:
            await self.redis.close()
