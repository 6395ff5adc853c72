"""Cached text generation: Triton's generate extension (`/v2/models/NAME/generate` and `generate_stream`), and
through it the OpenAI routes.

A request is read and checked here before anything goes upstream: the body must be a JSON object, `id` a string,
and each field that names an input of the model a value of that input's type (an INT32 that does not fit is
refused, not wrapped); a mistake is a 400 naming the field. What goes to Triton is the request as the gateway read
it, under an id of the gateway's own (the client's id when it sent one), so the answer is matched to the request:
an event that does not carry that id ends the answer with an error, and nothing of it is kept.

A request is cacheable when its answer is a function of the request: greedy, or sampling with a `seed`, by the
models' own rule (keys.is_draw) over every place a sampling parameter can be given (a top-level field or the
`parameters` object, the later winning, as Triton reads them). Its key covers the served version's fingerprint,
the route, the whole request and the forwarded headers. A miss goes to Triton and reaches the client as Triton
sends it — event by event for a stream — while the events are recorded; an answer that ended without an error,
every event from the model and version asked, within the entry size bound, is kept (as a result whose outputs are
the events, so it shares the cache's memory bound, Redis and checksums). A hit replays the recorded events as they
came: a stream is answered as a stream. Identical misses running at the same time each go to Triton (a stream is
not shared between clients).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import struct
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass

import orjson

from dstool.decoding.sampling import shown
from dstool.serve.gateway.cache.digests import generation_parameters, is_draw, key_fingerprint, scoped
from dstool.serve.gateway.core import GatewayCore, addressable, model_path, request_nonce, served_version
from dstool.serve.gateway.metrics import Metrics
from dstool.serve.gateway.tenancy.guard import estimated_tokens
from dstool.serve.gateway.tensors import GatewayError, InferResult, Tensor
from dstool.serve.gateway.triton_json import default_new_tokens, parse_json

INTEGER_RANGES = {"TYPE_INT8": 8, "TYPE_INT16": 16, "TYPE_INT32": 32, "TYPE_INT64": 64}
UNSIGNED_RANGES = {"TYPE_UINT8": 8, "TYPE_UINT16": 16, "TYPE_UINT32": 32, "TYPE_UINT64": 64}
FLOATS = frozenset({"TYPE_FP16", "TYPE_FP32", "TYPE_FP64", "TYPE_BF16"})
MISMATCH = "Triton's answer does not belong to this request (the connection was out of step): retry"


@dataclass(slots=True)
class Generation:
    """Triton's answer to one generate request: status, headers, and its body as events (one for `generate`,
    one per server-sent event for `generate_stream`, each without its blank-line separator)."""

    status: int
    headers: list[tuple[str, str]]
    events: AsyncGenerator[bytes, None]
    hit: bool = False  # answered from the cache
    close: Callable[[], None] = lambda: None  # gives the answer up (Triton's request cancelled unless it ended)


def data(event: bytes) -> dict | None:
    """The JSON object a server-sent event carries, or None for a comment or keep-alive."""
    return json_object(event[len(b"data: "):]) if event.startswith(b"data: ") else None


def read_request(body: bytes) -> dict:
    """A generate body as Triton reads it (its JSON dialect), checked: an object, `id` a string, no number that is
    not finite. GatewayError (400) naming what is wrong."""
    request = parse_json(body)
    if not isinstance(request, dict):
        raise GatewayError(400, "the request body must be a JSON object of inputs and parameters")
    if "id" in request and not isinstance(request["id"], str):
        raise GatewayError(400, f"'id' must be a string, got {shown(request['id'])}")
    if "parameters" in request and not isinstance(request["parameters"], dict):
        raise GatewayError(400, f"'parameters' must be a JSON object, got {shown(request['parameters'])}")
    for key, value in request.items():
        for name, number in _numbers(key, value):
            if isinstance(number, float) and not math.isfinite(number):
                raise GatewayError(400, f"'{name}' must be a finite number, got {number}")
    return request


def tenant_tag(tenant: str) -> str:
    """The engine's `tenant` parameter for a tenant: a digest of its name."""
    return hashlib.blake2b(tenant.encode(), digest_size=8).hexdigest()


def with_parameter(request: dict, name: str, value: str) -> dict:
    """The request with `name` set to `value`, whatever the client set (a field or in `parameters`)."""
    out = {**request, name: value}
    parameters = request.get("parameters")
    if isinstance(parameters, dict) and name in parameters:
        out["parameters"] = {k: v for k, v in parameters.items() if k != name}
    return out


def salted(request: dict, scope: str) -> dict:
    """The request with its prefix-cache salt (`cache_salt`, a field or a parameter) made a digest of the tenant's
    `scope` and the client's own salt: a tenant's prompts never meet another's computed prefixes. GatewayError (400)
    for a salt that is not a string."""
    parameters = request.get("parameters")
    own = [request.get("cache_salt"), parameters.get("cache_salt") if isinstance(parameters, dict) else None]
    for value in own:
        if value is not None and not isinstance(value, str):
            raise GatewayError(400, f"'cache_salt' must be a string, got {shown(value)}")
    digest = hashlib.blake2b(orjson.dumps([scope, *own]), digest_size=16).hexdigest()
    return with_parameter(request, "cache_salt", digest)


def check_inputs(request: dict, config: dict) -> None:
    """Each field of `request` that names an input of the model (its Triton `config`) holds a value of the input's
    type — one, or a flat list of them — in the type's range. GatewayError (400) naming the first that does not."""
    for spec in config.get("input") or []:
        name, kind = spec.get("name"), spec.get("data_type", "")
        if name not in request:
            continue
        value = request[name]
        if not all(_of_type(v, kind) for v in (value if isinstance(value, list) else [value])):
            raise GatewayError(400, f"'{name}' must be {_described(kind)} (the model's input {name} is "
                                    f"{kind.removeprefix('TYPE_')}), got {shown(value)}")


def _of_type(value, kind: str) -> bool:
    if kind == "TYPE_STRING":
        return isinstance(value, str)
    if kind == "TYPE_BOOL":
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if kind in INTEGER_RANGES:
        bits = INTEGER_RANGES[kind]
        return isinstance(value, int) and -2 ** (bits - 1) <= value < 2 ** (bits - 1)
    if kind in UNSIGNED_RANGES:
        return isinstance(value, int) and 0 <= value < 2 ** UNSIGNED_RANGES[kind]
    if kind in FLOATS:
        return isinstance(value, (int, float))
    return True


def _described(kind: str) -> str:
    if kind in INTEGER_RANGES:
        bits = INTEGER_RANGES[kind]
        return f"an integer from {-2 ** (bits - 1)} to {2 ** (bits - 1) - 1}"
    if kind in UNSIGNED_RANGES:
        return f"an integer from 0 to {2 ** UNSIGNED_RANGES[kind] - 1}"
    return {"TYPE_STRING": "a string", "TYPE_BOOL": "true or false"}.get(kind, "a number")


def _numbers(name: str, value):
    """(field name, number) for every number in a JSON value."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        yield name, value
    elif isinstance(value, list):
        for v in value:
            yield from _numbers(name, v)
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _numbers(str(k), v)


class GenerationCache:
    def __init__(self, core: GatewayCore, metrics: Metrics):
        self.core = core
        self.metrics = metrics

    def _key(self, model: str, served: str, fingerprint: str, route: str, request: dict,
             headers: tuple[tuple[str, str], ...], scope: str, variant: str = "") -> str:
        blob = orjson.dumps([route, model, served, request, list(headers), *([variant] if variant else [])],
                            option=orjson.OPT_SORT_KEYS)
        h = hashlib.blake2b(struct.pack("<I", len(blob)) + blob, digest_size=32)
        return f"{scoped(scope)}:gen:{model}:{fingerprint}:{h.hexdigest()}"

    async def most_tokens(self, model: str, request: dict) -> int:
        """The most tokens a generate request may use, reserved for a tenant before it runs: its prompt, estimated
        from its text, and its max_new_tokens (or the model's default)."""
        given = request.get("parameters")
        parameters: dict = given if isinstance(given, dict) else {}
        asked = request.get("max_new_tokens", parameters.get("max_new_tokens"))
        asked = asked[0] if isinstance(asked, list) and asked else asked
        try:
            config = (await self.core.deployments.get(model)).config
        except GatewayError:
            config = {}  # Triton does not serve it: its answer says so, and costs nothing
        new = asked if isinstance(asked, int) and not isinstance(asked, bool) and asked > 0 else \
            default_new_tokens(config)
        text = sum(len(orjson.dumps(value)) for name, value in [*request.items(), *parameters.items()]
                   if name in ("text_input", "messages", "tools"))
        return estimated_tokens(text) + new

    async def open(self, model: str, version: str, route: str, body: bytes | dict,
                   headers: tuple[tuple[str, str], ...] = (("Content-Type", "application/json"),),
                   keyed: tuple[tuple[str, str], ...] = (), opt_out: bool = False,
                   protocol: str = "http", scope: str = "", tenant: str = "", variant: str = "") -> Generation:
        """Answer a generate request (its body, or the request already read) from the cache or from Triton
        (recording a cacheable miss); `headers` go to Triton, `keyed` (those Triton passes on to the model) are part
        of the key, and so is `scope` (the tenant's cache namespace; the engine's prefix cache is salted with it).
        A `tenant`'s request to the engine takes its turn among tenants; `variant` (the sha256 of the LoRA adapter the
        request names, adapters.py) is part of the key too. GatewayError for a request that cannot go
        upstream. Counted in the gateway's metrics under `protocol` (the time to the answer's head)."""
        started = time.perf_counter()
        request = read_request(body) if isinstance(body, bytes) else body
        if not addressable(model):
            raise GatewayError(400, f"the model name {shown(model)} cannot be sent to Triton: at most 255 bytes "
                                    "without spaces, control characters, '/', '?' or '#'")
        key, served = None, ""
        try:
            d = await self.core.deployments.get(model)
        except GatewayError:
            d = None  # Triton does not serve it: its own answer says so
        if d is not None:
            check_inputs(request, d.config)
            if scope and "prefix_cache_tokens" in (d.config.get("parameters") or {}):
                request = salted(request, scope)
            served = served_version(d, version) or ""
            fingerprint = d.fingerprint(served) if served else None
            inputs = frozenset(i.get("name") for i in d.config.get("input") or [])
            if not opt_out and fingerprint is not None and "sequence_batching" not in d.config and \
                    not is_draw(generation_parameters(request, inputs)):
                key = self._key(model, served, fingerprint, route, request, keyed, scope, variant)
        if tenant and d is not None and "prefix_cache_tokens" in (d.config.get("parameters") or {}):
            request = with_parameter(request, "tenant", tenant_tag(tenant))  # its turn among tenants in the engine
        if key is not None:
            entry = await self.core.lookup(key)
            if entry is not None and entry.result.parameters.get("key") == key:
                self.metrics.observe(model, protocol, "hit", time.perf_counter() - started,
                                     sum(len(t.raw) for t in entry.result.outputs))
                return Generation(200, list(entry.result.parameters["headers"]), _replay(entry.result), hit=True)
        ours = not request.get("id")  # Triton echoes no empty id: the gateway's own is taken out again
        ident = request_nonce() if ours else request["id"]
        path = model_path(model) + (f"/versions/{version}" if version else "") + "/" + route
        r = await self.core.upstreams.open("POST", path, orjson.dumps({**request, "id": ident}), headers)
        passed = [("Content-Type", r.headers["content-type"])] if "content-type" in r.headers else []
        outcome = "error" if r.status != 200 else "miss" if key else "bypass"
        self.metrics.observe(model, protocol, outcome, time.perf_counter() - started)
        answer = Answer(model, served, ident, ours)
        if not r.streaming:
            whole = await r.read()
            try:
                whole = answer.check(whole)
            except GatewayError:
                r.conn.out_of_step()
                raise
            if key is not None and r.status == 200:
                self._store(key, served, model, passed, [whole], answer)
            return Generation(r.status, passed, _one(whole))
        return Generation(r.status, passed, self._relay(r, key, served, model, passed, answer), close=r.close)

    async def _relay(self, r, key: str | None, served: str, model: str, headers,
                     answer: Answer) -> AsyncGenerator[bytes, None]:
        """Triton's events as they come; a complete, error-free stream within the size bound is kept."""
        recorded: list[bytes] | None = [] if key is not None else None
        size, limit = 0, self.core.cache.max_entry_bytes
        buffer = b""
        async with contextlib.aclosing(r.chunks()) as chunks:
            async for part in chunks:
                buffer += part
                while b"\n\n" in buffer:
                    event, buffer = buffer.split(b"\n\n", 1)
                    try:
                        event = answer.check_event(event)
                    except GatewayError as e:
                        r.conn.out_of_step()
                        yield b"data: " + orjson.dumps({"error": e.message})
                        return
                    if recorded is not None:
                        size += len(event)
                        if size > limit or not answer.intact:
                            recorded = None
                        else:
                            recorded.append(event)
                    yield event
        if buffer:
            recorded = None  # a stream that did not end on an event boundary is not complete
            yield buffer
        if recorded is not None and key is not None:
            self._store(key, served, model, headers, recorded, answer)

    def _store(self, key: str, version: str, model: str, headers, events: list[bytes], answer: Answer) -> None:
        if answer.moved:  # Triton answered from another version than the one keyed: look again, keep nothing
            self.core.deployments.invalidate(model)
        if not answer.intact or not self.core.deployments.still_loaded_from(model, version, key_fingerprint(key)):
            return
        result = InferResult(model, version, [Tensor("event", "BYTES", (1,), e) for e in events],
                             {"headers": headers, "key": key})
        self.core.cache.put(key, result)


class Answer:
    """What Triton's answer to one generate request must be: each event (or the whole body) for this request's id,
    from the model asked (and the version keyed); `intact` while every one so far was, none an error. The gateway's
    own id (`ours`) is taken out again before the client sees it."""

    def __init__(self, model: str, version: str, ident: str, ours: bool):
        self.model, self.version, self.ident, self.ours = model, version, ident, ours
        self.prefix = b'{"id":' + orjson.dumps(ident) + b","
        self.intact, self.moved = True, False

    def check(self, body: bytes) -> bytes:
        """A whole body (or one event's JSON) checked, the gateway's id taken out; GatewayError (502) when it
        answers another request."""
        d = json_object(body)
        if d is None or "error" in d:  # Triton's own error answers carry no id: passed on, never kept
            self.intact = False
            if self.ours:  # as Triton words it for a request without an id
                return body.replace(f"[request id: {self.ident}]".encode(), b"[request id: <id_unknown>]")
            return body
        if d.get("id") != self.ident:
            self.intact = False
            raise GatewayError(502, MISMATCH)
        self.moved |= bool(self.version) and str(d.get("model_version")) != self.version
        if d.get("model_name") != self.model or self.moved:
            self.intact = False
        if self.ours:  # Triton writes the fields sorted: the id first unless an output's name sorts before it
            if body.startswith(self.prefix):
                return b"{" + body[len(self.prefix):]
            return orjson.dumps({k: v for k, v in d.items() if k != "id"})
        return body

    def check_event(self, event: bytes) -> bytes:
        if not event.startswith(b"data: "):
            return event  # a comment or keep-alive
        return b"data: " + self.check(event[len(b"data: "):])


def json_object(body: bytes) -> dict | None:
    """The JSON object `body` holds, or None."""
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
