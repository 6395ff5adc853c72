"""The gateway's KServe v2 HTTP/REST endpoint: inference (JSON and the binary tensor extension) through the
cache; every other route (health, metadata, config, statistics, repository, shared memory, generate, ...)
relayed to Triton (generate_stream's server-sent events as they come); /metrics for Prometheus.

The server is an asyncio.Protocol on httptools' parser rather than aiohttp: with the same HttpFrontend
behind both, a cache hit (1-token request, 16 KB of logits; wrk, 1 connection) measured p50 59-117 µs here
against 135-179 µs behind an aiohttp 3.14 web.Application, and 7,700 against 7,400 requests/s with 16
connections (2 shared cores, loaded; uvloop for both). A hit whose model version was checked recently is
answered synchronously in data_received, without creating a task. It guards itself as a well-kept server
does (limits and timeouts in `HttpLimits`, all options of the gateway): the token is checked before a body is
read, headers, URL and bodies are bounded, slow or silent clients are timed out, and a shutdown drains.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import math
import re
import struct
import time
import zlib
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

import httptools
import orjson

from dstool.serve.gateway.core import GatewayCore, error_message
from dstool.serve.gateway.metrics import Metrics
from dstool.serve.gateway.tensors import (
    GatewayError,
    InferRequest,
    InferResult,
    Tensor,
    check_tensor,
    from_json,
    is_unsigned,
    to_values,
)
from dstool.serve.gateway.upstream import UnsafeRequest, UpstreamTimeout, UpstreamUnavailable, within

# After refusing a request: for how long, and how much of, what the client still sends is read and dropped.
LINGER_SECONDS, LINGER_BYTES = 2.0, 8 << 20
HOP_BY_HOP = frozenset({"connection", "keep-alive", "host", "content-length", "transfer-encoding", "authorization",
                        "expect", "upgrade", "te", "trailer", "proxy-authorization", "cache-control"})


class _Passthrough(Exception):
    """The request uses features the cache does not model (shared memory): relay it to Triton as it is."""


@dataclass(frozen=True)
class HttpLimits:
    """What one client may ask of the server (defaults like nginx's and uvicorn's; all gateway options)."""

    max_request_bytes: int = 64 << 20
    max_generate_bytes: int = 4 << 20
    max_url_bytes: int = 8192
    max_header_bytes: int = 8192
    max_headers_bytes: int = 65536
    max_headers: int = 100
    header_timeout: float = 15.0
    body_timeout: float = 30.0
    keepalive_timeout: float = 5.0
    max_connections: int = 1024
    max_buffered_bytes: int = 256 << 20
    write_timeout: float = 30.0


@dataclass(slots=True)
class HttpRequest:
    method: str
    target: str  # path and query, as sent
    path: str
    headers: dict[str, str]  # lower-case names
    body: bytes


@dataclass(slots=True)
class HttpResponse:
    status: int
    chunks: list[bytes]
    headers: list[tuple[str, str]] = field(default_factory=list)

    def encode(self, keep_alive: bool) -> list[bytes]:
        length = sum(map(len, self.chunks))
        head = [f"HTTP/1.1 {self.status} {_phrase(self.status)}\r\nContent-Length: {length}\r\n"]
        head += [f"{k}: {v}\r\n" for k, v in self.headers]
        if not keep_alive:
            head.append("Connection: close\r\n")
        head.append("\r\n")
        return ["".join(head).encode("latin-1"), *self.chunks]


@dataclass(slots=True)
class StreamingResponse:
    """A response whose body arrives in parts (server-sent events), sent with chunked transfer encoding."""

    status: int
    headers: list[tuple[str, str]]
    body: AsyncIterator[bytes]
    close: Callable[[], None] | None = None  # called once the answer ends, however it ends (the client gone too)


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Unknown"


def error_response(status: int, message: str) -> HttpResponse:
    """KServe v2 error body."""
    return HttpResponse(status, [orjson.dumps({"error": message})], [("Content-Type", "application/json")])


def _missing(key: str) -> GatewayError:
    return GatewayError(400, f"Unable to parse '{key}': attempt to access non-existing object member '{key}'")


def _not(key: str, kind: str) -> GatewayError:
    return GatewayError(400, f"Unable to parse '{key}': attempt to access JSON non-{kind} as {kind}")


def _member(obj: dict, key: str, kind: type, kind_name: str):
    if key not in obj:
        raise _missing(key)
    value = obj[key]
    if not isinstance(value, kind):
        raise _not(key, kind_name)
    return value


def _params(item: dict) -> dict:
    """An input's or output's parameters; Triton looks inside them only when they are an object."""
    params = item.get("parameters")
    return params if isinstance(params, dict) else {}


def _flag(params: dict, key: str, default: bool) -> bool:
    value = params.get(key, default)
    if not isinstance(value, bool):
        raise _not(key, "boolean")
    return value


def _request_parameters(header: dict) -> dict:
    """The request's parameters, checked as Triton checks them (its order, its messages)."""
    if "parameters" not in header:
        return {}
    params = header["parameters"]
    if not isinstance(params, dict):
        raise GatewayError(400, "failed to get request params.: attempt to get members for non-object")
    for key, value in params.items():
        if key == "sequence_id":
            if not (is_unsigned(value) or isinstance(value, str)):
                raise _not(key, "string")
        elif key in ("sequence_start", "sequence_end", "binary_data_output"):
            _flag(params, key, False)
        elif key in ("priority", "timeout"):
            if not is_unsigned(value):
                raise _not(key, "unsigned-integer")
        elif key.startswith("triton_"):
            raise GatewayError(400, "parameter keys starting with 'triton_' are reserved for Triton usage and should "
                                    "not be specified.")
        elif value is None or isinstance(value, (list, dict)):
            raise GatewayError(400, f"parameter '{key}' has invalid type. It should be either 'int', 'bool', or "
                                    "'string'.")
    return params


_C_INTEGER = re.compile(r"[ \t\n\v\f\r]*([+-]?[0-9]+)")


def _c_atoi(text: str) -> int:
    """C's atoi as glibc computes it (strtol, then cast to int): how Triton reads Inference-Header-Content-Length."""
    m = _C_INTEGER.match(text)
    if m is None:
        return 0
    digits = m.group(1)
    value = int(digits) if len(digits) < 40 else (-1 if digits[0] == "-" else 1) * 2**128
    value = max(-2**63, min(2**63 - 1, value))
    return (value + 2**31) % 2**32 - 2**31


def _element_count(shape: list[int]) -> int:
    """The element count Triton 2.51 computes for a JSON input's shape: 0 for no dimensions, -1 for a wildcard,
    otherwise the product wrapped to int64 (what its `data` must then hold)."""
    if not shape:
        return 0
    if 2**64 - 1 in shape:
        return -1
    count = 1
    for d in shape:
        count = (count * d) % 2**64
    return count - 2**64 if count >= 2**63 else count


# orjson's limit (Triton's parser has none): deeper JSON is refused as a parse error
TOO_DEEP = "failed to parse the request JSON buffer: nested deeper than 1024 levels"
_NON_FINITE = re.compile(rb"-?(?:NaN|Infinity)")
_JSON_TOKEN = re.compile(rb'"(?:[^"\\]|\\.)*"|-?[0-9][0-9.eE+-]*')


def _too_big() -> float:
    raise OverflowError


def _double(literal: str) -> float:
    value = float(literal)
    return value if math.isfinite(value) else _too_big()


def _integer(literal: str) -> int | float:
    """An integer literal as rapidjson keeps it: int64 or uint64 when it fits, a double otherwise."""
    if len(literal) <= 20 and -2**63 <= (value := int(literal)) < 2**64:
        return value
    return _double(literal)


def parse_json(text: bytes):
    """JSON as Triton (rapidjson) reads it: NaN and Infinity literals and a UTF-8 byte order mark taken, a number
    beyond double range refused."""
    text = text.split(b"\0", 1)[0]  # rapidjson reads a C string: the document ends at the first NUL byte
    if text[:3] == b"\xef\xbb\xbf":
        text = text[3:]
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError as e:
        if e.msg.startswith("number is infinity"):
            raise _too_big_at(e.pos) from None
        if e.msg.startswith("depth limit"):
            raise GatewayError(400, TOO_DEEP) from None
        if not _NON_FINITE.match(text, e.pos):
            raise GatewayError(400, f"failed to parse the request JSON buffer: {e}") from None
    try:  # orjson refuses NaN/Infinity, which rapidjson takes; Python's json takes them too
        value = json.loads(text, parse_float=_double, parse_int=_integer)
        orjson.dumps(value)  # what orjson refuses besides (lone surrogates)
        return value
    except OverflowError:
        raise _too_big_at(next(m.start() for m in _JSON_TOKEN.finditer(text)
                               if m.group()[0] != 34 and not math.isfinite(float(m.group())))) from None
    except RecursionError:
        raise GatewayError(400, TOO_DEEP) from None
    except (ValueError, UnicodeDecodeError, orjson.JSONEncodeError) as e:
        raise GatewayError(400, f"failed to parse the request JSON buffer: {e}") from None


def _too_big_at(offset: int) -> GatewayError:
    return GatewayError(400, f"failed to parse the request JSON buffer: Number too big to be stored in double. at "
                             f"{offset}")


def decode_infer(model: str, version: str, headers: dict[str, str], body: bytes,
                 forward: re.Pattern | None = None) -> tuple[InferRequest, tuple]:
    """(InferRequest, output format: (binary by default?, ((name, binary?), ...))) from an HTTP infer request.

    Read as Triton reads it (the same checks in the same order, the same messages, but status 400 where Triton
    says 500: a client's mistake is a client error). What parses but the model may refuse (an empty input list,
    an unknown output, bytes that do not fit a datatype) or what the cache does not model (shared memory, a raw
    binary body) goes to Triton as it is, so its answer is Triton's own."""
    header_length = headers.get("inference-header-content-length")
    if header_length is not None:
        n = _c_atoi(header_length)
        if n < 0 or n > len(body):
            raise GatewayError(400, f"inference header size should be in range (0, {len(body)}), got: "
                                    f"{header_length}")
        if n == 0:
            raise _Passthrough()  # a raw binary request: the whole body is the model's one input
        header_bytes, binary = body[:n], memoryview(body)[n:]
    elif not body:
        raise _Passthrough()  # Triton reads an empty body as a raw binary request too
    else:
        header_bytes, binary = body, memoryview(b"")
    header = parse_json(header_bytes)
    if not isinstance(header, dict):
        raise _missing("inputs")
    request_id = header.get("id", "")
    if not isinstance(request_id, str):
        raise _not("id", "string")
    request_id = request_id.split("\0", 1)[0]  # Triton keeps the id as a C string
    parameters = _request_parameters(header)
    default_binary = _flag(parameters, "binary_data_output", False)
    items = _member(header, "inputs", list, "array")
    if not items:
        raise _Passthrough()  # Triton names the inputs the model expects
    inputs, offset, passthrough = [], 0, False
    for item in items:
        item = item if isinstance(item, dict) else {}
        params = _params(item)
        fields = [f for f, there in (("'data'", "data" in item), ("'binary_data_size'", "binary_data_size" in params),
                                     ("'shared_memory_region'", "shared_memory_region" in params)) if there]
        if len(fields) != 1:
            raise GatewayError(400, "Input must set only one of the following fields: 'data', 'binary_data_size' in "
                                    "'parameters', 'shared_memory_region' in 'parameters'. But "
                                    + (f"set {' '.join(fields)}" if fields else "no field is set"))
        name = _member(item, "name", str, "string")
        datatype = _member(item, "datatype", str, "string")
        shape = _member(item, "shape", list, "array")
        if not all(is_unsigned(d) for d in shape):
            raise _not("shape", "unsigned-integer")
        if "binary_data_size" in params:
            size = params["binary_data_size"]
            if not is_unsigned(size):
                raise _not("binary_data_size", "unsigned-integer")
            if offset + size > len(binary):
                raise GatewayError(400, f"unexpected size for input '{name}', expecting {offset + size - len(binary)} "
                                        f"additional bytes for model '{model}'")
            tensor = Tensor(name, datatype, tuple(shape), bytes(binary[offset:offset + size]))
            offset += size
            try:
                check_tensor(tensor)
            except GatewayError:
                passthrough = True  # the model refuses it, in Triton's words
        elif "shared_memory_region" in params:
            raise _Passthrough()
        elif (count := _element_count(shape)) == 0:
            tensor = Tensor(name, datatype, tuple(shape), b"")  # Triton does not read `data` then
        else:
            tensor = from_json(name, datatype, tuple(shape), item["data"], count)
        inputs.append(tensor)
    if offset != len(binary):
        raise GatewayError(400, f"unexpected additional input data for model '{model}'")
    outputs = None
    formats: tuple[tuple[str, bool], ...] = ()
    if "outputs" in header:
        requested = header["outputs"]
        if not isinstance(requested, list):
            raise _not("outputs", "array")
        outputs = []
        for item in requested:
            item = item if isinstance(item, dict) else {}
            params = _params(item)
            if "shared_memory_region" in params:
                raise _Passthrough()
            name = _member(item, "name", str, "string")
            if "classification" in params and not is_unsigned(params["classification"]):
                raise GatewayError(400, "Unable to set 'classification': attempt to access JSON "
                                        "non-unsigned-integer as unsigned-integer")
            _flag(params, "binary_data", False)
            outputs.append((name, params))
        # Listed outputs come back as their own binary_data says (JSON unless true), as Triton does.
        formats = tuple((name, params.get("binary_data", False)) for name, params in outputs)
    if passthrough:
        raise _Passthrough()
    forwarded = tuple(sorted((k, v) for k, v in headers.items() if forward is not None and forward.match(k)))
    return InferRequest(model, version, inputs, outputs, parameters, request_id, forwarded), (default_binary, formats)


_ESCAPED = re.compile(rb'[\x00-\x1f"\\]')
_ESCAPES = {b'"': b'\\"', b"\\": b"\\\\", b"\b": b"\\b", b"\f": b"\\f", b"\n": b"\\n", b"\r": b"\\r",
            b"\t": b"\\t"}


def _json_string(raw: bytes) -> bytes:
    """A BYTES element as Triton writes it in JSON: its bytes as they are (valid UTF-8 or not), with quotes,
    backslashes and control characters escaped as rapidjson escapes them (upper-case hex)."""
    return b'"' + _ESCAPED.sub(lambda m: _ESCAPES.get(m.group(), b"\\u%04X" % m.group()[0]), raw) + b'"'


def _json_data(t: Tensor) -> bytes:
    """A tensor's `data` array as Triton writes it (NaN and Infinity as rapidjson writes them)."""
    if t.datatype == "BYTES":
        items, offset = [], 0
        while offset < len(t.raw):
            n = struct.unpack_from("<I", t.raw, offset)[0]
            items.append(_json_string(t.raw[offset + 4:offset + 4 + n]))
            offset += 4 + n
        return b"[" + b",".join(items) + b"]"
    values = to_values(t)
    if t.datatype in ("FP16", "FP32", "FP64") and not all(math.isfinite(v) for v in values):
        return json.dumps(values, separators=(",", ":")).encode()
    return orjson.dumps(values)


def render_infer(result: InferResult, request_id: str, output_format: tuple) -> HttpResponse:
    """Triton's HTTP response for `result`: binary outputs after a JSON header, or plain JSON."""
    default_binary, formats = output_format
    binary_of = dict(formats)
    outputs, blobs = [], []
    data: dict[bytes, bytes] = {}  # placeholder in the header's JSON -> the data array
    for i, t in enumerate(result.outputs):
        o: dict[str, Any] = {"name": t.name, "datatype": t.datatype, "shape": t.shape}
        if binary_of.get(t.name, default_binary if not formats else False):
            o["parameters"] = {"binary_data_size": len(t.raw)}
            blobs.append(t.raw)
        else:
            mark = f"\0dstool-data-{i}\0"
            o["data"] = mark  # the array goes in below, written as Triton writes it
            data[orjson.dumps(mark)] = _json_data(t)
        outputs.append(o)
    header: dict[str, Any] = {"model_name": result.model_name, "model_version": result.model_version,
                              "outputs": outputs}
    if request_id:
        header = {"id": request_id, **header}
    if result.parameters:
        header["parameters"] = result.parameters
    head = orjson.dumps(header)
    for placeholder, array in data.items():
        head = head.replace(placeholder, array, 1)
    if not blobs:
        return HttpResponse(200, [head], [("Content-Type", "application/json")])
    return HttpResponse(200, [head, *blobs], [("Content-Type", "application/octet-stream"),
                                              ("Inference-Header-Content-Length", str(len(head)))])


def accepted_encoding(headers: dict[str, str]) -> str | None:
    """The response encoding Triton would choose: the first of gzip or deflate listed in Accept-Encoding,
    exactly as written (a token with parameters, such as `gzip;q=0`, is not taken)."""
    for token in headers.get("accept-encoding", "").split(","):
        if token.strip() in ("gzip", "deflate"):
            return token.strip()
    return None


def compressed(response: HttpResponse, encoding: str) -> HttpResponse:
    """The response with its body compressed (Inference-Header-Content-Length keeps the plain header's size)."""
    packer = zlib.compressobj(6, zlib.DEFLATED, 31 if encoding == "gzip" else 15)
    body = b"".join([*(packer.compress(c) for c in response.chunks), packer.flush()])
    return HttpResponse(response.status, [body], [*response.headers, ("Content-Encoding", encoding)])


Response = HttpResponse | StreamingResponse


class HttpFrontend:
    """Routes one parsed request; `handle` returns a response, or an awaitable of one when it must wait."""

    def __init__(self, core: GatewayCore, metrics: Metrics, token: str | None, limits: HttpLimits,
                 forward_headers: str | None = None):
        self.core = core
        self.metrics = metrics
        self.token = f"Bearer {token}".encode() if token else None
        self.limits = limits
        self.forward = re.compile(forward_headers, re.IGNORECASE) if forward_headers else None
        self.connections: set[HttpConnection] = set()
        self.answering: set[asyncio.Future] = set()  # requests being answered, held until done (see _dispatch)
        self.buffered = 0  # request body bytes held by all connections
        self.draining = False
        from dstool.serve.gateway.generation import GenerationCache
        from dstool.serve.gateway.openai import OpenAIFrontend  # it builds on this module's types

        self.generation = GenerationCache(core, metrics)
        self.openai = OpenAIFrontend(core.upstreams, self.generation)

    def authorized(self, path: str, headers: dict[str, str]) -> bool:
        """Health checks are open; everything else needs the bearer token, when one is set (compared as bytes)."""
        if self.token is None or path.startswith("/v2/health/"):
            return True
        return hmac.compare_digest(headers.get("authorization", "").encode("latin-1"), self.token)

    def handle(self, req: HttpRequest) -> Response | Awaitable[Response]:
        if req.path == "/metrics":
            return HttpResponse(200, [self.metrics.render()], [("Content-Type", "text/plain; version=0.0.4")])
        if req.path.startswith("/v1/"):
            return self.openai.handle(req)
        route = model_route(req.path) if req.method == "POST" else None
        if route is not None and route[2] == "infer":
            return self.infer(req, route[0], route[1])
        if route is not None and route[2] in ("generate", "generate_stream") and "content-encoding" not in req.headers:
            return self.generate(req, *route)
        return self.relay(req)

    async def generate(self, req: HttpRequest, model: str, version: str, route: str) -> Response:
        """Triton's generate extension through the generation cache (generation.py)."""
        headers = tuple((k, v) for k, v in req.headers.items() if k not in HOP_BY_HOP)
        keyed = tuple(sorted((k, v) for k, v in headers if self.forward is not None and self.forward.match(k)))
        try:
            g = await self.generation.open(model, version, route, req.body, headers, keyed, opt_out=opts_out(req))
        except (UpstreamUnavailable, UpstreamTimeout) as e:
            self.metrics.error("upstream")
            return error_response(503, str(e))
        except (GatewayError, UnsafeRequest) as e:
            status = e.status if isinstance(e, GatewayError) else 400
            self.metrics.error("bad_request" if status < 500 else "upstream")
            return error_response(status, str(e))
        if route == "generate" or g.status != 200:
            body = b"".join([e async for e in g.events])
            if g.status >= 400 and not body:
                return error_response(g.status, error_message(g.status, body))
            return HttpResponse(g.status, [body], g.headers)
        return StreamingResponse(g.status, g.headers, _sse(g.events))

    def infer(self, req: HttpRequest, model: str, version: str):
        started = time.perf_counter()
        opt_out = opts_out(req)
        try:
            request, output_format = decode_infer(model, version, req.headers, self._body(req), self.forward)
        except _Passthrough:
            return self._relay_infer(req, model, started)
        except GatewayError as e:
            self.metrics.error("bad_request")
            response = error_response(e.status, e.message)
            if e.status == 415:
                response.headers.append(("Accept-Encoding", "gzip, deflate"))
            return response
        if not opt_out:
            key = self.core.key_now(request)
            entry = self.core.cache.get_front(key) if key is not None else None
            if entry is not None:
                return self._answer(entry.result, entry, request, output_format, model, "hit", started,
                                    accepted_encoding(req.headers))
        return self._infer_async(req, request, output_format, opt_out, started)

    async def _infer_async(self, req, request, output_format, opt_out: bool, started: float) -> Response:
        try:
            key, version = await self.core.key(request, opt_out)
            if key is None:
                return await self._relay_infer(req, request.model, started)
            encoding = accepted_encoding(req.headers)
            entry = await self.core.lookup(key)
            if entry is not None:
                return self._answer(entry.result, entry, request, output_format, request.model, "hit", started,
                                    encoding)
            result, entry = await self.core.compute(key, version, request)
            return self._answer(result, entry, request, output_format, request.model, "miss", started, encoding)
        except (GatewayError, UpstreamUnavailable, UpstreamTimeout) as e:
            status = e.status if isinstance(e, GatewayError) else 504 if isinstance(e, UpstreamTimeout) else 503
            self.metrics.error("bad_request" if status < 500 else "timeout" if status == 504 else "upstream")
            self.metrics.observe(request.model, "http", "error", time.perf_counter() - started)
            return error_response(status, str(e))

    def _answer(self, result, entry, request, output_format, model, outcome, started,
                encoding: str | None = None) -> HttpResponse:
        """The response (as Triton writes it, compressed as Accept-Encoding asks); kept with the cache entry for the
        next hit, when the request has no id of its own."""
        form = ("http", output_format, encoding)
        response = entry.rendered.get(form) if entry is not None and not request.id else None
        if response is None:
            response = render_infer(result, request.id, output_format)
            if encoding is not None:
                response = compressed(response, encoding)
            if entry is not None and not request.id:
                shared = {id(t.raw) for t in result.outputs}  # binary outputs are the result's own bytes
                entry.keep(form, response, sum(len(c) for c in response.chunks if id(c) not in shared))
        self.metrics.observe(model, "http", outcome, time.perf_counter() - started,
                             sum(len(t.raw) for t in result.outputs) if outcome == "hit" else 0)
        return response

    def _body(self, req: HttpRequest) -> bytes:
        encoding = req.headers.get("content-encoding", "")
        if encoding in ("", "identity"):
            return req.body
        if encoding not in ("gzip", "deflate"):  # as Triton decides (its message; 415 where it says 501)
            raise GatewayError(415, "Unsupported compression type")
        inflater = zlib.decompressobj(47)  # zlib or gzip framing, whichever it is, as Triton's inflate takes both
        limit = self.limits.max_request_bytes
        try:
            body = inflater.decompress(req.body, limit + 1)
        except zlib.error as e:
            raise GatewayError(400, f"request body does not decompress as {encoding}: {e}") from None
        if len(body) > limit:
            raise GatewayError(413, f"decompressed request body exceeds {limit} bytes")
        return body

    async def _relay_infer(self, req: HttpRequest, model: str, started: float) -> Response:
        response = await self.relay(req)
        self.metrics.observe(model, "http", "bypass" if response.status == 200 else "error",
                             time.perf_counter() - started)
        return response

    async def relay(self, req: HttpRequest) -> Response:
        """Send the request to Triton as it came and return Triton's answer as it is (a streamed answer, such as
        generate_stream's server-sent events, as its parts come)."""
        headers = tuple((k, v) for k, v in req.headers.items() if k not in HOP_BY_HOP)
        health = req.path.startswith("/v2/health/")
        try:
            r = await self.core.upstreams.open(req.method, req.target, req.body, headers, health=health)
        except (UpstreamUnavailable, UpstreamTimeout) as e:
            self.metrics.error("upstream")
            return error_response(503, str(e))
        except UnsafeRequest as e:
            self.metrics.error("bad_request")
            return error_response(400, str(e))
        if req.method == "POST" and req.path.startswith("/v2/repository/models/"):  # a load or unload
            model = req.path.split("/")[4].encode("latin-1").decode("utf-8", "surrogateescape")
            self.core.deployments.invalidate(model, reloaded=r.status == 200)
        elif r.status >= 500:
            self.metrics.error("upstream")
        passed = [(k, v) for k, v in r.headers.items() if k not in HOP_BY_HOP]
        if r.streaming:
            return StreamingResponse(r.status, passed, r.chunks())
        body = await r.read()
        if r.status >= 400 and not body:
            return error_response(r.status, error_message(r.status, body))
        return HttpResponse(r.status, [body], passed)


def model_route(path: str) -> tuple[str, str, str] | None:
    """(model, version or "", action) of /v2/models/NAME/ACTION or /v2/models/NAME/versions/DIGITS/ACTION, matched
    as Triton matches them: on the path as sent (no percent-decoding), the name being its UTF-8 bytes."""
    parts = path.split("/")
    if len(parts) not in (5, 7) or parts[1:3] != ["v2", "models"] or not parts[3] or (
            len(parts) == 7 and not (parts[4] == "versions" and parts[5].isascii() and parts[5].isdigit())):
        return None
    return parts[3].encode("latin-1").decode("utf-8", "surrogateescape"), parts[5] if len(parts) == 7 else "", parts[-1]


def opts_out(req: HttpRequest) -> bool:
    """Whether the client asked not to be answered from the cache (Cache-Control: no-cache or no-store)."""
    cache_control = req.headers.get("cache-control", "")
    return "no-store" in cache_control or "no-cache" in cache_control


async def _sse(events: AsyncGenerator[bytes, None]) -> AsyncGenerator[bytes, None]:
    async with contextlib.aclosing(events):
        async for event in events:
            yield event + b"\n\n"


_ABSOLUTE = re.compile(r"https?://[^/?#]*", re.IGNORECASE)


def _origin_form(target: str) -> str | None:
    """The path (and query) a request names: as sent, or taken out of an absolute URL; None for anything else
    (`*`, an authority), which no route of Triton's takes."""
    if target.startswith("/"):
        return target
    m = _ABSOLUTE.match(target)
    if m is None:
        return None
    return target[m.end():] if target[m.end():m.end() + 1] == "/" else "/" + target[m.end():]


class HttpConnection(asyncio.Protocol):
    """One client connection: HTTP/1.1 keep-alive; pipelined requests are answered in order. Each phase has a
    deadline (headers, body, idle), and a request that breaks a limit is answered and the connection closed. A client
    that hangs up cancels the request it was waiting for (and with it the work upstream); a streamed answer is
    written no faster than the client reads it (the transport's buffer bounds what waits here), and a client that
    reads nothing for `write_timeout` seconds has its stream ended."""

    def __init__(self, frontend: HttpFrontend):
        self.frontend = frontend
        self.limits = frontend.limits
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.queue: deque[tuple[HttpRequest, bool]] = deque()
        self.busy = False
        self.timer: asyncio.TimerHandle | None = None
        self.lingering, self.lingered = False, 0
        self.started = 0  # requests begun on this connection
        self.task: asyncio.Future | None = None  # the request being answered, when it waits
        self.writable = asyncio.Event()  # cleared while the transport's write buffer is over its high-water mark
        self.writable.set()
        self._begin_request()

    # ---- lifecycle and timeouts --------------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        front = self.frontend
        if front.draining or len(front.connections) >= self.limits.max_connections:
            self._refuse(503, "the gateway is shutting down" if front.draining else
                         f"the gateway holds {self.limits.max_connections} connections: retry later")
            return
        front.connections.add(self)
        self._arm(self.limits.header_timeout, 408, "request headers not received in time")

    def connection_lost(self, exc) -> None:
        self.transport = None
        self._disarm()
        self._release()
        self.frontend.connections.discard(self)
        self.writable.set()
        if self.task is not None and not self.task.done():
            self.task.cancel()  # nobody is waiting for this answer any more: stop computing it

    def pause_writing(self) -> None:
        self.writable.clear()

    def resume_writing(self) -> None:
        self.writable.set()

    def eof_received(self) -> bool:
        """The client closed its side: it is gone, as nginx and uvicorn take it (a socket closed whole and one only
        shut for writing look the same until an answer is written, which for a long generation may be minutes). The
        transport closes (answers already written are flushed) and the request in flight is cancelled."""
        return False

    def _arm(self, seconds: float, status: int | None, message: str = "") -> None:
        """Answer `status` and close (or just close, for an idle connection) unless the phase ends in time."""
        self._disarm()
        self.timer = asyncio.get_running_loop().call_later(seconds, self._timed_out, status, message)

    def _disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _timed_out(self, status: int | None, message: str) -> None:
        self.timer = None
        if status is None or self.busy:
            self._close()
        else:
            self.frontend.metrics.error("bad_request")
            self._refuse(status, message)

    def idle(self) -> bool:
        return not self.busy and not self.queue and self.head_bytes == 0

    # ---- parsing ---------------------------------------------------------------------------------------
    def _begin_request(self) -> None:
        self.url = b""
        self.headers: dict[str, str] = {}
        self.header_name = b""
        self.body: list[bytes] = []
        self.size = 0
        self.head_bytes = 0
        self.headers_done = False
        self.error: tuple[int, str] | None = None
        self.reserved = 0
        self.limit = self.limits.max_request_bytes  # this request's body limit

    def data_received(self, data: bytes) -> None:
        if self.transport is None:
            return
        if self.lingering:  # what a refused client still sends is read and dropped, so it sees the answer
            self.lingered += len(data)
            if self.lingered > LINGER_BYTES:
                self._close()
            return
        in_head, started = not self.headers_done, self.started
        if in_head and self.head_bytes == 0 and not self.busy:
            self._arm(self.limits.header_timeout, 408, "request headers not received in time")
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            pass  # Triton answers an Upgrade request as a plain one: so does the gateway (then closes)
        except httptools.HttpParserError as e:
            if self.error is None:
                self.error = (400, f"malformed HTTP request: {e}")
        if in_head and not self.headers_done and self.started == started:  # still in the same request's head
            self.head_bytes += len(data)
            if self.head_bytes > self.limits.max_headers_bytes + self.limits.max_url_bytes and self.error is None:
                self.error = (431, f"request headers exceed {self.limits.max_headers_bytes} bytes")
        if self.error is not None:
            self._refuse(*self.error)

    def on_message_begin(self) -> None:
        self._begin_request()
        self.started += 1

    def on_url(self, url: bytes) -> None:
        self.url += url
        if len(self.url) > self.limits.max_url_bytes and self.error is None:
            self.error = (414, f"request target exceeds {self.limits.max_url_bytes} bytes")

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(self.headers) >= self.limits.max_headers and self.error is None:
            self.error = (431, f"more than {self.limits.max_headers} request headers")
        if len(name) + len(value) > self.limits.max_header_bytes and self.error is None:
            self.error = (431, f"a request header exceeds {self.limits.max_header_bytes} bytes")
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.headers_done = True
        if self.error is not None:
            return
        target = _origin_form(self.url.decode("latin-1"))
        if target is None:
            self.error = (400, "the request target must be a path (/v2/...) or an absolute http URL")
            return
        self.url = target.encode("latin-1")
        front = self.frontend
        path = target.split("?", 1)[0]
        if path.startswith("/v1/") or path.endswith(("/generate", "/generate_stream")):
            self.limit = min(self.limit, self.limits.max_generate_bytes)
        limit = self.limit
        try:
            length = int(self.headers.get("content-length", "0"))
        except ValueError:
            self.error = (400, "Content-Length is not an integer")
            return
        if not front.authorized(target.split("?", 1)[0], self.headers):  # before any byte of the body is read
            front.metrics.error("unauthorized")
            self.error = (401, "missing or wrong bearer token")
        elif length > limit:
            front.metrics.error("bad_request")
            self.error = (413, f"request body exceeds the gateway's limit of {limit} bytes")
        elif not self._reserve(length):
            self.error = (503, "the gateway holds too many request bodies at once: retry later")
        elif self.headers.get("expect", "").lower() == "100-continue" and self.transport is not None:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        if self.error is None and (length or self.headers.get("transfer-encoding")):
            self._arm(self.limits.body_timeout, 408, "request body not received in time")
        else:
            self._disarm()

    def on_body(self, body: bytes) -> None:
        if self.error is not None:
            return
        self.size += len(body)
        if self.size > self.limit:
            self.error = (413, f"request body exceeds the gateway's limit of {self.limit} bytes")
        elif self.size > self.reserved and not self._reserve(self.size - self.reserved):
            self.error = (503, "the gateway holds too many request bodies at once: retry later")
        else:
            self.body.append(body)
            self._arm(self.limits.body_timeout, 408, "request body not received in time")

    def on_message_complete(self) -> None:
        if self.error is not None:
            return
        self._disarm()
        target = self.url.decode("latin-1")
        req = HttpRequest(self.parser.get_method().decode(), target, target.split("?", 1)[0], self.headers,
                          b"".join(self.body))
        self.body = []
        keep_alive = self.parser.should_keep_alive() and not self.parser.should_upgrade()
        self.headers_done, self.head_bytes = False, 0  # the next request starts in its head
        if self.busy:
            self.queue.append((req, keep_alive))
            if len(self.queue) > 32 and self.transport is not None:
                self.transport.pause_reading()
        else:
            self._dispatch(req, keep_alive)

    def _reserve(self, nbytes: int) -> bool:
        front = self.frontend
        if front.buffered + nbytes > self.limits.max_buffered_bytes:
            return False
        front.buffered += nbytes
        self.reserved += nbytes
        return True

    def _release(self) -> None:
        self.frontend.buffered -= self.reserved
        self.reserved = 0

    # ---- answering -----------------------------------------------------------------------------------------
    def _dispatch(self, req: HttpRequest, keep_alive: bool) -> None:
        try:
            response = self.frontend.handle(req)
        except Exception as e:  # a bug must not take the connection's other requests with it
            response = error_response(500, f"gateway error: {type(e).__name__}: {e}")
        if isinstance(response, HttpResponse):
            self._release()
            self._write(response, keep_alive)
        else:
            self.busy = True
            self.task = asyncio.ensure_future(self._finish(response, keep_alive))
            self.frontend.answering.add(self.task)  # the loop holds tasks weakly: a cancelled one must still run
            self.task.add_done_callback(self.frontend.answering.discard)

    async def _finish(self, pending, keep_alive: bool) -> None:
        try:
            response = await pending
        except Exception as e:
            response = error_response(500, f"gateway error: {type(e).__name__}: {e}")
        self._release()
        if isinstance(response, StreamingResponse):
            await self._stream(response, keep_alive)
        else:
            self._write(response, keep_alive)
        self.busy = False
        while self.queue and not self.busy and self.transport is not None:
            self._dispatch(*self.queue.popleft())
        if self.transport is not None and not self.queue:
            self.transport.resume_reading()
            if not self.busy:
                self._arm(self.limits.keepalive_timeout, None)

    def _write(self, response: HttpResponse, keep_alive: bool) -> None:
        if self.transport is None:
            return
        keep_alive = keep_alive and not self.frontend.draining
        self.transport.writelines(response.encode(keep_alive))
        self._after_response(keep_alive)

    async def _stream(self, response: StreamingResponse, keep_alive: bool) -> None:
        if self.transport is None:
            if response.close is not None:
                response.close()
            return
        keep_alive = keep_alive and not self.frontend.draining
        head = [f"HTTP/1.1 {response.status} {_phrase(response.status)}\r\nTransfer-Encoding: chunked\r\n"]
        head += [f"{k}: {v}\r\n" for k, v in response.headers]
        if not keep_alive:
            head.append("Connection: close\r\n")
        self.transport.write("".join(head + ["\r\n"]).encode("latin-1"))
        body = response.body
        try:
            async for chunk in body:
                if self.transport is None:
                    break
                if chunk:
                    self.transport.writelines([f"{len(chunk):x}\r\n".encode(), chunk, b"\r\n"])
                if not self.writable.is_set():  # the client reads slower than the answer comes: wait for it
                    try:
                        await within(self.writable.wait(), self.limits.write_timeout)
                    except asyncio.TimeoutError:
                        self.frontend.metrics.error("slow_client")
                        self._close()
                        break
        except (UpstreamUnavailable, UpstreamTimeout, ConnectionError):
            keep_alive = False  # the stream broke off: the client sees the connection end, as from Triton
        finally:
            aclose = getattr(body, "aclose", None)
            if aclose is not None:
                await aclose()  # an answer cut short stops its source (and the work behind it) now
            if response.close is not None:
                response.close()
        if self.transport is not None:
            if keep_alive:
                self.transport.write(b"0\r\n\r\n")
            self._after_response(keep_alive)

    def _after_response(self, keep_alive: bool) -> None:
        if not keep_alive:
            self._close()
        elif not self.busy and not self.queue:
            self._arm(self.limits.keepalive_timeout, None)

    def _refuse(self, status: int, message: str) -> None:
        """Answer a request the gateway will not read further, and close the connection once the client has had
        time to read the answer (what it still sends meanwhile is dropped unread, as nginx's lingering close does:
        a client that writes its whole body before reading still gets the 413 or 401)."""
        if self.transport is None:
            return
        self.transport.writelines(error_response(status, message).encode(keep_alive=False))
        self._release()
        self.frontend.connections.discard(self)
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.lingering = True
        self._arm(LINGER_SECONDS, None)

    def _close(self) -> None:
        self._disarm()
        if self.transport is not None:
            self.transport.close()
            self.transport = None
        self._release()
        self.frontend.connections.discard(self)
