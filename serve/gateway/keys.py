"""Cache keys: a BLAKE2b-256 digest of everything that determines an inference result, under a namespace
that fingerprints the deployed model version (so a new or reloaded version never meets an old entry)."""

from __future__ import annotations

import hashlib
import struct

import orjson

from dstool.serve.gateway.tensors import InferRequest

PREFIX = "dstool:gw:1"
# Request parameters that only change how or when a result is delivered, not the result itself.
DELIVERY_PARAMETERS = frozenset({"binary_data_output", "priority", "timeout", "headers"})
# Output parameters that only change the wire format.
OUTPUT_FORMAT_PARAMETERS = frozenset({"binary_data", "binary_data_size"})
# Parameters that make a request part of a stateful sequence: never cached.
SEQUENCE_PARAMETERS = frozenset({"sequence_id", "sequence_start", "sequence_end"})
# Parameters that ask a generation model to sample even without a temperature (dstool's, vLLM's names).
SAMPLING_PARAMETERS = frozenset({"top_k", "top_p", "min_p"})


def model_fingerprint(model: str, version: str, config: dict, files: list | None = None) -> str:
    """Fingerprint of one deployed model version: its name, version, Triton config and (when the gateway can
    see the repository) the version folder's file names, sizes and modification times."""
    blob = orjson.dumps([model, version, config, files or []], option=orjson.OPT_SORT_KEYS)
    return hashlib.blake2b(blob, digest_size=12).hexdigest()


def cache_key(fingerprint: str, version: str, request: InferRequest, model_outputs: list[str]) -> str:
    """The Redis key of `request` served by model version `version` with fingerprint `fingerprint`; a request
    naming no outputs is keyed as one asking for all of `model_outputs` (what Triton then returns)."""
    h = hashlib.blake2b(digest_size=32)
    outputs = request.outputs if request.outputs is not None else [(n, {}) for n in model_outputs]
    meta = [request.model, version,
            sorted(([n, {k: v for k, v in p.items() if k not in OUTPUT_FORMAT_PARAMETERS}] for n, p in outputs),
                   key=lambda o: str(o[0])),
            {k: v for k, v in request.parameters.items() if k not in DELIVERY_PARAMETERS}, list(request.headers)]
    for t in sorted(request.inputs, key=lambda t: t.name):
        meta.append([t.name, t.datatype, t.shape, len(t.raw)])
    blob = orjson.dumps(meta, option=orjson.OPT_SORT_KEYS)
    h.update(struct.pack("<I", len(blob)))
    h.update(blob)
    for t in sorted(request.inputs, key=lambda t: t.name):
        h.update(t.raw)
    return f"{PREFIX}:{request.model}:{fingerprint}:{h.hexdigest()}"


def key_fingerprint(key: str) -> str:
    """The model fingerprint a cache key was made under."""
    return key.rsplit(":", 2)[-2]


def never_cached(request: InferRequest) -> bool:
    """A request whose answer is not a function of the request: part of a sequence, or a draw."""
    return is_sequence_request(request) or is_draw(request.parameters)


def is_draw(parameters: dict) -> bool:
    """Sampling without a seed: temperature > 0, or top_k/top_p/min_p with no temperature (the generation
    models' rule, serve/triton_models/sampling.py)."""
    if parameters.get("seed") is not None:
        return False
    if "temperature" in parameters:
        t = parameters["temperature"]
        return isinstance(t, (int, float)) and not isinstance(t, bool) and t > 0
    return any(k in parameters for k in SAMPLING_PARAMETERS)


def is_sequence_request(request: InferRequest) -> bool:
    return any(k in SEQUENCE_PARAMETERS and v not in (0, "", False) for k, v in request.parameters.items())
