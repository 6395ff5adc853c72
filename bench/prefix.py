"""Shared-prefix serving benchmark: chats that share a long system prompt, each with its own question, against
dstool's NAME_llm with its prefix cache on and off (two exports of one model, each on its own Triton behind the
gateway's OpenAI route) and, when its environment is there, vLLM's OpenAI server (automatic prefix caching on, its
default) — every system asked by the same openai client code, in interleaved rounds, medians.

    .venv/bin/python bench/prefix.py [--rounds 3] [--streams 16] [--system-tokens 512] [--question-tokens 32]
                                     [--new-tokens 32] [--peers /work/peers] [--work DIR]

Each round: one chat with the system prompt primes each system (as the traffic before it would), then STREAMS
chats arrive together, each with a question not asked before (so nothing but the system prompt can be reused),
streamed, greedy, the gateway's result cache bypassed. Reported per system: time to first token (p50 over the
streams, median over rounds), tokens/s over the burst, and the prompt tokens the server says it reused
(usage.prompt_tokens_details.cached_tokens). Target (issue 25): with the prefix cache, time to first token p50 at
least 3x lower than without, and no worse than vLLM's server.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def texts(model: Path, system_tokens: int, question_tokens: int, count: int) -> tuple[str, list[str]]:
    """A system prompt of `system_tokens` tokens and `count` questions of `question_tokens`, from the corpus."""
    from transformers import AutoTokenizer

    from dstool.corpus import read_documents

    tokenizer = AutoTokenizer.from_pretrained(model)
    ids = tokenizer("\n\n".join(d for _, d in zip(range(64), read_documents(None))), add_special_tokens=False)[
        "input_ids"]
    need = system_tokens + count * question_tokens
    if len(ids) < need:
        sys.exit(f"bench/prefix.py: the corpus has {len(ids)} tokens, {need} needed")
    system = tokenizer.decode(ids[:system_tokens])
    at = system_tokens
    questions = []
    for _ in range(count):
        questions.append(tokenizer.decode(ids[at:at + question_tokens]))
        at += question_tokens
    return system, questions


async def burst(url: str, model: str, system: str, questions: list[str], new_tokens: int) -> dict:
    """The chats at once, streamed: first-token times, tokens/s, reused prompt tokens."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"http://{url}/v1", api_key="none", max_retries=0, timeout=600)

    async def one(question: str) -> tuple[float, int, int]:
        sent, first, tokens, cached = time.perf_counter(), 0.0, 0, 0
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
            max_tokens=new_tokens, temperature=0, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True}, extra_headers={"Cache-Control": "no-cache"})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter() - sent
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
                details = chunk.usage.prompt_tokens_details
                cached = (details.cached_tokens or 0) if details else 0
        return first, tokens, cached

    try:
        started = time.perf_counter()
        done = await asyncio.gather(*(one(q) for q in questions))
        wall = time.perf_counter() - started
    finally:
        await client.close()
    return {"first_token_ms": 1e3 * float(np.median([d[0] for d in done])),
            "tokens_per_s": sum(d[1] for d in done) / wall, "cached_tokens": float(np.median([d[2] for d in done]))}


def start_vllm(python: Path, model: Path, work: Path) -> tuple[subprocess.Popen, str]:
    """vLLM's OpenAI server on the model folder (its CPU build), ready."""
    import http.client

    from dstool.proc import free_port

    port = free_port()
    template = work / "chat-template.jinja"  # NAME_llm's layout for a tokenizer without a chat template
    template.write_text("{% for m in messages %}{{ m['role'] | upper }}:\n{{ m['content'] }}\n\n{% endfor %}"
                        "{% if add_generation_prompt %}ASSISTANT:\n{% endif %}")
    proc = subprocess.Popen([str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                             "--served-model-name", "model", "--port", str(port), "--dtype", "float32",
                             "--max-model-len", "1024", "--chat-template", str(template)],
                            stdout=open(work / "vllm-serve.log", "w"), stderr=subprocess.STDOUT,
                            env=dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0-1", VLLM_CPU_KVCACHE_SPACE="2"))
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            sys.exit(f"bench/prefix.py: vllm serve exited {proc.returncode}: see {work / 'vllm-serve.log'}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return proc, f"127.0.0.1:{port}"
        except OSError:
            pass
        time.sleep(1)
    proc.kill()
    sys.exit("bench/prefix.py: vllm serve was not ready in 600 s")


def main() -> int:
    from cache import start_front

    from compress import build_model
    from dstool.proc import free_port, stop_process
    from dstool.serve.runtime import triton

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--system-tokens", type=int, default=512)
    p.add_argument("--question-tokens", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--peers", default="/work/peers", help="folder of the peers' virtual environments (vllm)")
    p.add_argument("--work", help="keep the model and repositories here (reused when present)")
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="dstool-bench-prefix-") as tmp:
        work = Path(a.work) if a.work else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        model = work / "model"
        if not (model / "config.json").exists():
            build_model(model)
        for variant, flag in (("on", "--prefix-cache"), ("off", "--no-prefix-cache")):
            if not (work / f"repo-{variant}" / "dstool.json").exists():
                subprocess.run([sys.executable, "-m", "dstool.cli", "export", str(model), "--repository",
                                str(work / f"repo-{variant}"), "--name", variant, flag], check=True,
                               capture_output=True)
        system, questions = texts(model, a.system_tokens, a.question_tokens, (a.rounds + 1) * a.streams)
        procs: list[subprocess.Popen] = []
        servers, systems = [], {}
        try:
            for variant in ("on", "off"):
                srv = triton.start(work / f"repo-{variant}", triton.find_tritonserver(), free_port(), free_port(),
                                   free_port(), work / f"triton-{variant}.log", timeout=300)
                servers.append(srv)
                front = start_front("gateway", {"upstreams": [srv.http_url], "upstreams_grpc": [srv.grpc_url],
                                                "cache": "memory"}, work, procs)
                systems[f"dstool, prefix cache {variant}"] = (front["http"], variant)
            vllm = Path(a.peers) / "vllm" / "bin" / "python"
            if vllm.exists():
                print("starting vllm serve ...", flush=True)
                proc, url = start_vllm(vllm, model, work)
                procs.append(proc)
                systems["vllm serve (automatic prefix caching)"] = (url, "model")
            else:
                print(f"vllm serve: skipped ({vllm} absent: bash bench/peers.sh {a.peers})")
            results: dict[str, list[dict]] = {k: [] for k in systems}
            order = list(systems)
            for r in range(a.rounds + 1):  # round 0 warms every system up and is not counted
                asked = questions[r * a.streams:(r + 1) * a.streams]
                for label in order[r % len(order):] + order[:r % len(order)]:
                    url, name = systems[label]
                    asyncio.run(burst(url, name, system, ["Prime."], 1))
                    time.sleep(1.0)
                    result = asyncio.run(burst(url, name, system, asked, a.new_tokens))
                    if r:
                        results[label].append(result)
                print(f"round {r} of {a.rounds} done" + (" (warm-up)" if not r else ""), flush=True)
        finally:
            for proc in procs:
                stop_process(proc, grace=10)
            for srv in servers:
                srv.stop()
    print(f"\n{a.streams} chats at once sharing a {a.system_tokens}-token system prompt, each with its own "
          f"{a.question_tokens}-token question, {a.new_tokens} new tokens, greedy; medians of {a.rounds} rounds")
    print("| system | first token p50 | tokens/s | prompt tokens reused |\n|---|---:|---:|---:|")
    med = {k: {m: float(np.median([x[m] for x in v])) for m in ("first_token_ms", "tokens_per_s", "cached_tokens")}
           for k, v in results.items()}
    for label, m in med.items():
        print(f"| {label} | {m['first_token_ms']:.0f} ms | {m['tokens_per_s']:.0f} | {m['cached_tokens']:.0f} |")
    on, off = med["dstool, prefix cache on"], med["dstool, prefix cache off"]
    print(f"\nfirst token p50, prefix cache off / on: {off['first_token_ms'] / on['first_token_ms']:.2f}x (target "
          ">= 3x)")
    peer = med.get("vllm serve (automatic prefix caching)")
    if peer:
        print(f"first token p50, vllm serve / dstool with the prefix cache: "
              f"{peer['first_token_ms'] / on['first_token_ms']:.2f}x (target >= 1.0x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
