"""Stored responses of OpenAI's Responses API: `store` (OpenAI's default: true), `previous_response_id`,
GET and DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items, `background` and
POST /v1/responses/{id}/cancel. They are kept in the gateway's Redis (the --cache one), so any gateway process or
replica continues, reads, cancels or deletes a response another one made; with no Redis (--cache memory), in this
process (not shared, lost on exit).

One response is one Redis hash, `dstool:responses:SCOPE:ID`: SCOPE is the tenant under --auth keys (another
tenant's response is absent to a key: 404), else one scope for everyone; ID is `resp_` and 48 random hex digits,
checked before it is part of a Redis name. The hash holds the response's status, the response object (JSON), the
conversation it answered — its input items as resolved: the previous response's conversation and output items, then
its own input — whether it runs in the background, and when its gateway last said it works on it. An entry lives
--responses-ttl seconds from its creation; one larger than --max-response-bytes is not kept.

A response is stored before it is answered (whole), or before its stream's `response.completed` event: what a client
was told is stored is. Redis down: requests that need the store (store: true, previous_response_id, GET, DELETE,
background, cancel) are refused with 503; nothing waits on it past --responses-redis-timeout.

Background responses run in the gateway that took them. It writes `in_progress`, then the outcome; every BEAT
seconds it tells Redis it is alive and learns whether the response was cancelled or deleted (by any gateway): then
it stops its work on Triton. A queued or running response whose gateway has said nothing for STALE seconds (it died)
reads as failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import secrets
import time
import urllib.parse
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from dstool.serve.cache_url import CacheURL
from dstool.serve.gateway.cache.store import _client
from dstool.serve.gateway.openai.answer import Answer, Streamed, Whole
from dstool.serve.gateway.openai.protocol import OpenAIError, parse
from dstool.serve.gateway.openai.responses import ResponsesRequest, Writer, renamed
from dstool.serve.gateway.tenancy.auth import Principal
from dstool.serve.gateway.tenancy.guard import Refused
from dstool.serve.gateway.transport import EVENT_STREAM, HttpRequest, HttpResponse, Response, StreamingResponse
from dstool.serve.gateway.upstream import within

log = logging.getLogger("dstool.gateway")
ID_PATTERN = re.compile(r"resp_[0-9a-f]{32,64}")  # what new_id makes (48 digits); older ids had 32
BEAT = 0.5  # seconds between a background response's heartbeats (and its checks for a cancel)
STALE = 15.0  # seconds without a heartbeat after which a queued or running response reads as failed
RUNNING = ("queued", "in_progress")
JSON = [("Content-Type", "application/json")]


def new_id() -> str:
    return "resp_" + secrets.token_hex(24)


def scope_of(principal: Principal | None) -> str:
    """The store's namespace of a request: its tenant's (--auth keys), else the one of everyone."""
    return "-" if principal is None else "t=" + principal.tenant


class StoreUnavailable(Exception):
    """The store (Redis) did not answer."""


@dataclass
class Stored:
    status: str
    response: dict
    context: list  # the conversation it answered (empty unless asked for)
    background: bool
    age: float  # seconds since its gateway last said it works on it

    def shown(self) -> dict:
        """The response object as GET answers it: the stored one, with the status the store holds now."""
        r = dict(self.response)
        r["status"] = self.status
        if self.background and self.status in RUNNING and self.age > STALE:
            r["status"] = "failed"
            r["error"] = {"code": "server_error", "message": "the gateway running this background response "
                          f"stopped before it finished (no word from it for {self.age:.0f} s)"}
        return r


# Redis's clock in ms, for every script
NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""
# A new entry: ARGV ttl ms, status, body, context, background (1/0)
CREATE = NOW + """
redis.call('HSET', KEYS[1], 'status', ARGV[2], 'body', ARGV[3], 'context', ARGV[4], 'bg', ARGV[5], 'beat', now)
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return 1
"""
# A background response's new status (and body, unless ''): not once it is cancelled or gone
UPDATE = NOW + """
local s = redis.call('HGET', KEYS[1], 'status')
if not s then return 'gone' end
if s == 'cancelled' then return s end
redis.call('HSET', KEYS[1], 'status', ARGV[1], 'beat', now)
if ARGV[2] ~= '' then redis.call('HSET', KEYS[1], 'body', ARGV[2]) end
return 'ok'
"""
# Its gateway's heartbeat: the status now (a cancel or delete from any gateway shows here)
BEAT_SCRIPT = NOW + """
local s = redis.call('HGET', KEYS[1], 'status')
if not s then return 'gone' end
if s == 'queued' or s == 'in_progress' then redis.call('HSET', KEYS[1], 'beat', now) end
return s
"""
# status, body, context (ARGV[1] = '1') or '', background, ms since the last heartbeat
READ = NOW + """
local v = redis.call('HMGET', KEYS[1], 'status', 'body', 'bg', 'beat')
if not v[1] then return false end
local context = ''
if ARGV[1] == '1' then context = redis.call('HGET', KEYS[1], 'context') end
return {v[1], v[2], context, v[3], tostring(now - tonumber(v[4]))}
"""
# 'gone', 'foreground' (not a background response), or the status after: cancelled when it was queued or running
CANCEL = """
local v = redis.call('HMGET', KEYS[1], 'status', 'bg')
if not v[1] then return 'gone' end
if v[2] ~= '1' then return 'foreground' end
if v[1] == 'queued' or v[1] == 'in_progress' then
  redis.call('HSET', KEYS[1], 'status', 'cancelled')
  return 'cancelled'
end
return v[1]
"""


class RedisResponses:
    """The store on Redis (a plain server or a Cluster: each entry is one key). After a failed call it is skipped
    for a second (requests that need it get 503 at once), then tried again."""

    def __init__(self, url: CacheURL, timeout: float, ttl: float, max_bytes: int, connections: int):
        self.url, self.timeout, self.ttl, self.max_bytes = url, timeout, ttl, max_bytes
        self.client = _client(url, timeout, connections)
        self.scripts = {name: self.client.register_script(text) for name, text in (
            ("create", CREATE), ("update", UPDATE), ("beat", BEAT_SCRIPT), ("read", READ), ("cancel", CANCEL))}
        self.down_until, self.why = 0.0, ""

    @staticmethod
    def name(scope: str, ident: str) -> str:
        return f"dstool:responses:{scope}:{ident}"

    def check(self) -> None:
        """StoreUnavailable at once while a recent call failed."""
        if time.monotonic() < self.down_until:
            raise StoreUnavailable(f"Redis {self.url.redacted()} did not answer ({self.why})")

    async def ready(self) -> None:
        """StoreUnavailable unless Redis answers now (before work whose answer must be stored)."""
        await self._call(self.client.ping)

    async def _call(self, make: Callable[[], Awaitable[Any]]) -> Any:
        self.check()
        try:
            return await within(make(), self.timeout * 2 + 0.5)
        except Exception as e:  # redis.RedisError, OSError, timeouts: the store is unavailable for this request
            self.down_until, self.why = time.monotonic() + 1.0, f"{type(e).__name__}: {e}"[:200]
            raise StoreUnavailable(f"Redis {self.url.redacted()} did not answer ({self.why})") from None

    async def _script(self, name: str, scope: str, ident: str, *args) -> Any:
        reply = await self._call(lambda: self.scripts[name](keys=[self.name(scope, ident)], args=list(args)))
        return reply.decode() if isinstance(reply, bytes) else reply

    async def create(self, scope: str, ident: str, status: str, body: bytes, context: bytes, background: bool) -> None:
        await self._script("create", scope, ident, max(1, int(self.ttl * 1000)), status, body, context,
                           int(background))

    async def update(self, scope: str, ident: str, status: str, body: bytes) -> str:
        return await self._script("update", scope, ident, status, body)

    async def beat(self, scope: str, ident: str) -> str:
        return await self._script("beat", scope, ident)

    async def cancel(self, scope: str, ident: str) -> str:
        return await self._script("cancel", scope, ident)

    async def read(self, scope: str, ident: str, context: bool = False) -> Stored | None:
        reply = await self._call(lambda: self.scripts["read"](keys=[self.name(scope, ident)],
                                                              args=["1" if context else "0"]))
        if not reply:
            return None
        status, body, ctx, bg, age = reply
        return Stored(status.decode(), orjson.loads(body), orjson.loads(ctx) if ctx else [], bg == b"1",
                      int(age) / 1000)

    async def delete(self, scope: str, ident: str) -> bool:
        return bool(await self._call(lambda: self.client.delete(self.name(scope, ident))))

    async def close(self) -> None:
        await self.client.aclose()


class MemoryResponses:
    """The store in this process (no Redis): the same answers, up to `max_total` bytes (the oldest dropped first)."""

    def __init__(self, ttl: float = 30 * 86400.0, max_bytes: int = 4 << 20, max_total: int = 256 << 20):
        self.ttl, self.max_bytes, self.max_total = ttl, max_bytes, max_total
        self.entries: OrderedDict[tuple[str, str], dict] = OrderedDict()
        self.total = 0

    def check(self) -> None:
        pass

    async def ready(self) -> None:
        pass

    def _get(self, scope: str, ident: str) -> dict | None:
        e = self.entries.get((scope, ident))
        if e is not None and e["expires"] <= time.monotonic():
            self._drop((scope, ident))
            return None
        return e

    def _drop(self, key: tuple[str, str]) -> bool:
        e = self.entries.pop(key, None)
        if e is not None:
            self.total -= e["size"]
        return e is not None

    async def create(self, scope: str, ident: str, status: str, body: bytes, context: bytes, background: bool) -> None:
        self._drop((scope, ident))
        now = time.monotonic()
        size = len(body) + len(context)
        self.entries[(scope, ident)] = {"status": status, "body": body, "context": context, "bg": background,
                                        "beat": now, "expires": now + self.ttl, "size": size}
        self.total += size
        while self.total > self.max_total and self.entries:
            self._drop(next(iter(self.entries)))

    async def update(self, scope: str, ident: str, status: str, body: bytes) -> str:
        e = self._get(scope, ident)
        if e is None:
            return "gone"
        if e["status"] == "cancelled":
            return "cancelled"
        e["status"], e["beat"] = status, time.monotonic()
        if body:
            self.total += len(body) - len(e["body"])
            e["size"] += len(body) - len(e["body"])
            e["body"] = body
        return "ok"

    async def beat(self, scope: str, ident: str) -> str:
        e = self._get(scope, ident)
        if e is None:
            return "gone"
        if e["status"] in RUNNING:
            e["beat"] = time.monotonic()
        return e["status"]

    async def cancel(self, scope: str, ident: str) -> str:
        e = self._get(scope, ident)
        if e is None:
            return "gone"
        if not e["bg"]:
            return "foreground"
        if e["status"] in RUNNING:
            e["status"] = "cancelled"
        return e["status"]

    async def read(self, scope: str, ident: str, context: bool = False) -> Stored | None:
        e = self._get(scope, ident)
        if e is None:
            return None
        return Stored(e["status"], orjson.loads(e["body"]), orjson.loads(e["context"]) if context else [], e["bg"],
                      time.monotonic() - e["beat"])

    async def delete(self, scope: str, ident: str) -> bool:
        return self._drop((scope, ident)) if self._get(scope, ident) is not None else False

    async def close(self) -> None:
        pass


Store = RedisResponses | MemoryResponses
# run(chat completion request body, the HTTP request): its answer, whole or streamed (openai.py)
Run = Callable[[dict, HttpRequest], Awaitable[Answer]]
FailedCode = Literal["server_error", "rate_limit_exceeded", "invalid_prompt"]  # of the Responses API's error codes


def _not_found(ident: str, previous: bool = False) -> OpenAIError:
    shown = ident if len(ident) <= 80 else ident[:77] + "..."
    if previous:
        return OpenAIError(404, f"Previous response with id '{shown}' not found.", "previous_response_id",
                           code="previous_response_not_found")
    return OpenAIError(404, f"Response with id '{shown}' not found.")


def _unavailable(e: StoreUnavailable) -> OpenAIError:
    return OpenAIError(503, f"the response store is unavailable: {e}. Retry, or send store: false with the whole "
                            "conversation as input (the stateless Responses API needs no store)", kind="server_error",
                       code="store_unavailable")


class ResponsesRoutes:
    """POST /v1/responses and the routes of a stored response, for one gateway process."""

    def __init__(self, store: Store, run: Run):
        self.store = store
        self.run = run
        self.working: dict[tuple[str, str], asyncio.Task] = {}  # background responses running here
        self.closing = False

    async def handle(self, req: HttpRequest) -> Response:
        try:
            if req.path == "/v1/responses":
                if req.method != "POST":
                    raise OpenAIError(405, "use POST for /v1/responses")
                return await self._create(req)
            return await self._stored(req)
        except StoreUnavailable as e:
            raise _unavailable(e) from None

    async def _stored(self, req: HttpRequest) -> Response:
        rest = req.path[len("/v1/responses/"):]
        ident, _, action = rest.partition("/")
        if action not in ("", "cancel", "input_items"):
            raise OpenAIError(404, f"no route {req.method} /v1/responses/ID/{action[:40]}: a stored response has GET "
                                   "and DELETE, POST .../cancel and GET .../input_items")
        if not ID_PATTERN.fullmatch(ident):  # never part of a Redis name: an id this server cannot have made
            raise _not_found(ident)
        want = {"": ("GET", "DELETE"), "cancel": ("POST",), "input_items": ("GET",)}[action]
        if req.method not in want:
            raise OpenAIError(405, f"use {' or '.join(want)} for /v1/responses/ID{'/' + action if action else ''}")
        scope = scope_of(req.principal)
        query = urllib.parse.parse_qs(req.target.partition("?")[2])
        if action == "cancel":
            return await self._cancel(scope, ident)
        if action == "input_items":
            return await self._input_items(scope, ident, query)
        if req.method == "DELETE":
            if not await self.store.delete(scope, ident):
                raise _not_found(ident)
            task = self.working.get((scope, ident))
            if task is not None:
                task.cancel()
            return _json({"id": ident, "object": "response", "deleted": True})
        if query.get("stream", ["false"])[0] == "true":
            raise OpenAIError(400, "'stream' on GET /v1/responses/ID is not supported by this server: poll it",
                              "stream")
        stored = await self.store.read(scope, ident)
        if stored is None:
            raise _not_found(ident)
        return _json(stored.shown())

    async def _cancel(self, scope: str, ident: str) -> Response:
        state = await self.store.cancel(scope, ident)
        if state == "gone":
            raise _not_found(ident)
        if state == "foreground":
            raise OpenAIError(400, "Only responses created with background: true can be cancelled.")
        task = self.working.get((scope, ident))
        if task is not None and state == "cancelled":
            task.cancel()  # running here: stopped now (elsewhere: at its gateway's next heartbeat)
        stored = await self.store.read(scope, ident)
        if stored is None:
            raise _not_found(ident)
        return _json(stored.shown())

    async def _input_items(self, scope: str, ident: str, query: dict[str, list[str]]) -> Response:
        stored = await self.store.read(scope, ident, context=True)
        if stored is None:
            raise _not_found(ident)
        order = query.get("order", ["desc"])[0]
        if order not in ("asc", "desc"):
            raise OpenAIError(400, f"'order' must be asc or desc, got '{order[:20]}'", "order")
        limit_text = query.get("limit", ["20"])[0]
        if not (limit_text.isdigit() and 1 <= int(limit_text) <= 100):
            raise OpenAIError(400, f"'limit' must be an integer from 1 to 100, got '{limit_text[:20]}'", "limit")
        items = stored.context if order == "asc" else stored.context[::-1]
        after = query.get("after", [None])[0]
        if after is not None:
            at = next((i for i, item in enumerate(items) if isinstance(item, dict) and item.get("id") == after), None)
            if at is None:
                raise OpenAIError(400, f"'after': no input item '{after[:80]}' in this response", "after")
            items = items[at + 1:]
        page = items[:int(limit_text)]
        return _json({"object": "list", "data": page, "first_id": page[0].get("id") if page else None,
                      "last_id": page[-1].get("id") if page else None, "has_more": len(items) > len(page)})

    async def _conversation(self, scope: str, previous: str) -> list:
        """The input items the previous response answered, then its output items."""
        if not ID_PATTERN.fullmatch(previous):
            raise _not_found(previous, previous=True)
        stored = await self.store.read(scope, previous, context=True)
        if stored is None:
            raise _not_found(previous, previous=True)
        status = stored.shown()["status"]
        if status not in ("completed", "incomplete"):
            raise OpenAIError(400, f"Previous response with id '{previous}' is {status}: a conversation continues "
                                   "from a completed response", "previous_response_id")
        return [*stored.context, *stored.response.get("output", [])]

    async def _create(self, req: HttpRequest) -> Response:
        asked = parse(req.body, ResponsesRequest)
        store, background, previous = asked.state()
        if background and not store:
            raise OpenAIError(400, "background mode requires store: true (a background response is read back "
                                   "with GET /v1/responses/ID)", "background")
        if background and asked.stream:
            raise OpenAIError(400, "'stream' with 'background' is not supported by this server: poll GET "
                                   "/v1/responses/ID", "stream")
        body = asked.chat()  # its own mistakes first, whatever the store
        scope = scope_of(req.principal)
        if store:
            await self.store.ready()  # down: refused before any work (and before a stream's 200)
        prior = await self._conversation(scope, previous) if previous is not None else []
        if prior:
            body = asked.chat(prior)
        context = orjson.dumps([*prior, *asked.items()])
        if store and len(context) > self.store.max_bytes:
            raise OpenAIError(400, f"the conversation is {len(context)} bytes stored, more than this server keeps "
                                   f"for one response ({self.store.max_bytes}, --max-response-bytes): send store: "
                                   "false with the conversation as input, or begin a new one", "input")
        writer = Writer(asked, body, new_id(), previous, store, background)
        if background:
            return await self._start(req, scope, writer, body, context)
        try:
            answer = await self.run(body, req)
        except OpenAIError as e:
            raise renamed(e) from None
        if isinstance(answer, Streamed):
            async def keep(final: dict) -> dict | None:
                """Before the stream's last event: the response stored, or the error event's fields."""
                try:
                    await self._keep(scope, final, context)
                except StoreUnavailable as e:
                    error = _unavailable(e)
                    return {"code": error.code, "message": error.message, "param": None}
                return None

            return StreamingResponse(200, [*EVENT_STREAM, *answer.headers],
                                     writer.events(answer.events, keep if store else None), answer.close)
        response = writer.whole(answer.completion)
        if store:
            await self._keep(scope, response, context)
        return _json(response)

    async def _keep(self, scope: str, response: dict, context: bytes) -> None:
        """Store a finished response (before it is answered); one too large is not kept, and says store: false."""
        body = orjson.dumps(response)
        if len(body) + len(context) > self.store.max_bytes:
            log.info("response %s not stored: %d bytes with its conversation, more than --max-response-bytes %d",
                     response["id"], len(body) + len(context), self.store.max_bytes)
            response["store"] = False
            return
        await self.store.create(scope, response["id"], response["status"], body, context, False)

    async def _start(self, req: HttpRequest, scope: str, writer: Writer, body: dict, context: bytes) -> Response:
        """A background response: stored as queued, answered so, run here."""
        queued = writer.response("queued", [])
        await self.store.create(scope, writer.ident, "queued", orjson.dumps(queued), context, True)
        task = asyncio.ensure_future(self._work(req, scope, writer, body, len(context)))
        key = (scope, writer.ident)
        self.working[key] = task
        task.add_done_callback(lambda _: self.working.pop(key, None))
        return _json(queued)

    async def _work(self, req: HttpRequest, scope: str, writer: Writer, body: dict, context_bytes: int) -> None:
        ident = writer.ident
        me = asyncio.current_task()
        beating = asyncio.ensure_future(self._beat(scope, ident, me))
        try:
            if await self.store.update(scope, ident, "in_progress", orjson.dumps(writer.response("in_progress", [])))\
                    != "ok":
                return  # cancelled or deleted while queued
            final = await self._outcome(req, writer, body)
            blob = orjson.dumps(final)
            if len(blob) + context_bytes > self.store.max_bytes:
                final = _failed(writer, "server_error", f"the response is {len(blob) + context_bytes} bytes "
                                f"with its conversation, more than --max-response-bytes {self.store.max_bytes}")
                blob = orjson.dumps(final)
            beating.cancel()
            await self.store.update(scope, ident, final["status"], blob)
        except StoreUnavailable as e:
            log.warning("background response %s: its outcome could not be stored (%s); it reads as failed after %g s",
                        ident, e, STALE)
        except asyncio.CancelledError:
            if self.closing:  # the gateway stops: say so, if Redis still answers
                with contextlib.suppress(Exception):
                    await self.store.update(scope, ident, "failed", orjson.dumps(_failed(
                        writer, "server_error", "the gateway stopped before this background response finished")))
            raise
        finally:
            beating.cancel()

    async def _outcome(self, req: HttpRequest, writer: Writer, body: dict) -> dict:
        try:
            answer = await self.run(body, req)
            assert isinstance(answer, Whole)
            return writer.whole(answer.completion)
        except OpenAIError as e:
            e = renamed(e)
            return _failed(writer, "server_error" if e.status >= 500 else "invalid_prompt", e.message)
        except Refused as e:
            return _failed(writer, "rate_limit_exceeded", e.message)
        except Exception as e:  # noqa: BLE001 (Triton unavailable, a defect: the response failed, the gateway goes on)
            return _failed(writer, "server_error", f"{type(e).__name__}: {e}")

    async def _beat(self, scope: str, ident: str, worker: asyncio.Task | None) -> None:
        """Every BEAT seconds: alive, in the store; the work stopped once the response is cancelled or deleted."""
        while True:
            await asyncio.sleep(BEAT)
            try:
                state = await self.store.beat(scope, ident)
            except StoreUnavailable:
                continue
            if state in ("cancelled", "gone") and worker is not None:
                worker.cancel()
                return

    async def close(self, grace: float = 0.0) -> None:
        """On shutdown: background responses get `grace` seconds to finish, then fail (stored as failed)."""
        if self.working and grace > 0:
            await asyncio.wait(list(self.working.values()), timeout=grace)
        self.closing = True
        tasks = list(self.working.values())
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=2.0)
        await self.store.close()


def _failed(writer: Writer, code: FailedCode, message: str) -> dict:
    """A failed response; its error's code one of the Responses API's (its message says which limit or field)."""
    r = writer.response("failed", [])
    r["error"] = {"code": code, "message": message}
    return r


def _json(value: dict) -> HttpResponse:
    return HttpResponse(200, [orjson.dumps(value)], list(JSON))
