"""What the LLM-surface tests share: raw HTTP against the gateway or Triton, the engine's counters from Triton's
/metrics and statistics, the python-backend process that holds a model, and an engine run to its end."""

from __future__ import annotations

import http.client
import json
import socket
import time
import urllib.request

import psutil


def post(port: int, path: str, body, headers: dict | None = None, timeout: float = 120) -> tuple[int, dict, bytes]:
    """(status, lower-cased headers, body) of one POST; `body` a dict/list (sent as JSON) or bytes."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, data, {"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def error_of(body: bytes) -> str:
    """The message of an error answer, KServe's {"error": "..."} or OpenAI's {"error": {"message": ...}}."""
    try:
        e = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return body.decode(errors="replace")
    return e["message"] if isinstance(e, dict) else str(e)


def sse_events(body: bytes) -> list[dict | str]:
    """The JSON objects of a server-sent event stream ("[DONE]" as the string)."""
    out: list[dict | str] = []
    for event in body.split(b"\n\n"):
        if event.startswith(b"data: "):
            payload = event[len(b"data: "):]
            out.append(payload.decode() if payload == b"[DONE]" else json.loads(payload))
    return out


def raw_request(port: int, path: str, body: dict) -> socket.socket:
    """A POST written on a raw socket (the caller reads, or hangs up, as it likes)."""
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
              % (path.encode(), len(data)) + data)
    return s


def llm_metrics(server) -> dict[str, float]:
    """dstool_lm_llm's dstool_llm_* figures on Triton's /metrics, by their full name with labels."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("dstool_llm_") and 'model="dstool_lm_llm"' in line}


def metric(server, name: str) -> float:
    """A counter or gauge of dstool_lm_llm on Triton's /metrics (its label sets summed)."""
    return sum(v for k, v in llm_metrics(server).items() if k.startswith(name + "{"))


def generated(server) -> float:
    return metric(server, "dstool_llm_generated_tokens_total")


def cancelled(server) -> float:
    return metric(server, "dstool_llm_cancelled_total")


def settled_generated(server, quiet: float = 0.6, limit: float = 60) -> float:
    """The engine's generated-token count once it stops moving (nothing left running)."""
    deadline = time.monotonic() + limit
    last = generated(server)
    while time.monotonic() < deadline:
        time.sleep(quiet)
        now = generated(server)
        if now == last:
            return now
        last = now
    raise AssertionError(f"the engine kept generating for {limit} s")


def executions(server, model: str, expect: int | None = None) -> int:
    """Requests Triton's `model` has taken (those it answered and those it failed). Triton counts a request when it
    releases it, which can be just after its answer reached the client: with `expect`, the count is read again for up
    to 2 s until it is that number (more never becomes fewer, so a count above it is returned at once)."""
    deadline = time.monotonic() + 2
    while True:
        count = _executions(server, model)
        if expect is None or count >= expect or time.monotonic() > deadline:
            return count
        time.sleep(0.02)


def _executions(server, model: str) -> int:
    conn = http.client.HTTPConnection(*server.http_url.split(":"), timeout=30)
    conn.request("GET", f"/v2/models/{model}/stats")
    stats = json.loads(conn.getresponse().read())["model_stats"][0]["inference_stats"]
    conn.close()
    return int(stats["success"]["count"]) + int(stats["fail"]["count"])


def stub_process(server, model: str) -> psutil.Process:
    """The python-backend stub process that runs `model` inside `server`."""
    for child in psutil.Process(server.proc.pid).children(recursive=True):
        try:
            if any(f"{model}_0_0" in part for part in child.cmdline()):
                return child
        except psutil.NoSuchProcess:
            continue
    raise AssertionError(f"no python-backend process runs {model}")


def timed_chat(port: int, content: str = "Speak, Juliet.", headers: dict | None = None) -> float:
    """Seconds a short greedy chat takes (asked not to come from the cache)."""
    started = time.monotonic()
    status, _, body = post(port, "/v1/chat/completions",
                           {"model": "dstool_lm", "messages": [{"role": "user", "content": content}],
                            "max_tokens": 8, "temperature": 0},
                           {"Cache-Control": "no-cache", **(headers or {})})
    assert status == 200, body
    return time.monotonic() - started


def llm_requests(server) -> int:
    """Requests Triton's dstool_lm_llm has taken."""
    conn = http.client.HTTPConnection(*server.http_url.split(":"), timeout=30)
    conn.request("GET", "/v2/models/dstool_lm_llm/stats")
    stats = json.loads(conn.getresponse().read())
    conn.close()
    return int(stats["model_stats"][0]["inference_stats"]["success"]["count"])


def llm_module(monkeypatch):
    """NAME_llm's model.py imported outside Triton: the python backend's module a small fake, the files beside it
    (the decoding package, ort_options) dstool's own."""
    import importlib
    import sys
    import types

    from dstool import decoding
    from dstool.decoding import engine, grammar, sampling
    from dstool.serve.triton_models import ort_options

    fake = types.SimpleNamespace(TRITONSERVER_RESPONSE_COMPLETE_FINAL=1,
                                 Logger=types.SimpleNamespace(log_error=lambda message: None))
    for name, module in {"triton_python_backend_utils": fake, "decoding": decoding, "decoding.engine": engine,
                         "decoding.sampling": sampling, "decoding.grammar": grammar,
                         "ort_options": ort_options}.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.delitem(sys.modules, "dstool.serve.triton_models.llm", raising=False)
    return importlib.import_module("dstool.serve.triton_models.llm")


def sequences_left(server, seconds: float = 60) -> float:
    """Sequences in the engine (waiting and running), read until there are none for up to `seconds` (the gauge is set
    after a step's last response went out): what the work before left in the engine, 0 when it left nothing. A test
    asks this, not how fast the next request is answered, to know that the engine was left as it was: a machine's
    load slows every request, a sequence left behind is there however fast the machine."""
    deadline = time.monotonic() + seconds
    while True:
        left = metric(server, "dstool_llm_sequences")
        if left == 0 or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def cpu_seconds(process: psutil.Process, wall: float = 2.0) -> float:
    """CPU seconds `process` (all its threads) used over `wall` seconds: near 0 for a process that is idle however
    loaded the machine is; a process that spins on work left behind uses what the machine gives it."""
    before = process.cpu_times()
    time.sleep(wall)
    after = process.cpu_times()
    return (after.user + after.system) - (before.user + before.system)


def run_to_end(engine, sequences: list) -> list[list[int]]:
    """Each of `sequences`' tokens, all added to `engine` together and run until none is left (none may fail)."""
    for s in sequences:
        engine.add(s)
    while engine.busy:
        for s, token in engine.step():
            assert token is not None, s.error
    return [s.output for s in sequences]
