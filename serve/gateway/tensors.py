"""The protocol-neutral form of a KServe v2 inference request and result.

HTTP (JSON or binary tensor extension) and gRPC requests are decoded into `InferRequest`, results into
`InferResult`: every tensor as name, datatype, shape and its raw little-endian bytes (BYTES tensors in
Triton's 4-byte-length-prefixed layout). Cache keys are computed on this form and cached results are
stored in it, so the two protocols share entries; each protocol renders it back in its own format.
"""

from __future__ import annotations

import math
import re
import struct
from dataclasses import dataclass, field

import numpy as np

NUMPY_TYPES = {"BOOL": np.bool_, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32, "UINT64": np.uint64,
               "INT8": np.int8, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64, "FP16": np.float16,
               "FP32": np.float32, "FP64": np.float64}
ITEM_SIZE = {name: np.dtype(t).itemsize for name, t in NUMPY_TYPES.items()} | {"BF16": 2}
DATATYPES = frozenset(ITEM_SIZE) | {"BYTES"}


class GatewayError(Exception):
    """A request the gateway answers with an error: `status` is the HTTP status (mapped to a gRPC code)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


# Triton's python backend failing, not the request: a stub process that died (Triton answers 400 on the generate
# extension, 500 / INTERNAL on infer, and keeps the model "ready"), or shared memory that cannot grow.
BACKEND_FAULT = re.compile(r"Stub process (?:'[^']*' )?is not healthy|Failed to obtain the health mutex|"
                           r"Failed to increase the shared memory pool size|grown shared memory region")


def backend_fault(message: str) -> str | None:
    """Triton's words for a fault of its backend in the error `message`, whatever status Triton gave it (answered
    503 / UNAVAILABLE: the model is down until `dstool serve` has loaded it again); None for any other error."""
    found = BACKEND_FAULT.search(message)
    return found.group(0) if found else None


@dataclass(slots=True)
class Tensor:
    name: str
    datatype: str
    shape: tuple[int, ...]
    raw: bytes


@dataclass(slots=True)
class InferRequest:
    model: str
    version: str  # "" = whichever version Triton serves
    inputs: list[Tensor]
    outputs: list[tuple[str, dict]] | None  # requested outputs with their parameters; None = all
    parameters: dict = field(default_factory=dict)
    id: str = ""
    headers: tuple[tuple[str, str], ...] = ()  # headers (gRPC metadata) Triton forwards to the model: part of the key
    scope: str = ""  # the cache namespace of the tenant asking ("" shared): part of the key


@dataclass(slots=True)
class InferResult:
    model_name: str
    model_version: str
    outputs: list[Tensor]
    parameters: dict = field(default_factory=dict)
    usage: tuple[int, int] | None = None  # (prompt, generated) tokens, read off outputs the client may not have asked


def check_tensor(t: Tensor, what: str = "input") -> None:
    """Raise a 400 GatewayError unless the tensor's bytes fit its datatype and shape."""
    if t.datatype not in DATATYPES:
        raise GatewayError(400, f"{what} '{t.name}': unknown datatype '{t.datatype}'")
    if any(d < 0 for d in t.shape):
        raise GatewayError(400, f"{what} '{t.name}': shape {list(t.shape)} has a negative dimension")
    count = math.prod(t.shape)
    if t.datatype == "BYTES":
        offset = 0
        for _ in range(count):
            if offset + 4 > len(t.raw):
                raise GatewayError(400, f"{what} '{t.name}': BYTES data holds fewer than {count} elements")
            offset += 4 + struct.unpack_from("<I", t.raw, offset)[0]
        if offset != len(t.raw):
            raise GatewayError(400, f"{what} '{t.name}': BYTES data does not fit shape {list(t.shape)}")
    elif len(t.raw) != count * ITEM_SIZE[t.datatype]:
        raise GatewayError(400, f"{what} '{t.name}': {len(t.raw)} bytes do not fit shape {list(t.shape)} "
                                f"of {t.datatype} ({count * ITEM_SIZE[t.datatype]} bytes)")


def from_values(name: str, datatype: str, shape, values) -> Tensor:
    """A tensor from gRPC typed contents (a flat list of values of the right type)."""
    try:
        shape = tuple(int(d) for d in shape)
    except (TypeError, ValueError):
        raise GatewayError(400, f"input '{name}': shape must be a list of integers") from None
    if datatype == "BYTES":
        raw = b"".join(struct.pack("<I", len(b)) + b for b in
                       (v if isinstance(v, bytes) else str(v).encode() for v in values))
    elif datatype in NUMPY_TYPES:
        try:
            raw = np.asarray(values, dtype=NUMPY_TYPES[datatype]).tobytes()
        except (TypeError, ValueError, OverflowError) as e:
            raise GatewayError(400, f"input '{name}': data does not convert to {datatype}: {e}") from None
    elif datatype in DATATYPES:
        raise GatewayError(400, f"input '{name}': {datatype} data must be sent as binary (raw) data")
    else:
        raise GatewayError(400, f"input '{name}': unknown datatype '{datatype}'")
    tensor = Tensor(name, datatype, shape, raw)
    check_tensor(tensor)
    return tensor


# What Triton accepts as JSON `data` elements for each datatype, and what it says when one does not fit.
def _is_signed(v) -> bool:
    return type(v) is int and -(2**63) <= v < 2**63


def is_unsigned(v) -> bool:
    return type(v) is int and 0 <= v < 2**64


def _is_number(v) -> bool:
    return type(v) in (int, float)


JSON_ELEMENT = {"BOOL": (lambda v: type(v) is bool, "non-boolean as boolean"),
                "INT8": (_is_signed, "non-signed-integer as signed-integer"),
                "INT16": (_is_signed, "non-signed-integer as signed-integer"),
                "INT32": (_is_signed, "non-signed-integer as signed-integer"),
                "INT64": (_is_signed, "non-signed-integer as signed-integer"),
                "UINT8": (is_unsigned, "non-unsigned-integer as unsigned-integer"),
                "UINT16": (is_unsigned, "non-unsigned-integer as unsigned-integer"),
                "UINT32": (is_unsigned, "non-unsigned-integer as unsigned-integer"),
                "UINT64": (is_unsigned, "non-unsigned-integer as unsigned-integer"),
                "FP32": (_is_number, "non-number as double"), "FP64": (_is_number, "non-number as double")}


def from_json(name: str, datatype: str, shape: tuple[int, ...], data, count: int) -> Tensor:
    """A tensor from KServe JSON `data`, checked as Triton checks it (the same messages): elements of the
    datatype's JSON type, nested lists allowed, `count` of them (the element count Triton computes for the
    shape). Integers wrap to the datatype's
    width as Triton's do; FP16/BF16 must come as binary data."""
    if not isinstance(data, list):
        raise GatewayError(400, "Unable to parse 'data': attempt to access JSON non-array as array")
    values = _flatten(data)
    if datatype == "BYTES":
        if not all(isinstance(v, str) for v in values):
            raise GatewayError(400, "Unable to parse JSON bytes array: attempt to access JSON non-string as string")
        raw = b"".join(struct.pack("<I", len(b)) + b for b in (v.encode() for v in values))
    elif datatype in JSON_ELEMENT:
        fits, what = JSON_ELEMENT[datatype]
        if not all(fits(v) for v in values):
            raise GatewayError(400, f"Unable to parse 'data': attempt to access JSON {what}")
        wide = np.float64 if datatype in ("FP32", "FP64") else np.uint64 if datatype.startswith("U") else np.int64
        raw = np.asarray(values, dtype=wide).astype(NUMPY_TYPES[datatype]).tobytes()
    elif datatype in ("FP16", "BF16"):
        raise GatewayError(400, f"receiving {datatype} data via JSON is not supported. Please use the binary data "
                                f"format for input {name}")
    else:
        raise GatewayError(400, f"invalid datatype for input {name}")
    if len(values) != count:
        raise GatewayError(400, "Unable to parse 'data': Shape does not match true shape of 'data' field")
    return Tensor(name, datatype, shape, raw)


def to_values(t: Tensor) -> list:
    """The tensor's elements as a flat list (what KServe JSON `data` holds)."""
    if t.datatype == "BYTES":
        values, offset = [], 0
        while offset < len(t.raw):
            n = struct.unpack_from("<I", t.raw, offset)[0]
            item = t.raw[offset + 4:offset + 4 + n]
            try:
                values.append(item.decode())
            except UnicodeDecodeError:
                values.append(item.decode("latin-1"))
            offset += 4 + n
        return values
    if t.datatype not in NUMPY_TYPES:
        raise GatewayError(400, f"output '{t.name}' is {t.datatype}, which JSON cannot carry: request binary_data")
    return np.frombuffer(t.raw, dtype=NUMPY_TYPES[t.datatype]).tolist()


def _flatten(values) -> list:
    """Nested lists' elements in order (iterative: a client chooses the depth)."""
    out: list = []
    stack = [iter(values)]
    while stack:
        for v in stack[-1]:
            if isinstance(v, list):
                stack.append(iter(v))
                break
            out.append(v)
        else:
            stack.pop()
    return out
