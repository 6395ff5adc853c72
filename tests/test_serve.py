"""dstool export + serve: a generated Triton repository, loaded by a real Triton 2.51 (nvidia-pytriton's
binary), queried with the real tritonclient over HTTP and gRPC."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import dstool
from dstool.errors import UsageError
from dstool.serve import repository, triton
from dstool.train.launch import free_port


@pytest.fixture(scope="module")
def repo(trained, session_tmp) -> Path:
    path = session_tmp / "model_repository"
    dstool("export", str(trained), "--repository", str(path), "--max-batch-size", "8", "--instances", "1")
    return path


@pytest.fixture(scope="module")
def server(repo, session_tmp):
    binary = triton.find_tritonserver()
    srv = triton.start(repo, binary, free_port(), free_port(), free_port(), session_tmp / "triton.log")
    yield srv
    assert srv.stop() == 0  # a clean shutdown


def test_repository_layout_and_schema(repo):
    from tritonclient.grpc import model_config_pb2

    model = repo / "dstool_lm"
    assert sorted(p.name for p in (model / "1").iterdir()) == ["model.onnx", "model.onnx.data", "model.py"]
    cfg = repository.validate(model / "config.pbtxt", model / "1" / "model.onnx")
    assert cfg.backend == "python" and cfg.max_batch_size == 8
    assert cfg.instance_group[0].kind == model_config_pb2.ModelInstanceGroup.KIND_CPU
    assert list(cfg.dynamic_batching.preferred_batch_size) == [4, 8] and cfg.model_warmup
    assert all(t.allow_ragged_batch for t in cfg.input)  # mixed lengths batch together (the model pads)


def test_onnxruntime_platform_variant_validates(trained, tmp_path):
    dstool("export", str(trained), "--repository", str(tmp_path / "r"), "--backend", "onnxruntime",
           "--instances", "2", "--response-cache")
    cfg = repository.validate(tmp_path / "r" / "dstool_lm" / "config.pbtxt", tmp_path / "r" / "dstool_lm" / "1" / "model.onnx")
    assert cfg.platform == "onnxruntime_onnx" and cfg.instance_group[0].count == 2 and cfg.response_cache.enable


def test_config_that_disagrees_with_the_graph_is_refused(repo, tmp_path):
    model = repo / "dstool_lm"
    bad = tmp_path / "config.pbtxt"
    bad.write_text((model / "config.pbtxt").read_text().replace("TYPE_FP32", "TYPE_FP16"))
    with pytest.raises(UsageError, match="logits is TYPE_FP16"):
        repository.validate(bad, model / "1" / "model.onnx")
    bad.write_text((model / "config.pbtxt").read_text().replace('"attention_mask"', '"mask"'))
    with pytest.raises(UsageError, match="do not match the ONNX"):
        repository.validate(bad, model / "1" / "model.onnx")


def test_new_version_keeps_the_old_one(trained, tmp_path):
    r = tmp_path / "r"
    dstool("export", str(trained), "--repository", str(r))
    dstool("export", str(trained), "--repository", str(r))
    assert sorted(p.name for p in (r / "dstool_lm").iterdir()) == ["1", "2", "config.pbtxt"]


@pytest.mark.parametrize("args,needle", [
    (["--name", "bad name/x"], "not one Triton accepts"),
    (["--max-batch-size", "0"], "cannot be on"),
    (["--instances", "0"], "at least 1"),
])
def test_bad_export_options_leave_the_repository_untouched(trained, repo, args, needle):
    before = sorted(str(p) for p in repo.rglob("*"))
    proc = dstool("export", str(trained), "--repository", str(repo), *args, check=False)
    assert proc.returncode == 2 and needle in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert sorted(str(p) for p in repo.rglob("*")) == before


def test_bad_export_inputs(trained, tmp_path):
    (tmp_path / "file").write_text("x")
    (tmp_path / "noweights").mkdir()
    shutil.copy(trained / "config.json", tmp_path / "noweights" / "config.json")
    for args, needle in (([str(trained), "--repository", str(tmp_path / "file")], "is a file"),
                         ([str(tmp_path / "noweights"), "--repository", str(tmp_path / "r")], "has no weights")):
        proc = dstool("export", *args, check=False)
        assert proc.returncode == 2 and needle in proc.stderr, proc.stderr
    assert not (tmp_path / "r").exists()


def _ort_logits(repo: Path, ids: np.ndarray) -> np.ndarray:
    from dstool.onnx_export import ort_session, run_logits

    return run_logits(ort_session(repo / "dstool_lm" / "1" / "model.onnx"), ids)


def test_http_and_grpc_match_onnxruntime_and_pytorch(server, repo, trained):
    import tritonclient.grpc as grpc
    import tritonclient.http as http
    from transformers import AutoModelForCausalLM

    ids = np.array([[5, 17, 300, 42, 7, 99, 1000, 3]], dtype=np.int64)
    direct = _ort_logits(repo, ids)
    with torch.no_grad():
        torch_logits = AutoModelForCausalLM.from_pretrained(trained)(input_ids=torch.from_numpy(ids)).logits.numpy()
    for client, url in ((http, server.http_url), (grpc, server.grpc_url)):
        c = client.InferenceServerClient(url)
        assert c.is_server_live() and c.is_model_ready("dstool_lm")
        inputs = []
        for name, value in (("input_ids", ids), ("attention_mask", np.ones_like(ids))):
            t = client.InferInput(name, list(value.shape), "INT64")
            t.set_data_from_numpy(value)
            inputs.append(t)
        logits = c.infer("dstool_lm", inputs).as_numpy("logits")
        c.close()
        assert np.abs(logits - direct).max() < 1e-5
        assert np.abs(logits - torch_logits).max() < 1e-3


def test_dynamic_batching_under_concurrency(server, repo):
    import tritonclient.grpc.aio as grpc_aio
    import tritonclient.http as http

    async def load(n: int) -> list[np.ndarray]:
        client = grpc_aio.InferenceServerClient(server.grpc_url)

        async def one(i: int) -> np.ndarray:
            ids = np.array([[i % 50 + 1] * (6 + i % 5)], dtype=np.int64)
            inputs = [grpc_aio.InferInput("input_ids", list(ids.shape), "INT64"),
                      grpc_aio.InferInput("attention_mask", list(ids.shape), "INT64")]
            inputs[0].set_data_from_numpy(ids)
            inputs[1].set_data_from_numpy(np.ones_like(ids))
            return (await client.infer("dstool_lm", inputs)).as_numpy("logits")

        try:
            return await asyncio.gather(*(one(i) for i in range(n)))
        finally:
            await client.close()

    stats_client = http.InferenceServerClient(server.http_url)

    def counts():
        s = stats_client.get_inference_statistics("dstool_lm")["model_stats"][0]
        return s["inference_count"], s["execution_count"]

    try:
        inf0, exe0 = counts()
        results = asyncio.run(load(48))
        inf1, exe1 = counts()
    finally:
        stats_client.close()  # an open keep-alive connection would hold up Triton's shutdown
    assert inf1 - inf0 == 48
    assert exe1 - exe0 < 48  # requests were batched together
    ids = np.array([[3] * 8], dtype=np.int64)  # padded batching leaves each request's logits unchanged
    assert np.abs(results[2] - _ort_logits(repo, ids)).max() < 1e-4


def test_serve_reports_a_server_that_never_becomes_ready(tmp_path):
    bad = tmp_path / "repo" / "broken"
    (bad / "1").mkdir(parents=True)
    (bad / "config.pbtxt").write_text('name: "broken"\nbackend: "python"\nmax_batch_size: 0\n')  # no model.py
    proc = dstool("serve", "--repository", str(tmp_path / "repo"), "--http-port", str(free_port()), "--grpc-port",
                  str(free_port()), "--metrics-port", str(free_port()), "--log-file", str(tmp_path / "t.log"),
                  "--timeout", "60", check=False, timeout=180)
    assert proc.returncode == 2 and "last log lines" in proc.stderr, proc.stderr
