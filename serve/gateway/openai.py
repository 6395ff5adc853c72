"""The OpenAI API on the gateway's HTTP port: /v1/models, /v1/completions and /v1/chat/completions, served by a
model family's NAME_llm (the streaming, continuous-batching model) through Triton's generate extension.

`model` is the family's name (`dstool_lm`: its NAME_llm answers). Sampling parameters go to the model as they
are (temperature — OpenAI's default 1 —, top_p, seed, presence/frequency_penalty, and vLLM's top_k, min_p,
repetition_penalty); `max_tokens` (or `max_completion_tokens`) is max_new_tokens; `stop` strings end a choice
here, the text cut before them; `n` choices run side by side (with a seed, choice i uses seed + i); `stream`
answers with server-sent events ending in `[DONE]`. Errors come in OpenAI's form. The gateway's bearer token,
when set, is the API key.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import orjson

from dstool.serve.gateway.generation import GenerationCache, data
from dstool.serve.gateway.http import HttpRequest, HttpResponse, StreamingResponse, opts_out
from dstool.serve.gateway.upstream import UpstreamTimeout, UpstreamUnavailable

PASSED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
          "ignore_eos")
# fields this server does not serve yet, with the values that ask for nothing
UNSUPPORTED: dict[str, tuple] = {
    "echo": (None, False), "suffix": (None, ""),
    "best_of": (None, 1), "logit_bias": (None, {}), "tools": (None, []), "functions": (None, [])}


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def response(self) -> HttpResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": "model_not_found" if self.status == 404 else None}}
        return HttpResponse(self.status, [orjson.dumps(body)], [("Content-Type", "application/json")])


MAX_LOGPROBS = 20  # alternatives per token (OpenAI's limit for chat; vLLM's for completions too)


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
    """One choice's text as it comes from the model, cut at the first stop string, and its tokens' logprobs."""

    def __init__(self, index: int, stops: list[str]):
        self.index, self.stops, self.text, self.sent, self.tokens = index, stops, "", 0, 0
        self.ranked: list[Ranked] = []
        self.prompt_tokens = 0
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
        new, self.sent = self.text[self.sent:], len(self.text)
        return new


class OpenAIFrontend:
    def __init__(self, upstreams, generation: GenerationCache, default_max_tokens: int = 16):
        self.upstreams = upstreams
        self.generation = generation
        self.default_max_tokens = default_max_tokens

    async def handle(self, req: HttpRequest):
        try:
            if req.path == "/v1/models" and req.method == "GET":
                return await self._models()
            if req.path in ("/v1/completions", "/v1/chat/completions"):
                if req.method != "POST":
                    raise OpenAIError(405, f"use POST for {req.path}")
                return await self._complete(req, chat=req.path == "/v1/chat/completions")
            raise OpenAIError(404, f"no route {req.method} {req.path}: the API has /v1/models, /v1/completions and "
                                   "/v1/chat/completions")
        except OpenAIError as e:
            return e.response()
        except (UpstreamUnavailable, UpstreamTimeout) as e:
            return OpenAIError(503, str(e), kind="server_error").response()

    async def _models(self) -> HttpResponse:
        r = await self.upstreams.request("POST", "/v2/repository/index", b"{}", (("Content-Type", "application/json"),))
        if r.status != 200:
            raise OpenAIError(502, f"Triton answered {r.status} to its repository index", kind="server_error")
        names = sorted(m["name"][:-len("_llm")] for m in orjson.loads(r.body)
                       if m.get("name", "").endswith("_llm") and m.get("state") == "READY")
        data = [{"id": n, "object": "model", "created": 0, "owned_by": "dstool"} for n in names]
        return HttpResponse(200, [orjson.dumps({"object": "list", "data": data})],
                            [("Content-Type", "application/json")])

    def _request(self, req: HttpRequest, chat: bool) -> tuple[str, dict, int, int, list[str], bool, dict]:
        try:
            body = orjson.loads(req.body)
        except orjson.JSONDecodeError as e:
            raise OpenAIError(400, f"the body is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise OpenAIError(400, "the body must be a JSON object")
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise OpenAIError(400, "'model' is required: a model family's name (GET /v1/models lists them)", "model")
        for name, allowed in UNSUPPORTED.items():
            if body.get(name) not in allowed:
                raise OpenAIError(400, f"'{name}' is not supported by this server", name)
        fields: dict[str, object] = {}
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in messages):
                raise OpenAIError(400, "'messages' must be a non-empty list of {role, content} with text content",
                                  "messages")
            fields["messages"] = orjson.dumps([{"role": m["role"], "content": m["content"]} for m in messages]).decode()
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]
            if not isinstance(prompt, str):
                raise OpenAIError(400, "'prompt' must be a string (or a list of one string)", "prompt")
            fields["text_input"] = prompt
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        max_tokens = self.default_max_tokens if max_tokens is None else max_tokens
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise OpenAIError(400, f"'max_tokens' must be a positive integer, got {max_tokens!r}", "max_tokens")
        n = body.get("n", 1)
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 16:
            raise OpenAIError(400, f"'n' must be an integer from 1 to 16, got {n!r}", "n")
        stop = body.get("stop")
        stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
        if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) and s for s in stops):
            raise OpenAIError(400, "'stop' must be a string or a list of up to 4 non-empty strings", "stop")
        fields.update({"max_new_tokens": max_tokens, "stream": True, "temperature": body.get("temperature", 1.0)})
        fields.update({k: body[k] for k in PASSED[1:] if body.get(k) is not None})
        if body.get("seed") is not None:
            fields["seed"] = body["seed"]
        logprobs, top = body.get("logprobs"), body.get("top_logprobs")
        if chat:
            if logprobs is not None and not isinstance(logprobs, bool):
                raise OpenAIError(400, f"'logprobs' must be true or false, got {logprobs!r}", "logprobs")
            if top is not None and not logprobs:
                raise OpenAIError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
            logprobs, name = (top or 0) if logprobs else None, "top_logprobs"
        else:
            name = "logprobs"
        if logprobs is not None:
            if isinstance(logprobs, bool) or not isinstance(logprobs, int) or not 0 <= logprobs <= MAX_LOGPROBS:
                raise OpenAIError(400, f"'{name}' must be an integer from 0 to {MAX_LOGPROBS}, got {logprobs!r}", name)
            fields["logprobs"] = logprobs
        options = body.get("stream_options") or {}
        return model, fields, max_tokens, n, stops, bool(body.get("stream", False)), options

    async def _complete(self, req: HttpRequest, chat: bool):
        model, fields, max_tokens, n, stops, stream, options = self._request(req, chat)
        choices = [Choice(i, stops) for i in range(n)]
        events: asyncio.Queue = asyncio.Queue()
        opt_out = opts_out(req)
        tasks = [asyncio.ensure_future(self._run(model, fields, c, events, opt_out)) for c in choices]
        first = await events.get()  # the first event, or an error before anything was generated
        if isinstance(first, OpenAIError):
            for t in tasks:
                t.cancel()
            raise first
        ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        if stream:
            return StreamingResponse(200, [("Content-Type", "text/event-stream"), ("Cache-Control", "no-cache")],
                                     self._sse(first, events, tasks, choices, max_tokens, chat, ident, created, model,
                                               bool(options.get("include_usage")), "logprobs" in fields))
        done = 0
        event = first
        while True:
            if isinstance(event, OpenAIError):
                raise event
            if event[1] is None:
                done += 1
                if done == n:
                    break
            event = await events.get()
        usage = self._usage(choices)
        rows = []
        asked = "logprobs" in fields
        for c in choices:
            c.end(max_tokens)
            lp = logprobs_field(chat, c.ranked) if asked else None
            rows.append({"index": c.index, "message": {"role": "assistant", "content": c.text}, "logprobs": lp,
                         "finish_reason": c.finish_reason} if chat else
                        {"index": c.index, "text": c.text, "logprobs": lp, "finish_reason": c.finish_reason})
        body = {"id": ident, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": model, "choices": rows, "usage": usage}
        return HttpResponse(200, [orjson.dumps(body)], [("Content-Type", "application/json")])

    @staticmethod
    def _usage(choices: list[Choice]) -> dict:
        completion = sum(c.tokens for c in choices)
        prompt = choices[0].prompt_tokens
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    async def _sse(self, event, events, tasks, choices, max_tokens, chat, ident, created, model,
                   include_usage, asked) -> AsyncIterator[bytes]:
        kind = "chat.completion.chunk" if chat else "text_completion"
        offsets = {c.index: 0 for c in choices}  # each choice's text offset so far, for completions' logprobs

        def chunk(index: int, text: str | None, finish: str | None, role: bool = False,
                  rows: list[Ranked] | None = None) -> bytes:
            lp = None
            if asked and rows:
                lp = logprobs_field(chat, rows, offsets[index])
                offsets[index] += sum(len(r.token) for r in rows)
            if chat:
                delta = {"role": "assistant", "content": ""} if role else {} if text is None else {"content": text}
                row = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
            else:
                row = {"index": index, "text": text or "", "logprobs": lp, "finish_reason": finish}
            return b"data: " + orjson.dumps({"id": ident, "object": kind, "created": created, "model": model,
                                             "choices": [row]}) + b"\n\n"

        try:
            if chat:
                for c in choices:
                    yield chunk(c.index, None, None, role=True)
            done = 0
            while True:
                if isinstance(event, OpenAIError):
                    yield b"data: " + orjson.dumps({"error": {"message": event.message, "type": event.kind}}) + b"\n\n"
                    break
                choice, text, rows = event
                if text is None:
                    rest = choice.end(max_tokens)
                    if rest:
                        yield chunk(choice.index, rest, None)
                    yield chunk(choice.index, None if chat else "", choice.finish_reason)
                    done += 1
                    if done == len(choices):
                        break
                elif text or (asked and rows):
                    yield chunk(choice.index, text, None, rows=rows)
                event = await events.get()
            if include_usage:
                yield b"data: " + orjson.dumps({"id": ident, "object": kind, "created": created, "model": model,
                                                 "choices": [], "usage": self._usage(choices)}) + b"\n\n"
            yield b"data: [DONE]\n\n"
        finally:
            for t in tasks:
                t.cancel()

    async def _run(self, model: str, fields: dict, choice: Choice, events: asyncio.Queue, opt_out: bool) -> None:
        """One choice through Triton's generate_stream: (choice, new text) events, then (choice, None)."""
        fields = dict(fields)
        if "seed" in fields and choice.index:
            fields["seed"] = fields["seed"] + choice.index if isinstance(fields["seed"], int) else fields["seed"]
        try:
            g = await self.generation.open(f"{model}_llm", "", "generate_stream", orjson.dumps(fields),
                                           opt_out=opt_out, protocol="openai")
            if g.status != 200:
                body = b"".join([e async for e in g.events])
                raise _upstream_error(g.status, body, model)
            async with contextlib.aclosing(g.events) as stream:
                async for event in stream:
                    d = data(event)
                    if d is None:
                        continue
                    if "error" in d:
                        raise _upstream_error(400, orjson.dumps(d), model)
                    choice.tokens += 1
                    choice.prompt_tokens = int(d.get("prompt_tokens", 0))
                    rows = ranked(d)
                    choice.ranked += rows
                    text = choice.add(d.get("text_output", ""))
                    await events.put((choice, text, rows))
                    if choice.finish_reason == "stop":  # a stop string: the rest is not wanted
                        await events.put((choice, None, []))
                        return
            await events.put((choice, None, []))
        except OpenAIError as e:
            await events.put(e)
        except (UpstreamUnavailable, UpstreamTimeout) as e:
            await events.put(OpenAIError(503, str(e), kind="server_error"))
        except Exception as e:  # noqa: BLE001 (a defect here must end the request, not leave it waiting)
            await events.put(OpenAIError(500, f"gateway error: {type(e).__name__}: {e}", kind="server_error"))


def _upstream_error(status: int, body: bytes, model: str) -> OpenAIError:
    try:
        message = orjson.loads(body).get("error", "") or body.decode("utf-8", "replace")
    except orjson.JSONDecodeError:
        message = body.decode("utf-8", "replace")
    if status == 404 or "unknown model" in message or "is not found" in message:
        return OpenAIError(404, f"the model '{model}' does not exist (GET /v1/models lists the served ones)", "model")
    return OpenAIError(400 if status < 500 else 502, message, kind="invalid_request_error" if status < 500
                       else "server_error")
