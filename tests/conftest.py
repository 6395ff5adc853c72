"""Shared helpers and the expensive artefacts the tests share: a trained model, its int8 compress output, an
exported repository and a real Triton serving it (each made once per session)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

DSTOOL = [sys.executable, "-m", "dstool.cli"]
# Small but real: 2 DeepSpeed ranks over gloo, the tiny preset, short sequences.
FAST = ["--seq-len", "64", "--micro-batch-size", "4", "--log-every", "1", "--no-tensorboard"]


def dstool(*args: str, timeout: float = 600, check: bool = True,
           cwd: Path | None = None) -> subprocess.CompletedProcess:
    """The real `dstool` CLI in its own process, as a user runs it."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run([*DSTOOL, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
    if check and proc.returncode != 0:
        raise AssertionError(f"dstool {' '.join(args)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}"
                             f"\n--- stderr\n{proc.stderr[-6000:]}")
    return proc


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


def cli(*args: str) -> Result:
    """`dstool.cli.main` in this process (for bad-input cases, where no process boundary is under test); its
    logging setup is undone when it returns (`dstool.log.shutdown`)."""
    from dstool.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return Result(code, out.getvalue(), err.getvalue())


def one_line_usage_error(result: Result, needle: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("dstool: error:") and needle in lines[0], result.stderr


def losses(output: Path) -> dict[int, float]:
    """Per-step training loss from metrics.jsonl (a resumed run's later rows win)."""
    rows = [json.loads(line) for line in (Path(output) / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


@pytest.fixture(scope="session")
def session_tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("dstool")


@pytest.fixture(scope="session")
def trained(session_tmp) -> Path:
    """A tiny-preset model trained 40 steps by `dstool train` (1 rank): the input of compress and export."""
    out = session_tmp / "trained_tiny"
    dstool("train", "--output", str(out), "--nproc", "1", "--zero", "0", "--max-steps", "40", "--save-every", "40",
           "--lr", "3e-3", *FAST)
    return out / "model"


@pytest.fixture(scope="session")
def int8_output(trained, session_tmp) -> Path:
    """`trained` quantized to int8 through the Python API (both graphs, one recipe; no speed gate: that is opt-in)."""
    from dstool.compress import quantize_dynamic

    out = session_tmp / "int8"
    quantize_dynamic(str(trained), str(out), bits=8, latency_repeats=5)
    return out


@pytest.fixture(scope="session")
def repo(trained, session_tmp) -> Path:
    """`trained` exported (fp32, both graphs parity-checked) by `dstool export`."""
    path = session_tmp / "model_repository"
    dstool("export", str(trained), "--repository", str(path), "--max-batch-size", "8", "--instances", "1")
    return path


@pytest.fixture(scope="session")
def server(repo, session_tmp):
    """A real Triton 2.51 serving `repo` (all five models)."""
    from dstool.proc import free_port
    from dstool.serve.runtime import triton

    srv = triton.start(repo, triton.find_tritonserver(), free_port(), free_port(), free_port(),
                       session_tmp / "triton.log")
    yield srv
    code = srv.stop()
    assert code == 0, f"Triton exited {code} on SIGTERM; its log ends:\n{srv.log_tail(30)}"


@pytest.fixture(scope="session")
def gateway_repo(repo, session_tmp) -> Path:
    """What the gateway tests serve: the exported tensor model (what the cache serves; fewer models start faster)
    and our own small python-backend models (echo, slow, failing, decoupled streaming)."""
    from gatewaylib import write_test_models

    path = session_tmp / "gateway_repository"
    shutil.copytree(repo / "dstool_lm", path / "dstool_lm")
    write_test_models(path)
    return path


@pytest.fixture(scope="session")
def gateway_server(gateway_repo, session_tmp):
    """A real Triton on `gateway_repo`, models loaded explicitly (so tests can load new versions)."""
    from dstool.proc import free_port
    from dstool.serve.runtime import triton

    srv = triton.start(gateway_repo, triton.find_tritonserver(), free_port(), free_port(), free_port(),
                       session_tmp / "gateway-triton.log",
                       extra_args=["--model-control-mode=explicit", "--load-model=*",
                                   "--http-header-forward-pattern", "^x-fwd-.*",
                                   "--grpc-header-forward-pattern", "^x-fwd-.*"])
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def redis_server(session_tmp):
    from gatewaylib import RedisServer

    r = RedisServer(session_tmp / "redis-main")
    yield r
    r.stop()


@pytest.fixture(scope="session")
def gateway(gateway_server, redis_server, session_tmp):
    """`dstool gateway` in front of `gateway_server`, caching in `redis_server`."""
    from gatewaylib import GatewayProcess

    gw = GatewayProcess(session_tmp / "gateway-main.log",
                        argv=["--upstream", gateway_server.http_url, "--upstream-grpc", gateway_server.grpc_url,
                              "--cache", redis_server.url, "--cache-ttl", "600", "--max-request-bytes", str(1 << 20),
                              "--version-check-interval", "0.5"])
    yield gw
    gw.stop()


@pytest.fixture(scope="session")
def llm_gateway(server, redis_server, session_tmp):
    """`dstool gateway` with the Redis cache in front of `server` (every exported model): the LLM routes' tests."""
    from gatewaylib import GatewayProcess

    gw = GatewayProcess(session_tmp / "gateway-llm.log",
                        config={"upstreams": [server.http_url], "upstreams_grpc": [server.grpc_url],
                                "cache": redis_server.url})
    yield gw
    gw.stop()
