"""`dstool pipeline` end to end on the real components: DeepSpeed (2 ranks), compress, export, a real Triton
behind the cache gateway with a real Redis, tritonclient over HTTP and gRPC."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time

import pytest

from dstool.proc import free_port

from conftest import cli, dstool


@pytest.fixture
def redis_url(tmp_path):
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server is not installed: run `bash scripts/setup.sh` (or apt-get install redis-server)")
    port = free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            time.sleep(0.1)
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(timeout=10)


@pytest.mark.slow
def test_pipeline_runs_end_to_end(tmp_path, redis_url):
    proc = dstool("pipeline", "--output", str(tmp_path / "run"), "--repository", str(tmp_path / "repo"),
                  "--train-steps", "20", "--recover-steps", "0", "--prune-ppl-tolerance", "0", "--cache", redis_url,
                  "--max-new-tokens", "8", "--latency-repeats", "3",
                  "--http-port", str(free_port()), "--grpc-port", str(free_port()), "--metrics-port", str(free_port()),
                  timeout=1200)
    out = proc.stdout
    for step in ("1/8 train", "2/8 compress", "3/8 export", "4/8 serve", "5/8 infer", "6/8 stream", "7/8 report",
                 "8/8 shutdown"):
        assert f"[pipeline {step}]" in out
    assert "| int8 |" in out and "| prune 0.3 |" in out
    # each of 3 prompts: computed once, then 2 hits; the streamed chat: computed, then a hit
    assert "cache: 7 hits, 4 misses, hit rate 64%" in out
    assert out.count("' -> '") == 4 and "[pipeline] done" in out
    assert (tmp_path / "repo" / "dstool_lm_generate" / "1" / "model.py").is_file()
    # One voice: the step lines and their results (indented), nothing from other libraries; they are in the log.
    assert proc.stderr == "", proc.stderr
    assert all(line.startswith(("[pipeline", "    ")) for line in out.splitlines()), out
    assert len(out.splitlines()) < 40, out
    log = (tmp_path / "run" / "pipeline.log").read_text()
    assert "torch.onnx" in log and "step 20 loss" in (tmp_path / "run" / "train" / "logs" / "rank0.log").read_text()
    summary = json.loads((tmp_path / "run" / "pipeline.json").read_text())
    assert [s["status"] for s in summary["steps"]] == ["passed"] * 8
    assert len(summary["stream"]["pieces"]) > 1  # token by token


def test_pipeline_refuses_a_busy_port_before_training(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = cli("pipeline", "--output", str(tmp_path / "run"), "--http-port", str(port))
    assert result.returncode == 2 and "already in use" in result.stderr and not (tmp_path / "run").exists()


@pytest.mark.parametrize("flags, named", [
    (["--model", "smollm2", "--prune-ppl-tolerance", "0"], "prune_ppl_tolerance"),
    (["--model", "smollm2", "--recover-steps", "3"], "recover_steps"),
    (["--lora", "8"], "lora"),
])
def test_a_flag_of_the_other_kind_of_run_is_refused(tmp_path, flags, named):
    """The pruned variant's flags mean nothing to a real model's run, --lora nothing to the tiny one's: exit 2
    naming them, before anything runs."""
    result = cli("pipeline", "--output", str(tmp_path / "run"), *flags)
    assert result.returncode == 2 and named in result.stderr and len(result.stderr.strip().splitlines()) == 1, \
        result.stderr
    assert not (tmp_path / "run").exists()
