"""The OpenAI API on the gateway's HTTP port: /v1/models, /v1/completions, /v1/chat/completions and /v1/responses
(responses.py: run as the chat completion it asks for; stored, continued, read and run in the background by
stored.py), served by a model family's NAME_llm (the streaming,
continuous-batching model) through Triton's generate extension. Structured outputs (response_format, vLLM's
guided_* and structured_outputs) are NAME_llm's grammar; tools (tools.py) are shown to the model, a forced call is
made under its schema, and the text is read back as tool calls.

`model` is the family's name (`dstool_lm`: its NAME_llm answers). Sampling parameters go to the model as they
are (temperature — OpenAI's default 1 —, top_p, seed, presence/frequency_penalty, and vLLM's top_k, min_p,
repetition_penalty); `max_tokens` (or `max_completion_tokens`) is max_new_tokens; `stop` strings end a choice
here, the text cut before them; `n` choices run side by side (with a seed, choice i uses seed + i, modulo 2**63);
`stream`
answers with server-sent events ending in `[DONE]`. Requests are typed (protocol.py): a mistake, an unknown field or
one not served is a 400 naming it, in OpenAI's form. A client that hangs up, streamed or not, cancels its choices
on Triton; a slow reader holds at most EVENTS_AHEAD events here. The gateway's bearer token, when set, is the API
key; with --auth keys, a tenant's key (http.py admits it): /v1/models lists its models only, its answers are cached
in its tenant's scope and its tokens charged as they come (Meter).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson

from dstool.serve.gateway import deepseek
from dstool.serve.gateway.auth import Principal
from dstool.serve.gateway.generation import GenerationCache, data
from dstool.serve.gateway.guard import Guard, Meter, Refused, estimated_tokens
from dstool.serve.gateway.protocol import (
    GRAMMAR_SUBJECT,
    SAMPLING,
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    Stops,
    parse,
)
from dstool.serve.gateway.stored import MemoryResponses, ResponsesRoutes
from dstool.serve.gateway.tensors import GatewayError, backend_fault
from dstool.serve.gateway.tools import Calls
from dstool.serve.gateway.transport import HttpRequest, HttpResponse, StreamingResponse, opts_out
from dstool.serve.gateway.upstream import UnsafeRequest, UpstreamTimeout, UpstreamUnavailable

# how the engine words a request longer than the model's positions (sampling.request_choices)
TOO_LONG = re.compile(r"prompt \((\d+) tokens\) \+ max_new_tokens \((\d+)\) exceed the model's (\d+) positions")
# Events the choices of one request may get ahead of the client by: past it they stop reading from Triton (and
# Triton's sending waits), so a slow reader holds a bounded amount here.
EVENTS_AHEAD = 64


def error_response(e: OpenAIError) -> HttpResponse:
    return HttpResponse(e.status, [e.body()], [("Content-Type", "application/json")])


@dataclass(slots=True)
class Ranked:
    """One generated token's text and log-probability, and the most likely alternatives'."""

    token: str
    logprob: float
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
            "top_logprobs": [{**dict(r.top), r.token: r.logprob} for r in rows], "text_offset": offsets}


class Choice:
    """One choice's text as it comes from the model, cut at the first stop string, and (for an answer sent whole,
    `whole`) its tokens' logprobs; a stream's go out as they come and are not kept. A stop string that cuts an
    answer under a grammar leaves it unfinished (not in the grammar, not a complete call): its finish reason is
    `length`, as when max_tokens cuts it."""

    def __init__(self, index: int, stops: Stops, whole: bool = True, calls: Calls | None = None):
        self.index, self.stops, self.text, self.sent, self.tokens, self.whole = index, stops, "", 0, 0, whole
        self.calls = calls  # the text read as tool calls, when the request has tools
        self.reasoning: deepseek.Reasoning | None = None  # the text split into thinking and answer (--reasoning-parser)
        self.ranked: list[Ranked] = []
        self.prompt_tokens = self.cached_tokens = 0  # the prompt's tokens, and those the engine's prefix cache held
        self.finish_reason: str | None = None
        self.hold = max((len(s) for s in stops), default=1) - 1  # characters that may begin a stop string

    def add(self, text: str) -> str:
        """Take the model's next text; what can be sent now."""
        self.text += text
        for stop in self.stops:
            at = self.text.find(stop)
            if at >= 0:
                self.text, self.finish_reason = self.text[:at], "stop"
        upto = len(self.text) if self.finish_reason else max(self.sent, len(self.text) - self.hold)
        new, self.sent = self.text[self.sent:upto], upto
        return new

    def end(self, max_tokens: int) -> str:
        if self.finish_reason is None:
            self.finish_reason = "length" if self.tokens >= max_tokens else "stop"
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
        completion = sum(c.tokens for c in self.choices)
        prompt = self.choices[0].prompt_tokens
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": self.choices[0].cached_tokens}}

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
                message["content"] = content or None
                named = c.calls.mode not in ("auto", "required")
                if c.calls.calls and not (named and c.finish_reason == "length"):  # a named call cut short is none
                    message["tool_calls"] = [call.whole() for call in c.calls.calls]
                    c.finish_reason = "tool_calls" if c.finish_reason == "stop" else c.finish_reason
            rows.append({"index": c.index, "message": message, "logprobs": lp,
                         "finish_reason": c.finish_reason} if self.chat else
                        {"index": c.index, "text": c.text, "logprobs": lp, "finish_reason": c.finish_reason})
        return {"id": self.ident, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": rows, "usage": self.usage()}

    def chunk(self, index: int, text: str | None, finish: str | None, role: bool = False,
              rows: list[Ranked] | None = None, calls: list[dict] | None = None, thought: str | None = None) -> bytes:
        lp = None
        if self.logprobs and rows:
            lp = logprobs_field(self.chat, rows, self.offsets[index])
            self.offsets[index] += sum(len(r.token) for r in rows)
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {} if text is None else \
                {"content": text}
            if calls:
                delta["tool_calls"] = calls
            if thought:  # thinking, under both names vLLM has used (reasoning_content, reasoning)
                delta = {"reasoning_content": thought, "reasoning": thought}
            row = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        else:
            row = {"index": index, "text": text or "", "logprobs": lp, "finish_reason": finish}
        return self._event({"choices": [row]})

    def usage_chunk(self) -> bytes:
        return self._event({"choices": [], "usage": self.usage()})

    def _event(self, fields: dict) -> bytes:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return b"data: " + orjson.dumps({"id": self.ident, "object": kind, "created": self.created,
                                         "model": self.model, **fields}) + b"\n\n"


class OpenAIFrontend:
    reasoning_parser: str | None = None  # --reasoning-parser (deepseek.py), set by the gateway
    tool_call_parser: str = "hermes"  # --tool-call-parser

    def __init__(self, upstreams, generation: GenerationCache, guard: Guard | None = None,
                 shared_models: frozenset[str] = frozenset(), default_max_tokens: int = 16):
        self.upstreams = upstreams
        self.generation = generation
        self.guard = guard
        self.shared_models = shared_models
        self.default_max_tokens = default_max_tokens
        self.choices: set[asyncio.Task] = set()  # held until done: the loop keeps only weak references to tasks
        self.responses = ResponsesRoutes(MemoryResponses(), self._chat)  # the gateway gives it its Redis store

    async def handle(self, req: HttpRequest):
        try:
            if req.path == "/v1/models" and req.method == "GET":
                return await self._models(req.principal)
            if req.path == "/v1/responses" or req.path.startswith("/v1/responses/"):
                return await self.responses.handle(req)
            if req.path in ("/v1/completions", "/v1/chat/completions"):
                if req.method != "POST":
                    raise OpenAIError(405, f"use POST for {req.path}")
                request = parse(req.body, ChatCompletionRequest if req.path == "/v1/chat/completions" else
                                CompletionRequest)
                _given(request.model, req.principal)  # before any work on what the request asks
                await request.check_grammars()
                return await self._complete(request, opts_out(req), req.principal)
            if req.path == "/v1/embeddings":
                raise OpenAIError(404, "no route /v1/embeddings: dstool serves causal language models, whose hidden "
                                       "states are no trained embedding (docs/structured-outputs.md)")
            raise OpenAIError(404, f"no route {req.method} {req.path}: the API has /v1/models, /v1/completions, "
                                   "/v1/chat/completions and /v1/responses")
        except OpenAIError as e:
            return error_response(e)
        except Refused as e:
            return refused(e)
        except (UpstreamUnavailable, UpstreamTimeout) as e:
            return error_response(OpenAIError(503, str(e), kind="server_error"))

    async def _models(self, principal: Principal | None) -> HttpResponse:
        r = await self.upstreams.request("POST", "/v2/repository/index", b"{}", (("Content-Type", "application/json"),))
        if r.status != 200:
            raise OpenAIError(502, f"Triton answered {r.status} to its repository index", kind="server_error")
        names = sorted(m["name"][:-len("_llm")] for m in orjson.loads(r.body)
                       if m.get("name", "").endswith("_llm") and m.get("state") == "READY" and
                       (principal is None or principal.allows(m["name"])))
        data = [{"id": n, "object": "model", "created": 0, "owned_by": "dstool"} for n in names]
        return HttpResponse(200, [orjson.dumps({"object": "list", "data": data})],
                            [("Content-Type", "application/json")])

    async def _chat(self, body: dict, req: HttpRequest):
        """The chat completion a Responses request asks for (stored.py), as req's principal: its answer."""
        request = parse(orjson.dumps(body), ChatCompletionRequest)
        _given(request.model, req.principal)
        await request.check_grammars()
        return await self._complete(request, opts_out(req), req.principal)

    async def _complete(self, request, opt_out: bool, principal: Principal | None = None):
        """A completion or chat completion request, validated: its answer, whole or streamed; with `principal` (a
        tenant's key), from its tenant's cache scope, its tokens charged as they come."""
        chat = isinstance(request, ChatCompletionRequest)
        meter = self.guard.meter(principal) if self.guard is not None and principal is not None else None
        scope = principal.scope(request.model, self.shared_models) if principal is not None else ""
        max_tokens = request.max_new_tokens or self.default_max_tokens
        if meter is not None:  # its tenant's turn for its choices, and the most it may use, before anything runs
            await meter.start(request.n, estimated_tokens(request.prompt_bytes()) + request.n * max_tokens)
        tooled = chat and request.tool_mode != "none"
        choices = [Choice(i, request.stop, whole=not request.stream,
                          calls=deepseek.tool_calls(self.tool_call_parser, request.tool_list, request.tool_mode,
                                                    request.parallel_tool_calls is not False)
                          if tooled else None)
                   for i in range(request.n)]
        thinking = chat and deepseek.thinks(self.reasoning_parser, getattr(request, "chat_template_kwargs", None))
        thinks: dict = {}
        if thinking:
            if request.structured is not None:  # NAME_llm lets the model think before the grammar applies
                thinks["reasoning_parser"] = "deepseek_r1"
            for c in choices:
                c.reasoning = deepseek.Reasoning()
        events: asyncio.Queue = asyncio.Queue(EVENTS_AHEAD)
        tasks = [asyncio.ensure_future(self._run(request.model, {**request.fields(c.index),
                                                                 "max_new_tokens": max_tokens, **thinks}, c, events,
                                                 opt_out,
                                                 scope, meter, request.structured_param))
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
            if request.stream:
                handed_over = True  # the stream's end (or the client's) stops the choices
                return StreamingResponse(200, [("Content-Type", "text/event-stream"), ("Cache-Control", "no-cache")],
                                         self._sse(first, events, reply), stop)
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
        return HttpResponse(200, [orjson.dumps(reply.whole())], [("Content-Type", "application/json")])

    @staticmethod
    async def _sse(event, events: asyncio.Queue, reply: Reply) -> AsyncIterator[bytes]:
        """The stream of `reply` from its first event on: a role chunk per choice (chat), the text as it comes, each
        choice's finish, the usage chunk when asked, [DONE]; an error after the first event ends it as an error
        event."""
        if reply.chat:
            for c in reply.choices:
                yield reply.chunk(c.index, None, None, role=True)
        done = 0
        while True:
            if isinstance(event, OpenAIError):
                yield b"data: " + orjson.dumps({"error": {"message": event.message, "type": event.kind,
                                                          "param": event.param, "code": event.code}}) + b"\n\n"
                break
            choice, text, rows = event
            if text is None:
                rest = choice.end(reply.max_tokens)
                for part in _stream_parts(reply, choice, rest, [], final=True):
                    yield part
                if choice.calls is not None:
                    rest = choice.calls.end()
                    if rest:
                        yield reply.chunk(choice.index, rest, None)
                    if choice.calls.calls and choice.finish_reason == "stop":
                        choice.finish_reason = "tool_calls"
                yield reply.chunk(choice.index, None if reply.chat else "", choice.finish_reason)
                done += 1
                if done == len(reply.choices):
                    break
            else:
                for part in _stream_parts(reply, choice, text, rows):
                    yield part
            event = await events.get()
        if reply.include_usage:
            yield reply.usage_chunk()
        yield b"data: [DONE]\n\n"

    async def _run(self, model: str, fields: dict, choice: Choice, events: asyncio.Queue, opt_out: bool,
                   scope: str = "", meter: Meter | None = None, grammar_param: str | None = None) -> None:
        """One choice through Triton's generate_stream: (choice, new text) events, then (choice, None); the engine's
        errors about the grammar name `grammar_param`, the field the client sent it in."""
        try:
            g = await self.generation.open(f"{model}_llm", "", "generate_stream", fields, opt_out=opt_out,
                                           protocol="openai", scope=scope,
                                           tenant=meter.principal.tenant if meter is not None else "")
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
                    new = len(_listed(d.get("output_ids"))) or 1  # several with a stream interval
                    choice.tokens += new
                    prompt_known = choice.prompt_tokens
                    choice.prompt_tokens = int(d.get("prompt_tokens", choice.prompt_tokens))
                    choice.cached_tokens = int(d.get("prompt_cached_tokens", choice.cached_tokens))
                    if meter is not None:  # what the answer's usage says, charged as it comes
                        first = choice.index == 0 and not prompt_known and choice.prompt_tokens
                        meter.add(choice.prompt_tokens if first else 0, new, choice.cached_tokens if first else 0)
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
            await events.put(e)
        except GatewayError as e:
            await events.put(_upstream_error(e.status, orjson.dumps({"error": e.message}), model,
                                             "messages" in fields, grammar_param))
        except UnsafeRequest as e:
            await events.put(OpenAIError(400, str(e)))
        except (UpstreamUnavailable, UpstreamTimeout) as e:
            await events.put(OpenAIError(503, str(e), kind="server_error"))
        except Exception as e:  # noqa: BLE001 (a defect here must end the request, not leave it waiting)
            await events.put(OpenAIError(500, f"gateway error: {type(e).__name__}: {e}", kind="server_error"))


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


def _stream_parts(reply: Reply, choice: Choice, text: str, rows: list[Ranked], final: bool = False) -> list[bytes]:
    """The chunks that new text of a choice makes: its thinking as reasoning deltas (with a reasoning parser), its
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
            thought.append(reply.chunk(choice.index, None, None, thought=more))
    return thought + _answer_parts(reply, choice, text, rows)


def _answer_parts(reply: Reply, choice: Choice, text: str, rows: list[Ranked]) -> list[bytes]:
    if choice.calls is None:
        return [reply.chunk(choice.index, text, None, rows=rows)] if text or (reply.logprobs and rows) else []
    before = len(choice.calls.calls)
    named = choice.calls.mode not in ("auto", "required")
    content, found, arguments = choice.calls.feed(text)
    parts = []
    if content or (reply.logprobs and rows and not (found or arguments)):
        parts.append(reply.chunk(choice.index, content or None, None, rows=rows))
        rows = []
    if named and (arguments or not choice.calls.announced):
        call = choice.calls.calls[0]
        delta: dict = {"index": 0, "function": {"arguments": arguments}}
        if not choice.calls.announced:
            delta = {"index": 0, "id": call.id, "type": "function", "function": {"name": call.name,
                                                                                 "arguments": arguments}}
            choice.calls.announced = True
        parts.append(reply.chunk(choice.index, None, None, rows=rows, calls=[delta]))
    elif found:
        parts.append(reply.chunk(choice.index, None, None, rows=rows, calls=[
            {"index": before + i, **call.whole()} for i, call in enumerate(found)]))
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
    if status == 404 or "unknown model" in message or "is not found" in message:
        return OpenAIError(404, f"the model '{model}' does not exist (GET /v1/models lists the served ones)", "model",
                           code="model_not_found")
    too_long = TOO_LONG.match(message)
    if too_long:
        prompt, new, positions = (int(g) for g in too_long.groups())
        where = "messages" if chat else "prompt"
        return OpenAIError(400, f"This model's maximum context length is {positions} tokens. However, you requested "
                                f"{prompt + new} tokens ({prompt} in the {where}, {new} in the completion). Please "
                                f"reduce the length of the {where} or completion.", where,
                           code="context_length_exceeded")
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
