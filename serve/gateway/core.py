"""The gateway's protocol-independent core: which model version a request meets, cache lookup, and
computing a miss on Triton (over its HTTP binary tensor protocol, whatever protocol the client spoke)."""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from dstool.serve.gateway.cache import Entry, ResultCache
from dstool.serve.gateway.keys import cache_key, is_sequence_request, model_fingerprint
from dstool.serve.gateway.metrics import Metrics
from dstool.serve.gateway.tensors import GatewayError, InferRequest, InferResult, Tensor, check_tensor, from_values
from dstool.serve.gateway.upstream import Upstreams, UpstreamTimeout, UpstreamUnavailable


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


def error_message(status: int, body: bytes) -> str:
    """The message of a KServe error body, or the body itself."""
    try:
        return str(orjson.loads(body)["error"])
    except Exception:
        return body.decode(errors="replace")[:500] or f"HTTP {status}"


class Deployments:
    """Model versions as Triton reports them, re-checked at most every `interval` seconds (and at once after a
    repository load/unload through the gateway, or when Triton answers with another version)."""

    def __init__(self, upstreams: Upstreams, interval: float, repository: Path | None, metrics: Metrics):
        self.upstreams = upstreams
        self.metrics = metrics
        self.interval = interval
        self.repository = repository
        self._known: dict[str, Deployment] = {}
        self._pending: dict[str, asyncio.Future] = {}

    def now(self, model: str) -> Deployment | None:
        d = self._known.get(model)
        return d if d is not None and time.monotonic() - d.checked_at < self.interval else None

    async def get(self, model: str) -> Deployment:
        """The model's deployment as Triton reports it now; while Triton cannot be asked, the last one seen (so the
        cache answers what it holds, and only misses fail)."""
        d = self.now(model)
        if d is not None:
            return d
        pending = self._pending.get(model)
        if pending is None:
            pending = self._pending[model] = asyncio.ensure_future(self._fetch(model))
            pending.add_done_callback(lambda t: (self._pending.pop(model, None), t.cancelled() or t.exception()))
        try:
            return await asyncio.shield(pending)
        except (UpstreamUnavailable, UpstreamTimeout):
            last = self._known.get(model)
            if last is None:
                raise
            return last

    async def _fetch(self, model: str) -> Deployment:
        path = model_path(model)
        meta, config = await asyncio.gather(self.upstreams.request("GET", path),
                                            self.upstreams.request("GET", path + "/config"), return_exceptions=True)
        for answer in (meta, config):
            if isinstance(answer, BaseException):
                raise answer
        assert not isinstance(meta, BaseException) and not isinstance(config, BaseException)
        for r in (meta, config):
            if r.status != 200:
                self._known.pop(model, None)
                raise GatewayError(r.status, error_message(r.status, r.body))
        metadata = orjson.loads(meta.body)
        versions = sorted(metadata.get("versions") or [], key=lambda v: (len(v), v))
        outputs = [o["name"] for o in metadata.get("outputs") or []]
        d = Deployment(model, versions, outputs, orjson.loads(config.body), time.monotonic(), self.repository)
        self._known[model] = d
        self.metrics.models.add(model)
        return d

    def invalidate(self, model: str | None = None) -> None:
        if model is None:
            self._known.clear()
        else:
            self._known.pop(model, None)


_UNADDRESSABLE = re.compile(r"[\x00-\x20\x7f/?#\ud800-\udfff]")


def addressable(model: str) -> bool:
    """Whether Triton's HTTP endpoint can name `model`: at most 255 bytes (a repository folder's name), nothing
    a URL path cannot carry as it is (Triton does not percent-decode), valid UTF-8. Other names are relayed."""
    return 0 < len(model) <= 255 and len(model.encode("utf-8", "surrogatepass")) <= 255 and \
        not _UNADDRESSABLE.search(model)


def model_path(model: str) -> str:
    """/v2/models/NAME as Triton reads it: the name's UTF-8 bytes as they are (a latin-1 string of them)."""
    return "/v2/models/" + model.encode().decode("latin-1")


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
        self.deployments = Deployments(upstreams, version_check_interval, repository, metrics)
        self._computing: dict[str, asyncio.Future] = {}

    def key_now(self, request: InferRequest) -> str | None:
        """The cache key, if the model's deployment is known and fresh and the request is cacheable."""
        d = self.deployments.now(request.model) if addressable(request.model) else None
        if d is None or not d.cacheable or is_sequence_request(request):
            return None
        version = served_version(d, request.version)
        return cache_key(d.fingerprint(version), version, request, d.outputs) if version else None

    async def key(self, request: InferRequest, opt_out: bool) -> tuple[str | None, str]:
        """(cache key or None when the request must go to Triton untouched, served version)."""
        if not addressable(request.model):
            return None, ""
        d = await self.deployments.get(request.model)
        version = served_version(d, request.version)
        if opt_out or version is None or not d.cacheable or is_sequence_request(request):
            return None, version or ""
        return cache_key(d.fingerprint(version), version, request, d.outputs), version

    async def lookup(self, key: str) -> Entry | None:
        return await self.cache.get(key)

    async def compute(self, key: str, version: str, request: InferRequest) -> tuple[InferResult, Entry | None]:
        """Run a miss on Triton (identical concurrent misses share one Triton request) and keep the result.

        The computation is a task of its own that no request owns: a client that gives up (a gRPC deadline, a
        closed connection) stops waiting, and the others that joined the same miss still get its result."""
        task = self._computing.get(key)
        if task is None:
            task = asyncio.ensure_future(self._compute_and_store(key, version, request))
            self._computing[key] = task
            task.add_done_callback(lambda t: self._finished(key, t))
        return await asyncio.shield(task)

    def _finished(self, key: str, task: asyncio.Task) -> None:
        if self._computing.get(key) is task:
            del self._computing[key]
        if not task.cancelled():
            task.exception()  # retrieved here: every waiter may have given up

    async def _compute_and_store(self, key: str, version: str, request: InferRequest):
        result = await self.infer_upstream(request)
        if result.model_version != version:  # Triton moved to another version since we last looked
            self.deployments.invalidate(request.model)
            return result, None
        entry = self.cache.put(key, result)
        if entry is not None:
            self.metrics.bytes.labels(self.metrics.model(request.model), "store").inc(entry.size)
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
        path = model_path(request.model)
        if request.version:
            path += f"/versions/{request.version}"  # one Triton reported: digits
        response = await self.upstreams.request(
            "POST", path + "/infer", [head, *(t.raw for t in request.inputs)],
            (("Inference-Header-Content-Length", str(len(head))), ("Content-Type", "application/octet-stream"),
             *request.headers))
        if response.status != 200:
            raise GatewayError(response.status, error_message(response.status, response.body))
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

