"""The decoding room's errors, typed: what a client got wrong, with the `code` a frontend maps to its protocol's
(OpenAI's error code, an HTTP status). A Triton error is text, so they cross into the gateway as their message; a
type that carries figures reads itself back from that text (`ContextTooLong.read`): the wording and its reading
live here together, never in a frontend."""

from __future__ import annotations

import re


class DecodingError(ValueError):
    """A request the decoder cannot run as asked (the message names the parameter and the accepted values)."""

    code = "invalid_request"


class SamplingError(DecodingError):
    """A parameter the client got wrong (the message names it and the accepted values)."""

    code = "invalid_parameter"


class GrammarError(DecodingError):
    """The client's grammar cannot be used (the message names the part and what to do)."""

    code = "invalid_grammar"


class ContextTooLong(SamplingError):
    """The prompt and the tokens asked for do not fit the model's positions."""

    code = "context_length_exceeded"
    _WORDS = re.compile(r"prompt \((\d+) tokens\) \+ max_new_tokens \((\d+)\) exceed the model's (\d+) positions")

    def __init__(self, prompt: int, new: int, positions: int, advice: str):
        super().__init__(f"prompt ({prompt} tokens) + max_new_tokens ({new}) exceed the model's {positions} "
                         f"positions: {advice}")
        self.prompt, self.new, self.positions = prompt, new, positions

    @classmethod
    def read(cls, message: str) -> ContextTooLong | None:
        """The error a message says, when it is this one's (as Triton passed it on)."""
        m = cls._WORDS.match(message)
        if m is None:
            return None
        prompt, new, positions = (int(g) for g in m.groups())
        return cls(prompt, new, positions, message[m.end():].lstrip(": "))


class AdapterError(DecodingError):
    """A LoRA adapter the server cannot load as asked (the message names the reason)."""

    code = "invalid_adapter"


class UnknownAdapter(DecodingError):
    """A request names an adapter that is not loaded (OpenAI's 404 model_not_found)."""

    code = "model_not_found"
    _WORDS = re.compile(r"adapter '([A-Za-z0-9._-]{1,64})' is not loaded")

    def __init__(self, name: str, loaded: list[str], said: str | None = None):
        super().__init__(said or f"adapter '{name}' is not loaded: the loaded ones are {', '.join(loaded) or 'none'}")
        self.name = name

    @classmethod
    def read(cls, message: str) -> UnknownAdapter | None:
        """The error a message says, when it is this one's (as Triton passed it on)."""
        m = cls._WORDS.match(message)
        return None if m is None else cls(m[1], [], message)
