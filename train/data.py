"""Sources -> tokenizer -> tokenized shards (cached by content hash) -> the run's data set, and the resumable global
sample order (a mixture of sources when they are weighted).

A tokenized shard is a folder of fixed-length sequences: tokens.bin, and for instruction data learn.bin (1 where the
token is learned) and pos.bin (position ids restarting at each packed example, so attention stays within it). Its
last `--val-fraction` of sequences is held out. Shards are made once per (shard bytes and reader, tokenizer, format,
seq_len) in the cache (dstool.files.cache_dir()/tokenized), in parallel, and hard-linked into the run's
data/shards/.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import shutil
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import ByteLevelBPETokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from dstool import log as dlog
from dstool.errors import UsageError
from dstool.files import cache_dir, replace_folder, sha256_file, write_json_atomic
from dstool.train import chat, sources

__all__ = ["train_tokenizer", "load_or_train_tokenizer", "fingerprint", "prepare", "open_run", "run_sha256",
           "GlobalOrder", "Mixture", "Split", "collate"]
log = dlog.log
EOS = "<|endoftext|>"
PAD = "<|pad|>"
_TOKENIZER_TEXT = 100 << 20  # bytes of text a tokenizer is trained on, at most
_SHARD_LAYOUT = 3  # part of every cached shard's key: a change to how shards are tokenized or laid out bumps it
_SAMPLE_TOKENS = 2_000_000  # tokens of data/train.bin and data/val.bin (calibration and measurement samples)


def train_tokenizer(docs, vocab_size: int):
    """A byte-level BPE trained on `docs` (an iterable of text), wrapped as a transformers fast tokenizer."""
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(docs, vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS, PAD],
                            show_progress=False)
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token=EOS, eos_token=EOS,
                                   pad_token=PAD, unk_token=None, model_max_length=1 << 30)


def _texts(srcs: list[sources.Source], data_format: str):
    """Up to _TOKENIZER_TEXT bytes of the sources' text, for training a tokenizer."""
    seen = 0
    for src in srcs:
        for shard in src.shards:
            for batch in sources.rows(shard, data_format):
                for row in batch:
                    if data_format == "text":
                        text = row["text"] if isinstance(row["text"], str) else ""
                    elif data_format == "chat":
                        msgs = row["messages"] if isinstance(row["messages"], list) else []
                        text = "\n".join(str(m.get("content") or "") for m in msgs if isinstance(m, dict))
                    else:
                        text = f"{row['prompt'] or ''}{row['completion'] or ''}"
                    yield text
                    seen += len(text)
                    if seen > _TOKENIZER_TEXT:
                        return


def load_or_train_tokenizer(model_ref: str, srcs: list[sources.Source], cfg, save_dir: Path):
    """The run's tokenizer: saved in `save_dir` by an earlier start, else the model folder's, else a BPE trained on
    the data; with the chat template asked for."""
    if (save_dir / "tokenizer.json").is_file():
        tok = AutoTokenizer.from_pretrained(save_dir)
        if cfg.chat_template is not None:
            before = tok.chat_template
            chat.set_template(tok, cfg.chat_template, needed=False)
            if tok.chat_template != before:
                raise UsageError(f"--chat-template {cfg.chat_template} differs from the template this run's tokenizer "
                                 f"({save_dir}) was saved with: use a new --output for another template")
        chat.set_template(tok, None, needed=cfg.data_format == "chat")
        return tok
    model_dir = Path(model_ref)
    if model_dir.is_dir() and any((model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer.model")):
        tok = AutoTokenizer.from_pretrained(model_dir)
    else:
        tok = train_tokenizer(_texts(srcs, cfg.data_format), cfg.vocab_size)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    chat.set_template(tok, cfg.chat_template, needed=cfg.data_format == "chat")
    tmp = save_dir.with_name(save_dir.name + ".tmp")
    tok.save_pretrained(tmp)
    replace_folder(tmp, save_dir)
    return tok


def _tokenizer_id(tok) -> str:
    """What decides a shard's tokens besides its bytes: the vocabulary, merges, special tokens and chat template."""
    h = hashlib.sha256(tok.backend_tokenizer.to_str().encode())
    h.update(json.dumps([tok.eos_token_id, tok.pad_token_id, tok.chat_template or ""]).encode())
    return h.hexdigest()


@dataclass
class _Job:
    shard: str
    digest: str
    data_format: str
    seq_len: int
    tokenizer_dir: str
    target: str


def _tokenize(job: _Job) -> dict:
    """Tokenize and pack one shard into `job.target` (written beside it, then renamed)."""
    tok = AutoTokenizer.from_pretrained(job.tokenizer_dir)
    target = Path(job.target)
    tmp = target.with_name(f".{target.name}.tmp-{uuid.uuid4().hex}")  # unique across hosts sharing the cache
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    packer = _Packer(tmp, job.seq_len, len(tok), tok.eos_token_id, tok.pad_token_id, job.data_format != "text")
    rows = dropped = 0
    started = False  # a .txt document has text so far
    with packer:
        for batch in sources.rows(job.shard, job.data_format):
            if job.data_format == "text":  # whitespace-only rows are no documents; a .txt's pieces end with one EOS
                for i, r in enumerate(batch):
                    if not isinstance(r["text"], str):
                        raise UsageError(f"{job.shard} row {rows + i + 1}: text is {type(r['text']).__name__}, not "
                                         "text: fix or drop the row")
                batch = [r for r in batch if r["text"].strip() or (r.get("piece") is False and started)]
                if not batch:
                    continue
                for r, ids in zip(batch, tok([r["text"] for r in batch], add_special_tokens=False)["input_ids"]):
                    packer.stream(ids + ([] if r.get("piece") else [tok.eos_token_id]))
                    started = bool(r.get("piece"))
                rows += sum(not r.get("piece") for r in batch)
                continue
            for r in batch:
                rows += 1
                ids, learn = chat.encode(r, job.data_format, tok, f"{job.shard} row {rows}")
                dropped += not packer.example(ids, learn)
    meta = {"shard": job.shard, "sha256": job.digest, "format": job.data_format, "seq_len": job.seq_len,
            "dtype": packer.dtype.name, "rows": rows, "sequences": packer.sequences, "tokens": packer.real_tokens,
            "tail_tokens": packer.tail, "truncated": packer.truncated, "dropped": dropped,
            "files": {f.name: sha256_file(f) for f in sorted(tmp.glob("*.bin"))}}
    write_json_atomic(tmp / "meta.json", meta)
    try:
        replace_folder(tmp, target)
    except OSError:  # another process (a run on another output, another host) made the same entry meanwhile
        shutil.rmtree(tmp, ignore_errors=True)
        if not _cached(target):
            raise
    return meta


class _Packer:
    """Appends fixed-length sequences to tokens.bin (learn.bin and pos.bin for instruction data) as they fill."""

    def __init__(self, folder: Path, seq_len: int, vocab: int, eos: int, pad: int, examples: bool):
        self.seq_len, self.eos, self.pad, self.examples = seq_len, eos, pad, examples
        self.dtype = np.dtype(np.uint16 if vocab < 65536 else np.uint32)
        self.files = {name: open(folder / f"{name}.bin", "wb") for name in
                      (("tokens", "learn", "pos") if examples else ("tokens",))}
        self.buf: dict[str, list[int]] = {name: [] for name in self.files}
        self.sequences = self.real_tokens = self.truncated = self.tail = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if exc[0] is None and self.examples and self.buf["tokens"]:
            self._close_sequence()
        self.tail = 0 if self.examples else len(self.buf["tokens"])  # text that fills no whole sequence
        for f in self.files.values():
            f.close()

    def stream(self, ids: list[int]) -> None:
        """Text: one token stream cut into sequences (attention crosses documents, EOS between them)."""
        buf = self.buf["tokens"]
        buf.extend(ids)
        full = len(buf) // self.seq_len * self.seq_len
        if full:
            np.asarray(buf[:full], dtype=self.dtype).tofile(self.files["tokens"])
            self.sequences += full // self.seq_len
            self.real_tokens += full
            del buf[:full]

    def example(self, ids: list[int], learn: list[int]) -> bool:
        """Instruction data: whole examples packed into sequences, truncated to one sequence; False when nothing of
        it is left to learn (dropped)."""
        if len(ids) > self.seq_len:
            ids, learn = ids[:self.seq_len], learn[:self.seq_len]
            self.truncated += 1
        if not any(learn):
            return False
        if len(self.buf["tokens"]) + len(ids) > self.seq_len:
            self._close_sequence()
        self.buf["tokens"].extend(ids)
        self.buf["learn"].extend(learn)
        self.buf["pos"].extend(range(len(ids)))
        self.real_tokens += len(ids)
        return True

    def _close_sequence(self) -> None:
        fill = self.seq_len - len(self.buf["tokens"])
        self.buf["tokens"].extend([self.pad] * fill)
        self.buf["learn"].extend([0] * fill)
        self.buf["pos"].extend(range(fill))  # the padding is a segment of its own
        for name, dtype in (("tokens", self.dtype), ("learn", np.uint8), ("pos", np.uint16)):
            np.asarray(self.buf[name], dtype=dtype).tofile(self.files[name])
            self.buf[name] = []
        self.sequences += 1


def fingerprint(cfg, srcs: list[sources.Source]) -> str:
    """sha256 over what the data set is made of: the format, and each source's weight and shards' bytes (hashed
    here, through the stat cache)."""
    stat_cache = sources.StatCache(cache_dir() / "tokenized" / "hashes.json")
    for src in srcs:
        src.hashes = [sources.content_hash(s, stat_cache.entries) for s in src.shards]
    stat_cache.save()
    return hashlib.sha256(json.dumps([cfg.data_format, [[src.weight, src.hashes] for src in srcs]]).encode()
                          ).hexdigest()[:16]


def prepare(cfg, srcs: list[sources.Source], tokenizer, out_dir: Path) -> dict:
    """The run's data set in `out_dir` (`srcs` hashed by `fingerprint`): every shard tokenized (from the cache when
    it was before), linked in, and data/meta.json describing the sources; returns that meta."""
    tok_id = _tokenizer_id(tokenizer)
    jobs = []
    for src in srcs:
        for shard, digest in zip(src.shards, src.hashes):
            reader = sources.reader(shard)  # the same bytes read as .txt and as .jsonl are different data
            key = hashlib.sha256(json.dumps([_SHARD_LAYOUT, digest, reader, tok_id, cfg.data_format, cfg.seq_len]
                                            ).encode())
            jobs.append(_Job(shard, digest, cfg.data_format, cfg.seq_len, str(out_dir.parent / "tokenizer"),
                             str(cache_dir() / "tokenized" / key.hexdigest()[:32])))
    todo = list({j.target: j for j in jobs if not _cached(Path(j.target))}.values())  # equal shards: once
    if todo:
        log.info(f"  tokenizing {len(todo)} of {len(jobs)} shard(s) ({len(jobs) - len(todo)} from the cache "
                 f"{cache_dir() / 'tokenized'})")
        workers = min(len(todo), os.cpu_count() or 1)
        if workers > 1:
            with multiprocessing.get_context("spawn").Pool(workers) as pool:
                pool.map(_tokenize, todo, chunksize=1)
        else:
            for job in todo:
                _tokenize(job)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "shards").mkdir(parents=True)
    described: list[dict] = []
    k = 0
    for src in srcs:
        shards = []
        for _ in src.shards:
            job = jobs[k]
            k += 1
            name = f"{k - 1:05d}"
            _link_folder(Path(job.target), tmp / "shards" / name)
            shards.append({"name": name, **json.loads((Path(job.target) / "meta.json").read_text())})
        described.append({"spec": src.spec, "weight": src.weight, "shards": shards})
    _hold_out(described, cfg.val_fraction)
    meta = _describe(cfg, described)
    if meta["documents"] == 0:
        raise UsageError(f"data {cfg.data} is empty: it holds no text to train on")
    if meta["train_sequences"] == 0:
        raise UsageError(f"--data holds no full {cfg.seq_len}-token sequence to train on: give more data or a smaller "
                         "--seq-len")
    if meta["val_sequences"] == 0:
        raise UsageError("--data is too small to hold out a validation sequence (it needs two sequences in one "
                         "shard): give more data")
    for entry in described:
        if entry["weight"] and not sum(s["sequences"] - s["val_sequences"] for s in entry["shards"]):
            raise UsageError(f"--data {entry['spec']} has weight {entry['weight']:g} but no sequence to train on: "
                             "give it more data or weight 0")
    write_json_atomic(tmp / "meta.json", meta)
    _write_samples(tmp, meta, tokenizer.pad_token_id)
    replace_folder(tmp, out_dir)
    return meta


def _hold_out(described: list[dict], fraction: float) -> None:
    """Each shard's held-out sequences: the last `fraction` of them (rounded down), and when that leaves the whole
    data set none, the last sequence of its largest shard."""
    shards = [s for src in described for s in src["shards"]]
    for s in shards:
        s["val_sequences"] = int(s["sequences"] * fraction)
    largest = max(shards, key=lambda s: s["sequences"])
    if not any(s["val_sequences"] for s in shards) and largest["sequences"] >= 2:
        largest["val_sequences"] = 1


def _describe(cfg, described: list[dict]) -> dict:
    shards = [s for src in described for s in src["shards"]]
    train = sum(s["sequences"] - s["val_sequences"] for s in shards)
    val = sum(s["val_sequences"] for s in shards)
    dtype = max((s["dtype"] for s in shards), key=lambda d: np.dtype(d).itemsize)
    return {"format": cfg.data_format, "seq_len": cfg.seq_len, "val_fraction": cfg.val_fraction, "dtype": dtype,
            "sources": described, "train_sequences": train, "val_sequences": val,
            "train_tokens": train * cfg.seq_len, "val_tokens": val * cfg.seq_len,
            "documents": sum(s["rows"] for s in shards), "truncated": sum(s["truncated"] for s in shards),
            "tail_tokens": sum(s["tail_tokens"] for s in shards), "tokens": sum(s["tokens"] for s in shards),
            "dropped": sum(s["dropped"] for s in shards)}


def _cached(folder: Path) -> bool:
    """A tokenized shard in the cache whose files are those it was written with (a run's data/shards/ are hard links
    to them: a file changed in either place is tokenized again)."""
    try:
        files = json.loads((folder / "meta.json").read_text())["files"]
    except (OSError, ValueError, KeyError):
        return False
    return all((folder / name).is_file() and sha256_file(folder / name) == digest for name, digest in files.items())


def _link_folder(src: Path, dst: Path) -> None:
    """Hard links of the cached shard's files (a copy across file systems)."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        try:
            os.link(f, dst / f.name)
        except OSError:
            shutil.copy2(f, dst / f.name)


def _write_samples(folder: Path, meta: dict, pad: int) -> None:
    """data/train.bin and data/val.bin: the first training and held-out tokens (up to _SAMPLE_TOKENS each; packed
    examples without their padding) as flat arrays, which `dstool compress` calibrates and measures on."""
    run = _RunData(folder, meta)
    for name, split in (("train", run.train), ("val", run.val)):
        n = min(len(split), max(1, _SAMPLE_TOKENS // meta["seq_len"]))
        parts = [split.tokens(i) if meta["format"] == "text" else _unpadded(split, i, pad) for i in range(n)]
        (np.concatenate(parts) if parts else np.zeros(0)).astype(meta["dtype"]).tofile(folder / f"{name}.bin")


def _unpadded(split: Split, i: int, pad: int) -> np.ndarray:
    """A packed sequence without its padding: the last segment (positions restart at 0), when it is all `pad`."""
    sample = split[i]
    ids, starts = sample["input_ids"].numpy(), np.flatnonzero(sample["position_ids"].numpy() == 0)
    last = int(starts[-1]) if len(starts) else len(ids)
    return ids[:last] if last and (ids[last:] == pad).all() else ids


def run_sha256(data_dir: Path) -> dict[str, str]:
    """sha256 of every file of the run's data set, by path relative to `data_dir`."""
    return {str(f.relative_to(data_dir)): sha256_file(f) for f in sorted(data_dir.rglob("*.bin"))}


class Split:
    """Sequences over several tokenized shards: `split[i]` is one sequence's model inputs. Shards are memory-mapped
    when read, the most recent OPEN kept (a data set of thousands of shards holds no file descriptor per shard)."""

    OPEN = 64

    def __init__(self, parts: list[tuple[Path, int, int, str]], examples: bool):
        """parts: (shard folder, first sequence, sequences, dtype)."""
        self.examples, self.parts = examples, parts
        self.seq_len = [json.loads((folder / "meta.json").read_text())["seq_len"] for folder, *_ in parts]
        self.ends = np.cumsum([p[2] for p in parts]) if parts else np.zeros(0, dtype=np.int64)
        self._open: OrderedDict[int, dict[str, np.ndarray]] = OrderedDict()

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    def _arrays(self, part: int) -> dict[str, np.ndarray]:
        if part in self._open:
            self._open.move_to_end(part)
            return self._open[part]
        folder, _, _, dtype = self.parts[part]
        arrays: dict[str, np.ndarray] = {"tokens": np.memmap(folder / "tokens.bin", dtype=dtype, mode="r")}
        if self.examples:
            arrays["learn"] = np.memmap(folder / "learn.bin", dtype=np.uint8, mode="r")
            arrays["pos"] = np.memmap(folder / "pos.bin", dtype=np.uint16, mode="r")
        self._open[part] = arrays
        if len(self._open) > self.OPEN:
            self._open.popitem(last=False)
        return arrays

    def _where(self, i: int):
        part = int(np.searchsorted(self.ends, i, side="right"))
        first, seq_len = self.parts[part][1], self.seq_len[part]
        j = first + i - (int(self.ends[part - 1]) if part else 0)
        return self._arrays(part), slice(j * seq_len, (j + 1) * seq_len)

    def tokens(self, i: int) -> np.ndarray:
        arrays, s = self._where(i)
        return np.asarray(arrays["tokens"][s])

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        arrays, s = self._where(i)
        ids = torch.from_numpy(arrays["tokens"][s].astype(np.int64))
        if not self.examples:
            return {"input_ids": ids, "labels": ids}
        learn = torch.from_numpy(arrays["learn"][s].astype(np.bool_))
        return {"input_ids": ids, "labels": torch.where(learn, ids, torch.full_like(ids, -100)),
                "position_ids": torch.from_numpy(arrays["pos"][s].astype(np.int64))}


def collate(samples: list[dict[str, torch.Tensor]], device) -> dict[str, torch.Tensor]:
    return {k: torch.stack([s[k] for s in samples]).to(device) for k in samples[0]}


class _RunData:
    """A run's data set: the train split (sources in order, each's shards' leading sequences), the held-out split
    (every shard's trailing sequences) and the sources' sizes and weights."""

    def __init__(self, folder: Path, meta: dict):
        self.meta = meta
        examples = meta["format"] != "text"
        train, val, self.sizes, self.weights = [], [], [], []
        for src in meta["sources"]:
            size = 0
            for s in src["shards"]:
                held = s["val_sequences"]
                train.append((folder / "shards" / s["name"], 0, s["sequences"] - held, s["dtype"]))
                val.append((folder / "shards" / s["name"], s["sequences"] - held, held, s["dtype"]))
                size += s["sequences"] - held
            self.sizes.append(size)
            self.weights.append(src["weight"])
        self.train, self.val = Split(train, examples), Split(val, examples)

    def order(self, seed: int):
        if self.weights[0] is None or len(self.sizes) == 1:
            return GlobalOrder(len(self.train), seed)
        return Mixture(self.sizes, self.weights, seed)


def open_run(data_dir: Path) -> _RunData:
    return _RunData(data_dir, json.loads((data_dir / "meta.json").read_text()))


class GlobalOrder:
    """Which sample every rank reads at every step, as a function of the global sample position.

    Epoch e is a seeded permutation of the training sequences. Optimizer step s consumes the global
    positions [s*G, (s+1)*G), G = micro * accumulation * world; micro-step m gives rank r the
    `micro` positions starting at s*G + (m*world + r)*micro. So the data position saved in a
    checkpoint is one number (samples consumed), no sample repeats within an epoch, and the same
    global batch is drawn whatever the world size (DistributedSampler semantics, made resumable).
    """

    def __init__(self, n_samples: int, seed: int):
        if n_samples == 0:
            raise UsageError("the training split holds no full sequence: give more data or a smaller --seq-len")
        self.n, self.seed = n_samples, seed
        self._epoch, self._perm = -1, torch.empty(0, dtype=torch.long)

    def sample_at(self, position: int) -> int:
        epoch, i = divmod(position, self.n)
        if epoch != self._epoch:
            g = torch.Generator().manual_seed(self.seed + epoch)
            self._perm, self._epoch = torch.randperm(self.n, generator=g), epoch
        return int(self._perm[i])

    def micro_batch(self, step: int, micro_step: int, rank: int, world: int, micro: int, accum: int,
                    offset: int = 0) -> list[int]:
        """`offset` shifts every position: set on resume when the global batch changed with the world size."""
        start = offset + step * micro * accum * world + (micro_step * world + rank) * micro
        return [self.sample_at(start + k) for k in range(micro)]


class Mixture(GlobalOrder):
    """Weighted sources: every block of BLOCK global positions holds each source's share (largest remainder), in a
    seeded order; a source's k-th draw is sample k of its own GlobalOrder (its own epochs: a small source repeats,
    a large one is not exhausted). Still a function of the position alone, so resume stays exact."""

    BLOCK = 1000

    def __init__(self, sizes: list[int], weights: list[float], seed: int):
        total = sum(weights)
        share = [w / total * self.BLOCK for w in weights]
        counts = [int(s) for s in share]
        for i in sorted(range(len(share)), key=lambda i: counts[i] - share[i])[:self.BLOCK - sum(counts)]:
            counts[i] += 1
        self.counts, self.seed = counts, seed
        self.orders = [GlobalOrder(n, seed + 7919 * (k + 1)) if n else None for k, n in enumerate(sizes)]
        self.offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(int).tolist()
        self._block, self._slots, self._seen = -1, np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)

    def sample_at(self, position: int) -> int:
        block, r = divmod(position, self.BLOCK)
        if block != self._block:
            slots = np.repeat(np.arange(len(self.counts)), self.counts)
            np.random.default_rng([self.seed, block]).shuffle(slots)
            seen = np.zeros_like(slots)
            running = np.zeros(len(self.counts), dtype=np.int64)
            for i, s in enumerate(slots):
                seen[i] = running[s]
                running[s] += 1
            self._block, self._slots, self._seen = block, slots, seen
        src = int(self._slots[r])
        order = self.orders[src]
        assert order is not None  # a source with no sequences has weight 0 (prepare refuses otherwise)
        return self.offsets[src] + order.sample_at(block * self.counts[src] + int(self._seen[r]))
