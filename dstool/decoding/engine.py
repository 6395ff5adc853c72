"""The one prefill-and-decode loop of dstool over the exported key/value-cache decoder graph, with continuous
(in-flight) batching, numpy only: Triton's NAME_llm (copied beside it) and NAME_generate (its decoder called
through Triton), `dstool batch`, the edge runner (the graph in blocks) and compress's decoding-speed figure all run it.

    engine = Engine(onnxruntime.InferenceSession("model.onnx"), cache_shapes, max_batch=16)
    engine.add(Sequence("a", prompt_ids, max_new_tokens=32, choose=sampler.next, stop_ids={eos}))
    while engine.busy:
        for sequence, token in engine.step(): ...   # each running sequence's next token

Each `step` admits waiting sequences (as many as `max_batch` and the `max_cache_tokens` budget allow — admission
waits, it never fails, when the budget is spent), prefills up to `max_prefill_tokens` of their prompts (together;
a longer prompt in chunks over several steps, its cache kept between them; all of them when none is running),
then runs one decoding step for the
running sequences; a sequence whose prompt is done gets its first token in that step and joins the batch for
the next. So a newcomer starts at the next step, and prefill holds the running ones up by a bounded amount of
work per step, however many arrive. A sequence leaves the batch as soon as it finishes.

The running sequences share one batch cache, a row each, with a mask of the positions each row holds: the cache
the graph returns from a decoding step is the next step's input as it is (no copy per token, as in a plain
generation loop). Rows of different lengths are padded where they joined, and the padding is masked; each row
keeps its own position ids. The cache is copied only when the batch changes: newcomers' rows appended, finished
rows dropped (and columns no row uses any more with them).

`FusedEngine` is the same loop on the fused-attention graph (`dstool.fused_decoder`, what NAME_llm runs for
Llama-layout models): the batch cache is one buffer the graph updates in place, a row per sequence holding its own
positions, so rows are neither padded nor masked and a decoding step copies no cache; `engine_for(session, ...)`
picks the engine a graph needs.

With a `PrefixCache`, a newcomer's prompt starts from the longest prefix an earlier prompt left in it (whole
blocks of tokens, the very same ids from the first one on): those positions' keys and values are its cache so far,
as if an earlier chunk had computed them, and only the rest of the prompt is prefilled.

A sequence with a `score` (prompt logprobs) is given its prompt's own logits as they are prefilled, chunk by chunk
with the position each begins at; its prompt is computed whole, never from the prefix cache (kept positions carry no
logits).

With a `Speculation` (vLLM's n-gram speculative decoding, prompt lookup), a running sequence's next tokens may be
drafted from its own text: the most recent earlier occurrence of its last n tokens (n from `prompt_lookup_max` down
to `prompt_lookup_min`) in prompt + output proposes the up to `num_speculative_tokens` that followed it, and one graph
run over [last token, drafts] gives the logits of every position. The sequence's own `choose` is then called on them
in order, as plain decoding would call it (one call per token made: the same RNG draws, penalties and grammar
state), while each chosen token equals the draft: a step makes the accepted drafts and the first choice that differs
(or the one after the last draft), so greedy and seeded outputs are exactly those without speculation. The rejected
drafts' positions are dropped (FusedEngine: the row's `held` count does not pass them; Engine: the cache and mask
are cut). When it drafts (the rule measured in docs/export-serve.md): only for a single running sequence with
nothing prefilling or waiting — the fused op runs a chunk after cached positions one row at a time, so a batch would
verify row by row, each run costing about a whole batch's decoding step —, and not for the next 1, 2, 4, ...
MAX_BACKOFF steps after a draft none of which was accepted (until one is: a verifying run costs more than a decoding
step, and free text seldom repeats itself). A sequence's `speculative` lowers its draft length or turns drafting off
(0). The engine counts drafts, draft tokens and accepted tokens (by position) as vLLM does (`spec_counts`). A graph
that gives the last position's logits only cannot verify: the engine then decodes plainly and drafts no more
(`speculation` None).

With the method `deepseek_mtp` (vLLM's name; `mtp` too) the drafts come from DeepSeek-V3's MTP module instead
(`MTPDrafter`, the draft graph `dstool export` writes beside such a model, whose decoder graph then also gives its
last hidden state): the same loop, the same rule of when to draft, the same verification and counters. The main
graph's hidden states of each sequence's positions are kept (only while the engine has the drafter, and only those
the MTP layer has not read yet); at a draft, the MTP layer first reads them (with the next token of each position)
into its own cache, its last position proposing the first draft, then runs on its own output hidden state and that
draft for the next (the same layer chained, as vLLM does past num_nextn_predict_layers). Those chained positions
are not kept: the MTP cache holds exactly the positions the main cache holds but the last, and after verification
the accepted tokens' hidden states are kept for the MTP layer's next read, the rejected ones' dropped with their
main-cache positions.

A failure ends only the sequences it concerns: a choice that raises (or picks an id outside the vocabulary) ends
its own sequence; a graph run that fails ends the sequences of that run (the prefilling group, or the running
batch, whose cache is then dropped). Such a sequence comes out of `steps` with the token None and its `error` set;
the engine goes on with the others.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from .adapters import Adapter, RowWeights, graph_layout

MAX_BACKOFF = 16  # steps a sequence drafts no more after drafts that all failed, at most
MTP_PENDING = 256  # main-graph hidden states a sequence holds unread before its MTP layer reads them (a bound)


@dataclass(frozen=True)
class Speculation:
    """Prompt-lookup drafting, as vLLM's speculative_config {"method": "ngram", "num_speculative_tokens": K,
    "prompt_lookup_max": N, "prompt_lookup_min": M} (vLLM's defaults: both lookups 5 when neither is given, else
    the one given); or DeepSeek's MTP module drafting, {"method": "deepseek_mtp", "num_speculative_tokens": K} (the
    lookups unused)."""

    num_speculative_tokens: int
    prompt_lookup_max: int = 0
    prompt_lookup_min: int = 0
    method: str = "ngram"

    MAX_TOKENS: ClassVar[int] = 16  # drafts per step, at most
    MAX_LOOKUP: ClassVar[int] = 32  # n-gram length, at most
    MTP_METHODS: ClassVar[tuple[str, ...]] = ("deepseek_mtp", "mtp")  # vLLM's names of MTP drafting

    @classmethod
    def parse(cls, value: str | dict) -> Speculation:
        """From the JSON text (or the mapping) of a speculative_config; ValueError naming what is wrong."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise ValueError("must be the JSON text of an object") from None
        if not isinstance(value, dict):
            raise ValueError('must be an object such as {"method": "ngram", "num_speculative_tokens": 4}')
        method = value.get("method")
        if method not in ("ngram", *cls.MTP_METHODS):
            raise ValueError(f"method must be \"ngram\" (prompt lookup) or \"deepseek_mtp\" (the model's own MTP "
                             f"module), got {json.dumps(method)[:40]}")
        known = {"method", "num_speculative_tokens"} | \
            ({"prompt_lookup_max", "prompt_lookup_min"} if method == "ngram" else set())
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"{unknown[0]} is not read: give {', '.join(sorted(known))}")

        def integer(name: str, high: int, default: int | None) -> int:
            v = value.get(name, default)
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= high:
                raise ValueError(f"{name} must be an integer from 1 to {high}, got {json.dumps(v)[:40]}")
            return v

        k = integer("num_speculative_tokens", cls.MAX_TOKENS, None)
        if method != "ngram":
            return cls(k, method=method)
        high, low = value.get("prompt_lookup_max"), value.get("prompt_lookup_min")
        high = integer("prompt_lookup_max", cls.MAX_LOOKUP, 5 if high is None and low is None else low)
        low = integer("prompt_lookup_min", cls.MAX_LOOKUP, high)
        if low > high:
            raise ValueError(f"prompt_lookup_min ({low}) must not exceed prompt_lookup_max ({high})")
        return cls(k, high, low)

    @property
    def mtp(self) -> bool:
        """Drafting with the model's MTP module."""
        return self.method in self.MTP_METHODS

    def check_mtp(self, depths: int) -> None:
        """ValueError unless the model has the MTP depths this method drafts with (num_nextn_predict_layers)."""
        if self.mtp and depths < 1:
            raise ValueError(f"method {self.method} drafts with the model's MTP module, and this model has none "
                             "(num_nextn_predict_layers 0, no MTP graph exported): train it with --mtp-layers N and "
                             "export it again, or use method ngram")

    def text(self) -> str:
        """The config as vLLM writes it (JSON)."""
        if self.mtp:
            return json.dumps({"method": self.method, "num_speculative_tokens": self.num_speculative_tokens})
        return json.dumps({"method": "ngram", "num_speculative_tokens": self.num_speculative_tokens,
                           "prompt_lookup_max": self.prompt_lookup_max, "prompt_lookup_min": self.prompt_lookup_min})

    def draft(self, tokens: list[int], k: int) -> list[int]:
        """Up to `k` tokens that followed the most recent earlier occurrence of the last n of `tokens` (the longest
        n that occurs); none when no n-gram recurs."""
        ids = np.asarray(tokens, np.int64)
        for n in range(min(self.prompt_lookup_max, len(ids) - 1), self.prompt_lookup_min - 1, -1):
            tail = ids[-n:]
            ends = np.flatnonzero(ids[n - 1:-1] == tail[-1])  # earlier n-grams' starts with the same last token
            for start in ends[::-1]:
                if np.array_equal(ids[start:start + n], tail):
                    return ids[start + n:start + n + k].tolist()
        return []


@dataclass
class SpecCounts:
    """vLLM's spec_decode counters: drafts verified, tokens drafted, drafted tokens accepted, and accepted at each
    draft position."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    accepted_at: list[int] = field(default_factory=list)

    def since(self, before: SpecCounts) -> SpecCounts:
        """What was counted after `before` (an earlier copy of these counts)."""
        at = [n - (before.accepted_at[i] if i < len(before.accepted_at) else 0) for i, n in enumerate(self.accepted_at)]
        return SpecCounts(self.drafts - before.drafts, self.draft_tokens - before.draft_tokens,
                          self.accepted - before.accepted, at)

    def copy(self) -> SpecCounts:
        return SpecCounts(self.drafts, self.draft_tokens, self.accepted, list(self.accepted_at))


@dataclass
class MTPState:
    """A sequence's MTP drafting state: the MTP layer's cache over positions `start`.. (`start`: its first position
    with a hidden state, after a prefix cache's, which have none) and the main graph's hidden states of the positions
    after those, not read by the MTP layer yet."""

    start: int
    cache: dict[str, np.ndarray] | None = None  # past_key_values.layers.0.* [1, 1, held, dim]
    hidden: list[np.ndarray] = field(default_factory=list)  # [positions, hidden] chunks, in order

    @property
    def held(self) -> int:
        return _positions(self.cache)

    @property
    def pending(self) -> int:
        return sum(len(h) for h in self.hidden)

    def drop(self, rows: int) -> None:
        """Forget the last `rows` hidden states (the rejected drafts' positions)."""
        if rows:
            kept = np.concatenate(self.hidden)[:-rows]
            self.hidden = [kept] if len(kept) else []


class MTPDrafter:
    """DeepSeek's MTP module drafting a sequence's next tokens: the first depth's exported draft graph
    (dstool.onnx_export.MTPDraft: token ids, hidden states, position ids, attention mask, its own cache -> logits,
    its output hidden states, the grown cache), each draft its most likely token."""

    def __init__(self, session):
        self.session = session
        self.cache_names = [i.name for i in session.get_inputs() if i.name.startswith("past_key_values.")]
        self.shapes = {i.name: (i.shape[1], i.shape[3]) for i in session.get_inputs() if i.name in self.cache_names}
        self.outputs = ["logits", "next_hidden_states", *(c.replace("past_key_values.", "cache.", 1)
                                                          for c in self.cache_names)]

    def run(self, ids: list[int], hidden: np.ndarray, first: int, cache: dict[str, np.ndarray] | None):
        """The MTP layer over `ids` at positions first.. with `hidden` [n, hidden] after `cache`: (logits [n, vocab],
        output hidden states [n, hidden], the grown cache)."""
        past = cache or {n: np.zeros((1, h, 0, d), np.float32) for n, (h, d) in self.shapes.items()}
        held, n = _positions(past), len(ids)
        logits, out, *grown = self.session.run(self.outputs, {
            "input_ids": np.array([ids], np.int64), "hidden_states": hidden[None].astype(np.float32),
            "position_ids": (first + np.arange(n, dtype=np.int64))[None],
            "attention_mask": np.ones((1, held + n), np.int64), **past})
        return logits[0], out[0], dict(zip(self.cache_names, grown))

    def _read(self, s: Sequence, n: int):
        """The first `n` of `s`'s unread hidden states, each with its position's next token, read into its MTP
        cache (kept): the layer's logits and output hidden states at those positions."""
        state, tokens = s.mtp, s.prompt + s.output
        assert state is not None
        first, hidden = state.start + state.held, np.concatenate(state.hidden)
        logits, out, state.cache = self.run(tokens[first + 1:first + 1 + n], hidden[:n], first, state.cache)
        state.hidden = [hidden[n:]] if n < len(hidden) else []
        return logits, out

    def absorb(self, s: Sequence) -> None:
        """`s`'s unread hidden states whose next token is known read into its MTP cache, as a draft reads them: a
        sequence that does not draft for a while (in a batch) holds at most MTP_PENDING of them."""
        state = s.mtp
        if state is not None and state.hidden:  # the last position's next token is still being chosen
            n = min(state.pending, len(s.prompt) + len(s.output) - 1 - (state.start + state.held))
            if n > 0:
                self._read(s, n)

    def draft(self, s: Sequence, k: int) -> list[int]:
        """Up to `k` tokens after `s`'s: its unread hidden states read into its MTP cache first (kept), then the
        layer chained on its own output for each further draft (not kept)."""
        state = s.mtp
        if state is None or not state.hidden:
            return []
        logits, out = self._read(s, state.pending)  # every unread position: the last is the one before the newest
        drafted, cache, at = [int(np.argmax(logits[-1]))], state.cache, len(s.prompt) + len(s.output) - 1
        for _ in range(k - 1):
            logits, out, cache = self.run(drafted[-1:], out[-1:], at, cache)
            drafted.append(int(np.argmax(logits[-1])))
            at += 1
        return drafted


@dataclass
class Sequence:
    """One request: its prompt ids, how many tokens it may add, how it chooses them, where it stops."""

    id: str
    prompt: list[int]
    max_new_tokens: int
    choose: Callable[[np.ndarray, list[int], list[int]], int]  # (logits row, prompt, output) -> token
    stop_ids: set[int]
    output: list[int] = field(default_factory=list)
    finished: bool = False
    started_step: int | None = None  # the engine's step that began its prefill
    prefilled: int = 0  # prompt tokens in its cache so far
    cached: int = 0  # prompt tokens taken from the prefix cache, not computed
    partial: dict[str, np.ndarray] | None = None  # its cache while prefilling (every position its own)
    error: str | None = None  # why it ended early, when it failed
    salt: str = ""  # its prefix-cache scope: prefixes are shared only between sequences of the same salt
    tenant: str = ""  # whose it is: waiting sequences begin by turns of tenants (the fewest places in the batch first)
    paused: bool = False  # taken out of the batch for another tenant's turn: its cache kept in `partial`
    # the prompt's own logits (prompt logprobs): each prefilled chunk's [chunk, vocab] with the position of its first
    # token; such a prompt is computed whole (the prefix cache's positions have no logits)
    score: Callable[[np.ndarray, int], None] | None = None
    speculative: int | None = None  # tokens it may draft per step (None: the engine's; 0: none)
    backoff: int = 0  # steps it drafts no more after a draft none of which was accepted (doubling while none is)
    idle: int = 0  # steps of the backoff still to go
    adapter: Adapter | None = None  # the LoRA adapter it decodes with (a graph with LoRA inputs); None: the base
    mtp: MTPState | None = None  # its MTP drafting state (an engine with an MTPDrafter)

    @property
    def scope(self) -> str:
        """Its prefix-cache scope: its salt and its adapter's content (another adapter's keys and values differ)."""
        return self.salt if self.adapter is None else f"{self.salt}\x00{self.adapter.sha256}"

    @property
    def reserved(self) -> int:
        """Cache positions this sequence may come to hold."""
        return len(self.prompt) + self.max_new_tokens

    def _take(self, token: int) -> None:
        self.output.append(token)
        self.finished = token in self.stop_ids or len(self.output) >= self.max_new_tokens

    def _fail(self, error: BaseException | str) -> tuple[Sequence, None]:
        self.error = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        self.finished, self.partial = True, None
        return self, None


class Engine:
    def __init__(self, session, cache_shapes: dict[str, tuple[int, int]], max_batch: int = 16,
                 max_cache_tokens: int | None = None, max_prefill_tokens: int = 64,
                 prefix_cache: PrefixCache | None = None, speculation: Speculation | None = None,
                 mtp: MTPDrafter | None = None):
        """`session`: what runs the decoder graph, anything with onnxruntime's `run(output names, feeds)` (its
        logits for every position, or for the last one only, which serves one prompt per prefill: max_batch 1);
        `cache_shapes`: its cache inputs
        (past_key_values.*) -> (kv_heads, head_dim); `max_cache_tokens`: the cache positions all admitted
        sequences together may hold (default: unbounded); `max_prefill_tokens`: prompt tokens prefilled per step;
        `prefix_cache`: where prompts' computed prefixes are kept and found (none: every prompt computed whole);
        `speculation`: n-gram or MTP drafting (none: one token per step); `mtp`: the MTP draft graph's drafter,
        which method deepseek_mtp needs (and a decoder graph giving `hidden_states`)."""
        if max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be at least 1, got {max_prefill_tokens}")
        self.max_prefill_tokens = max_prefill_tokens
        self.prefix_cache = prefix_cache
        self.prefilling: list[Sequence] = []  # admitted, prompt not done yet
        self.steps_started = 0
        self.session = session
        self.cache_shapes = cache_shapes
        self.cache_outputs = {name: name.replace("past_key_values.", "cache.", 1) for name in cache_shapes}
        self.max_batch = max_batch
        self.max_cache_tokens = max_cache_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # the batch cache's rows, in order
        self.cache: dict[str, np.ndarray] = self._empty(0)  # input name -> [rows, kv_heads, positions, head_dim]
        self.mask = np.zeros((0, 0), np.int64)  # [rows, positions]: 1 where a row holds a token
        self.speculation = speculation
        if speculation is not None and speculation.mtp:
            speculation.check_mtp(0 if mtp is None else 1)
            if "hidden_states" not in {o.name for o in session.get_outputs()}:
                raise ValueError(f"method {speculation.method} reads the decoder's last hidden state, and this "
                                 "decoder graph gives none: export the model with dstool export again")
        self.mtp = mtp if speculation is not None and speculation.mtp else None
        self.lora: RowWeights | None = None  # each row's adapter weights, for a graph with LoRA inputs (FusedEngine)
        self.spec_counts = SpecCounts(accepted_at=[0] * (speculation.num_speculative_tokens if speculation else 0))

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    def add(self, sequence: Sequence) -> None:
        if sequence.adapter is not None and self.lora is None:
            raise ValueError("this decoder graph has no LoRA inputs: export the model with --adapter or --enable-lora "
                             "to serve adapters")
        if self.max_cache_tokens is not None and sequence.reserved > self.max_cache_tokens:
            raise ValueError(f"prompt ({len(sequence.prompt)} tokens) + max_new_tokens ({sequence.max_new_tokens}) "
                             f"exceed the engine's {self.max_cache_tokens} cache positions")
        self.waiting.append(sequence)

    def cancel(self, sequence_id: str) -> None:
        """Drop a sequence, waiting or running (its client has gone)."""
        self.waiting = deque(s for s in self.waiting if s.id != sequence_id)
        self.prefilling = [s for s in self.prefilling if s.id != sequence_id]
        self._keep([i for i, s in enumerate(self.running) if s.id != sequence_id])

    def clear(self) -> list[Sequence]:
        """Drop every sequence (waiting, prefilling, running) and the batch cache; the ones dropped."""
        held = [*self.running, *self.prefilling, *self.waiting]
        self.waiting, self.prefilling = deque(), []
        self._drop_batch()
        return held

    def _drop_batch(self) -> None:
        """No running sequence, no batch cache."""
        self.running, self.cache, self.mask = [], self._empty(0), np.zeros((0, 0), np.int64)

    def step(self) -> list[tuple[Sequence, int | None]]:
        """Admit and prefill newcomers, decode one token for the others; (sequence, new token) for each (None for a
        sequence that failed: its `error` says why)."""
        return [token for part in self.steps() for token in part]

    def steps(self) -> Iterator[list[tuple[Sequence, int | None]]]:
        """`step` in its two parts: the first tokens of sequences whose prompt is done (prefill), then the running
        ones' next tokens — so a server can send the first ones before the batch decodes."""
        self.steps_started += 1
        self._preempt()
        admitted = self._admit()
        self.prefilling += [s for s in admitted if not s.paused]
        self._resume([s for s in admitted if s.paused])
        joining: list[tuple[Sequence, dict[str, np.ndarray]]] = []
        if self.prefilling:
            produced, joining = self._prefill()
            yield produced
        if self.running:
            try:
                yield self._speculate() or self._decode()
            except _RunFailed as e:  # the batch's cache is gone with it: every running sequence ends
                failed: list[tuple[Sequence, int | None]] = [s._fail(e.cause) for s in self.running]
                self._drop_batch()
                yield failed
        self._append([j for j in joining if not j[0].finished])
        self._keep([i for i, s in enumerate(self.running) if not s.finished])

    def _empty(self, rows: int, positions: int = 0) -> dict[str, np.ndarray]:
        return {name: np.zeros((rows, heads, positions, dim), np.float32)
                for name, (heads, dim) in self.cache_shapes.items()}

    def _places(self) -> dict[str, int]:
        """Places in the batch (running and prefilling) by tenant."""
        places: dict[str, int] = {}
        for s in self.running + self.prefilling:
            places[s.tenant] = places.get(s.tenant, 0) + 1
        return places

    def _preempt(self) -> None:
        """With the batch full and a waiting tenant holding fewer places than another by two or more, pause the
        latest sequence of the tenant holding the most: its cache is kept aside (it still counts against the cache
        budget) and it goes on, exactly where it was, at its next turn. So a tenant's flood cannot make another
        tenant wait for its sequences to end: a newcomer begins within a step or two."""
        if not self.waiting or len(self.running) + len(self.prefilling) < self.max_batch or not self.running:
            return
        places = self._places()
        waiting = places.get(self._next_waiting(places).tenant, 0)
        heaviest = max(places, key=lambda t: places[t])
        rows = [i for i, s in enumerate(self.running) if s.tenant == heaviest]
        if places[heaviest] <= waiting + 1 or not rows:
            return
        row = rows[-1]
        s = self.running[row]
        s.partial, s.paused = self._row(row), True
        self._keep([i for i in range(len(self.running)) if i != row])
        self.waiting.appendleft(s)

    def _row(self, row: int) -> dict[str, np.ndarray]:
        """A running row's own cache [1, heads, positions, dim] (the positions it holds, in order)."""
        held = np.flatnonzero(self.mask[row])
        return {n: v[row:row + 1][:, :, held].copy() for n, v in self.cache.items()}

    def _resume(self, paused: list[Sequence]) -> None:
        """Paused sequences back into the batch with their cache, to decode their next token."""
        rows = []
        for s in paused:
            assert s.partial is not None
            rows.append((s, s.partial))
            s.partial, s.paused = None, False
        self._append(rows)

    def _admit(self) -> list[Sequence]:
        held = sum(s.reserved for s in self.running + self.prefilling) + \
            sum(s.reserved for s in self.waiting if s.paused)
        places = self._places()
        admitted: list[Sequence] = []
        while self.waiting and len(self.running) + len(self.prefilling) + len(admitted) < self.max_batch:
            s = self._next_waiting(places)
            if not s.paused and self.max_cache_tokens is not None and held + s.reserved > self.max_cache_tokens:
                break
            self.waiting.remove(s)
            places[s.tenant] = places.get(s.tenant, 0) + 1
            held += 0 if s.paused else s.reserved
            if self.prefix_cache is not None and not s.prefilled and s.score is None:
                s.cached, s.partial = self.prefix_cache.match(s.prompt, s.scope)
                s.prefilled = s.cached
            admitted.append(s)
        self._fit_prefix_cache(held)
        return admitted

    def _next_waiting(self, places: dict[str, int]) -> Sequence:
        """The waiting sequence to begin next: the oldest of the tenant holding the fewest places in the batch (one
        tenant's flood of requests does not queue ahead of another's; without tenants, the oldest)."""
        best = self.waiting[0]
        for s in self.waiting:
            if places.get(best.tenant, 0) == 0:
                break
            if places.get(s.tenant, 0) < places.get(best.tenant, 0):
                best = s
        return best

    def _fit_prefix_cache(self, held: int | None = None) -> None:
        """The kept prefixes take only what the admitted sequences leave of the cache budget."""
        if self.prefix_cache is not None and self.max_cache_tokens is not None:
            if held is None:
                held = sum(s.reserved for s in self.running + self.prefilling)
            self.prefix_cache.shrink(self.max_cache_tokens - held)

    def _chunks(self) -> list[tuple[Sequence, int]]:
        """The prefilling sequences and how many prompt tokens of each to prefill now: up to `max_prefill_tokens` in
        all, or every admitted prompt whole when nothing is running (nobody to hold up)."""
        budget, group = self.max_prefill_tokens if self.running else sum(len(s.prompt) for s in self.prefilling), []
        for s in self.prefilling:
            take = min(len(s.prompt) - s.prefilled, budget)
            if take == 0:
                break
            group.append((s, take))
            budget -= take
        return group

    def _run(self, feeds: dict[str, np.ndarray]) -> tuple[np.ndarray, dict[str, np.ndarray], np.ndarray | None]:
        """(logits, the grown cache, the last hidden states where MTP drafting reads them, else None)."""
        names = ["logits", *self.cache_outputs.values(), *(["hidden_states"] if self.mtp else [])]
        try:
            logits, *caches = self.session.run(names, feeds)
        except Exception as e:  # noqa: BLE001 (whatever the runtime raises ends this run's sequences, not the engine)
            raise _RunFailed(e) from e
        hidden = caches.pop() if self.mtp else None
        return logits, dict(zip(self.cache_shapes, caches)), hidden

    def _keep_hidden(self, s: Sequence, hidden: np.ndarray | None, position: int) -> None:
        """The main graph's hidden states [positions, hidden] of `s` from `position` on, for its MTP drafts (a
        sequence that does not draft keeps none)."""
        if hidden is None or s.speculative == 0:
            return
        if s.mtp is None:
            s.mtp = MTPState(start=position)
        s.mtp.hidden.append(hidden)
        if self.mtp is not None and s.mtp.pending > MTP_PENDING:
            self.mtp.absorb(s)

    def _prefill(self):
        """The next chunks of the prefilling sequences' prompts, up to `max_prefill_tokens` in all, as one batch
        (each row its cache so far, then its chunk right-padded; the padding masked). Returns the first tokens of
        the sequences whose prompt is done, with their cache rows to join the batch."""
        group = self._chunks()
        past_len = max(_positions(s.partial) for s, _ in group)
        width = max(take for _, take in group)
        rows = len(group)
        ids = np.zeros((rows, width), np.int64)
        positions = np.zeros((rows, width), np.int64)
        mask = np.zeros((rows, past_len + width), np.int64)
        past = self._empty(rows, past_len)
        for b, (s, take) in enumerate(group):
            if s.started_step is None:
                s.started_step = self.steps_started
            ids[b, :take] = s.prompt[s.prefilled:s.prefilled + take]
            positions[b] = s.prefilled + np.arange(width)
            mask[b, past_len:past_len + take] = 1
            if s.partial:
                held = _positions(s.partial)
                mask[b, :held] = 1
                for name in past:
                    past[name][b, :, :held] = s.partial[name][0]
        try:
            logits, present, hidden = self._run({"input_ids": ids, "attention_mask": mask,
                                                 "position_ids": positions, **past})
        except _RunFailed as e:  # this group's prompts end; nothing else held changed
            failed = {id(s) for s, _ in group}
            self.prefilling = [s for s in self.prefilling if id(s) not in failed]
            return [s._fail(e.cause) for s, _ in group], []
        produced: list[tuple[Sequence, int | None]] = []
        joining = []
        for b, (s, take) in enumerate(group):
            if s.score is not None:
                if logits.shape[1] < width:
                    produced.append(s._fail("the graph gives the last position's logits only: it cannot score a "
                                            "prompt"))
                    continue
                unscored = _scored(s, logits[b, :take])
                if unscored is not None:
                    produced.append(unscored)
                    continue
            self._keep_hidden(s, None if hidden is None else hidden[b, :take], s.prefilled)
            s.prefilled += take
            held = np.flatnonzero(mask[b])  # the row's own positions, the padding left out
            row = {name: value[b:b + 1, :, held] for name, value in present.items()}
            if s.prefilled < len(s.prompt):
                s.partial = row
                continue
            s.partial = None
            if self.prefix_cache is not None:
                self.prefix_cache.add(s.prompt, row, s.scope)
                self._fit_prefix_cache()
            last = take - 1 - (width - logits.shape[1])  # the graph may give the last position's logits only
            if last < 0:
                produced.append(s._fail("the graph gives the last position's logits only: run it with max_batch 1"))
                continue
            produced.append(self._choose(s, logits[b, last]))
            joining.append((s, row))
        done = {id(s) for s, _ in produced}
        self.prefilling = [s for s in self.prefilling if id(s) not in done]
        return produced, joining

    def _decode(self) -> list[tuple[Sequence, int | None]]:
        """One token for every row: the last token in, the graph's cache out kept as the batch cache."""
        batch = self.running
        mask = np.concatenate([self.mask, np.ones((len(batch), 1), np.int64)], axis=1)
        logits, self.cache, hidden = self._run({
            "input_ids": np.array([[s.output[-1]] for s in batch], np.int64), "attention_mask": mask,
            "position_ids": np.array([[len(s.prompt) + len(s.output) - 1] for s in batch], np.int64), **self.cache})
        self.mask = mask
        for b, s in enumerate(batch):
            self._keep_hidden(s, None if hidden is None else hidden[b], len(s.prompt) + len(s.output) - 1)
        return [self._choose(s, logits[b, -1]) for b, s in enumerate(batch)]

    def _speculate(self) -> list[tuple[Sequence, int | None]] | None:
        """A lone running sequence's drafted tokens verified in one run (the module's docstring): the tokens it
        made; None when it does not draft (a batch, others prefilling or waiting, no n-gram recurring)."""
        if self.speculation is None or len(self.running) != 1 or self.prefilling or self.waiting:
            return None
        s = self.running[0]
        if s.idle:
            s.idle -= 1
            return None
        k = min(self.speculation.num_speculative_tokens, s.max_new_tokens - len(s.output) - 1,
                self.speculation.num_speculative_tokens if s.speculative is None else s.speculative)
        drafted = [] if k <= 0 else self.mtp.draft(s, k) if self.mtp else \
            self.speculation.draft(s.prompt + s.output, k)
        if not drafted:
            return None
        logits = self._verify(s, drafted)
        if logits.shape[0] != len(drafted) + 1:  # the last position's logits only: nothing to verify with
            self.speculation = None
            return None
        produced: list[tuple[Sequence, int | None]] = []
        for i in range(len(drafted) + 1):
            produced.append(self._choose(s, logits[i]))
            token = produced[-1][1]
            if token is None or s.finished or i == len(drafted) or token != drafted[i]:
                break
        accepted = sum(1 for (_, t), d in zip(produced, drafted) if t == d)
        counts = self.spec_counts
        counts.drafts += 1
        counts.draft_tokens += len(drafted)
        counts.accepted += accepted
        for i in range(accepted):
            counts.accepted_at[i] += 1
        s.backoff = 0 if accepted else min(2 * s.backoff or 1, MAX_BACKOFF)
        s.idle = s.backoff
        self._commit(len(produced), len(drafted) + 1)
        return produced

    def _verify(self, s: Sequence, drafted: list[int]) -> np.ndarray:
        """The lone row's last token and drafts run after its cache: their logits [1 + drafts, vocab] (or fewer
        from a graph that gives the last position's only, the cache then unchanged); the new positions held until
        `_commit`."""
        new = len(drafted) + 1
        mask = np.concatenate([self.mask, np.ones((1, new), np.int64)], axis=1)
        at = len(s.prompt) + len(s.output) - 1
        logits, present, hidden = self._run({
            "input_ids": np.array([[s.output[-1], *drafted]], np.int64), "attention_mask": mask,
            "position_ids": (at + np.arange(new, dtype=np.int64))[None], **self.cache})
        if logits.shape[1] == new:
            self.cache, self.mask = present, mask
            self._keep_hidden(s, None if hidden is None else hidden[0], at)
        return logits[0]

    def _commit(self, made: int, verified: int) -> None:
        """Of the `verified` positions `_verify` added, keep the first `made` (the last token and the accepted
        drafts), dropping the rejected drafts' (and their hidden states, for MTP drafting)."""
        if self.running[0].mtp is not None:
            self.running[0].mtp.drop(verified - made)
        end = self.mask.shape[1] - verified + made
        if end < self.mask.shape[1]:
            self.mask = self.mask[:, :end]
            self.cache = {n: np.ascontiguousarray(v[:, :, :end]) for n, v in self.cache.items()}

    @staticmethod
    def _choose(s: Sequence, logits: np.ndarray) -> tuple[Sequence, int | None]:
        """The sequence's next token by its own rule; a rule that fails, or picks an id the graph cannot take
        back in, ends this sequence alone."""
        try:
            token = s.choose(logits, s.prompt, s.output)
        except Exception as e:  # noqa: BLE001 (a request's own sampling must not reach the others)
            return s._fail(e)
        if not 0 <= token < logits.shape[-1]:
            return s._fail(f"token {token} chosen outside the vocabulary 0..{logits.shape[-1] - 1}")
        s._take(token)
        return s, token

    def _append(self, joining: list[tuple[Sequence, dict[str, np.ndarray]]]) -> None:
        """The joining sequences' rows after the running ones, all padded (masked) to the longest."""
        if not joining:
            return
        width = max(self.mask.shape[1], *(_positions(c) for _, c in joining))

        def padded(a: np.ndarray, axis: int) -> np.ndarray:
            pad = [(0, 0)] * a.ndim
            pad[axis] = (0, width - a.shape[axis])
            return np.pad(a, pad) if pad[axis][1] else a

        self.cache = {n: np.concatenate([padded(self.cache[n], 2), *(padded(c[n], 2) for _, c in joining)])
                      for n in self.cache}
        self.mask = np.concatenate([padded(self.mask, 1),
                                    *(padded(np.ones((1, _positions(c)), np.int64), 1) for _, c in joining)])
        self.running += [s for s, _ in joining]

    def _keep(self, rows: list[int]) -> None:
        """Keep these rows of the batch (and only the positions they use)."""
        if len(rows) == len(self.running):
            return
        self.running = [self.running[i] for i in rows]
        mask = self.mask[rows]
        used = np.flatnonzero(mask.any(axis=0))
        if used.size < mask.shape[1]:
            mask = mask[:, used]
            self.cache = {n: v[rows][:, :, used] for n, v in self.cache.items()}
        else:
            self.cache = {n: v[rows] for n, v in self.cache.items()}
        self.mask = mask


class FusedRunner:
    """Runs the fused graph on cache buffers, numpy arrays [rows, kv_heads, capacity, head_dim] by input name that the
    op writes into (views of a larger buffer work: a run on rows 3..5 of the batch buffer writes there)."""

    def __init__(self, session):
        import onnxruntime as ort

        self.session, self.ort_value = session, ort.OrtValue.ortvalue_from_numpy
        self.binding, self.bound, self.held_arrays = None, None, []

    def run(self, ids: np.ndarray, held: np.ndarray, buffers: dict[str, np.ndarray],
            lora: dict[str, np.ndarray] | None = None) -> np.ndarray:
        """`ids` [rows, new] after `held` [rows] positions each -> logits [rows, new, vocab]; the new positions'
        keys and values written into `buffers` (capacity >= held + new). The cache bindings are kept while the
        buffers are the same memory and shape (each decoding step of a batch that did not change). A graph with LoRA
        inputs takes `lora`: each row's adapter weights (bound again only when they are other arrays)."""
        weights = lora or {}
        key = [(b.__array_interface__["data"][0], b.shape) for b in (*buffers.values(), *weights.values())]
        if self.binding is None or key != self.bound:
            self.release()
            binding = self.session.io_binding()
            binding.bind_output("logits")  # the first output (bound again each run: its shape changes)
            for name, buffer in buffers.items():
                value = self.ort_value(buffer)  # shares the array's memory (C-contiguous)
                binding.bind_ortvalue_input(name, value)
                binding.bind_ortvalue_output(name.replace("past_key_values.", "cache.", 1), value)
            for name, weight in weights.items():
                binding.bind_ortvalue_input(name, self.ort_value(weight))
            self.binding, self.bound = binding, key
            self.held_arrays = [*buffers.values(), *weights.values()]
        binding = self.binding
        binding.bind_cpu_input("input_ids", np.ascontiguousarray(ids, np.int64))
        binding.bind_cpu_input("seqlens_k", (held + ids.shape[1] - 1).astype(np.int32))
        binding.bind_cpu_input("total_sequence_length", np.array(int(held.max()) + ids.shape[1], np.int32))
        binding.bind_output("logits")
        self.session.run_with_iobinding(binding)
        return binding.get_outputs()[0].numpy()  # the logits alone (copying every output copied the whole cache)

    def release(self) -> None:
        """Forget the bound buffers (the arrays are kept alive only while bound)."""
        self.binding, self.bound, self.held_arrays = None, None, []


class FusedEngine(Engine):
    """The engine on the fused decoder graph (`dstool.fused_decoder`): the batch cache is one buffer per cache tensor,
    a row per running sequence (rows 0..R-1, compacted when one leaves) and room for the positions the longest may
    come to hold (prompt + max_new_tokens: made again when one needs more or the rest need half, released when the
    batch empties); each row holds its own positions from the
    first, so nothing is padded or masked, and a decoding step writes each row's new position in place — no cache
    is copied per token. Prompts' first chunks are prefilled together; a chunk after cached positions (a long
    prompt's next, or after a prefix-cache hit) runs one row at a time (the op's rule)."""

    def __init__(self, session, *args, **kwargs):
        """As `Engine`'s."""
        super().__init__(session, *args, **kwargs)
        self.runner = FusedRunner(session)
        self.held = np.zeros(0, np.int64)  # positions each running row holds
        layout = graph_layout(session.get_inputs())
        self.lora = RowWeights(layout) if layout else None

    def _drop_batch(self) -> None:
        self.running, self.cache, self.held = [], self._empty(0), np.zeros(0, np.int64)
        self.runner.release()  # the batch buffer goes with it

    def _fit(self, positions: int, shrink: bool = False) -> None:
        """Room in the batch buffer for max_batch rows of `positions` (made for exactly that many; with `shrink`,
        also when the buffer has twice the room)."""
        first = next(iter(self.cache.values()))
        if first.shape[2] >= positions and not (shrink and first.shape[2] >= 2 * positions):
            return
        refit = self._empty(self.max_batch, positions)
        rows, kept = len(self.running), min(first.shape[2], positions)
        for name, buffer in refit.items():
            buffer[:rows, :, :kept] = self.cache[name][:rows, :, :kept]
        self.cache = refit

    def _run_fused(self, ids: np.ndarray, held: np.ndarray, buffers: dict[str, np.ndarray],
                   rows: list[Sequence] | None = None) -> np.ndarray:
        """A run over `rows` (a prefill run's sequences, their own buffers), or over the batch buffer's first rows
        (None: the running sequences there)."""
        try:
            lora = None
            if self.lora is not None:  # the running batch's kept between steps; a prefill run's made for it
                lora = self.lora.rows([s.adapter for s in rows]) if rows is not None else \
                    self.lora.batch([s.adapter for s in self.running[:len(ids)]], self.max_batch)
            return self.runner.run(ids, held, buffers, lora)
        except Exception as e:  # noqa: BLE001 (whatever the runtime raises ends this run's sequences, not the engine)
            raise _RunFailed(e) from e

    def _prefill(self):
        """The next chunks of the prefilling prompts, up to `max_prefill_tokens` in all: first chunks together in one
        run, later ones (after cached positions) one run each. Each prompt's cache is a buffer of its own until it
        joins the batch."""
        group = self._chunks()
        fresh = [(s, take) for s, take in group if s.prefilled == 0]
        runs = [fresh] if fresh else []
        runs += [[(s, take)] for s, take in group if s.prefilled > 0]
        produced: list[tuple[Sequence, int | None]] = []
        joining = []
        for run in runs:
            for s, _ in run:
                if s.started_step is None:
                    s.started_step = self.steps_started
            if run is fresh:  # a buffer for them all, room for the longest whole prompt; a row each
                buffers = self._empty(len(run), max(len(s.prompt) for s, _ in run))
                for b, (s, _) in enumerate(run):
                    s.partial = {n: v[b:b + 1] for n, v in buffers.items()}
            else:
                s, _ = run[0]
                buffers = s.partial or {}
                if next(iter(buffers.values())).shape[2] < len(s.prompt):  # the prefix cache's blocks only
                    own = self._empty(1, len(s.prompt))
                    for n, v in buffers.items():
                        own[n][:, :, :v.shape[2]] = v
                    s.partial = buffers = own
            width = max(take for _, take in run)
            ids = np.zeros((len(run), width), np.int64)
            for b, (s, take) in enumerate(run):
                ids[b, :take] = s.prompt[s.prefilled:s.prefilled + take]
            held = np.array([s.prefilled for s, _ in run], np.int64)
            try:
                logits = self._run_fused(ids, held, buffers, [s for s, _ in run])
            except _RunFailed as e:  # this run's prompts end; nothing else held changed
                produced += [s._fail(e.cause) for s, _ in run]
                continue
            for b, (s, take) in enumerate(run):
                if s.score is not None:
                    unscored = _scored(s, logits[b, :take])
                    if unscored is not None:
                        produced.append(unscored)
                        continue
                s.prefilled += take
                if s.prefilled < len(s.prompt):
                    continue
                row, s.partial = s.partial or {}, None
                if self.prefix_cache is not None:
                    self.prefix_cache.add(s.prompt, row, s.scope)
                    self._fit_prefix_cache()
                produced.append(self._choose(s, logits[b, take - 1]))
                joining.append((s, row))
        done = {id(s) for s, _ in produced}
        self.prefilling = [s for s in self.prefilling if id(s) not in done]
        return produced, joining

    def _decode(self) -> list[tuple[Sequence, int | None]]:
        """One token for every row, its key and value written at the row's next position."""
        rows = len(self.running)
        self._fit(int(self.held.max()) + 1)
        ids = np.array([[s.output[-1]] for s in self.running], np.int64)
        logits = self._run_fused(ids, self.held, {n: v[:rows] for n, v in self.cache.items()})
        self.held = self.held + 1
        return [self._choose(s, logits[b, -1]) for b, s in enumerate(self.running)]

    def _verify(self, s: Sequence, drafted: list[int]) -> np.ndarray:
        ids = np.array([[s.output[-1], *drafted]], np.int64)
        self._fit(int(self.held[0]) + ids.shape[1])
        return self._run_fused(ids, self.held, {n: v[:1] for n, v in self.cache.items()})[0]

    def _commit(self, made: int, verified: int) -> None:
        self.held = self.held + made  # the rejected drafts' positions are written over next

    def _row(self, row: int) -> dict[str, np.ndarray]:
        return {n: v[row:row + 1, :, :self.held[row]].copy() for n, v in self.cache.items()}

    def _append(self, joining: list[tuple[Sequence, dict[str, np.ndarray]]]) -> None:
        """The joining sequences' caches copied into the next rows of the batch buffer."""
        if not joining:
            return
        self._fit(max(s.reserved for s in self.running + [s for s, _ in joining]))  # all they may come to hold
        for s, row in joining:
            at, length = len(self.running), len(s.prompt) + len(s.output) - 1  # the positions its cache holds
            for name, buffer in self.cache.items():
                buffer[at, :, :length] = row[name][0, :, :length]
            self.running.append(s)
            self.held = np.append(self.held, length)

    def _keep(self, rows: list[int]) -> None:
        """Keep these rows, moved up to fill the places of the others."""
        if len(rows) == len(self.running):
            return
        if not rows:
            self._drop_batch()
            return
        for to, row in enumerate(rows):
            if to != row:
                for buffer in self.cache.values():
                    buffer[to, :, :self.held[row]] = buffer[row, :, :self.held[row]]
        self.running = [self.running[i] for i in rows]
        self.held = self.held[rows]
        self._fit(max(s.reserved for s in self.running), shrink=True)  # the longest gone: its room with it


def engine_for(session, *args, **kwargs) -> Engine:
    """The engine for this decoder graph: the fused one's (it takes `seqlens_k`) or the exported one's."""
    fused = any(i.name == "seqlens_k" for i in session.get_inputs())
    return (FusedEngine if fused else Engine)(session, *args, **kwargs)


class PrefixCache:
    """Prompt prefixes already computed, kept by block of `block` tokens (as vLLM's automatic prefix caching): a
    block's keys and values are kept under a digest of a sequence's salt and every token up to the block's end, so a
    block is reused only after the very same prefix of the same salt (vLLM's cache_salt: tenants do not see each
    other's prefixes, in cached tokens or in time), and the least recently used blocks are dropped past `max_tokens`
    positions. A
    prompt's longest run of kept blocks from its start is its cached prefix; its last token is always computed (its
    logits choose the first new token). In an engine with a cache budget, the kept blocks take only what the
    admitted sequences leave of it."""

    def __init__(self, block: int = 16, max_tokens: int = 4096):
        if block < 1 or max_tokens < block:
            raise ValueError(f"a prefix cache needs block >= 1 and max_tokens >= block, got {block}, {max_tokens}")
        self.block, self.max_tokens = block, max_tokens
        self.blocks: OrderedDict[bytes, dict[str, np.ndarray]] = OrderedDict()  # digest -> [1, heads, block, dim]
        self.looked_up = self.hit = 0  # prompt tokens looked up, and found

    @property
    def tokens(self) -> int:
        """Positions held."""
        return len(self.blocks) * self.block

    def _digests(self, ids: list[int], blocks: int, salt: str) -> list[bytes]:
        digests, digest = [], hashlib.blake2b(salt.encode(), digest_size=16).digest() if salt else b""
        for b in range(blocks):
            chunk = np.asarray(ids[b * self.block:(b + 1) * self.block], np.int64).tobytes()
            digest = hashlib.blake2b(digest + chunk, digest_size=16).digest()
            digests.append(digest)
        return digests

    def match(self, prompt: list[int], salt: str = "") -> tuple[int, dict[str, np.ndarray] | None]:
        """(tokens, their cache [1, heads, tokens, dim] by input name) of the longest prefix of `prompt` kept under
        `salt`."""
        self.looked_up += len(prompt)
        found = []
        for digest in self._digests(prompt, (len(prompt) - 1) // self.block, salt):
            kept = self.blocks.get(digest)
            if kept is None:
                break
            self.blocks.move_to_end(digest)
            found.append(kept)
        if not found:
            return 0, None
        self.hit += len(found) * self.block
        return len(found) * self.block, {name: np.concatenate([b[name] for b in found], axis=2) for name in found[0]}

    def add(self, prompt: list[int], cache: dict[str, np.ndarray], salt: str = "") -> None:
        """Keep the whole blocks of `prompt` under `salt`, its cache [1, heads, >= len(prompt), dim] holding every
        position."""
        for b, digest in enumerate(self._digests(prompt, len(prompt) // self.block, salt)):
            if digest in self.blocks:
                self.blocks.move_to_end(digest)
                continue
            at = slice(b * self.block, (b + 1) * self.block)
            self.blocks[digest] = {name: v[:, :, at].copy() for name, v in cache.items()}  # not a view of the row
        self.shrink(self.max_tokens)

    def shrink(self, tokens: int) -> None:
        """Drop the least recently used blocks until at most `tokens` positions are held."""
        while self.blocks and self.tokens > tokens:
            self.blocks.popitem(last=False)


class _RunFailed(Exception):
    """The graph's run failed (`cause`); the sequences in it end."""

    def __init__(self, cause: BaseException):
        super().__init__(str(cause))
        self.cause = cause


def _scored(s: Sequence, logits: np.ndarray) -> tuple[Sequence, None] | None:
    """A prefilled chunk's logits to the sequence's `score` (before `prefilled` counts the chunk); a score that fails
    ends this sequence alone: (it, None), else None."""
    try:
        s.score(logits, s.prefilled)  # type: ignore[misc]
    except Exception as e:  # noqa: BLE001 (a request's own scoring must not reach the others)
        return s._fail(e)
    return None


def _positions(cache: dict[str, np.ndarray] | None) -> int:
    """Positions a sequence's own cache holds (0 for none)."""
    return next(iter(cache.values())).shape[2] if cache else 0
