"""Serving benchmark on a real Triton: dynamic batching and the key/value cache.

    .venv/bin/python bench/batching.py [--requests 160] [--seq-len 32] [--new-tokens 64]

1. builds a ~40 M-parameter Llama-architecture model (`--size 40m`, as bench/compress.py) or the embedded
   default (`--size tiny`, 3 M parameters, the model the README's pipeline serves); weights untrained:
   speed does not depend on them. Exports it with `dstool export`; the same ONNX graph is written a
   second time as a model without dynamic batching;
2. starts Triton (nvidia-pytriton's 2.51) and drives the tensor model (token ids -> logits) with
   tritonclient's asyncio gRPC client at concurrency 1, 4 and 16, with and without dynamic batching
   (throughput and p50/p99 latency), and with `wrk` over HTTP as an outside load generator;
3. drives the text-generation entry point the same way (BATCH_TOKENS tokens per request; requests,
   tokens/s, p50/p99) with and without dynamic batching;
4. generates NEW_TOKENS tokens from one stream with and without the key/value cache.
Targets (issue #4): dynamic batching >= 3x throughput at concurrency 16; the cache >= 3x faster generation.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from compress import build_model  # noqa: E402  (the same ~40 M model as the compression benchmark)


def build_tiny(folder: Path) -> None:
    from transformers import AutoModelForCausalLM

    from dstool import models
    from dstool.corpus import read_documents
    from dstool.train import data

    tok = data.train_tokenizer(read_documents(None), 2048)
    special = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    AutoModelForCausalLM.from_config(models.preset_config("tiny", len(tok), special)).save_pretrained(folder)
    tok.save_pretrained(folder)


def tensor_load(url: str, model: str, concurrency: int, requests: int, seq_len: int) -> dict:
    """`requests` logits requests from `concurrency` concurrent gRPC asyncio clients' tasks."""
    import tritonclient.grpc.aio as grpc_aio

    ids = np.random.default_rng(0).integers(5, 2000, (1, seq_len)).astype(np.int64)

    async def run() -> tuple[list[float], float]:
        client = grpc_aio.InferenceServerClient(url)
        latencies: list[float] = []
        queue = list(range(requests))

        async def worker():
            while queue:
                queue.pop()
                inputs = [grpc_aio.InferInput("input_ids", list(ids.shape), "INT64"),
                          grpc_aio.InferInput("attention_mask", list(ids.shape), "INT64")]
                inputs[0].set_data_from_numpy(ids)
                inputs[1].set_data_from_numpy(np.ones_like(ids))
                t = time.perf_counter()
                await client.infer(model, inputs)
                latencies.append(time.perf_counter() - t)

        try:
            start = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(concurrency)))
            return latencies, time.perf_counter() - start
        finally:
            await client.close()

    asyncio.run(run())  # warm-up round (connections, first batches)
    latencies, wall = asyncio.run(run())
    ms = np.array(latencies) * 1e3
    return {"throughput_rps": requests / wall, "p50_ms": float(np.percentile(ms, 50)),
            "p99_ms": float(np.percentile(ms, 99))}


def generation_load(url: str, model: str, concurrency: int, requests: int, prompt: str, new_tokens: int) -> dict:
    """`requests` text-generation requests from `concurrency` concurrent gRPC asyncio tasks."""
    import tritonclient.grpc.aio as grpc_aio

    async def run() -> tuple[list[float], int, float]:
        client = grpc_aio.InferenceServerClient(url)
        latencies, tokens, queue = [], [0], list(range(requests))

        async def worker():
            while queue:
                queue.pop()
                inputs = [grpc_aio.InferInput("text_input", [1, 1], "BYTES"),
                          grpc_aio.InferInput("max_new_tokens", [1, 1], "INT32")]
                inputs[0].set_data_from_numpy(np.array([[prompt.encode()]], dtype=np.object_))
                inputs[1].set_data_from_numpy(np.array([[new_tokens]], dtype=np.int32))
                t = time.perf_counter()
                result = await client.infer(model, inputs)
                latencies.append(time.perf_counter() - t)
                tokens[0] += result.as_numpy("output_ids").shape[1]

        try:
            start = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(concurrency)))
            return latencies, tokens[0], time.perf_counter() - start
        finally:
            await client.close()

    latencies, tokens, wall = asyncio.run(run())
    ms = np.array(latencies) * 1e3
    return {"throughput_rps": requests / wall, "tokens_per_s": tokens / wall, "p50_ms": float(np.percentile(ms, 50)),
            "p99_ms": float(np.percentile(ms, 99))}


def wrk_load(url: str, model: str, concurrency: int, seq_len: int, seconds: int, work: Path) -> dict | None:
    """The same request over HTTP (JSON in, binary logits out) from `wrk`, an outside load generator."""
    if not shutil.which("wrk"):
        return None
    ids = np.random.default_rng(0).integers(5, 2000, seq_len).tolist()
    body = json.dumps({"inputs": [{"name": "input_ids", "shape": [1, seq_len], "datatype": "INT64", "data": ids},
                                  {"name": "attention_mask", "shape": [1, seq_len], "datatype": "INT64",
                                   "data": [1] * seq_len}],
                       "outputs": [{"name": "logits", "parameters": {"binary_data": True}}]})
    script = work / "post.lua"
    script.write_text(f'wrk.method = "POST"\nwrk.body = {json.dumps(body)}\n'
                      'wrk.headers["Content-Type"] = "application/json"\n')
    out = subprocess.run(["wrk", "-t", "1", "-c", str(concurrency), "-d", f"{seconds}s", "--latency", "-s", str(script),
                          f"http://{url}/v2/models/{model}/infer"], capture_output=True, text=True, check=True).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    p50 = re.search(r"50%\s+([\d.]+)(us|ms|s)", out)
    scale = {"us": 1e-3, "ms": 1.0, "s": 1e3}[p50.group(2)]
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    return {"throughput_rps": rps, "p50_ms": float(p50.group(1)) * scale,
            "non_2xx": int(non2xx.group(1)) if non2xx else 0}


def generation(url: str, model: str, prompt: str, new_tokens: int, use_kv_cache: bool, rounds: int) -> dict:
    from dstool.serve.runtime.client import generate_text

    generate_text(url, "grpc", model, prompt, 4, use_kv_cache)  # warm-up
    times, tokens = [], 0
    for _ in range(rounds):
        t = time.perf_counter()
        _, ids = generate_text(url, "grpc", model, prompt, new_tokens, use_kv_cache)
        times.append(time.perf_counter() - t)
        tokens = len(ids)
    seconds = float(np.median(times))
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=["tiny", "40m"], default="40m", help="model size [default: 40m]")
    parser.add_argument("--requests", type=int, default=160, help="tensor-model requests per measurement")
    parser.add_argument("--seq-len", type=int, default=32, help="tokens per tensor-model request")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated per text request")
    parser.add_argument("--gen-requests", type=int, default=16, help="text requests per concurrency level")
    parser.add_argument("--batch-tokens", type=int, default=32, help="tokens per text request under load")
    parser.add_argument("--wrk-seconds", type=int, default=5)
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    args = parser.parse_args()

    from dstool.proc import free_port
    from dstool.serve.config.export_config import ExportConfig, RepositorySettings
    from dstool.serve.export import export, repository
    from dstool.serve.runtime import triton

    work = Path(tempfile.mkdtemp(prefix="dstool-bench-serve-"))
    try:
        print(f"[model] building the {args.size} model and exporting it (logits + key/value-cache decoder)", flush=True)
        (build_model if args.size == "40m" else build_tiny)(work / "model")
        repo = work / "repo"
        export(ExportConfig(model=str(work / "model"), repository=str(repo), name="lm", max_batch_size=16))
        graphs = {role: repo / name / "1" / "model.onnx" for role, name in repository.model_names("lm").items()}
        repository.write_repository(repo, RepositorySettings(name="lm_unbatched", max_batch_size=16,
                                                             dynamic_batching=False),
                                    repository.Artefacts(graphs["logits"], graphs["decoder"], work / "model", [-1],
                                                         1024))  # no end-of-sequence: the full length
        ports = [free_port() for _ in range(3)]
        server = triton.start(repo, triton.find_tritonserver(), *ports, work / "triton.log", timeout=300)
        try:
            rows = []
            for batching, model in (("on", "lm"), ("off", "lm_unbatched")):
                for concurrency in (1, 4, 16):
                    r = tensor_load(server.grpc_url, model, concurrency, args.requests, args.seq_len)
                    rows.append({"client": "grpc.aio", "dynamic_batching": batching, "concurrency": concurrency, **r})
                    print(f"[tensor] grpc.aio  batching {batching:3} c={concurrency:2}: "
                          f"{r['throughput_rps']:7.1f} req/s, p50 {r['p50_ms']:7.2f} ms, p99 {r['p99_ms']:7.2f} ms",
                          flush=True)
                w = wrk_load(server.http_url, model, 16, args.seq_len, args.wrk_seconds, work)
                if w:
                    rows.append({"client": "wrk (HTTP)", "dynamic_batching": batching, "concurrency": 16, **w})
                    print(f"[tensor] wrk HTTP  batching {batching:3} c=16: {w['throughput_rps']:7.1f} req/s, "
                          f"p50 {w['p50_ms']:7.2f} ms, non-2xx {w['non_2xx']}", flush=True)
            prompt = "ROMEO:\nBut soft, what light through yonder window breaks? It is the east, and Juliet"
            for batching, model in (("on", "lm_generate"), ("off", "lm_unbatched_generate")):
                for concurrency in (1, 4, 16):
                    r = generation_load(server.grpc_url, model, concurrency, max(concurrency, args.gen_requests),
                                        prompt, args.batch_tokens)
                    rows.append({"client": "generate", "dynamic_batching": batching, "concurrency": concurrency, **r})
                    print(f"[generate] {args.batch_tokens} tokens, batching {batching:3} c={concurrency:2}: "
                          f"{r['throughput_rps']:6.2f} req/s = {r['tokens_per_s']:7.1f} tokens/s, "
                          f"p50 {r['p50_ms']:7.0f} ms, p99 {r['p99_ms']:7.0f} ms", flush=True)
            gen = {kv: generation(server.grpc_url, "lm", prompt, args.new_tokens, kv, rounds=3) for kv in (True, False)}
            for kv, g in gen.items():
                print(f"[generate] key/value cache {'on ' if kv else 'off'}: {g['tokens']} tokens in "
                      f"{g['seconds'] * 1e3:.0f} ms = {g['tokens_per_s']:.1f} tokens/s", flush=True)
        finally:
            server.stop()

        def rps(client, batching, c):
            return next(r["throughput_rps"] for r in rows if r["client"] == client and r["dynamic_batching"] == batching
                        and r["concurrency"] == c)
        print("\nsummary (target >= 3x each):")
        ratio = rps('grpc.aio', 'on', 16) / rps('grpc.aio', 'off', 16)
        print(f"  dynamic batching at concurrency 16 (grpc.aio): {ratio:.2f}x throughput")
        if any(r["client"].startswith("wrk") for r in rows):
            print(f"  dynamic batching at concurrency 16 (wrk HTTP): "
                  f"{rps('wrk (HTTP)', 'on', 16) / rps('wrk (HTTP)', 'off', 16):.2f}x throughput")
        print(f"  dynamic batching at concurrency 16 (text generation): "
              f"{rps('generate', 'on', 16) / rps('generate', 'off', 16):.2f}x throughput")
        print(f"  key/value cache, {args.new_tokens} new tokens: "
              f"{gen[True]['tokens_per_s'] / gen[False]['tokens_per_s']:.2f}x tokens/s")
    finally:
        if args.keep:
            print(f"work folder: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
