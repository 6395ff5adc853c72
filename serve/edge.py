"""Text generation from an edge package (`dstool export --target edge`) under a memory cap: numpy, onnxruntime,
tokenizers and pydantic (the manifest) only — no torch, transformers or onnx.

    model = EdgeModel("edge_package", memory_cap_mb=64)
    result = model.generate("ROMEO:", max_new_tokens=32)     # text, ids, and what it cost (Stats)

The embedding and the head stay loaded. A prefill runs every block once over the whole prompt, a decoding step
once over one token; each block is an ORT-format session opened when it is needed. As many blocks as the cap
leaves room for stay open (the first ones: the blocks run in the same order at every step, so keeping the first
K open and streaming the rest through one session loads B - K per token, where an LRU of K would evict each block
just before its turn and load all B); the others are opened, run and released. The cap is checked against the
process's own resident memory, measured: a block is released early when opening it would pass the cap, and
generation stops with one line when even one block cannot be opened within it.
"""

from __future__ import annotations

import ctypes
import functools
import math
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dstool.artifacts import EdgePackage, EdgePart, ManifestError
from dstool.decoding.engine import Engine, Sequence
from dstool.errors import StageFailed, UsageError

MB = 1 << 20
# Opening an ORT-format session from its file peaks at a multiple of the file (the file read whole, the weights
# copied out; docs/export-serve.md has it measured): a block is opened only where this much still fits.
OPEN_PEAK = 3.0


def rss_bytes() -> int:
    """This process's resident memory now (Linux /proc; elsewhere the high-water mark, the best available)."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()
    except OSError:
        return peak_rss_bytes()


def reset_peak() -> bool:
    """Restart the resident-memory high-water mark (Linux: clear_refs 5); False where it cannot be."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """The resident-memory high-water mark since `reset_peak` (or since the process began)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


@functools.cache
def _libc():
    """glibc, where this process runs on it (else None: no hand-back, no free count; the cap is then checked on
    resident memory alone, which counts freed heap: more cautious)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    if hasattr(libc, "mallinfo2"):
        libc.mallinfo2.restype = _MallInfo2
    return libc


def _release_freed() -> None:
    """Hand freed heap back to the system (glibc keeps it otherwise, and a released block would still count). A
    released session is freed when its last reference goes (no cycles): no gc.collect, which costs ~0.2 s per call in
    a process holding torch's objects (measured), more than opening a small block."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def heap_free_bytes() -> int:
    """The free bytes glibc's main heap holds (mallinfo2's fordblks: freed, kept for reuse); 0 where unknown."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return 0
    return int(libc.mallinfo2().fordblks)


@dataclass
class Stats:
    """What one generation cost."""

    prompt_tokens: int
    new_tokens: int
    seconds: float
    tokens_per_s: float = 0.0  # new tokens over the whole time, prefill included
    baseline_rss_mb: float = 0.0  # the process before the package was opened
    resident_rss_mb: float = 0.0  # what the embedding and the head added, open (onnxruntime's own state included)
    peak_rss_mb: float = 0.0  # high-water mark during the generation
    peak_over_baseline_mb: float = 0.0  # what the package cost at its peak: the figure the cap bounds
    memory_cap_mb: float | None = None
    blocks: int = 0
    blocks_kept_open: int = 0
    block_loads: int = 0  # sessions opened for blocks during the generation


@dataclass
class Result:
    text: str
    ids: list[int]
    stats: Stats


class EdgeModel:
    def __init__(self, package: str | Path, memory_cap_mb: float | None = None, threads: int | None = None,
                 keep_open: int | None = None, manifest: EdgePackage | None = None):
        """Open `package` (its manifest checked, every file's size and sha256): the embedding and the head now,
        the blocks when generating. `memory_cap_mb`: the most resident memory the package may add to this
        process (None: no cap, every block stays open); `keep_open`: at most this many blocks stay open;
        `manifest`: the package's, not read from the folder (export, before writing it)."""
        import onnxruntime as ort
        from tokenizers import Tokenizer

        self.folder = Path(package)
        if not self.folder.is_dir():
            raise UsageError(f"edge package {package} is not a folder: pass the --output of `dstool export --target "
                             "edge`")
        try:
            self.manifest = manifest or EdgePackage.read(self.folder, verify=True)
        except ManifestError as e:
            raise UsageError(f"{e}: pass the --output of `dstool export --target edge`") from None
        self.ort = ort
        self.threads = threads
        self.cap = None if memory_cap_mb is None else int(memory_cap_mb * MB)
        self.keep_open = max(1, len(self.manifest.blocks) if keep_open is None else keep_open)
        self.prepack_blocks = self.cap is None and self.keep_open >= len(self.manifest.blocks)  # all stay open
        _release_freed()  # freed heap still resident now would hide what the package adds
        self.baseline = rss_bytes()
        self.tokenizer = Tokenizer.from_file(str(self.folder / self.manifest.tokenizer / "tokenizer.json"))
        self.embed = self._open(self.manifest.embed)
        self.head = self._open(self.manifest.head)
        self._trim()  # what opening them freed (the files read whole): resident memory then says what they hold
        self.resident = rss_bytes() - self.baseline
        self.last_position_head = self.manifest.head_last_position
        self.failure: BaseException | None = None  # what the last run raised (the engine ends the sequence on it)
        self.open_blocks: dict[int, object] = {}
        self.loads = 0
        self.need = 0  # MB the current generation was estimated to need (needs_mb)

    def _open(self, part: EdgePart, prepack: bool = True):
        """An ORT-format session as a minimal build runs it: the optimizations were applied at export, none now."""
        opts = self.ort.SessionOptions()
        if not prepack:
            # faster to open and smaller, a step slower: the better trade for a block that may be released soon
            opts.add_session_config_entry("session.disable_prepacking", "1")
        opts.log_severity_level = 3
        opts.graph_optimization_level = self.ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        opts.enable_cpu_mem_arena = False  # less memory per open block, the same speed
        # a session's threads spin after each run, and here the next block's session runs at once beside them
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        if self.threads:
            opts.intra_op_num_threads = self.threads
        elif not prepack:
            # a session's thread pool is made when it opens and joined when it is released: for a block that may be
            # released, one thread, at the cost of a long prompt's prefill running such blocks on one core
            opts.intra_op_num_threads = 1
        return self.ort.InferenceSession(str(self.folder / part.path), opts, providers=["CPUExecutionProvider"])

    def needs_mb(self, prompt_tokens: int, new_tokens: int) -> tuple[int, str]:
        """The memory a generation adds to this process at its peak, at most (MB, rounded up), and of what: the
        embedding and the head as they hold now, open; the largest block while it opens; the key/value cache of
        every position, twice (a block's input and its grown output exist at once); the prompt's logits. Plus 10 %
        and 2 MB for what Python and onnxruntime allocate besides. The one figure every memory hint gives."""
        largest = OPEN_PEAK * max(b.bytes for b in self.manifest.blocks)
        cache = 2 * (prompt_tokens + new_tokens) * 4 * sum(h * d for h, d in self.manifest.cache.values())
        logits = (1 if self.last_position_head else prompt_tokens) * self.tokenizer.get_vocab_size() * 4
        total = (self.resident + largest + cache + logits) * 1.1 + 2 * MB
        return math.ceil(total / MB), (f"the embedding and head open {self.resident / MB:.1f} MB, the largest block "
                                       f"while it opens {largest / MB:.1f} MB, the key/value cache "
                                       f"{cache / MB:.1f} MB")

    def _over_cap(self, extra: float) -> bool:
        return self.cap is not None and rss_bytes() - self.baseline + extra > self.cap

    def _reusable(self) -> int:
        """Heap freed since the last hand-back (a released block's weights, the file an opened one read): resident,
        so counted in the process's memory, and what the next allocations reuse before the process grows. (Heap
        handed back stays in glibc's free count without being resident: not counted.)"""
        return max(0, heap_free_bytes() - self.trimmed_free)

    def _trim(self) -> None:
        _release_freed()
        self.trimmed_free = heap_free_bytes()

    def _room(self, extra: float) -> bool:
        """Whether opening something that peaks at `extra` bytes keeps the process under the cap: the resident
        memory now, which counts freed heap, plus what `extra` needs beyond the freed heap it reuses. Freed heap is
        handed back to the system only when nothing is left to release: handing it back at every release and
        faulting it in again at the next open cost 3x the time (measured on 12 MB blocks: 43 instead of 13 ms per
        block load)."""
        return not self._over_cap(max(0.0, extra - self._reusable()))

    def _block(self, index: int):
        """Block `index`'s session, opened now if it is not open. To make room (the cap, or `keep_open`), the open
        block used last goes first: the one needed again latest, since the blocks run in order at every step."""
        if index in self.open_blocks:
            return self.open_blocks[index]
        part = self.manifest.blocks[index]
        while self.open_blocks and (len(self.open_blocks) >= self.keep_open or not self._room(OPEN_PEAK * part.bytes)):
            del self.open_blocks[max(self.open_blocks)]
        if self.cap is not None and not self._room(OPEN_PEAK * part.bytes):
            self._trim()  # nothing left to release: the freed heap goes back, and what is left counts
            if not self._room(OPEN_PEAK * part.bytes):
                # the cap held when the package was opened, but the cache and activations grew since: the cap is
                # too small for this generation, a usage error like a cap too small to open the package under
                raise UsageError(f"block {part.path} ({part.bytes / MB:.1f} MB) does not fit under the memory cap "
                                 f"of {self.cap / MB:g} MB: the process holds "
                                 f"{(rss_bytes() - self.baseline) / MB:.1f} MB more than before the package was "
                                 f"opened, beyond this generation's estimate of {self.need} MB; give a larger "
                                 "--memory-cap-mb")
        self.loads += 1
        self.open_blocks[index] = self._open(part, self.prepack_blocks)
        return self.open_blocks[index]

    def run(self, names: list[str], feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        """The unsplit decoder graph's outputs `names` (logits, cache.*) for `feeds`, part after part: what the engine
        runs (with a last-position head, the last position's logits only). A failure is kept in `failure` for
        `generate` to raise."""
        try:
            env = dict(feeds)
            env.update(zip(self.manifest.embed.outputs, self.embed.run(self.manifest.embed.outputs,
                                                                       {"input_ids": env["input_ids"]})))
            for index, part in enumerate(self.manifest.blocks):
                values = self._block(index).run(part.outputs, {name: env[name] for name in part.inputs})
                del env[part.inputs[0]]  # the hidden state it took: no later part needs it
                env.update(zip(part.outputs, values))
            hidden = env[self.manifest.head.inputs[0]]
            if self.last_position_head:
                hidden = hidden[:, -1:]
            env["logits"] = self.head.run(["logits"], {self.manifest.head.inputs[0]: hidden})[0]
            return [env[name] for name in names]
        except BaseException as e:
            self.failure = e
            raise

    def forward(self, ids: np.ndarray, past: dict[str, np.ndarray], past_len: int) -> tuple[np.ndarray,
                                                                                           dict[str, np.ndarray]]:
        """Logits of the last position of `ids` [1, seq] after `past_len` cached tokens, and the grown cache (one run,
        for the export's parity check)."""
        seq = ids.shape[1]
        feeds = {"input_ids": ids.astype(np.int64), "attention_mask": np.ones((1, past_len + seq), np.int64),
                 "position_ids": np.arange(past_len, past_len + seq, dtype=np.int64)[None], **past}
        logits, *caches = self.run(["logits", *(n.replace("past_key_values.", "cache.", 1) for n in past)], feeds)
        return logits[0, -1], dict(zip(past, caches))

    def empty_cache(self) -> dict[str, np.ndarray]:
        return {name: np.zeros((1, heads, 0, size), np.float32) for name, (heads, size) in self.manifest.cache.items()}

    def generate(self, prompt: str, max_new_tokens: int = 32, choose: Callable[[np.ndarray, list[int], list[int]],
                 int] | None = None, stop_ids: set[int] | None = None) -> Result:
        """Continue `prompt` by up to `max_new_tokens` tokens, greedy unless `choose` ((logits, prompt ids, output
        ids) -> token, e.g. the serving models' Sampler.next) is given; stops at end-of-sequence."""
        prompt_ids = self.tokenizer.encode(prompt).ids
        if max_new_tokens < 1:
            raise UsageError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        if not prompt_ids:
            raise UsageError("the prompt is empty after tokenization: give some text")
        if len(prompt_ids) + max_new_tokens > self.manifest.max_positions:
            raise UsageError(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) exceed the "
                             f"model's {self.manifest.max_positions} positions")
        self.need, parts = self.needs_mb(len(prompt_ids), max_new_tokens)
        if self.cap is not None and self.cap < self.need * MB:
            raise UsageError(f"--memory-cap-mb {self.cap / MB:g} is below what this generation needs: give at least "
                             f"{self.need} ({parts}; {len(prompt_ids)} + {max_new_tokens} positions)")
        stops = set(self.manifest.eos_token_ids) if stop_ids is None else stop_ids
        choose = choose or (lambda logits, _p, _o: int(np.argmax(logits)))
        reset = reset_peak()
        loads, started = self.loads, time.perf_counter()
        sequence = Sequence("edge", prompt_ids, max_new_tokens, choose, stops)
        engine = Engine(self, {name: (heads, size) for name, (heads, size) in self.manifest.cache.items()}, max_batch=1,
                        max_prefill_tokens=len(prompt_ids))
        engine.add(sequence)
        self.failure = None
        while engine.busy:
            engine.step()
            if self.failure is not None:
                raise self.failure
        if sequence.error:
            raise StageFailed(f"generation failed: {sequence.error}")
        output = sequence.output
        seconds = time.perf_counter() - started
        peak = peak_rss_bytes() if reset else max(peak_rss_bytes(), rss_bytes())
        stats = Stats(prompt_tokens=len(prompt_ids), new_tokens=len(output), seconds=seconds,
                      tokens_per_s=len(output) / seconds, baseline_rss_mb=self.baseline / MB,
                      resident_rss_mb=self.resident / MB, peak_rss_mb=peak / MB,
                      peak_over_baseline_mb=(peak - self.baseline) / MB,
                      memory_cap_mb=None if self.cap is None else self.cap / MB, blocks=len(self.manifest.blocks),
                      blocks_kept_open=len(self.open_blocks), block_loads=self.loads - loads)
        return Result(self.tokenizer.decode(output, skip_special_tokens=True), output, stats)


def stats_line(stats: Stats) -> str:
    cap = f" (cap {stats.memory_cap_mb:g} MB)" if stats.memory_cap_mb is not None else ""
    return (f"{stats.new_tokens} tokens in {stats.seconds:.2f} s, {stats.tokens_per_s:.1f} tokens/s; peak resident "
            f"memory {stats.peak_rss_mb:.1f} MB, {stats.peak_over_baseline_mb:.1f} MB over the process before the "
            f"package{cap}; {stats.blocks_kept_open} of {stats.blocks} blocks kept open, {stats.block_loads} block "
            "loads")
