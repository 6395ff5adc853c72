"""Triton model repositories: every config is built as Triton's own `ModelConfig` protobuf message
(`tritonclient.grpc.model_config_pb2`), checked against the ONNX graph, and written with `text_format`;
a new version of all five models is assembled beside the repository and renamed in together."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import onnx
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from dstool import decoding
from dstool.errors import StageFailed, UsageError
from dstool.files import replace_folder
from dstool.serve.config.export_config import RepositorySettings, model_names

ONNX_TO_TRITON = {onnx.TensorProto.FLOAT: mc.TYPE_FP32, onnx.TensorProto.FLOAT16: mc.TYPE_FP16,
                  onnx.TensorProto.INT64: mc.TYPE_INT64, onnx.TensorProto.INT32: mc.TYPE_INT32,
                  onnx.TensorProto.BFLOAT16: mc.TYPE_BF16}
MODELS_PY = Path(__file__).parent.parent / "triton_models"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def _graph_io(onnx_path: Path) -> tuple[list, list]:
    graph = onnx.load(str(onnx_path), load_external_data=False).graph
    inits = {i.name for i in graph.initializer}
    return [i for i in graph.input if i.name not in inits], list(graph.output)


def _dims(value, batched: bool) -> list[int]:
    dims = [d.dim_value if d.HasField("dim_value") else -1 for d in value.type.tensor_type.shape.dim]
    return dims[1:] if batched else dims


def _common(name: str, s: RepositorySettings, max_batch_size: int, dynamic_batching: bool,
            onnx_platform: bool) -> mc.ModelConfig:
    cfg = mc.ModelConfig(name=name, max_batch_size=max_batch_size)
    if onnx_platform:
        cfg.platform = "onnxruntime_onnx"
    else:
        cfg.backend = "python"
    gpu = s.device == "gpu" and onnx_platform
    kind = mc.ModelInstanceGroup.KIND_GPU if gpu else mc.ModelInstanceGroup.KIND_CPU
    cfg.instance_group.add(count=s.instances, kind=kind)
    cfg.version_policy.latest.num_versions = 1
    if dynamic_batching:
        cfg.dynamic_batching.preferred_batch_size.extend(sorted({max(1, max_batch_size // 2), max_batch_size}))
        cfg.dynamic_batching.max_queue_delay_microseconds = s.queue_delay_us
    return cfg


def onnx_model_config(s: RepositorySettings, onnx_path: Path, name: str, decoder: bool = False) -> mc.ModelConfig:
    """The config of an ONNX model, inputs/outputs read off the graph: the logits model (batched as `s` says) or,
    with `decoder`, the key/value-cache decoder (max_batch_size 0: the batch axis is in the dims, since requests
    with caches of different lengths cannot share a batch)."""
    inputs, outputs = _graph_io(onnx_path)
    max_batch_size = 0 if decoder else s.max_batch_size
    batched = max_batch_size > 0
    dynamic = s.dynamic_batching and not decoder
    cfg = _common(name, s, max_batch_size, dynamic, s.backend == "onnxruntime")
    # The python model right-pads what the batcher hands it, so requests of different lengths may share a
    # batch (allow_ragged_batch); the ONNX Runtime backend needs equal shapes.
    ragged = s.backend == "python" and batched and s.dynamic_batching
    for v in inputs:
        cfg.input.add(name=v.name, data_type=ONNX_TO_TRITON[v.type.tensor_type.elem_type], dims=_dims(v, batched),
                      allow_ragged_batch=ragged)
    for v in outputs:
        cfg.output.add(name=v.name, data_type=ONNX_TO_TRITON[v.type.tensor_type.elem_type], dims=_dims(v, batched))
    if s.response_cache and not decoder:
        cfg.response_cache.enable = True
    warmup = cfg.model_warmup.add(name="warmup", batch_size=1)
    for v in inputs:
        tensor = warmup.inputs[v.name]
        tensor.data_type = ONNX_TO_TRITON[v.type.tensor_type.elem_type]
        tensor.dims.extend(_warmup_dims(v, batched))
        tensor.zero_data = True
    if s.backend == "python":
        cfg.parameters["onnx_file"].string_value = "model.onnx"
    return cfg


def _warmup_dims(value, batched: bool) -> list[int]:
    """A warmup request: batch 1, 8 new tokens after 8 cached ones (the mask spans both)."""
    dims = [d if d > 0 else 8 for d in _dims(value, batched=False)]
    if value.name == "attention_mask" and len(dims) == 2 and not batched:
        dims = [1, 16]
    else:
        dims[0] = 1
    return dims[1:] if batched else dims


TEXT_MODELS = {  # python model file, inputs (name, type, dims, optional), outputs (name, type, dims)
    "tokenizer": ("tokenizer.py", [("text_input", mc.TYPE_STRING, [1], False)], [("input_ids", mc.TYPE_INT64, [-1])]),
    "detokenizer": ("detokenizer.py", [("output_ids", mc.TYPE_INT64, [-1], False)],
                    [("text_output", mc.TYPE_STRING, [1])]),
    "generate": ("generate.py", [("text_input", mc.TYPE_STRING, [1], False),
                                 ("max_new_tokens", mc.TYPE_INT32, [1], True),
                                 ("use_kv_cache", mc.TYPE_BOOL, [1], True),
                                 ("stop_token_ids", mc.TYPE_INT64, [-1], True)],
                 [("text_output", mc.TYPE_STRING, [1]), ("output_ids", mc.TYPE_INT64, [-1]),
                  ("prompt_tokens", mc.TYPE_INT32, [1])]),
    "llm": ("llm.py", [("text_input", mc.TYPE_STRING, [1], True), ("messages", mc.TYPE_STRING, [1], True),
                       ("input_ids", mc.TYPE_INT64, [-1], True),
                       ("max_new_tokens", mc.TYPE_INT32, [1], True), ("stop_token_ids", mc.TYPE_INT64, [-1], True),
                       ("stream", mc.TYPE_BOOL, [1], True)],
            [("text_output", mc.TYPE_STRING, [1]), ("output_ids", mc.TYPE_INT64, [-1]),
             ("prompt_tokens", mc.TYPE_INT32, [1]), ("prompt_cached_tokens", mc.TYPE_INT32, [1]),
             # with the `logprobs` parameter (K): each token's text and log-probability, and the K most likely
             ("tokens", mc.TYPE_STRING, [-1]), ("logprobs", mc.TYPE_FP32, [-1]),
             ("top_tokens", mc.TYPE_STRING, [-1, -1]), ("top_logprobs", mc.TYPE_FP32, [-1, -1]),
             # the first response's, with the `echo` and `prompt_logprobs` parameters: the prompt's text, and its
             # tokens' texts and log-probabilities (from the second token on) with the K most likely
             ("prompt_text", mc.TYPE_STRING, [1]), ("prompt_token_texts", mc.TYPE_STRING, [-1]),
             ("prompt_logprobs", mc.TYPE_FP32, [-1]), ("prompt_top_tokens", mc.TYPE_STRING, [-1, -1]),
             ("prompt_top_logprobs", mc.TYPE_FP32, [-1, -1])]),
}
# What a python model imports, deployed beside its model.py (Triton puts the version folder on its path): the
# decoding room, whole (dstool/decoding: the decode loop, the sampler, the grammars, their errors), as the package
# `decoding`; the rest sits beside the models in triton_models/.
DECODING = Path(decoding.__file__).parent
BESIDE = {"generate": [DECODING], "llm": [DECODING, MODELS_PY / "ort_options.py"]}
ENGINE_MAX_BATCH = 16  # sequences the llm model decodes at once; more wait for a free place
# prompt tokens the llm model prefills per step while others decode (about one decoding step's work at 16 here)
ENGINE_PREFILL_TOKENS = 64
# tokens per block of the llm model's prefix cache: a prompt reuses the whole blocks an earlier one computed
PREFIX_CACHE_BLOCK = 16


def text_model_config(role: str, name: str, s: RepositorySettings, parameters: dict[str, str]) -> mc.ModelConfig:
    """The config of a python-backend text model (tokenizer, detokenizer, the generation entry point, or the
    streaming llm model: decoupled, one instance holding the continuous-batching engine)."""
    _, inputs, outputs = TEXT_MODELS[role]
    entry = role == "generate"
    cfg = _common(name, s, s.max_batch_size if entry else 0, entry and s.dynamic_batching, onnx_platform=False)
    if role == "llm":
        cfg.instance_group[0].count = 1
        cfg.model_transaction_policy.decoupled = True
    for n, t, d, optional in inputs:
        cfg.input.add(name=n, data_type=t, dims=d, optional=optional)
    for n, t, d in outputs:
        cfg.output.add(name=n, data_type=t, dims=d)
    if s.response_cache and entry:
        cfg.response_cache.enable = True
    for key, value in parameters.items():
        cfg.parameters[key].string_value = value
    return cfg


def cache_shapes(config_path: Path) -> dict[str, tuple[int, int]]:
    """The decoder's cache inputs -> (kv_heads, head_dim), as a generation model's config records them (what the
    generation engine needs to lay out an empty cache)."""
    return {k: tuple(v) for k, v in
            json.loads(read_config(config_path).parameters["empty_cache"].string_value).items()}


def check_against_graph(cfg: mc.ModelConfig, onnx_path: Path, where: str) -> mc.ModelConfig:
    """Names, dtypes and shapes of `cfg`'s inputs and outputs against the ONNX graph; UsageError naming the first
    mismatch."""
    inputs, outputs = _graph_io(onnx_path)
    batched = cfg.max_batch_size > 0
    for declared, graph, what in ((cfg.input, inputs, "input"), (cfg.output, outputs, "output")):
        by_name = {v.name: v for v in graph}
        if {t.name for t in declared} != set(by_name):
            raise UsageError(f"{where}: {what}s {sorted(t.name for t in declared)} do not match the ONNX "
                             f"graph's {sorted(by_name)}")
        for t in declared:
            v = by_name[t.name]
            want = ONNX_TO_TRITON.get(v.type.tensor_type.elem_type)
            if t.data_type != want:
                raise UsageError(f"{where}: {what} {t.name} is {mc.DataType.Name(t.data_type)}, the ONNX graph says "
                                 f"{mc.DataType.Name(want) if want is not None else 'an unsupported type'}")
            graph_dims = _dims(v, batched)
            if len(graph_dims) != len(t.dims) or any(g != -1 and g != d for g, d in zip(graph_dims, t.dims)):
                raise UsageError(f"{where}: {what} {t.name} dims {list(t.dims)} do not fit the ONNX shape {graph_dims}")
    return cfg


def read_config(config_path: Path) -> mc.ModelConfig:
    """Parse a config.pbtxt with Triton's ModelConfig schema."""
    cfg = mc.ModelConfig()
    try:
        text_format.Parse(config_path.read_text(), cfg)
    except text_format.ParseError as e:
        raise UsageError(f"{config_path} does not parse as a Triton ModelConfig: {e}") from None
    return cfg


def validate(config_path: Path, onnx_path: Path) -> mc.ModelConfig:
    """A config.pbtxt on disk, parsed with Triton's schema and checked against its ONNX graph."""
    return check_against_graph(read_config(config_path), onnx_path, str(config_path))


def _write(cfg: mc.ModelConfig, path: Path) -> None:
    path.write_text(text_format.MessageToString(cfg))


@dataclass
class Artefacts:
    """What a text-generation repository is made of (see `write_repository`)."""

    logits_onnx: Path
    decoder_onnx: Path
    tokenizer_dir: Path  # holds the Hugging Face tokenizer files
    eos_token_ids: list[int]
    max_positions: int
    default_max_new_tokens: int = 32
    fused_onnx: Path | None = None  # the fused-attention decoder NAME_llm runs (dstool.fused_decoder), if any
    adapters: dict[str, Path] = field(default_factory=dict)  # LoRA adapters NAME_llm loads at start, by name
    mtp_onnx: list[Path] = field(default_factory=list)  # DeepSeek's MTP depths as draft graphs (dstool.onnx_export)


def prompt_bytes_bound(tokenizer_dir: Path, positions: int) -> int:
    """Bytes of text beyond which a prompt cannot fit in `positions` tokens, so the served models refuse it before
    tokenizing: no token stands for more text than its own UTF-8 bytes (the longest token's), times 4 for
    normalization (NFKC maps a 3-byte character to one byte)."""
    from transformers import AutoTokenizer  # noqa: PLC0415 (transformers: only when exporting; dstool batch reads manifests with this module)

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return positions * 4 * max(4, *(len(t.encode("utf-8")) for t in tokens if t is not None))


def next_version(repository: Path, name: str) -> int:
    existing = [int(p.name) for n in model_names(name).values() if (repository / n).is_dir()
                for p in (repository / n).iterdir() if p.name.isdigit()]
    return max(existing, default=0) + 1


def write_repository(repository: Path, s: RepositorySettings, a: Artefacts) -> dict[str, Path]:
    """Add a new version of every model (see `model_names`) to `repository`: all of them are assembled and
    checked beside the repository first, then renamed in; earlier versions stay until then."""
    repository = Path(repository)
    if repository.exists() and not repository.is_dir():
        raise UsageError(f"repository {repository} is a file: pass a folder for --repository")
    names = model_names(s.name)
    version = s.version or next_version(repository, s.name)
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
                shutil.copy2(MODELS_PY / "ort_options.py", folder / "ort_options.py")
            cfg = onnx_model_config(s, onnx_path, names[role], decoder=role == "decoder")
            _write(check_against_graph(cfg, onnx_path, f"{names[role]}/config.pbtxt"),
                   staging / names[role] / "config.pbtxt")
        inputs, _ = _graph_io(a.decoder_onnx)
        empty_cache = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim][1::2]
                       for v in inputs if v.name.startswith("past_key_values.")}
        if any(0 in dims for dims in empty_cache.values()):
            raise StageFailed(f"{a.decoder_onnx}: the cache inputs need static head counts and sizes, got "
                              f"{empty_cache}")
        limit = {"max_prompt_bytes": str(prompt_bytes_bound(a.tokenizer_dir, a.max_positions))}
        generation = {"empty_cache": json.dumps(empty_cache), "eos_token_ids": json.dumps(a.eos_token_ids),
                      "max_positions": str(a.max_positions), "default_max_new_tokens": str(a.default_max_new_tokens),
                      **limit}
        parameters = {"tokenizer": limit, "generate": {"models": json.dumps(names), **generation},
                      "llm": {"decoder": names["decoder"], "max_batch": str(ENGINE_MAX_BATCH),
                              "max_cache_tokens": str(ENGINE_MAX_BATCH * a.max_positions),
                              "max_prefill_tokens": str(ENGINE_PREFILL_TOKENS),
                              "prefix_cache_tokens": str(ENGINE_MAX_BATCH * a.max_positions if s.prefix_cache else 0),
                              "prefix_cache_block": str(PREFIX_CACHE_BLOCK),
                              "stream_interval": str(s.stream_interval),
                              **({"speculative_config": s.speculative_config} if s.speculative_config else {}),
                              **({"fused_decoder": "fused/model.onnx"} if a.fused_onnx else {}),
                              **({"mtp_graphs": json.dumps([f"mtp/{k}/model.onnx" for k in
                                                            range(1, len(a.mtp_onnx) + 1)])} if a.mtp_onnx else {}),
                              **({"lora": json.dumps({"adapters": sorted(a.adapters), "max_lora_rank": s.max_lora_rank,
                                                      "max_loras": s.max_loras})} if s.enable_lora else {}),
                              **generation}}
        for role in ("tokenizer", "detokenizer", "generate", "llm"):
            folder = staging / names[role] / str(version)
            folder.mkdir(parents=True)
            shutil.copy2(MODELS_PY / TEXT_MODELS[role][0], folder / "model.py")
            for source in BESIDE.get(role, []):
                if source.is_dir():
                    shutil.copytree(source, folder / source.name, ignore=shutil.ignore_patterns("__pycache__"))
                else:
                    shutil.copy2(source, folder / source.name)
            if role == "llm" and a.fused_onnx:
                (folder / "fused").mkdir()
                shutil.copy2(a.fused_onnx, folder / "fused" / "model.onnx")
                data = Path(str(a.fused_onnx) + ".data")  # the graph names its weights file: kept as it is
                if data.exists():
                    shutil.copy2(data, folder / "fused" / data.name)
                for adapter_name, adapter in a.adapters.items():  # PEFT's two files, as NAME_llm reads them
                    (folder / "adapters" / adapter_name).mkdir(parents=True)
                    for peft_file in ("adapter_config.json", "adapter_model.safetensors"):
                        shutil.copy2(adapter / peft_file, folder / "adapters" / adapter_name / peft_file)
            if role == "llm":
                for k, graph in enumerate(a.mtp_onnx, start=1):  # the graph names its weights file: kept as it is
                    (folder / "mtp" / str(k)).mkdir(parents=True)
                    for f in (graph, Path(str(graph) + ".data")):
                        if f.exists():
                            shutil.copy2(f, folder / "mtp" / str(k) / f.name)
            if role != "generate":
                for name in TOKENIZER_FILES:
                    if (a.tokenizer_dir / name).is_file():
                        shutil.copy2(a.tokenizer_dir / name, folder / name)
            _write(text_model_config(role, names[role], s, parameters.get(role, {})),
                   staging / names[role] / "config.pbtxt")
        placed = {}
        for role, name in names.items():
            target = repository / name / str(version)
            target.parent.mkdir(parents=True, exist_ok=True)
            replace_folder(staging / name / str(version), target)
            os.replace(staging / name / "config.pbtxt", repository / name / "config.pbtxt")
            placed[role] = target
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return placed
