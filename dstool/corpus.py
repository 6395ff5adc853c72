"""The text dstool trains and measures on: a file, a folder of .txt/.jsonl files, or the embedded corpus
(tiny-Shakespeare); and a training run's tokenized splits."""

from __future__ import annotations

import gzip
import json
from importlib import resources
from pathlib import Path

import numpy as np

from dstool.errors import UsageError

EMBEDDED = "embedded:tinyshakespeare"


def conversations(split: str) -> Path:
    """The shipped real English conversations (chatterbot-corpus, BSD; dstool/data/NOTICE) as a chat .jsonl.gz:
    `train` (1,762) or `heldout` (264), split by a hash of each conversation's first line (scripts/chat_data.py)."""
    return Path(str(resources.files("dstool").joinpath(f"data/conversations-{split}.jsonl.gz")))


def read_documents(data: str | None) -> list[str]:
    """Documents from a text file, a folder of .txt/.jsonl files (field `text`), or the embedded corpus."""
    if data is None or data == EMBEDDED:
        raw = resources.files("dstool").joinpath("data/tinyshakespeare.txt.gz").read_bytes()
        text = gzip.decompress(raw).decode("utf-8")
        # Scenes are separated by blank lines; keep paragraphs of dialogue together.
        return [d for d in text.split("\n\n") if d.strip()]
    path = Path(data)
    if not path.exists():
        raise UsageError(f"data path {data} does not exist: pass a text file, a folder of .txt/.jsonl files, or omit "
                         "--data")
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.suffix in (".txt", ".jsonl"))
    if not files:
        raise UsageError(f"data folder {data} holds no .txt or .jsonl files")
    docs: list[str] = []
    for f in files:
        if f.suffix == ".jsonl":
            for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    text = json.loads(line)["text"]
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise UsageError(f"{f}:{n} is not a JSON object with a 'text' field") from None
                docs.append(str(text))
        else:
            docs.append(f.read_text(encoding="utf-8", errors="replace"))
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise UsageError(f"data {data} is empty: it holds no text to train on")
    return docs


def read_split(folder: Path, split: str, dtype: str) -> np.ndarray:
    """A run's tokenized split (train or val) as a read-only memory map."""
    return np.memmap(Path(folder) / f"{split}.bin", dtype=dtype, mode="r")


EMBEDDED_PROMPTS = "embedded:heldout-prompts"


def heldout_prompts(n: int = 1000, val_fraction: float = 0.05) -> list[str]:
    """`n` prompts from the embedded corpus's held-out tail (the share `dstool train` keeps out of training): each a
    speaker's name and the first words of one of their lines, in corpus order."""
    docs = read_documents(None)
    total, tail, kept = sum(len(d) for d in docs), 0, []
    for doc in reversed(docs):  # the documents that hold the last val_fraction of the text
        if tail >= total * val_fraction:
            break
        kept.append(doc)
        tail += len(doc)
    prompts = []
    for doc in reversed(kept):
        speaker, _, speech = doc.partition("\n")
        for line in speech.splitlines():
            words = line.split()
            if speaker.endswith(":") and len(words) >= 3:
                prompts.append(f"{speaker}\n{' '.join(words[:3])}")
    if len(prompts) < n:
        raise UsageError(f"the embedded corpus's held-out tail holds {len(prompts)} prompts, fewer than {n}")
    return prompts[:n]
