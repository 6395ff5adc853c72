"""Anthropic's Messages API on the gateway's HTTP port: POST /v1/messages, as Anthropic's server answers it, and
GET /v1/models (and /v1/models/ID) in Anthropic's shape for a client that sends the anthropic-version header.

A request is read as its own type (protocol.py), turned into the chat completion it asks for and run by the OpenAI
frontend's chat machinery (openai/routes.py), so tenants' keys, limits, reservations, usage, fair share and the result
cache scope are exactly the chat route's. The answer is written back as a Message (text and tool_use blocks,
stop_reason end_turn / max_tokens / stop_sequence / tool_use), or, streamed, as Anthropic's events made from the
chat answer's typed events (openai/answer.py) as they come; an error is {"type": "error", "error": {"type":
"invalid_request_error", ...}}.
The key is `x-api-key` or `Authorization: Bearer` (http.credential). docs/anthropic.md has the table of fields.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import orjson

from dstool.decoding.sampling import shown
from dstool.serve.gateway.anthropic.protocol import AnthropicError, MessagesRequest, renamed
from dstool.serve.gateway.openai.answer import CallDelta, Event, Failed, Streamed, Usage
from dstool.serve.gateway.openai.protocol import ChatCompletionRequest, OpenAIError, validated
from dstool.serve.gateway.tenancy.guard import Refused
from dstool.serve.gateway.transport import EVENT_STREAM, HttpRequest, HttpResponse, StreamingResponse, opts_out
from dstool.serve.gateway.upstream import UnsafeRequest, UpstreamTimeout, UpstreamUnavailable

JSON = [("Content-Type", "application/json")]
# Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors)
ANTHROPIC_ERRORS = {400: "invalid_request_error", 401: "authentication_error", 402: "billing_error",
                    403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                    429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


def anthropic_error(status: int, message: str) -> bytes:
    """Anthropic's error body: {"type": "error", "error": {"type": ..., "message": ...}}."""
    kind = ANTHROPIC_ERRORS.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return orjson.dumps({"type": "error", "error": {"type": kind, "message": message}})


def _error(status: int, message: str) -> HttpResponse:
    return HttpResponse(status, [anthropic_error(status, message)], list(JSON))


def anthropic_refused(e: Refused) -> HttpResponse:
    """The guard's refusal (a key, a limit, a budget) in Anthropic's error shape, with its headers (retry-after, which
    the `anthropic` client honours)."""
    response = _error(e.status, e.message)
    response.headers += e.headers
    return response


def model_info(name: str) -> dict:
    """A served model as Anthropic's models API describes one (its release date unknown: the epoch)."""
    return {"type": "model", "id": name, "display_name": name, "created_at": "1970-01-01T00:00:00Z",
            "lifecycle": "active", "deprecated_at": None, "retires_at": None}


class AnthropicFrontend:
    def __init__(self, openai):
        self.openai = openai  # openai.OpenAIFrontend: its chat machinery runs every message

    async def handle(self, req: HttpRequest):
        try:
            if req.path == "/v1/messages":
                if req.method != "POST":
                    raise AnthropicError(405, f"use POST for {req.path}")
                return await self._messages(req)
            if req.path == "/v1/models" and req.method == "GET":
                return await self._models(req, None)
            if req.path.startswith("/v1/models/") and req.method == "GET":
                return await self._models(req, req.path[len("/v1/models/"):])
            if req.path == "/v1/messages/count_tokens":
                raise AnthropicError(404, "POST /v1/messages/count_tokens is not served: the exact count needs the "
                                          "model's chat template, which only the model runs; POST /v1/messages "
                                          "answers usage.input_tokens")
            raise AnthropicError(404, f"no route {req.method} {req.path}: this server's Anthropic API has POST "
                                      "/v1/messages and GET /v1/models")
        except AnthropicError as e:
            return _error(e.status, e.message)
        except OpenAIError as e:
            return _error(e.status, renamed(e.message))
        except Refused as e:
            return anthropic_refused(e)
        except UnsafeRequest as e:
            return _error(400, str(e))
        except (UpstreamUnavailable, UpstreamTimeout) as e:
            return _error(503, str(e))

    async def _models(self, req: HttpRequest, model: str | None) -> HttpResponse:
        def row(m: dict) -> dict:
            return model_info(m["id"])

        if model is not None:  # as the OpenAI route finds it (an adapter also by its BASE:NAME)
            try:
                one = await self.openai._model(model, req.principal)
            except OpenAIError as e:
                if e.status != 404:
                    raise
                raise AnthropicError(404, f"model: {shown(model)} is not served (GET /v1/models lists them)") from None
            return HttpResponse(200, [orjson.dumps(row(orjson.loads(b"".join(one.chunks))))], list(JSON))
        listed = await self.openai._models(req.principal)  # the served families the key is given
        rows = [row(m) for m in orjson.loads(b"".join(listed.chunks))["data"]]
        return HttpResponse(200, [orjson.dumps({"data": rows, "has_more": False,
                                                "first_id": rows[0]["id"] if rows else None,
                                                "last_id": rows[-1]["id"] if rows else None})], list(JSON))

    async def _messages(self, req: HttpRequest):
        try:
            body = orjson.loads(req.body)
        except orjson.JSONDecodeError as e:
            raise AnthropicError(400, f"the body is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise AnthropicError(400, "the body must be a JSON object")
        asked = MessagesRequest.parse(body)
        request = validated(asked.chat(), ChatCompletionRequest)
        try:  # the base and adapter it names, and whether the key is given it: before any work on the request
            target = await self.openai.target(request.model, req.principal)
        except OpenAIError as e:
            if e.status == 404:
                raise AnthropicError(404, f"model: {shown(request.model)} (this key is not given it, or it does not "
                                          "exist)") from None
            raise
        await request.check_grammars()
        answer = await self.openai._complete(request, opts_out(req), req.principal, target)
        writer = Writer(request.model, asked.stop_sequences)
        if isinstance(answer, Streamed):
            return StreamingResponse(200, [*EVENT_STREAM, *answer.headers], writer.events(answer.events), answer.close)
        return HttpResponse(200, [orjson.dumps(writer.whole(answer.completion))], list(JSON))


# ---- the answer ----------------------------------------------------------------------------------------------------

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def tool_use_id(call_id: str | None) -> str:
    """A chat call's id as Anthropic spells its tool_use ids."""
    return "toolu_" + (call_id or uuid.uuid4().hex).removeprefix("call_")


def _ended_by(text: str, stops: list[str]) -> str | None:
    """The stop sequence `text` ends with (the chat answer keeps the one that stopped it), or None."""
    found = [s for s in stops if text.endswith(s)]
    return max(found, key=len) if found else None


def _usage(usage: dict | None) -> dict:
    """Anthropic's usage: input_tokens are those the prompt cache did not hold (as Anthropic counts them), the others
    cache_read_input_tokens."""
    usage = usage or {}
    prompt = int(usage.get("prompt_tokens", 0))
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0)
    return {"input_tokens": prompt - cached, "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached,
            "output_tokens": int(usage.get("completion_tokens", 0)), "service_tier": "standard"}


class Writer:
    """A Message built from a chat completion: whole (`whole`), or as Anthropic's events from its stream's chunks
    (`events`)."""

    def __init__(self, model: str, stops: list[str]):
        self.model, self.stops = model, stops
        self.ident = "msg_" + uuid.uuid4().hex

    def message(self, content: list[dict], stop_reason: str | None, stop_sequence: str | None, usage: dict) -> dict:
        return {"id": self.ident, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage}

    def _reason(self, finish: str | None, text: str) -> tuple[str, str | None, str]:
        """(stop_reason, stop_sequence, the text without it)."""
        stop = _ended_by(text, self.stops) if finish == "stop" else None
        if stop is not None:
            return "stop_sequence", stop, text[:len(text) - len(stop)]
        return STOP_REASONS.get(finish or "stop", "end_turn"), None, text

    def whole(self, completion: dict) -> dict:
        choice = completion["choices"][0]
        message = choice["message"]
        reason, stop, text = self._reason(choice["finish_reason"], message.get("content") or "")
        content: list[dict] = [{"type": "text", "text": text}] if text else []
        for call in message.get("tool_calls") or []:
            content.append({"type": "tool_use", "id": tool_use_id(call["id"]), "name": call["function"]["name"],
                            "input": _input(call["function"]["arguments"])})
        return self.message(content, reason, stop, _usage(completion.get("usage")))

    @staticmethod
    def _event(kind: str, **fields) -> bytes:
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **fields}) + b"\n\n"

    async def events(self, events: AsyncIterator[Event]) -> AsyncIterator[bytes]:
        """Anthropic's events of a chat answer's stream (answer.py, usage last): message_start,
        each block's content_block_start, deltas (text_delta, input_json_delta) and content_block_stop, a ping after
        the first block starts, message_delta (stop_reason, stop_sequence, usage), message_stop. The last characters
        of the text are held until the answer ends when it has stop sequences (the one that stopped it is not
        sent)."""
        yield self._event("message_start", message=self.message([], None, None, _usage(None)))
        hold = max((len(s) for s in self.stops), default=0)
        state = _Blocks()
        pending = ""  # text held back: it may be (the start of) the stop sequence that ends the answer
        finish, usage = None, None
        async for event in events:
            if isinstance(event, Failed):
                kind = "api_error" if event.error.kind == "server_error" else "invalid_request_error"
                yield self._event("error", error={"type": kind, "message": event.error.message})
                return
            if isinstance(event, Usage):
                usage = event.usage
                continue
            finish = event.finish_reason or finish
            if event.content:
                pending += event.content
                if len(pending) > hold:
                    cut = len(pending) - hold
                    for part in state.text(pending[:cut]):
                        yield part
                    pending = pending[cut:]
            for call in event.calls:
                for part in state.text(pending):  # no stop sequence comes before a call
                    yield part
                pending = ""
                for part in state.tool(call):
                    yield part
        reason, stop, pending = self._reason(finish, pending)
        for part in [*state.text(pending), *state.close()]:
            yield part
        if not state.pinged:
            yield self._event("ping")
        yield self._event("message_delta", delta={"stop_reason": reason, "stop_sequence": stop},
                          usage={k: v for k, v in _usage(usage).items() if k != "service_tier"})
        yield self._event("message_stop")


class _Blocks:
    """The content blocks of a streamed Message as they open, grow and close (one open at a time)."""

    def __init__(self):
        self.index = -1
        self.open: str | None = None  # "text" or "tool"
        self.calls: dict[int, int] = {}  # the chat's tool-call index -> its block's index
        self.pinged = False

    def _start(self, block: dict) -> list[bytes]:
        events = self.close()
        self.index += 1
        events.append(Writer._event("content_block_start", index=self.index, content_block=block))
        if not self.pinged:
            events.append(Writer._event("ping"))
            self.pinged = True
        return events

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [Writer._event("content_block_stop", index=self.index)]

    def text(self, text: str) -> list[bytes]:
        if not text:
            return []
        events = [] if self.open == "text" else self._start({"type": "text", "text": ""})
        self.open = "text"
        events.append(Writer._event("content_block_delta", index=self.index,
                                    delta={"type": "text_delta", "text": text}))
        return events

    def tool(self, call: CallDelta) -> list[bytes]:
        """A tool call's part: its first (id and name) opens a tool_use block; its arguments' text follows as
        input_json_delta."""
        events: list[bytes] = []
        if call.index not in self.calls:
            events += self._start({"type": "tool_use", "id": tool_use_id(call.id), "name": call.name, "input": {}})
            self.open = "tool"
            self.calls[call.index] = self.index
        if call.arguments:
            events.append(Writer._event("content_block_delta", index=self.calls[call.index],
                                        delta={"type": "input_json_delta", "partial_json": call.arguments}))
        return events


def _input(arguments: str) -> Any:
    try:
        value = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}
