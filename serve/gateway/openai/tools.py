"""Tool calling on /v1/chat/completions, as OpenAI and vLLM serve it: the request's `tools` (functions with JSON
schemas) and `tool_choice`, the grammar that makes a forced call's arguments follow its schema, and the model's text
read back as tool calls — whole, or as a stream's deltas.

What the model writes for each `tool_choice` (vLLM's choices):
- a named function: the call's arguments alone, JSON under the function's `parameters` schema;
- `required`: a JSON array of calls `[{"name": ..., "arguments": {...}}]` (one call when `parallel_tool_calls` is
  false), each under its function's schema;
- `auto`: free text, in which each `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` naming a known tool, its
  arguments a JSON object, is a call (the Hermes format that chat templates with tools use, and the one the default
  layout asks for); anything else there stays text, as vLLM's Hermes parser leaves it;
- `none`: text only (the tools are still shown to the model, as OpenAI does).

A function's `parameters` is the schema of an object (a call's arguments are one); none, or `{}`, is OpenAI's
function of no arguments: `{}`.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field

import orjson

NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_TOOLS = 128
# a call of `required` cut short: {"name": "NAME", "arguments": ... (the grammar writes the keys in this order)
PARTIAL_CALL = re.compile(r'\{\s*"name"\s*:\s*"(?P<name>[a-zA-Z0-9_-]{1,64})"\s*'
                          r'(?:,\s*"arguments"\s*:\s*(?P<arguments>.*))?', re.DOTALL)


class ToolError(ValueError):
    """A mistake in the request's tools (`param` the field, as OpenAI names it)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: dict

    def wire(self) -> dict:
        """As a chat template (and the default layout) shows it to the model: OpenAI's tool object."""
        function: dict = {"name": self.name, "parameters": self.parameters}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}


def read_tools(value) -> list[Tool]:
    """The request's `tools`, checked: function tools with unique names and parameters schemas (compiled by the
    request's check_grammars); an empty list is no tools (openai-agents sends one). ToolError naming the first
    mistake."""
    if not isinstance(value, list) or len(value) > MAX_TOOLS:
        raise ToolError(f"'tools' must be a list of at most {MAX_TOOLS} function tools", "tools")
    tools: list[Tool] = []
    for i, t in enumerate(value):
        at = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict) or \
                set(t) - {"type", "function"}:
            raise ToolError(f"'{at}' must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                            "\"parameters\": {...}}}}: this server serves function tools", at)
        f = t["function"]
        unknown = sorted(set(f) - {"name", "description", "parameters", "strict"})
        if unknown:
            raise ToolError(f"Unrecognized request argument supplied: {at}.function.{unknown[0]}",
                            f"{at}.function.{unknown[0]}")
        name = f.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise ToolError(f"'{at}.function.name' must be 1-64 letters, digits, '_' or '-'", f"{at}.function.name")
        if any(name == other.name for other in tools):
            raise ToolError(f"'{at}.function.name': two tools are named {name!r}", f"{at}.function.name")
        description = f.get("description")
        if description is not None and not isinstance(description, str):
            raise ToolError(f"'{at}.function.description' must be a string", f"{at}.function.description")
        if "strict" in f and not isinstance(f["strict"], bool):
            raise ToolError(f"'{at}.function.strict' must be true or false", f"{at}.function.strict")
        parameters = f.get("parameters")
        if parameters is None or parameters == {}:  # OpenAI's function of no arguments: an empty object
            parameters = {"type": "object", "properties": {}}
        if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
            raise ToolError(f"'{at}.function.parameters' must be a JSON schema of an object ({{\"type\": "
                            "\"object\", ...}): a call's arguments are a JSON object", f"{at}.function.parameters")
        tools.append(Tool(name, description, {"type": "object", **parameters}))
    return tools


def read_choice(value, tools: list[Tool]) -> str:
    """`tool_choice` as "none", "auto", "required" or the name of the function to call. ToolError for a mistake."""
    if value is None:
        return "auto" if tools else "none"
    if isinstance(value, str):
        if value not in ("none", "auto", "required"):
            raise ToolError(f"'tool_choice' must be none, auto, required or {{\"type\": \"function\", \"function\": "
                            f"{{\"name\": ...}}}}, got {value!r}", "tool_choice")
        if value == "required" and not tools:
            raise ToolError("'tool_choice' 'required' needs 'tools'", "tool_choice")
        return value if tools else "none"  # auto with no tools to call is text
    name = value.get("function", {}).get("name") if isinstance(value, dict) and value.get("type") == "function" \
        and isinstance(value.get("function"), dict) else None
    if not isinstance(name, str):
        raise ToolError("'tool_choice' must be none, auto, required or {\"type\": \"function\", \"function\": "
                        "{\"name\": ...}}", "tool_choice")
    if not any(t.name == name for t in tools):
        raise ToolError(f"'tool_choice' names {name[:64]!r}, which is not one of 'tools'", "tool_choice")
    return name


def call_schema(tool: Tool) -> dict:
    return {"type": "object", "properties": {"name": {"const": tool.name}, "arguments": tool.parameters},
            "required": ["name", "arguments"], "additionalProperties": False}


def grammar(tools: list[Tool], choice: str, parallel: bool) -> dict | None:
    """The structured_outputs spec the answer must follow for this tool_choice (None: free text). Under `required`
    each tool's parameters schema sits in the array's `$defs` under its own name, its local `$ref`s (`#/$defs/A`,
    `#/definitions/A`, `#`) rebased there: they resolve as in the tool's own schema, and two tools may each have
    their own `A`."""
    if choice in ("none", "auto"):
        return None
    if choice != "required":
        return {"json": next(t for t in tools if t.name == choice).parameters}
    defs = {f"tool-{t.name}": rebased(t.parameters, f"#/$defs/tool-{t.name}") for t in tools}
    calls = [call_schema(Tool(t.name, t.description, {"$ref": f"#/$defs/tool-{t.name}"})) for t in tools]
    item = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return {"json": {"type": "array", "items": item, "minItems": 1, **({} if parallel else {"maxItems": 1}),
                     "$defs": defs}}


VALUES = frozenset({"const", "enum", "default", "examples"})  # keywords whose contents are data, not schemas


def rebased(schema: dict, root: str) -> dict:
    """A copy of `schema` whose `$ref`s into itself (`#...`) point at `root` instead (iteratively: any depth)."""
    top: dict = {}
    stack: list[tuple[dict | list, dict | list]] = [(schema, top)]
    while stack:
        source, target = stack.pop()
        items = source.items() if isinstance(source, dict) else enumerate(source)
        for key, value in items:
            if key == "$ref" and isinstance(value, str) and value.startswith("#") and isinstance(source, dict):
                value = root + value[1:]
            elif isinstance(value, (dict, list)) and not (isinstance(source, dict) and key in VALUES):
                copy: dict | list = {} if isinstance(value, dict) else [None] * len(value)
                stack.append((value, copy))
                value = copy
            target[key] = value
    return top


@dataclass
class Call:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def whole(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class Calls:
    """One choice's text read as tool calls for its tool_choice (`mode`: "auto", "required" or a function's name;
    with `parallel` false, auto reads one call at most, as the grammar of required makes one), piece by piece as it
    is generated: `feed` returns (text for `content`, calls complete so far, arguments text
    for the named call); `end` reads what is left."""

    def __init__(self, tools: list[Tool], mode: str, parallel: bool = True):
        self.names = {t.name for t in tools}
        self.mode, self.parallel = mode, parallel
        self.calls: list[Call] = []
        self.buffer = ""
        self.depth, self.in_string, self.escaped, self.start = 0, False, False, -1
        self.announced = False  # a stream has sent the named call's id and name
        if mode not in ("auto", "required"):
            self.calls.append(Call(mode, ""))

    def feed(self, text: str) -> tuple[str, list[Call], str]:
        if self.mode == "required":
            return "", self._scan(text), ""
        if self.mode != "auto":
            self.calls[0].arguments += text
            return "", [], text
        self.buffer += text
        content, found = "", list[Call]()
        while True:
            at = self.buffer.find(OPEN)
            if at < 0:
                keep = _partial_suffix(self.buffer, OPEN)
                content += self.buffer[:len(self.buffer) - keep]
                self.buffer = self.buffer[len(self.buffer) - keep:]
                break
            end = self.buffer.find(CLOSE, at)
            if end < 0:
                content += self.buffer[:at]
                self.buffer = self.buffer[at:]
                break
            call = self._read(self.buffer[at + len(OPEN):end])
            if call is None or not self.parallel and (self.calls or found):  # not a call (of a known tool, or one
                # more than parallel_tool_calls false allows): it stays text
                content += self.buffer[:end + len(CLOSE)]
            else:
                content += self.buffer[:at]
                found.append(call)
            self.buffer = self.buffer[end + len(CLOSE):]
        self.calls += found
        return content, found, ""

    def cut(self) -> Call | None:
        """The call `required` had begun when the answer was cut short (max_tokens): its name and the arguments
        written so far, as OpenAI returns a call cut by the limit; None when none had begun or its name had not."""
        if self.mode != "required" or self.start < 0:
            return None
        begun = PARTIAL_CALL.match(self.buffer[self.start:])
        if begun is None or begun["name"] not in self.names:
            return None
        call = Call(begun["name"], begun["arguments"] or "")
        self.calls.append(call)
        self.buffer, self.start = "", -1
        return call

    def end(self) -> str:
        """What is left as content (an unfinished `<tool_call>` of auto stays text)."""
        if self.mode != "auto":
            return ""  # what `required` had begun stays for `cut`
        rest, self.buffer = self.buffer, ""
        return rest

    def _read(self, text: str) -> Call | None:
        """The call `text` holds: a known tool's name and its arguments, a JSON object (or the JSON text of one, as
        OpenAI writes them); None for anything else."""
        try:
            d = orjson.loads(text)
            name, arguments = d["name"], d["arguments"]
            if isinstance(arguments, str):
                arguments = orjson.loads(arguments)
        except (orjson.JSONDecodeError, TypeError, KeyError):
            return None
        if not isinstance(name, str) or name not in self.names or not isinstance(arguments, dict):
            return None
        return Call(name, d["arguments"] if isinstance(d["arguments"], str) else orjson.dumps(arguments).decode())

    def _scan(self, text: str) -> list[Call]:
        """`required`'s array: each element complete so far (the grammar makes the text JSON)."""
        found = []
        for ch in text:
            self.buffer += ch
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                continue
            if ch == '"':
                self.in_string, self.escaped = True, False
            elif ch in "[{":
                self.depth += 1
                if self.depth == 2:
                    self.start = len(self.buffer) - 1
            elif ch in "]}":
                self.depth -= 1
                if self.depth == 1 and self.start >= 0:
                    call = self._read(self.buffer[self.start:])
                    self.buffer, self.start = "", -1
                    if call is not None:
                        found.append(call)
        self.calls += found
        return found


def _partial_suffix(text: str, marker: str) -> int:
    """Characters at the end of `text` that could begin `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
