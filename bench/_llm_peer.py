"""A peer text-generation engine for bench/serve.py, run with that engine's own virtual environment's python:

    PEER_PYTHON bench/_llm_peer.py {genai-fp32|genai-int4|vllm} MODEL_DIR WORK

Loads (and for onnxruntime-genai first builds, with its own model builder, into WORK) the Hugging Face model, prints
`ready`, then answers each JSON line {"ids": [...], "streams": N, "new_tokens": K} on stdin with one JSON line:
tokens/s for N copies of the prompt generated together (greedy, end of sequence ignored), and, at N = 1, the time
to the first token. Token ids are given, not text: each engine's tokenizer treats the beginning of text its own way.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path


def genai(precision: str, model_dir: Path, work: Path):
    import numpy as np
    import onnxruntime_genai as og

    out = work / f"genai-{precision}"
    if not (out / "genai_config.json").exists():
        subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(model_dir), "-o", str(out),
                        "-p", precision, "-e", "cpu"], check=True, stdout=sys.stderr, stderr=sys.stderr)
    model = og.Model(str(out))

    def run(ids: list[int], streams: int, new_tokens: int) -> dict:
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(ids) + new_tokens, min_length=len(ids) + new_tokens,
                                  do_sample=False, batch_size=streams)
        started = time.perf_counter()
        generator = og.Generator(model, params)
        generator.append_tokens(np.array([ids] * streams, dtype=np.int32))
        first, made = 0.0, 0
        while not generator.is_done() and made < new_tokens:
            generator.generate_next_token()
            made += 1
            first = first or time.perf_counter() - started
        wall = time.perf_counter() - started
        del generator
        return {"tokens_per_s": streams * made / wall, "first_token_ms": first * 1e3, "tokens": streams * made}

    return run


def vllm(model_dir: Path, work: Path):
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(model_dir), dtype="float32", max_model_len=512, max_num_seqs=16, seed=0)

    def run(ids: list[int], streams: int, new_tokens: int) -> dict:
        params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
        started = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": ids}] * streams, params, use_tqdm=False)
        wall = time.perf_counter() - started
        made = sum(len(o.outputs[0].token_ids) for o in outputs)
        return {"tokens_per_s": made / wall, "tokens": made}

    return run


def main() -> None:
    engine, model_dir, work = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    answers = os.fdopen(os.dup(1), "w")  # the answers' channel; what the engines print goes to stderr
    os.dup2(2, 1)
    run = genai(engine.split("-")[1], model_dir, work) if engine.startswith("genai") else vllm(model_dir, work)
    run(list(range(5, 30)), 1, 4)  # warm up
    print("ready", file=answers, flush=True)
    for line in sys.stdin:
        ask = json.loads(line)
        print(json.dumps(run(ask["ids"], ask["streams"], ask["new_tokens"])), file=answers, flush=True)


if __name__ == "__main__":  # vLLM starts its engine process with spawn: the guard is needed
    main()
