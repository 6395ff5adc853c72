"""Corpus -> tokenizer -> packed token arrays on disk, and a resumable sharded sampler."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dstool.corpus import read_documents
from dstool.errors import UsageError
from dstool.files import replace_folder, sha256_file

__all__ = ["read_documents", "train_tokenizer", "load_or_train_tokenizer", "prepare_dataset", "open_split",
           "corpus_fingerprint", "packed_sha256", "GlobalOrder", "TokenSplit"]
EOS = "<|endoftext|>"
PAD = "<|pad|>"


def train_tokenizer(docs: list[str], vocab_size: int):
    """A byte-level BPE trained on `docs`, wrapped as a transformers fast tokenizer."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(docs, vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS, PAD],
                            show_progress=False)
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token=EOS, eos_token=EOS,
                                   pad_token=PAD, unk_token=None, model_max_length=1 << 30)


def load_or_train_tokenizer(model_ref: str, docs: list[str], vocab_size: int, save_dir: Path):
    """The model folder's tokenizer when it has one, else a BPE trained on the corpus; saved to `save_dir`."""
    from transformers import AutoTokenizer

    if (save_dir / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(save_dir)
    model_dir = Path(model_ref)
    if model_dir.is_dir() and any((model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer.model")):
        tok = AutoTokenizer.from_pretrained(model_dir)
    else:
        tok = train_tokenizer(docs, vocab_size)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tmp = save_dir.with_name(save_dir.name + ".tmp")
    tok.save_pretrained(tmp)
    replace_folder(tmp, save_dir)
    return tok


@dataclass
class TokenSplit:
    """Fixed-length packed sequences over a flat token array (memory-mapped)."""

    tokens: np.ndarray
    seq_len: int

    def __len__(self) -> int:
        return len(self.tokens) // self.seq_len

    def __getitem__(self, i: int) -> torch.Tensor:
        s = self.tokens[i * self.seq_len:(i + 1) * self.seq_len]
        return torch.from_numpy(s.astype(np.int64))


def prepare_dataset(docs: list[str], tokenizer, out_dir: Path, val_fraction: float) -> dict:
    """Tokenize, join documents with EOS, split off the tail as held-out, write train.bin/val.bin."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for enc in tokenizer(docs, add_special_tokens=False)["input_ids"]:
        ids.extend(enc)
        ids.append(eos)
    dtype = np.uint16 if len(tokenizer) < 65536 else np.uint32
    arr = np.asarray(ids, dtype=dtype)
    n_val = max(int(len(arr) * val_fraction), 1)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    arr[:-n_val].tofile(tmp / "train.bin")
    arr[-n_val:].tofile(tmp / "val.bin")
    meta = {"dtype": np.dtype(dtype).name, "train_tokens": int(len(arr) - n_val), "val_tokens": int(n_val),
            "documents": len(docs)}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    replace_folder(tmp, out_dir)
    return meta


def open_split(data_dir: Path, split: str, seq_len: int) -> TokenSplit:
    meta = json.loads((data_dir / "meta.json").read_text())
    tokens = np.memmap(data_dir / f"{split}.bin", dtype=meta["dtype"], mode="r")
    return TokenSplit(tokens, seq_len)


def packed_sha256(data_dir: Path) -> dict[str, str]:
    """sha256 of the packed token files, by name."""
    return {name: sha256_file(data_dir / name) for name in ("train.bin", "val.bin") if (data_dir / name).is_file()}


def corpus_fingerprint(docs: list[str]) -> str:
    h = hashlib.sha256()
    for d in docs:
        h.update(hashlib.sha256(d.encode()).digest())
    return h.hexdigest()[:16]


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
