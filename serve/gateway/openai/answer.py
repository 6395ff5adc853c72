"""The typed answer of the chat machinery (routes.py), which every frontend reads: the completion whole (`Whole`),
or a stream of events (`Streamed`: `Delta` per choice's new output, `Usage` once at the end when asked, `Failed`
when it ends in an error). The OpenAI routes write them as OpenAI's JSON and server-sent events; the Anthropic
Messages and Responses frontends write their own from the same events, without reading OpenAI's wire format back.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from dstool.serve.gateway.openai.protocol import OpenAIError


@dataclass(frozen=True, slots=True)
class CallDelta:
    """A tool call's next part: its first carries its id and name, the rest more of its arguments' text."""

    index: int  # the call's place among the choice's calls
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    def chat(self) -> dict:
        """As a chat chunk's `tool_calls` entry."""
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True, slots=True)
class Delta:
    """One choice's new output: the role it starts with, text, thinking, tool-call parts, the logprobs of its tokens
    (in the route's shape) and, last, its finish reason."""

    index: int
    content: str | None = None
    reasoning: str | None = None
    calls: tuple[CallDelta, ...] = ()
    logprobs: dict | None = None
    finish_reason: str | None = None
    role: bool = False


@dataclass(frozen=True, slots=True)
class Usage:
    """The tokens of the whole answer (OpenAI's usage object), after every choice has finished."""

    usage: dict


@dataclass(frozen=True, slots=True)
class Failed:
    """The error that ended a stream after its first event."""

    error: OpenAIError


Event = Delta | Usage | Failed


@dataclass
class Whole:
    """An answer sent whole: the completion (OpenAI's chat.completion or text_completion object) and its headers."""

    completion: dict
    headers: list[tuple[str, str]]


@dataclass
class Streamed:
    """An answer streamed: its events as the choices make them, its headers, and `close` (called once, however it
    ends: it stops the choices); `head` is the identity OpenAI's chunks repeat (id, object, created, model)."""

    events: AsyncIterator[Event]
    headers: list[tuple[str, str]]
    close: Callable[[], None]
    head: dict


Answer = Whole | Streamed
