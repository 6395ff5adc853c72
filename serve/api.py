"""`export(...)`, `serve(...)`, `infer_ids(...)`: what `dstool export/serve/infer` do, callable from Python."""

from __future__ import annotations

import shutil
import signal
import tempfile
import threading
from pathlib import Path

import numpy as np
import torch

from dstool import models
from dstool.errors import UsageError
from dstool.onnx_export import export_logits_model
from dstool.serve import repository, triton
from dstool.serve.repository import ModelSettings


def _onnx_of(model_dir: Path, work: Path) -> Path:
    """The model's fp32 ONNX (parity-checked), or the quantized graph of a `dstool compress` output."""
    from transformers import AutoModelForCausalLM

    compressed = sorted((model_dir / "onnx").glob("model*.onnx")) if (model_dir / "onnx").is_dir() else []
    if compressed:
        return compressed[0]
    hf_dir = model_dir / "model" if (model_dir / "model" / "config.json").is_file() else model_dir
    if not hf_dir.is_dir():
        raise UsageError(f"model {model_dir} is not a folder: pass a Hugging Face folder or a dstool compress output")
    models.check_model_folder(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    return export_logits_model(model, work / "onnx").path


def export(model_dir: str, repo: str, settings: ModelSettings, echo=print) -> Path:
    """Write model `settings.name` (a new version) into the Triton repository `repo`; returns the version folder."""
    repository.check_settings(settings)
    repo_path = Path(repo)
    if repo_path.exists() and not repo_path.is_dir():
        raise UsageError(f"repository {repo} is a file: pass a folder for --repository")
    work = Path(tempfile.mkdtemp(prefix="dstool-export-"))
    try:
        onnx_path = _onnx_of(Path(model_dir), work)
        target = repository.write_model(repo_path, settings, onnx_path)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    echo(f"dstool export: {target} ({settings.backend} backend, max_batch_size {settings.max_batch_size}, "
         f"{settings.instances} instance(s), config validated against Triton's schema and the ONNX graph)")
    return target


def serve(repo: str, http_port: int, grpc_port: int, metrics_port: int, tritonserver: str | None,
          log_file: str, timeout: float, echo=print) -> int:
    """Start Triton on `repo`, wait until ready, block until Ctrl-C/SIGTERM, stop it cleanly."""
    if not Path(repo).is_dir():
        raise UsageError(f"repository {repo} does not exist: run dstool export first")
    binary = triton.find_tritonserver(tritonserver)
    server = triton.start(Path(repo), binary, http_port, grpc_port, metrics_port, Path(log_file), timeout=timeout)
    echo(f"dstool serve: Triton ready — HTTP {server.http_url}, gRPC {server.grpc_url}, metrics "
         f"127.0.0.1:{metrics_port}; log: {log_file}; Ctrl-C to stop")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.is_set() and server.proc.poll() is None:
        stop.wait(0.5)
    code = server.stop()
    echo(f"dstool serve: Triton stopped (exit code {code})")
    return 0


def infer_ids(url: str, protocol: str, model: str, ids: list[int]) -> np.ndarray:
    """Send token ids to the tensor model with tritonclient; returns logits [seq, vocab]."""
    if protocol == "grpc":
        import tritonclient.grpc as client
    else:
        import tritonclient.http as client
    c = client.InferenceServerClient(url)
    config = c.get_model_config(model, as_json=True)["config"] if protocol == "grpc" else c.get_model_config(model)
    batched = int(config.get("max_batch_size", 0)) > 0
    arr = np.asarray([ids] if batched else ids, dtype=np.int64)
    inputs = []
    for name in ("input_ids", "attention_mask"):
        t = client.InferInput(name, list(arr.shape), "INT64")
        t.set_data_from_numpy(arr if name == "input_ids" else np.ones_like(arr))
        inputs.append(t)
    result = c.infer(model, inputs, outputs=[client.InferRequestedOutput("logits")])
    logits = result.as_numpy("logits")
    return logits[0] if batched else logits
