"""The gateway's KServe v2 gRPC endpoint (inference.GRPCInferenceService).

A grpc.aio server with one generic handler working on raw bytes: ModelInfer is decoded (tritonclient's
service_pb2), answered from the cache or computed through the core; every other method, ModelStreamInfer
included, is relayed to Triton's gRPC port byte for byte, so its answers and error codes are Triton's own.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import re
import time
from collections import deque
from typing import NoReturn

import grpc
import numpy as np
from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2

from dstool.serve.gateway.core import GatewayCore
from dstool.serve.gateway.generation import salted, tenant_tag
from dstool.serve.gateway.kserve.codec import CREDENTIALS
from dstool.serve.gateway.metrics import Metrics
from dstool.serve.gateway.tenancy.auth import Principal
from dstool.serve.gateway.tenancy.guard import Guard, Meter, Refused, estimated_tokens, tensor_tokens
from dstool.serve.gateway.tensors import (
    NUMPY_TYPES,
    GatewayError,
    InferRequest,
    InferResult,
    Tensor,
    backend_fault,
    check_tensor,
    from_values,
)
from dstool.serve.gateway.upstream import UpstreamTimeout, UpstreamUnavailable

SERVICE = "/inference.GRPCInferenceService/"
HEALTH_CHECK = "/grpc.health.v1.Health/Check"  # the standard gRPC health service, which Triton implements too
# Health methods: open to every client, answered within the health timeout, and "not ready" when Triton is not.
NOT_READY = {SERVICE + "ServerLive": service_pb2.ServerLiveResponse(live=False).SerializeToString(),
             SERVICE + "ServerReady": service_pb2.ServerReadyResponse(ready=False).SerializeToString(),
             SERVICE + "ModelReady": service_pb2.ModelReadyResponse(ready=False).SerializeToString(),
             HEALTH_CHECK: b"\x08\x02"}  # HealthCheckResponse{status: NOT_SERVING}
HEALTH_METHODS = frozenset(NOT_READY)
REPOSITORY_CONTROL = {SERVICE + "RepositoryModelLoad": service_pb2.RepositoryModelLoadRequest,
                      SERVICE + "RepositoryModelUnload": service_pb2.RepositoryModelUnloadRequest}
STATUS_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
                404: grpc.StatusCode.NOT_FOUND, 413: grpc.StatusCode.RESOURCE_EXHAUSTED,
                429: grpc.StatusCode.RESOURCE_EXHAUSTED, 503: grpc.StatusCode.UNAVAILABLE,
                504: grpc.StatusCode.DEADLINE_EXCEEDED}
CONTENTS_FIELD = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
                  "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents",
                  "UINT32": "uint_contents", "UINT64": "uint64_contents", "FP32": "fp32_contents",
                  "FP64": "fp64_contents", "BYTES": "bytes_contents"}
NOT_FORWARDED = frozenset({"authorization", "user-agent", "cache-control"})
# --auth keys: the calls that name a model (the key must be given it), those any key may make; the rest are admin's
MODEL_METHODS = {SERVICE + "ModelMetadata": service_pb2.ModelMetadataRequest,
                 SERVICE + "ModelConfig": service_pb2.ModelConfigRequest,
                 SERVICE + "ModelStatistics": service_pb2.ModelStatisticsRequest}
TENANT_METHODS = frozenset({SERVICE + "ModelInfer", SERVICE + "ModelStreamInfer", SERVICE + "ServerMetadata",
                            SERVICE + "RepositoryIndex", *MODEL_METHODS})
REFUSED_CODES = {401: grpc.StatusCode.UNAUTHENTICATED, 403: grpc.StatusCode.PERMISSION_DENIED,
                 404: grpc.StatusCode.PERMISSION_DENIED, 429: grpc.StatusCode.RESOURCE_EXHAUSTED,
                 503: grpc.StatusCode.UNAVAILABLE}


class _Passthrough(Exception):
    """A request the cache does not model: relayed to Triton as it is."""


class _Failed(Exception):
    """A relayed health call that Triton did not answer."""


UNPARSABLE = "Unable to parse request"  # what Triton says (as INTERNAL) of bytes that are no request message


def _parameters(params) -> dict:
    return {k: getattr(p, p.WhichOneof("parameter_choice")) for k, p in params.items()
            if p.WhichOneof("parameter_choice")}


def _set_parameter(target, key: str, value) -> None:
    p = target[key]
    if isinstance(value, bool):
        p.bool_param = value
    elif isinstance(value, int):
        p.int64_param = value
    elif isinstance(value, float):
        p.double_param = value
    else:
        p.string_param = str(value)


_TYPED = frozenset({"int64_param", "bool_param", "string_param", "double_param"})
_REQUEST_PARAMETER = {"sequence_id": {"int64_param", "string_param"}, "sequence_start": {"bool_param"},
                      "sequence_end": {"bool_param"}, "priority": {"int64_param", "uint64_param"},
                      "timeout": {"int64_param"}}


def _plain_parameters(params) -> bool:
    """Whether Triton takes these request parameters as they are (their types are the ones it expects)."""
    for key, p in params.items():
        kind = p.WhichOneof("parameter_choice")
        if key.startswith("triton_") or kind not in _REQUEST_PARAMETER.get(key, _TYPED) or \
                (key == "priority" and kind == "int64_param" and p.int64_param < 0):
            return False
    return True


def decode_infer(msg: service_pb2.ModelInferRequest) -> InferRequest:
    """The request in the cache's form when it is one Triton takes as it is: each input's data in
    raw_input_contents, or in the one typed contents field of its datatype. Anything else (shared memory, both
    or neither, counts or sizes that do not fit, parameters of other types) raises _Passthrough: Triton reads it,
    so its answer, an error included, is Triton's own."""
    raw = msg.raw_input_contents
    if not msg.inputs or (raw and len(raw) != len(msg.inputs)) or not _plain_parameters(msg.parameters):
        raise _Passthrough()
    inputs = []
    try:
        for i, item in enumerate(msg.inputs):
            if "shared_memory_region" in item.parameters:
                raise _Passthrough()
            if raw:
                if item.HasField("contents"):
                    raise _Passthrough()
                tensor = Tensor(item.name, item.datatype, tuple(item.shape), raw[i])
                check_tensor(tensor)
            else:
                field = CONTENTS_FIELD.get(item.datatype)
                if field is None or [f.name for f, _ in item.contents.ListFields()] != [field]:
                    raise _Passthrough()
                tensor = from_values(item.name, item.datatype, item.shape, list(getattr(item.contents, field)))
            inputs.append(tensor)
    except GatewayError:
        raise _Passthrough() from None
    outputs = None
    if msg.outputs:
        outputs = []
        for o in msg.outputs:
            if "shared_memory_region" in o.parameters:
                raise _Passthrough()
            params = {}  # Triton's gRPC endpoint reads one output parameter besides shared memory
            if "classification" in o.parameters:
                c = o.parameters["classification"]
                if c.WhichOneof("parameter_choice") != "int64_param" or c.int64_param < 0:
                    raise _Passthrough()
                params["classification"] = c.int64_param
            outputs.append((o.name, params))
    return InferRequest(msg.model_name, msg.model_version, inputs, outputs, _parameters(msg.parameters),
                        msg.id.split("\0", 1)[0])  # Triton keeps the id as a C string


SHARED_MEMORY_REFUSED = "shared-memory inputs and outputs are for admin keys only (regions are the server's)"


def _authorization(context) -> str:
    given = dict(context.invocation_metadata()).get("authorization", "")
    return given.decode("latin-1") if isinstance(given, bytes) else given


async def _refused(context, e: Refused) -> NoReturn:
    """End the call as the guard refused it: its status code, message and headers (as trailing metadata)."""
    context.set_trailing_metadata(tuple((k.lower(), v) for k, v in e.headers))
    await context.abort(REFUSED_CODES[e.status], e.message)
    raise AssertionError("context.abort raises")


def names_shared_memory(msg) -> bool:
    return any("shared_memory_region" in t.parameters for t in (*msg.inputs, *msg.outputs))


def _charged(raw: bytes, meters: dict[str, deque]) -> None:
    """Charge one ModelStreamInfer response to its request's meter (the oldest in flight under its id): the elements
    of its `output_ids` output (NAME_llm's) and, in its first response, its `prompt_tokens` and
    `prompt_cached_tokens`; the request's last response (or an error) closes its meter."""
    try:
        message = service_pb2.ModelStreamInferResponse.FromString(raw)
    except DecodeError:
        return
    response = message.infer_response
    waiting = meters.get(response.id)
    if not waiting:
        return
    meter = waiting[0]
    counts = {"output_ids": 0, "prompt_tokens": 0, "prompt_cached_tokens": 0}
    for i, output in enumerate(response.outputs):
        if output.name in counts and i < len(response.raw_output_contents) and output.datatype in NUMPY_TYPES:
            values = np.frombuffer(response.raw_output_contents[i], NUMPY_TYPES[output.datatype])
            counts[output.name] = len(values) if output.name == "output_ids" else int(values.sum())
    first = meter.spent == 0
    meter.add(counts["prompt_tokens"] if first else 0, counts["output_ids"],
              counts["prompt_cached_tokens"] if first else 0)
    final = response.parameters.get("triton_final_response")
    if message.error_message or final is None or final.bool_param:
        waiting.popleft().close()
        if not waiting:
            del meters[response.id]


async def _merged(call, refusals: asyncio.Queue):
    """A stream call's responses, and the gateway's own refusals of some of its requests, as they come."""
    ended = object()

    async def pump():
        try:
            async for response in call:
                await refusals.put(response)
        except grpc.aio.AioRpcError as e:
            await refusals.put(e)
        await refusals.put(ended)

    reader = asyncio.ensure_future(pump())
    try:
        while (item := await refusals.get()) is not ended:
            if isinstance(item, grpc.aio.AioRpcError):
                raise item
            yield item
        while not refusals.empty():  # refusals after Triton's last answer
            item = refusals.get_nowait()
            if isinstance(item, bytes):
                yield item
    finally:
        reader.cancel()


def render_infer(result: InferResult, request_id: str) -> bytes:
    response = service_pb2.ModelInferResponse(model_name=result.model_name, model_version=result.model_version,
                                              id=request_id)
    for t in result.outputs:
        response.outputs.add(name=t.name, datatype=t.datatype, shape=t.shape)
        response.raw_output_contents.append(t.raw)
    for k, v in result.parameters.items():
        _set_parameter(response.parameters, k, v)
    return response.SerializeToString()


class GrpcFrontend(grpc.GenericRpcHandler):
    def __init__(self, core: GatewayCore, metrics: Metrics, upstream_targets: list[str], token: str | None,
                 timeout: float, health_timeout: float, forward_headers: str | None = None, guard: Guard | None = None,
                 shared_models: frozenset[str] = frozenset()):
        self.forward = re.compile(forward_headers, re.IGNORECASE) if forward_headers else None
        self.guard, self.shared_models = guard, shared_models
        self.core = core
        self.metrics = metrics
        self.token = f"Bearer {token}".encode() if token else None
        self.timeout, self.health_timeout = timeout, health_timeout
        # Triton's error messages repeat what the client sent (a model name of any length): relayed whole
        options = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1),
                   ("grpc.max_metadata_size", 1 << 20), ("grpc.absolute_max_metadata_size", 1 << 20)]
        self.channels = [grpc.aio.insecure_channel(t, options=options) for t in upstream_targets]
        self._turn = itertools.cycle(range(len(self.channels)))
        self._handlers: dict[str, grpc.RpcMethodHandler] = {}

    def service(self, details):
        method = details.method
        if not method.startswith(SERVICE) and method != HEALTH_CHECK:
            return None
        handler = self._handlers.get(method)
        if handler is None:
            if method == SERVICE + "ModelInfer":
                handler = grpc.unary_unary_rpc_method_handler(self.model_infer)
            elif method == SERVICE + "ModelStreamInfer":
                handler = grpc.stream_stream_rpc_method_handler(self._stream_relay(method))
            else:
                handler = grpc.unary_unary_rpc_method_handler(self._unary_relay(method))
            self._handlers[method] = handler
        return handler

    async def _admit(self, context, method: str, raw: bytes = b"") -> Principal | None:
        """--auth keys: the caller's principal, admitted for `method` (its model, read from the request `raw`, given
        to the key; an inference within its limits); the call aborted otherwise. None for open calls and without
        keys."""
        if self.guard is None or method in HEALTH_METHODS:
            await self._check_token(context, method)
            return None
        given = _authorization(context)
        model, inference = None, method == SERVICE + "ModelInfer"  # a stream's requests are admitted one by one
        try:
            principal, rate = await self.guard.admit(given, inference)
            if method in MODEL_METHODS:
                try:
                    model = MODEL_METHODS[method].FromString(raw).name
                except DecodeError:
                    model = None
                if not model and not principal.admin:
                    raise Refused(403, f"{method.rsplit('/', 1)[1]} without a model name is for admin keys only",
                                  "permission_denied")
            elif method not in TENANT_METHODS and not principal.admin:
                raise Refused(403, f"{method.rsplit('/', 1)[1]} is for admin keys only (`dstool keys create --admin`)",
                              "permission_denied")
            why = principal.not_given(model) if model else None
            if why is not None:
                raise Refused(403, why, "model_not_found")
        except Refused as e:
            await _refused(context, e)
        if rate:
            context.set_trailing_metadata(tuple(rate))
        return principal

    async def _check_token(self, context, method: str) -> None:
        if self.token and method not in HEALTH_METHODS:
            given = dict(context.invocation_metadata()).get("authorization", "")
            given_bytes = given if isinstance(given, bytes) else given.encode("utf-8", "surrogateescape")
            if not hmac.compare_digest(given_bytes, self.token):  # bytes: any metadata value compares
                self.metrics.error("unauthorized")
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

    def _forwarded_metadata(self, context) -> tuple:
        return tuple((k, v) for k, v in context.invocation_metadata()
                     if k not in NOT_FORWARDED and not k.startswith(":") and not k.startswith("grpc-"))

    def _unary_relay(self, method: str):
        async def relay(raw: bytes, context) -> bytes:
            principal = await self._admit(context, method, raw)
            if method == SERVICE + "RepositoryIndex" and principal is not None and not principal.admin:
                index = service_pb2.RepositoryIndexResponse.FromString(
                    await self._relay_unary(method, raw, context, self.timeout))
                kept = [m for m in index.models if principal.allows(m.name)]
                del index.models[:]
                index.models.extend(kept)
                return index.SerializeToString()
            if method in HEALTH_METHODS:  # a Triton that does not answer in time is not ready
                try:
                    return await self._relay_unary(method, raw, context, self.health_timeout, quiet=True)
                except _Failed:
                    return NOT_READY[method]
            return await self._relay_unary(method, raw, context, self.timeout)
        return relay

    def _deadline(self, context, timeout: float) -> float:
        """This call's deadline on Triton: ours, or the client's own when that is shorter."""
        remaining = context.time_remaining()
        return timeout if remaining is None else max(0.001, min(timeout, remaining))

    async def _relay_unary(self, method: str, raw: bytes, context, timeout: float, quiet: bool = False) -> bytes:
        first = next(self._turn)
        servers = self.core.upstreams.servers
        error: tuple[grpc.StatusCode, str] | None = None
        for i in range(len(self.channels)):
            k = (first + i) % len(self.channels)
            if k < len(servers) and servers[k].down:  # marked down: fail at once, do not wait out a deadline
                error = error or (grpc.StatusCode.UNAVAILABLE, f"Triton at {servers[k].address} is not answering: "
                                  "retry later")
                continue
            call = self.channels[k].unary_unary(method)
            try:
                answer = await call(raw, metadata=self._forwarded_metadata(context),
                                    timeout=self._deadline(context, timeout))
                if method in REPOSITORY_CONTROL:  # loaded or unloaded: what it serves now is what its files say
                    self.core.deployments.invalidate(REPOSITORY_CONTROL[method].FromString(raw).model_name,
                                                      reloaded=True)
                return answer
            except grpc.aio.AioRpcError as e:
                error = (grpc.StatusCode.UNAVAILABLE if backend_fault(e.details() or "") else e.code(),
                         e.details() or "")
                if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and k < len(servers):
                    servers[k].check_health()
                if e.code() != grpc.StatusCode.UNAVAILABLE:
                    break
        assert error is not None  # there is at least one channel
        unanswered = error[0] in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        if unanswered:
            self.metrics.error("upstream")
        if method in REPOSITORY_CONTROL:
            self.core.deployments.invalidate()
        if quiet and unanswered:
            raise _Failed()
        if error == (grpc.StatusCode.INTERNAL, UNPARSABLE):  # the client's bytes: a client error
            error = (grpc.StatusCode.INVALID_ARGUMENT, UNPARSABLE)
        await context.abort(*error)
        raise AssertionError("context.abort raises")

    def _stream_relay(self, method: str):
        async def relay(requests, context):
            principal = await self._admit(context, method)
            refusals: asyncio.Queue = asyncio.Queue()
            meters: dict[str, deque[Meter]] = {}  # a tenant's requests in flight on the stream, by id
            if principal is not None and self.guard is not None:
                requests = self._given(requests, principal, context, meters, refusals)
            servers, first = self.core.upstreams.servers, next(self._turn)
            up = [k for k in ((first + i) % len(self.channels) for i in range(len(self.channels)))
                  if k >= len(servers) or not servers[k].down]
            if not up:  # every Triton marked down: fail at once, as unary calls do
                self.metrics.error("upstream")
                await context.abort(grpc.StatusCode.UNAVAILABLE, "no Triton is answering: retry later")
            call = self.channels[up[0]].stream_stream(method)(
                requests, metadata=self._forwarded_metadata(context), timeout=context.time_remaining())
            responses = call if principal is None else _merged(call, refusals)
            try:
                async for response in responses:
                    if principal is not None:
                        _charged(response, meters)
                    if response[:1] == b"\n":  # an error answer (error_message, field 1, is serialized first)
                        fault = backend_fault(service_pb2.ModelStreamInferResponse.FromString(response).error_message)
                        if fault:  # the model is down: the stream ends UNAVAILABLE, as when Triton does not answer
                            self.metrics.error("upstream")
                            await context.abort(grpc.StatusCode.UNAVAILABLE, fault)
                    yield response
            except grpc.aio.AioRpcError as e:
                await context.abort(e.code(), e.details() or "")
            finally:
                call.cancel()  # the client cancelled or went away: so does the call to Triton (a no-op once done)
                for waiting in meters.values():
                    for meter in waiting:
                        meter.close()
        return relay

    async def _given(self, requests, principal: Principal, context, meters: dict[str, deque[Meter]],
                     refusals: asyncio.Queue):
        """A stream's requests, each admitted as an inference of its own (the key still valid, within its limits, its
        tenant's turn and its tokens reserved: a Meter under its id in `meters`), on a model the key is given, naming
        no shared memory unless the key is an admin's; one that is not is answered on the stream with its error (as
        Triton answers a request it refuses), the others go on."""
        assert self.guard is not None
        authorization = _authorization(context)
        async for raw in requests:
            try:
                msg = service_pb2.ModelInferRequest.FromString(raw)
            except DecodeError:
                msg = service_pb2.ModelInferRequest()
            meter = self.guard.meter(principal)
            try:
                await self.guard.admit(authorization, inference=True)
                why = principal.not_given(msg.model_name) or principal.not_given_adapter(
                    msg.model_name, _parameters(msg.parameters).get("adapter"))
                if why is None and not principal.admin and names_shared_memory(msg):
                    why = SHARED_MEMORY_REFUSED
                if why is not None:
                    raise Refused(403, why, "permission_denied")
                await meter.start(1, await self._most_tokens(msg, raw))
                salted = await self._salted(raw, msg, principal)
            except (Refused, GatewayError) as e:
                meter.close()
                refusals.put_nowait(service_pb2.ModelStreamInferResponse(
                    error_message=e.message, infer_response=service_pb2.ModelInferResponse(
                        model_name=msg.model_name, model_version=msg.model_version, id=msg.id)).SerializeToString())
                continue
            meters.setdefault(msg.id, deque()).append(meter)
            yield salted

    async def _most_tokens(self, msg, raw: bytes) -> int:
        """The most tokens one request of a stream may use (core.most_tokens; estimated from its size where the
        gateway does not model it)."""
        try:
            return await self.core.most_tokens(decode_infer(msg))
        except _Passthrough:
            return estimated_tokens(len(raw))

    async def _salted(self, raw: bytes, msg, principal: Principal) -> bytes:
        """A stream's request to the engine with its tenant's turn (`tenant`) and its prefix-cache salt made its
        tenant's (generation.salted); GatewayError for a salt that is not a string."""
        scope = principal.scope(msg.model_name, self.shared_models)
        try:
            d = await self.core.deployments.get(msg.model_name)
        except (GatewayError, UpstreamUnavailable, UpstreamTimeout):
            return raw  # Triton answers it
        if "prefix_cache_tokens" not in (d.config.get("parameters") or {}):
            return raw
        msg.parameters["tenant"].string_param = tenant_tag(principal.tenant)  # its turn among tenants in the engine
        if scope:
            given = _parameters(msg.parameters).get("cache_salt")
            msg.parameters["cache_salt"].string_param = salted({} if given is None else {"cache_salt": given},
                                                               scope)["cache_salt"]
        return msg.SerializeToString()

    async def model_infer(self, raw: bytes, context) -> bytes:
        started = time.perf_counter()
        principal = await self._admit(context, SERVICE + "ModelInfer")
        try:
            msg = service_pb2.ModelInferRequest.FromString(raw)
        except DecodeError:  # Triton answers it (as it answers every request the cache does not model)
            if principal is not None:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, UNPARSABLE)
            return await self._relay_infer(raw, context, started, "")
        why = principal.not_given(msg.model_name) if principal is not None else None
        if why is not None:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, why)
        try:
            return await self._model_infer(raw, msg, context, started, principal)
        except BaseException:
            if principal is not None and self.guard is not None:
                self.guard.charge(principal, error=True)
            raise

    async def _model_infer(self, raw: bytes, msg, context, started: float, principal: Principal | None) -> bytes:
        try:
            request = decode_infer(msg)
        except _Passthrough:
            if principal is not None and not principal.admin and names_shared_memory(msg):
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, SHARED_MEMORY_REFUSED)
            return await self._relay_infer(raw, context, started, msg.model_name)
        if principal is not None:
            request.scope = principal.scope(request.model, self.shared_models)
        if self.forward is not None:
            request.headers = tuple(sorted((k, v) for k, v in context.invocation_metadata()
                                           if isinstance(v, str) and k not in CREDENTIALS and self.forward.match(k)))
        opt_out = any(k == "cache-control" and ("no-store" in v or "no-cache" in v)
                      for k, v in context.invocation_metadata())
        meter = self.guard.meter(principal) if principal is not None and self.guard is not None else None
        try:
            return await self._infer(raw, request, context, started, opt_out, meter)
        finally:
            if meter is not None:
                meter.close()

    async def _infer(self, raw: bytes, request: InferRequest, context, started: float, opt_out: bool,
                     meter: Meter | None) -> bytes:
        """A decoded ModelInfer: from the cache, or computed (a tenant's, `meter`, reserved first and charged)."""
        try:
            key, version = await self.core.key(request, opt_out)
            if key is None and meter is None:
                return await self._relay_infer(raw, context, started, request.model)
            entry = await self.core.lookup(key) if key is not None else None
            outcome = "hit"
            if entry is not None:
                result = entry.result
            else:
                if meter is not None:
                    await meter.start(1, await self.core.most_tokens(request))
                if key is None:  # a tenant's inference the cache does not keep: read, so its tokens are counted
                    result, outcome = await self.core.infer_upstream(request), "bypass"
                else:
                    (result, entry), outcome = await self.core.compute(key, version, request), "miss"
        except Refused as e:
            await _refused(context, e)
        except (GatewayError, UpstreamUnavailable, UpstreamTimeout) as e:
            status = e.status if isinstance(e, GatewayError) else 504 if isinstance(e, UpstreamTimeout) else 503
            self.metrics.error("upstream" if status >= 500 else "bad_request")
            self.metrics.observe(request.model, "grpc", "error", time.perf_counter() - started)
            await context.abort(STATUS_CODES.get(status, grpc.StatusCode.INTERNAL), str(e))
        if entry is not None and not request.id:
            body = entry.rendered.get("grpc")
            if body is None:
                body = render_infer(result, "")
                entry.keep("grpc", body, len(body))
        else:
            body = render_infer(result, request.id)
        self.metrics.observe(request.model, "grpc", outcome, time.perf_counter() - started,
                             sum(len(t.raw) for t in result.outputs) if outcome == "hit" else 0)
        if meter is not None and outcome != "hit":  # computed for this request: charged against its reservation
            meter.add(*tensor_tokens(request, result))
        elif meter is not None:
            meter.guard.charge(meter.principal, *tensor_tokens(request, result), hit=True)
        return body

    async def _relay_infer(self, raw: bytes, context, started: float, model: str) -> bytes:
        try:
            body = await self._relay_unary(SERVICE + "ModelInfer", raw, context, self.timeout)
        except BaseException:
            self.metrics.observe(model, "grpc", "error", time.perf_counter() - started)
            raise
        self.metrics.observe(model, "grpc", "bypass", time.perf_counter() - started)
        return body

    async def close(self) -> None:
        for channel in self.channels:
            await channel.close()
