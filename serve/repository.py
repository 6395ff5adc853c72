"""Triton model repositories: generated from an ONNX export, validated with Triton's own protobuf schema
(`tritonclient.grpc.model_config_pb2`) and cross-checked against the ONNX graph before they are put in place."""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import onnx
from google.protobuf import text_format

from dstool.errors import UsageError

ONNX_TO_TRITON = {onnx.TensorProto.FLOAT: "TYPE_FP32", onnx.TensorProto.FLOAT16: "TYPE_FP16",
                  onnx.TensorProto.INT64: "TYPE_INT64", onnx.TensorProto.INT32: "TYPE_INT32",
                  onnx.TensorProto.BFLOAT16: "TYPE_BF16"}
NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
MODEL_PY = Path(__file__).with_name("triton_models") / "onnx_logits.py"


@dataclass
class ModelSettings:
    name: str
    version: int | None = None
    max_batch_size: int = 8
    instances: int = 1
    device: str = "cpu"
    backend: str = "python"  # python (runs onnxruntime inside) | onnxruntime (platform onnxruntime_onnx)
    dynamic_batching: bool = True
    queue_delay_us: int = 2000
    response_cache: bool = False


def check_settings(s: ModelSettings) -> None:
    if not NAME_RE.match(s.name) or s.name in (".", ".."):
        raise UsageError(f"model name '{s.name}' is not one Triton accepts: use letters, digits, '_', '-' and '.'")
    if s.max_batch_size < 0:
        raise UsageError("--max-batch-size must be 0 (no batching) or more")
    if s.max_batch_size == 0 and s.dynamic_batching:
        raise UsageError("--max-batch-size 0 disables batching, so dynamic batching cannot be on: "
                         "give a max batch size >= 1 or --no-dynamic-batching")
    if s.instances < 1:
        raise UsageError("--instances must be at least 1")
    if s.version is not None and s.version < 1:
        raise UsageError("--version must be 1 or more (Triton version folders are positive integers)")


def _graph_io(onnx_path: Path) -> tuple[list, list]:
    graph = onnx.load(str(onnx_path), load_external_data=False).graph
    inits = {i.name for i in graph.initializer}
    return [i for i in graph.input if i.name not in inits], list(graph.output)


def _dims(value, batched: bool) -> list[int]:
    dims = [d.dim_value if d.HasField("dim_value") else -1 for d in value.type.tensor_type.shape.dim]
    return dims[1:] if batched else dims


def config_text(s: ModelSettings, onnx_path: Path) -> str:
    """config.pbtxt for a logits model, with inputs/outputs read off the ONNX graph."""
    inputs, outputs = _graph_io(onnx_path)
    batched = s.max_batch_size > 0

    # The python model right-pads what the batcher hands it, so requests of different lengths may share a
    # batch (allow_ragged_batch); the ONNX Runtime backend needs equal shapes.
    ragged = " allow_ragged_batch: true" if s.backend == "python" and batched and s.dynamic_batching else ""

    def tensors(values, extra: str = "") -> str:
        return ",\n".join(f'  {{ name: "{v.name}" data_type: {ONNX_TO_TRITON[v.type.tensor_type.elem_type]} '
                          f'dims: [ {", ".join(map(str, _dims(v, batched)))} ]{extra} }}' for v in values)

    kind = "KIND_GPU" if s.device == "gpu" else "KIND_CPU"
    lines = [f'name: "{s.name}"',
             'backend: "python"' if s.backend == "python" else 'platform: "onnxruntime_onnx"',
             f"max_batch_size: {s.max_batch_size}",
             f"input [\n{tensors(inputs, ragged)}\n]", f"output [\n{tensors(outputs)}\n]",
             f"instance_group [ {{ count: {s.instances} kind: {kind} }} ]",
             "version_policy: { latest { num_versions: 1 } }"]
    if s.dynamic_batching:
        preferred = sorted({b for b in (max(1, s.max_batch_size // 2), s.max_batch_size) if b >= 1})
        lines.append(f"dynamic_batching {{ preferred_batch_size: [ {', '.join(map(str, preferred))} ] "
                     f"max_queue_delay_microseconds: {s.queue_delay_us} }}")
    if s.response_cache:
        lines.append("response_cache { enable: true }")
    warm_dims = "8" if batched else "1, 8"  # one 8-token sequence (the batch dimension is implicit when batched)
    lines.append("model_warmup [ {\n  name: \"warmup\" batch_size: 1\n" + "".join(
        f'  inputs {{ key: "{v.name}" value {{ data_type: {ONNX_TO_TRITON[v.type.tensor_type.elem_type]} '
        f'dims: [ {warm_dims} ] zero_data: true }} }}\n' for v in inputs) + "} ]")
    if s.backend == "python":
        lines.append('parameters { key: "onnx_file" value { string_value: "model.onnx" } }')
    return "\n".join(lines) + "\n"


def validate(config_path: Path, onnx_path: Path) -> object:
    """Parse with Triton's ModelConfig schema and check names, dtypes and shapes against the ONNX graph."""
    from tritonclient.grpc import model_config_pb2

    cfg = model_config_pb2.ModelConfig()
    try:
        text_format.Parse(config_path.read_text(), cfg)
    except text_format.ParseError as e:
        raise UsageError(f"{config_path} does not parse as a Triton ModelConfig: {e}") from None
    inputs, outputs = _graph_io(onnx_path)
    batched = cfg.max_batch_size > 0
    for declared, graph, what in ((cfg.input, inputs, "input"), (cfg.output, outputs, "output")):
        by_name = {v.name: v for v in graph}
        if {t.name for t in declared} != set(by_name):
            raise UsageError(f"{config_path}: {what}s {sorted(t.name for t in declared)} do not match the ONNX "
                             f"graph's {sorted(by_name)}")
        for t in declared:
            v = by_name[t.name]
            want_type = ONNX_TO_TRITON.get(v.type.tensor_type.elem_type)
            if model_config_pb2.DataType.Name(t.data_type) != want_type:
                raise UsageError(f"{config_path}: {what} {t.name} is {model_config_pb2.DataType.Name(t.data_type)}, "
                                 f"the ONNX graph says {want_type}")
            graph_dims = _dims(v, batched)
            if len(graph_dims) != len(t.dims) or any(g != -1 and g != d for g, d in zip(graph_dims, t.dims)):
                raise UsageError(f"{config_path}: {what} {t.name} dims {list(t.dims)} do not fit the ONNX shape "
                                 f"{graph_dims}")
    return cfg


def write_model(repository: Path, s: ModelSettings, onnx_path: Path) -> Path:
    """Add (or add a version of) model `s.name`: the new version is assembled and validated beside the
    repository, then renamed in; earlier versions stay until it validates."""
    check_settings(s)
    repository = Path(repository)
    if repository.exists() and not repository.is_dir():
        raise UsageError(f"repository {repository} is a file: pass a folder for --repository")
    model_dir = repository / s.name
    existing = sorted(int(p.name) for p in model_dir.iterdir() if p.name.isdigit()) if model_dir.is_dir() else []
    version = s.version or (existing[-1] + 1 if existing else 1)
    staging = repository.parent / f".{repository.name}.{s.name}.v{version}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    (staging / str(version)).mkdir(parents=True)
    for f in (onnx_path, Path(str(onnx_path) + ".data")):
        if f.exists():
            shutil.copy2(f, staging / str(version) / ("model.onnx" + f.name[len(onnx_path.name):]))
    if s.backend == "python":
        shutil.copy2(MODEL_PY, staging / str(version) / "model.py")
    (staging / "config.pbtxt").write_text(config_text(s, onnx_path))
    validate(staging / "config.pbtxt", onnx_path)
    model_dir.mkdir(parents=True, exist_ok=True)
    target = model_dir / str(version)
    if target.exists():
        shutil.rmtree(target)
    os.replace(staging / str(version), target)
    os.replace(staging / "config.pbtxt", model_dir / "config.pbtxt")
    shutil.rmtree(staging, ignore_errors=True)
    return target
