"""Triton python-backend model (decoupled): text generation on the continuous-batching engine (engine.py beside
this file) with the decoder graph of NAME_decoder, the tokenizer in its own folder and sampling.py's choices.

text_input BYTES [1], or input_ids INT64 [-1] (a prompt as token ids, each of the vocabulary, as they are), or
messages BYTES [1] (a chat: JSON [{"role", "content", optional "name", "tool_calls",
"tool_call_id"}, ...], laid out by the tokenizer's chat template, or without one as the corpus lays out a play's
speeches: "NAME-OR-ROLE:\nCONTENT\n\n" ending in "ASSISTANT:\n"; the `tools` parameter, JSON text of OpenAI tool
objects, goes to the template or starts the layout) (+ optional max_new_tokens INT32 [1], stop_token_ids INT64 [-1],
stream BOOL [1]; sampling as request parameters, and `structured_outputs`: a grammar the answer follows, grammar.py) ->
text_output BYTES [1], output_ids INT64 [-1], prompt_tokens INT32 [1], prompt_cached_tokens INT32 [1] (the prompt's
tokens the engine's prefix cache held, not computed again: only prefixes of requests with the same `cache_salt`
parameter count). Waiting requests begin by turns of their `tenant` parameter. With `stream` true, one response per
token (the text it adds, and its id) and the last one marked final; otherwise one response with the whole text and ids.
The `echo` parameter adds the prompt's text (prompt_text) to the first response, and `prompt_logprobs` K (as vLLM's)
the prompt's tokens' texts and log-probabilities with K alternatives each (prompt_token_texts, prompt_logprobs,
prompt_top_tokens, prompt_top_logprobs; the first token has none), computed from the prompt's logits as it is
prefilled (such a prompt is computed whole, not from the prefix cache). With the `speculative_config` parameter in the
model's config (vLLM's n-gram speculative decoding, or deepseek_mtp with the MTP draft graph a DeepSeek-V3 model's
export writes under mtp/ in this folder: engine.py), the `num_speculative_tokens` request parameter lowers
the drafts per step for this request, or turns them off (0); a model without it refuses a value above 0.
A model exported with LoRA adapters (`lora` in its config: --adapter, --enable-lora) decodes each request with the
adapter its `adapter` parameter names (none: the base), rows of different adapters in one batch (adapters.py); a
control request (its `adapter_admin` parameter: JSON {"action": "list" | "load" | "unload", "name", "path"}) lists,
loads (from a folder inside the model repository) or unloads adapters — running sequences keep theirs until they end
— and its answer's text_output is the adapters loaded after it, as JSON.

`execute` only reads a request and checks its size: a prompt of more bytes than the model's positions could ever
hold is refused before anything else. Tokenizing (and the chat template) happens on intake threads, so a long
prompt holds up neither the engine nor the requests behind it. Requests join the running batch at the next decoding
step, from one engine thread. What goes to Triton (responses, metrics: each a round trip to the server process) is
handed to an outbox thread, in order, so the engine computes the next step meanwhile, at most AHEAD_STEPS steps
ahead; that thread also looks for requests whose client has gone (cancelled) every CANCEL_POLL_S, and they leave the
batch at the next step. A sequence that fails ends alone with its error; should the engine loop itself fail, what
it held ends with the error and the loop starts again (counted in dstool_llm_engine_restarts_total).
"""

import json
import os
import queue
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import onnxruntime as ort
import triton_python_backend_utils as pb_utils
from decoding.adapters import Adapter, graph_layout
from decoding.engine import MTPDrafter, PrefixCache, Sequence, SpecCounts, Speculation, engine_for
from decoding.errors import AdapterError, UnknownAdapter
from decoding.grammar import Grammars, thought_over
from decoding.sampling import FINITE, SamplingError, request_choices
from ort_options import session_options
from transformers import AutoTokenizer

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
CANCEL_POLL_S = 0.05  # how often the outbox asks Triton which requests were cancelled (a round trip each)
AHEAD_STEPS = 2  # engine steps whose calls may wait in the outbox; beyond that the engine waits for it
MAX_SALT_BYTES = 1024
MAX_STOP_CHARS = 256  # a stop string's length
MAX_TEMPLATE_KWARGS_BYTES = 4096  # chat_template_kwargs as JSON text
MAX_TEMPLATE_KWARGS = 16  # names in it
TEMPLATE_OWN = frozenset({"messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
                          "tokenize", "chat_template", "return_dict", "return_tensors", "padding", "truncation",
                          "max_length", "tokenizer_kwargs", "return_assistant_tokens_mask"})  # not the client's
REASONING_PARSERS = ("deepseek_r1",)  # the thinking a grammar waits for: <think> ... </think>
# read here, besides sampling's
OWN_PARAMETERS = frozenset({"tools", "cache_salt", "tenant", "stop", "skip_special_tokens",
                            "prompt_logprobs", "echo", "chat_template_kwargs", "reasoning_parser",
                            "num_speculative_tokens", "adapter"})
MAX_PROMPT_LOGPROBS = 20  # alternatives per prompt token, at most (as for generated ones)
SCORE_ROWS = 64  # prompt positions scored at once (a float64 block of SCORE_ROWS x vocab)


class RequestError(ValueError):
    """The client's mistake (INVALID_ARG: HTTP 400 / gRPC INVALID_ARGUMENT)."""


class Stream:
    """Where one sequence's tokens go, and (with logprobs) each token's ranked log-probabilities."""

    def __init__(self, sender, stream: bool):
        self.sender, self.stream, self.sent = sender, stream, ""
        self.ranked: list[tuple[float, np.ndarray, np.ndarray]] = []
        self.pending: list[int] = []  # streamed tokens not sent yet (the stream interval)
        self.arrived, self.arrived_step, self.started_at = time.monotonic(), 0, None
        self.first_at: float | None = None  # when its first token was made, and its latest (monotonic)
        self.last_at: float | None = None
        self.stops: list[str] = []  # its stop strings: generation ends as soon as the text holds one
        self.skip_special = True  # special tokens left out of its text
        self.echo: str | None = None  # the prompt's text, for its first response (the `echo` parameter)
        self.prompt_ranked: list[tuple[float, np.ndarray, np.ndarray]] | None = None  # with prompt_logprobs
        self.prompt_k = 0
        self.prompt_sent = False
        self.made = 0  # its tokens handled so far (a step may make several: speculative decoding)


class Outbox:
    """A thread that makes the engine's calls into Triton in the order they were posted, and every CANCEL_POLL_S
    asks which of `streams` were cancelled, handing their ids to `on_cancelled`."""

    def __init__(self, streams, on_cancelled):
        self.streams, self.on_cancelled = streams, on_cancelled
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.ahead = threading.Semaphore(AHEAD_STEPS)
        self.thread = threading.Thread(target=self._run, name="dstool-outbox", daemon=True)
        self.thread.start()

    def post(self, call, *args):
        self.queue.put((call, args))

    def end_step(self):
        """The end of one engine step's calls. Waits while AHEAD_STEPS steps are still to be made, so the engine
        never runs ahead of what its clients were sent: the outbox holds bounded memory, and a client that hangs up
        is seen while its sequence still runs (unbounded, a short sequence could end unseen)."""
        self.ahead.acquire()
        self.queue.put((self.ahead.release, ()))

    def close(self):
        """Make what was posted, then stop."""
        self.queue.put(None)
        self.thread.join(30)

    def _run(self):
        polled = time.monotonic()
        while True:
            try:
                item = self.queue.get(timeout=CANCEL_POLL_S)
            except queue.Empty:
                item = ()
            if item is None:
                return
            if item:
                call, args = item
                try:
                    call(*args)
                except Exception as e:  # noqa: BLE001 (one failed call must not stop the others)
                    pb_utils.Logger.log_error(f"dstool_llm: a call to Triton failed ({type(e).__name__}: {e})")
            if time.monotonic() - polled >= CANCEL_POLL_S:
                polled = time.monotonic()
                gone = [i for i, out in list(self.streams.items()) if _cancelled(out.sender)]
                if gone:
                    self.on_cancelled(gone)


def _cancelled(sender) -> bool:
    """Whether the request's client has gone (False for a request that has just ended: its sender is closed)."""
    try:
        return sender.is_cancelled()
    except Exception:  # noqa: BLE001
        return False


class Metrics:
    """The engine's own figures, on Triton's /metrics (the python backend's custom metrics): values read in the
    engine thread, published through the outbox (gauges only when they change).

    Beside dstool's own (dstool_llm_*, labelled model and version), the same figures under vLLM's names, label
    and buckets (vllm/v1/metrics/loggers.py), so that dashboards built for vLLM — its Grafana board among them —
    read a dstool server unchanged. Their one label, `model_name`, is the served model's name: what clients put in
    `model`, the family's name, NAME for NAME_llm (the gateway's /v1 routes send model NAME to NAME_llm). As vLLM
    counts them: time to first token from the request's arrival; inter-token latency per output token after the
    first; queue time from arrival to the step that began its prefill, prefill time from there to its first token,
    decode time from its first token to its last, end to end from arrival to its last token (these, and the
    prompt/generation lengths, observed when a request ends by stop or length); prompt tokens (the whole prompt,
    cached or not, at its first token) and generated tokens; prefix-cache queries and hits in prompt tokens
    looked up and found; requests by finished_reason (stop; length: max_new_tokens reached; abort: its client
    went away; error: its generation failed); running (prefilling or decoding) and waiting requests (paused ones
    included); KV-cache usage as the share of the engine's cache budget (max_cache_tokens) the admitted
    sequences reserve — prompt + max_new_tokens each, from admission on, where vLLM allocates blocks as tokens
    come, so it reads higher than vLLM's would for the same requests; the prefix cache's blocks only take what
    they leave, as vLLM's cached free blocks, and are not counted. With speculative decoding, vLLM v1's
    spec_decode counters (drafts, draft tokens, accepted tokens, accepted tokens by draft position) and their
    dstool_llm_spec_decode_* twins: mean accepted length = accepted / drafts + 1."""

    SECONDS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]
    # vLLM's buckets (vllm/v1/metrics/loggers.py)
    VLLM_FIRST_TOKEN = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                        20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
    VLLM_INTER_TOKEN = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                        40.0, 80.0]
    VLLM_REQUEST = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                    480.0, 960.0, 1920.0, 7680.0]
    VLLM_REASONS = ("stop", "length", "abort", "error")

    def __init__(self, model, version, max_positions, speculation=None):
        labels = {"model": model, "version": version}
        H, C, G = pb_utils.MetricFamily.HISTOGRAM, pb_utils.MetricFamily.COUNTER, pb_utils.MetricFamily.GAUGE
        self.families = [
            pb_utils.MetricFamily("dstool_llm_queue_steps", "Decoding steps that began after a request arrived and "
                                  "before the one that began its prefill (0: the next step)", H),
            pb_utils.MetricFamily("dstool_llm_queue_seconds", "Time from a request's arrival to the step that began "
                                  "its prefill", H),
            pb_utils.MetricFamily("dstool_llm_time_to_first_token_seconds", "Time from a request's arrival to its "
                                  "first token", H),
            pb_utils.MetricFamily("dstool_llm_generated_tokens_total", "Tokens generated", C),
            pb_utils.MetricFamily("dstool_llm_prompt_tokens_total", "Prompt tokens prefilled", C),
            pb_utils.MetricFamily("dstool_llm_prefix_cache_tokens_total", "Prompt tokens looked up in the prefix "
                                  "cache (result: hit, taken from it; miss, computed)", C),
            pb_utils.MetricFamily("dstool_llm_prefix_cache_hit_ratio", "Share of the prompt tokens looked up that the "
                                  "prefix cache held, since the model loaded", G),
            pb_utils.MetricFamily("dstool_llm_prefix_cache_held_tokens", "Positions the prefix cache holds", G),
            pb_utils.MetricFamily("dstool_llm_sequences", "Sequences in the engine, by state", G),
            pb_utils.MetricFamily("dstool_llm_engine_restarts_total", "Times the engine loop failed and started "
                                  "again (what it held ended with the error)", C),
            pb_utils.MetricFamily("dstool_llm_cancelled_total", "Requests whose client went away before their end: "
                                  "they left the engine at the next step", C)]
        queue_steps, queue, first, tokens, prompt, looked_up, ratio, held, sequences, restarts, cancelled = \
            self.families
        self.queue_steps = queue_steps.Metric(labels=labels, buckets=[0, 1, 2, 4, 8, 16, 32, 64])
        self.queue = queue.Metric(labels=labels, buckets=self.SECONDS)
        self.first = first.Metric(labels=labels, buckets=self.SECONDS)
        self.tokens, self.prompt = tokens.Metric(labels=labels), prompt.Metric(labels=labels)
        self.prefix_hit = looked_up.Metric(labels={**labels, "result": "hit"})
        self.prefix_miss = looked_up.Metric(labels={**labels, "result": "miss"})
        self.prefix_ratio, self.prefix_held = ratio.Metric(labels=labels), held.Metric(labels=labels)
        self.counted = (0, 0)  # the prefix cache's hits and misses on the counters so far
        self.waiting = sequences.Metric(labels={**labels, "state": "waiting"})
        self.running = sequences.Metric(labels={**labels, "state": "running"})
        self.restarts = restarts.Metric(labels=labels)
        self.cancelled = cancelled.Metric(labels=labels)
        self._vllm(model[:-len("_llm")] if model.endswith("_llm") else model, max_positions)
        self.speculative_names: list[str] = []  # the speculative counters' attributes
        if speculation is not None:
            self._speculative(labels, model[:-len("_llm")] if model.endswith("_llm") else model,
                              speculation.num_speculative_tokens)
        self.speculative_counted = SpecCounts()  # engine.spec_counts as last published
        self.post = lambda call, *args: call(*args)  # the outbox's, once there is one
        self.published: dict[str, float] = {}  # the gauges' values as last set
        self.generated = 0  # tokens made since the last step's figures went out
        self.gaps: list[float] = []  # the inter-token latencies seen since then

    def _vllm(self, served, max_positions):
        """vLLM's figures (the class's docstring), labelled model_name=`served`; the token-count buckets 1, 2, 5,
        10, ... up to the model's positions (vLLM's build_1_2_5_buckets(max_model_len))."""
        H, C, G = pb_utils.MetricFamily.HISTOGRAM, pb_utils.MetricFamily.COUNTER, pb_utils.MetricFamily.GAUGE
        label = {"model_name": served}
        lengths = [m * 10 ** e for e in range(12) for m in (1, 2, 5) if m * 10 ** e <= (max_positions or 0)]
        family = {name: pb_utils.MetricFamily(name, text, kind) for name, text, kind in (
            ("vllm:num_requests_running", "Number of requests in model execution batches.", G),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", G),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", G),
            ("vllm:prefix_cache_queries_total", "Prefix cache queries, in terms of number of queried tokens.", C),
            ("vllm:prefix_cache_hits_total", "Prefix cache hits, in terms of number of cached tokens.", C),
            ("vllm:prompt_tokens_total", "Number of prefill tokens processed.", C),
            ("vllm:generation_tokens_total", "Number of generation tokens processed.", C),
            ("vllm:request_success_total", "Count of successfully processed requests.", C),
            ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", H),
            ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", H),
            ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", H),
            ("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", H),
            ("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.", H),
            ("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.", H),
            ("vllm:request_prompt_tokens", "Number of prefill tokens processed.", H),
            ("vllm:request_generation_tokens", "Number of generation tokens processed.", H),
            ("vllm:request_max_num_generation_tokens", "Histogram of maximum number of requested generation "
             "tokens.", H))}
        self.families += family.values()

        def one(name, buckets=None):
            return family[name].Metric(labels=label, **({"buckets": buckets} if buckets is not None else {}))

        self.vllm_running, self.vllm_waiting = one("vllm:num_requests_running"), one("vllm:num_requests_waiting")
        self.vllm_kv = one("vllm:kv_cache_usage_perc")
        self.vllm_queries, self.vllm_hits = one("vllm:prefix_cache_queries_total"), one("vllm:prefix_cache_hits_total")
        self.vllm_prompt, self.vllm_generated = one("vllm:prompt_tokens_total"), one("vllm:generation_tokens_total")
        self.vllm_success = {reason: family["vllm:request_success_total"].Metric(
            labels={**label, "finished_reason": reason}) for reason in self.VLLM_REASONS}
        self.vllm_first = one("vllm:time_to_first_token_seconds", self.VLLM_FIRST_TOKEN)
        self.vllm_gap = one("vllm:inter_token_latency_seconds", self.VLLM_INTER_TOKEN)
        self.vllm_e2e, self.vllm_queue, self.vllm_prefill, self.vllm_decode = (
            one(f"vllm:{name}_seconds", self.VLLM_REQUEST)
            for name in ("e2e_request_latency", "request_queue_time", "request_prefill_time", "request_decode_time"))
        self.vllm_prompt_len = one("vllm:request_prompt_tokens", lengths)
        self.vllm_output_len = one("vllm:request_generation_tokens", lengths)
        self.vllm_most_output = one("vllm:request_max_num_generation_tokens", lengths)

    def _speculative(self, labels, served, k):
        """vLLM v1's spec_decode counters (model_name=`served`; per position 0..k-1) and dstool's twins."""
        C = pb_utils.MetricFamily.COUNTER
        families = {name: pb_utils.MetricFamily(name, text, C) for name, text in (
            ("vllm:spec_decode_num_drafts_total", "Number of spec decoding drafts."),
            ("vllm:spec_decode_num_draft_tokens_total", "Number of draft tokens."),
            ("vllm:spec_decode_num_accepted_tokens_total", "Number of accepted tokens."),
            ("vllm:spec_decode_num_accepted_tokens_per_pos_total", "Accepted tokens per draft position."),
            ("dstool_llm_spec_decode_drafts_total", "Drafts verified (speculative decoding)"),
            ("dstool_llm_spec_decode_draft_tokens_total", "Tokens drafted"),
            ("dstool_llm_spec_decode_accepted_tokens_total", "Drafted tokens accepted"))}
        self.families += families.values()
        vllm = {"model_name": served}
        for key, name in (("drafts", "num_drafts"), ("draft_tokens", "num_draft_tokens"),
                          ("accepted", "num_accepted_tokens")):
            setattr(self, f"vllm_spec_{key}", families[f"vllm:spec_decode_{name}_total"].Metric(labels=vllm))
            own = "accepted_tokens" if key == "accepted" else key
            setattr(self, f"spec_{key}", families[f"dstool_llm_spec_decode_{own}_total"].Metric(labels=labels))
            self.speculative_names += [f"vllm_spec_{key}", f"spec_{key}"]
        for i in range(k):
            setattr(self, f"vllm_spec_at_{i}", families["vllm:spec_decode_num_accepted_tokens_per_pos_total"].Metric(
                labels={**vllm, "position": str(i)}))

    def close(self):
        """The metrics before their families (the python backend's rule)."""
        for name in ("queue_steps", "queue", "first", "tokens", "prompt", "prefix_hit", "prefix_miss", "prefix_ratio",
                     "prefix_held", "waiting", "running", "restarts", "cancelled",
                     *[n for n in vars(self) if n.startswith(("vllm_", "spec_"))]):
            delattr(self, name)
        self.families.clear()

    def produced(self, sequence, out, began):
        """A sequence's next token, made in a step that began at `began` (monotonic)."""
        now = time.monotonic()
        if out.first_at is None:
            self.first_token(sequence, out, began, now)
        elif out.last_at is not None:
            self.gaps.append(now - out.last_at)
        out.last_at = now
        self.generated += 1

    def first_token(self, sequence, out, began, now=None):
        """A sequence's first token, in a step that began at `began` (monotonic)."""
        now = time.monotonic() if now is None else now
        if out.started_at is None:  # its whole prompt prefilled in this step
            out.started_at = began
        out.first_at = now
        self.post(self._first, sequence.started_step - out.arrived_step - 1, out.started_at - out.arrived,
                  now - out.arrived, len(sequence.prompt) - sequence.cached, len(sequence.prompt))

    def _first(self, steps, queued, first, prompt, whole_prompt):
        self.queue_steps.observe(steps)
        self.queue.observe(queued)
        self.first.observe(first)
        self.prompt.increment(prompt)
        self.vllm_first.observe(first)
        self.vllm_prompt.increment(whole_prompt)

    def ended(self, sequence, out):
        """A sequence that has made its last token (stop: a stop token, string or the grammar's end; length:
        max_new_tokens): its request's figures."""
        if out.first_at is None or out.last_at is None:
            return
        reason = "length" if len(sequence.output) >= sequence.max_new_tokens else "stop"
        self.post(self._ended, reason, out.last_at - out.arrived, out.started_at - out.arrived,
                  out.first_at - out.started_at, out.last_at - out.first_at, len(sequence.prompt),
                  len(sequence.output))

    def _ended(self, reason, e2e, queued, prefill, decode, prompt, output):
        self.vllm_success[reason].increment(1)
        self.vllm_e2e.observe(e2e)
        self.vllm_queue.observe(queued)
        self.vllm_prefill.observe(prefill)
        self.vllm_decode.observe(decode)
        self.vllm_prompt_len.observe(prompt)
        self.vllm_output_len.observe(output)
        self.vllm_most_output.observe(output)  # one sequence per request: the most any of its sequences made

    def cut_short(self, reason):
        """A request that ended before its last token: "abort" (its client went away) or "error"."""
        self.post(lambda: self.vllm_success[reason].increment(1))

    def count(self, name, n=1):
        self.post(lambda: getattr(self, name).increment(n))

    def step(self, engine, streams, began, tokens):
        for sequence in engine.prefilling:  # begun, its prompt still being prefilled in chunks
            out = streams.get(sequence.id)
            if out is not None and out.started_at is None and sequence.started_step == engine.steps_started:
                out.started_at = began
        counters = {"tokens": tokens, "vllm_generated": self.generated}
        gauges: dict[str, float] = {"waiting": len(engine.waiting) + len(engine.prefilling),
                                    "running": len(engine.running),
                                    "vllm_running": len(engine.running) + len(engine.prefilling),
                                    "vllm_waiting": len(engine.waiting)}
        if engine.max_cache_tokens:  # the budget the admitted sequences (and paused ones) reserve
            reserved = sum(s.reserved for s in engine.running + engine.prefilling) + \
                sum(s.reserved for s in engine.waiting if s.paused)
            gauges["vllm_kv"] = reserved / engine.max_cache_tokens
        cache = engine.prefix_cache
        if cache is not None:
            hit, miss = cache.hit, cache.looked_up - cache.hit
            counters.update(prefix_hit=hit - self.counted[0], prefix_miss=miss - self.counted[1])
            counters.update(vllm_hits=counters["prefix_hit"],
                            vllm_queries=counters["prefix_hit"] + counters["prefix_miss"])
            self.counted = (hit, miss)
            gauges.update(prefix_ratio=cache.hit / cache.looked_up if cache.looked_up else 0.0,
                          prefix_held=cache.tokens)
        if self.speculative_names:  # the engine's speculative counters, what they added since the last step
            added = engine.spec_counts.since(self.speculative_counted)
            for key in ("drafts", "draft_tokens", "accepted"):
                counters[f"vllm_spec_{key}"] = counters[f"spec_{key}"] = getattr(added, key)
            for i, n in enumerate(added.accepted_at):
                counters[f"vllm_spec_at_{i}"] = n
            self.speculative_counted = engine.spec_counts.copy()
        self.post(self._publish, counters, gauges, self.gaps)
        self.generated, self.gaps = 0, []

    def _publish(self, counters, gauges, gaps=()):
        for name, n in counters.items():
            if n:
                getattr(self, name).increment(n)
        for name, value in gauges.items():
            if self.published.get(name) != value:
                getattr(self, name).set(value)
                self.published[name] = value
        for gap in gaps:
            self.vllm_gap.observe(gap)


class Request:
    """What `execute` reads of one request, before any work: its inputs and parameters, sizes checked."""

    def __init__(self, model, request, sender):
        self.sender, self.arrived = sender, time.monotonic()
        limit = model.max_prompt_bytes
        self.prompt = _text(request, "text_input", limit, model.max_positions)
        self.ids = _ids(request, model.max_positions, model.vocab)
        self.messages = _text(request, "messages", 8 * limit, model.max_positions)  # JSON escapes, keys, roles
        if (self.prompt is not None) + (self.messages is not None) + (self.ids is not None) != 1:
            raise RequestError("send text_input (a prompt), input_ids (a prompt's token ids) or messages (a chat), "
                               "one of them")
        self.max_new_tokens, self.stop_ids = _values(request, "max_new_tokens"), _values(request, "stop_token_ids")
        self.parameters = request.parameters()  # JSON text, as Triton passes it (sampling reads it whole)
        self.text = self.prompt  # the prompt's text as the model reads it (a chat's laid out), once known
        flag = _values(request, "stream")
        self.stream = bool(flag.reshape(-1)[0]) if flag is not None and flag.size else False


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config["parameters"].items()}
        folder = os.path.join(args["model_repository"], args["model_version"])
        decoder = os.path.join(folder, params["fused_decoder"]) if "fused_decoder" in params else os.path.join(
            os.path.dirname(args["model_repository"]), params["decoder"], args["model_version"], "model.onnx")
        opts = session_options(ort)
        session = ort.InferenceSession(decoder, opts, providers=["CPUExecutionProvider"])
        shapes = {k: tuple(v) for k, v in json.loads(params["empty_cache"]).items()}
        budget = int(params["max_cache_tokens"])
        # (a repository exported before the prefix cache: none)
        prefix_tokens, block = int(params.get("prefix_cache_tokens", 0)), int(params.get("prefix_cache_block", 16))
        speculation = Speculation.parse(params["speculative_config"]) if params.get("speculative_config") else None
        mtp = [os.path.join(folder, g) for g in json.loads(params.get("mtp_graphs", "[]"))]  # DeepSeek's MTP depths
        drafter = MTPDrafter(ort.InferenceSession(mtp[0], opts, providers=["CPUExecutionProvider"])) \
            if mtp and speculation is not None and speculation.mtp else None
        self.engine = engine_for(session, shapes, int(params["max_batch"]), budget, int(params["max_prefill_tokens"]),
                                 PrefixCache(block, prefix_tokens) if prefix_tokens else None, speculation,
                                 mtp=drafter)
        self.lora = json.loads(params["lora"]) if "lora" in params else None  # adapters: max_lora_rank, max_loras
        self.layout = graph_layout(session.get_inputs())
        self.root = os.path.realpath(os.path.dirname(args["model_repository"]))  # where adapters may be loaded from
        self.adapters: dict[str, Adapter] = {}  # by name; replaced whole (intake threads read it)
        for name in (self.lora or {}).get("adapters", []):
            self._load_adapter(name, os.path.join(folder, "adapters", name))
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.vocab = len(self.tokenizer)  # token ids a prompt may hold (input_ids): those the tokenizer can read
        self.eos = set(json.loads(params["eos_token_ids"]))
        self.grammars = Grammars(self.tokenizer, self.eos)
        self.default_new_tokens = int(params["default_max_new_tokens"])
        self.max_positions = int(params["max_positions"])
        self.stream_interval = int(params.get("stream_interval", 1))
        # (a repository exported before this parameter: a bound as generous as any tokenizer's)
        self.max_prompt_bytes = int(params.get("max_prompt_bytes", 256 * self.max_positions))
        self.streams: dict[str, Stream] = {}
        self.metrics = Metrics(args["model_name"], args["model_version"], self.max_positions, speculation)
        self.incoming: list[Sequence] = []
        self.cancelled: set[str] = set()  # ids the outbox found cancelled, for the engine loop
        self.wake = threading.Condition()
        self.outbox = Outbox(self.streams, self._on_cancelled)
        self.metrics.post = self.outbox.post
        self.stopping = False
        self.intake = ThreadPoolExecutor(2, thread_name_prefix="dstool-intake")
        self.thread = self._start()

    def _start(self):
        thread = threading.Thread(target=self._serve, name="dstool-engine", daemon=True)
        thread.start()
        return thread

    def execute(self, requests):
        if not self.thread.is_alive() and not self.stopping:  # never expected (the loop restarts itself): say so
            pb_utils.Logger.log_error("dstool_llm: the engine thread had stopped; started again")
            self.thread = self._start()
        for request in requests:
            sender = request.get_response_sender()
            admin = _admin_action(request)
            if admin is not None:
                self._adapter_admin(admin, sender)
                continue
            try:
                read = Request(self, request, sender)
            except RequestError as e:
                sender.send(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError(str(e), pb_utils.TritonError.INVALID_ARG)), flags=FINAL)
                continue
            self.intake.submit(self._admit, read)
        return None

    def _admit(self, read):
        """Tokenize and check one request (an intake thread), then hand it to the engine."""
        try:
            sequence, sampler = self._sequence(read)
            stops, skip = _stops(read), _skip_special(read)
            echo, prompt_k = _prompt_asks(read)
        except RequestError as e:
            read.sender.send(pb_utils.InferenceResponse(
                error=pb_utils.TritonError(str(e), pb_utils.TritonError.INVALID_ARG)), flags=FINAL)
            return
        except Exception as e:  # noqa: BLE001 (a request that cannot be read fails alone)
            read.sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                f"could not read the request: {type(e).__name__}: {e}")), flags=FINAL)
            return
        out = Stream(read.sender, read.stream)
        out.arrived, out.stops, out.skip_special = read.arrived, stops, skip
        if echo:
            out.echo = read.text if read.text is not None else self.tokenizer.decode(sequence.prompt)
        if prompt_k is not None:  # the prompt's own log-probabilities, computed as it is prefilled
            out.prompt_ranked, out.prompt_k = [], prompt_k
            sequence.score = _prompt_scorer(sequence.prompt, prompt_k, out.prompt_ranked)
        if sampler.logprobs is not None:
            sequence.choose = _ranking(sampler, out.ranked)
        with self.wake:
            out.arrived_step = self.engine.steps_started
            self.streams[sequence.id] = out
            self.incoming.append(sequence)
            self.wake.notify()

    def _on_cancelled(self, ids):
        with self.wake:
            self.cancelled.update(ids)
            self.wake.notify()

    def finalize(self):
        with self.wake:
            self.stopping = True
            self.wake.notify()
        self.intake.shutdown(wait=True, cancel_futures=True)
        self.thread.join(30)
        for out in self.streams.values():  # unloading: what is still generating ends here, said so
            self._send(out, pb_utils.InferenceResponse(error=pb_utils.TritonError("the model is being unloaded")))
        self.streams.clear()
        self.outbox.close()
        self.metrics.close()

    def _send(self, out, response=None, flags=FINAL):
        """A response (or the final flag alone) to a request, through the outbox."""
        self.outbox.post(lambda: out.sender.send(response, flags=flags))

    def _chat_prompt(self, messages, tools, kwargs=None):
        try:
            chat = json.loads(messages)
        except (ValueError, RecursionError):
            chat = None
        if not isinstance(chat, list) or not chat or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                and isinstance(m.get("name", ""), str) for m in chat):
            raise RequestError('messages must be a JSON list of {"role": ..., "content": ..., optional "name": ...} '
                               "with text content")
        for i, m in enumerate(chat):
            unread = sorted(set(m) - {"role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content"})
            if unread:
                raise RequestError(f"messages[{i}] has {unread[0]!r}, which this model does not read: send role, "
                                   "content, name, tool_calls, tool_call_id and reasoning_content only")
        if self.tokenizer.chat_template:
            extra: dict = {**(kwargs or {}), **({"tools": tools} if tools else {})}
            if DEEPSEEK_CALL in self.tokenizer.chat_template:
                chat = deepseek_messages(chat)
            prompt = self.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True, **extra)
            named = [i for i, m in enumerate(chat) if m.get("name")]
            if named and prompt == self.tokenizer.apply_chat_template(
                    [{k: v for k, v in m.items() if k != "name"} for m in chat], tokenize=False,
                    add_generation_prompt=True, **extra):
                raise RequestError(f"messages[{named[0]}].name: this model's chat template does not use a message's "
                                   "name: leave it out")
            return prompt
        return default_layout(chat, tools)

    def _tools(self, read):
        """The request's tools parameter (JSON text of OpenAI tool objects), or None."""
        value = _parameter(read, "tools")
        if value is None:
            return None
        if isinstance(value, str) and len(value.encode()) > self.max_prompt_bytes:
            raise RequestError(f"tools is {len(value.encode())} bytes: more than the model's {self.max_positions} "
                               f"positions can hold (at most {self.max_prompt_bytes} bytes); send fewer or shorter "
                               "tools")
        try:
            tools = json.loads(value) if isinstance(value, str) else None
        except (ValueError, RecursionError):
            tools = None
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise RequestError("tools must be the JSON text of a list of tool objects "
                               '({"type": "function", "function": {"name": ..., "parameters": {...}}})')
        if read.messages is None:
            raise RequestError("tools go with messages (a chat), not text_input or input_ids")
        return tools

    def _sequence(self, read):
        tools = self._tools(read)
        ids = getattr(read, "ids", None)  # token ids, checked by execute: the prompt as they are
        if ids is None:
            try:
                prompt = read.prompt if read.messages is None else self._chat_prompt(read.messages, tools,
                                                                                     _template_kwargs(read))
            except RecursionError:
                raise RequestError("messages or tools nest too deep to lay out: send flatter JSON") from None
            if len(prompt.encode()) > self.max_prompt_bytes:  # refused untokenized: it cannot fit
                raise RequestError(f"messages are {len(prompt.encode())} bytes as the chat template lays them out: "
                                   f"more than the model's {self.max_positions} positions can hold (at most "
                                   f"{self.max_prompt_bytes} bytes); shorten the messages or tools")
            read.text = prompt
            ids = self.tokenizer(prompt)["input_ids"]
            if not ids:
                raise RequestError("text_input is empty: send at least one token of text")
        positions = min(self.max_positions, self.engine.max_cache_tokens or self.max_positions)
        try:
            new_tokens, sampler, stop_ids = request_choices(
                read.parameters, len(ids), read.max_new_tokens, self.default_new_tokens, positions, read.stop_ids,
                self.eos, self.grammars, OWN_PARAMETERS, len(self.tokenizer))
        except SamplingError as e:
            raise RequestError(str(e)) from None
        if _reasoning_parser(read) and sampler.constraint is not None and \
                not thought_over(read.text if read.ids is None else self.tokenizer.decode(read.ids)):
            sampler.constraint = self.grammars.after_thinking(sampler.constraint)  # the model thinks first
        return Sequence(uuid.uuid4().hex, ids, new_tokens, sampler.next, stop_ids,
                        salt=_text_parameter(read, "cache_salt"), tenant=_text_parameter(read, "tenant"),
                        speculative=_speculative(read, self.engine.speculation),
                        adapter=self._adapter(read)), sampler

    def _adapter(self, read):
        """The request's `adapter` parameter: the loaded adapter it names, None for the base ("" or not given)."""
        name = _parameter(read, "adapter", "")
        if not isinstance(name, str):
            raise RequestError(f"adapter must be a string (an adapter's name), got {json.dumps(name)[:40]}")
        if not name:
            return None
        adapter = self.adapters.get(name)
        if adapter is None:
            raise RequestError(str(UnknownAdapter(name[:64], sorted(self.adapters))))
        return adapter

    def _load_adapter(self, name, path):
        """Load the PEFT adapter at `path` as `name` (AdapterError naming the reason when it cannot be)."""
        if self.lora is None:
            raise AdapterError("this model serves no adapters: export it with --adapter or --enable-lora")
        if name in self.adapters:
            raise AdapterError(f"adapter {name!r} is loaded already: unload it first to load other weights under "
                               "its name")
        if len(self.adapters) >= self.lora["max_loras"]:
            raise AdapterError(f"{len(self.adapters)} adapters are loaded, the most this model holds "
                               f"(export --max-loras): unload one first")
        real = os.path.realpath(os.path.join(self.root, path))  # relative paths: from the model repository
        if os.path.commonpath([real, self.root]) != self.root:
            raise AdapterError(f"adapter {name!r}: {path} is outside the model repository {self.root}: place the "
                               "adapter's folder in the repository and give its path there")
        adapter = Adapter.load(name, Path(real), self.layout, self.lora["max_lora_rank"])
        self.adapters = {**self.adapters, name: adapter}

    def _adapter_admin(self, action, sender):
        """A control request (`adapter_admin`: list, load or unload an adapter): the adapters loaded after it as
        JSON text, or the reason it was refused."""
        try:
            if not isinstance(action, dict) or action.get("action") not in ("list", "load", "unload") or not all(
                    isinstance(action.get(k, ""), str) for k in ("name", "path")):
                raise AdapterError('adapter_admin must be the JSON text of {"action": "list"}, {"action": "load", '
                                   '"name": NAME, "path": FOLDER} or {"action": "unload", "name": NAME}')
            name = action.get("name", "")
            if action["action"] == "load":
                self._load_adapter(name, action.get("path", ""))
            elif action["action"] == "unload":  # running sequences keep it until they end
                if name not in self.adapters:
                    raise UnknownAdapter(name[:64], sorted(self.adapters))
                self.adapters = {k: v for k, v in self.adapters.items() if k != name}
        except (AdapterError, UnknownAdapter) as e:
            sender.send(pb_utils.InferenceResponse(
                error=pb_utils.TritonError(str(e), pb_utils.TritonError.INVALID_ARG)), flags=FINAL)
            return
        text = json.dumps({"adapters": [a.describe() for a in self.adapters.values()]})
        sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("text_output", np.array([text.encode()],
                                                                                    dtype=np.object_))]), flags=FINAL)

    def _serve(self):
        """The engine loop, started again whenever it fails (what it held ends with the error)."""
        while True:
            try:
                self._loop()
                return
            except Exception as e:  # noqa: BLE001 (nothing may stop the engine for good)
                self.metrics.count("restarts")
                pb_utils.Logger.log_error(f"dstool_llm: the engine loop failed ({type(e).__name__}: {e}); "
                                          "the sequences it held end with the error, the loop starts again")
                self._fail_all(f"the engine failed ({type(e).__name__}: {e})")

    def _loop(self):
        while True:
            with self.wake:
                while not self.stopping and not self.incoming and not self.engine.busy:
                    self.wake.wait()
                if self.stopping:
                    return
                incoming, self.incoming = self.incoming, []
                cancelled, self.cancelled = self.cancelled, set()
            for sequence in incoming:
                self.engine.add(sequence)
            held = {s.id for s in self.engine.running + self.engine.prefilling + list(self.engine.waiting)}
            for sequence_id in cancelled & held:
                self.engine.cancel(sequence_id)  # its client has gone; Triton still waits for the final flag
                self.metrics.count("cancelled")
                self.metrics.cut_short("abort")
                self._send(self.streams.pop(sequence_id))
            began, made = time.monotonic(), 0
            for produced in self.engine.steps():  # newcomers' first tokens go out before the batch decodes
                for sequence, token in produced:
                    if token is None:
                        self._fail(sequence)
                        continue
                    out = self.streams.get(sequence.id)
                    if out is None:  # ended by a stop string at an earlier token of this step (speculation)
                        continue
                    out.made += 1
                    made += 1
                    self.metrics.produced(sequence, out, began)
                    if self._emit(sequence, out):
                        self.metrics.ended(sequence, out)
            self.metrics.step(self.engine, self.streams, began, made)
            self.outbox.end_step()

    def _emit(self, sequence, out):
        """The sequence's token number `out.made` to its request; whether it was the last. (A step may have made
        tokens after it: speculative decoding's accepted drafts.)"""
        made, output = out.made, sequence.output
        done = sequence.finished and made == len(output) and sequence.error is None  # (a failure: _fail ends it)
        if out.stops and not done:  # a stop string: what would follow it is not wanted, nor generated
            tail = self.tokenizer.decode(output[max(0, made - max(map(len, out.stops)) - 4):made],
                                         skip_special_tokens=out.skip_special)
            done = any(stop in tail for stop in out.stops)
            if done:
                del output[made:]  # tokens a step made past it: plain decoding would not have made them
                sequence.finished = True
        if out.stream:
            out.pending.append(output[made - 1])
        if not done and (not out.stream or 1 < made and len(out.pending) < self.stream_interval):
            return False  # the first token goes at once; then a response every stream_interval tokens, and the last
        text = self.tokenizer.decode(output[:made], skip_special_tokens=out.skip_special)
        if out.stream:  # the new tokens' text
            if text.endswith("\ufffd") and not done:
                delta = ""  # a character still incomplete: its bytes come with the next token
            else:
                delta, out.sent = text[len(out.sent):], text
            ids, out.pending = out.pending, []
            response = self._response(delta, ids, sequence, out.ranked[made - len(ids):made] if out.ranked else [],
                                      out)
        else:  # the whole text
            response = self._response(text, output, sequence, out.ranked[:made], out)
        self._send(out, response, FINAL if done else 0)
        if done:
            self.streams.pop(sequence.id, None)
        return done

    def _response(self, text, ids, sequence, ranked, out=None):
        tensors = [pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_)),
                   pb_utils.Tensor("output_ids", np.asarray(ids, dtype=np.int64)),
                   pb_utils.Tensor("prompt_tokens", np.array([len(sequence.prompt)], dtype=np.int32)),
                   pb_utils.Tensor("prompt_cached_tokens", np.array([sequence.cached], dtype=np.int32))]
        if out is not None and not out.prompt_sent:  # the first response: what was asked of the prompt
            out.prompt_sent = True
            tensors += self._prompt_tensors(sequence, out)
        if ranked:  # the tokens' own text and log-probabilities, and the most likely alternatives'
            tensors += [
                pb_utils.Tensor("tokens", self._texts(ids)),
                pb_utils.Tensor("logprobs", np.array([r[0] for r in ranked], dtype=np.float32)),
                pb_utils.Tensor("top_tokens", np.stack([self._texts(r[1]) for r in ranked])),
                pb_utils.Tensor("top_logprobs", np.stack([r[2] for r in ranked]).astype(np.float32))]
        return pb_utils.InferenceResponse(tensors)

    def _prompt_tensors(self, sequence, out):
        """With `echo`, the prompt's text (prompt_text); with `prompt_logprobs` K, each prompt token's text
        (prompt_token_texts) and, from the second on (the first has no context to be predicted from), its
        log-probability (prompt_logprobs) and the K most likely there (prompt_top_tokens / prompt_top_logprobs)."""
        tensors = []
        if out.echo is not None:
            tensors.append(pb_utils.Tensor("prompt_text", np.array([out.echo.encode("utf-8")], dtype=np.object_)))
        ranked = out.prompt_ranked
        if ranked is None:
            return tensors
        tensors.append(pb_utils.Tensor("prompt_token_texts", self._texts(sequence.prompt)))
        if ranked:
            tensors.append(pb_utils.Tensor("prompt_logprobs", np.array([r[0] for r in ranked], dtype=np.float32)))
            if out.prompt_k:
                tensors += [pb_utils.Tensor("prompt_top_tokens", np.stack([self._texts(r[1]) for r in ranked])),
                            pb_utils.Tensor("prompt_top_logprobs", np.stack([r[2] for r in ranked]).astype(np.float32))]
        return tensors

    def _texts(self, ids):
        return np.array([self.tokenizer.decode([int(i)]).encode("utf-8") for i in ids], dtype=np.object_)

    def _fail(self, sequence, error=None):
        """End one sequence with its error (it is out of the engine already)."""
        out = self.streams.pop(sequence.id, None)
        if out is not None:
            self.metrics.cut_short("error")
            self._send(out, pb_utils.InferenceResponse(error=pb_utils.TritonError(
                f"generation failed: {error or sequence.error}")))

    def _fail_all(self, error):
        for sequence in self.engine.clear():
            self._fail(sequence, error)


def default_layout(chat, tools):
    """A chat laid out for a tokenizer without a chat template, as the corpus lays out a play's speeches: "NAME-OR-ROLE:
    \nCONTENT\n\n" ending in "ASSISTANT:\n"; with tools, a first SYSTEM speech lists them and asks for calls as
    <tool_call>{"name": ..., "arguments": {...}}</tool_call>, and an assistant's calls are written so."""
    speeches = []
    if tools:
        listed = "\n".join(json.dumps(t.get("function", t)) for t in tools)
        speeches.append(("SYSTEM", "You may call these tools, each call written as <tool_call>{\"name\": NAME, "
                                   "\"arguments\": {...}}</tool_call>:\n" + listed))
    for m in chat:
        content = m["content"]
        for call in m.get("tool_calls") or []:
            f = call.get("function", {})
            content += "<tool_call>" + json.dumps({"name": f.get("name"), "arguments": f.get("arguments")}) + \
                "</tool_call>"
        speeches.append(((m.get("name") or m["role"]).upper(), content))
    return "".join(f"{who}:\n{content}\n\n" for who, content in speeches) + "ASSISTANT:\n"


DEEPSEEK_CALL = "<｜tool▁call▁begin｜>"  # in a chat template: DeepSeek's (V3, R1, V3.1)


def deepseek_messages(chat):
    """Messages as DeepSeek's chat templates read them: an assistant's call arguments as JSON text (they join them
    to strings). (V3's own template writes calls only beside a content of None, which transformers 5 cannot give
    it: R1's and V3.1's write them.)"""
    out = []
    for m in chat:
        if m.get("tool_calls"):
            calls = [{**c, "function": {**c.get("function", {}), "arguments": json.dumps(
                c.get("function", {}).get("arguments"), ensure_ascii=False)}}
                if not isinstance(c.get("function", {}).get("arguments"), str) else c for c in m["tool_calls"]]
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


def _template_kwargs(read):
    """The `chat_template_kwargs` parameter (vLLM's): JSON text of an object of names to strings, numbers, booleans
    or null, passed to the chat template (V3.1's `thinking`, Qwen3's `enable_thinking`); bounded, and never one of
    the names the template call itself takes."""
    value = _parameter(read, "chat_template_kwargs")
    if value is None:
        return {}
    if isinstance(value, str):
        if len(value.encode()) > MAX_TEMPLATE_KWARGS_BYTES:
            raise RequestError(f"chat_template_kwargs is {len(value.encode())} bytes: at most "
                               f"{MAX_TEMPLATE_KWARGS_BYTES}")
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):
            value = None
    if not isinstance(value, dict) or len(value) > MAX_TEMPLATE_KWARGS or not all(
            isinstance(k, str) and k.isidentifier() and (v is None or isinstance(v, (str, int, float, bool)))
            for k, v in value.items()) or len(json.dumps(value).encode()) > MAX_TEMPLATE_KWARGS_BYTES:
        raise RequestError(f"chat_template_kwargs must be the JSON text of an object of at most {MAX_TEMPLATE_KWARGS} "
                           "names to strings, numbers, booleans or null (e.g. {\"thinking\": true})")
    own = sorted(set(value) & TEMPLATE_OWN)
    if own:
        raise RequestError(f"chat_template_kwargs.{own[0]} is not the template's to take: leave it out")
    if read.messages is None and value:
        raise RequestError("chat_template_kwargs go with messages (a chat)")
    return value


def _reasoning_parser(read):
    """The `reasoning_parser` parameter (the gateway's --reasoning-parser): a grammar applies after the model's
    thinking; None when not given."""
    value = _parameter(read, "reasoning_parser")
    if value is not None and value not in REASONING_PARSERS:
        raise RequestError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, got {value!r:.60}")
    return value


def _text(request, name, limit, positions):
    """A one-element BYTES input as text, None when not sent; refused unread when over `limit` bytes."""
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return None
    text = tensor.as_numpy().reshape(-1)
    if text.size != 1:
        raise RequestError(f"send one {name} per request (got {text.size})")
    if len(text[0]) > limit:
        raise RequestError(f"{name} is {len(text[0])} bytes: more than the model's {positions} positions can hold "
                           f"(at most {limit} bytes); shorten it")
    try:
        return text[0].decode("utf-8") if isinstance(text[0], bytes) else str(text[0])
    except UnicodeDecodeError as e:
        raise RequestError(f"{name} is not valid UTF-8 (byte {e.start}): send UTF-8 text") from None


def _ids(request, positions, vocab):
    """The input_ids input (a prompt as token ids) as a list, None when not sent: 1 to `positions` integers, each a
    token id of the vocabulary (0 to vocab - 1); checked before anything else is done."""
    tensor = pb_utils.get_input_tensor_by_name(request, "input_ids")
    if tensor is None:
        return None
    ids = tensor.as_numpy()
    if ids.dtype.kind not in "iu":
        raise RequestError(f"input_ids must be integers (INT64), got {ids.dtype}")
    ids = ids.reshape(-1)
    if not 0 < ids.size <= positions:
        raise RequestError(f"input_ids holds {ids.size} token ids: send 1 to {positions} (the model's positions)")
    bad = np.flatnonzero((ids < 0) | (ids >= vocab))
    if bad.size:
        raise RequestError(f"input_ids[{int(bad[0])}] is {int(ids[bad[0]])}: not a token id of this model's "
                           f"vocabulary (0 to {vocab - 1})")
    return ids.astype(np.int64).tolist()


def _prompt_asks(read):
    """(echo, K): the `echo` parameter (true: the first response carries the prompt's text, prompt_text) and
    `prompt_logprobs` (K, 0-MAX_PROMPT_LOGPROBS: the prompt's tokens' log-probabilities and K alternatives each, or
    None)."""
    echo, k = _parameter(read, "echo", False), _parameter(read, "prompt_logprobs")
    if not isinstance(echo, bool):
        raise RequestError(f"echo must be true or false, got {json.dumps(echo)[:60]}")
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_PROMPT_LOGPROBS):
        raise RequestError(f"prompt_logprobs must be an integer from 0 to {MAX_PROMPT_LOGPROBS}, got "
                           f"{json.dumps(k)[:60]}")
    return echo, k


def _prompt_scorer(prompt, k, ranked):
    """The engine's `score` for a prompt: from each prefilled chunk's logits (position p predicts token p + 1), each
    prompt token's log-probability under the model's own distribution and the K most likely there (as the
    sampler's `ranked` gives a generated token's), appended to `ranked` in order; the last position's logits
    choose the answer's first token and are not scored."""
    targets = np.asarray(prompt, np.int64)

    def score(logits, start):
        end = min(logits.shape[0], len(prompt) - 1 - start)
        for at in range(0, end, SCORE_ROWS):
            rows = min(SCORE_ROWS, end - at)
            x = np.nan_to_num(np.array(logits[at:at + rows], np.float64), nan=-FINITE)
            np.clip(x, -FINITE, FINITE, out=x)
            x -= x.max(axis=1, keepdims=True)
            x -= np.log(np.exp(x).sum(axis=1, keepdims=True))
            np.maximum(x, -1e30, out=x)  # finite in float32 and in JSON
            own = x[np.arange(rows), targets[start + at + 1:start + at + 1 + rows]]
            if k:
                top = np.argpartition(-x, k - 1, axis=1)[:, :k]
                order = np.argsort(-np.take_along_axis(x, top, axis=1), axis=1, kind="stable")
                top = np.take_along_axis(top, order, axis=1)
            for r in range(rows):
                ids = top[r] if k else np.zeros(0, np.int64)
                ranked.append((float(own[r]), ids, x[r, ids].astype(np.float32)))

    return score


def _skip_special(read):
    """vLLM's skip_special_tokens parameter (default true): false keeps special tokens in the text."""
    value = _parameter(read, "skip_special_tokens", True)
    if not isinstance(value, bool):
        raise RequestError(f"skip_special_tokens must be true or false, got {value!r:.60}")
    return value


def _stops(read):
    """The request's `stop` parameter: JSON text of up to 4 non-empty strings (or one string): generation ends as
    soon as the text holds one of them (the text sent includes it; the gateway's OpenAI routes cut it there)."""
    value = _parameter(read, "stop")
    if value is None:
        return []
    if isinstance(value, str) and value.startswith("["):
        try:
            value = json.loads(value)
        except ValueError:
            pass
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not 0 < len(stops) <= 4 or \
            not all(isinstance(x, str) and 0 < len(x) <= MAX_STOP_CHARS for x in stops):
        raise RequestError(f"stop must be a string or the JSON text of a list of up to 4 strings of 1-{MAX_STOP_CHARS} "
                           "characters")
    return stops


def _speculative(read, speculation):
    """The `num_speculative_tokens` parameter: the drafts per step this request allows (0: none), at most the
    model's speculative_config's; None when not given (the model's)."""
    value = _parameter(read, "num_speculative_tokens")
    if value is None:
        return None
    high = speculation.num_speculative_tokens if speculation is not None else 0
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= high:
        why = f"from 0 to {high} (the model's speculative_config)" if high else \
            "0: this model does not speculate (dstool export --speculative-config turns it on)"
        raise RequestError(f"num_speculative_tokens must be an integer {why}, got {json.dumps(value)[:40]}")
    return value


def _text_parameter(read, name):
    """A string parameter of the request ("" when not given): `cache_salt` (vLLM's: its prompt shares computed
    prefixes only with requests of the same salt) and `tenant` (its turn among tenants' requests); the gateway sets
    both for a tenant's request."""
    value = _parameter(read, name, "")
    if not isinstance(value, str) or len(value.encode()) > MAX_SALT_BYTES:
        raise RequestError(f"{name} must be a string of at most {MAX_SALT_BYTES} bytes, got {json.dumps(value)[:40]}")
    return value


def _parameter(read, name, default=None):
    """A parameter of the request `read` (its `parameters`, JSON text as Triton passes them); `default` when not
    given."""
    try:
        named = json.loads(read.parameters or "{}")
    except ValueError:
        return default
    return named.get(name, default) if isinstance(named, dict) else default


def _admin_action(request):
    """The `adapter_admin` parameter of a control request, read (None: an ordinary request)."""
    text = request.parameters()
    if "adapter_admin" not in text:
        return None
    try:
        value = json.loads(text).get("adapter_admin")
        return None if value is None else json.loads(value) if isinstance(value, str) else value
    except (ValueError, RecursionError):
        return "unreadable"


def _ranking(sampler, ranked):
    """The sampler's choice, each token's log-probabilities kept in `ranked`."""

    def choose(logits, prompt, output):
        token = sampler.next(logits, prompt, output)
        ranked.append(sampler.ranked(logits, token))
        return token

    return choose


def _values(request, name):
    """An optional input's values, or None."""
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return tensor.as_numpy() if tensor is not None else None
