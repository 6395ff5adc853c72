"""OpenAI's Responses API (POST /v1/responses): a request is read as its own type, turns into the chat completion it
asks for (input items -> messages, after the previous response's conversation when it names one; `instructions` -> a
system message first, function tools, `text.format` -> response_format), runs as one, and its answer is written back
as a Response object — or, streamed, as the Responses events (response.created ... response.completed) made from the
chat answer's typed events (answer.py) as they come.

`store`, `previous_response_id` and `background` are stored.py's (the store on Redis); fields that change the answer
and are not served are refused (`reasoning.summary`, `include`, hosted tools)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, field_validator

from dstool.decoding.sampling import shown
from dstool.serve.gateway.openai.answer import Event, Failed, Usage
from dstool.serve.gateway.openai.protocol import OpenAIError, ToolChoice, unserved

# fields not served -> the values that ask for nothing (taken)
UNSERVED: dict[str, tuple[Any, ...]] = {"include": ([],), "truncation": ("disabled",), "max_tool_calls": (),
                                        "top_logprobs": (0,)}
# chat fields -> the Responses field a client sent
PARAMS = {"max_tokens": "max_output_tokens", "response_format.json_schema": "text.format",
          "response_format": "text.format", "messages": "input", "verbosity": "text.verbosity",
          "reasoning_effort": "reasoning.effort"}


class Reasoning(BaseModel):
    """`reasoning`: its effort is chat's reasoning_effort (chat checks the level); a summary is not served."""

    model_config = ConfigDict(extra="forbid", strict=True)
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None  # summary's older name

    @field_validator("summary", "generate_summary", mode="after")
    @classmethod
    def _summary(cls, v: str | None, info) -> None:
        if v is not None:
            raise ValueError(f"'reasoning.{info.field_name}' {shown(v)}: reasoning summaries are not supported by "
                             "this server (the thinking itself comes as a reasoning item with --reasoning-parser)")


class TextConfig(BaseModel):
    """`text`: its format is chat's response_format, its verbosity chat's (chat checks the level)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    format: dict[str, Any] | None = None
    verbosity: str | None = None


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None  # chat's rule names a missing or unknown model
    input: list[dict[str, Any]] | str | None = None  # text, or input items of several shapes (_messages)
    instructions: str | None = None
    # types here, ranges by chat's rules (the chat request they become)
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None  # function tools, flat (_tool)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool | None = None  # null: not sent
    store: bool | None = None  # OpenAI's default: true
    previous_response_id: str | None = None
    background: bool | None = None
    reasoning: Reasoning | None = None
    include: list[str] | None = None  # refused unless empty
    truncation: Literal["auto", "disabled"] | None = None  # refused unless disabled
    max_tool_calls: int | None = None  # refused
    top_logprobs: int | None = None  # refused unless 0
    # taken, not used: they do not change the answer
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _input(cls, v: Any) -> Any:
        if v is not None and not isinstance(v, (str, list)):
            raise ValueError(f"'input' must be text or a non-empty list of input items, got {shown(v)}")
        return v

    @field_validator(*UNSERVED, mode="after")
    @classmethod
    def _unserved(cls, v: Any, info) -> Any:
        unserved(info.field_name, v, *UNSERVED[info.field_name])
        return v

    def state(self) -> tuple[bool, bool, str | None]:
        """(store — OpenAI's default: true —, background, previous_response_id)."""
        return self.store is not False, self.background is True, self.previous_response_id

    def items(self) -> list[dict]:
        """The request's input as the input items a stored conversation keeps (text is one user message), each with
        an id."""
        value = [{"type": "message", "role": "user", "content": self.input}] if isinstance(self.input, str) else \
            self.input or []
        items = []
        for item in value:
            kind = item.get("type", "message")
            prefix = {"message": "msg_", "function_call": "fc_"}.get(kind, "fco_")
            items.append({"type": kind, "id": prefix + uuid.uuid4().hex, **item})
        return items

    def chat(self, prior: list[dict] | None = None) -> dict:
        """The chat completion request this asks for, after the conversation `prior` (input items: a previous
        response's); OpenAIError (400) naming a field not served or wrong."""
        messages = _messages(self.input)  # its own input checked, its errors named as sent
        if prior:
            messages = _messages([*prior, *self.items()])
        body: dict = {"model": self.model, "messages": [*self._instructions(), *messages], "stream": self.stream}
        if self.reasoning is not None and self.reasoning.effort is not None:
            body["reasoning_effort"] = self.reasoning.effort
        for name, chat in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p"),
                           ("parallel_tool_calls", "parallel_tool_calls")):
            if getattr(self, name) is not None:
                body[chat] = getattr(self, name)
        if self.tools is not None:
            body["tools"] = [_tool(t, i) for i, t in enumerate(self.tools)]
        if self.tool_choice is not None:
            choice = self.tool_choice
            if isinstance(choice, dict) and choice.get("type") == "function" and set(choice) == {"type", "name"}:
                choice = {"type": "function", "function": {"name": choice["name"]}}
            body["tool_choice"] = choice
        if self.text is not None and self.text.format is not None:
            fmt = self.text.format
            body["response_format"] = {"type": "json_schema", "json_schema": {
                k: v for k, v in fmt.items() if k != "type"}} if fmt.get("type") == "json_schema" else fmt
        if self.text is not None and self.text.verbosity is not None:
            body["verbosity"] = self.text.verbosity
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        return body

    def _instructions(self) -> list[dict]:
        if self.instructions is None:
            return []
        return [{"role": "system", "content": self.instructions}]


def _messages(value: Any) -> list[dict]:
    """Input items as chat messages: a string is one user message; messages keep their role (their content text or
    input_text/output_text parts); function_call items become an assistant's tool_calls, function_call_output
    items tool messages."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise OpenAIError(400, "'input' must be text or a non-empty list of input items", "input")
    messages: list[dict] = []
    thought: str | None = None  # a reasoning item's text, for the assistant message made next
    for i, item in enumerate(value):
        at = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        made = len(messages)
        if kind == "reasoning":  # a previous answer's thinking (--reasoning-parser) fed back with its output
            thought = _reasoning_text(item, at)
            continue
        if kind == "message":
            # a null is the field left out (an output item fed back as model_dump() has "phase": null)
            unknown = sorted(k for k, v in item.items() if v is not None and k not in
                             {"type", "role", "content", "id", "status"})
            if unknown:
                raise OpenAIError(400, f"Unrecognized request argument supplied: {at}.{unknown[0]}",
                                  f"{at}.{unknown[0]}")
            messages.append({"role": item.get("role"), "content": _content(item.get("content"), at)})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str) else _content(output, f"{at}.output")})
        else:
            raise OpenAIError(400, f"'{at}' must be a message, reasoning, function_call or function_call_output item, "
                                   f"got {shown(item)}", at)
        if len(messages) > made:
            if thought is not None and messages[-1]["role"] == "assistant":
                messages[-1]["reasoning_content"] = thought  # the chat template decides whether the model sees it
            thought = None
    return messages


def _reasoning_text(item: dict, at: str) -> str:
    """A reasoning item's text (its reasoning_text parts, else its summary's): what the chat template is given as
    the next assistant message's reasoning_content. OpenAI's encrypted_content is taken unread: DeepSeek's templates
    (and the default layout) drop earlier turns' thinking, so it cannot change the answer."""
    for field in ("content", "summary"):
        parts = item.get(field)
        if parts is None or parts == []:
            continue
        if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str)
                                                  for p in parts):
            raise OpenAIError(400, f"'{at}.{field}' must be a list of parts with text, got {shown(parts)}",
                              f"{at}.{field}")
        return "".join(p["text"] for p in parts)
    return ""


def _content(value: Any, at: str) -> Any:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(
            isinstance(p, dict) and p.get("type") in ("input_text", "output_text") and isinstance(p.get("text"), str)
            for p in value):
        return [{"type": "text", "text": p["text"]} for p in value]
    raise OpenAIError(400, f"'{at}.content' must be text or a list of input_text parts: this server serves text only",
                      f"{at}.content")


def _tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    """A Responses function tool (flat) as a chat tool."""
    if tool.get("type") == "function":
        return {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}
    raise OpenAIError(400, f"'tools[{i}]' must be a function tool: this server serves no hosted tools",
                      f"tools[{i}]")


def renamed(e: OpenAIError) -> OpenAIError:
    """A chat request's error in the Responses request's names."""
    for chat, ours in PARAMS.items():
        if e.param and e.param.startswith(chat):
            e.param = ours + e.param[len(chat):]
            e.message = e.message.replace(f"'{chat}", f"'{ours}")
            break
    return e


class Writer:
    """A Response object built from a chat completion: whole (`whole`), or as Responses events from its stream's
    chunks (`events`)."""

    def __init__(self, request: ResponsesRequest, chat: dict, ident: str | None = None, previous: str | None = None,
                 store: bool = False, background: bool = False):
        self.request, self.chat = request, chat
        self.ident = ident or "resp_" + uuid.uuid4().hex
        self.previous, self.store, self.background = previous, store, background
        self.created = int(time.time())
        self.sequence = 0

    def response(self, status: str, output: list[dict], usage: dict | None = None, reason: str | None = None) -> dict:
        r = self.request
        fmt = self.chat.get("response_format") or {"type": "text"}
        if fmt.get("type") == "json_schema":
            fmt = {"type": "json_schema", **fmt["json_schema"]}
        return {"id": self.ident, "object": "response", "created_at": self.created, "status": status,
                "error": None, "incomplete_details": {"reason": reason} if reason else None,
                "instructions": r.instructions, "max_output_tokens": r.max_output_tokens, "model": r.model,
                "output": output, "parallel_tool_calls": r.parallel_tool_calls is not False,
                "previous_response_id": self.previous, "reasoning": None, "store": self.store,
                "background": self.background,
                "temperature": r.temperature if r.temperature is not None else 1.0, "text": {"format": fmt},
                "tool_choice": r.tool_choice if r.tool_choice is not None else "auto",
                "tools": r.tools or [], "top_p": r.top_p if r.top_p is not None else 1.0, "truncation": "disabled",
                "usage": _usage(usage) if usage else None, "user": r.user, "metadata": r.metadata or {}}

    def whole(self, completion: dict) -> dict:
        choice = completion["choices"][0]
        message = choice["message"]
        output = []
        if message.get("reasoning_content"):  # the model's thinking (the gateway's --reasoning-parser)
            output.append(_reasoning_item("rs_" + uuid.uuid4().hex, message["reasoning_content"], "completed"))
        if message.get("content") or not message.get("tool_calls"):
            output.append(_message_item("msg_" + uuid.uuid4().hex, message["content"] or "", "completed"))
        for call in message.get("tool_calls") or []:
            output.append(_call_item("fc_" + uuid.uuid4().hex, call["id"], call["function"]["name"],
                                     call["function"]["arguments"], "completed"))
        cut = choice["finish_reason"] == "length"
        if cut:
            output[-1]["status"] = "incomplete"  # what the limit cut: the message or the call as far as it got
        return self.response("incomplete" if cut else "completed", output, completion["usage"],
                             "max_output_tokens" if cut else None)

    def _event(self, kind: str, **fields) -> bytes:
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(
            {"type": kind, "sequence_number": self.sequence - 1, **fields}) + b"\n\n"

    async def events(self, events: AsyncIterator[Event],
                     keep: Callable[[dict], Awaitable[dict | None]] | None = None) -> AsyncIterator[bytes]:
        """The Responses events of a chat answer's stream (answer.py); `keep` (the store) is given the final response
        before its event is sent, and may end the stream with an error event instead (its fields)."""
        yield self._event("response.created", response=self.response("in_progress", []))
        yield self._event("response.in_progress", response=self.response("in_progress", []))
        output: list[dict] = []
        text: dict | None = None  # the message item being written
        thought: dict | None = None  # the reasoning item (--reasoning-parser)
        calls: dict[int, dict] = {}  # tool-call index -> its function_call item
        finish, usage = None, None
        async for event in events:
            if isinstance(event, Failed):
                e = event.error
                yield self._event("error", code=e.code, message=e.message, param=e.param)
                return
            if isinstance(event, Usage):
                usage = event.usage
                continue
            finish = event.finish_reason or finish
            if event.reasoning:
                if thought is None:
                    thought = _reasoning_item("rs_" + uuid.uuid4().hex, "", "in_progress")
                    output.append(thought)
                    yield self._event("response.output_item.added", output_index=len(output) - 1, item=thought)
                thought["content"][0]["text"] += event.reasoning
                yield self._event("response.reasoning_text.delta", item_id=thought["id"],
                                  output_index=output.index(thought), content_index=0, delta=event.reasoning)
            elif thought is not None and thought["status"] == "in_progress" and (event.content or event.calls):
                for part in self._close_thought(thought, output):
                    yield part
            if event.content:
                if text is None:
                    text = _message_item("msg_" + uuid.uuid4().hex, "", "in_progress")
                    output.append(text)
                    yield self._event("response.output_item.added", output_index=len(output) - 1, item=text)
                    yield self._event("response.content_part.added", item_id=text["id"],
                                      output_index=len(output) - 1, content_index=0, part=_part(""))
                text["content"][0]["text"] += event.content
                yield self._event("response.output_text.delta", item_id=text["id"],
                                  output_index=output.index(text), content_index=0, delta=event.content,
                                  logprobs=[])
            for call in event.calls:
                if call.index not in calls:
                    if text is not None:
                        for part in self._close_text(text, output):
                            yield part
                        text = None
                    item = _call_item("fc_" + uuid.uuid4().hex, call.id, call.name, "", "in_progress")
                    calls[call.index] = item
                    output.append(item)
                    yield self._event("response.output_item.added", output_index=len(output) - 1, item=item)
                item = calls[call.index]
                if call.arguments:
                    item["arguments"] += call.arguments
                    yield self._event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=output.index(item), delta=call.arguments)
        cut = finish == "length"
        last = output[-1] if cut and output else None  # what the limit cut: marked incomplete
        if thought is not None and thought["status"] == "in_progress":
            for part in self._close_thought(thought, output, "incomplete" if thought is last else "completed"):
                yield part
        if text is not None:
            for part in self._close_text(text, output, "incomplete" if text is last else "completed"):
                yield part
        for item in calls.values():
            item["status"] = "incomplete" if item is last else "completed"
            yield self._event("response.function_call_arguments.done", item_id=item["id"],
                              output_index=output.index(item), name=item["name"], arguments=item["arguments"])
            yield self._event("response.output_item.done", output_index=output.index(item), item=item)
        final = self.response("incomplete" if cut else "completed", output, usage,
                              "max_output_tokens" if cut else None)
        failed = await keep(final) if keep is not None else None
        if failed is not None:
            yield self._event("error", **failed)
            return
        yield self._event("response.incomplete" if cut else "response.completed", response=final)

    def _close_thought(self, thought: dict, output: list[dict], status: str = "completed") -> list[bytes]:
        at = output.index(thought)
        thought["status"] = status
        return [self._event("response.reasoning_text.done", item_id=thought["id"], output_index=at, content_index=0,
                            text=thought["content"][0]["text"]),
                self._event("response.output_item.done", output_index=at, item=thought)]

    def _close_text(self, text: dict, output: list[dict], status: str = "completed") -> list[bytes]:
        at, part = output.index(text), text["content"][0]
        text["status"] = status
        return [self._event("response.output_text.done", item_id=text["id"], output_index=at, content_index=0,
                            text=part["text"], logprobs=[]),
                self._event("response.content_part.done", item_id=text["id"], output_index=at, content_index=0,
                            part=part),
                self._event("response.output_item.done", output_index=at, item=text)]


def _reasoning_item(ident: str, text: str, status: str) -> dict:
    return {"type": "reasoning", "id": ident, "summary": [], "content": [{"type": "reasoning_text", "text": text}],
            "encrypted_content": None, "status": status}


def _part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(ident: str, text: str, status: str) -> dict:
    return {"type": "message", "id": ident, "status": status, "role": "assistant", "content": [_part(text)]}


def _call_item(ident: str, call_id: str | None, name: str | None, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": ident, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def _usage(usage: dict) -> dict:
    return {"input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0),
                                     "cache_write_tokens": 0},  # as Anthropic's cache_creation_input_tokens here
            "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"]}
