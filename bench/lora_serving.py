"""Multi-LoRA serving in dstool's engine, on the real SmolLM2-135M-Instruct, in one process.

    .venv/bin/python bench/lora_serving.py [--rounds 3] [--new-tokens 64] [--rank 16] [--adapters 8]

The fused decoder graph NAME_llm runs is written twice from the model (dstool.fused_decoder): without LoRA inputs
(what `dstool export` writes by default) and with them (`--adapter` / `--enable-lora`); engines are built as NAME_llm
builds them (ONNX Runtime's options, its batch of 16). --adapters random rank --rank adapters on every linear layer
(PEFT's own files, tests/lorautil.py). Greedy chat requests, the end of sequence ignored so every run makes the same
tokens; rounds interleaved (the order rotating), medians:
- 16 streams submitted together: tokens/s from submission to the last token, on the plain graph (base), the LoRA graph
  with no adapter in use, and the LoRA graph with the adapters mixed (two streams each, so 8 different adapters in
  every step) — the target (issue 44): mixed >= 0.85x base;
- 1 stream: decode tokens/s on the plain graph and with one adapter on the LoRA graph;
- loading a rank --rank adapter (NAME_llm's load: read, checked, laid out; median of 5) — target < 1 s — and writing
  the batch's 16 rows' adapter weights whole (what a batch whose every row changed costs once);
- an adapter's logits against PEFT's merge of it, exported as its own fused graph (fp32): target <= 1e-4.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from _machine import cpu_name  # noqa: E402 (bench/ is the script's folder)
from speculative import CHAT, GROUNDED  # noqa: E402 (bench/ is the script's folder)


def engine(graph: Path, shapes):
    import onnxruntime as ort

    from dstool.decoding.engine import engine_for
    from dstool.serve.export.repository import ENGINE_MAX_BATCH
    from dstool.serve.triton_models.ort_options import session_options

    session = ort.InferenceSession(str(graph), session_options(ort), providers=["CPUExecutionProvider"])
    return engine_for(session, shapes, ENGINE_MAX_BATCH)


def run(eng, prompts: list[list[int]], adapters: list, new: int) -> float:
    """Tokens/s in all, from submission to the last token, of the prompts submitted together (prompt i with
    adapters[i])."""
    import numpy as np

    from dstool.decoding.engine import Sequence

    def greedy(logits, prompt, output):
        return int(np.argmax(logits))

    seqs = [Sequence(str(i), p, new, greedy, set(), adapter=a) for i, (p, a) in enumerate(zip(prompts, adapters))]
    began = time.perf_counter()
    for s in seqs:
        eng.add(s)
    while eng.busy:
        eng.step()
    return sum(len(s.output) for s in seqs) / (time.perf_counter() - began)


def alone(eng, prompt: list[int], adapter, new: int) -> float:
    """Decode tokens/s of one sequence, from its first token to its last."""
    import numpy as np

    from dstool.decoding.engine import Sequence

    s = Sequence("one", prompt, new, lambda logits, p, o: int(np.argmax(logits)), set(), adapter=adapter)
    eng.add(s)
    eng.step()
    began = time.perf_counter()
    while eng.busy:
        eng.step()
    return (len(s.output) - 1) / (time.perf_counter() - began)


def main() -> int:
    import numpy as np
    import torch
    from lorautil import make_adapter, merged
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dstool import gguf
    from dstool.decoding.adapters import Adapter, RowWeights, graph_layout
    from dstool.fused_decoder import export_fused_decoder, prefill
    from dstool.onnx_export import ort_session

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--adapters", type=int, default=8)
    a = p.parse_args()
    hf = Path(gguf.resolve("smollm2"))
    tokenizer = AutoTokenizer.from_pretrained(hf)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
        export_fused_decoder(model, work / "plain")
        export_fused_decoder(model, work / "lora", lora=True)
        del model
        folders = [make_adapter(hf, work / f"a{i}", rank=a.rank, seed=i, scale=0.02) for i in range(a.adapters)]
        session = ort_session(work / "lora" / "model.onnx")
        layout = graph_layout(session.get_inputs())
        began = time.perf_counter()
        adapters = [Adapter.load(f"a{j}", f, layout, 64) for j, f in enumerate(folders)]
        loads = [(time.perf_counter() - began) / len(adapters)]
        for _ in range(4):
            began = time.perf_counter()
            Adapter.load("again", folders[0], layout, 64)
            loads.append(time.perf_counter() - began)
        rows = RowWeights(layout)
        writes = []
        for i in range(5):  # the batch's 16 rows written whole (every row's adapter changed), alternating layouts
            began = time.perf_counter()
            rows.batch([adapters[(j + i) % len(adapters)] for j in range(16)], 16)
            writes.append(time.perf_counter() - began)
        ids = np.random.default_rng(0).integers(0, 49152, (2, 24))
        want = prefill(ort_session(export_fused_decoder(merged(hf, folders[0]), work / "merged").path), ids)
        got = prefill(session, ids, adapters[0])
        diff = float(np.abs(got - want).max())
        changed = float(np.abs(got - prefill(session, ids)).max())
        shapes = {n.name: (n.shape[1], n.shape[3]) for n in session.get_inputs() if n.name.startswith("past_key")}

        def chat(text: str) -> list[int]:
            laid = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                 add_generation_prompt=True)
            return tokenizer(laid, add_special_tokens=False)["input_ids"]

        prompts = [chat(t) for t in [*GROUNDED.values(), *CHAT.values()]] * 2
        engines = {"base": engine(work / "plain" / "model.onnx", shapes),
                   "lora, none in use": engine(work / "lora" / "model.onnx", shapes)}
        engines["lora, mixed"] = engines["lora, none in use"]
        mixes = {"base": [None] * 16, "lora, none in use": [None] * 16,
                 "lora, mixed": [adapters[i % len(adapters)] for i in range(16)]}
        many: dict[str, list[float]] = {k: [] for k in mixes}
        one: dict[str, list[float]] = {"base": [], "one adapter": []}
        for r in range(a.rounds):
            order = list(mixes)[r % 3:] + list(mixes)[:r % 3]
            for mode in order:
                many[mode].append(run(engines[mode], prompts, mixes[mode], a.new_tokens))
            for mode in (("base", "one adapter") if r % 2 == 0 else ("one adapter", "base")):
                eng = engines["base" if mode == "base" else "lora, mixed"]
                one[mode].append(alone(eng, prompts[0], None if mode == "base" else adapters[0], a.new_tokens))
            print(f"round {r + 1}/{a.rounds} done", file=sys.stderr, flush=True)

    cpu = cpu_name()
    print(f"# multi-LoRA serving, SmolLM2-135M-Instruct fp32 (fused graph, as NAME_llm), {cpu}, {os.cpu_count()} "
          f"cores; {a.adapters} random rank-{a.rank} adapters on every linear layer; greedy, {a.new_tokens} new tokens "
          f"each, {a.rounds} rounds interleaved, medians")
    print("| 16 streams | tokens/s | against base (median of paired ratios) |")
    print("|---|---|---|")
    for mode, rates in many.items():
        ratio = statistics.median(x / b for x, b in zip(rates, many["base"]))
        print(f"| {mode}{f' ({a.adapters} adapters, 2 streams each)' if mode == 'lora, mixed' else ''} | "
              f"{statistics.median(rates):.1f} | {ratio:.2f}x |")
    ratio = statistics.median(x / b for x, b in zip(one["one adapter"], one["base"]))
    print(f"| 1 stream: base {statistics.median(one['base']):.1f} tok/s, one adapter "
          f"{statistics.median(one['one adapter']):.1f} tok/s | | {ratio:.2f}x |")
    print(f"\nload a rank-{a.rank} adapter: {1000 * statistics.median(loads):.0f} ms (median of 5); write the "
          f"batch's 16 rows' adapter weights whole: {1000 * statistics.median(writes):.0f} ms; an adapter's logits "
          "against its PEFT "
          f"merge's graph: max |diff| {diff:.2e} (the adapter moves them by {changed:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
