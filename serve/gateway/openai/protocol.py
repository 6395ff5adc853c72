"""The OpenAI API's request bodies as types (as vLLM's protocol module): a request validates itself — a value of
the wrong type or out of range, a field OpenAI does not define, or one this server does not serve yet is an
OpenAIError naming it, in OpenAI's error shape — and turns itself into the generate request its model's NAME_llm
takes. Sampling values are checked by the engine's own rule (sampling.SamplingParams), before anything goes
upstream. A null is the field left out (as OpenAI reads it). Fields that cannot change this model's answer (`user`,
`metadata`, `store`, routing and bookkeeping fields, `reasoning_effort` on a model without a thinking mode, no-op
values) are taken and not used, logged once at debug level; a value that would change the answer and is not served
is refused by name."""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Any, ClassVar, Literal, TypeVar

import orjson
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    InstanceOf,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from dstool.decoding import grammar
from dstool.decoding.grammar import GrammarError
from dstool.decoding.sampling import MAX_LOGPROBS, SEEDS, SamplingError, SamplingParams, shown
from dstool.serve.gateway.core import addressable
from dstool.serve.gateway.openai import tools as tooling

MAX_N = 16  # choices per request
MAX_PROMPTS = 64  # prompts in one /v1/completions batch
MAX_CHOICES = 256  # choices of one /v1/completions request: prompts x n
MAX_PROMPT_IDS = 65536  # token ids in one prompt (the model's positions bound it further)
MAX_GRAMMAR_BYTES = 2 * grammar.MAX_SPEC_BYTES  # one request's schemas and grammars (tools' included), in all
MAX_SALT_BYTES = 1024  # a cache_salt (NAME_llm's bound)
MAX_STOP_CHARS = 256  # a stop string (NAME_llm's bound)
MAX_BIASED = 300  # logit_bias entries (OpenAI's limit)
MAX_STOP_IDS = 64  # stop_token_ids entries
MAX_TEMPLATE_KWARGS_BYTES = 4096  # chat_template_kwargs as JSON
MAX_TOKEN_ID = 2**31 - 1
GRAMMAR_SUBJECT = re.compile(r"^structured_outputs(\.\w+)?")  # how the grammar engine names what it was given
MAX_TOKENS = 2**31 - 1  # max_new_tokens is an INT32 input
SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
            "seed")
# structured outputs as vLLM names them: its older guided_* fields, and each one's structured_outputs kind
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def body(self) -> bytes:
        return orjson.dumps({"error": {"message": self.message, "type": self.kind, "param": self.param,
                                       "code": self.code}})


def _integer(name: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"'{name}' must be an integer from {low} to {high}, got {shown(value)}")
    return value


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"'{name}' must be true or false, got {shown(value)}")
    return value


log = logging.getLogger("dstool.gateway")
_NOTED: set[str] = set()


def _noted(name: str) -> None:
    """A field taken that cannot change this model's answer: said once, at debug level."""
    if name not in _NOTED:
        _NOTED.add(name)
        log.debug("gateway: '%s' is accepted and cannot change this model's answers", name)


def _unset_nulls(data: Any) -> Any:
    """A request object with its null fields left out: OpenAI reads a null as the field not sent."""
    return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


def unserved(name: str, value: Any, *asks_nothing: Any) -> None:
    """A field this server does not serve yet: taken only with a value that asks for nothing."""
    if value is not None and not any(value == a and type(value) is type(a) for a in asks_nothing):
        raise ValueError(f"'{name}' is not supported by this server (got {shown(value)}): leave it out")


class Stops(list):
    """`stop`'s strings. `grammar`: the answer is under a grammar (a structured output or a forced tool call), so
    one of them coming in it cuts it short: openai.Choice makes its finish reason `length`, as max_tokens would."""

    grammar = False


ToolChoice = Literal["none", "auto", "required"] | dict[str, Any]  # a dict names a function: tools.read_choice


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class _Request(BaseModel):
    """What completions and chat completions share."""

    model_config = ConfigDict(extra="forbid", strict=True, validate_default=True)

    model: str
    max_tokens: int | None = None
    n: int = 1
    stop: InstanceOf[Stops] = Field(default_factory=Stops)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # vLLM's
    # types here, ranges by the engine's own rule (SamplingParams.from_parameters, in _together)
    temperature: float | None = 1.0  # OpenAI's default
    top_p: float | None = None
    top_k: int | None = None  # vLLM's, as are min_p and repetition_penalty
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    logit_bias: dict[str, float] | None = None
    # structured outputs: OpenAI's way, vLLM's guided_* fields, or structured_outputs (their contents: _grammar)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None  # a schema, or the schema as JSON text
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    cache_salt: str | None = None  # vLLM's: prefixes computed for requests of another salt are not reused
    min_tokens: int | None = None  # vLLM's, as are the three below
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    _structured: dict | None = PrivateAttr(default=None)  # the grammar asked for, as NAME_llm takes it
    _structured_param: str = PrivateAttr(default="")  # the field it came from
    # taken, not used: they do not change the answer
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _nulls(cls, data: Any) -> Any:
        return _unset_nulls(data)

    @field_validator("model", mode="before")
    @classmethod
    def _model(cls, v: Any) -> str:
        if not isinstance(v, str) or not v:
            raise ValueError("'model' is required: a model family's name (GET /v1/models lists them)")
        if not addressable(v + "_llm"):
            raise ValueError(f"'model' {shown(v)} is not a model name: at most 251 bytes, without spaces, control "
                             "characters, '/', '?' or '#' (GET /v1/models lists the served ones)")
        return v

    @field_validator("max_tokens", mode="before")
    @classmethod
    def _max_tokens(cls, v: Any) -> int | None:
        if v is not None:
            _integer("max_tokens", v, 1, MAX_TOKENS)
        return v

    @field_validator("n", mode="before")
    @classmethod
    def _n(cls, v: Any) -> int:
        return _integer("n", v, 1, MAX_N)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v: Any) -> Stops:
        stops = [v] if isinstance(v, str) else v if v is not None else []
        if not isinstance(stops, list) or len(stops) > 4 or \
                not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops):
            raise ValueError(f"'stop' must be a string or a list of up to 4 strings of 1-{MAX_STOP_CHARS} characters")
        return Stops(stops)

    @field_validator("cache_salt", mode="before")
    @classmethod
    def _cache_salt(cls, v: Any) -> str | None:
        if v is not None and (not isinstance(v, str) or not 0 < len(v.encode()) <= MAX_SALT_BYTES):
            raise ValueError(f"'cache_salt' must be a non-empty string of at most {MAX_SALT_BYTES} bytes")
        return v

    @field_validator("stream", "ignore_eos", "include_stop_str_in_output", "skip_special_tokens", mode="before")
    @classmethod
    def _flags(cls, v: Any, info) -> bool:
        return _flag(info.field_name, v)

    @field_validator("stream_options", mode="before")
    @classmethod
    def _stream_options(cls, v: Any) -> StreamOptions | None:
        if v is None:
            return None
        try:
            return StreamOptions.model_validate(v)
        except ValidationError:
            raise ValueError('\'stream_options\' must be {"include_usage": true or false}, got '
                             f"{shown(v)}") from None

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _logit_bias(cls, v: Any) -> dict[str, float] | None:
        """Token id (as a string, as JSON keys are) -> a bias from -100 to 100 added to its logit."""
        if v is None or v == {}:
            return None
        if not isinstance(v, dict) or len(v) > MAX_BIASED or not all(
                isinstance(k, str) and k.isdigit() and len(k) <= 10 and int(k) <= MAX_TOKEN_ID and
                isinstance(b, (int, float)) and not isinstance(b, bool) and -100 <= b <= 100 for k, b in v.items()):
            raise ValueError(f"'logit_bias' must map at most {MAX_BIASED} token ids (\"50256\") to numbers from -100 "
                             f"to 100, got {shown(v)}")
        return {str(int(k)): float(b) for k, b in v.items()}

    @field_validator("min_tokens", mode="before")
    @classmethod
    def _min_tokens(cls, v: Any) -> int | None:
        return None if v is None or v == 0 else _integer("min_tokens", v, 0, MAX_TOKENS)

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _stop_token_ids(cls, v: Any) -> list[int] | None:
        if v is None or v == []:
            return None
        if not isinstance(v, list) or len(v) > MAX_STOP_IDS or not all(
                isinstance(i, int) and not isinstance(i, bool) and 0 <= i <= MAX_TOKEN_ID for i in v):
            raise ValueError(f"'stop_token_ids' must be a list of at most {MAX_STOP_IDS} token ids, got {shown(v)}")
        return v

    @field_validator("user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier",
                     mode="after")
    @classmethod
    def _bookkeeping(cls, v: Any, info) -> Any:
        if v is not None:
            _noted(info.field_name)
        return v

    @model_validator(mode="after")
    def _grammar(self):
        """The one structured output asked for, compiled here (a schema the engine cannot use is a 400 naming the
        field), as NAME_llm's structured_outputs."""
        asked = [(name, getattr(self, name)) for name in ("response_format", "structured_outputs", *GUIDED)
                 if getattr(self, name) is not None]
        asked = [(name, value) for name, value in asked if not (name == "response_format" and value ==
                                                                {"type": "text"})]
        if len(asked) > 1:
            raise OpenAIError(400, f"ask for one structured output: '{asked[0][0]}' and '{asked[1][0]}' were both "
                                   "given", asked[1][0])
        if asked:
            self._structured, self._structured_param = self._structured_spec(*asked[0])
            self.stop.grammar = True
        return self

    async def check_grammars(self) -> None:
        """Every grammar of the request bounded and compiled (the answer's, each tool's schema) on the grammar
        engine's own threads (grammar.COMPILER), each once (kept by content): OpenAIError (400) naming the field of
        one the engine cannot use or that is over its bounds."""
        pending, total = [], 0
        for spec, param in self._grammars():
            try:
                pending.append((grammar.check(spec), param))
                total += len(orjson.dumps(spec))
            except GrammarError as e:
                raise _grammar_error(e, param) from None
            if total > MAX_GRAMMAR_BYTES:
                raise OpenAIError(400, f"the request's schemas and grammars are over {MAX_GRAMMAR_BYTES} bytes in "
                                       "all: send fewer or smaller ones", param)
        for future, param in pending:
            try:
                await asyncio.wrap_future(future)
            except GrammarError as e:
                raise _grammar_error(e, param) from None

    def _grammars(self) -> list[tuple[dict, str]]:
        return [(self._structured, self._structured_param)] if self._structured is not None else []

    @staticmethod
    def _structured_spec(name: str, value: Any) -> tuple[dict, str]:
        """(NAME_llm's structured_outputs, the field a mistake in it concerns)."""
        if name in GUIDED:
            return {GUIDED[name]: value}, name
        if name == "structured_outputs":
            if not isinstance(value, dict) or len(value) != 1:
                raise OpenAIError(400, "'structured_outputs' must be an object with one of json, json_object, regex, "
                                       "choice, grammar", name)
            kind = next(iter(value))
            return value, f"structured_outputs.{kind}"
        kind = value.get("type") if isinstance(value, dict) else None
        if kind == "json_object" and set(value) == {"type"}:
            return {"json_object": True}, name
        if kind == "json_schema" and set(value) == {"type", "json_schema"} and isinstance(value["json_schema"], dict):
            js = value["json_schema"]
            unknown = sorted(set(js) - {"name", "schema", "strict", "description"})
            if unknown:
                raise OpenAIError(400, f"Unrecognized request argument supplied: response_format.json_schema."
                                       f"{unknown[0]}", f"response_format.json_schema.{unknown[0]}")
            if not isinstance(js.get("name"), str) or not tooling.NAME.fullmatch(js["name"]):
                raise OpenAIError(400, "'response_format.json_schema.name' is required: 1-64 letters, digits, '_' or "
                                       "'-'", "response_format.json_schema.name")
            if "strict" in js and not isinstance(js["strict"], bool) and js["strict"] is not None:
                raise OpenAIError(400, "'response_format.json_schema.strict' must be true or false",
                                  "response_format.json_schema.strict")
            schema = js.get("schema", {})
            if not isinstance(schema, dict):
                raise OpenAIError(400, "'response_format.json_schema.schema' must be a JSON schema (an object)",
                                  "response_format.json_schema.schema")
            return {"json": schema}, "response_format.json_schema.schema"
        raise OpenAIError(400, "'response_format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                               "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}}, "
                               f"got {shown(value)}", name)

    @model_validator(mode="after")
    def _together(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("'stream_options' is only allowed with 'stream': true")
        if self.min_tokens is not None and self.max_new_tokens is not None and self.min_tokens > self.max_new_tokens:
            raise ValueError(f"'min_tokens' ({self.min_tokens}) must not exceed 'max_tokens' ({self.max_new_tokens})")
        params = {k: getattr(self, k) for k in SAMPLING if getattr(self, k) is not None}
        try:
            SamplingParams.from_parameters(params)  # the engine's own rule, before anything goes upstream
        except SamplingError as e:
            raise ValueError(str(e)) from None
        return self

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_tokens

    def fields(self, choice: int) -> dict:
        """The generate_stream request of choice `choice` (with a seed, choice i uses seed + i, wrapping)."""
        fields: dict[str, Any] = {**self.prompt_fields(), "stream": True}
        if self.max_new_tokens is not None:
            fields["max_new_tokens"] = self.max_new_tokens
        fields.update({k: getattr(self, k) for k in SAMPLING if getattr(self, k) is not None})
        if self.seed is not None:
            fields["seed"] = (self.seed + choice) % SEEDS
        if self.ignore_eos:
            fields["ignore_eos"] = True
        if self.cache_salt is not None:
            fields["cache_salt"] = self.cache_salt
        if self.logit_bias:
            fields["logit_bias"] = orjson.dumps(self.logit_bias).decode()
        if self.min_tokens:
            fields["min_tokens"] = self.min_tokens
        if self.stop_token_ids:
            fields["stop_token_ids"] = self.stop_token_ids
        if not self.skip_special_tokens:
            fields["skip_special_tokens"] = False
        if self.stop:  # the engine stops as soon as one comes (the text is cut here)
            fields["stop"] = orjson.dumps(self.stop).decode()
        if self.top_logprobs_asked is not None:
            fields["logprobs"] = self.top_logprobs_asked
        if self.structured is not None:
            fields["structured_outputs"] = orjson.dumps(self.structured).decode()
        return fields

    @property
    def structured(self) -> dict | None:
        """The grammar the answer must follow (NAME_llm's structured_outputs), or None."""
        return self._structured

    @property
    def structured_param(self) -> str | None:
        """The field the answer's grammar came from (`tools` for a forced call), or None."""
        return self._structured_param if self._structured is not None else None

    def prompt_fields(self) -> dict:
        raise NotImplementedError

    def prompt_bytes(self) -> int:
        """The bytes of text the prompt is made of (what a tenant's reservation estimates its tokens from)."""
        raise NotImplementedError

    @property
    def top_logprobs_asked(self) -> int | None:
        raise NotImplementedError


class CompletionRequest(_Request):
    """POST /v1/completions. `prompt` is a string, a list of token ids, or a batch: a list of strings or of lists of
    token ids (at most MAX_PROMPTS; each prompt's `n` choices, indexed prompt by prompt: prompt i's choice j is
    choice i * n + j, as OpenAI and vLLM index them). Token ids go to the model as they are (it checks them against
    its vocabulary). `echo` puts the prompt's text before each choice's (with `logprobs`, the prompt's tokens'
    log-probabilities before the answer's, the first one null); with `echo`, `max_tokens` 0 asks for the prompt's
    alone (as vLLM: lm-evaluation-harness scores prompts so)."""

    prompt: list[str | list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: None = None  # taken with a value that asks for nothing ("", 1, false), else refused
    best_of: None = None
    _echo_only: bool = PrivateAttr(default=False)  # echo with max_tokens 0: no answer, the prompt alone

    @model_validator(mode="wrap")
    @classmethod
    def _echo_alone(cls, data: Any, handler):
        """`max_tokens` 0 with `echo` (vLLM's rule): one token is computed (the prompt's logits are those of a
        generation step) and not shown."""
        alone = isinstance(data, dict) and data.get("echo") is True and type(data.get("max_tokens")) is int and \
            data["max_tokens"] == 0
        request = handler({**data, "max_tokens": 1} if alone else data)
        request._echo_only = alone
        return request

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, v: Any) -> list[str | list[int]]:
        """The batch of prompts: each a string or a list of token ids."""
        if isinstance(v, str):
            return [v]
        if not isinstance(v, list) or not v:
            raise ValueError("'prompt' must be a string, a list of token ids, or a list of (at most "
                             f"{MAX_PROMPTS}) strings or lists of token ids, got {shown(v)}")
        if all(_is_id(x) for x in v):
            return [_token_ids("prompt", v)]
        if len(v) > MAX_PROMPTS:
            raise ValueError(f"'prompt' holds {len(v)} prompts: send at most {MAX_PROMPTS} a request")
        prompts: list[str | list[int]] = []
        for i, x in enumerate(v):
            if isinstance(x, str):
                prompts.append(x)
            elif isinstance(x, list) and x and all(_is_id(t) for t in x):
                prompts.append(_token_ids(f"prompt[{i}]", x))
            else:
                raise ValueError(f"'prompt[{i}]' must be a string or a non-empty list of token ids (integers), got "
                                 f"{shown(x)}: a batch is a list of strings or of lists of token ids")
            if type(prompts[-1]) is not type(prompts[0]):
                raise ValueError(f"'prompt[{i}]': a batch is a list of strings or a list of lists of token ids, "
                                 "not both")
        if sum(len(x) if isinstance(x, list) else len(x.encode()) // 4 for x in prompts) > MAX_PROMPT_IDS * 4:
            raise ValueError(f"'prompt': the batch is over {MAX_PROMPT_IDS * 4} tokens in all: send fewer prompts")
        return prompts

    @field_validator("logprobs", mode="before")
    @classmethod
    def _logprobs(cls, v: Any) -> int | None:
        return None if v is None else _integer("logprobs", v, 0, MAX_LOGPROBS)

    @field_validator("echo", mode="before")
    @classmethod
    def _echo(cls, v: Any) -> bool:
        return _flag("echo", v)

    @field_validator("suffix", "best_of", mode="before")
    @classmethod
    def _unserved(cls, v: Any, info) -> None:
        unserved(info.field_name, v, False, "", 1)

    @model_validator(mode="after")
    def _batch(self):
        if len(self.prompt) * self.n > MAX_CHOICES:
            raise OpenAIError(400, f"{len(self.prompt)} prompts x n={self.n} is {len(self.prompt) * self.n} "
                                   f"choices: at most {MAX_CHOICES} a request; send fewer prompts", "prompt")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        return self.prompt

    @property
    def echo_only(self) -> bool:
        """`echo` with `max_tokens` 0: the prompt alone, no answer."""
        return self._echo_only

    def fields(self, choice: int) -> dict:
        """Choice i * n + j: prompt i's choice j (with a seed, seed + j, as a request of prompt i alone)."""
        prompt, j = divmod(choice, self.n)
        fields = super().fields(j)
        fields.pop("text_input", None)
        fields.pop("input_ids", None)
        fields.update(self.prompt_fields(prompt))
        if self.echo:
            fields["echo"] = True
            if self.logprobs is not None:  # the prompt's tokens' log-probabilities too (vLLM's prompt_logprobs)
                fields["prompt_logprobs"] = self.logprobs
        return fields

    def prompt_fields(self, prompt: int = 0) -> dict:
        given = self.prompt[prompt]
        return {"text_input": given} if isinstance(given, str) else {"input_ids": given}

    def prompt_bytes(self) -> int:
        """Every prompt's (a token id counted as 4 bytes, a token as estimated_tokens reads them)."""
        return sum(4 * len(p) if isinstance(p, list) else len(p.encode()) for p in self.prompt)

    @property
    def top_logprobs_asked(self) -> int | None:
        return self.logprobs


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _token_ids(name: str, ids: list) -> list[int]:
    """A prompt of token ids, each an integer 0-MAX_TOKEN_ID (the model checks its vocabulary), at most
    MAX_PROMPT_IDS."""
    if len(ids) > MAX_PROMPT_IDS:
        raise ValueError(f"'{name}' holds {len(ids)} token ids: at most {MAX_PROMPT_IDS}")
    bad = next((i for i, t in enumerate(ids) if not 0 <= t <= MAX_TOKEN_ID), None)
    if bad is not None:
        raise ValueError(f"'{name}[{bad}]' is {shown(ids[bad])}: a token id is an integer from 0 to {MAX_TOKEN_ID}")
    return ids


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    ROLES: ClassVar[tuple[str, ...]] = ("system", "developer", "user", "assistant", "tool")

    role: str
    content: str | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message's answer to a call
    reasoning_content: str | None = None  # an assistant's thinking, as a reasoning parser returned it (vLLM's)
    reasoning: str | None = None  # vLLM's newer name for it
    refusal: str | None = None  # an assistant's refusal, fed back: its text
    annotations: None = None  # an assistant's citations: bookkeeping, checked and dropped
    audio: None = None  # refused
    function_call: None = None  # refused

    @model_validator(mode="before")
    @classmethod
    def _nulls(cls, data: Any) -> Any:
        """An answer's message fed back as it came (`message.model_dump()`: refusal, annotations, audio,
        function_call as null) is a message."""
        return _unset_nulls(data)

    @field_validator("reasoning_content", "reasoning", "refusal", mode="before")
    @classmethod
    def _texts(cls, v: Any, info) -> str | None:
        if v is not None and not isinstance(v, str):
            raise ValueError(f"'{info.field_name}' must be text, got {shown(v)}")
        return v

    @field_validator("annotations", mode="before")
    @classmethod
    def _annotations(cls, v: Any) -> None:
        if not isinstance(v, list):
            raise ValueError(f"'annotations' must be a list, got {shown(v)}")

    @field_validator("audio", "function_call", mode="before")
    @classmethod
    def _not_served(cls, v: Any, info) -> None:
        why = "this server serves text only" if info.field_name == "audio" else \
            "OpenAI's deprecated form: send 'tool_calls'"
        raise ValueError(f"'{info.field_name}' in a message: {why}")

    @field_validator("role", mode="before")
    @classmethod
    def _role(cls, v: Any) -> str:
        if v not in cls.ROLES:
            raise ValueError(f"'role' must be one of {', '.join(cls.ROLES)}, got {shown(v)}")
        return v

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, v: Any) -> str | None:
        """Text, or a list of text parts (joined by newlines, as vLLM joins them); None only beside tool_calls."""
        if v is None or isinstance(v, str):
            return v
        if isinstance(v, list) and v and all(isinstance(p, dict) and p.get("type") == "text" and set(p) ==
                                             {"type", "text"} and isinstance(p["text"], str) for p in v):
            return "\n".join(p["text"] for p in v)
        raise ValueError("'content' must be text or a list of text parts ({\"type\": \"text\", \"text\": ...}): "
                         "this server serves text only")

    @field_validator("name", "tool_call_id", mode="before")
    @classmethod
    def _name(cls, v: Any, info) -> str | None:
        if v is not None and (not isinstance(v, str) or not v):
            raise ValueError(f"'{info.field_name}' must be a non-empty string, got {shown(v)}")
        return v

    @field_validator("tool_calls", mode="before")
    @classmethod
    def _tool_calls(cls, v: Any) -> list[dict] | None:
        if v is None:
            return None
        if not isinstance(v, list) or not v or not all(
                isinstance(c, dict) and c.get("type", "function") == "function" and isinstance(c.get("id"), str) and
                isinstance(c.get("function"), dict) and isinstance(c["function"].get("name"), str) and
                isinstance(c["function"].get("arguments"), str) for c in v):
            raise ValueError("'tool_calls' must be a list of {\"id\": ..., \"type\": \"function\", \"function\": "
                             "{\"name\": ..., \"arguments\": JSON text}}")
        return v

    @model_validator(mode="after")
    def _shape(self):
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("'tool_calls' belongs to assistant messages only")
        if (self.tool_call_id is not None) != (self.role == "tool"):
            raise ValueError("a tool message needs 'tool_call_id' (the call it answers), and only a tool message "
                             "has one")
        if (self.reasoning_content is not None or self.reasoning is not None or self.refusal is not None) and \
                self.role != "assistant":
            raise ValueError("'reasoning_content', 'reasoning' and 'refusal' belong to assistant messages only")
        if self.content is None and self.refusal is not None:
            self.content = self.refusal
        if self.content is None and self.tool_calls is None:
            raise ValueError("'content' is required (an assistant message may have tool_calls instead)")
        return self

    def wire(self) -> dict:
        """As NAME_llm takes it: role, content, and name, tool_calls (arguments as objects, as chat templates read
        them) or tool_call_id where given."""
        out: dict = {"role": self.role, "content": self.content or ""}
        if self.name:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [{"id": c["id"], "type": "function", "function": {
                "name": c["function"]["name"], "arguments": _arguments(c["function"]["arguments"])}}
                for c in self.tool_calls]
        if self.tool_call_id:
            out["tool_call_id"] = self.tool_call_id
        thinking = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if thinking:
            out["reasoning_content"] = thinking  # the chat template decides whether the model sees it again
        return out


def _arguments(text: str) -> Any:
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return text


class ChatCompletionRequest(_Request):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    logprobs: bool | None = None
    max_completion_tokens: int | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None  # each checked by tools.read_tools, its mistakes named by index
    functions: None = None  # refused: OpenAI's deprecated form
    tool_choice: ToolChoice | None = None
    function_call: None = None  # refused
    parallel_tool_calls: bool | None = None
    modalities: None = None  # ["text"] only, checked and dropped
    audio: None = None  # refused, as is web_search_options
    prediction: None = None  # predicted output: speeds OpenAI's answer up, never changes it (checked, dropped)
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: None = None
    chat_template_kwargs: dict | None = None  # vLLM's: given to the chat template (enable_thinking, thinking, ...)

    @field_validator("messages", mode="before")
    @classmethod
    def _messages(cls, v: Any) -> Any:
        if not isinstance(v, list) or not v:
            raise ValueError("'messages' must be a non-empty list of {role, content} with text content")
        return v

    @field_validator("max_completion_tokens", mode="before")
    @classmethod
    def _max_completion_tokens(cls, v: Any) -> int | None:
        return None if v is None else _integer("max_completion_tokens", v, 1, MAX_TOKENS)

    @field_validator("logprobs", mode="before")
    @classmethod
    def _logprobs(cls, v: Any) -> bool | None:
        return None if v is None else _flag("logprobs", v)

    @field_validator("top_logprobs", mode="before")
    @classmethod
    def _top_logprobs(cls, v: Any) -> int | None:
        return None if v is None else _integer("top_logprobs", v, 0, MAX_LOGPROBS)

    _tools: list[tooling.Tool] = PrivateAttr(default_factory=list)
    _tool_choice: str = PrivateAttr(default="none")

    @field_validator("functions", "function_call", mode="before")
    @classmethod
    def _functions(cls, v: Any, info) -> None:
        if v is not None:
            raise ValueError(f"'{info.field_name}' is OpenAI's deprecated form: send 'tools' and 'tool_choice'")

    @field_validator("parallel_tool_calls", mode="before")
    @classmethod
    def _parallel(cls, v: Any) -> bool | None:
        return None if v is None else _flag("parallel_tool_calls", v)

    @model_validator(mode="after")
    def _tooling(self):
        try:
            self._tools = tooling.read_tools(self.tools) if self.tools is not None else []
            if self.tools is None and self.tool_choice not in (None, "none"):  # (`tools: []` is no tools: taken)
                raise tooling.ToolError(f"'tool_choice' {shown(self.tool_choice)} needs 'tools'", "tool_choice")
            self._tool_choice = tooling.read_choice(self.tool_choice, self._tools)
        except tooling.ToolError as e:
            raise OpenAIError(400, str(e), e.param) from None
        if self._tool_choice not in ("none", "auto"):
            # the answer is a call: the structured output asked for text has none to shape (as OpenAI takes both)
            self._structured = tooling.grammar(self._tools, self._tool_choice,
                                               self.parallel_tool_calls is not False)
            self._structured_param = "tools"
            self.stop.grammar = True
        return self

    def _grammars(self) -> list[tuple[dict, str]]:
        """Each tool's parameters schema, then the answer's grammar (a forced call's is made of those schemas)."""
        own = [({"json": t.parameters}, f"tools[{i}].function.parameters") for i, t in enumerate(self._tools)]
        return own + ([] if self._structured_param == "tools" else super()._grammars())

    @property
    def tool_list(self) -> list[tooling.Tool]:
        return self._tools

    @property
    def tool_mode(self) -> str:
        """none, auto, required, or the name of the function to call."""
        return self._tool_choice

    @field_validator("modalities", mode="before")
    @classmethod
    def _modalities(cls, v: Any) -> None:
        unserved("modalities", v, ["text"])

    @field_validator("audio", "web_search_options", mode="before")
    @classmethod
    def _others(cls, v: Any, info) -> None:
        unserved(info.field_name, v)

    @field_validator("prediction", mode="before")
    @classmethod
    def _prediction(cls, v: Any) -> None:
        if v is None:
            return
        if not isinstance(v, dict) or v.get("type") != "content":
            raise ValueError(f"'prediction' must be {{\"type\": \"content\", \"content\": ...}}, got {shown(v)}")
        _noted("prediction")

    @field_validator("reasoning_effort", "verbosity", mode="before")
    @classmethod
    def _effort(cls, v: Any, info) -> str | None:
        """OpenAI's levels for reasoning models (and GPT-5's verbosity): they select how a reasoning model thinks,
        which this model does not: taken, as vLLM takes them for models without a thinking mode."""
        levels = ("none", "minimal", "low", "medium", "high") if info.field_name == "reasoning_effort" else \
            ("low", "medium", "high")
        if v is None:
            return None
        if v not in levels:
            raise ValueError(f"'{info.field_name}' must be one of {', '.join(levels)}, got {shown(v)}")
        _noted(info.field_name)
        return v

    @field_validator("chat_template_kwargs", mode="before")
    @classmethod
    def _template_kwargs(cls, v: Any) -> dict | None:
        """Keyword arguments for the chat template (vLLM's): names to JSON scalars, bounded."""
        if v is None:
            return None
        if not isinstance(v, dict) or not all(
                isinstance(k, str) and k.isidentifier() and (x is None or isinstance(x, (str, int, float, bool)))
                for k, x in v.items()) or len(orjson.dumps(v)) > MAX_TEMPLATE_KWARGS_BYTES:
            raise ValueError("'chat_template_kwargs' must be an object of names to strings, numbers or booleans "
                             f"(at most {MAX_TEMPLATE_KWARGS_BYTES} bytes), got {shown(v)}")
        return v or None

    @model_validator(mode="after")
    def _logprobs_together(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("'top_logprobs' needs 'logprobs': true")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def prompt_bytes(self) -> int:
        """Each message's content and role (the chat template adds a few tokens around each), and the tools."""
        return sum(len((m.content or "").encode()) + len(m.role) + len(orjson.dumps(m.tool_calls or []))
                   for m in self.messages) + len(orjson.dumps([t.wire() for t in self._tools]))

    def prompt_fields(self) -> dict:
        fields = {"messages": orjson.dumps([m.wire() for m in self.messages]).decode()}
        if self._tools:
            fields["tools"] = orjson.dumps([t.wire() for t in self._tools]).decode()
        if self.chat_template_kwargs:
            fields["chat_template_kwargs"] = orjson.dumps(self.chat_template_kwargs).decode()
        return fields

    @property
    def top_logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


Body = TypeVar("Body", bound=BaseModel)


def parse(body: bytes, kind: type[Body]) -> Body:
    """The request in `body` as `kind` (a request type of this module, or responses.py's), validated; OpenAIError
    (400) naming the first thing wrong."""
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise OpenAIError(400, f"the body is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise OpenAIError(400, "the body must be a JSON object")
    return validated(value, kind)


def validated(value: dict, kind: type[Body]) -> Body:
    """A request already read (a JSON object's value: the chat completion a Responses request becomes) as `kind`,
    validated as parse() validates a body."""
    try:
        return kind.model_validate(value)
    except ValidationError as e:
        raise _error(e) from None


def _grammar_error(e: GrammarError, param: str) -> OpenAIError:
    """A grammar the engine cannot use, named as the field the client sent it in."""
    rest = GRAMMAR_SUBJECT.sub("", str(e), count=1)
    return OpenAIError(400, f"'{param}'" + (rest if rest.startswith((" ", ":")) else ": " + rest), param)


def _error(e: ValidationError) -> OpenAIError:
    """The first validation error, in OpenAI's words and shape: the field it concerns as `param`."""
    first = e.errors(include_url=False)[0]
    loc = [part for part in first["loc"] if isinstance(part, int) or "[" not in part]
    param = "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else p) for i, p in enumerate(loc)) or None
    if first["type"] == "extra_forbidden":
        return OpenAIError(400, f"Unrecognized request argument supplied: {param}", param)
    if first["type"] == "missing":
        hint = ": a model family's name (GET /v1/models lists them)" if param == "model" else ""
        return OpenAIError(400, f"'{param}' is required{hint}", param)
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] != "value_error":
        message = f"'{param}': {message}, got {shown(first.get('input'))}"
    return OpenAIError(400, message, _param_of(message, param))


def _param_of(message: str, param: str | None) -> str | None:
    """The field a model-level check names at the start of its message ("top_p must be ...")."""
    if param:
        return param
    head = message.split(" ", 1)[0].strip("'")
    return head if head.isidentifier() else None
