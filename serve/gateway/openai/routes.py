"""The OpenAI API on the gateway's HTTP port: /v1/models, /v1/completions, /v1/chat/completions and /v1/responses
(responses.py: run as the chat completion it asks for; stored, continued, read and run in the background by
stored.py), served by a model family's NAME_llm (the streaming,
continuous-batching model) through Triton's generate extension. Structured outputs (response_format, vLLM's
guided_* and structured_outputs) are NAME_llm's grammar; tools (tools.py) are shown to the model, a forced call is
made under its schema, and the text is read back as tool calls.

`model` is the family's name (`dstool_lm`: its NAME_llm answers), or a LoRA adapter's (BASE:ADAPTER, or ADAPTER
held by one family: adapters.py; vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter load them, the
admin's). Sampling parameters go to the model as they are (temperature — OpenAI's default 1 —, top_p, seed,
presence/frequency_penalty, logit_bias, and vLLM's top_k,
min_p, repetition_penalty, min_tokens, stop_token_ids); `max_tokens` (or `max_completion_tokens`) is max_new_tokens:
without it a chat answer runs to the model's end or the context's (completions: 16 tokens, the legacy default), at
most --max-tokens-limit; `stop` strings end a choice here, the text cut before them (after them with vLLM's
include_stop_str_in_output); `n` choices run side by side (with a seed, choice i uses seed + i, modulo 2**63); `stream`
answers with server-sent events ending in `[DONE]`. Requests are typed (protocol.py): a mistake, an unknown field or
one not served is a 400 naming it, in OpenAI's form. A client that hangs up, streamed or not, cancels its choices
on Triton; a slow reader holds at most EVENTS_AHEAD events here. The gateway's bearer token, when set, is the API
key; with --auth keys, a tenant's key (http.py admits it): /v1/models lists its models only, its answers are cached
in its tenant's scope and its tokens charged as they come (Meter).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import urllib.parse
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson

from dstool.decoding.errors import ContextTooLong
from dstool.decoding.sampling import shown
from dstool.serve.gateway.adapters import AdapterRefused, Adapters, ServedAdapter, load_request, not_loaded
from dstool.serve.gateway.core import addressable
from dstool.serve.gateway.generation import GenerationCache, data
from dstool.serve.gateway.openai import deepseek
from dstool.serve.gateway.openai.answer import Answer, CallDelta, Delta, Event, Failed, Streamed, Usage, Whole
from dstool.serve.gateway.openai.protocol import (
    GRAMMAR_SUBJECT,
    SAMPLING,
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    Stops,
    parse,
    validated,
)
from dstool.serve.gateway.openai.stored import MemoryResponses, ResponsesRoutes
from dstool.serve.gateway.openai.tools import Calls
from dstool.serve.gateway.tenancy.auth import Principal
from dstool.serve.gateway.tenancy.guard import Guard, Meter, Refused, estimated_tokens
from dstool.serve.gateway.tensors import GatewayError, backend_fault
from dstool.serve.gateway.transport import EVENT_STREAM, HttpRequest, HttpResponse, StreamingResponse, opts_out
from dstool.serve.gateway.upstream import UnsafeRequest, UpstreamTimeout, UpstreamUnavailable

# Events the choices of one request may get ahead of the client by: past it they stop reading from Triton (and
# Triton's sending waits), so a slow reader holds a bounded amount here.
EVENTS_AHEAD = 64
COMPLETION_TOKENS = 16  # /v1/completions without max_tokens (OpenAI's and vLLM's legacy default)


def error_response(e: OpenAIError) -> HttpResponse:
    return HttpResponse(e.status, [e.body()], [("Content-Type", "application/json")])


@dataclass(slots=True)
class Ranked:
    """One token's text and log-probability, and the most likely alternatives' (a prompt's first token has none:
    logprob None)."""

    token: str
    logprob: float | None
    top: list[tuple[str, float]]


def ranked(event: dict) -> list[Ranked]:
    """The tokens' log-probabilities in one generate_stream event (Triton writes a one-element tensor as a scalar,
    and the others flattened)."""
    if "logprobs" not in event:
        return []
    lps, tokens = _listed(event["logprobs"]), _listed(event.get("tokens"))
    top_tokens, top_lps = _listed(event.get("top_tokens")), _listed(event.get("top_logprobs"))
    k = len(top_lps) // len(lps) if lps else 0
    return [Ranked(tokens[i], lps[i], list(zip(top_tokens[i * k:(i + 1) * k], top_lps[i * k:(i + 1) * k])))
            for i in range(len(lps))]


def prompt_ranked(event: dict) -> list[Ranked] | None:
    """The prompt's tokens and their log-probabilities in a first generate_stream event (NAME_llm's prompt_logprobs:
    none for the first token, then each one's with its alternatives), or None when it has none."""
    if "prompt_token_texts" not in event:
        return None
    tokens, lps = _listed(event["prompt_token_texts"]), _listed(event.get("prompt_logprobs"))
    top_tokens, top_lps = _listed(event.get("prompt_top_tokens")), _listed(event.get("prompt_top_logprobs"))
    k = len(top_lps) // len(lps) if lps else 0
    return [Ranked(tokens[0], None, [])] + [
        Ranked(tokens[i + 1], lps[i], list(zip(top_tokens[i * k:(i + 1) * k], top_lps[i * k:(i + 1) * k])))
        for i in range(min(len(lps), len(tokens) - 1))] if tokens else []


def _listed(value) -> list:
    return value if isinstance(value, list) else [] if value is None else [value]


def logprobs_field(chat: bool, rows: list[Ranked], offset: int = 0) -> dict:
    """A choice's `logprobs` as OpenAI writes it: chat's `content` list, or completions' parallel lists
    (`text_offset` counted from the start of the completion, `offset` being where `rows` begin)."""
    if chat:
        return {"content": [{"token": r.token, "logprob": r.logprob, "bytes": list(r.token.encode()),
                             "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())}
                                              for t, lp in r.top]} for r in rows], "refusal": None}
    offsets = []
    for r in rows:
        offsets.append(offset)
        offset += len(r.token)
    return {"tokens": [r.token for r in rows], "token_logprobs": [r.logprob for r in rows],
            "top_logprobs": [None if r.logprob is None else {**dict(r.top), r.token: r.logprob} for r in rows],
            "text_offset": offsets}


class Choice:
    """One choice's text as it comes from the model, cut at the first stop string, and (for an answer sent whole,
    `whole`) its tokens' logprobs; a stream's go out as they come and are not kept. A stop string that cuts an
    answer under a grammar leaves it unfinished (not in the grammar, not a complete call): its finish reason is
    `length`, as when max_tokens cuts it."""

    def __init__(self, index: int, stops: Stops, whole: bool = True, calls: Calls | None = None,
                 keep_stop: bool = False):
        self.index, self.stops, self.text, self.sent, self.tokens, self.whole = index, stops, "", 0, 0, whole
        self.keep_stop = keep_stop  # vLLM's include_stop_str_in_output: the stop string ends the text
        self.limit: int | None = None  # the tokens it may have, once known (an answer running to the context's end)
        self.calls = calls  # the text read as tool calls, when the request has tools
        self.reasoning: deepseek.Reasoning | None = None  # the text split into thinking and answer (--reasoning-parser)
        self.ranked: list[Ranked] = []
        self.prompt_tokens = self.cached_tokens = 0  # the prompt's tokens, and those the engine's prefix cache held
        self.finish_reason: str | None = None
        self.hold = max((len(s) for s in stops), default=1) - 1  # characters that may begin a stop string
        # /v1/completions: whether it counts its prompt's tokens (its prompt's first choice), the prompt's text and
        # tokens put before its own (echo), whether its answer is dropped (echo with max_tokens 0), what its
        # prompt is called in errors
        self.lead, self.echo, self.discard, self.prompt_name = True, "", False, "prompt"
        self.prompt_ranked: list[Ranked] = []

    def add(self, text: str) -> str:
        """Take the model's next text; what can be sent now."""
        self.text += text
        for stop in self.stops:
            at = self.text.find(stop)
            if at >= 0:
                self.text, self.finish_reason = self.text[:at + (len(stop) if self.keep_stop else 0)], "stop"
        upto = len(self.text) if self.finish_reason else max(self.sent, len(self.text) - self.hold)
        new, self.sent = self.text[self.sent:upto], upto
        return new

    def end(self, max_tokens: int) -> str:
        if self.finish_reason is None:
            limit = self.limit if self.limit is not None else max_tokens
            self.finish_reason = "length" if self.tokens >= limit else "stop"
        elif self.stops.grammar:  # a stop string cut it
            self.finish_reason = "length"
        new, self.sent = self.text[self.sent:], len(self.text)
        return new


@dataclass
class Reply:
    """One answer being written: its identity, its choices, and what the request asked of its shape (logprobs, a
    usage chunk); renders the whole answer or a stream's chunks."""

    chat: bool
    model: str
    choices: list[Choice]
    max_tokens: int
    logprobs: bool  # top_logprobs or logprobs asked
    include_usage: bool = False
    ident: str = ""
    created: int = 0

    def __post_init__(self):
        self.ident = self.ident or ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = self.created or int(time.time())
        self.offsets = {c.index: 0 for c in self.choices}  # each choice's text offset so far (completions' logprobs)

    def usage(self) -> dict:
        """Every prompt's tokens (a batch's, each once: its first choice's), every choice's."""
        completion = sum(c.tokens for c in self.choices)
        prompt = sum(c.prompt_tokens for c in self.choices if c.lead)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(c.cached_tokens for c in self.choices if c.lead)}}

    def whole(self) -> dict:
        rows = []
        for c in self.choices:
            c.end(self.max_tokens)
            lp = logprobs_field(self.chat, c.ranked) if self.logprobs else None
            message: dict[str, Any] = {"role": "assistant", "content": c.text}
            text = c.text
            if c.reasoning is not None:  # the thinking apart, the rest the answer (None when there is none: vLLM's)
                thought, text = c.reasoning.feed(c.text)
                more, rest = c.reasoning.end()
                thought, text = thought + more, text + rest
                message.update(content=text or None, reasoning_content=thought or None, reasoning=thought or None)
            if c.calls is not None:
                content, _, _ = c.calls.feed(text)
                content += c.calls.end()
                message["content"] = deepseek.whole_content(c.calls, content)  # content or None, as vLLM's
                if c.finish_reason == "length":  # a call cut short comes back as far as it got, as OpenAI's
                    c.calls.cut()
                if c.calls.calls:
                    message["tool_calls"] = [call.whole() for call in c.calls.calls]
                    c.finish_reason = "tool_calls" if c.finish_reason == "stop" else c.finish_reason
            rows.append({"index": c.index, "message": message, "logprobs": lp,
                         "finish_reason": c.finish_reason} if self.chat else
                        {"index": c.index, "text": c.echo + c.text, "logprobs": logprobs_field(
                            False, c.prompt_ranked + c.ranked) if self.logprobs else None,
                         "finish_reason": c.finish_reason})
        return {"id": self.ident, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": rows, "usage": self.usage()}

    def delta(self, index: int, text: str | None, finish: str | None = None, role: bool = False,
              rows: list[Ranked] | None = None, calls: tuple[CallDelta, ...] = (), thought: str | None = None) -> Delta:
        lp = None
        if self.logprobs and rows:
            lp = logprobs_field(self.chat, rows, self.offsets[index])
            self.offsets[index] += sum(len(r.token) for r in rows)
        return Delta(index, text, thought, calls, lp, finish, role)

    def head(self) -> dict:
        """What every chunk of its stream repeats."""
        return {"id": self.ident, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model}


def sse(head: dict, event: Event) -> bytes:
    """An event of a stream as OpenAI's server-sent event: a chunk (`head` its identity), the usage chunk, or the
    error."""
    if isinstance(event, Failed):
        return b"data: " + event.error.body() + b"\n\n"
    fields: dict[str, Any]
    if isinstance(event, Usage):
        fields = {"choices": [], "usage": event.usage}
    elif head["object"] == "text_completion":
        fields = {"choices": [{"index": event.index, "text": event.content or "", "logprobs": event.logprobs,
                               "finish_reason": event.finish_reason}]}
    else:
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if event.role else {} \
            if event.content is None else {"content": event.content}
        if event.calls:
            delta["tool_calls"] = [c.chat() for c in event.calls]
        if event.reasoning:  # thinking, under both names vLLM has used (reasoning_content, reasoning)
            delta = {"reasoning_content": event.reasoning, "reasoning": event.reasoning}
        fields = {"choices": [{"index": event.index, "delta": delta, "logprobs": event.logprobs,
                               "finish_reason": event.finish_reason}]}
    return b"data: " + orjson.dumps({**head, **fields}) + b"\n\n"


async def sse_stream(head: dict, events: AsyncIterator[Event]) -> AsyncIterator[bytes]:
    """A stream's events as OpenAI's server-sent events, ending in [DONE] (an error ends it without)."""
    async for event in events:
        yield sse(head, event)
        if isinstance(event, Failed):
            return
    yield b"data: [DONE]\n\n"


def respond(answer: Answer) -> HttpResponse | StreamingResponse:
    """An answer in OpenAI's wire format."""
    if isinstance(answer, Whole):
        return HttpResponse(200, [orjson.dumps(answer.completion)], [("Content-Type", "application/json"),
                                                                     *answer.headers])
    return StreamingResponse(200, [*EVENT_STREAM, *answer.headers], sse_stream(answer.head, answer.events),
                             answer.close)


class OpenAIFrontend:
    reasoning_parser: str | None = None  # --reasoning-parser (deepseek.py), set by the gateway
    tool_call_parser: str = "hermes"  # --tool-call-parser

    def __init__(self, upstreams, generation: GenerationCache, guard: Guard | None = None,
                 shared_models: frozenset[str] = frozenset(), max_tokens_limit: int | None = None):
        self.upstreams = upstreams
        self.generation = generation
        self.guard = guard
        self.shared_models = shared_models
        self.max_tokens_limit = max_tokens_limit  # --max-tokens-limit: the most tokens one choice may have
        self.choices: set[asyncio.Task] = set()  # held until done: the loop keeps only weak references to tasks
        self.responses = ResponsesRoutes(MemoryResponses(), self._chat)  # the gateway gives it its Redis store
        self.adapters = Adapters(generation.core, generation.core.deployments.interval)  # LoRA adapters (adapters.py)

    async def handle(self, req: HttpRequest):
        try:
            if req.path == "/v1/models" and req.method == "GET":
                return await self._models(req.principal)
            if req.path.startswith("/v1/models/") and req.method == "GET":
                return await self._model(req.path[len("/v1/models/"):], req.principal)
            if req.path == "/v1/responses" or req.path.startswith("/v1/responses/"):
                return await self.responses.handle(req)
            if req.path in ("/v1/completions", "/v1/chat/completions"):
                if req.method != "POST":
                    raise OpenAIError(405, f"use POST for {req.path}")
                request = parse(req.body, ChatCompletionRequest if req.path == "/v1/chat/completions" else
                                CompletionRequest)
                target = await self.target(request.model, req.principal)  # before any work on what it asks
                await request.check_grammars()
                return respond(await self._complete(request, opts_out(req), req.principal, target))
            if req.path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
                if req.method != "POST":
                    raise OpenAIError(405, f"use POST for {req.path}")
                return await self._adapter_admin(req)
            if req.path == "/v1/embeddings":
                raise OpenAIError(404, "no route /v1/embeddings: dstool serves causal language models, whose hidden "
                                       "states are no trained embedding (docs/structured-outputs.md)")
            raise OpenAIError(404, f"no route {req.method} {req.path}: the API has /v1/models, /v1/completions, "
                                   "/v1/chat/completions, /v1/responses, /v1/load_lora_adapter and "
                                   "/v1/unload_lora_adapter")
        except OpenAIError as e:
            return error_response(e)
        except AdapterRefused as e:
            return error_response(_adapter_error(e))
        except Refused as e:
            return refused(e)
        except (UpstreamUnavailable, UpstreamTimeout) as e:
            return error_response(OpenAIError(503, str(e), kind="server_error"))

    async def _positions(self, model: str) -> int:
        """The positions (prompt and answer) of the model's NAME_llm, from its config (kept by core.UpstreamModels)."""
        try:
            config = (await self.generation.core.deployments.get(f"{model}_llm")).config
        except GatewayError as e:
            raise _upstream_error(e.status, orjson.dumps({"error": e.message}), model, True) from None
        try:
            return int(config["parameters"]["max_positions"]["string_value"])
        except (KeyError, TypeError, ValueError):
            raise OpenAIError(500, f"the model '{model}' has no max_positions parameter: export it again with this "
                                   "dstool", kind="server_error") from None

    async def _served(self, principal: Principal | None) -> list[str]:
        """The model families whose NAME_llm is ready on Triton (those the key is given, with a key)."""
        try:
            bases = await self.adapters.bases()
        except GatewayError as e:
            raise OpenAIError(502, e.message, kind="server_error") from None
        return [b for b in bases if principal is None or principal.allows(b + "_llm")]

    async def _listed(self, principal: Principal | None) -> list[tuple[dict, str]]:
        """(model object, full name) of each served family and each of its adapters (those the key is given): an
        adapter as vLLM lists a LoRA module, its id the name clients send (bare when no other base holds one of
        that name, else BASE:NAME), `parent` its base, `root` its path."""
        bases = await self._served(None)
        rows = [(_model_object(b), b) for b in bases if principal is None or principal.allows(b + "_llm")]
        lists = await asyncio.gather(*(self.adapters.of(b) for b in bases), return_exceptions=True)
        adapters = [a for held in lists if isinstance(held, dict) for a in held.values()]
        names = [a.name for a in adapters]
        for a in adapters:
            if principal is None or principal.allows(a.id):
                rows.append(({**_model_object(a.name if names.count(a.name) == 1 else a.id), "root": a.path,
                              "parent": a.base}, a.id))
        return rows

    async def _models(self, principal: Principal | None) -> HttpResponse:
        data = [row for row, _ in await self._listed(principal)]
        return HttpResponse(200, [orjson.dumps({"object": "list", "data": data})],
                            [("Content-Type", "application/json")])

    async def _model(self, raw: str, principal: Principal | None) -> HttpResponse:
        """GET /v1/models/{id}: the model object GET /v1/models lists (an adapter also by its BASE:NAME), or OpenAI's
        404 (model_not_found)."""
        try:  # the path's bytes (a latin-1 string of them), percent escapes decoded, as UTF-8
            name = urllib.parse.unquote_to_bytes(raw.encode("latin-1")).decode("utf-8")
        except (UnicodeError, ValueError):
            name = ""
        if not name or not addressable(name.rpartition(":")[0] + "_llm" if ":" in name else name + "_llm"):
            raise OpenAIError(404, f"The model {shown(name)} does not exist: a model's id is a served family's name "
                                   "or an adapter's (GET /v1/models lists them)", "model", code="model_not_found")
        row = next((row for row, full in await self._listed(principal) if name in (row["id"], full)), None)
        if row is None:
            raise OpenAIError(404, f"The model '{name}' does not exist or you do not have access to it.", "model",
                              code="model_not_found")
        return HttpResponse(200, [orjson.dumps(row)], [("Content-Type", "application/json")])

    async def target(self, model: str, principal: Principal | None) -> Target:
        """The base and adapter a request's `model` names (adapters.py), refused (OpenAI's 404, model_not_found) when
        the key (when there is one) is not given it: a family's name gives its base model, an adapter's BASE:NAME
        that adapter only (a key given BASE is not given its adapters)."""
        try:
            base, adapter = await self.adapters.resolve(model)
        except AdapterRefused as e:
            if e.status == 404:  # whether the key is given it or not, the same answer
                _given(model, principal)
            raise OpenAIError(e.status, e.message, "model",
                              code="model_not_found" if e.status == 404 else None) from None
        _given(adapter.id if adapter is not None else model, principal)
        return Target(base, adapter)

    async def _adapter_admin(self, req: HttpRequest) -> HttpResponse:
        """vLLM's POST /v1/load_lora_adapter {"lora_name", "lora_path"} and /v1/unload_lora_adapter {"lora_name"}
        (`base_model_name`, or lora_name BASE:NAME, when several families are served): the admin's only; answered
        as vLLM does, in plain text. A refused load is a 400 with NAME_llm's reason, an unknown name's unload a 404."""
        if req.principal is not None and not req.principal.admin:
            raise OpenAIError(403, f"POST {req.path} is for admin keys only (`dstool keys create --admin`)",
                              code="permission_denied")
        unload = req.path == "/v1/unload_lora_adapter"
        base, name, path = load_request(req.body, unload)
        if base is None:
            served = await self._served(None)
            if unload:  # the base that holds it
                lists = await asyncio.gather(*(self.adapters.of(b, 0.0) for b in served))
                served = [b for b, held in zip(served, lists) if name in held] or served[:1]
            if len(served) != 1:
                raise OpenAIError(400, f"{len(served)} models are served ({', '.join(served) or 'none'})"
                                       f"{' holding the adapter' if unload else ''}: name the adapter's in "
                                       "'base_model_name' (or 'lora_name' as BASE:NAME)", "base_model_name")
            base = served[0]
        if unload:
            if name not in await self.adapters.of(base, 0.0):
                raise OpenAIError(404, f"The lora adapter '{name}' cannot be found (on the model '{base}').",
                                  "lora_name", code="model_not_found")
            await self.adapters.unload(base, name)
            text = f"Success: LoRA adapter '{name}' removed successfully."
        else:
            await self.adapters.load(base, name, path)
            text = f"Success: LoRA adapter '{name}' added successfully."
        return HttpResponse(200, [text.encode()], [("Content-Type", "text/plain; charset=utf-8")])

    async def _chat(self, body: dict, req: HttpRequest) -> Answer:
        """The chat completion a Responses request asks for (stored.py), as req's principal: its answer."""
        request = validated(body, ChatCompletionRequest)
        target = await self.target(request.model, req.principal)
        await request.check_grammars()
        return await self._complete(request, opts_out(req), req.principal, target)

    async def _complete(self, request, opt_out: bool, principal: Principal | None = None,
                        target: Target | None = None) -> Answer:
        """A completion or chat completion request, validated, for its `target` (the base and adapter its model
        names): its answer, whole or streamed; with `principal` (a tenant's key), from its tenant's cache scope, its
        tokens charged as they come."""
        chat, arrived = isinstance(request, ChatCompletionRequest), time.monotonic()
        target = target or Target(request.model, None)
        meter = self.guard.meter(principal) if self.guard is not None and principal is not None else None
        scope = principal.scope(target.name, self.shared_models) if principal is not None else ""
        asked = request.max_new_tokens if request.max_new_tokens is not None or chat else COMPLETION_TOKENS
        cap = self.max_tokens_limit
        if asked is not None and cap is not None and asked > cap:
            raise OpenAIError(400, f"'max_tokens' is {asked}: this server gives a choice at most {cap} tokens "
                                   "(--max-tokens-limit); ask for fewer", "max_tokens")
        limits: dict = {} if asked is None and cap is None else {"max_new_tokens": asked if asked is not None else cap}
        if asked is None:  # chat without a limit: to the model's end or the context's (as OpenAI and vLLM)
            limits["fill_context"] = True
            positions = await self._positions(target.base)
            max_tokens = min(cap or positions, positions)
        else:
            max_tokens = asked
        prompts = 1 if chat else len(request.prompts)  # a completion's batch: n choices of each prompt
        if meter is not None:  # its tenant's turn for its choices, and the most it may use, before anything runs
            sequences, prompt = prompts * request.n, estimated_tokens(request.prompt_bytes())
            granted = await meter.start(sequences, prompt + sequences * max_tokens,
                                        prompt + sequences if asked is None else None)
            if granted < prompt + sequences * max_tokens:  # a limit holds less than the context: the answer
                max_tokens = limits["max_new_tokens"] = (granted - prompt) // sequences  # runs to what is left,
                if sequences == 1:  # the prompt as the engine counts it included
                    max_tokens = limits["max_new_tokens"] = granted - 1
                    limits["max_total_tokens"] = granted
        tooled = chat and request.tool_mode != "none"
        choices = [Choice(i, request.stop, whole=not request.stream,
                          calls=deepseek.tool_calls(self.tool_call_parser, request.tool_list, request.tool_mode,
                                                    request.parallel_tool_calls is not False)
                          if tooled else None, keep_stop=request.include_stop_str_in_output)
                   for i in range(prompts * request.n)]
        for c in choices if not chat else []:
            c.lead, c.discard = c.index % request.n == 0, request.echo_only
            c.prompt_name = f"prompt[{c.index // request.n}]" if prompts > 1 else "prompt"
        thinking = chat and deepseek.thinks(self.reasoning_parser, getattr(request, "chat_template_kwargs", None))
        if thinking:
            if request.structured is not None:  # NAME_llm lets the model think before the grammar applies
                limits["reasoning_parser"] = "deepseek_r1"
            for c in choices:
                c.reasoning = deepseek.Reasoning()
        events: asyncio.Queue = asyncio.Queue(EVENTS_AHEAD)
        tasks = [asyncio.ensure_future(self._run(target, {**request.fields(c.index), **limits, **target.fields()}, c,
                                                 events, opt_out, scope, meter, request.structured_param))
                 for c in choices]
        running = len(tasks)

        def ended(task: asyncio.Task) -> None:
            nonlocal running
            self.choices.discard(task)
            running -= 1
            if running == 0 and meter is not None:
                meter.close()  # every choice has ended: what the reservation did not use goes back

        for t in tasks:
            self.choices.add(t)
            t.add_done_callback(ended)
        handed_over = False

        def stop() -> None:
            for t in tasks:
                t.cancel()

        try:
            first = await events.get()  # the first event, or an error before anything was generated
            if isinstance(first, OpenAIError):
                raise first
            reply = Reply(chat, request.model, choices, max_tokens, request.top_logprobs_asked is not None,
                          request.stream_options is not None and request.stream_options.include_usage)
            timings = [("x-dstool-time-to-first-token-ms", _ms(time.monotonic() - arrived))]
            if request.stream:
                handed_over = True  # the stream's end (or the client's) stops the choices
                return Streamed(self._events(first, events, reply), timings, stop, reply.head())
            done, event = 0, first
            while True:
                if isinstance(event, OpenAIError):
                    raise event
                if event[1] is None:
                    done += 1
                    if done == len(choices):
                        break
                event = await events.get()
        finally:
            if not handed_over:
                stop()  # also when the client hung up (this task cancelled): the choices end on Triton too
        return Whole(reply.whole(), [*timings, ("x-dstool-e2e-ms", _ms(time.monotonic() - arrived))])

    @staticmethod
    async def _events(event, events: asyncio.Queue, reply: Reply) -> AsyncIterator[Event]:
        """The stream of `reply` from its first event on: a role delta per choice (chat), the text as it comes, each
        choice's finish, the usage when asked; an error after the first event ends it."""
        if reply.chat:
            for c in reply.choices:
                yield reply.delta(c.index, None, role=True)
        done = 0
        while True:
            if isinstance(event, OpenAIError):
                yield Failed(event)
                return
            choice, text, rows = event
            if text is None:
                rest = choice.end(reply.max_tokens)
                for part in _stream_parts(reply, choice, rest, [], final=True):
                    yield part
                if choice.calls is not None:
                    rest = choice.calls.end()
                    if rest:
                        yield reply.delta(choice.index, rest)
                    cut = choice.calls.cut() if choice.finish_reason == "length" else None
                    if cut is not None:
                        yield reply.delta(choice.index, None, calls=(
                            CallDelta(len(choice.calls.calls) - 1, cut.arguments, cut.id, cut.name),))
                    if choice.calls.calls and choice.finish_reason == "stop":
                        choice.finish_reason = "tool_calls"
                yield reply.delta(choice.index, None if reply.chat else "", choice.finish_reason)
                done += 1
                if done == len(reply.choices):
                    break
            else:
                for part in _stream_parts(reply, choice, text, rows):
                    yield part
            event = await events.get()
        if reply.include_usage:
            yield Usage(reply.usage())

    async def _run(self, target: Target, fields: dict, choice: Choice, events: asyncio.Queue, opt_out: bool,
                   scope: str = "", meter: Meter | None = None, grammar_param: str | None = None) -> None:
        """One choice through Triton's generate_stream: (choice, new text) events, then (choice, None); the engine's
        errors about the grammar name `grammar_param`, the field the client sent it in."""
        model = target.base
        try:
            g = await self.generation.open(f"{model}_llm", "", "generate_stream", fields, opt_out=opt_out,
                                           protocol="openai", scope=scope,
                                           tenant=meter.principal.tenant if meter is not None else "",
                                           variant=target.adapter.sha256 if target.adapter is not None else "")
            if meter is not None and g.hit and choice.index == 0:
                meter.hit()
            async with contextlib.aclosing(g.events) as stream:
                if g.status != 200:
                    raise _upstream_error(g.status, b"".join([e async for e in stream]), model, "messages" in fields,
                                          grammar_param)
                async for event in stream:
                    d = data(event)
                    if d is None:
                        continue
                    if "error" in d:
                        raise _upstream_error(400, orjson.dumps(d), model, "messages" in fields, grammar_param)
                    new = 0 if choice.discard else len(_listed(d.get("output_ids"))) or 1  # several: stream interval
                    choice.tokens += new
                    prompt_known = choice.prompt_tokens
                    choice.prompt_tokens = int(d.get("prompt_tokens", choice.prompt_tokens))
                    if fields.get("fill_context") and choice.limit is None and choice.prompt_tokens:
                        positions = await self._positions(model)
                        cap = fields.get("max_new_tokens")
                        choice.limit = min(positions if cap is None else cap, positions - choice.prompt_tokens,
                                           fields.get("max_total_tokens", positions) - choice.prompt_tokens)
                    choice.cached_tokens = int(d.get("prompt_cached_tokens", choice.cached_tokens))
                    if meter is not None:  # what the answer's usage says, charged as it comes (a prompt's once)
                        first = choice.lead and not prompt_known and choice.prompt_tokens
                        meter.add(choice.prompt_tokens if first else 0, new, choice.cached_tokens if first else 0)
                    if not prompt_known and ("prompt_text" in d or "prompt_token_texts" in d):  # echo: first
                        choice.echo, choice.prompt_ranked = str(d.get("prompt_text", "")), prompt_ranked(d) or []
                        if not choice.whole:
                            await events.put((choice, choice.echo, choice.prompt_ranked))
                    if choice.discard:  # echo with max_tokens 0: the prompt alone
                        choice.finish_reason = "length"
                        await events.put((choice, None, []))
                        return
                    rows = ranked(d)
                    if choice.whole:
                        choice.ranked += rows
                    text = choice.add(d.get("text_output", ""))
                    await events.put((choice, text, rows))
                    if choice.finish_reason == "stop":  # a stop string: the rest is not wanted
                        await events.put((choice, None, []))
                        return
            await events.put((choice, None, []))
        except OpenAIError as e:
            if e.code == "model_not_found" and target.adapter is not None:
                self.adapters.forget(model)  # NAME_llm says the adapter is not loaded: its list is asked again
                e = OpenAIError(404, f"the model '{target.adapter.id}' does not exist: {e.message}", "model",
                                code="model_not_found")
            await events.put(_prompt_named(e, choice))
        except GatewayError as e:
            await events.put(_prompt_named(_upstream_error(e.status, orjson.dumps({"error": e.message}), model,
                                                           "messages" in fields, grammar_param), choice))
        except UnsafeRequest as e:
            await events.put(OpenAIError(400, str(e)))
        except (UpstreamUnavailable, UpstreamTimeout) as e:
            await events.put(OpenAIError(503, str(e), kind="server_error"))
        except Exception as e:  # noqa: BLE001 (a defect here must end the request, not leave it waiting)
            await events.put(OpenAIError(500, f"gateway error: {type(e).__name__}: {e}", kind="server_error"))


@dataclass(frozen=True, slots=True)
class Target:
    """What a request's `model` names: a family (its NAME_llm answers) and the adapter it runs with, if any."""

    base: str
    adapter: ServedAdapter | None

    @property
    def name(self) -> str:
        """The full model name: BASE, or BASE:ADAPTER."""
        return self.adapter.id if self.adapter is not None else self.base

    def fields(self) -> dict:
        """NAME_llm's request parameter that picks the adapter."""
        return {"adapter": self.adapter.name} if self.adapter is not None else {}


def _adapter_error(e: AdapterRefused) -> OpenAIError:
    """A refused adapter request in OpenAI's shape (a name that is not loaded: 404, model_not_found)."""
    if e.status == 404:
        return OpenAIError(404, e.message, "lora_name", code="model_not_found")
    return OpenAIError(e.status, e.message, kind="server_error" if e.status >= 500 else "invalid_request_error")


def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:.1f}"


def _model_object(name: str) -> dict:
    return {"id": name, "object": "model", "created": 0, "owned_by": "dstool"}


def _prompt_named(e: OpenAIError, choice: Choice) -> OpenAIError:
    """NAME_llm's words for a completion's prompt (text_input, input_ids) as the client named it: `prompt`, or
    `prompt[i]` in a batch."""
    for name in ("input_ids", "text_input"):
        if e.message.startswith(name):
            return OpenAIError(e.status, choice.prompt_name + e.message[len(name):], "prompt", e.kind, e.code)
    return e


def _given(model: str, principal: Principal | None) -> None:
    """OpenAIError (404, as OpenAI words it) unless the key (when there is one) is given `model`."""
    if principal is not None and not principal.allows(model):
        raise OpenAIError(404, f"The model '{model}' does not exist or you do not have access to it.", "model",
                          code="model_not_found")


def refused(e: Refused) -> HttpResponse:
    """The guard's refusal in OpenAI's error shape, with its headers (Retry-After, x-ratelimit-*)."""
    response = error_response(OpenAIError(e.status, e.message, kind=e.kind, code=e.code))
    response.headers += e.headers
    return response


def _stream_parts(reply: Reply, choice: Choice, text: str, rows: list[Ranked], final: bool = False) -> list[Delta]:
    """The deltas that new text of a choice makes: its thinking as reasoning deltas (with a reasoning parser), its
    text as content, or (with tools) the content and tool-call deltas read from it — a named function's arguments as
    they come (its id and name first), each call of `required` or `auto` once it is complete. `final`: the choice's
    last text."""
    thought = []
    if choice.reasoning is not None:
        more, text = choice.reasoning.feed(text)
        if final:
            last, rest = choice.reasoning.end()
            more, text = more + last, text + rest
        if more:
            thought.append(reply.delta(choice.index, None, thought=more))
    return thought + _answer_parts(reply, choice, text, rows)


def _answer_parts(reply: Reply, choice: Choice, text: str, rows: list[Ranked]) -> list[Delta]:
    if choice.calls is None:
        return [reply.delta(choice.index, text, rows=rows)] if text or (reply.logprobs and rows) else []
    before = len(choice.calls.calls)
    named = choice.calls.mode not in ("auto", "required")
    content, found, arguments = choice.calls.feed(text)
    parts = []
    if content or (reply.logprobs and rows and not (found or arguments)):
        parts.append(reply.delta(choice.index, content or None, rows=rows))
        rows = []
    if named and (arguments or not choice.calls.announced):
        call = choice.calls.calls[0]
        delta = CallDelta(0, arguments, call.id, call.name) if not choice.calls.announced else CallDelta(0, arguments)
        choice.calls.announced = True
        parts.append(reply.delta(choice.index, None, rows=rows, calls=(delta,)))
    elif found:
        parts.append(reply.delta(choice.index, None, rows=rows, calls=tuple(
            CallDelta(before + i, call.arguments, call.id, call.name) for i, call in enumerate(found))))
    return parts


def _upstream_error(status: int, body: bytes, model: str, chat: bool, grammar_param: str | None = None
                    ) -> OpenAIError:
    """An error from Triton or the model (a KServe error body, or an error event of a stream) in OpenAI's shape,
    the engine's names for fields as the client named them (its grammar as `grammar_param`); a request longer than
    the model's positions as OpenAI words it (code context_length_exceeded)."""
    text = body.decode("utf-8", "replace")
    d = data(body) if body.startswith(b"data: ") else None
    if d is None:
        try:
            d = orjson.loads(body)
        except orjson.JSONDecodeError:
            d = None
    message = str(d.get("error") or text) if isinstance(d, dict) else text
    if backend_fault(message):  # whatever status Triton gave it
        return OpenAIError(503, message, kind="server_error")
    if not_loaded(message):  # NAME_llm's UnknownAdapter
        return OpenAIError(404, message, "model", code="model_not_found")
    if status == 404 or "unknown model" in message or "is not found" in message:
        return OpenAIError(404, f"the model '{model}' does not exist (GET /v1/models lists the served ones)", "model",
                           code="model_not_found")
    too_long = ContextTooLong.read(message)
    if too_long is not None:
        prompt, new, positions = too_long.prompt, too_long.new, too_long.positions
        where = "messages" if chat else "prompt"
        return OpenAIError(400, f"This model's maximum context length is {positions} tokens. However, you requested "
                                f"{prompt + new} tokens ({prompt} in the {where}, {new} in the completion). Please "
                                f"reduce the length of the {where} or completion.", where,
                           code=too_long.code)
    message = message.replace("max_new_tokens", "max_tokens")
    at = message.find("structured_outputs")
    if grammar_param and at >= 0 and status < 500:
        return OpenAIError(400, message[:at] + GRAMMAR_SUBJECT.sub(f"'{grammar_param}'", message[at:], count=1),
                           grammar_param)
    head = message.split(" ", 1)[0]
    param = head if head in ("max_tokens", "prompt", "messages", "logprobs", "tools") or head in SAMPLING else None
    if status >= 500:
        return OpenAIError(502, message, kind="server_error")
    return OpenAIError(400, message, param)
