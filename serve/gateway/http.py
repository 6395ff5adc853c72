"""The gateway's HTTP front door: each request to its protocol's room — KServe v2 inference (JSON and the binary
tensor extension, kserve/codec.py) through the cache; Triton's generate extension through the generation cache; the
OpenAI routes (openai/routes.py) and Anthropic's (anthropic/messages.py); every other
route (health, metadata, config, statistics, repository, shared memory, ...) relayed to Triton, a streamed answer
as its parts come; /metrics for Prometheus. A hit whose model version was checked recently is answered
synchronously, without creating a task. The connections themselves are transport.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import re
import time
import zlib
from collections.abc import AsyncGenerator, Awaitable

import orjson

from dstool.serve.gateway.adapters import NAME
from dstool.serve.gateway.anthropic.messages import AnthropicFrontend, anthropic_error, anthropic_refused
from dstool.serve.gateway.cache.digests import generation_parameters
from dstool.serve.gateway.core import GatewayCore, error_message
from dstool.serve.gateway.generation import GenerationCache, data, json_object, read_request
from dstool.serve.gateway.kserve.codec import (
    Passthrough,
    accepted_encoding,
    compressed,
    decode_infer,
    error_response,
    names_shared_memory,
    render_infer,
)
from dstool.serve.gateway.metrics import Metrics
from dstool.serve.gateway.openai.protocol import OpenAIError
from dstool.serve.gateway.openai.routes import OpenAIFrontend, refused
from dstool.serve.gateway.tenancy.auth import Principal
from dstool.serve.gateway.tenancy.guard import UNKNOWN, Guard, Meter, Refused, tensor_tokens
from dstool.serve.gateway.tensors import GatewayError, backend_fault
from dstool.serve.gateway.transport import (
    HttpConnection,
    HttpLimits,
    HttpRequest,
    HttpResponse,
    Response,
    StreamingResponse,
    opts_out,
)
from dstool.serve.gateway.upstream import UnsafeRequest, UpstreamTimeout, UpstreamUnavailable

HOP_BY_HOP = frozenset({"connection", "keep-alive", "host", "content-length", "transfer-encoding", "authorization",
                        "expect", "upgrade", "te", "trailer", "proxy-authorization", "cache-control"})



def api_of(path: str, headers: dict[str, str]) -> str:
    """Which API a request speaks, so whose error shape it gets: Anthropic's for /v1/messages (and /v1/models with
    the anthropic-version header, as the `anthropic` client sends it), OpenAI's for the other /v1/ routes, else
    KServe's."""
    if not path.startswith("/v1/"):
        return "kserve"
    if path.startswith("/v1/messages") or (path.startswith("/v1/models") and "anthropic-version" in headers):
        return "anthropic"
    return "openai"


class HttpFrontend:
    """Routes one parsed request; `handle` returns a response, or an awaitable of one when it must wait."""

    def __init__(self, core: GatewayCore, metrics: Metrics, token: str | None, limits: HttpLimits,
                 forward_headers: str | None = None, guard: Guard | None = None,
                 shared_models: frozenset[str] = frozenset(), max_tokens_limit: int | None = None):
        self.core = core
        self.guard = guard  # --auth keys: tenants' keys, limits and usage
        self.shared_models = shared_models
        self.unauthorized = UNKNOWN if guard is not None else "missing or wrong bearer token"
        self.metrics = metrics
        self.token = f"Bearer {token}".encode() if token else None
        self.limits = limits
        self.forward = re.compile(forward_headers, re.IGNORECASE) if forward_headers else None
        self.connections: set[HttpConnection] = set()
        self.answering: set[asyncio.Future] = set()  # requests being answered, held until done (see _dispatch)
        self.buffered = 0  # request body bytes held by all connections
        self.draining = False

        self.generation = GenerationCache(core, metrics)
        self.openai = OpenAIFrontend(core.upstreams, self.generation, guard, shared_models, max_tokens_limit)
        self.anthropic = AnthropicFrontend(self.openai)  # /v1/messages: run as the chat completion it asks for

    def authorized(self, path: str, headers: dict[str, str]) -> bool:
        """Health checks are open; everything else needs the bearer token, when one is set (compared as bytes), or
        with --auth keys what may be a key (checked in Redis before the request is answered)."""
        if path.startswith("/v2/health/"):
            return True
        if self.guard is not None:
            return self.guard.well_formed(credential(path, headers))
        if self.token is None:
            return True
        return hmac.compare_digest(credential(path, headers).encode("latin-1"), self.token)

    def error(self, status: int, message: str, path: str, headers: dict[str, str]) -> HttpResponse:
        """An error in the shape of the API the request speaks (api_of); OpenAI's words a wrong key as OpenAI
        does."""
        api = api_of(path, headers)
        if api == "anthropic":
            body = anthropic_error(status, message)
        elif api == "openai":
            body = OpenAIError(status, message, kind="server_error" if status >= 500 else "invalid_request_error",
                               code="invalid_api_key" if status == 401 else None).body()
        else:
            return error_response(status, message)
        return HttpResponse(status, [body], [("Content-Type", "application/json")])

    def handle(self, req: HttpRequest) -> Response | Awaitable[Response]:
        if self.guard is None or req.path.startswith("/v2/health/"):
            return self._route(req)
        kind, model = tenant_route(req.method, req.path)
        try:  # a key with a lease is admitted here and now: a cache hit is still answered without a task
            decided = self.guard.admit_now(credential(req.path, req.headers), kind in INFERENCE_KINDS)
        except Refused as e:
            return self._refusal(e, req)
        if decided is None:
            return self._guarded(req, kind, model)
        return self._admitted(req, kind, model, *decided)

    async def _guarded(self, req: HttpRequest, kind: str, model: str | None) -> Response:
        """--auth keys, Redis asked: admit the request (key, model, limits), answer it, count what it used."""
        assert self.guard is not None
        try:
            principal, rate = await self.guard.admit(credential(req.path, req.headers), kind in INFERENCE_KINDS)
        except Refused as e:
            return self._refusal(e, req)
        answer = self._admitted(req, kind, model, principal, rate)
        return answer if isinstance(answer, (HttpResponse, StreamingResponse)) else await answer

    def _admitted(self, req: HttpRequest, kind: str, model: str | None, principal: Principal,
                  rate: list[tuple[str, str]]) -> Response | Awaitable[Response]:
        """A request whose key is admitted: refused if the key is not given its route or model, else answered."""
        if kind == "admin" and not principal.admin:
            return self._refusal(Refused(403, f"{req.method} {req.path} is for admin keys only (`dstool keys create "
                                              "--admin`)", "permission_denied"), req)
        why = principal.not_given(model) if model is not None else None
        if why is not None:
            return self._refusal(Refused(404 if kind.startswith("openai") else 403, why, "model_not_found"), req)
        req.principal = principal
        answer = self._route(req)
        if isinstance(answer, (HttpResponse, StreamingResponse)):
            return self._answered(req, kind, principal, rate, answer)
        return self._answered_later(req, kind, principal, rate, answer)

    async def _answered_later(self, req, kind, principal, rate, answer: Awaitable[Response]) -> Response:
        return self._answered(req, kind, principal, rate, await answer)

    def _answered(self, req: HttpRequest, kind: str, principal: Principal, rate: list[tuple[str, str]],
                  response: Response) -> Response:
        """The response with the key's rate headers; the request's outcome counted (OpenAI's tokens are counted as
        they come, openai/routes.py)."""
        assert self.guard is not None
        if kind == "inference":
            self.guard.charge(principal, *req.tokens, hit=req.hit, error=response.status >= 400)
        elif kind == "openai_inference" and response.status >= 400:
            self.guard.charge(principal, error=True)
        if rate:  # on a copy: a cache hit's response is kept with its entry and shared
            response = dataclasses.replace(response, headers=[*response.headers, *rate])
        return response

    @staticmethod
    def _refusal(e: Refused, req: HttpRequest) -> HttpResponse:
        api = api_of(req.path, req.headers)
        if api == "anthropic":
            return anthropic_refused(e)
        if api == "openai":
            return refused(e)
        refusal = error_response(e.status, e.message)
        refusal.headers += e.headers
        return refusal

    def _route(self, req: HttpRequest) -> Response | Awaitable[Response]:
        if req.path == "/metrics":
            return HttpResponse(200, [self.metrics.render()], [("Content-Type", "text/plain; version=0.0.4")])
        if req.path.startswith("/v1/"):
            if api_of(req.path, req.headers) == "anthropic":
                return self.anthropic.handle(req)
            return self.openai.handle(req)
        if req.path == "/v2/repository/index" and req.principal is not None and not req.principal.admin:
            return self._index(req)
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
        principal = req.principal
        meter = self.guard.meter(principal) if principal is not None and self.guard is not None else None
        opened = False
        try:
            request = read_request(req.body)
            adapter = generation_parameters(request, frozenset()).get("adapter")  # NAME_llm's LoRA adapter
            why = principal.not_given_adapter(model, adapter) if principal is not None else None
            if why is not None:
                raise Refused(403, why, "model_not_found")
            variant, opt_out = "", opts_out(req)
            if adapter not in (None, "") and model.endswith("_llm"):  # its sha256 in the key; unknown: not cached
                found = await self.openai.adapters.find(model[:-len("_llm")], adapter) \
                    if isinstance(adapter, str) and NAME.fullmatch(adapter) else None
                variant, opt_out = (found.sha256, opt_out) if found is not None else ("", True)
            if meter is not None:
                await meter.start(1, await self.generation.most_tokens(model, request))
            g = await self.generation.open(model, version, route, request, headers, keyed, opt_out=opt_out,
                                           scope=principal.scope(model, self.shared_models) if principal else "",
                                           tenant=principal.tenant if principal else "", variant=variant)
            opened = True
        except Refused as e:
            return self._refusal(e, req)
        except (UpstreamUnavailable, UpstreamTimeout) as e:
            self.metrics.error("upstream")
            return error_response(503, str(e))
        except (GatewayError, UnsafeRequest) as e:
            status = e.status if isinstance(e, GatewayError) else 400
            self.metrics.error("bad_request" if status < 500 else "upstream")
            return error_response(status, str(e))
        finally:
            if meter is not None and not opened:  # refused, failed or cancelled before an answer came
                meter.close()
        events = g.events
        if meter is not None:
            req.hit = g.hit
            if g.status == 200:
                events = _counted(events, meter)  # closes the meter as the answer ends
            else:
                meter.close()
        if route == "generate" or g.status != 200:
            body = b"".join([e async for e in events])
            if g.status >= 400 and (fault := backend_fault(body.decode(errors="replace"))):
                return error_response(503, fault)
            if g.status >= 400 and not body:
                return error_response(g.status, error_message(g.status, body))
            answer = json_object(body) if g.status == 200 else None
            if answer is not None and set(answer) == {"error"} and isinstance(answer["error"], str):
                # Triton's 200 holding only an error: `generate` on a decoupled model that answered several times
                # (`stream: true` on NAME_llm), "use generate stream" — the client's mistake, so a 4xx
                if fault := backend_fault(answer["error"]):
                    return error_response(503, fault)
                self.metrics.error("bad_request")
                return error_response(400, answer["error"])
            return HttpResponse(g.status, [body], g.headers)
        return StreamingResponse(g.status, g.headers, _sse(events), g.close)

    def infer(self, req: HttpRequest, model: str, version: str):
        started = time.perf_counter()
        opt_out = opts_out(req)
        try:
            request, output_format = decode_infer(model, version, req.headers, self._body(req), self.forward)
        except Passthrough:
            if req.principal is not None and not req.principal.admin and names_shared_memory(req.body, req.headers):
                return error_response(403, "shared-memory inputs and outputs are for admin keys only (regions are "
                                           "the server's, not a tenant's)")
            return self._relay_infer(req, model, started)
        except GatewayError as e:
            self.metrics.error("bad_request")
            response = error_response(e.status, e.message)
            if e.status == 415:
                response.headers.append(("Accept-Encoding", "gzip, deflate"))
            return response
        if req.principal is not None:
            request.scope = req.principal.scope(model, self.shared_models)
        if not opt_out:
            key = self.core.key_now(request)
            entry = self.core.cache.get_front(key) if key is not None else None
            if entry is not None:
                req.hit = True
                return self._answer(entry.result, entry, request, output_format, model, "hit", started,
                                    accepted_encoding(req.headers), req)
        return self._infer_async(req, request, output_format, opt_out, started)

    async def _infer_async(self, req, request, output_format, opt_out: bool, started: float) -> Response:
        meter = self.guard.meter(req.principal) if req.principal is not None and self.guard is not None else None
        try:
            key, version = await self.core.key(request, opt_out)
            if key is None and meter is None:
                return await self._relay_infer(req, request.model, started)
            encoding = accepted_encoding(req.headers)
            entry = await self.core.lookup(key) if key is not None else None
            if entry is not None:
                req.hit = True
                return self._answer(entry.result, entry, request, output_format, request.model, "hit", started,
                                    encoding, req)
            if meter is not None:
                await meter.start(1, await self.core.most_tokens(request))
            if key is None:  # a tenant's inference the cache does not keep: read, so its tokens are counted
                result, entry, outcome = await self.core.infer_upstream(request), None, "bypass"
            else:
                (result, entry), outcome = await self.core.compute(key, version, request), "miss"
            return self._answer(result, entry, request, output_format, request.model, outcome, started, encoding,
                                req, meter)
        except Refused as e:
            return self._refusal(e, req)
        except (GatewayError, UpstreamUnavailable, UpstreamTimeout) as e:
            status = e.status if isinstance(e, GatewayError) else 504 if isinstance(e, UpstreamTimeout) else 503
            self.metrics.error("bad_request" if status < 500 else "timeout" if status == 504 else "upstream")
            self.metrics.observe(request.model, "http", "error", time.perf_counter() - started)
            return error_response(status, str(e))
        finally:
            if meter is not None:
                meter.close()

    def _answer(self, result, entry, request, output_format, model, outcome, started,
                encoding: str | None = None, req: HttpRequest | None = None, meter: Meter | None = None
                ) -> HttpResponse:
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
        if meter is not None:  # computed for this request: charged against its reservation
            meter.add(*tensor_tokens(request, result))
        elif req is not None and req.principal is not None:
            req.tokens = tensor_tokens(request, result)
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
            return StreamingResponse(r.status, passed, r.chunks(), r.close)
        body = await r.read()
        if r.status >= 400 and (fault := backend_fault(body.decode(errors="replace"))):
            return error_response(503, fault)
        if r.status >= 400 and not body:
            return error_response(r.status, error_message(r.status, body))
        return HttpResponse(r.status, [body], passed)


    async def _index(self, req: HttpRequest) -> Response:
        """The repository index as Triton answers it, less the models the key is not given."""
        response = await self.relay(req)
        if isinstance(response, HttpResponse) and response.status == 200 and req.principal is not None:
            try:
                models = orjson.loads(b"".join(response.chunks))
                kept = [m for m in models if isinstance(m, dict) and req.principal.allows(str(m.get("name", "")))]
            except (orjson.JSONDecodeError, TypeError):
                return error_response(502, "Triton's repository index is not a JSON list")
            response.chunks = [orjson.dumps(kept)]
        return response


# Triton routes any key may use (with a model, if it is given that model); the rest are admin keys' (model control,
# shared memory, tracing, logging, every model's statistics, /metrics).
MODEL_ACTIONS = frozenset({"ready", "config", "stats", "infer", "generate", "generate_stream"})
INFERENCE_ACTIONS = frozenset({"infer", "generate", "generate_stream"})
OPENAI_INFERENCE = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages"})
ADAPTER_ADMIN = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})  # LoRA adapters: admin keys only
INFERENCE_KINDS = frozenset({"inference", "openai_inference"})


def credential(path: str, headers: dict[str, str]) -> str:
    """The request's Authorization header; on the /v1/ routes without one, Anthropic's `x-api-key` as a bearer token
    (what the `anthropic` client sends). Neither is ever passed on to Triton."""
    given = headers.get("authorization", "")
    if not given and path.startswith("/v1/") and "x-api-key" in headers:
        return "Bearer " + headers["x-api-key"]
    return given


def tenant_route(method: str, path: str) -> tuple[str, str | None]:
    """(kind, model) of a request under --auth keys: kind is openai_inference, openai, inference, model (metadata
    and the like), server (/v2, the repository index) or admin."""
    if path in ADAPTER_ADMIN:
        return "admin", None
    if path.startswith("/v1/"):
        return ("openai_inference" if method == "POST" and path in OPENAI_INFERENCE else "openai"), None
    if path in ("/v2", "/v2/", "/v2/repository/index"):
        return "server", None
    parts = path.split("/")
    if len(parts) >= 4 and parts[1:3] == ["v2", "models"] and parts[3] and parts[3] != "stats":
        model = parts[3].encode("latin-1").decode("utf-8", "surrogateescape")
        rest = parts[4:]
        if len(rest) >= 2 and rest[0] == "versions":
            rest = rest[2:]
        if not rest or (len(rest) == 1 and rest[0] in MODEL_ACTIONS):
            return ("inference" if rest and rest[0] in INFERENCE_ACTIONS and method == "POST" else "model"), model
    return "admin", None


async def _counted(events: AsyncGenerator[bytes, None], meter: Meter) -> AsyncGenerator[bytes, None]:
    """A generate answer's events as they are, the tokens they carry charged to the meter's key as they pass; its
    reservation closed at the end, however the answer ends."""
    prompt_seen = False
    try:
        async with contextlib.aclosing(events):
            async for event in events:
                d = data(event) if event.startswith(b"data: ") else json_object(event)
                if d is not None and "error" not in d:
                    ids = d.get("output_ids")
                    completion = len(ids) if isinstance(ids, list) else 1 if isinstance(ids, int) else 0
                    prompt = cached = 0
                    if not prompt_seen and isinstance(d.get("prompt_tokens"), int):
                        prompt, cached, prompt_seen = d["prompt_tokens"], int(d.get("prompt_cached_tokens") or 0), True
                    if completion or prompt:
                        meter.add(prompt, completion, cached)
                yield event
    finally:
        meter.close()


def model_route(path: str) -> tuple[str, str, str] | None:
    """(model, version or "", action) of /v2/models/NAME/ACTION or /v2/models/NAME/versions/DIGITS/ACTION, matched
    as Triton matches them: on the path as sent (no percent-decoding), the name being its UTF-8 bytes."""
    parts = path.split("/")
    if len(parts) not in (5, 7) or parts[1:3] != ["v2", "models"] or not parts[3] or (
            len(parts) == 7 and not (parts[4] == "versions" and parts[5].isascii() and parts[5].isdigit())):
        return None
    return parts[3].encode("latin-1").decode("utf-8", "surrogateescape"), parts[5] if len(parts) == 7 else "", parts[-1]


async def _sse(events: AsyncGenerator[bytes, None]) -> AsyncGenerator[bytes, None]:
    async with contextlib.aclosing(events):
        async for event in events:
            yield event + b"\n\n"
