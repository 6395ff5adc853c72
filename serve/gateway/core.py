"""The gateway's protocol-independent core: which model version a request meets, cache lookup, and
computing a miss on Triton (over its HTTP binary tensor protocol, whatever protocol the client spoke)."""

from __future__ import annotations

import asyncio
import itertools
import os
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import orjson

from dstool.serve.gateway.cache.digests import cache_key, key_fingerprint, model_fingerprint, never_cached
from dstool.serve.gateway.cache.store import Entry, ResultCache
from dstool.serve.gateway.metrics import Metrics
from dstool.serve.gateway.tenancy.guard import COUNTED, tensor_reservation, tensor_tokens
from dstool.serve.gateway.tensors import (
    GatewayError,
    InferRequest,
    InferResult,
    Tensor,
    backend_fault,
    check_tensor,
    from_values,
)
from dstool.serve.gateway.upstream import Upstreams, UpstreamTimeout, UpstreamUnavailable


@dataclass
class Loaded:
    """One loaded model version as the gateway has seen it since Triton loaded it: the version folder's files at
    first sight (what Triton loaded), its fingerprint, Triton's inference count at the last check, and the files
    seen since if they changed under the loaded version (then results are not cached until Triton reloads it)."""

    files: list | None
    fingerprint: str
    count: int | None
    changed: list | None = None


@dataclass
class UpstreamModel:
    """What Triton serves for one model: its ready versions, config, and what each version was loaded from."""

    model: str
    versions: list[str]  # ready versions, highest last
    outputs: list[str]  # output names from the model metadata
    config: dict
    checked_at: float
    loaded: dict[str, Loaded] = field(default_factory=dict)

    @property
    def cacheable(self) -> bool:
        decoupled = self.config.get("model_transaction_policy", {}).get("decoupled", False)
        return not decoupled and "sequence_batching" not in self.config

    def fingerprint(self, version: str) -> str | None:
        """The cache namespace of `version`; None while its files differ from those it was loaded from."""
        record = self.loaded.get(version)
        return None if record is None or record.changed is not None else record.fingerprint


def version_files(repository: Path | None, model: str, version: str) -> list | None:
    """The version folder's files (path, size, mtime), or None when the gateway cannot see the repository."""
    if repository is None or not (folder := repository / model / version).is_dir():
        return None
    return sorted([str(p.relative_to(repository)), st.st_size, st.st_mtime_ns]
                  for p in folder.rglob("*") if p.is_file() and (st := p.stat()))


def error_message(status: int, body: bytes) -> str:
    """The message of a KServe error body, or the body itself."""
    try:
        return str(orjson.loads(body)["error"])
    except Exception:
        return body.decode(errors="replace")[:500] or f"HTTP {status}"


T = TypeVar("T")


async def joined(pending: dict[str, asyncio.Future], key: str, make: Callable[[], Awaitable[T]]) -> T:
    """`make()` run once for `key` however many ask while it runs (`pending` holds the run): each waits for it, and
    one that gives up does not cancel it for the others."""
    task = pending.get(key)
    if task is None:
        task = pending[key] = asyncio.ensure_future(make())
        task.add_done_callback(lambda t: (pending.pop(key, None), t.cancelled() or t.exception()))
    return await asyncio.shield(task)


class UpstreamModels:
    """Model versions as Triton reports them, re-checked at most every `interval` seconds (and at once after a
    repository load/unload through the gateway, or when Triton answers with another version)."""

    def __init__(self, upstreams: Upstreams, interval: float, repository: Path | None, metrics: Metrics):
        self.upstreams = upstreams
        self.metrics = metrics
        self.interval = interval
        self.repository = repository
        self._known: dict[str, UpstreamModel] = {}
        self._loaded: dict[str, dict[str, Loaded]] = {}  # model -> version -> load record, kept across checks
        self._pending: dict[str, asyncio.Future] = {}

    def now(self, model: str) -> UpstreamModel | None:
        d = self._known.get(model)
        return d if d is not None and time.monotonic() - d.checked_at < self.interval else None

    def known(self, model: str) -> UpstreamModel | None:
        """The model's deployment as last seen, however long ago."""
        return self._known.get(model)

    async def get(self, model: str) -> UpstreamModel:
        """The model's deployment as Triton reports it now; while Triton cannot be asked, the last one seen (so the
        cache answers what it holds, and only misses fail)."""
        d = self.now(model)
        if d is not None:
            return d
        try:
            return await joined(self._pending, model, lambda: self._fetch(model))
        except (UpstreamUnavailable, UpstreamTimeout):
            last = self._known.get(model)
            if last is None:
                raise
            return last

    async def _fetch(self, model: str) -> UpstreamModel:
        path = model_path(model)
        meta, config, stats = await asyncio.gather(
            self.upstreams.request("GET", path), self.upstreams.request("GET", path + "/config"),
            self.upstreams.request("GET", path + "/stats"), return_exceptions=True)
        for answer in (meta, config):
            if isinstance(answer, BaseException):
                raise answer
        assert not isinstance(meta, BaseException) and not isinstance(config, BaseException)
        for r in (meta, config):
            if r.status != 200:
                self._known.pop(model, None)
                self._loaded.pop(model, None)
                raise GatewayError(r.status, error_message(r.status, r.body))
        metadata = orjson.loads(meta.body)
        versions = sorted(metadata.get("versions") or [], key=lambda v: (len(v), v))
        outputs = [o["name"] for o in metadata.get("outputs") or []]
        counts = {}
        if not isinstance(stats, BaseException) and stats.status == 200 and len(self.upstreams.servers) == 1:
            counts = {str(s.get("version")): s.get("inference_count")
                      for s in orjson.loads(stats.body).get("model_stats", [])}
        d = UpstreamModel(model, versions, outputs, orjson.loads(config.body), time.monotonic(),
                       self._check_loaded(model, versions, orjson.loads(config.body), counts))
        self._known[model] = d
        self.metrics.models.add(model)
        return d

    def _check_loaded(self, model: str, versions: list[str], config: dict, counts: dict) -> dict[str, Loaded]:
        """Each ready version's load record, checked against the files now. A version first seen is fingerprinted
        by its files now. Files that change under a loaded version mark it changed: Triton still serves what it
        loaded, which the files no longer say, so nothing of it is cached. It is fingerprinted anew once Triton is
        seen to have loaded it again after the change (its inference count started over, or its config changed),
        or after a load through the gateway or the version leaving the ready set (the record is dropped then)."""
        before = self._loaded.get(model, {})
        records: dict[str, Loaded] = {}
        for v in versions:
            files, count, record = version_files(self.repository, model, v), counts.get(v), before.get(v)
            fingerprint = model_fingerprint(model, v, config, files)
            reloaded = record is not None and (
                (count is not None and record.count is not None and count < record.count) or
                model_fingerprint(model, v, config, record.files) != record.fingerprint)  # a config Triton reloaded
            seen = record.files if record is not None and record.changed is None else \
                record.changed if record is not None else None
            if record is None or (reloaded and files == seen):
                record = Loaded(files, fingerprint, count)  # first seen, or loaded again after its files last changed
            elif files != seen:
                record.changed = files  # changed under the loaded version (a reload seen at once may predate it)
            record.count = count
            records[v] = record
        self._loaded[model] = records
        return records

    def still_loaded_from(self, model: str, version: str, fingerprint: str) -> bool:
        """Whether the version's files are still those its fingerprint was taken from (checked before a result is
        stored, so a change in the middle of a miss is not stored under the old namespace)."""
        record = self._loaded.get(model, {}).get(version)
        if record is None or record.changed is not None or record.fingerprint != fingerprint:
            return False
        files = version_files(self.repository, model, version)
        if files != record.files:
            record.changed = files
            return False
        return True

    def invalidate(self, model: str | None = None, reloaded: bool = False) -> None:
        """Ask Triton again at the next request (all models, or one); `reloaded`: the model was just loaded
        or unloaded through the gateway, so what it serves now is what its files say."""
        if model is None:
            self._known.clear()
        else:
            self._known.pop(model, None)
            if reloaded:
                self._loaded.pop(model, None)


_UNADDRESSABLE = re.compile(r"[\x00-\x20\x7f/?#\ud800-\udfff]")


def addressable(model: str) -> bool:
    """Whether Triton's HTTP endpoint can name `model`: at most 255 bytes (a repository folder's name), nothing
    a URL path cannot carry as it is (Triton does not percent-decode), valid UTF-8. Other names are relayed."""
    return 0 < len(model) <= 255 and len(model.encode("utf-8", "surrogatepass")) <= 255 and \
        not _UNADDRESSABLE.search(model)


def model_path(model: str) -> str:
    """/v2/models/NAME as Triton reads it: the name's UTF-8 bytes as they are (a latin-1 string of them)."""
    return "/v2/models/" + model.encode().decode("latin-1")


def served_version(d: UpstreamModel, requested: str) -> str | None:
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
        self.deployments = UpstreamModels(upstreams, version_check_interval, repository, metrics)
        self._computing: dict[str, asyncio.Future] = {}

    def key_now(self, request: InferRequest) -> str | None:
        """The cache key, if the model's deployment is known and fresh and the request is cacheable."""
        d = self.deployments.now(request.model) if addressable(request.model) else None
        if d is None or not d.cacheable or never_cached(request):
            return None
        version = served_version(d, request.version)
        fingerprint = d.fingerprint(version) if version else None
        return cache_key(fingerprint, version, request, d.outputs) if version and fingerprint else None

    async def key(self, request: InferRequest, opt_out: bool) -> tuple[str | None, str]:
        """(cache key or None when the request must go to Triton untouched, served version)."""
        if not addressable(request.model):
            return None, ""
        d = await self.deployments.get(request.model)
        version = served_version(d, request.version)
        fingerprint = d.fingerprint(version) if version else None
        if opt_out or version is None or fingerprint is None or not d.cacheable or never_cached(request):
            return None, version or ""
        return cache_key(fingerprint, version, request, d.outputs), version

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
        if not self.deployments.still_loaded_from(request.model, version, key_fingerprint(key)):
            return result, None
        entry = self.cache.put(key, result)
        if entry is not None:
            self.metrics.bytes.labels(self.metrics.model(request.model), "store").inc(entry.size)
        return result, entry

    async def most_tokens(self, request: InferRequest) -> int:
        """The most tokens an inference may use, reserved for a tenant before it runs (guard.tensor_reservation)."""
        try:
            config = (await self.deployments.get(request.model)).config
        except GatewayError:
            config = {}
        return tensor_reservation(request, config)

    async def infer_upstream(self, request: InferRequest) -> InferResult:
        """Send the request to Triton as a binary-tensor HTTP request asking for binary outputs, under an id of the
        gateway's own, which the answer must carry (an answer to another request is never taken for this one's).
        A generation model's token counts are asked for whatever outputs the request names: its `usage`, the
        outputs it did not name left out of the result."""
        ident = request_nonce()
        header: dict[str, Any] = {
            "id": ident, "inputs": [{"name": t.name, "datatype": t.datatype, "shape": t.shape,
                                     "parameters": {"binary_data_size": len(t.raw)}} for t in request.inputs],
            "parameters": {**request.parameters, "binary_data_output": True}}
        extra: list[str] = []
        if request.outputs is not None:
            header["outputs"] = [{"name": n, "parameters": {**p, "binary_data": True}} for n, p in request.outputs]
            d = self.deployments.now(request.model) or self.deployments.known(request.model)
            named = {n for n, _ in request.outputs}
            extra = [n for n in COUNTED if d is not None and n in d.outputs and n not in named]
            header["outputs"] += [{"name": n, "parameters": {"binary_data": True}} for n in extra]
        head = orjson.dumps(header)
        path = model_path(request.model)
        if request.version:
            path += f"/versions/{request.version}"  # one Triton reported: digits
        response = await self.upstreams.request(
            "POST", path + "/infer", [head, *(t.raw for t in request.inputs)],
            (("Inference-Header-Content-Length", str(len(head))), ("Content-Type", "application/octet-stream"),
             *request.headers))
        if response.status != 200:
            message = untagged(error_message(response.status, response.body), ident, request.id)
            raise GatewayError(503 if backend_fault(message) else response.status, message)
        result = parse_binary_response(response.body, response.headers.get("inference-header-content-length"), ident)
        result.usage = tensor_tokens(request, result)
        result.outputs = [t for t in result.outputs if t.name not in extra]
        return result


_NONCES = itertools.count()
_NONCE_PREFIX = f"dstool-{os.getpid():x}-{time.monotonic_ns() & 0xffffffff:x}-"


def request_nonce() -> str:
    """An id for one request to Triton, which Triton echoes in its answer: never the same twice in a process."""
    return f"{_NONCE_PREFIX}{next(_NONCES)}"


def untagged(message: str, nonce: str, client_id: str) -> str:
    """Triton's error message as it would read had the client's request gone as sent: with the client's id, or
    Triton's "<id_unknown>" for none, where Triton quotes the gateway's `nonce`."""
    return message.replace(f"[request id: {nonce}]", f"[request id: {client_id or '<id_unknown>'}]")


def parse_binary_response(body: bytes, header_length: str | None, ident: str) -> InferResult:
    """A Triton HTTP inference response (binary tensor extension or plain JSON) to the request sent with id `ident`,
    as an InferResult; GatewayError (502) when it answers another request."""
    n = int(header_length) if header_length else len(body)
    header = orjson.loads(body[:n])
    if header.get("id") != ident:
        raise GatewayError(502, "Triton's answer belongs to another request: not used (retry)")
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

