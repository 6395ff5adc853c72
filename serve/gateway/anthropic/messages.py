"""Anthropic's Messages API on the gateway's HTTP port: POST /v1/messages, as Anthropic's server answers it, and
GET /v1/models (and /v1/models/ID) in Anthropic's shape for a client that sends the anthropic-version header.

A request is read here in Anthropic's names, turned into the chat completion it asks for (`system` -> a system
message first; text blocks -> content; an assistant's tool_use blocks -> its tool_calls; tool_result blocks -> tool
messages; tools' input_schema -> function parameters; tool_choice auto/any/tool/none -> auto/required/the named
function/none, disable_parallel_tool_use -> parallel_tool_calls false; stop_sequences -> stop) and run by the OpenAI
frontend's chat machinery (openai/routes.py), so tenants' keys, limits, reservations, usage, fair share and the result
cache scope are exactly the chat route's. The answer is written back as a Message (text and tool_use blocks,
stop_reason end_turn / max_tokens / stop_sequence / tool_use), or, streamed, as Anthropic's events made from the
chat answer's typed events (openai/answer.py) as they come.

What cannot change this model's answer is taken and not used (metadata, cache_control on any block or tool,
service_tier, thinking {"type": "disabled"}, thinking blocks of earlier turns, which Anthropic drops from the
context too); what would change it and is not served is refused by name (images, documents, server tools, thinking
with a budget, an assistant prefill, ...): {"type": "error", "error": {"type": "invalid_request_error", ...}}.
The key is `x-api-key` or `Authorization: Bearer` (http.credential). docs/anthropic.md has the table of fields.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import AsyncIterator
from typing import Any

import orjson

from dstool.decoding.sampling import shown
from dstool.serve.gateway.openai.answer import CallDelta, Event, Failed, Streamed, Usage
from dstool.serve.gateway.openai.protocol import ChatCompletionRequest, OpenAIError, validated
from dstool.serve.gateway.openai.tools import NAME
from dstool.serve.gateway.tenancy.guard import Refused
from dstool.serve.gateway.transport import EVENT_STREAM, HttpRequest, HttpResponse, StreamingResponse, opts_out
from dstool.serve.gateway.upstream import UnsafeRequest, UpstreamTimeout, UpstreamUnavailable

TOP_LEVEL = frozenset({"model", "max_tokens", "messages", "system", "stop_sequences", "temperature", "top_p", "top_k",
                       "tools", "tool_choice", "metadata", "stream", "thinking", "service_tier", "container",
                       "mcp_servers", "context_management", "output_config", "cache_control", "inference_geo",
                       "speed", "diagnostics", "user_profile_id", "workspace_id"})
EFFORTS = ("low", "medium", "high", "xhigh", "max")
# vLLM's include_stop_str_in_output on the chat request: the stop string kept at the text's end tells which one
# stopped the answer (stop_reason stop_sequence); without it an answer a stop sequence ended reads as end_turn
KEEPS_STOP = "include_stop_str_in_output" in ChatCompletionRequest.model_fields
TOOL_ID = re.compile(r"[a-zA-Z0-9_-]{1,128}")
MAX_MESSAGES = 100_000  # Anthropic's limit on one request's messages
JSON = [("Content-Type", "application/json")]
# blocks a request may hold that this server does not serve (they would change the answer): why
UNSERVED_BLOCKS = {"image": "this server serves text only", "document": "this server serves text only",
                   "search_result": "this server serves text only", "container_upload": "this server runs no tools",
                   "server_tool_use": "this server runs no server tools",
                   "web_search_tool_result": "this server runs no server tools",
                   "web_fetch_tool_result": "this server runs no server tools",
                   "code_execution_tool_result": "this server runs no server tools",
                   "mcp_tool_use": "this server connects to no MCP server",
                   "mcp_tool_result": "this server connects to no MCP server"}


# Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors)
ANTHROPIC_ERRORS = {400: "invalid_request_error", 401: "authentication_error", 402: "billing_error",
                    403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                    429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


def anthropic_error(status: int, message: str) -> bytes:
    """Anthropic's error body: {"type": "error", "error": {"type": ..., "message": ...}}."""
    kind = ANTHROPIC_ERRORS.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return orjson.dumps({"type": "error", "error": {"type": kind, "message": message}})


class AnthropicError(Exception):
    """A request refused, with its HTTP status; the message names the field as Anthropic does (`messages.0.content`)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


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
        chat, stops = translate(body)
        request = validated(chat, ChatCompletionRequest)
        try:  # the base and adapter it names, and whether the key is given it: before any work on the request
            target = await self.openai.target(request.model, req.principal)
        except OpenAIError as e:
            if e.status == 404:
                raise AnthropicError(404, f"model: {shown(request.model)} (this key is not given it, or it does not "
                                          "exist)") from None
            raise
        await request.check_grammars()
        answer = await self.openai._complete(request, opts_out(req), req.principal, target)
        writer = Writer(request.model, stops)
        if isinstance(answer, Streamed):
            return StreamingResponse(200, [*EVENT_STREAM, *answer.headers], writer.events(answer.events), answer.close)
        return HttpResponse(200, [orjson.dumps(writer.whole(answer.completion))], list(JSON))


# ---- the request ---------------------------------------------------------------------------------------------------

def translate(body: dict) -> tuple[dict, list[str]]:
    """The chat completion request a Messages request asks for, and its stop sequences; AnthropicError (400) naming
    the first field that is wrong or not served."""
    body = {k: v for k, v in body.items() if v is not None}  # a null is the field left out
    unknown = sorted(set(body) - TOP_LEVEL)
    if unknown:
        raise AnthropicError(400, f"{unknown[0][:64]}: Extra inputs are not permitted")
    for name in ("model", "max_tokens", "messages"):
        if name not in body:
            raise AnthropicError(400, f"{name}: Field required")
    model, max_tokens = body["model"], body["max_tokens"]
    if not isinstance(model, str) or not model:
        raise AnthropicError(400, f"model: Input should be a non-empty string, got {shown(model)}")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise AnthropicError(400, f"max_tokens: Input should be an integer of at least 1, got {shown(max_tokens)}")
    chat: dict[str, Any] = {"model": model, "max_tokens": max_tokens}
    for name in ("temperature", "top_p"):
        if name in body:
            chat[name] = _number(name, body[name], 0.0, 1.0)
    if "top_k" in body:
        top_k = body["top_k"]
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
            raise AnthropicError(400, f"top_k: Input should be an integer of at least 0, got {shown(top_k)}")
        if top_k:
            chat["top_k"] = top_k
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise AnthropicError(400, f"stream: Input should be a valid boolean, got {shown(stream)}")
    chat["stream"] = stream
    if stream:
        chat["stream_options"] = {"include_usage": True}
    stops = body.get("stop_sequences", [])
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise AnthropicError(400, f"stop_sequences: Input should be a list of strings, got {shown(stops)}")
    if stops:  # the stop string kept at the text's end tells which one stopped it (Writer takes it off)
        chat["stop"] = stops
        if KEEPS_STOP:
            chat["include_stop_str_in_output"] = True
    _accepted(body)
    messages = [*_system(body.get("system")), *_messages(body["messages"])]
    chat["messages"] = messages
    if "tools" in body:
        chat["tools"] = _tools(body["tools"])
    if "tool_choice" in body:
        choice, parallel = _tool_choice(body["tool_choice"], chat.get("tools") or [])
        chat["tool_choice"] = choice
        if parallel is not None:
            chat["parallel_tool_calls"] = parallel
    fmt = _output_config(body.get("output_config", {}))
    if fmt is not None:
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt}}
    return chat, stops


def _output_config(value: Any) -> dict | None:
    """output_config's JSON schema, when it has one (the answer is generated under it, as the chat route's
    response_format); its `effort` selects how a thinking model thinks, which this model does not: taken."""
    if not isinstance(value, dict):
        raise AnthropicError(400, f"output_config: Input should be an object, got {shown(value)}")
    value = {k: v for k, v in value.items() if v is not None}
    _keys(value, "output_config", {"effort", "format"})
    if value.get("effort", "high") not in EFFORTS:
        raise AnthropicError(400, f"output_config.effort: Input should be one of {', '.join(EFFORTS)}, got "
                                  f"{shown(value['effort'])}")
    if "format" not in value:
        return None
    fmt = value["format"]
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise AnthropicError(400, "output_config.format: Input should be {\"type\": \"json_schema\", \"schema\": "
                                  f"{{...}}}}, got {shown(fmt)}")
    _keys(fmt, "output_config.format", {"schema"})
    return fmt["schema"]


def _number(name: str, value: Any, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise AnthropicError(400, f"{name}: range: {low:g}..{high:g}, got {shown(value)}")
    return float(value)


def _accepted(body: dict) -> None:
    """The fields that cannot change this model's answer, checked as Anthropic checks them; the others refused."""
    metadata = body.get("metadata", {})
    if not isinstance(metadata, dict) or not all(isinstance(k, str) for k in metadata) or \
            not isinstance(metadata.get("user_id", ""), str):
        raise AnthropicError(400, f"metadata: Input should be an object such as {{\"user_id\": \"...\"}}, got "
                                  f"{shown(metadata)}")
    unknown = sorted(set(metadata) - {"user_id"})
    if unknown:
        raise AnthropicError(400, f"metadata.{unknown[0][:64]}: Extra inputs are not permitted")
    tier = body.get("service_tier", "auto")
    if tier not in ("auto", "standard_only"):
        raise AnthropicError(400, f"service_tier: Input should be 'auto' or 'standard_only', got {shown(tier)}")
    thinking = body.get("thinking", {"type": "disabled"})
    if thinking != {"type": "disabled"}:
        if not isinstance(thinking, dict) or thinking.get("type") not in ("enabled", "disabled", "adaptive"):
            raise AnthropicError(400, f"thinking: Input should be {{\"type\": \"enabled\", \"budget_tokens\": N}} or "
                                      f"{{\"type\": \"disabled\"}}, got {shown(thinking)}")
        raise AnthropicError(400, f"thinking: {shown(thinking)} is not supported by this model, which has no "
                                  "thinking mode: leave 'thinking' out or send {\"type\": \"disabled\"}")
    _cache_control(body, "")
    for name in ("inference_geo", "user_profile_id", "workspace_id"):  # where and for whom: not what
        if not isinstance(body.get(name, ""), str):
            raise AnthropicError(400, f"{name}: Input should be a valid string, got {shown(body[name])}")
    if body.get("speed", "standard") not in ("standard", "fast"):
        raise AnthropicError(400, f"speed: Input should be 'standard' or 'fast', got {shown(body['speed'])}")
    diagnostics = body.get("diagnostics", {})
    if not isinstance(diagnostics, dict) or set(diagnostics) - {"previous_message_id"}:
        raise AnthropicError(400, f"diagnostics: Input should be {{\"previous_message_id\": ...}}, got "
                                  f"{shown(diagnostics)}")
    if body.get("mcp_servers", []) != []:
        raise AnthropicError(400, "mcp_servers: this server connects to no MCP server: leave it out")
    for name in ("container", "context_management"):
        if name in body:
            raise AnthropicError(400, f"{name}: not supported by this server: leave it out")


def _cache_control(block: dict, at: str) -> None:
    """`cache_control` (Anthropic's prompt caching) asks for nothing here: the engine's prefix cache keeps every
    prompt's prefixes by itself. Checked for its shape only."""
    value = block.get("cache_control")
    if value is not None and not (isinstance(value, dict) and value.get("type") == "ephemeral" and
                                  set(value) <= {"type", "ttl"} and value.get("ttl", "5m") in ("5m", "1h")):
        name = f"{at}.cache_control" if at else "cache_control"
        raise AnthropicError(400, f"{name}: Input should be {{\"type\": \"ephemeral\", \"ttl\": \"5m\" or \"1h\"}}, "
                                  f"got {shown(value)}")


def _keys(block: dict, at: str, allowed: set[str]) -> None:
    unknown = sorted(set(block) - allowed - {"type", "cache_control", "toolset_name"})
    if unknown:
        raise AnthropicError(400, f"{at}.{unknown[0][:64]}: Extra inputs are not permitted")
    _cache_control(block, at)
    if block.get("toolset_name") is not None:
        raise AnthropicError(400, f"{at}.toolset_name: toolsets are not supported by this server: leave it out")


def _text_block(block: Any, at: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text":
        raise AnthropicError(400, f"{at}: Input should be a text block {{\"type\": \"text\", \"text\": ...}}, got "
                                  f"{shown(block)}")
    _keys(block, at, {"text", "citations"})
    text = block.get("text")
    if not isinstance(text, str):
        raise AnthropicError(400, f"{at}.text: Input should be a valid string, got {shown(text)}")
    if not text:
        raise AnthropicError(400, f"{at}.text: text content blocks must be non-empty")
    if block.get("citations") not in (None, []):
        raise AnthropicError(400, f"{at}.citations: citations are not supported by this server: leave them out")
    return text


def _system(value: Any) -> list[dict]:
    if value is None or value == "" or value == []:
        return []
    if isinstance(value, str):
        return [{"role": "system", "content": value}]
    if not isinstance(value, list):
        raise AnthropicError(400, f"system: Input should be a string or a list of text blocks, got {shown(value)}")
    return [{"role": "system", "content": [{"type": "text", "text": _text_block(b, f"system.{i}")}
                                           for i, b in enumerate(value)]}]


def _messages(value: Any) -> list[dict]:
    """Anthropic's turns as chat messages: a user turn's tool_result blocks are tool messages (in order, with its
    text as a user message), an assistant turn's text and tool_use blocks one assistant message. Each tool_result
    answers a tool_use of the turn before, and each tool_use is answered in the turn after, as Anthropic checks."""
    if not isinstance(value, list) or not value:
        raise AnthropicError(400, f"messages: Input should be a non-empty list of messages, got {shown(value)}")
    if len(value) > MAX_MESSAGES:
        raise AnthropicError(400, f"messages: at most {MAX_MESSAGES} messages, got {len(value)}")
    out: list[dict] = []
    asked: list[str] = []  # the tool_use ids of the turn before
    for i, message in enumerate(value):
        at = f"messages.{i}"
        if not isinstance(message, dict):
            raise AnthropicError(400, f"{at}: Input should be an object {{\"role\": ..., \"content\": ...}}, got "
                                      f"{shown(message)}")
        unknown = sorted(set(message) - {"role", "content"})
        if unknown:
            raise AnthropicError(400, f"{at}.{unknown[0][:64]}: Extra inputs are not permitted")
        role, content = message.get("role"), message.get("content")
        if role not in ("user", "assistant"):
            raise AnthropicError(400, f"{at}.role: Input should be 'user' or 'assistant', got {shown(role)}"
                                      + (" (the system prompt is the top-level 'system' field)" if role == "system"
                                         else ""))
        if isinstance(content, str):
            if not content:
                raise AnthropicError(400, f"{at}.content: messages must have non-empty content")
            blocks: list = [{"type": "text", "text": content}]
        elif isinstance(content, list):
            if not content:
                raise AnthropicError(400, f"{at}.content: messages must have non-empty content")
            blocks = content
        else:
            raise AnthropicError(400, f"{at}.content: Input should be a string or a list of content blocks, got "
                                      f"{shown(content)}")
        if role == "user":
            answered = _user_turn(blocks, at, out)
            if answered != set(asked):
                missing = sorted(set(asked) - answered)
                if missing:
                    raise AnthropicError(400, f"{at}: `tool_use` ids were found without `tool_result` blocks "
                                              f"immediately after: {', '.join(missing)[:200]}. Each `tool_use` block "
                                              "must have a corresponding `tool_result` block in the next message.")
                extra = sorted(answered - set(asked))
                raise AnthropicError(400, f"{at}.content: unexpected `tool_use_id` found in `tool_result` blocks: "
                                          f"{', '.join(extra)[:200]}. Each `tool_result` block must have a "
                                          "corresponding `tool_use` block in the previous message.")
            asked = []
        else:
            if asked:
                raise AnthropicError(400, f"{at}: `tool_use` ids were found without `tool_result` blocks immediately "
                                          f"after: {', '.join(asked)[:200]}. Each `tool_use` block must have a "
                                          "corresponding `tool_result` block in the next message.")
            asked = _assistant_turn(blocks, at, out)
    if value[-1].get("role") == "assistant":
        raise AnthropicError(400, f"messages.{len(value) - 1}: a final assistant message (a prefill the answer "
                                  "continues) is not supported by this server: end with a user message")
    return out


def _user_turn(blocks: list, at: str, out: list[dict]) -> set[str]:
    """A user turn's messages appended to `out`; the tool_use ids its tool_result blocks answer."""
    texts: list[dict] = []
    answered: set[str] = set()
    for j, block in enumerate(blocks):
        where = f"{at}.content.{j}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append({"type": "text", "text": _text_block(block, where)})
        elif kind == "tool_result":
            _keys(block, where, {"tool_use_id", "content", "is_error"})
            ident = block.get("tool_use_id")
            if not isinstance(ident, str) or not TOOL_ID.fullmatch(ident):
                raise AnthropicError(400, f"{where}.tool_use_id: Input should be an id of letters, digits, '_' or "
                                          f"'-', got {shown(ident)}")
            if ident in answered:
                raise AnthropicError(400, f"{where}.tool_use_id: {ident} is answered twice")
            answered.add(ident)
            is_error = block.get("is_error", False)
            if not isinstance(is_error, bool):
                raise AnthropicError(400, f"{where}.is_error: Input should be a valid boolean, got {shown(is_error)}")
            result = _tool_result(block.get("content", ""), f"{where}.content")
            if is_error:  # the chat's tool message has no error flag: the model reads it in the text
                result = "Error: " + result
            if texts:  # text before a tool result stays before it
                out.append({"role": "user", "content": texts})
                texts = []
            out.append({"role": "tool", "tool_call_id": ident, "content": result})
        else:
            _unserved_block(block, kind, where, ("text", "tool_result"))
    if texts:
        out.append({"role": "user", "content": texts})
    return answered


def _tool_result(value: Any, at: str) -> str:
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise AnthropicError(400, f"{at}: Input should be a string or a list of text blocks, got {shown(value)}")
    texts = []
    for k, block in enumerate(value):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text":
            _unserved_block(block, kind, f"{at}.{k}", ("text",))
        texts.append(_text_block(block, f"{at}.{k}"))
    return "\n".join(texts)


def _assistant_turn(blocks: list, at: str, out: list[dict]) -> list[str]:
    """An assistant turn as one message appended to `out`; the ids of its tool_use blocks."""
    texts: list[str] = []
    calls: list[dict] = []
    for j, block in enumerate(blocks):
        where = f"{at}.content.{j}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(_text_block(block, where))
        elif kind == "tool_use":
            _keys(block, where, {"id", "name", "input"})
            ident, name, given = block.get("id"), block.get("name"), block.get("input")
            if not isinstance(ident, str) or not TOOL_ID.fullmatch(ident):
                raise AnthropicError(400, f"{where}.id: Input should be an id of letters, digits, '_' or '-', got "
                                          f"{shown(ident)}")
            if any(c["id"] == ident for c in calls):
                raise AnthropicError(400, f"{where}.id: `tool_use` ids must be unique: {ident} is used twice")
            if not isinstance(name, str) or not NAME.fullmatch(name):
                raise AnthropicError(400, f"{where}.name: Input should be 1-64 letters, digits, '_' or '-', got "
                                          f"{shown(name)}")
            if not isinstance(given, dict):
                raise AnthropicError(400, f"{where}.input: Input should be an object, got {shown(given)}")
            calls.append({"id": ident, "type": "function",
                          "function": {"name": name, "arguments": orjson.dumps(given).decode()}})
        elif kind in ("thinking", "redacted_thinking"):  # an earlier turn's thinking: Anthropic drops it too
            if kind == "thinking" and not isinstance(block.get("thinking"), str):
                raise AnthropicError(400, f"{where}.thinking: Input should be a valid string")
            _keys(block, where, {"thinking", "signature", "data"})
        else:
            _unserved_block(block, kind, where, ("text", "tool_use", "thinking", "redacted_thinking"))
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) if texts else None}
    if calls:
        message["tool_calls"] = calls
    elif not texts:
        message["content"] = ""  # thinking alone
    out.append(message)
    return [c["id"] for c in calls]


def _unserved_block(block: Any, kind: Any, at: str, expected: tuple[str, ...]) -> None:
    if isinstance(kind, str) and kind in UNSERVED_BLOCKS:
        raise AnthropicError(400, f"{at}: {kind} blocks are not supported by this server: {UNSERVED_BLOCKS[kind]}")
    raise AnthropicError(400, f"{at}: Input should be a block of type {', '.join(expected)}, got {shown(block)}")


def _tools(value: Any) -> list[dict]:
    """Custom tools as chat function tools (their names, schemas and count checked by the chat request)."""
    if not isinstance(value, list):
        raise AnthropicError(400, f"tools: Input should be a list of tools, got {shown(value)}")
    tools = []
    for i, tool in enumerate(value):
        at = f"tools.{i}"
        if not isinstance(tool, dict):
            raise AnthropicError(400, f"{at}: Input should be a tool {{\"name\", \"input_schema\", ...}}, got "
                                      f"{shown(tool)}")
        kind = tool.get("type", "custom")
        if kind != "custom":
            raise AnthropicError(400, f"{at}.type: {shown(kind)} tools are not supported by this server, which runs "
                                      "no server tools: define a custom tool with 'input_schema'")
        _keys(tool, at, {"name", "description", "input_schema", "strict", "eager_input_streaming", "allowed_callers",
                         "defer_loading", "input_examples"})
        if tool.get("allowed_callers", ["direct"]) != ["direct"]:
            raise AnthropicError(400, f"{at}.allowed_callers: only [\"direct\"] is supported by this server, which "
                                      "runs no code execution")
        if tool.get("defer_loading", False) is not False:
            raise AnthropicError(400, f"{at}.defer_loading: tool search is not supported by this server: every tool is "
                                      "shown to the model")
        if tool.get("input_examples", []) != []:
            raise AnthropicError(400, f"{at}.input_examples: not supported by this server: leave them out")
        if "input_schema" not in tool:
            raise AnthropicError(400, f"{at}.input_schema: Field required")
        function = {"name": tool.get("name"), "parameters": tool["input_schema"]}
        for name in ("description", "strict"):
            if tool.get(name) is not None:
                function[name] = tool[name]
        tools.append({"type": "function", "function": function})
    return tools


def _tool_choice(value: Any, tools: list[dict]) -> tuple[Any, bool | None]:
    """(the chat's tool_choice, its parallel_tool_calls or None)."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise AnthropicError(400, f"tool_choice: Input should be {{\"type\": \"auto\" | \"any\" | \"tool\" | "
                                  f"\"none\"}}, got {shown(value)}")
    assert isinstance(value, dict)
    _keys(value, "tool_choice", {"name", "disable_parallel_tool_use"} if kind == "tool" else
          {"disable_parallel_tool_use"} if kind != "none" else set())
    disable = value.get("disable_parallel_tool_use")
    if disable is not None and not isinstance(disable, bool):
        raise AnthropicError(400, f"tool_choice.disable_parallel_tool_use: Input should be a valid boolean, got "
                                  f"{shown(disable)}")
    if kind in ("any", "tool") and not tools:
        raise AnthropicError(400, f"tool_choice: {kind} needs 'tools'")
    if kind == "tool":
        name = value.get("name")
        if not isinstance(name, str) or not any(t["function"]["name"] == name for t in tools):
            raise AnthropicError(400, f"tool_choice.name: {shown(name)} is not the name of one of 'tools'")
        choice: Any = {"type": "function", "function": {"name": name}}
    else:
        choice = {"auto": "auto", "any": "required", "none": "none"}[kind]
    return choice, (False if disable else None)


RENAMES = ((re.compile(r"tools\[(\d+)\]\.function\.parameters"), r"tools.\1.input_schema"),
           (re.compile(r"tools\[(\d+)\]\.function\."), r"tools.\1."), (re.compile(r"tools\[(\d+)\]"), r"tools.\1"),
           (re.compile(r"response_format\.json_schema\.schema"), "output_config.format.schema"),
           (re.compile(r"response_format(\.json_schema)?"), "output_config.format"),
           (re.compile(r"'stop'"), "'stop_sequences'"),
           (re.compile(r"'parallel_tool_calls'"), "'tool_choice.disable_parallel_tool_use'"))


def renamed(message: str) -> str:
    """A chat request's error in the Messages request's names."""
    for pattern, name in RENAMES:
        message = pattern.sub(name, message)
    return message


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
