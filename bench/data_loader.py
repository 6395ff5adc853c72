"""The data loader's throughput: tokens read and tokenized per second on one core, dstool's shard tokenizer
(train/data.py: a jsonl shard streamed, tokenized in batches, packed into sequences on disk) against Hugging Face
`datasets` alone (`load_dataset("json")` then `.map(tokenize, batched=True)`, the same tokenizer.json through
`tokenizers`), on the same generated shard, interleaved rounds, medians.

    bash bench/peers.sh /work/peers      # PEERS/datasets
    .venv/bin/python bench/data_loader.py [--peers /work/peers] [--mb 64] [--rounds 3]

Both run in a process pinned to one core (taskset) with the tokenizer's own threads off, and both start cold
(dstool: an empty cache; datasets: an empty cache_dir), so each pays its whole read-and-tokenize path.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

_DATASETS = r"""
import sys, time
from datasets import load_dataset
from tokenizers import Tokenizer
shard, tokenizer_json, cache = sys.argv[1:4]
tok = Tokenizer.from_file(tokenizer_json)
t0 = time.perf_counter()
ds = load_dataset("json", data_files=shard, split="train", cache_dir=cache)
ds = ds.map(lambda b: {"ids": [e.ids for e in tok.encode_batch(b["text"], add_special_tokens=False)]},
            batched=True, remove_columns=["text"], num_proc=None)
tokens = sum(len(x) for x in ds["ids"])
print(tokens, time.perf_counter() - t0)
"""

_DSTOOL = r"""
import sys, time
from dstool.train import data
shard, tokenizer_dir, target = sys.argv[1:4]
t0 = time.perf_counter()
meta = data._tokenize(data._Job(shard, "bench", "text", 1024, tokenizer_dir, target))
print(meta["tokens"], time.perf_counter() - t0)
"""


def _shard(path: Path, mb: int) -> None:
    from dstool.corpus import read_documents

    docs = read_documents(None)
    with open(path, "w") as f:
        i = 0
        while f.tell() < mb << 20:
            f.write(json.dumps({"text": f"{i} {docs[i % len(docs)]}"}) + "\n")
            i += 1


def _timed(cmd: list[str]) -> tuple[int, float]:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", RAYON_NUM_THREADS="1", OMP_NUM_THREADS="1")
    out = subprocess.run(["taskset", "-c", "0", *cmd], check=True, capture_output=True, text=True, env=env)
    tokens, seconds = out.stdout.split()[-2:]
    return int(tokens), float(seconds)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peers", default="/work/peers")
    p.add_argument("--mb", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    peer = Path(a.peers) / "datasets" / "bin" / "python"
    if not peer.is_file():
        sys.exit(f"{peer} is missing: run `bash bench/peers.sh {a.peers}` first")
    from dstool.corpus import read_documents
    from dstool.train import data

    rates: dict[str, list[float]] = {"dstool": [], "datasets": []}
    tokens: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="dstool-bench-data-") as tmp:
        root = Path(tmp)
        shard = root / "shard.jsonl"
        _shard(shard, a.mb)
        tok = data.train_tokenizer(read_documents(None), 4096)
        tok.save_pretrained(root / "tokenizer")
        for r in range(a.rounds):
            for name in ("dstool", "datasets"):
                if name == "dstool":
                    cmd = [sys.executable, "-c", _DSTOOL, str(shard), str(root / "tokenizer"), str(root / f"d{r}")]
                else:
                    cmd = [str(peer), "-c", _DATASETS, str(shard), str(root / "tokenizer" / "tokenizer.json"),
                           str(root / f"c{r}")]
                n, seconds = _timed(cmd)
                tokens[name] = n
                rates[name].append(n / seconds)
    print(f"{a.mb} MiB jsonl shard (the embedded corpus's paragraphs), one core, cold, {a.rounds} interleaved rounds")
    base = statistics.median(rates["datasets"])
    for name in ("dstool", "datasets"):
        rate = statistics.median(rates[name])
        print(f"{name:9s} {tokens[name]:>12,} tokens  {rate:>12,.0f} tokens/s  {rate / base:5.2f}x")


if __name__ == "__main__":
    main()
