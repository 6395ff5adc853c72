"""Triton model repositories: generated from an ONNX export, validated with Triton's own protobuf schema
(`tritonclient.grpc.model_config_pb2`) and cross-checked against the ONNX graph before they are put in place."""

from __future__ import annotations

import json
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
MODELS_PY = Path(__file__).with_name("triton_models")


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


def _tensors(values, batched: bool, extra: str = "") -> str:
    return ",\n".join(f'  {{ name: "{v.name}" data_type: {ONNX_TO_TRITON[v.type.tensor_type.elem_type]} '
                       f'dims: [ {", ".join(map(str, _dims(v, batched)))} ]{extra} }}' for v in values)


def _common(name: str, s: ModelSettings, backend_line: str, max_batch_size: int, dynamic_batching: bool) -> list[str]:
    kind = "KIND_GPU" if s.device == "gpu" and "onnxruntime" in backend_line else "KIND_CPU"
    lines = [f'name: "{name}"', backend_line, f"max_batch_size: {max_batch_size}",
             f"instance_group [ {{ count: {s.instances} kind: {kind} }} ]",
             "version_policy: { latest { num_versions: 1 } }"]
    if dynamic_batching:
        preferred = sorted({b for b in (max(1, max_batch_size // 2), max_batch_size) if b >= 1})
        lines.append(f"dynamic_batching {{ preferred_batch_size: [ {', '.join(map(str, preferred))} ] "
                     f"max_queue_delay_microseconds: {s.queue_delay_us} }}")
    return lines


def config_text(s: ModelSettings, onnx_path: Path, name: str | None = None, decoder: bool = False) -> str:
    """config.pbtxt for an ONNX model, inputs/outputs read off the graph: the logits model (batched as
    `s` says) or, with `decoder`, the key/value-cache decoder (max_batch_size 0: the batch axis is in the
    dims, since requests with caches of different lengths cannot share a batch)."""
    inputs, outputs = _graph_io(onnx_path)
    max_batch_size = 0 if decoder else s.max_batch_size
    batched = max_batch_size > 0
    # The python model right-pads what the batcher hands it, so requests of different lengths may share a
    # batch (allow_ragged_batch); the ONNX Runtime backend needs equal shapes.
    ragged = " allow_ragged_batch: true" if s.backend == "python" and batched and s.dynamic_batching else ""
    backend = 'backend: "python"' if s.backend == "python" else 'platform: "onnxruntime_onnx"'
    lines = _common(name or s.name, s, backend, max_batch_size, s.dynamic_batching and not decoder)
    lines[3:3] = [f"input [\n{_tensors(inputs, batched, ragged)}\n]", f"output [\n{_tensors(outputs, batched)}\n]"]
    if s.response_cache and not decoder:
        lines.append("response_cache { enable: true }")
    lines.append("model_warmup [ {\n  name: \"warmup\" batch_size: 1\n" + "".join(
        f'  inputs {{ key: "{v.name}" value {{ data_type: {ONNX_TO_TRITON[v.type.tensor_type.elem_type]} '
        f'dims: [ {", ".join(map(str, _warmup_dims(v, batched)))} ] zero_data: true }} }}\n' for v in inputs) + "} ]")
    if s.backend == "python":
        lines.append('parameters { key: "onnx_file" value { string_value: "model.onnx" } }')
    return "\n".join(lines) + "\n"


def _warmup_dims(value, batched: bool) -> list[int]:
    """A warmup request: batch 1, 8 new tokens after 8 cached ones (the mask spans both)."""
    dims = [d if d > 0 else 8 for d in _dims(value, batched=False)]
    if value.name.startswith("past_key_values."):
        dims[0] = 1
    elif value.name == "attention_mask" and len(dims) == 2 and not batched:
        dims = [1, 16]
    else:
        dims[0] = 1
    return dims[1:] if batched else dims


TEXT_MODELS = {  # python model file, inputs, outputs (name, type, dims, optional)
    "tokenizer": ("tokenizer.py", [("text_input", "TYPE_STRING", [1], False)], [("input_ids", "TYPE_INT64", [-1])]),
    "detokenizer": ("detokenizer.py", [("output_ids", "TYPE_INT64", [-1], False)],
                    [("text_output", "TYPE_STRING", [1])]),
    "generate": ("generate.py", [("text_input", "TYPE_STRING", [1], False), ("max_new_tokens", "TYPE_INT32", [1], True),
                                 ("use_kv_cache", "TYPE_BOOL", [1], True)],
                 [("text_output", "TYPE_STRING", [1]), ("output_ids", "TYPE_INT64", [-1])]),
}


def text_model_config(role: str, name: str, s: ModelSettings, parameters: dict[str, str]) -> str:
    """config.pbtxt of a python-backend text model (tokenizer, detokenizer, or the generation entry point)."""
    _, inputs, outputs = TEXT_MODELS[role]
    entry = role == "generate"
    max_batch_size = s.max_batch_size if entry else 0
    lines = _common(name, s, 'backend: "python"', max_batch_size, entry and s.dynamic_batching)

    def dims(d):
        return ", ".join(map(str, d))
    lines[3:3] = ["input [\n" + ",\n".join(f'  {{ name: "{n}" data_type: {t} dims: [ {dims(d)} ]'
                                            f'{" optional: true" if o else ""} }}' for n, t, d, o in inputs) + "\n]",
                  "output [\n" + ",\n".join(f'  {{ name: "{n}" data_type: {t} dims: [ {dims(d)} ] }}'
                                             for n, t, d in outputs) + "\n]"]
    if s.response_cache and entry:
        lines.append("response_cache { enable: true }")
    lines += [f'parameters {{ key: "{k}" value {{ string_value: {json.dumps(v)} }} }}' for k, v in parameters.items()]
    return "\n".join(lines) + "\n"


def validate(config_path: Path, onnx_path: Path) -> object:
    """Parse with Triton's ModelConfig schema and check names, dtypes and shapes against the ONNX graph."""
    from tritonclient.grpc import model_config_pb2

    cfg = validate_text_model(config_path)
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


def validate_text_model(config_path: Path) -> object:
    """Parse a config.pbtxt with Triton's ModelConfig schema (the text models have no graph to check it against)."""
    from tritonclient.grpc import model_config_pb2

    cfg = model_config_pb2.ModelConfig()
    try:
        text_format.Parse(config_path.read_text(), cfg)
    except text_format.ParseError as e:
        raise UsageError(f"{config_path} does not parse as a Triton ModelConfig: {e}") from None
    return cfg


@dataclass
class Artefacts:
    """What a text-generation repository is made of (see `write_repository`)."""

    logits_onnx: Path
    decoder_onnx: Path
    tokenizer_dir: Path  # holds the Hugging Face tokenizer files
    eos_token_ids: list[int]
    max_positions: int
    default_max_new_tokens: int = 32


def model_names(name: str) -> dict[str, str]:
    """The repository's models: NAME (token ids -> logits) and the text-generation models around it."""
    return {"logits": name, "decoder": f"{name}_decoder", "tokenizer": f"{name}_tokenizer",
            "detokenizer": f"{name}_detokenizer", "generate": f"{name}_generate"}


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def write_repository(repository: Path, s: ModelSettings, a: Artefacts) -> dict[str, Path]:
    """Add a new version of every model (see `model_names`) to `repository`: all of them are assembled and
    validated beside the repository first, then renamed in; earlier versions stay until then."""
    check_settings(s)
    repository = Path(repository)
    if repository.exists() and not repository.is_dir():
        raise UsageError(f"repository {repository} is a file: pass a folder for --repository")
    names = model_names(s.name)
    existing = [int(p.name) for n in names.values() if (repository / n).is_dir()
                for p in (repository / n).iterdir() if p.name.isdigit()]
    version = s.version or max(existing, default=0) + 1
    staging = repository.parent / f".{repository.name}.{s.name}.v{version}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        for role, onnx_path in (("logits", a.logits_onnx), ("decoder", a.decoder_onnx)):
            folder = staging / names[role] / str(version)
            folder.mkdir(parents=True)
            for f in (onnx_path, Path(str(onnx_path) + ".data")):
                if f.exists():
                    shutil.copy2(f, folder / ("model.onnx" + f.name[len(onnx_path.name):]))
            if s.backend == "python":
                shutil.copy2(MODELS_PY / "onnx_model.py", folder / "model.py")
            config = staging / names[role] / "config.pbtxt"
            config.write_text(config_text(s, onnx_path, names[role], decoder=role == "decoder"))
            validate(config, onnx_path)
        inputs, _ = _graph_io(a.decoder_onnx)
        empty_cache = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim][1::2]
                       for v in inputs if v.name.startswith("past_key_values.")}
        if any(0 in dims for dims in empty_cache.values()):
            raise UsageError(f"{a.decoder_onnx}: the cache inputs need static head counts and sizes, got {empty_cache}")
        parameters = {"generate": {"models": json.dumps(names), "empty_cache": json.dumps(empty_cache),
                                   "eos_token_ids": json.dumps(a.eos_token_ids), "max_positions": str(a.max_positions),
                                   "default_max_new_tokens": str(a.default_max_new_tokens)}}
        for role in ("tokenizer", "detokenizer", "generate"):
            folder = staging / names[role] / str(version)
            folder.mkdir(parents=True)
            shutil.copy2(MODELS_PY / TEXT_MODELS[role][0], folder / "model.py")
            if role != "generate":
                for f in TOKENIZER_FILES:
                    if (a.tokenizer_dir / f).is_file():
                        shutil.copy2(a.tokenizer_dir / f, folder / f)
            config = staging / names[role] / "config.pbtxt"
            config.write_text(text_model_config(role, names[role], s, parameters.get(role, {})))
            validate_text_model(config)
        placed = {}
        for role, name in names.items():
            target = repository / name / str(version)
            target.parent.mkdir(parents=True, exist_ok=True)
            if target.exists():
                shutil.rmtree(target)
            os.replace(staging / name / str(version), target)
            os.replace(staging / name / "config.pbtxt", repository / name / "config.pbtxt")
            placed[role] = target
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return placed
