"""The KServe v2 JSON codec of the HTTP endpoint, read and written as Triton 2.51 does: an infer request (JSON or
the binary tensor extension) decoded into an `InferRequest` with Triton's own messages for each mistake, a result
rendered into Triton's response bytes, and the response compression Triton chooses from Accept-Encoding.
"""

from __future__ import annotations

import json
import math
import re
import struct
import zlib
from typing import Any

import orjson

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
from dstool.serve.gateway.transport import HttpResponse
from dstool.serve.gateway.triton_json import parse_json

CREDENTIALS = frozenset({"authorization", "proxy-authorization"})  # the gateway's to check, never passed on


def names_shared_memory(body: bytes, headers: dict[str, str]) -> bool:
    """Whether an infer request (JSON or binary tensor extension) names a shared-memory region."""
    length = headers.get("inference-header-content-length")
    head = body[:_c_atoi(length)] if length is not None and _c_atoi(length) > 0 else body
    if b"shared_memory_region" not in head:
        return False
    try:
        header = orjson.loads(head)
    except orjson.JSONDecodeError:
        return True  # not read here, nor certainly not one: Triton would read it
    items = [*(header.get("inputs") or []), *(header.get("outputs") or [])] if isinstance(header, dict) else []
    return any(isinstance(i, dict) and "shared_memory_region" in _params(i) for i in items) or \
        not isinstance(header, dict)


class Passthrough(Exception):
    """The request uses features the cache does not model (shared memory): relay it to Triton as it is."""



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


def error_response(status: int, message: str) -> HttpResponse:
    """KServe v2's error body, as Triton writes it: {"error": message}."""
    return HttpResponse(status, [orjson.dumps({"error": message})], [("Content-Type", "application/json")])


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
            raise Passthrough()  # a raw binary request: the whole body is the model's one input
        header_bytes, binary = body[:n], memoryview(body)[n:]
    elif not body:
        raise Passthrough()  # Triton reads an empty body as a raw binary request too
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
        raise Passthrough()  # Triton names the inputs the model expects
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
            raise Passthrough()
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
                raise Passthrough()
            name = _member(item, "name", str, "string")
            if "classification" in params and not is_unsigned(params["classification"]):
                raise GatewayError(400, "Unable to set 'classification': attempt to access JSON "
                                        "non-unsigned-integer as unsigned-integer")
            _flag(params, "binary_data", False)
            outputs.append((name, params))
        # Listed outputs come back as their own binary_data says (JSON unless true), as Triton does.
        formats = tuple((name, params.get("binary_data", False)) for name, params in outputs)
    if passthrough:
        raise Passthrough()
    forwarded = tuple(sorted((k, v) for k, v in headers.items()
                             if forward is not None and k not in CREDENTIALS and forward.match(k)))
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
