"""Cache keys: a BLAKE2b-256 digest of everything that determines an inference result, under a namespace
that fingerprints the deployed model version (so a new or reloaded version never meets an old entry)."""

from __future__ import annotations

import hashlib
import struct

import orjson

from dstool.decoding.sampling import SamplingError, SamplingParams
from dstool.serve.gateway.tensors import InferRequest

PREFIX = "dstool:gw:1"
# Request parameters that only change how or when a result is delivered, not the result itself.
DELIVERY_PARAMETERS = frozenset({"binary_data_output", "priority", "timeout", "headers"})
# Output parameters that only change the wire format.
OUTPUT_FORMAT_PARAMETERS = frozenset({"binary_data", "binary_data_size"})
# Parameters that make a request part of a stateful sequence: never cached.
SEQUENCE_PARAMETERS = frozenset({"sequence_id", "sequence_start", "sequence_end"})


# The config parameter `dstool serve` adds when it loads a model again after its stub process died: the same files
# and config, so the same results (not part of the fingerprint).
RESTART_PARAMETER = "dstool_restart"


def model_fingerprint(model: str, version: str, config: dict, files: list | None = None) -> str:
    """Fingerprint of one deployed model version: its name, version, Triton config and (when the gateway can
    see the repository) the version folder's file names, sizes and modification times."""
    parameters = config.get("parameters")
    if isinstance(parameters, dict) and RESTART_PARAMETER in parameters:
        config = {**config, "parameters": {k: v for k, v in parameters.items() if k != RESTART_PARAMETER}}
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
    return f"{scoped(request.scope)}:{request.model}:{fingerprint}:{h.hexdigest()}"


def scoped(scope: str) -> str:
    """The key prefix of a cache scope: a tenant's (t=NAME), or the shared one ("")."""
    return f"{PREFIX}:{scope}" if scope else PREFIX


def key_fingerprint(key: str) -> str:
    """The model fingerprint a cache key was made under."""
    return key.rsplit(":", 2)[-2]


def never_cached(request: InferRequest) -> bool:
    """A request whose answer is not a function of the request: part of a sequence, or a draw."""
    return is_sequence_request(request) or is_draw(request.parameters)


def is_draw(parameters: dict) -> bool:
    """Whether the answer is a new draw each time rather than a function of the request: sampling without a seed,
    by the generation models' own rule (sampling.SamplingParams, the one place it is written). Parameters the
    models refuse count as a draw too: what they answer is an error, never kept."""
    try:
        p = SamplingParams.from_parameters(parameters)
    except SamplingError:
        return True
    return not p.greedy and p.seed is None


def generation_parameters(request: dict, inputs: frozenset[str]) -> dict:
    """The parameters a generate-extension body gives its model, as Triton reads them: every top-level field that
    is not an input of the model (nor `id`), and the `parameters` object's fields, the later in the body winning."""
    merged: dict = {}
    for key, value in request.items():
        if key == "parameters":
            if isinstance(value, dict):
                merged.update(value)
        elif key != "id" and key not in inputs:
            merged[key] = value
    return merged


def is_sequence_request(request: InferRequest) -> bool:
    return any(k in SEQUENCE_PARAMETERS and v not in (0, "", False) for k, v in request.parameters.items())
