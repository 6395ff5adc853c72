"""Fair share between tenants, measured: one tenant's time to first token, idle and while another tenant floods the
same gateway and engine.

    .venv/bin/python bench/fairness.py [--repository REPO] [--rounds 5] [--samples 8]

Without --repository a tiny preset is trained 40 steps and exported first. A real Triton serves it, a redis-server
starts on a free port and `dstool gateway --auth keys` runs in front. Tenant `flood` (its own concurrency 16: the
engine's whole batch) keeps 4 streamed chats of n=8 choices and 300 tokens going (32 sequences: 16 generating, 16
waiting at the gateway); tenant `victim` sends short streamed chats one after another and measures the time to its
first token. Rounds alternate idle and flooded; the figures are the medians over the rounds of each round's median.
Target (issue 40): flooded time to first token <= 2x idle.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from _machine import cpu_name

from dstool.proc import free_port
from dstool.serve.runtime import triton

DSTOOL = [sys.executable, "-m", "dstool.cli"]
GATEWAY = ("import json, sys; from dstool import log; from dstool.serve.gateway import GatewayConfig, run_gateway; "
           "log.setup(); sys.exit(run_gateway(GatewayConfig(**json.loads(sys.argv[1]))))")
CHAT = "/v1/chat/completions"


def run(cmd: list[str]) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def repository(a, work: Path) -> Path:
    if a.repository:
        return Path(a.repository)
    print("training the tiny preset 40 steps and exporting it ...", flush=True)
    run([*DSTOOL, "train", "--output", str(work / "run"), "--nproc", "1", "--zero", "0", "--max-steps", "40",
         "--save-every", "40"])
    run([*DSTOOL, "export", str(work / "run" / "model"), "--repository", str(work / "repo")])
    return work / "repo"


def first_token(port: int, key: str, content: str) -> float:
    """Seconds from sending a streamed chat to its first content chunk (the rest read and dropped)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    started = time.perf_counter()
    conn.request("POST", CHAT, json.dumps({"model": "dstool_lm", "max_tokens": 4, "ignore_eos": True, "stream": True,
                                           "messages": [{"role": "user", "content": content}]}),
                 {"Authorization": f"Bearer {key}", "Cache-Control": "no-cache", "Content-Type": "application/json"})
    r = conn.getresponse()
    first = None
    for line in r:
        if first is None and line.startswith(b"data: {") and b'"content":"' in line and b'"content":""' not in line:
            first = time.perf_counter() - started
    conn.close()
    assert r.status == 200 and first is not None, r.status
    return first


def flood(port: int, key: str, stop: threading.Event) -> None:
    """One flood client: streamed chats of n=8 and 300 tokens, one after another, until `stop`."""
    while not stop.is_set():
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        conn.request("POST", CHAT, json.dumps({"model": "dstool_lm", "max_tokens": 300, "ignore_eos": True, "n": 8,
                                               "stream": True, "messages": [{"role": "user", "content": "flood"}]}),
                     {"Authorization": f"Bearer {key}", "Cache-Control": "no-cache",
                      "Content-Type": "application/json"})
        r = conn.getresponse()
        for _ in r:
            if stop.is_set():
                break
        conn.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repository")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--samples", type=int, default=8)
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="dstool-bench-fairness-"))
    repo = repository(a, work)
    redis_port = free_port()
    redis = subprocess.Popen(["redis-server", "--port", str(redis_port), "--save", "", "--appendonly", "no"],
                             stdout=subprocess.DEVNULL)
    redis_url = f"redis://127.0.0.1:{redis_port}/0"
    srv = triton.start(repo, triton.find_tritonserver(), free_port(), free_port(), free_port(), work / "triton.log")
    port, log = free_port(), work / "gateway.log"
    gateway = subprocess.Popen([sys.executable, "-c", GATEWAY, json.dumps({
        "upstreams": [srv.http_url], "upstreams_grpc": [srv.grpc_url], "cache": redis_url, "auth": "keys",
        "http_port": port, "grpc_port": free_port()})], stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        while "ready" not in log.read_text():
            if gateway.poll() is not None:
                raise SystemExit(f"the gateway did not start:\n{log.read_text()}")
            time.sleep(0.1)
        run([*DSTOOL, "keys", "limits", "--tenant", "flood", "--concurrency", "16", "--redis", redis_url])
        flooder = run([*DSTOOL, "keys", "create", "--tenant", "flood", "--redis", redis_url]).strip()
        victim = run([*DSTOOL, "keys", "create", "--tenant", "victim", "--redis", redis_url]).strip()
        for i in range(3):
            first_token(port, victim, f"warm {i}")
        medians: dict[str, list[float]] = {"idle": [], "flooded": []}
        for r in range(a.rounds):
            for state in (("idle", "flooded") if r % 2 == 0 else ("flooded", "idle")):
                stop = threading.Event()
                clients = [threading.Thread(target=flood, args=(port, flooder, stop)) for _ in range(4)] \
                    if state == "flooded" else []
                for c in clients:
                    c.start()
                time.sleep(1.0 if clients else 0.0)  # the flood fills the batch and the gateway's queue
                samples = [first_token(port, victim, f"{state} {r} {i}") for i in range(a.samples)]
                stop.set()
                for c in clients:
                    c.join()
                medians[state].append(statistics.median(samples))
                print(f"round {r} {state:>7}: time to first token p50 {medians[state][-1] * 1e3:7.1f} ms", flush=True)
        idle, flooded = statistics.median(medians["idle"]), statistics.median(medians["flooded"])
        cpu = cpu_name()
        print(f"\nCPU: {cpu}\nvictim time to first token: idle {idle * 1e3:.1f} ms, while another tenant floods "
              f"{flooded * 1e3:.1f} ms: {flooded / idle:.2f}x idle (target <= 2x)")
    finally:
        gateway.terminate()
        gateway.wait(30)
        srv.stop()
        redis.terminate()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
