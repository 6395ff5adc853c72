"""Cache gateway latency and throughput, in one run: direct Triton, Triton with its local response cache,
the dstool gateway on a hit and on a miss — HTTP (binary tensors) and gRPC.

    .venv/bin/python bench/cache.py [--model HF_DIR | --repository REPO] [--tokens 2] [--requests 1000]

Without --model/--repository a tiny preset is trained 40 steps first. The repository gets the tensor model
twice: `dstool_lm` (`dstool export`) and `dstool_lm_rc` (`dstool export --response-cache`), served by one
Triton started with `--cache-config local,size=256MiB`; a redis-server is started on a free port for the
gateway. Latency: sequential tritonclient requests (p50/p99); a miss uses a fresh input each time and is
compared with direct Triton on fresh inputs, the two interleaved. Throughput: concurrent tritonclient asyncio
clients, `wrk` (HTTP/1.1) and `h2load` (gRPC over HTTP/2) from Debian (`apt-get install wrk nghttp2-client`).
Throughput under wrk/h2load is measured for the gateway with one process and with `--workers`, and for its HTTP
frontend under uvicorn and granian (`--fronts`, bench/_asgi_front.py), in interleaved rounds.
Targets (issue #13): gateway hit p50 <= Triton's own cache-hit p50; miss overhead <= +0.3 ms p50 over direct
Triton; hit throughput >= 1.0x Triton's own cache under the same load generator.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from dstool.proc import free_port
from dstool.serve.runtime import triton

BENCH = Path(__file__).resolve().parent
DSTOOL = [sys.executable, "-m", "dstool.cli"]
GATEWAY = ("import json, sys; from dstool import log; from dstool.serve.gateway import GatewayConfig, run_gateway; "
           "log.setup(); sys.exit(run_gateway(GatewayConfig(**json.loads(sys.argv[1]))))")
WRK_LUA = """local f = io.open(os.getenv("BODY"), "rb"); wrk.body = f:read("*a"); f:close()
wrk.method = "POST"
wrk.headers["Inference-Header-Content-Length"] = os.getenv("HLEN")
wrk.headers["Content-Type"] = "application/octet-stream"
"""


def run(cmd: list[str], **kw) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True, **kw).stdout


def prepare_repository(a, work: Path) -> Path:
    if a.repository:
        return Path(a.repository)
    model = a.model
    if model is None:
        print("training the tiny preset 40 steps ...", flush=True)
        run([*DSTOOL, "train", "--output", str(work / "run"), "--nproc", "1", "--zero", "0", "--max-steps", "40",
             "--save-every", "40", "--seq-len", "64", "--micro-batch-size", "4", "--no-tensorboard"])
        model = str(work / "run" / "model")
    repo = work / "repository"
    print("exporting dstool_lm and dstool_lm_rc (--response-cache) ...", flush=True)
    run([*DSTOOL, "export", model, "--repository", str(repo), "--name", "dstool_lm"])
    run([*DSTOOL, "export", model, "--repository", str(repo), "--name", "dstool_lm_rc", "--response-cache"])
    for m in repo.iterdir():  # only the two tensor models take part
        if m.name not in ("dstool_lm", "dstool_lm_rc"):
            shutil.rmtree(m)
    return repo


def ids_for(i: int, tokens: int) -> np.ndarray:
    """A distinct input for each i (tokens >= 2)."""
    base = [i % 4000 + 1, (i // 4000) % 4000 + 1]
    return np.array([(base + [7] * tokens)[:tokens]], dtype=np.int64)


def make_inputs(module, ids: np.ndarray):
    inputs = []
    for name, value in (("input_ids", ids), ("attention_mask", np.ones_like(ids))):
        t = module.InferInput(name, list(value.shape), "INT64")
        t.set_data_from_numpy(value)
        inputs.append(t)
    return inputs


def percentiles(samples: list[float]) -> dict:
    ms = np.array(samples) * 1e3
    return {"p50_ms": round(float(np.percentile(ms, 50)), 3), "p99_ms": round(float(np.percentile(ms, 99)), 3),
            "n": len(samples)}


def latency(clients: dict, plan: list[tuple[str, str, str, callable]], n: int, warmup: int) -> dict:
    """Sequential requests; the plan's entries are taken in turn (interleaved) so load drifts hit all alike."""
    import tritonclient.grpc as grpc
    import tritonclient.http as http

    samples = {name: [] for name, *_ in plan}
    outputs = {"http": [http.InferRequestedOutput("logits")], "grpc": [grpc.InferRequestedOutput("logits")]}
    for i in range(warmup + n):
        for name, target, model, ids_of in plan:
            protocol = "grpc" if name.endswith("grpc") else "http"
            module = grpc if protocol == "grpc" else http
            inputs = make_inputs(module, ids_of(i))
            started = time.perf_counter()
            clients[(target, protocol)].infer(model, inputs, outputs=outputs[protocol])
            if i >= warmup:
                samples[name].append(time.perf_counter() - started)
    return {name: percentiles(s) for name, s in samples.items()}


async def asyncio_load(url: str, protocol: str, model: str, ids: np.ndarray, concurrency: int, seconds: float):
    if protocol == "grpc":
        import tritonclient.grpc.aio as module
    else:
        import tritonclient.http.aio as module
    client = module.InferenceServerClient(url)
    done, samples = 0, []
    deadline = time.perf_counter() + seconds

    async def worker():
        nonlocal done
        inputs = make_inputs(module, ids)
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            await client.infer(model, inputs)
            samples.append(time.perf_counter() - started)
            done += 1

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    await client.close()
    return {"requests_per_s": round(done / elapsed), **percentiles(samples)}


def http_body(ids: np.ndarray) -> tuple[bytes, int]:
    inputs = [{"name": n, "shape": list(ids.shape), "datatype": "INT64", "parameters": {"binary_data_size": ids.nbytes}}
              for n in ("input_ids", "attention_mask")]
    header = json.dumps({"inputs": inputs, "outputs": [{"name": "logits", "parameters": {"binary_data": True}}]})
    return header.encode() + ids.tobytes() + np.ones_like(ids).tobytes(), len(header)


def grpc_body(model: str, ids: np.ndarray) -> bytes:
    from tritonclient.grpc import service_pb2

    req = service_pb2.ModelInferRequest(model_name=model)
    for name, value in (("input_ids", ids), ("attention_mask", np.ones_like(ids))):
        req.inputs.add(name=name, datatype="INT64", shape=list(ids.shape))
        req.raw_input_contents.append(value.tobytes())
    req.outputs.add(name="logits")
    msg = req.SerializeToString()
    return b"\x00" + struct.pack(">I", len(msg)) + msg  # gRPC length-prefixed message


def wrk(url: str, model: str, ids: np.ndarray, work: Path, seconds: int, connections: int) -> dict:
    body, header_length = http_body(ids)
    (work / "body.bin").write_bytes(body)
    (work / "post.lua").write_text(WRK_LUA)
    out = run(["wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "--latency", "-s", str(work / "post.lua"),
               f"http://{url}/v2/models/{model}/infer"],
              env=dict(os.environ, BODY=str(work / "body.bin"), HLEN=str(header_length)))
    if "Non-2xx" in out:
        raise RuntimeError(f"wrk saw errors:\n{out}")
    return {"requests_per_s": round(float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))),
            "p50_ms": _wrk_ms(re.search(r"50%\s+([\d.]+\w+)", out).group(1))}


def _wrk_ms(value: str) -> float:
    number, unit = re.match(r"([\d.]+)(\w+)", value).groups()
    return round(float(number) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[unit], 3)


def h2load(url: str, model: str, ids: np.ndarray, work: Path, requests: int, connections: int) -> dict:
    (work / "grpc.bin").write_bytes(grpc_body(model, ids))
    out = run(["h2load", "-n", str(requests), "-c", str(connections), "-m", "1", "-t", "1", "-d",
               str(work / "grpc.bin"), "-H", "content-type: application/grpc", "-H", "te: trailers",
               f"http://{url}/inference.GRPCInferenceService/ModelInfer"])
    if f"{requests} succeeded" not in out:
        raise RuntimeError(f"h2load saw failures:\n{out}")
    mean = re.search(r"time for request:\s+\S+\s+\S+\s+(\S+)", out).group(1)
    return {"requests_per_s": round(float(re.search(r"finished in [\d.]+\w+, ([\d.]+) req/s", out).group(1))),
            "mean_ms": _wrk_ms(mean)}


def start_front(name: str, config: dict, work: Path, procs: list) -> dict[str, str]:
    """Start one HTTP(/gRPC) front on free ports: the gateway (`gateway`, `gateway xN` with N workers), or its HTTP
    frontend as an ASGI app under `uvicorn` (httptools, uvloop) or `granian` (one worker); its addresses."""
    http_port, grpc_port = free_port(), free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1", DSTOOL_BENCH_GATEWAY=json.dumps(config))
    if name.startswith("gateway"):
        workers = int(name.split("x")[1]) if " x" in name else 1
        cmd = [sys.executable, "-c", GATEWAY, json.dumps({**config, "http_port": http_port, "grpc_port": grpc_port,
                                                          "workers": workers})]
    elif name == "uvicorn":
        cmd = [sys.executable, "-m", "uvicorn", "--app-dir", str(BENCH), "_asgi_front:app", "--host", "127.0.0.1",
               "--port", str(http_port), "--loop", "uvloop", "--http", "httptools", "--no-access-log",
               "--log-level", "warning", "--lifespan", "on"]
    elif name == "granian":
        cmd = [sys.executable, "-m", "granian", "--interface", "asgi", "--host", "127.0.0.1", "--port", str(http_port),
               "--workers", "1", "--runtime-threads", "1", "--loop", "uvloop", "--log-level", "warning",
               "--working-dir", str(BENCH), "_asgi_front:app"]
    else:
        sys.exit(f"bench/cache.py: unknown front '{name}' (uvicorn or granian)")
    log = open(work / f"{name.replace(' ', '_')}.log", "w")
    procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env))
    import http.client

    deadline = time.time() + 60
    while True:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", http_port, timeout=2)
            conn.request("GET", "/v2/health/ready")
            if conn.getresponse().status == 200:
                break
        except OSError:
            pass
        if procs[-1].poll() is not None or time.time() > deadline:
            sys.exit(f"bench/cache.py: {name} did not start:\n{Path(log.name).read_text()[-2000:]}")
        time.sleep(0.2)
    return {"http": f"127.0.0.1:{http_port}", **({"grpc": f"127.0.0.1:{grpc_port}"} if name.startswith("gateway")
                                                  else {})}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="Hugging Face folder to export (default: train the tiny preset)")
    p.add_argument("--repository", help="an existing repository holding dstool_lm and dstool_lm_rc")
    p.add_argument("--tokens", type=int, default=2, help="tokens per request [default: 2]")
    p.add_argument("--requests", type=int, default=1000, help="sequential requests per latency figure")
    p.add_argument("--seconds", type=int, default=5, help="seconds per throughput figure")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--workers", type=int, default=2, help="also measure the gateway with this many worker processes")
    p.add_argument("--fronts", default="uvicorn,granian",
                   help="ASGI servers to run the gateway's HTTP frontend under, beside its own server ('' for none)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of wrk and h2load")
    p.add_argument("--output", default="bench/cache.json")
    a = p.parse_args()
    for tool in ("wrk", "h2load", "redis-server"):
        if shutil.which(tool) is None:
            sys.exit(f"bench/cache.py: {tool} is not installed (apt-get install -y wrk nghttp2-client redis-server)")
    import tritonclient.grpc as grpc
    import tritonclient.http as http

    work = Path(tempfile.mkdtemp(prefix="dstool-bench-cache-"))
    procs: list[subprocess.Popen] = []
    server = None
    try:
        repo = prepare_repository(a, work)
        redis_port = free_port()
        procs.append(subprocess.Popen(["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                                       "--appendonly", "no", "--dir", str(work)], stdout=subprocess.DEVNULL))
        server = triton.start(repo, triton.find_tritonserver(), free_port(), free_port(), free_port(),
                              work / "triton.log", cache_config=f"local,size={256 << 20}")
        config = {"upstreams": [server.http_url], "upstreams_grpc": [server.grpc_url],
                  "cache": f"redis://127.0.0.1:{redis_port}/0"}
        fronts = {name: start_front(name, config, work, procs) for name in
                  ["gateway", f"gateway x{a.workers}", *[f for f in a.fronts.split(",") if f]]}
        gw = fronts["gateway"]
        direct = {"http": server.http_url, "grpc": server.grpc_url}
        clients = {("triton", "http"): http.InferenceServerClient(direct["http"]),
                   ("triton", "grpc"): grpc.InferenceServerClient(direct["grpc"]),
                   ("gateway", "http"): http.InferenceServerClient(gw["http"]),
                   ("gateway", "grpc"): grpc.InferenceServerClient(gw["grpc"])}
        t = a.tokens
        hot = ids_for(0, t)
        fresh = iter(range(1, 10**9))  # every miss gets an input never seen before
        results = {"tokens": t, "logits_bytes": t * 4096 * 4}
        for protocol in ("http", "grpc"):
            print(f"latency, {protocol} ...", flush=True)
            plan = [(f"direct Triton/{protocol}", "triton", "dstool_lm", lambda i: ids_for(next(fresh), t)),
                    (f"gateway miss/{protocol}", "gateway", "dstool_lm", lambda i: ids_for(next(fresh), t)),
                    (f"Triton cache hit/{protocol}", "triton", "dstool_lm_rc", lambda i: hot),
                    (f"gateway hit/{protocol}", "gateway", "dstool_lm", lambda i: hot)]
            results.update(latency(clients, plan, a.requests, warmup=50))
        for c in clients.values():
            c.close()
        for protocol in ("http", "grpc"):
            print(f"asyncio load, {protocol} ...", flush=True)
            results[f"asyncio gateway hit/{protocol}"] = asyncio.run(
                asyncio_load(gw[protocol], protocol, "dstool_lm", hot, a.concurrency, a.seconds))
            results[f"asyncio Triton cache hit/{protocol}"] = asyncio.run(
                asyncio_load(direct[protocol], protocol, "dstool_lm_rc", hot, a.concurrency, a.seconds))
        http_targets = {"Triton cache": (direct["http"], "dstool_lm_rc"),
                        **{name: (f["http"], "dstool_lm") for name, f in fronts.items()}}
        grpc_targets = {"Triton cache": (direct["grpc"], "dstool_lm_rc"),
                        **{name: (f["grpc"], "dstool_lm") for name, f in fronts.items() if "grpc" in f}}
        rounds: dict[str, list[dict]] = {}
        for r in range(a.rounds):  # interleaved rounds: the machine's drift hits every target alike
            print(f"wrk and h2load, round {r + 1} of {a.rounds} ...", flush=True)
            for name, (url, model) in http_targets.items():
                rounds.setdefault(f"wrk {name}", []).append(wrk(url, model, hot, work, a.seconds, a.concurrency))
            for name, (url, model) in grpc_targets.items():
                rounds.setdefault(f"h2load {name}", []).append(
                    h2load(url, model, hot, work, 5000 * a.seconds, a.concurrency))
        for name, samples in rounds.items():
            results[name] = {k: float(np.median([s[k] for s in samples])) for k in samples[0]}
    finally:
        for proc in reversed(procs):
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
        if server is not None:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)
    Path(a.output).write_text(json.dumps(results, indent=2) + "\n")
    report(results)
    return 0


def report(r: dict) -> None:
    print(f"\nrequest: {r['tokens']} tokens, response: {r['logits_bytes']:,} bytes of logits\n")
    print("| sequential tritonclient | HTTP p50 / p99 ms | gRPC p50 / p99 ms |\n|---|---:|---:|")
    for name in ("direct Triton", "gateway miss", "Triton cache hit", "gateway hit"):
        h, g = r[f"{name}/http"], r[f"{name}/grpc"]
        print(f"| {name} | {h['p50_ms']:.3f} / {h['p99_ms']:.3f} | {g['p50_ms']:.3f} / {g['p99_ms']:.3f} |")
    print("\n| hit throughput, tritonclient asyncio | requests/s | p50 ms |\n|---|---:|---:|")
    for name in ("asyncio gateway hit/http", "asyncio Triton cache hit/http", "asyncio gateway hit/grpc",
                 "asyncio Triton cache hit/grpc"):
        print(f"| {name} | {r[name]['requests_per_s']:,} | {r[name]['p50_ms']:.3f} |")
    print("\n| hit throughput (medians of interleaved rounds) | requests/s | vs Triton's cache | latency ms |"
          "\n|---|---:|---:|---:|")
    for tool, key in (("wrk", "p50_ms"), ("h2load", "mean_ms")):
        own = r[f"{tool} Triton cache"]["requests_per_s"]
        for name in [k for k in r if k.startswith(tool + " ")]:
            rps = r[name]["requests_per_s"]
            print(f"| {name} ({'HTTP' if tool == 'wrk' else 'gRPC'}) | {rps:,.0f} | {rps / own:.2f}x | "
                  f"{key.split('_')[0]} {r[name][key]:.3f} |")
    for protocol in ("http", "grpc"):
        hit, own = r[f"gateway hit/{protocol}"]["p50_ms"], r[f"Triton cache hit/{protocol}"]["p50_ms"]
        miss = r[f"gateway miss/{protocol}"]["p50_ms"] - r[f"direct Triton/{protocol}"]["p50_ms"]
        print(f"\n{protocol}: gateway hit p50 {hit:.3f} ms vs Triton cache hit {own:.3f} ms "
              f"({'met' if hit <= own else 'missed'}); miss overhead {miss:+.3f} ms "
              f"({'met' if miss <= 0.3 else 'missed'})")
    for tool in ("wrk", "h2load"):
        own = r[f"{tool} Triton cache"]["requests_per_s"]
        best = max((v["requests_per_s"], k) for k, v in r.items() if k.startswith(tool + " ") and "Triton" not in k)
        print(f"hit throughput, {tool}: best {best[1][len(tool) + 1:]} {best[0] / own:.2f}x Triton's cache "
              f"(target 1.0x: {'met' if best[0] >= own else 'missed'})")


if __name__ == "__main__":
    sys.exit(main())
