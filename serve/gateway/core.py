"""The gateway's protocol-independent core: which model version a request meets, cache lookup, and
computing a miss on Triton (over its HTTP binary tensor protocol, whatever protocol the client spoke)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

import orjson

from dstool.serve.gateway.cache import Entry, ResultCache
from dstool.serve.gateway.keys import cache_key, is_sequence_request, model_fingerprint
from dstool.serve.gateway.metrics import Metrics
from dstool.serve.gateway.tensors import GatewayError, InferRequest, InferResult, Tensor, check_tensor, from_values
from dstool.serve.gateway.upstream import Response, Upstreams


@dataclass
class Deployment:
    """What Triton serves for one model: its ready versions, config and per-version fingerprints."""

    model: str
    versions: list[str]  # ready versions, highest last
    outputs: list[str]  # output names from the model metadata
    config: dict
    checked_at: float
    repository: Path | None
    fingerprints: dict[str, str] = field(default_factory=dict)

    @property
    def cacheable(self) -> bool:
        decoupled = self.config.get("model_transaction_policy", {}).get("decoupled", False)
        return not decoupled and "sequence_batching" not in self.config

    def fingerprint(self, version: str) -> str:
        fp = self.fingerprints.get(version)
        if fp is None:
            files = None
            if self.repository is not None and (self.repository / self.model / version).is_dir():
                files = sorted([str(p.relative_to(self.repository)), p.stat().st_size, p.stat().st_mtime_ns]
                               for p in (self.repository / self.model / version).rglob("*") if p.is_file())
            fp = self.fingerprints[version] = model_fingerprint(self.model, version, self.config, files)
        return fp


def error_message(response: Response) -> str:
    try:
        return str(orjson.loads(response.body)["error"])
    except Exception:
        return response.body.decode(errors="replace")[:500] or f"HTTP {response.status}"


class Deployments:
    """Model versions as Triton reports them, re-checked at most every `interval` seconds (and at once after a
    repository load/unload through the gateway, or when Triton answers with another version)."""

    def __init__(self, upstreams: Upstreams, interval: float, repository: Path | None):
        self.upstreams = upstreams
        self.interval = interval
        self.repository = repository
        self._known: dict[str, Deployment] = {}
        self._pending: dict[str, asyncio.Future] = {}

    def now(self, model: str) -> Deployment | None:
        d = self._known.get(model)
        return d if d is not None and time.monotonic() - d.checked_at < self.interval else None

    async def get(self, model: str) -> Deployment:
        d = self.now(model)
        if d is not None:
            return d
        pending = self._pending.get(model)
        if pending is None:
            pending = self._pending[model] = asyncio.ensure_future(self._fetch(model))
            pending.add_done_callback(lambda _: self._pending.pop(model, None))
        return await asyncio.shield(pending)

    async def _fetch(self, model: str) -> Deployment:
        path = f"/v2/models/{quote(model, safe='')}"
        meta, config = await asyncio.gather(self.upstreams.request("GET", path),
                                            self.upstreams.request("GET", path + "/config"))
        for r in (meta, config):
            if r.status != 200:
                self._known.pop(model, None)
                raise GatewayError(r.status, error_message(r))
        metadata = orjson.loads(meta.body)
        versions = sorted(metadata.get("versions") or [], key=lambda v: (len(v), v))
        outputs = [o["name"] for o in metadata.get("outputs") or []]
        d = Deployment(model, versions, outputs, orjson.loads(config.body), time.monotonic(), self.repository)
        self._known[model] = d
        return d

    def invalidate(self, model: str | None = None) -> None:
        if model is None:
            self._known.clear()
        else:
            self._known.pop(model, None)


def served_version(d: Deployment, requested: str) -> str | None:
    """The version that answers a request, or None when Triton has no ready version to match it."""
    if requested:
        return requested if requested in d.versions else None
    return d.versions[-1] if d.versions else None


class GatewayCore:
    def __init__(self, upstreams: Upstreams, cache: ResultCache, metrics: Metrics, version_check_interval: float,
                 repository: Path | None = None):
        self.upstreams = upstreams
        self.cache = cache
        self.metrics = metrics
        self.deployments = Deployments(upstreams, version_check_interval, repository)
        self._computing: dict[str, asyncio.Future] = {}

    def key_now(self, request: InferRequest) -> str | None:
        """The cache key, if the model's deployment is known and fresh and the request is cacheable."""
        d = self.deployments.now(request.model)
        if d is None or not d.cacheable or is_sequence_request(request):
            return None
        version = served_version(d, request.version)
        return cache_key(d.fingerprint(version), version, request, d.outputs) if version else None

    async def key(self, request: InferRequest, opt_out: bool) -> tuple[str | None, str]:
        """(cache key or None when the request must go to Triton untouched, served version)."""
        d = await self.deployments.get(request.model)
        version = served_version(d, request.version)
        if opt_out or version is None or not d.cacheable or is_sequence_request(request):
            return None, version or ""
        return cache_key(d.fingerprint(version), version, request, d.outputs), version

    async def lookup(self, key: str) -> Entry | None:
        return await self.cache.get(key)

    async def compute(self, key: str, version: str, request: InferRequest) -> tuple[InferResult, Entry | None]:
        """Run a miss on Triton (identical concurrent misses share one Triton request) and keep the result."""
        pending = self._computing.get(key)
        if pending is not None:
            return await asyncio.shield(pending)
        # The first request computes in its own task (no extra task or loop turn on the common path);
        # identical requests arriving meanwhile wait on `shared`.
        shared = self._computing[key] = asyncio.get_running_loop().create_future()
        shared.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved even with no waiter
        try:
            answer = await self._compute_and_store(key, version, request)
        except BaseException as e:
            shared.set_exception(e)
            raise
        finally:
            del self._computing[key]
        shared.set_result(answer)
        return answer

    async def _compute_and_store(self, key: str, version: str, request: InferRequest):
        result = await self.infer_upstream(request)
        if result.model_version != version:  # Triton moved to another version since we last looked
            self.deployments.invalidate(request.model)
            return result, None
        entry = self.cache.put(key, result)
        if entry is not None:
            self.metrics.bytes.labels(request.model, "store").inc(entry.size)
        return result, entry

    async def infer_upstream(self, request: InferRequest) -> InferResult:
        """Send the request to Triton as a binary-tensor HTTP request asking for binary outputs."""
        header = {"inputs": [{"name": t.name, "datatype": t.datatype, "shape": t.shape,
                              "parameters": {"binary_data_size": len(t.raw)}} for t in request.inputs],
                  "parameters": {**request.parameters, "binary_data_output": True}}
        if request.id:
            header["id"] = request.id
        if request.outputs is not None:
            header["outputs"] = [{"name": n, "parameters": {**p, "binary_data": True}} for n, p in request.outputs]
        head = orjson.dumps(header)
        path = f"/v2/models/{quote(request.model, safe='')}"
        if request.version:
            path += f"/versions/{quote(request.version, safe='')}"
        response = await self.upstreams.request(
            "POST", path + "/infer", [head, *(t.raw for t in request.inputs)],
            (("Inference-Header-Content-Length", str(len(head))), ("Content-Type", "application/octet-stream")))
        if response.status != 200:
            raise GatewayError(response.status, error_message(response))
        return parse_binary_response(response.body, response.headers.get("inference-header-content-length"))


def parse_binary_response(body: bytes, header_length: str | None) -> InferResult:
    """A Triton HTTP inference response (binary tensor extension or plain JSON) as an InferResult."""
    n = int(header_length) if header_length else len(body)
    header = orjson.loads(body[:n])
    offset, outputs = n, []
    for o in header.get("outputs", []):
        params = o.get("parameters") or {}
        size = params.get("binary_data_size")
        if size is not None:
            t = Tensor(o["name"], o["datatype"], tuple(o["shape"]), body[offset:offset + size])
            check_tensor(t, "output")
            offset += size
        else:
            t = from_values(o["name"], o["datatype"], o["shape"], o.get("data", []))
        outputs.append(t)
    return InferResult(header.get("model_name", ""), str(header.get("model_version", "")), outputs,
                       header.get("parameters") or {})

