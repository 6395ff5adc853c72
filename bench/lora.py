"""LoRA against full fine-tuning: peak memory, tokens/s and checkpoint size of `dstool train` fine-tuning the same
model on the same chats, ranks, ZeRO stage and steps, interleaved rounds, medians.

    .venv/bin/python bench/lora.py [--hidden 512] [--layers 8] [--nproc 2] [--zero 3] [--rank 16] [--steps 8]
        [--rounds 2]

The model is a random-weight Llama folder of the given shape (the tokenizer of a BPE trained on the embedded
corpus), so the comparison needs no download. Peak memory: the largest resident set of any rank (getrusage of the
run's finished descendants, in a fresh process per run). Tokens/s: median of the metrics rows after the first two.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from _rss import peak_rss


def _model(folder: Path, hidden: int, layers: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from dstool.corpus import read_documents
    from dstool.train import data

    tok = data.train_tokenizer(read_documents(None), 4096)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 64 * 64,
                         num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 128,
                         max_position_embeddings=2048, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tok.save_pretrained(folder)


def _chats(path: Path, n: int = 2000) -> None:
    from dstool.corpus import read_documents

    docs = read_documents(None)
    with open(path, "w") as f:
        for i in range(n):
            speaker, _, speech = docs[i % len(docs)].partition("\n")
            f.write(json.dumps({"messages": [{"role": "user", "content": f"Who says: {speech[:80]}"},
                                             {"role": "assistant", "content": f"{speaker} {speech[:400]}"}]}) + "\n")


def run(a, model: Path, chats: Path, lora: bool, out: Path) -> tuple[int, list[float], int]:
    cmd = [sys.executable, "-m", "dstool.cli", "train", "--output", str(out), "--model", str(model), "--data",
           str(chats), "--data-format", "chat", "--chat-template", "default", "--nproc", str(a.nproc), "--zero",
           str(a.zero), "--max-steps", str(a.steps), "--save-every", str(a.steps), "--log-every", "1", "--seq-len",
           str(a.seq_len), "--micro-batch-size", str(a.micro_batch_size), "--eval-batches", "1",
           "--no-tensorboard", "--resume", "none", *(["--lora", str(a.rank)] if lora else [])]
    peak = peak_rss(cmd)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rates = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r][2:]
    tag = out / "checkpoints" / f"step-{a.steps:08d}"
    return peak, rates, sum(f.stat().st_size for f in tag.rglob("*") if f.is_file())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--zero", type=int, default=3)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args()
    results: dict[bool, tuple[list[int], list[float], list[int]]] = {False: ([], [], []), True: ([], [], [])}
    with tempfile.TemporaryDirectory(prefix="dstool-bench-lora-") as tmp:
        root = Path(tmp)
        _model(root / "model", a.hidden, a.layers)
        _chats(root / "chats.jsonl")
        for r in range(a.rounds):
            for lora in (False, True):
                peak, rates, size = run(a, root / "model", root / "chats.jsonl", lora, root / f"{lora}-{r}")
                results[lora][0].append(peak)
                results[lora][1].extend(rates)
                results[lora][2].append(size)
    print(f"Llama hidden {a.hidden} x {a.layers} layers, chats, {a.nproc} ranks, ZeRO-{a.zero}, micro-batch "
          f"{a.micro_batch_size} x {a.seq_len} tokens, {a.steps} steps x {a.rounds} rounds; LoRA rank {a.rank}, "
          "all-linear")
    print(f"{'':6s} {'peak MiB':>9s} {'tokens/s':>9s} {'checkpoint MiB':>15s} {'memory':>7s} {'speed':>6s} "
          f"{'checkpoint':>10s}")
    base = [statistics.median(x) for x in results[False]]
    for lora in (False, True):
        peak, rate, size = (statistics.median(x) for x in results[lora])
        print(f"{'LoRA' if lora else 'full':6s} {peak / 2**20:9.0f} {rate:9.0f} {size / 2**20:15.2f} "
              f"{peak / base[0]:6.2f}x {rate / base[1]:5.2f}x {size / base[2]:9.3f}x")


if __name__ == "__main__":
    main()
