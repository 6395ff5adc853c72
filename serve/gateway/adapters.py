"""LoRA adapters served on a model family's NAME_llm (multi-LoRA): which adapters each base holds, asked from Triton
with NAME_llm's control requests, and which base and adapter a request's `model` names.

A request's `model` is a family (its NAME_llm, no adapter), `BASE:ADAPTER`, or a bare `ADAPTER` when exactly one
served base holds an adapter of that name. NAME_llm answers a control request (`text_input` "" and the parameter
`adapter_admin`: `{"action": "list"}`, `{"action": "load", "name", "path"}` or `{"action": "unload", "name"}`) with
the adapters it holds after the action: `{"adapters": [{"name", "sha256", "rank", "alpha", "targets", "path"}]}`.

A base's list is asked when first needed and again when it is older than --version-check-interval (before a request
naming an adapter is keyed or sent, and for /v1/models), so a load or unload made through another gateway replica
(or straight on Triton) is seen within that interval, as a new model version is; at once after a load or unload
through this gateway; and when a request names an adapter the list does not hold, before its 404 (at most every
MISS_AGE seconds per base, one request at a time). With several Triton servers, every one is asked, and an adapter
counts as loaded when each answering server holds it with the same sha256; a load or unload goes to every one.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import orjson

from dstool.decoding.adapters import NAME
from dstool.decoding.errors import UnknownAdapter
from dstool.serve.gateway.core import GatewayCore, addressable, error_message, joined, model_path
from dstool.serve.gateway.tensors import GatewayError
from dstool.serve.gateway.upstream import UpstreamTimeout, UpstreamUnavailable

MISS_AGE = 0.25  # seconds: a name not in a base's list asks for the list again when it is older than this
MAX_PATH = 4096
JSON = (("Content-Type", "application/json"),)


@dataclass(frozen=True)
class ServedAdapter:
    """One adapter loaded on a base (its NAME_llm), as NAME_llm lists it."""

    base: str
    name: str
    sha256: str  # of its files: part of every cache key of its answers
    rank: int
    alpha: float
    targets: tuple[str, ...]
    path: str

    @property
    def id(self) -> str:
        """Its full model name, BASE:NAME (what tenant keys list)."""
        return f"{self.base}:{self.name}"


class AdapterRefused(Exception):
    """A request about adapters refused: its HTTP status and message (404 for a name that is not loaded)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


@dataclass
class _Listed:
    at: float  # time.monotonic() when asked
    adapters: dict[str, ServedAdapter]


def parsed(base: str, answer: Any) -> dict[str, ServedAdapter] | None:
    """The adapters a control request's answer (Triton's generate JSON) lists, or None when it is not such an
    answer (a model that takes no control requests answered something else)."""
    if not isinstance(answer, dict):
        return None
    text = answer.get("text_output")
    text = text[0] if isinstance(text, list) and len(text) == 1 else text
    if not isinstance(text, str):
        return None
    try:
        listed = orjson.loads(text)
        return {a["name"]: ServedAdapter(base, str(a["name"]), str(a["sha256"]), int(a["rank"]), float(a["alpha"]),
                                   tuple(str(t) for t in a.get("targets") or ()), str(a.get("path", "")))
                for a in listed["adapters"] if isinstance(a, dict) and NAME.fullmatch(str(a.get("name", "")))}
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        return None


class Adapters:
    """The adapters of every base as last asked (see the module's docstring for when it asks)."""

    def __init__(self, core: GatewayCore, interval: float):
        self.core = core
        self.upstreams = core.upstreams
        self.interval = interval
        self._lists: dict[str, _Listed] = {}
        self._pending: dict[str, asyncio.Future] = {}

    async def bases(self) -> list[str]:
        """The families whose NAME_llm is ready on Triton (its repository index)."""
        r = await self.upstreams.request("POST", "/v2/repository/index", b"{}", JSON)
        if r.status != 200:
            raise GatewayError(502, f"Triton answered {r.status} to its repository index")
        return sorted(m["name"][:-len("_llm")] for m in orjson.loads(r.body)
                      if isinstance(m, dict) and str(m.get("name", "")).endswith("_llm") and m.get("state") == "READY")

    async def of(self, base: str, age: float | None = None) -> dict[str, ServedAdapter]:
        """The base's adapters, asked again when the list is older than `age` seconds (--version-check-interval);
        while Triton cannot be asked, the last list seen (none: UpstreamUnavailable)."""
        listed = self._lists.get(base)
        if listed is not None and time.monotonic() - listed.at < (self.interval if age is None else age):
            return listed.adapters
        try:
            return await joined(self._pending, base, lambda: self._ask(base))
        except (UpstreamUnavailable, UpstreamTimeout):
            if listed is None:
                raise
            return listed.adapters

    def known(self, base: str) -> dict[str, ServedAdapter]:
        """The base's adapters as last asked, however long ago (empty when never asked)."""
        listed = self._lists.get(base)
        return listed.adapters if listed is not None else {}

    def forget(self, base: str) -> None:
        """Ask for the base's list again at the next request (Triton said an adapter of it is not loaded)."""
        listed = self._lists.get(base)
        if listed is not None:
            listed.at = float("-inf")

    async def _ask(self, base: str) -> dict[str, ServedAdapter]:
        """Every answering server's list; an adapter counts when each holds it with the same sha256. A base whose
        NAME_llm is not served, or takes no control requests, holds none."""
        if not addressable(base + "_llm"):
            return {}
        servers = [s for s in self.upstreams.servers if not s.down] or self.upstreams.servers
        answers = await asyncio.gather(*(self._control(s, base, {"action": "list"}) for s in servers),
                                       return_exceptions=True)
        lists = [a for a in answers if not isinstance(a, BaseException)]
        if not lists:
            raise next(a for a in answers if isinstance(a, BaseException))
        held: dict[str, ServedAdapter] = {}
        if all(x is not None for x in lists):
            first, *others = [x for x in lists if x is not None]
            held = {name: a for name, a in first.items() if all(other.get(name) == a for other in others)}
        self._lists[base] = _Listed(time.monotonic(), held)
        return held

    async def _control(self, server, base: str, action: dict) -> dict[str, ServedAdapter] | None:
        """One control request to one server's NAME_llm: the adapters it holds after the action; None when the model
        takes no control requests (or is not served); AdapterRefused with Triton's message when it refuses the
        action."""
        body = orjson.dumps({"text_input": "", "adapter_admin": orjson.dumps(action).decode()})
        r = await server.request("POST", model_path(base + "_llm") + "/generate", body, JSON)
        if r.status != 200:
            message = error_message(r.status, r.body)
            if action["action"] == "list":
                return None
            raise AdapterRefused(404 if not_loaded(message) else 400, message)
        try:
            answer = orjson.loads(r.body)
        except orjson.JSONDecodeError:
            answer = None
        adapters = parsed(base, answer)
        if adapters is None and action["action"] != "list":
            raise AdapterRefused(400, f"the model '{base}' does not serve LoRA adapters (its {base}_llm takes no "
                                    "adapter requests: export it again with this dstool)")
        return adapters

    async def load(self, base: str, name: str, path: str) -> ServedAdapter:
        """Load an adapter on every server (refused by one: unloaded again from those that took it)."""
        done: list = []
        for server in self.upstreams.servers:
            try:
                adapters = await self._control(server, base, {"action": "load", "name": name, "path": path})
            except Exception:
                for other in done:
                    try:
                        await self._control(other, base, {"action": "unload", "name": name})
                    except Exception:  # noqa: BLE001,S110 (best effort: the refusal is what the client hears)
                        pass
                self.forget(base)
                raise
            done.append(server)
        assert adapters is not None
        self._lists[base] = _Listed(time.monotonic(), adapters)
        if name not in adapters:
            raise AdapterRefused(502, f"{base}_llm answered the load of '{name}' without listing it")
        return adapters[name]

    async def unload(self, base: str, name: str) -> None:
        """Unload an adapter from every server; AdapterRefused (404) when none held it."""
        unloaded, refusal = False, None
        for server in self.upstreams.servers:
            try:
                adapters = await self._control(server, base, {"action": "unload", "name": name})
            except AdapterRefused as e:
                refusal = refusal or e
                continue
            unloaded = True
            if adapters is not None:
                self._lists[base] = _Listed(time.monotonic(), adapters)
        if len(self.upstreams.servers) > 1:
            self.forget(base)
        if not unloaded:
            assert refusal is not None
            raise refusal

    async def find(self, base: str, name: str) -> ServedAdapter | None:
        """The base's adapter of that name (the list asked again on a miss), or None."""
        adapters = await self.of(base)
        if name not in adapters:
            adapters = await self.of(base, MISS_AGE)
        return adapters.get(name)

    async def resolve(self, model: str) -> tuple[str, ServedAdapter | None]:
        """(base, adapter) a request's `model` names: BASE:ADAPTER, a bare ADAPTER held by exactly one served base,
        or else the family itself (no adapter; Triton answers for a name it does not serve). AdapterRefused: 404 for
        an adapter that is not loaded, 400 for a bare name that several bases hold."""
        if ":" in model:
            base, _, name = model.rpartition(":")
            adapter = await self.find(base, name) if NAME.fullmatch(name) and addressable(base + "_llm") else None
            if adapter is None:
                raise AdapterRefused(404, f"the model '{model}' does not exist: no adapter '{name}' is loaded on the "
                                        f"model '{base}' (GET /v1/models lists the served ones)")
            return base, adapter
        if not NAME.fullmatch(model) or not addressable(model + "_llm"):
            return model, None
        try:
            await self.core.deployments.get(model + "_llm")
            return model, None  # a family's name: its base model
        except GatewayError:
            pass  # not a family: a bare adapter's name, or nothing Triton serves
        bases = await self.bases()
        for age in (None, MISS_AGE):
            holders = []
            for base in bases:
                try:
                    adapter = (await self.of(base, age)).get(model)
                except (UpstreamUnavailable, UpstreamTimeout):
                    adapter = None
                if adapter is not None:
                    holders.append(adapter)
            if len(holders) == 1:
                return holders[0].base, holders[0]
            if holders:
                raise AdapterRefused(400, f"the model '{model}' is an adapter of several models "
                                        f"({', '.join(a.base for a in holders)}): name one as BASE:{model}")
        return model, None


def not_loaded(message: str) -> bool:
    """Whether Triton's error message is NAME_llm's for an adapter that is not loaded (its UnknownAdapter)."""
    return UnknownAdapter.read(message) is not None


def load_request(body: bytes, unload: bool) -> tuple[str | None, str, str]:
    """(base or None, adapter name, path) of a /v1/load_lora_adapter or /v1/unload_lora_adapter body (vLLM's
    `lora_name`, `lora_path`; `base_model_name` or `lora_name` BASE:NAME picks the base when several are served);
    AdapterRefused (400) naming what is wrong."""
    try:
        request = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise AdapterRefused(400, f"the body is not JSON: {e}") from None
    if not isinstance(request, dict):
        raise AdapterRefused(400, "the body must be a JSON object with 'lora_name'" + ("" if unload else
                                                                                     " and 'lora_path'"))
    fields = {"lora_name", "base_model_name", "lora_int_id"} | (set() if unload else {"lora_path"})
    unknown = sorted(set(request) - fields)
    if unknown:
        taken = ", ".join(sorted(fields - {"lora_int_id"}))
        raise AdapterRefused(400, f"unknown field '{unknown[0][:80]}': the body takes {taken}")
    if request.get("lora_int_id") is not None:
        raise AdapterRefused(400, "'lora_int_id' is not served: name the adapter in 'lora_name'")
    name = request.get("lora_name")
    base = request.get("base_model_name")
    if base is not None and (not isinstance(base, str) or not addressable(base + "_llm")):
        raise AdapterRefused(400, "'base_model_name' must be a served model's name, got "
                                  f"{orjson.dumps(base).decode()[:80]}")
    if isinstance(name, str) and ":" in name:
        given, _, name = name.rpartition(":")
        if base is not None and base != given:
            raise AdapterRefused(400, f"'lora_name' names the model '{given[:80]}', 'base_model_name' '{base[:80]}'")
        base = given if addressable(given + "_llm") else None
        if base is None:
            raise AdapterRefused(400, f"'lora_name' names the model '{given[:80]}', which cannot be served")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise AdapterRefused(400, "'lora_name' must be an adapter's name: a letter or digit, then up to 63 letters, "
                                f"digits, '.', '_' or '-'; got {orjson.dumps(request.get('lora_name')).decode()[:80]}")
    path = "" if unload else request.get("lora_path")
    if not unload and (not isinstance(path, str) or not path or len(path) > MAX_PATH or "\x00" in path):
        raise AdapterRefused(400, "'lora_path' must be the adapter's folder (a PEFT LoRA adapter: adapter_config.json "
                                "and adapter_model.safetensors), absolute or relative to the model repository")
    assert isinstance(path, str)
    return base, name, path
