"""`dstool serve --cache` keeps what it runs alive, on the real processes: the gateway process killed with SIGSEGV is
started again; a python-backend stub killed with SIGSEGV is named in a line and its model loaded again, requests
meanwhile answered 503 / UNAVAILABLE (never the client's 400); `dstool serve` itself killed with SIGKILL leaves no
Triton, stub or shared-memory region behind. One `dstool serve` for the module, the tests in order."""

from __future__ import annotations

import os
import queue
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil
import pytest

from dstool.proc import free_port

from conftest import DSTOOL
from gatewaylib import wait_for
from llmlib import error_of, post

COMPLETION = {"model": "dstool_lm", "prompt": "ROMEO:", "max_tokens": 4}


@dataclass
class Served:
    proc: subprocess.Popen
    http_port: int
    grpc_port: int
    out: Path

    def log(self) -> str:
        return self.out.read_text()

    def listener(self) -> psutil.Process:
        """The process answering on the HTTP port (the gateway's)."""
        pids = {c.pid for c in psutil.net_connections("tcp")
                if c.status == psutil.CONN_LISTEN and c.laddr.port == self.http_port and c.pid}
        assert len(pids) == 1, pids
        return psutil.Process(pids.pop())

    def triton(self) -> psutil.Process:
        found = [p for p in psutil.Process(self.proc.pid).children() if p.name() == "tritonserver"]
        assert len(found) == 1, found
        return found[0]

    def stub(self, model: str) -> psutil.Process:
        for p in self.triton().children():
            if p.status() != psutil.STATUS_ZOMBIE and f"/{model}/" in " ".join(p.cmdline()):
                return p
        raise AssertionError(f"no stub process runs {model}")


def start_serve(repo: Path, models: tuple[str, ...], folder: Path, *options: str) -> Served:
    """`dstool serve OPTIONS` on a copy of `models` of `repo`, as a user starts it, once it says it is ready."""
    for model in models:
        shutil.copytree(repo / model, folder / "repo" / model)
    http_port, grpc_port, out = free_port(), free_port(), folder / "serve.out"
    with open(out, "w") as sink:
        proc = subprocess.Popen([*DSTOOL, "serve", "--repository", str(folder / "repo"), "--http-port", str(http_port),
                                 "--grpc-port", str(grpc_port), "--metrics-port", str(free_port()), "--log-file",
                                 str(folder / "triton.log"), *options],
                                stdout=sink, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    served = Served(proc, http_port, grpc_port, out)
    ready = "gateway: ready" if "--cache" in options else "Triton ready"
    wait_for(lambda: ready in served.log() or proc.poll() is not None, "dstool serve to be ready", 180)
    assert proc.poll() is None, served.log()
    return served


@pytest.fixture(scope="module")
def served(repo, redis_server, tmp_path_factory):
    """`dstool serve` on the tensor model and NAME_llm (it holds its fused decoder: it needs no other model), behind
    the gateway."""
    served = start_serve(repo, ("dstool_lm", "dstool_lm_llm"), tmp_path_factory.mktemp("supervised"), "--cache",
                         redis_server.url, "--shutdown-grace", "0")
    try:
        yield served
    finally:
        if served.proc.poll() is None:
            served.proc.send_signal(signal.SIGTERM)
            served.proc.wait(60)


def test_a_gateway_killed_by_sigsegv_is_started_again(served):
    gateway, triton = served.listener(), served.triton()
    assert gateway.pid != served.proc.pid  # a crash of the gateway is not one of its supervisor
    started = time.monotonic()
    gateway.send_signal(signal.SIGSEGV)
    wait_for(lambda: f"the gateway process (pid {gateway.pid}) died of SIGSEGV; starting another" in served.log(),
             "a line naming the gateway and its signal")
    wait_for(lambda: _ready(served.http_port), "the gateway to answer again", 30)
    print(f"the gateway answered again {time.monotonic() - started:.2f} s after SIGSEGV")
    assert served.listener().pid != gateway.pid and served.triton().pid == triton.pid  # Triton kept, not orphaned
    status, _, body = post(served.http_port, "/v1/completions", COMPLETION)
    assert status == 200, body


def test_b_a_stub_killed_by_sigsegv_is_loaded_again_and_meanwhile_503(served):
    import tritonclient.grpc as grpc

    for model in ("dstool_lm_llm", "dstool_lm"):
        served.stub(model).send_signal(signal.SIGSEGV)
    answers: dict[str, object] = {}
    seed = int(time.time() * 1000) % 1000  # inputs the cache has not seen
    ids = {"inputs": [{"name": "input_ids", "shape": [1, 3], "datatype": "INT64", "data": [seed, 7, 11]},
                      {"name": "attention_mask", "shape": [1, 3], "datatype": "INT64", "data": [1, 1, 1]}]}

    def grpc_stream() -> object:
        client, results = grpc.InferenceServerClient(f"127.0.0.1:{served.grpc_port}"), queue.Queue()
        text = grpc.InferInput("text_input", [1], "BYTES")
        text.set_data_from_numpy(np.array([b"ROMEO:"], dtype=np.object_))
        client.start_stream(callback=lambda result, error: results.put(error))
        client.async_stream_infer("dstool_lm_llm", [text])
        try:
            error = results.get(timeout=60)
            return None if error is None else error.status()
        finally:
            client.stop_stream()
            client.close()

    def grpc_infer() -> object:
        client = grpc.InferenceServerClient(f"127.0.0.1:{served.grpc_port}")
        inputs = [grpc.InferInput(name, [1, 3], "INT64") for name in ("input_ids", "attention_mask")]
        inputs[0].set_data_from_numpy(np.array([[seed, 7, 12]], np.int64))
        inputs[1].set_data_from_numpy(np.ones((1, 3), np.int64))
        try:
            client.infer("dstool_lm", inputs)
            return None
        except Exception as e:  # noqa: BLE001 (its status is the answer)
            return e.status()
        finally:
            client.close()

    calls = {"openai": lambda: post(served.http_port, "/v1/completions", COMPLETION),
             "generate": lambda: post(served.http_port, "/v2/models/dstool_lm_llm/generate",
                                      {"text_input": "ROMEO:", "max_new_tokens": 4}),
             "kserve": lambda: post(served.http_port, "/v2/models/dstool_lm/infer", ids),
             "grpc stream": grpc_stream, "grpc infer": grpc_infer}
    threads = [threading.Thread(target=lambda n=n, f=f: answers.__setitem__(n, f())) for n, f in calls.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    # Each request met the dead stub (503 / UNAVAILABLE) or, sent once the new one was loading, waited for it.
    outcomes = {name: _outcome(answer) for name, answer in answers.items()}
    assert len(outcomes) == len(calls) and set(outcomes.values()) <= {"down", "served"}, outcomes
    assert "down" in outcomes.values(), outcomes
    for model in ("dstool_lm_llm", "dstool_lm"):
        wait_for(lambda m=model: f"dstool serve: model {m} is loaded again" in served.log(), f"{model} again", 60)
        assert f"the stub process of model {model} (pid " in served.log()
        assert f"instance {model}_0_0) died of SIGSEGV; loading {model} again" in served.log()
    status, _, body = post(served.http_port, "/v1/completions", COMPLETION)
    assert status == 200, body
    assert post(served.http_port, "/v2/models/dstool_lm/infer", ids)[0] == 200
    assert _ready(served.http_port) and served.proc.poll() is None


def test_c_killed_by_sigkill_it_leaves_nothing_behind(served):
    """Even right after a stub died (its shared memory left to remove), with nothing of `dstool serve` left to act."""
    triton = served.triton()
    left = [triton, *triton.children(), *psutil.Process(served.proc.pid).children()]
    regions = f"dstool_triton_{served.proc.pid}_*"
    assert list(Path("/dev/shm").glob(regions))
    served.stub("dstool_lm").send_signal(signal.SIGSEGV)
    served.proc.kill()
    served.proc.wait()

    def gone() -> bool:
        return not any(_running(p) for p in left) and not list(Path("/dev/shm").glob(regions))
    wait_for(gone, "Triton, its stubs and their shared memory to be gone", 30)


def test_d_a_model_that_cannot_be_loaded_again_ends_serve_with_exit_1(repo, tmp_path):
    """Without the gateway too: the model's files broken after it was loaded, then its stub killed."""
    served = start_serve(repo, ("dstool_lm",), tmp_path)
    try:
        triton = served.triton()
        (tmp_path / "repo" / "dstool_lm" / "1" / "model.py").write_text("raise RuntimeError('broken on purpose')\n")
        stub = served.stub("dstool_lm")
        stub.send_signal(signal.SIGSEGV)
        assert served.proc.wait(60) == 1, served.log()
    finally:
        if served.proc.poll() is None:
            served.proc.kill()
    log = served.log()
    assert f"the stub process of model dstool_lm (pid {stub.pid}, instance dstool_lm_0_0) died of SIGSEGV" in log
    assert "model dstool_lm could not be loaded again after its stub process died: Triton answered 400" in log
    assert "broken on purpose" in log and not _running(triton)


def _outcome(answer) -> object:
    """"down": a 503 naming the dead stub, or gRPC UNAVAILABLE; "served": a success; else the answer itself."""
    if answer is None:
        return "served"
    if answer == "StatusCode.UNAVAILABLE":
        return "down"
    if isinstance(answer, tuple) and answer[0] == 200:
        return "served"
    if isinstance(answer, tuple) and answer[0] == 503 and "is not healthy" in error_of(answer[2]):
        return "down"
    return answer


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _ready(port: int) -> bool:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", "/v2/health/ready")
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()
