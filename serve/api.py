"""`export(...)`, `serve(...)`, `infer_ids(...)`: what `dstool export/serve/infer` do, callable from Python."""

from __future__ import annotations

import contextlib
import shutil
import signal
import tempfile
import threading
from pathlib import Path

import numpy as np
import torch

from dstool import models
from dstool.errors import UsageError
from dstool.onnx_export import export_decoder_model, export_logits_model
from dstool.serve import repository, triton
from dstool.serve.repository import ModelSettings


def _hf_folder(model_dir: Path) -> Path:
    hf_dir = model_dir / "model" if (model_dir / "model" / "config.json").is_file() else model_dir
    if not hf_dir.is_dir():
        raise UsageError(f"model {model_dir} is not a folder: pass a Hugging Face folder or a dstool compress output")
    models.check_model_folder(hf_dir)
    return hf_dir


def _compressed_graph(model_dir: Path) -> Path | None:
    """The quantized/pruned logits graph of a `dstool compress` output, if `model_dir` is one."""
    found = sorted((model_dir / "onnx").glob("model*.onnx")) if (model_dir / "onnx").is_dir() else []
    return found[0] if found else None


def _quantized_like(reference: Path, fp32: Path, out: Path) -> Path:
    """Quantize the decoder graph `fp32` as `dstool compress` quantized the logits graph `reference`: same
    format (int8 / 4-bit), and the weights compress kept in fp32 stay fp32 here too."""
    import onnx

    from dstool.compress import quantize

    graph = onnx.load(str(reference), load_external_data=False).graph
    ops = {n.op_type for n in graph.node}
    if "MatMulNBits" in ops:
        return quantize.quantize_int4(fp32, out)
    if not ops & {"MatMulInteger", "DynamicQuantizeMatMul"}:
        return fp32  # pruned / sparse only: the fp32 graph is the artefact
    choice = quantize.int8_choice_for_this_cpu()
    kept = set(_matmul_weights(reference, float_only=True).values())
    if kept:  # matched by content: the two graphs name their constants differently
        choice.excluded_nodes = [node for node, digest in _matmul_weights(fp32).items() if digest in kept]
    return quantize.quantize_int8(fp32, out, choice)


def _matmul_weights(onnx_path: Path, float_only: bool = False) -> dict[str, str]:
    """MatMul node name -> sha256 of its weight initializer (fp32 weights only with `float_only`)."""
    import hashlib

    import onnx
    from onnx import numpy_helper

    graph = onnx.load(str(onnx_path)).graph
    weights = {i.name: i for i in graph.initializer if not float_only or i.data_type == onnx.TensorProto.FLOAT}
    return {n.name: hashlib.sha256(numpy_helper.to_array(weights[n.input[1]]).tobytes()).hexdigest()
            for n in graph.node if n.op_type == "MatMul" and n.input[1:2] and n.input[1] in weights}


def export(model_dir: str, repo: str, settings: ModelSettings, echo=print) -> dict[str, Path]:
    """Write a new version of model `settings.name` (token ids -> logits) and of its text-generation models
    (tokenizer, key/value-cache decoder, detokenizer, `NAME_generate`) into the Triton repository `repo`;
    returns each model's new version folder."""
    from transformers import AutoModelForCausalLM

    repository.check_settings(settings)
    repo_path = Path(repo)
    if repo_path.exists() and not repo_path.is_dir():
        raise UsageError(f"repository {repo} is a file: pass a folder for --repository")
    source = Path(model_dir)
    hf_dir = _hf_folder(source)
    work = Path(tempfile.mkdtemp(prefix="dstool-export-"))
    try:
        model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        compressed = _compressed_graph(source)
        echo("dstool export: ONNX logits model" + (f" (compressed: {compressed.name})" if compressed else ""))
        logits = compressed or export_logits_model(model, work / "logits").path
        echo("dstool export: ONNX decoder with key/value cache (parity-checked on prefill and decoding steps)")
        decoder = export_decoder_model(model, work / "decoder").path
        if compressed:
            decoder = _quantized_like(compressed, decoder, work / "decoder" / "model.quantized.onnx")
        eos = model.generation_config.eos_token_id
        placed = repository.write_repository(repo_path, settings, repository.Artefacts(
            logits_onnx=logits, decoder_onnx=decoder, tokenizer_dir=hf_dir,
            eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
            max_positions=int(model.config.max_position_embeddings)))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    echo(f"dstool export: {repo_path} version {placed['logits'].name} of {', '.join(p.parent.name for p in placed.values())} "
         f"({settings.backend} backend, max_batch_size {settings.max_batch_size}, {settings.instances} instance(s); "
         f"every config validated against Triton's schema and the ONNX graphs)")
    return placed


def serve(repo: str, http_port: int, grpc_port: int, metrics_port: int, tritonserver: str | None,
          log_file: str, timeout: float, echo=print, cache_config: str | None = None) -> int:
    """Start Triton on `repo` (with `cache_config` as tritonserver --cache-config), wait until ready, block until
    Ctrl-C/SIGTERM, stop it cleanly."""
    if not Path(repo).is_dir():
        raise UsageError(f"repository {repo} does not exist: run dstool export first")
    binary = triton.find_tritonserver(tritonserver)
    server = triton.start(Path(repo), binary, http_port, grpc_port, metrics_port, Path(log_file),
                          cache_config=cache_config, timeout=timeout)
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
    client = _tritonclient(protocol)
    arr = np.asarray([ids], dtype=np.int64)  # [1, seq]: a batch of one, batched model or not
    inputs = []
    for name in ("input_ids", "attention_mask"):
        t = client.InferInput(name, list(arr.shape), "INT64")
        t.set_data_from_numpy(arr if name == "input_ids" else np.ones_like(arr))
        inputs.append(t)
    with _client(client, url) as c:
        result = c.infer(model, inputs, outputs=[client.InferRequestedOutput("logits")])
    return result.as_numpy("logits")[0]


def generate_text(url: str, protocol: str, model: str, prompt: str, max_new_tokens: int | None = None,
                  use_kv_cache: bool = True) -> tuple[str, list[int]]:
    """Send `prompt` to the text-generation entry point `MODEL_generate` with tritonclient; returns the
    generated text and its token ids."""
    client = _tritonclient(protocol)
    values = {"text_input": np.array([[prompt.encode("utf-8")]], dtype=np.object_)}  # [batch 1, 1]
    if max_new_tokens is not None:
        values["max_new_tokens"] = np.array([[max_new_tokens]], dtype=np.int32)
    if not use_kv_cache:
        values["use_kv_cache"] = np.array([[False]])
    inputs = []
    for name, value in values.items():
        inputs.append(client.InferInput(name, list(value.shape), {np.object_: "BYTES", np.int32: "INT32",
                                                                   np.bool_: "BOOL"}[value.dtype.type]))
        inputs[-1].set_data_from_numpy(value)
    with _client(client, url) as c:
        result = c.infer(repository.model_names(model)["generate"], inputs)
    return result.as_numpy("text_output")[0, 0].decode("utf-8"), result.as_numpy("output_ids")[0].tolist()


def _tritonclient(protocol: str):
    """tritonclient.grpc or tritonclient.http."""
    import importlib

    return importlib.import_module("tritonclient.grpc" if protocol == "grpc" else "tritonclient.http")


@contextlib.contextmanager
def _client(client, url: str):
    """A tritonclient client for `url`; a server that does not answer or refuses the request is a one-line error."""
    from tritonclient.utils import InferenceServerException

    c = client.InferenceServerClient(url)
    try:
        yield c
    except InferenceServerException as e:
        raise UsageError(f"Triton at {url}: {e.message().splitlines()[0] if e.message() else e} "
                         "(is `dstool serve` running, and is the model exported?)") from None
    except (ConnectionError, OSError) as e:
        raise UsageError(f"no Triton answers at {url} ({e}): start one with `dstool serve`") from None
    finally:
        c.close()
