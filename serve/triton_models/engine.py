"""Text generation with continuous (in-flight) batching over the exported key/value-cache decoder graph, in one
process (numpy + onnxruntime): no Triton calls and no copies between processes per token.

    engine = Engine(onnxruntime.InferenceSession("model.onnx"), cache_shapes, max_batch=16)
    engine.add(Sequence("a", prompt_ids, max_new_tokens=32, choose=sampler.next, stop_ids={eos}))
    while engine.busy:
        for sequence, token in engine.step(): ...   # each running sequence's next token

Each `step` first admits waiting sequences (as many as `max_batch` and the `max_cache_tokens` budget allow —
admission waits, it never fails, when the budget is spent) and prefills them together, then runs one decoding
step for the sequences that were already running; so a newcomer gets its first token in the step it joins, and
holds the others up by one prefill at most. A sequence leaves the batch as soon as it finishes.

The running sequences share one batch cache, a row each, with a mask of the positions each row holds: the cache
the graph returns from a decoding step is the next step's input as it is (no copy per token, as in a plain
generation loop). Rows of different lengths are padded where they joined, and the padding is masked; each row
keeps its own position ids. The cache is copied only when the batch changes: newcomers' rows appended, finished
rows dropped (and columns no row uses any more with them).
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
        self.running: list[Sequence] = []  # the batch cache's rows, in order
        self.cache: dict[str, np.ndarray] = self._empty(0)  # input name -> [rows, kv_heads, positions, head_dim]
        self.mask = np.zeros((0, 0), np.int64)  # [rows, positions]: 1 where a row holds a token

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
        self._keep([i for i, s in enumerate(self.running) if s.id != sequence_id])

    def step(self) -> list[tuple[Sequence, int]]:
        """Admit and prefill newcomers, decode one token for the others; (sequence, new token) for each."""
        newcomers = self._admit()
        produced = []
        if newcomers:
            produced, cache, mask = self._prefill(newcomers)
        if self.running:
            produced += self._decode()
        if newcomers:
            self._append(newcomers, cache, mask)
        self._keep([i for i, s in enumerate(self.running) if not s.finished])
        return produced

    def _empty(self, rows: int, positions: int = 0) -> dict[str, np.ndarray]:
        return {name: np.zeros((rows, heads, positions, dim), np.float32)
                for name, (heads, dim) in self.cache_shapes.items()}

    def _admit(self) -> list[Sequence]:
        held = sum(s.reserved for s in self.running)
        admitted: list[Sequence] = []
        while self.waiting and len(self.running) + len(admitted) < self.max_batch and (
                self.max_cache_tokens is None or held + self.waiting[0].reserved <= self.max_cache_tokens):
            s = self.waiting.popleft()
            held += s.reserved
            admitted.append(s)
        return admitted

    def _run(self, feeds: dict[str, np.ndarray]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        names = ["logits", *self.cache_outputs.values()]
        logits, *caches = self.session.run(names, feeds)
        return logits, dict(zip(self.cache_shapes, caches))

    def _prefill(self, batch: list[Sequence]):
        """The newcomers' prompts together (right-padded, the padding masked): their first tokens, cache and mask."""
        lengths = [len(s.prompt) for s in batch]
        ids = np.zeros((len(batch), max(lengths)), np.int64)
        mask = np.zeros_like(ids)
        for b, s in enumerate(batch):
            ids[b, :lengths[b]], mask[b, :lengths[b]] = s.prompt, 1
        positions = np.broadcast_to(np.arange(ids.shape[1]), ids.shape).astype(np.int64)
        logits, present = self._run({"input_ids": ids, "attention_mask": mask, "position_ids": positions,
                                     **self._empty(len(batch))})
        return [self._choose(s, logits[b, lengths[b] - 1]) for b, s in enumerate(batch)], present, mask

    def _decode(self) -> list[tuple[Sequence, int]]:
        """One token for every row: the last token in, the graph's cache out kept as the batch cache."""
        batch = self.running
        self.mask = np.concatenate([self.mask, np.ones((len(batch), 1), np.int64)], axis=1)
        logits, self.cache = self._run({
            "input_ids": np.array([[s.output[-1]] for s in batch], np.int64), "attention_mask": self.mask,
            "position_ids": np.array([[len(s.prompt) + len(s.output) - 1] for s in batch], np.int64), **self.cache})
        return [self._choose(s, logits[b, -1]) for b, s in enumerate(batch)]

    @staticmethod
    def _choose(s: Sequence, logits: np.ndarray) -> tuple[Sequence, int]:
        token = s.choose(logits, s.prompt, s.output)
        s._take(token)
        return s, token

    def _append(self, newcomers: list[Sequence], cache: dict[str, np.ndarray], mask: np.ndarray) -> None:
        """The newcomers' rows after the running ones, the shorter side padded (masked) to the longer."""
        width = max(self.mask.shape[1], mask.shape[1])

        def padded(a: np.ndarray, axis: int) -> np.ndarray:
            pad = [(0, 0)] * a.ndim
            pad[axis] = (0, width - a.shape[axis])
            return np.pad(a, pad) if pad[axis][1] else a

        self.cache = {n: np.concatenate([padded(self.cache[n], 2), padded(cache[n], 2)]) for n in self.cache}
        self.mask = np.concatenate([padded(self.mask, 1), padded(mask, 1)])
        self.running += newcomers

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
