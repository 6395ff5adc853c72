"""DeepSeek MTP drafting (speculative_config {"method": "deepseek_mtp", "num_speculative_tokens": K}) in dstool's
engine, on the tiny-moe preset trained with --mtp-layers 1 on the embedded corpus (tiny Shakespeare), in one process.

    .venv/bin/python bench/mtp_serving.py [--model RUN/model] [--steps 300] [--rounds 3] [--new-tokens 64] [--k 1 2]

Without --model, `dstool train --model tiny-moe --mtp-layers 1` runs first (--steps steps of 4 x 128 tokens, lr 3e-3,
1 rank); then `dstool export` (the decoder graph giving its last hidden state, the MTP draft graph). The engines are
built as NAME_llm builds them (its config.pbtxt's parameters, ONNX Runtime's options): without speculation, and with
deepseek_mtp for each K. Greedy, no stop token (the tiny model's lines are short), rounds interleaved, medians:
- 1 stream, each prompt alone: decode tokens/s (first token to last) with and without, and the mean accepted length
  (accepted / drafts + 1: the tokens a verifying step makes);
- 16 streams submitted together (the prompts twice over): tokens/s in all, from submission to the last token, beside
  a second engine without speculation (plain against plain: the machine's noise);
- the cost of one graph run: a lone row's decoding step, its verifying 1 + K tokens (the first K), the MTP graph on
  1 and 2 positions.
The speedups are the medians of each round's paired ratios. Every request's tokens are checked to be the same with and
without MTP drafting.
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

from _llm import llm_config, llm_engine
from _machine import cpu_name, interleaved_ms
from speculative import alone, crowd, sequence

PROMPTS = ["ROMEO:\n", "JULIET:\nO Romeo, Romeo!", "KING RICHARD III:\nNow is the winter of our discontent",
           "First Citizen:\nBefore we proceed any further, hear me speak.", "MENENIUS:\nI tell you, friends,",
           "DUKE VINCENTIO:\n", "GLOUCESTER:\nWhat, will the king",
           "LADY ANNE:\nSet down, set down your honourable load"]


def dstool(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "dstool.cli", *args], check=True, capture_output=True)


def build(repo: Path, speculation):
    """An engine as NAME_llm's `initialize` makes one (its config.pbtxt's parameters and graphs)."""
    import onnxruntime as ort

    from dstool.decoding.engine import MTPDrafter

    params, version, options = llm_config(repo)
    decoder = repo / params["decoder"] / version.name / "model.onnx"
    session = ort.InferenceSession(str(decoder), options, providers=["CPUExecutionProvider"])
    drafter = MTPDrafter(ort.InferenceSession(str(version / json.loads(params["mtp_graphs"])[0]), options,
                                              providers=["CPUExecutionProvider"])) if speculation else None
    return llm_engine(session, params, speculation, mtp=drafter), version


def step_costs(engine, ids: list[int], k: int, repeats: int = 30) -> dict[str, float]:
    """Milliseconds (medians, interleaved) of a lone row's decoder step (1 token), its verifying 1 + k tokens, and the
    MTP graph on 1 position (a chained draft) and on 2 (reading a step's two accepted positions), after `ids`."""

    import numpy as np

    n, names = len(ids), ["logits", *engine.cache_outputs.values(), "hidden_states"]
    empty = {name: np.zeros((1, h, 0, d), np.float32) for name, (h, d) in engine.cache_shapes.items()}
    *_, hidden = engine.session.run(names, {"input_ids": np.array([ids]), "attention_mask": np.ones((1, n), np.int64),
                                            "position_ids": np.arange(n)[None], **empty})
    _, *caches, _ = engine.session.run(names, {
        "input_ids": np.array([ids[:-k - 1]]), "attention_mask": np.ones((1, n - k - 1), np.int64),
        "position_ids": np.arange(n - k - 1)[None], **empty})
    past = dict(zip(engine.cache_shapes, caches))
    _, _, mtp_cache = engine.mtp.run(ids[1:n - 2], hidden[0, :n - 3], 0, None)

    def decoder(new: int) -> None:
        engine.session.run(names, {"input_ids": np.array([ids[n - k - 1:n - k - 1 + new]]),
                                   "attention_mask": np.ones((1, n - k - 1 + new), np.int64),
                                   "position_ids": np.arange(n - k - 1, n - k - 1 + new)[None], **past})

    kinds = {"decoder, 1 token": lambda: decoder(1), f"decoder, verifying 1 + {k} tokens": lambda: decoder(k + 1),
             "MTP graph, 1 position": lambda: engine.mtp.run(ids[n - 2:n - 1], hidden[0, n - 3:n - 2], n - 3,
                                                             mtp_cache),
             "MTP graph, 2 positions": lambda: engine.mtp.run(ids[n - 2:], hidden[0, n - 3:n - 1], n - 3, mtp_cache)}
    return interleaved_ms(kinds, repeats)


def main() -> int:
    from transformers import AutoTokenizer

    from dstool.decoding.engine import Speculation

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a tiny-moe model folder trained with --mtp-layers 1 (default: trained here)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--k", type=int, nargs="+", default=[1, 2])
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="dstool-bench-mtp-serving-") as tmp:
        work = Path(tmp)
        model = Path(a.model) if a.model else work / "run" / "model"
        if not a.model:
            dstool("train", "--output", str(model.parent), "--model", "tiny-moe", "--mtp-layers", "1", "--nproc", "1",
                   "--zero", "0", "--max-steps", str(a.steps), "--save-every", str(a.steps), "--lr", "3e-3",
                   "--seq-len", "128", "--micro-batch-size", "4", "--no-tensorboard")
        dstool("export", str(model), "--repository", str(work / "repo"), "--instances", "1")
        rows = [json.loads(line) for line in (model.parent / "metrics.jsonl").read_text().splitlines()]
        held_out = next(r for r in reversed(rows) if "val_loss" in r)
        mtp_loss = next(r["mtp_loss_1"] for r in reversed(rows) if "mtp_loss_1" in r)
        modes = ["off", *(f"k{k}" for k in a.k)]
        engines = {m: build(work / "repo", None if m == "off" else
                            Speculation(int(m[1:]), method="deepseek_mtp"))[0] for m in modes}
        again, version = build(work / "repo", None)
        tokenizer = AutoTokenizer.from_pretrained(version)
        prompts = [tokenizer(t)["input_ids"] for t in PROMPTS]
        single: dict[str, list[list[float]]] = {m: [[] for _ in prompts] for m in modes}
        many: dict[str, list[float]] = {m: [] for m in [*modes, "again"]}
        made: dict[int, list[int]] = {}
        counts = {m: {"drafts": 0, "accepted": 0} for m in modes[1:]}
        for r in range(a.rounds):
            order = modes if r % 2 == 0 else modes[::-1]
            for i, ids in enumerate(prompts):
                for mode in order:
                    engine = engines[mode]
                    before = engine.spec_counts.copy()
                    rate, out = alone(engine, sequence(str(i), ids, a.new_tokens, set()))
                    single[mode][i].append(rate)
                    assert made.setdefault(i, out) == out, f"prompt {i}: MTP drafting changed the tokens"
                    if mode != "off":
                        added = engine.spec_counts.since(before)
                        counts[mode]["drafts"] += added.drafts
                        counts[mode]["accepted"] += added.accepted
            for mode in [*order, "again"]:
                seqs = [sequence(str(i), ids, a.new_tokens, set()) for i, ids in enumerate(prompts * 2)]
                rate, outs = crowd(again if mode == "again" else engines[mode], seqs)
                many[mode].append(rate)
                assert all(made[i % len(prompts)] == outs[str(i)] for i in range(len(seqs))), "16 streams differ"
            print(f"round {r + 1}/{a.rounds} done", file=sys.stderr, flush=True)
        costs = step_costs(engines[modes[1]], prompts[3], int(modes[1][1:]))

    print(f"# DeepSeek MTP drafting, tiny-moe + 1 MTP layer trained {held_out['step']} steps (held-out loss "
          f"{held_out['val_loss']:.3f}, last MTP loss {mtp_loss:.3f}), fp32 decoder graph (as NAME_llm), "
          f"{cpu_name()}, {os.cpu_count()} cores; greedy, {a.new_tokens} new tokens, {len(prompts)} prompts, "
          f"{a.rounds} rounds interleaved, medians; tokens identical with and without: checked")
    print("| K | mean accepted length | 1 stream: off tok/s | on tok/s | speedup (median of paired ratios) | "
          "16 streams: off tok/s | on tok/s | speedup |")
    print("|---|---|---|---|---|---|---|---|")
    off_single = [statistics.median(x) for x in single["off"]]
    for mode in modes[1:]:
        c = counts[mode]
        mean = c["accepted"] / c["drafts"] + 1 if c["drafts"] else 1.0
        on_single = [statistics.median(x) for x in single[mode]]
        ratio = statistics.geometric_mean(statistics.median(b / o for o, b in zip(single["off"][i], single[mode][i]))
                                          for i in range(len(prompts)))
        crowd_ratio = statistics.median(b / o for o, b in zip(many["off"], many[mode]))
        print(f"| {mode[1:]} | {mean:.2f} | {statistics.median(off_single):.0f} | {statistics.median(on_single):.0f} | "
              f"{ratio:.2f}x | {statistics.median(many['off']):.0f} | {statistics.median(many[mode]):.0f} | "
              f"{crowd_ratio:.2f}x |")
    noise = statistics.median(b / o for o, b in zip(many["off"], many["again"]))
    print(f"| plain against plain (noise) | | | | | {statistics.median(many['off']):.0f} | "
          f"{statistics.median(many['again']):.0f} | {noise:.2f}x |")
    print("\nstep costs (ms, medians): " + ", ".join(f"{k} {v:.2f}" for k, v in costs.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
