"""Anthropic's Messages request as types (as openai/protocol.py has OpenAI's): `MessagesRequest.parse` validates a body
and `chat()` turns it into the chat completion request it asks for; a mistake, an unknown field or one not served is
an `AnthropicError` (400) naming the field as Anthropic does (`messages.0.content.1.text: ...`).

The turn from Anthropic's names to the chat's: `system` -> a system message first; text blocks -> content; an
assistant's tool_use blocks -> its tool_calls; tool_result blocks -> tool messages; tools' input_schema -> function
parameters; tool_choice auto/any/tool/none -> auto/required/the named function/none, disable_parallel_tool_use ->
parallel_tool_calls false; stop_sequences -> stop; output_config.format -> response_format. What cannot change this
model's answer is taken and not used (metadata, cache_control on any block or tool, service_tier, thinking
{"type": "disabled"}, earlier turns' thinking blocks, which Anthropic drops from the context too); what would change
it and is not served is refused by name (images, documents, server tools, thinking with a budget, a prefill, ...).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import orjson
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
)

from dstool.decoding.sampling import shown
from dstool.serve.gateway.openai.protocol import ChatCompletionRequest
from dstool.serve.gateway.openai.tools import NAME

# vLLM's include_stop_str_in_output on the chat request: the stop string kept at the text's end tells which one
# stopped the answer (stop_reason stop_sequence); without it an answer a stop sequence ended reads as end_turn
KEEPS_STOP = "include_stop_str_in_output" in ChatCompletionRequest.model_fields
TOOL_ID = r"^[a-zA-Z0-9_-]{1,128}$"
MAX_MESSAGES = 100_000  # Anthropic's limit on one request's messages
# blocks a request may hold that this server does not serve (they would change the answer): why
UNSERVED_BLOCKS = {"image": "this server serves text only", "document": "this server serves text only",
                   "search_result": "this server serves text only", "container_upload": "this server runs no tools",
                   "server_tool_use": "this server runs no server tools",
                   "web_search_tool_result": "this server runs no server tools",
                   "web_fetch_tool_result": "this server runs no server tools",
                   "code_execution_tool_result": "this server runs no server tools",
                   "mcp_tool_use": "this server connects to no MCP server",
                   "mcp_tool_result": "this server connects to no MCP server"}
BLOCK_TYPES = frozenset({"text", "tool_use", "tool_result", "thinking", "redacted_thinking"})
ALLOWED = {"user": ("text", "tool_result"), "assistant": ("text", "tool_use", "thinking", "redacted_thinking")}


class AnthropicError(Exception):
    """A request refused, with its HTTP status; the message names the field as Anthropic does (`messages.0.content`)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def _range(low: float, high: float):
    def check(v: Any) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not low <= v <= high:
            raise ValueError(f"range: {low:g}..{high:g}, got {shown(v)}")
        return float(v)
    return BeforeValidator(check)


def _only(why: str, *taken: Any):
    """A field served at the values `taken` (its empty or default ones) or left out: any other would change the
    answer, which this server does not serve (`why`)."""
    def check(v: Any) -> None:
        if v is not None and not any(type(v) is type(t) and v == t for t in taken):
            raise ValueError(why)
    return BeforeValidator(check)


def _thinking(v: Any) -> None:
    """`thinking`: only {"type": "disabled"} is served (this model has no thinking mode)."""
    if v is None or v == {"type": "disabled"}:
        return None
    if not isinstance(v, dict) or v.get("type") not in ("enabled", "disabled", "adaptive"):
        raise ValueError(f'Input should be {{"type": "enabled", "budget_tokens": N}} or {{"type": "disabled"}}, got '
                         f"{shown(v)}")
    raise ValueError(f"{shown(v)} is not supported by this model, which has no thinking mode: leave 'thinking' out or "
                     'send {"type": "disabled"}')


def _blocks(v: Any) -> Any:
    """A message's content: a string is one text block."""
    if isinstance(v, str):
        if not v:
            raise ValueError("messages must have non-empty content")
        return [{"type": "text", "text": v}]
    if isinstance(v, list) and not v:
        raise ValueError("messages must have non-empty content")
    if not isinstance(v, list):
        raise ValueError(f"Input should be a string or a list of content blocks, got {shown(v)}")
    return v


def _texts(v: Any) -> Any:
    """A system prompt's or a tool result's content: a string is one text block (none when empty)."""
    if isinstance(v, str):
        return [{"type": "text", "text": v}] if v else []
    if not isinstance(v, list):
        raise ValueError(f"Input should be a string or a list of text blocks, got {shown(v)}")
    return v


class _Type(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CacheControl(_Type):
    """Anthropic's prompt caching: asks for nothing here (the engine's prefix cache keeps every prompt's prefixes by
    itself); checked for its shape only."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class _Block(_Type):
    """What every block and tool may carry."""

    cache_control: CacheControl | None = None
    toolset_name: Annotated[None, _only("toolsets are not supported by this server: leave it out")] = None


class TextBlock(_Block):
    type: Literal["text"]
    text: StrictStr
    citations: Annotated[None, _only("citations are not supported by this server: leave them out", [])] = None

    @field_validator("text")
    @classmethod
    def _text(cls, v: str) -> str:
        if not v:
            raise ValueError("text content blocks must be non-empty")
        return v


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: Annotated[StrictStr, Field(pattern=TOOL_ID)]
    name: Annotated[StrictStr, Field(pattern=NAME.pattern)]
    input: dict[str, Any]


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: Annotated[StrictStr, Field(pattern=TOOL_ID)]
    content: Annotated[list[TextBlock], BeforeValidator(_texts)] = []
    is_error: StrictBool = False

    def text(self) -> str:
        text = "\n".join(b.text for b in self.content)
        return "Error: " + text if self.is_error else text  # the chat's tool message has no error flag


class ThinkingBlock(_Block):
    """An earlier turn's thinking: dropped from the context, as Anthropic drops it."""

    type: Literal["thinking"]
    thinking: StrictStr
    signature: StrictStr | None = None


class RedactedThinkingBlock(_Block):
    type: Literal["redacted_thinking"]
    data: StrictStr


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
                  Field(discriminator="type")]


class Message(_Type):
    role: Literal["user", "assistant"]
    content: Annotated[list[Block], BeforeValidator(_blocks)]

    @field_validator("role", mode="before")
    @classmethod
    def _role(cls, v: Any) -> Any:
        if v == "system":
            raise ValueError("Input should be 'user' or 'assistant' (the system prompt is the top-level 'system' "
                             "field)")
        return v


class Tool(_Block):
    type: Literal["custom"] = "custom"
    name: StrictStr  # its rules, and input_schema's, are the chat request's (their errors renamed)
    description: StrictStr | None = None
    input_schema: dict[str, Any]
    strict: StrictBool | None = None
    eager_input_streaming: StrictBool | None = None
    allowed_callers: Annotated[None, _only('only ["direct"] is supported by this server, which runs no code execution',
                                           ["direct"])] = None
    defer_loading: Annotated[None, _only("tool search is not supported by this server: every tool is shown to the "
                                         "model", False)] = None
    input_examples: Annotated[None, _only("not supported by this server: leave them out", [])] = None

    @field_validator("type", mode="before")
    @classmethod
    def _type(cls, v: Any) -> Any:
        if v != "custom":
            raise ValueError(f"{shown(v)} tools are not supported by this server, which runs no server tools: "
                             "define a custom tool with 'input_schema'")
        return v

    def function(self) -> dict:
        function = {"name": self.name, "parameters": self.input_schema}
        for name in ("description", "strict"):
            if getattr(self, name) is not None:
                function[name] = getattr(self, name)
        return {"type": "function", "function": function}


class ToolChoice(_Type):
    type: Literal["auto", "any", "tool", "none"]
    name: StrictStr | None = None
    disable_parallel_tool_use: StrictBool | None = None
    cache_control: CacheControl | None = None


class Metadata(_Type):
    user_id: StrictStr | None = None


class OutputFormat(_Type):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Type):
    """output_config's JSON schema (the answer is generated under it, as the chat route's response_format); `effort`
    selects how a thinking model thinks, which this model does not: taken."""

    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


class Diagnostics(_Type):
    previous_message_id: StrictStr | None = None


class MessagesRequest(_Type):
    model: Annotated[StrictStr, Field(min_length=1)]
    max_tokens: Annotated[StrictInt, Field(ge=1)]
    messages: list[Message]
    system: Annotated[list[TextBlock], BeforeValidator(_texts)] = []
    stop_sequences: list[StrictStr] = []
    temperature: Annotated[float | None, _range(0.0, 1.0)] = None
    top_p: Annotated[float | None, _range(0.0, 1.0)] = None
    top_k: Annotated[StrictInt, Field(ge=0)] = 0
    stream: StrictBool = False
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    output_config: OutputConfig | None = None
    # what cannot change this model's answer: checked for its shape, taken
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    cache_control: CacheControl | None = None
    inference_geo: StrictStr | None = None
    user_profile_id: StrictStr | None = None
    workspace_id: StrictStr | None = None
    speed: Literal["standard", "fast"] | None = None
    diagnostics: Diagnostics | None = None
    # what would change it, not served
    thinking: Annotated[None, BeforeValidator(_thinking)] = None
    mcp_servers: Annotated[None, _only("this server connects to no MCP server: leave it out", [])] = None
    container: Annotated[None, _only("not supported by this server: leave it out")] = None
    context_management: Annotated[None, _only("not supported by this server: leave it out")] = None

    @field_validator("messages")
    @classmethod
    def _messages(cls, v: list[Message]) -> list[Message]:
        if not v:
            raise ValueError("Input should be a non-empty list of messages")
        if len(v) > MAX_MESSAGES:
            raise ValueError(f"at most {MAX_MESSAGES} messages, got {len(v)}")
        return v

    @classmethod
    def parse(cls, body: dict) -> MessagesRequest:
        """The request a JSON object's value asks for (a null is the field left out); AnthropicError naming the
        first field that is wrong or not served."""
        try:
            return cls.model_validate({k: v for k, v in body.items() if v is not None})
        except ValidationError as e:
            raise AnthropicError(400, _message(e, body)) from None

    def chat(self) -> dict:
        """The chat completion request this asks for (validated by ChatCompletionRequest next, its errors renamed)."""
        chat: dict[str, Any] = {"model": self.model, "max_tokens": self.max_tokens, "stream": self.stream}
        for name in ("temperature", "top_p"):
            if getattr(self, name) is not None:
                chat[name] = getattr(self, name)
        if self.top_k:
            chat["top_k"] = self.top_k
        if self.stream:
            chat["stream_options"] = {"include_usage": True}
        if self.stop_sequences:  # the stop string kept at the text's end tells which one stopped it (Writer)
            chat["stop"] = self.stop_sequences
            if KEEPS_STOP:
                chat["include_stop_str_in_output"] = True
        parts = [{"type": "text", "text": b.text} for b in self.system]
        system = [{"role": "system", "content": parts[0]["text"] if len(parts) == 1 else parts}] if parts else []
        chat["messages"] = [*system, *self._turns()]
        if self.tools is not None:
            chat["tools"] = [t.function() for t in self.tools]
        if self.tool_choice is not None:
            chat.update(self._tool_choice())
        if self.output_config is not None and self.output_config.format is not None:
            chat["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "output", "schema": self.output_config.format.schema_}}
        return chat

    def _turns(self) -> list[dict]:
        """Anthropic's turns as chat messages: a user turn's tool_result blocks are tool messages (in order, with its
        text as a user message), an assistant turn's text and tool_use blocks one assistant message. Each tool_result
        answers a tool_use of the turn before, and each tool_use is answered in the turn after, as Anthropic
        checks."""
        out: list[dict] = []
        asked: list[str] = []  # the tool_use ids of the turn before
        for i, message in enumerate(self.messages):
            at = f"messages.{i}"
            for j, block in enumerate(message.content):
                if block.type not in ALLOWED[message.role]:
                    raise AnthropicError(400, f"{at}.content.{j}: Input should be a block of type "
                                              f"{', '.join(ALLOWED[message.role])}, got a {block.type} block")
            if message.role == "user":
                answered = _user_turn(message.content, at, out)
                missing, extra = sorted(set(asked) - answered), sorted(answered - set(asked))
                if missing:
                    raise AnthropicError(400, f"{at}: `tool_use` ids were found without `tool_result` blocks "
                                              f"immediately after: {', '.join(missing)[:200]}. Each `tool_use` block "
                                              "must have a corresponding `tool_result` block in the next message.")
                if extra:
                    raise AnthropicError(400, f"{at}.content: unexpected `tool_use_id` found in `tool_result` blocks: "
                                              f"{', '.join(extra)[:200]}. Each `tool_result` block must have a "
                                              "corresponding `tool_use` block in the previous message.")
                asked = []
            else:
                if asked:
                    raise AnthropicError(400, f"{at}: `tool_use` ids were found without `tool_result` blocks "
                                              f"immediately after: {', '.join(asked)[:200]}. Each `tool_use` block "
                                              "must have a corresponding `tool_result` block in the next message.")
                asked = _assistant_turn(message.content, at, out)
        if self.messages[-1].role == "assistant":
            raise AnthropicError(400, f"messages.{len(self.messages) - 1}: a final assistant message (a prefill the "
                                      "answer continues) is not supported by this server: end with a user message")
        return out

    def _tool_choice(self) -> dict:
        """The chat's tool_choice, and parallel_tool_calls false for disable_parallel_tool_use."""
        choice = self.tool_choice
        assert choice is not None
        tools = self.tools or []
        if choice.type in ("any", "tool") and not tools:
            raise AnthropicError(400, f"tool_choice: {choice.type} needs 'tools'")
        if choice.type == "none" and choice.disable_parallel_tool_use is not None:
            raise AnthropicError(400, "tool_choice.disable_parallel_tool_use: Extra inputs are not permitted")
        if choice.type != "tool" and choice.name is not None:
            raise AnthropicError(400, "tool_choice.name: Extra inputs are not permitted")
        if choice.type == "tool":
            if not any(t.name == choice.name for t in tools):
                raise AnthropicError(400, f"tool_choice.name: {shown(choice.name)} is not the name of one of 'tools'")
            fields: dict[str, Any] = {"tool_choice": {"type": "function", "function": {"name": choice.name}}}
        else:
            fields = {"tool_choice": {"auto": "auto", "any": "required", "none": "none"}[choice.type]}
        if choice.disable_parallel_tool_use:
            fields["parallel_tool_calls"] = False
        return fields


def _user_turn(blocks: list, at: str, out: list[dict]) -> set[str]:
    """A user turn's messages appended to `out`; the tool_use ids its tool_result blocks answer."""
    texts: list[dict] = []
    answered: set[str] = set()
    for j, block in enumerate(blocks):
        if isinstance(block, TextBlock):
            texts.append({"type": "text", "text": block.text})
            continue
        assert isinstance(block, ToolResultBlock)
        if block.tool_use_id in answered:
            raise AnthropicError(400, f"{at}.content.{j}.tool_use_id: {block.tool_use_id} is answered twice")
        answered.add(block.tool_use_id)
        if texts:  # text before a tool result stays before it
            out.append({"role": "user", "content": texts})
            texts = []
        out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text()})
    if texts:
        out.append({"role": "user", "content": texts})
    return answered


def _assistant_turn(blocks: list, at: str, out: list[dict]) -> list[str]:
    """An assistant turn as one message appended to `out`; the ids of its tool_use blocks."""
    texts: list[str] = []
    calls: list[dict] = []
    for j, block in enumerate(blocks):
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolUseBlock):
            if any(c["id"] == block.id for c in calls):
                raise AnthropicError(400, f"{at}.content.{j}.id: `tool_use` ids must be unique: {block.id} is used "
                                          "twice")
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": orjson.dumps(block.input).decode()}})
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) if texts else None}
    if calls:
        message["tool_calls"] = calls
    elif not texts:
        message["content"] = ""  # thinking alone
    out.append(message)
    return [c["id"] for c in calls]


def _message(e: ValidationError, body: Any) -> str:
    """The first validation error as Anthropic words it: the field's dotted path (a block's type, which pydantic
    puts in the path of a block's own fields, left out), then what is wrong."""
    first = e.errors(include_url=False)[0]
    loc = list(first["loc"])
    path = [p for i, p in enumerate(loc) if not (i and isinstance(loc[i - 1], int) and p in BLOCK_TYPES and
                                                 i + 1 < len(loc))]
    at = ".".join(str(p) for p in path)
    kind = first["type"]
    given = first.get("input")
    if kind in ("union_tag_invalid", "literal_error") and (kind == "union_tag_invalid" or path[-1:] == ["type"]):
        tag = (first.get("ctx") or {}).get("tag", given)
        block_at = at if kind == "union_tag_invalid" else ".".join(str(p) for p in path[:-1])
        if isinstance(tag, str) and tag in UNSERVED_BLOCKS:
            return f"{block_at}: {tag} blocks are not supported by this server: {UNSERVED_BLOCKS[tag]}"
        if kind == "union_tag_invalid":
            return f"{at}: Input should be a block of type {', '.join(sorted(BLOCK_TYPES))}, got {shown(tag)}"
    if kind in ("union_tag_not_found", "model_attributes_type") and len(path) > 1 and isinstance(path[-1], int):
        return f"{at}: Input should be a content block {{\"type\": ..., ...}}, got {shown(given)}"
    if kind in ("model_type", "dict_type"):  # pydantic names its own class here
        return f"{at}: Input should be an object, got {shown(given)}"
    message = first["msg"].removeprefix("Value error, ")
    return f"{at}: {message}" if at else message


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
