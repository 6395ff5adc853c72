"""Cached text generation: Triton's generate extension (`/v2/models/NAME/generate` and `generate_stream`), and
through it the OpenAI routes.

A generation request is cacheable when its answer is a function of the request: greedy, or sampling with a
`seed` (a draw without one never is, keys.is_draw). Its key covers the served version's fingerprint, the route,
the whole request body (the prompt, every input and every sampling parameter) and the forwarded headers. A miss
goes to Triton and reaches the client as Triton sends it — event by event for a stream — while the events are
recorded; an answer that ended without an error, within the entry size bound, is kept (as a result whose outputs
are the events, so it shares the cache's memory bound, Redis and checksums). A hit replays the recorded events
as they came: a stream is answered as a stream. Identical misses running at the same time each go to Triton
(a stream is not shared between clients).
"""

from __future__ import annotations

import hashlib
import struct
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass

import orjson

from dstool.serve.gateway.core import GatewayCore, addressable, model_path, served_version
from dstool.serve.gateway.keys import PREFIX, is_draw, key_fingerprint
from dstool.serve.gateway.metrics import Metrics
from dstool.serve.gateway.tensors import GatewayError, InferResult, Tensor


@dataclass(slots=True)
class Generation:
    """Triton's answer to one generate request: status, headers, and its body as events (one for `generate`,
    one per server-sent event for `generate_stream`, each without its blank-line separator)."""

    status: int
    headers: list[tuple[str, str]]
    events: AsyncGenerator[bytes, None]


def data(event: bytes) -> dict | None:
    """The JSON object a server-sent event carries, or None for a comment or keep-alive."""
    return _json(event[len(b"data: "):]) if event.startswith(b"data: ") else None


class GenerationCache:
    def __init__(self, core: GatewayCore, metrics: Metrics):
        self.core = core
        self.metrics = metrics

    async def key(self, model: str, version: str, route: str, body: bytes,
                  headers: tuple[tuple[str, str], ...]) -> tuple[str | None, str]:
        """(the cache key, or None when the request goes to Triton uncached; the version that serves it)."""
        if not addressable(model):
            return None, ""
        try:
            request = orjson.loads(body)
        except orjson.JSONDecodeError:
            return None, ""  # Triton's own error answers it
        if not isinstance(request, dict) or is_draw(request):
            return None, ""
        try:
            d = await self.core.deployments.get(model)
        except GatewayError:
            return None, ""  # Triton does not serve it: its own answer says so
        served = served_version(d, version)
        fingerprint = d.fingerprint(served) if served else None
        if served is None or fingerprint is None or "sequence_batching" in d.config:
            return None, served or ""
        blob = orjson.dumps([route, model, served, request, list(headers)], option=orjson.OPT_SORT_KEYS)
        h = hashlib.blake2b(struct.pack("<I", len(blob)) + blob, digest_size=32)
        return f"{PREFIX}:gen:{model}:{fingerprint}:{h.hexdigest()}", served

    async def open(self, model: str, version: str, route: str, body: bytes,
                   headers: tuple[tuple[str, str], ...] = (("Content-Type", "application/json"),),
                   keyed: tuple[tuple[str, str], ...] = (), opt_out: bool = False,
                   protocol: str = "http") -> Generation:
        """Answer a generate request from the cache or from Triton (recording a cacheable miss); `headers` go to
        Triton, `keyed` (those Triton passes on to the model) are part of the key. Counted in the gateway's metrics
        under `protocol` (the time to the answer's head)."""
        started = time.perf_counter()
        key, served = (None, "") if opt_out else await self.key(model, version, route, body, keyed)
        if key is not None:
            entry = await self.core.lookup(key)
            if entry is not None:
                self.metrics.observe(model, protocol, "hit", time.perf_counter() - started,
                                     sum(len(t.raw) for t in entry.result.outputs))
                return Generation(200, list(entry.result.parameters["headers"]), _replay(entry.result))
        path = model_path(model) + (f"/versions/{version}" if version else "") + "/" + route
        r = await self.core.upstreams.open("POST", path, body, headers)
        passed = [("Content-Type", r.headers["content-type"])] if "content-type" in r.headers else []
        outcome = "error" if r.status != 200 else "miss" if key else "bypass"
        self.metrics.observe(model, protocol, outcome, time.perf_counter() - started)
        if not r.streaming:
            whole = await r.read()
            if key is not None and r.status == 200:
                self._store(key, served, model, passed, [whole])
            return Generation(r.status, passed, _one(whole))
        return Generation(r.status, passed, self._relay(r, key, served, model, passed))

    async def _relay(self, r, key: str | None, served: str, model: str, headers) -> AsyncGenerator[bytes, None]:
        """Triton's events as they come; a complete, error-free stream within the size bound is kept."""
        recorded: list[bytes] | None = [] if key is not None else None
        size, limit = 0, self.core.cache.max_entry_bytes
        buffer = b""
        async for part in r.chunks():
            buffer += part
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                if recorded is not None:
                    size += len(event)
                    if size > limit or "error" in (data(event) or {}):
                        recorded = None
                    else:
                        recorded.append(event)
                yield event
        if buffer:
            recorded = None  # a stream that did not end on an event boundary is not complete
            yield buffer
        if recorded is not None and key is not None:
            self._store(key, served, model, headers, recorded)

    def _store(self, key: str, version: str, model: str, headers, events: list[bytes]) -> None:
        if not self.core.deployments.still_loaded_from(model, version, key_fingerprint(key)):
            return
        for event in events:  # an answer from another version than the one keyed is not kept
            d = data(event) or _json(event)
            if d is not None and str(d.get("model_version", version)) != version:
                self.core.deployments.invalidate(model)
                return
        result = InferResult(model, version, [Tensor("event", "BYTES", (1,), e) for e in events],
                             {"headers": headers})
        self.core.cache.put(key, result)


def _json(body: bytes) -> dict | None:
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


async def _one(body: bytes) -> AsyncGenerator[bytes, None]:
    yield body


async def _replay(result: InferResult) -> AsyncGenerator[bytes, None]:
    for t in result.outputs:
        yield t.raw
