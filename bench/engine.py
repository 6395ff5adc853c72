"""The continuous-batching engine (dstool/decoding/engine.py) on the exported decoder graph, in one process.

    .venv/bin/python bench/engine.py [--repository REPO] [--new-tokens 64] [--rounds 3]

Without --repository the ~40 M-parameter Llama of bench/compress.py (untrained: speed does not depend on the
weights) is exported first. Greedy, 25-token prompts, medians of interleaved rounds:
- 1 stream: tokens/s and time to the first token;
- 16 streams submitted together: tokens/s (what a static batch does too);
- 16 streams arriving one per decoding step: tokens/s and the queue wait of each (steps from its arrival to
  its first token: 1 means it joined the running batch at the next step);
- 16 streams submitted together, each under a JSON schema (structured outputs: llguidance's mask every token; an
  array of at least 1,000 short strings, so no stream ends early): tokens/s, and the grammar's share of a step (the
  time its masks and token checks took, over the run's time).

With --memory instead: 64 requests with long prompts (--prompt-tokens, default 3/4 of the model's positions, each its
own text after a shared first half, so the prefix cache holds something) arrive together at an engine set up as
NAME_llm is (16 rows, a cache budget of 16 x the model's positions, the prefix cache within it); each step the
cache memory the engine holds (batch cache, prompts being prefilled, prefix cache) is read, and the peak is printed
against the budget's bytes, with the process's peak resident memory.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
SCHEMA = {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1000}
sys.path.insert(0, str(HERE))


def prepare(a, work: Path) -> Path:
    if a.repository:
        return Path(a.repository)
    from compress import build_model  # the same ~40 M model as the compression benchmark

    build_model(work / "model")
    subprocess.run([sys.executable, "-m", "dstool.cli", "export", str(work / "model"), "--repository",
                    str(work / "repo"), "--name", "lm"], check=True, capture_output=True)
    return work / "repo"


def main() -> int:
    import onnxruntime as ort

    from dstool.decoding.engine import Sequence, engine_for
    from dstool.decoding.grammar import Grammars
    from dstool.decoding.sampling import Sampler, SamplingParams
    from dstool.serve.export.repository import cache_shapes

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repository", help="a dstool export repository (default: export the ~40 M model)")
    p.add_argument("--name", default=None, help="the model family's name in the repository")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--graph", choices=["fused", "exported"], default="fused",
                   help="the decoder NAME_llm runs (fused attention, where the export wrote it) or the exported one")
    p.add_argument("--memory", action="store_true", help="the cache memory under 64 concurrent long prompts instead")
    p.add_argument("--prompt-tokens", type=int, default=0, help="--memory: prompt length (default: 3/4 of the "
                   "model's positions)")
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="dstool-bench-engine-") as tmp:
        repo = prepare(a, Path(tmp))
        name = a.name or next(d.name[:-len("_decoder")] for d in repo.iterdir() if d.name.endswith("_decoder"))
        version = max((d for d in (repo / f"{name}_decoder").iterdir() if d.name.isdigit()), key=lambda d: int(d.name))
        fused = repo / f"{name}_llm" / version.name / "fused" / "model.onnx"
        graph = fused if fused.exists() and a.graph == "fused" else version / "model.onnx"
        print(f"graph: {graph.relative_to(repo)}")
        opts = ort.SessionOptions()
        session = ort.InferenceSession(str(graph), opts, providers=["CPUExecutionProvider"])
        shapes = cache_shapes(repo / f"{name}_generate" / "config.pbtxt")
        rng = np.random.default_rng(0)
        if a.memory:
            return memory(a, session, shapes, repo / f"{name}_llm" / "config.pbtxt", rng)
        prompts = [rng.integers(5, 4000, 25).tolist() for _ in range(16)]

        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(repo / f"{name}_llm" / version.name)
        grammars = Grammars(tokenizer, {tokenizer.eos_token_id})
        in_grammar = [0.0]  # seconds spent in the grammar's masks and token checks

        def timed(constraint):
            allowed, accept = constraint.allowed, constraint.accept

            def allowed_timed(size):
                began = time.perf_counter()
                try:
                    return allowed(size)
                finally:
                    in_grammar[0] += time.perf_counter() - began

            def accept_timed(token):
                began = time.perf_counter()
                accept(token)
                in_grammar[0] += time.perf_counter() - began

            constraint.allowed, constraint.accept = allowed_timed, accept_timed
            return constraint

        def sequence(i: int, schema: bool = False) -> Sequence:
            # eos never stops a run (every stream makes new_tokens tokens, as in the other systems' runs)
            constraint = timed(grammars.constraint({"json": SCHEMA})) if schema else None
            return Sequence(str(i), prompts[i], a.new_tokens, Sampler(SamplingParams(), constraint=constraint).next,
                            set())

        def one_stream() -> dict:
            engine = engine_for(session, shapes)
            engine.add(sequence(0))
            started = time.perf_counter()
            engine.step()
            first = time.perf_counter() - started
            while engine.busy:
                engine.step()
            return {"tokens_per_s": a.new_tokens / (time.perf_counter() - started), "first_token_ms": first * 1e3}

        def together() -> dict:
            engine = engine_for(session, shapes)
            for i in range(16):
                engine.add(sequence(i))
            started = time.perf_counter()
            while engine.busy:
                engine.step()
            return {"tokens_per_s": 16 * a.new_tokens / (time.perf_counter() - started)}

        def under_schema() -> dict:
            engine = engine_for(session, shapes)
            for i in range(16):
                engine.add(sequence(i, schema=True))
            in_grammar[0] = 0.0
            started = time.perf_counter()
            while engine.busy:
                engine.step()
            took = time.perf_counter() - started
            return {"tokens_per_s": 16 * a.new_tokens / took, "grammar_share_pct": 100 * in_grammar[0] / took}

        def staggered() -> dict:
            engine = engine_for(session, shapes)
            arrived, waits, step = {}, [], 0
            started = time.perf_counter()
            while engine.busy or step < 16:
                if step < 16:
                    engine.add(sequence(step))
                    arrived[str(step)] = step
                step += 1
                for s, _ in engine.step():
                    if len(s.output) == 1:
                        waits.append(step - arrived[s.id])
            return {"tokens_per_s": 16 * a.new_tokens / (time.perf_counter() - started),
                    "queue_wait_steps_p99": float(np.percentile(waits, 99))}

        runs: dict[str, list[dict]] = {}
        for r in range(a.rounds):
            for label, fn in (("1 stream", one_stream), ("16 together", together), ("16 staggered", staggered),
                              ("16 together, JSON schema", under_schema)):
                runs.setdefault(label, []).append(fn())
            print(f"round {r + 1} of {a.rounds} done", flush=True)
    print(f"\n{a.new_tokens} new tokens per stream, 25-token prompts, greedy; medians of {a.rounds} rounds\n")
    print("| engine, one process | tokens/s | other |\n|---|---:|---|")
    for label, samples in runs.items():
        med = {k: float(np.median([s[k] for s in samples])) for k in samples[0]}
        other = ", ".join(f"{k} {v:.1f}" for k, v in med.items() if k != "tokens_per_s")
        print(f"| {label} | {med['tokens_per_s']:.0f} | {other} |")
    return 0


def memory(a, session, shapes: dict[str, tuple[int, int]], llm_config: Path, rng) -> int:
    """64 long prompts at once on an engine set up as NAME_llm is: the peak cache memory it holds, per step."""
    import resource

    from dstool.decoding.engine import PrefixCache, Sequence, engine_for
    from dstool.decoding.sampling import Sampler, SamplingParams
    from dstool.serve.export.repository import read_config

    params = {k: v.string_value for k, v in read_config(llm_config).parameters.items()}
    positions, budget = int(params["max_positions"]), int(params["max_cache_tokens"])
    prefix = int(params.get("prefix_cache_tokens", 0))
    engine = engine_for(session, shapes, int(params["max_batch"]), budget, int(params["max_prefill_tokens"]),
                    PrefixCache(int(params["prefix_cache_block"]), prefix) if prefix else None)
    length = a.prompt_tokens or positions * 3 // 4
    shared = rng.integers(5, 4000, length // 2).tolist()
    for i in range(64):
        own = rng.integers(5, 4000, length - len(shared)).tolist()
        engine.add(Sequence(str(i), shared + own, a.new_tokens, Sampler(SamplingParams()).next, set()))
    per_position = sum(4 * heads * dim for heads, dim in shapes.values())  # fp32 keys and values, every layer

    def held() -> int:
        arrays = list(engine.cache.values())
        arrays += [v for s in engine.prefilling if s.partial for v in s.partial.values()]
        if engine.prefix_cache is not None:
            arrays += [v for block in engine.prefix_cache.blocks.values() for v in block.values()]
        return sum(v.nbytes for v in arrays)

    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    peak, steps, started = 0, 0, time.perf_counter()
    while engine.busy:
        engine.step()
        steps += 1
        peak = max(peak, held())
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(f"64 requests of {length} prompt tokens + {a.new_tokens} new, {steps} steps, "
          f"{time.perf_counter() - started:.0f} s")
    print(f"cache budget: {budget} positions x {per_position} bytes = {budget * per_position / 2**20:.1f} MiB")
    print(f"peak cache held by the engine: {peak / 2**20:.1f} MiB ({peak / (budget * per_position):.2f}x the budget)")
    print(f"process peak resident memory: {rss / 2**20:.0f} MiB ({rss_before / 2**20:.0f} MiB before the run)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
