"""Text generation with continuous (in-flight) batching over the exported key/value-cache decoder graph, in one
process (numpy + onnxruntime): no Triton calls and no copies between processes per token.

    engine = Engine(onnxruntime.InferenceSession("model.onnx"), cache_shapes, max_batch=16)
    engine.add(Sequence("a", prompt_ids, max_new_tokens=32, choose=sampler.next, stop_ids={eos}))
    while engine.busy:
        for sequence, token in engine.step(): ...   # each running sequence's next token

Each `step` first admits waiting sequences (as many as `max_batch` and the `max_cache_tokens` budget allow —
admission waits, it never fails, when the budget is spent) and prefills them together, then runs one decoding
step for the sequences that were already running; so a newcomer gets its first token in the step it joins, and
holds the others up by one prefill at most. A sequence leaves the batch as soon as it finishes. Each sequence
keeps its own cache (the tokens it has seen, no padding); a step lays the running caches side by side, padded
to the longest and masked, as the graph takes them, and keeps the one new position of each.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Sequence:
    """One request: its prompt ids, how many tokens it may add, how it chooses them, where it stops."""

    id: str
    prompt: list[int]
    max_new_tokens: int
    choose: Callable[[np.ndarray, list[int], list[int]], int]  # (logits row, prompt, output) -> token
    stop_ids: set[int]
    output: list[int] = field(default_factory=list)
    cache: dict[str, np.ndarray] = field(default_factory=dict)  # input name -> [kv_heads, seen, head_dim]
    finished: bool = False

    @property
    def reserved(self) -> int:
        """Cache positions this sequence may come to hold."""
        return len(self.prompt) + self.max_new_tokens

    def _take(self, token: int) -> None:
        self.output.append(token)
        self.finished = token in self.stop_ids or len(self.output) >= self.max_new_tokens


class Engine:
    def __init__(self, session, cache_shapes: dict[str, tuple[int, int]], max_batch: int = 16,
                 max_cache_tokens: int | None = None):
        """`session`: an onnxruntime session of the decoder graph; `cache_shapes`: its cache inputs
        (past_key_values.*) -> (kv_heads, head_dim); `max_cache_tokens`: the cache positions all running
        sequences together may hold (default: unbounded)."""
        self.session = session
        self.cache_shapes = cache_shapes
        self.cache_outputs = {name: name.replace("past_key_values.", "cache.", 1) for name in cache_shapes}
        self.max_batch = max_batch
        self.max_cache_tokens = max_cache_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, sequence: Sequence) -> None:
        if self.max_cache_tokens is not None and sequence.reserved > self.max_cache_tokens:
            raise ValueError(f"prompt ({len(sequence.prompt)} tokens) + max_new_tokens ({sequence.max_new_tokens}) "
                             f"exceed the engine's {self.max_cache_tokens} cache positions")
        self.waiting.append(sequence)

    def cancel(self, sequence_id: str) -> None:
        """Drop a sequence, waiting or running (its client has gone)."""
        self.waiting = deque(s for s in self.waiting if s.id != sequence_id)
        self.running = [s for s in self.running if s.id != sequence_id]

    def step(self) -> list[tuple[Sequence, int]]:
        """Admit and prefill newcomers, decode one token for the others; (sequence, new token) for each."""
        decoding = list(self.running)
        newcomers = self._admit()
        produced = self._prefill(newcomers) if newcomers else []
        if decoding:
            produced += self._decode(decoding)
        self.running = [s for s in self.running if not s.finished]
        return produced

    def _admit(self) -> list[Sequence]:
        held = sum(s.reserved for s in self.running)
        admitted = []
        while self.waiting and len(self.running) < self.max_batch and (
                self.max_cache_tokens is None or held + self.waiting[0].reserved <= self.max_cache_tokens):
            s = self.waiting.popleft()
            held += s.reserved
            self.running.append(s)
            admitted.append(s)
        return admitted

    def _run(self, feeds: dict[str, np.ndarray]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        names = ["logits", *self.cache_outputs.values()]
        logits, *caches = self.session.run(names, feeds)
        return logits, dict(zip(self.cache_shapes, caches))

    def _prefill(self, batch: list[Sequence]) -> list[tuple[Sequence, int]]:
        lengths = [len(s.prompt) for s in batch]
        ids = np.zeros((len(batch), max(lengths)), np.int64)
        mask = np.zeros_like(ids)
        for b, s in enumerate(batch):  # right-padded, the padding masked
            ids[b, :lengths[b]], mask[b, :lengths[b]] = s.prompt, 1
        positions = np.broadcast_to(np.arange(ids.shape[1]), ids.shape).astype(np.int64)
        empty = {name: np.zeros((len(batch), heads, 0, dim), np.float32)
                 for name, (heads, dim) in self.cache_shapes.items()}
        logits, present = self._run({"input_ids": ids, "attention_mask": mask, "position_ids": positions, **empty})
        produced = []
        for b, s in enumerate(batch):
            s.cache = {name: np.ascontiguousarray(value[b, :, :lengths[b]]) for name, value in present.items()}
            token = s.choose(logits[b, lengths[b] - 1], s.prompt, s.output)
            s._take(token)
            produced.append((s, token))
        return produced

    def _decode(self, batch: list[Sequence]) -> list[tuple[Sequence, int]]:
        seen = [len(s.prompt) + len(s.output) - 1 for s in batch]  # positions in each cache; the last token is new
        longest = max(seen)
        mask = np.zeros((len(batch), longest + 1), np.int64)
        past = {name: np.zeros((len(batch), heads, longest, dim), np.float32)
                for name, (heads, dim) in self.cache_shapes.items()}
        for b, s in enumerate(batch):  # each cache left-aligned, the padding up to the longest masked
            mask[b, :seen[b]] = 1
            for name in past:
                past[name][b, :, :seen[b]] = s.cache[name]
        mask[:, -1] = 1
        logits, present = self._run({
            "input_ids": np.array([[s.output[-1]] for s in batch], np.int64), "attention_mask": mask,
            "position_ids": np.array([[n] for n in seen], np.int64), **past})
        produced = []
        for b, s in enumerate(batch):
            s.cache = {name: np.concatenate([s.cache[name], value[b, :, -1:]], axis=1)
                       for name, value in present.items()}
            token = s.choose(logits[b, -1], s.prompt, s.output)
            s._take(token)
            produced.append((s, token))
        return produced
