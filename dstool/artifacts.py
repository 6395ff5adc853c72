"""Typed artefacts: the manifest (`dstool.json`) each stage writes beside what it produces, and the next
stage reads — never a glob, a guess or prose.

    --model X.gguf    CACHE/gguf/D/dstool.json       GGUFModel        a GGUF file converted to a Hugging Face folder
    dstool train      RUN/dstool.json                TrainRun         tokenizer, data split, checkpoints, model
                      RUN/model/dstool.json          HFModel          a Hugging Face folder, its run and data split
                      RUN/checkpoints/step-N/...     Checkpoint       a DeepSpeed tag folder, hashed
    dstool compress   OUT/dstool.json                CompressedModel  both ONNX graphs, the recipe, the figures
    dstool export     REPOSITORY/dstool.json         Repository       what every deployed version is made of
    dstool export --target edge  OUT/dstool.json     EdgePackage      the ORT-format parts, blocks, operator config
    dstool batch      OUT/dstool.json                BatchOutput      the partitions, the model version, figures

Paths inside a manifest are relative to its folder, so an artefact can be moved or copied whole. Every
manifest names its `kind` and `schema_version`; a reader refuses another kind, or a schema it does not
know, in one line that says which command redoes the artefact.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dstool import __version__
from dstool.files import sha256_file, write_text_atomic

MANIFEST = "dstool.json"
SCHEMA_VERSION = 1
M = TypeVar("M", bound="Manifest")


class ManifestError(Exception):
    """A folder's manifest is missing, of another kind or schema, or its files do not match it."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class FileEntry(_Model):
    """One file of an artefact, as it was written."""

    sha256: str
    bytes: int = Field(description="size; checked before the (slower) digest")


class Manifest(_Model):
    """What every manifest holds."""

    PRODUCER: ClassVar[str] = "dstool"  # the command that writes this kind (named in errors)
    LEGACY_OK: ClassVar[bool] = False  # read a manifest written before schema versions as schema 1

    kind: str = Field(description="what the folder is")
    schema_version: int = Field(SCHEMA_VERSION, description="this manifest's schema; readers refuse others")
    dstool_version: str = Field(__version__, description="the dstool that wrote it")
    created: str = Field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                         description="when it was written")
    files: dict[str, FileEntry] = Field(default_factory=dict, description="path -> sha256 and size of every file "
                                        "(empty where the folder keeps changing, as a run folder does)")

    def write(self, folder: Path, hash_files: bool = True) -> Manifest:
        """Hash the folder's files (not logs, not the manifest) into `files`, then write `folder/dstool.json`."""
        folder = Path(folder)
        if hash_files:
            self.files = {str(p.relative_to(folder)): FileEntry(sha256=sha256_file(p), bytes=p.stat().st_size)
                          for p in sorted(folder.rglob("*"))
                          if p.is_file() and p.name != MANIFEST and p.suffix != ".log"}
        write_text_atomic(folder / MANIFEST, self.model_dump_json(indent=1) + "\n")
        return self

    @classmethod
    def read(cls: type[M], folder: Path, verify: bool = False) -> M:
        """The manifest of `folder` as this kind; ManifestError (one line, naming the fix) otherwise."""
        folder = Path(folder)
        raw = _load(folder)
        kind = cls.model_fields["kind"].default
        if raw.get("kind") != kind:
            raise ManifestError(f"{folder} is a '{raw.get('kind')}', not a '{kind}'")
        if "schema_version" not in raw and cls.LEGACY_OK:
            raw["schema_version"] = SCHEMA_VERSION
        if raw.get("schema_version") != SCHEMA_VERSION:
            raise ManifestError(f"{folder} was written by dstool {raw.get('dstool_version', '(unknown)')} with "
                                f"manifest "
                                f"schema {raw.get('schema_version', 0)}; this dstool reads schema {SCHEMA_VERSION}: "
                                f"re-run `{cls.PRODUCER}` to redo it")
        try:
            manifest = cls.model_validate(raw)
        except ValidationError as e:
            first = e.errors()[0]
            raise ManifestError(f"{folder / MANIFEST} does not fit the '{kind}' schema "
                                f"({'.'.join(map(str, first['loc']))}: {first['msg']}): re-run `{cls.PRODUCER}` "
                                "to redo it") from None
        if verify:
            manifest.verify(folder)
        return manifest

    def verify(self, folder: Path) -> None:
        """Check every listed file's size and sha256; ManifestError naming the first that differs."""
        for rel, info in self.files.items():
            p = Path(folder) / rel
            if not p.is_file():
                raise ManifestError(f"{folder}: file {rel} is missing")
            if p.stat().st_size != info.bytes:
                raise ManifestError(f"{folder}: file {rel} has {p.stat().st_size} bytes, manifest says {info.bytes}")
            if sha256_file(p) != info.sha256:
                raise ManifestError(f"{folder}: file {rel} fails its sha256 check")


def _load(folder: Path) -> dict:
    path = folder / MANIFEST
    if not path.is_file():
        raise ManifestError(f"{folder} has no {MANIFEST} (a partial or foreign write)")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ManifestError(f"{path} is not valid JSON (a partial or foreign write)") from None
    if not isinstance(raw, dict):
        raise ManifestError(f"{path} is not a JSON object")
    return raw


def kind_of(folder: Path) -> str | None:
    """The `kind` a folder's manifest declares, or None when it has no readable manifest."""
    try:
        return str(_load(Path(folder)).get("kind"))
    except ManifestError:
        return None


def model_hint(folder: Path) -> str:
    """For a folder given where a model was expected: what it is and what to pass instead (from its manifest, or its
    parent's: a run's checkpoints/ or tokenizer/), as the end of a one-line error; "" when nothing is known."""
    folder = Path(folder)
    for where, inside in ((folder, False), (folder.parent, True)):
        kind = kind_of(where)
        if kind == "train-run":
            model = where / str(_load(where).get("model", "model"))
            what = f"{folder} is inside the dstool train run {where}" if inside else f"{folder} is a dstool train run"
            return (f": {what}; pass its model folder {model}" if model.is_dir() else
                    f": {what}, whose training has not finished (no {model.name}/ yet)")
        if kind is not None and not inside:
            return {"model-repository": f": {folder} is a Triton model repository; pass the model folder it was "
                                        "exported from",
                    "edge-package": f": {folder} is an edge package; run it with `dstool infer --edge {folder}`",
                    "batch-output": f": {folder} is a dstool batch output, not a model",
                    }.get(kind, f": {folder} is a {kind}, not a model")
    return ""


# ---- dstool train --------------------------------------------------------------------------------------

class DataSplit(_Model):
    """A run's tokenized corpus: flat token files, the held-out split being the corpus' tail."""

    folder: str = Field(description="folder of train.bin, val.bin and meta.json, relative to the manifest")
    dtype: str = Field(description="numpy dtype of the token files")
    train_tokens: int
    val_tokens: int
    fingerprint: str = Field(description="sha256 over the corpus documents (a run refuses other data)")
    sha256: dict[str, str] = Field(default_factory=dict, description="the packed token files (train.bin, val.bin) "
                                   "-> sha256 when packed: checked at every start and at the end of a run")


class TrainRun(Manifest):
    """A `dstool train` run folder (written before the ranks start; files are not hashed, they keep changing)."""

    PRODUCER: ClassVar[str] = "dstool train"
    LEGACY_OK: ClassVar[bool] = True

    kind: Literal["train-run"] = "train-run"
    data_fingerprint: str = Field(description="sha256 over the corpus documents")
    data: DataSplit | None = Field(None, description="the tokenized corpus and its held-out split")
    tokenizer: str = Field("tokenizer", description="the tokenizer folder (Hugging Face files)")
    checkpoints: str = Field("checkpoints", description="DeepSpeed checkpoints, `latest` names the newest")
    checkpoint_index: str = Field("checkpoints/index.json", description="every checkpoint's step -> where it lives "
                                  "(`hot`: in checkpoints/, `archive`: the URL of its verified copy) and its sha256 "
                                  "status")
    archive: str | None = Field(None, description="--archive: the folder or URL checkpoints are moved to when they "
                                "leave the --keep-checkpoints window")
    model: str = Field("model", description="the final Hugging Face folder (an HFModel), once training ends")
    config: str = Field("config.yaml", description="the effective TrainConfig")


class Parity(_Model):
    """transformers' reload of the saved folder against the training engine, on held-out tokens."""

    max_abs_logit_diff: float
    tolerance: float = Field(description="1e-4 for fp32 weights, 5e-2 for bf16/fp16")
    probe_shape: list[int] = Field(description="[sequences, tokens] of the probe")


class HFModel(Manifest):
    """A Hugging Face causal-LM folder consolidated by `dstool train` and reloaded with the engine's logits."""

    PRODUCER: ClassVar[str] = "dstool train"
    LEGACY_OK: ClassVar[bool] = True

    kind: Literal["hf-model"] = "hf-model"
    step: int = Field(description="the optimizer step the weights are from")
    precision: str = Field(description="fp32, bf16 or fp16: the dtype the weights are saved in")
    parity: Parity = Field(description="transformers' reload against the engine's logits")
    run: str | None = Field(None, description="the run folder, relative to this one")
    data: DataSplit | None = Field(None, description="the run's data split (held-out tokens for measurements), "
                                   "its folder relative to this one")


class GGUFModel(Manifest):
    """A Hugging Face folder converted from a GGUF file (llama.cpp's format) given as --model: dequantized weights."""

    PRODUCER: ClassVar[str] = "dstool (a .gguf given as --model)"

    kind: Literal["gguf-model"] = "gguf-model"
    source: str = Field(description="the .gguf file it was converted from (absolute)")
    source_sha256: str = Field(description="that file's sha256")
    source_bytes: int = Field(description="that file's size")
    architecture: str = Field(description="the GGUF's general.architecture (llama, ...)")
    tensor_types: dict[str, int] = Field(description="the GGUF's tensor types (Q4_1, F32, ...) and how many of each")
    dequantized: bool = Field(description="its quantized blocks were expanded to float weights here")
    precision: str = Field(description="the dtype of the saved weights")


class Checkpoint(Manifest):
    """A DeepSpeed checkpoint tag folder (every rank's files), renamed into place only when complete."""

    PRODUCER: ClassVar[str] = "dstool train"
    LEGACY_OK: ClassVar[bool] = True

    kind: Literal["deepspeed-checkpoint"] = "deepspeed-checkpoint"
    step: int | None = Field(None, description="the optimizer step it holds")
    world_size: int = Field(0, description="ranks that saved it (another world size resumes through the universal "
                            "form)")
    zero_stage: int = Field(0, description="ZeRO stage of its optimizer shards")
    model_shapes: dict[str, list[int]] | None = Field(None, description="every parameter's whole shape: a run of "
                                                      "another model refuses it")
    lora: dict | None = Field(None, description="the LoRA adapter (rank, alpha, dropout, targets) when only it "
                              "trained: the frozen weights are not in the checkpoint")
    precision: str | None = Field(None, description="fp32, bf16 or fp16: the engine's compute precision (its "
                                  "optimizer state files differ by it)")
    expert_parallel: int | None = Field(None, description="ranks each MoE layer's routed experts were sharded over "
                                        "(DeepSpeed AutoEP's module layout); None: the model's own MoE blocks")
    pipeline_stages: int | None = Field(None, description="pipeline stages it was saved with (its files are per "
                                        "stage layer; None: written before this was recorded)")
    tensor_parallel: int | None = Field(None, description="tensor-parallel ranks it was saved with (files per shard)")


class UniversalCheckpoint(Checkpoint):
    """A checkpoint converted with DeepSpeed's ds_to_universal, to resume on another world size."""

    kind: Literal["deepspeed-universal-checkpoint"] = "deepspeed-universal-checkpoint"  # type: ignore[assignment]


# ---- dstool compress -----------------------------------------------------------------------------------

class SourceModel(_Model):
    """The model an artefact was made from."""

    path: str = Field(description="the folder as given (absolute)")
    kind: str = Field(description="its manifest's kind (hf-model for a dstool train run), or 'huggingface'")
    weights_sha256: str = Field(description="sha256 over its weight files (names and digests, sorted)")
    gguf: str | None = Field(None, description="the .gguf file the folder was converted from (its weights "
                             "dequantized), when it was")
    gguf_sha256: str | None = Field(None, description="that file's sha256")


class Graph(_Model):
    """One ONNX graph of an artefact."""

    path: str = Field(description="the .onnx file, relative to the manifest")
    data: str | None = Field(None, description="its external-data (weights) file, if any")
    sha256: str = Field(description="of the .onnx file")
    inputs: list[str] = Field(description="graph input names (the decoder's include past_key_values.layers.N.*)")
    outputs: list[str] = Field(description="graph output names (the decoder's include cache.layers.N.*)")
    fp32_parity: float = Field(description="max |logit diff| of the fp32 graph against PyTorch, before quantization")


class Int8Trial(_Model):
    """One int8 layout tried while choosing what stays fp32."""

    fp32_layers: list[str] = Field(description="layers kept fp32 in this trial")
    activation_matmuls: bool
    perplexity: float = Field(description="on calibration tokens (never the held-out split)")


class Quantization(_Model):
    """How the graphs (or, with torchao, the PyTorch weights) were quantized."""

    bits: Literal[8, 4]
    engine: Literal["onnxruntime", "torchao"]
    format: Literal["int8-matmulnbits", "int8-dynamic-qoperator", "int4-matmulnbits", "torchao-int8-dynamic"] = Field(
        description="int8: weight-only MatMulNBits, or ORT dynamic (MatMulInteger); 4-bit: weight-only MatMulNBits; "
        "torchao: PyTorch int8")
    weight_type: str | None = Field(None, description="QInt8 / QUInt8 (dynamic int8); int8/int4 symmetric or "
                                    "asymmetric (weight-only)")
    activation_type: str | None = None
    per_channel: bool | None = None
    reduce_range: bool | None = Field(None, description="7-bit weights: chosen on CPUs without VNNI")
    cpu_vnni: bool | None = Field(None, description="whether this CPU has VNNI (decides reduce_range)")
    activation_matmuls: bool | None = Field(None, description="MatMuls of two activations (attention scores) "
                                            "quantized too; kept only if measured more accurate")
    block_size: int | None = Field(None, description="weight-only: input channels per scale (--group-size)")
    accuracy_level: int | None = Field(None, description="weight-only: the decoder graph's MatMulNBits compute (4 = "
                                       "int8, activations quantized per block; None = fp32), the faster decoding "
                                       "step measured on this CPU; the 4-bit logits graph computes in fp32, the "
                                       "int8 one as the decoder")
    decoding_step_ms: dict[str, float] = Field(default_factory=dict, description="weight-only: one batch-1 "
                                               "decoding step's time with each compute (fp32, int8)")
    method: Literal["rtn", "gptq"] | None = Field(None, description="4-bit: round-to-nearest (ORT's quantizer) or "
                                                  "GPTQ (--int4)")
    calibration_tokens: int | None = Field(None, description="GPTQ: the calibration tokens its Hessians were "
                                           "measured on (windows x tokens of the calibration split)")
    gptq_seconds: float | None = Field(None, description="GPTQ: wall time of the pass on the PyTorch model")
    gptq_weights: dict[str, int] = Field(default_factory=dict, description="GPTQ: graph role -> MatMuls given "
                                         "GPTQ's codes (the rest, lm_head and the embedding table, round to nearest)")
    fp32_layers: list[str] = Field(default_factory=list, description="layers kept fp32 by measured perplexity "
                                   "(lm_head, layer N)")
    fp32_nodes: dict[str, list[str]] = Field(default_factory=dict, description="graph role -> MatMul nodes kept fp32")
    trials: list[Int8Trial] = Field(default_factory=list, description="every int8 layout measured")
    torchao_folder: str | None = Field(None, description="torchao: the Hugging Face folder that reloads quantized")


class LayerRemoval(_Model):
    """What pruning removed from one decoder layer, as indices of the original model."""

    kv_groups: list[int]
    query_heads: list[int]
    mlp_channels: list[int] = Field(description="dense MLP channels (none in a MoE layer)")
    experts: list[int] = Field(default_factory=list, description="MoE layer: routed experts removed")
    expert_load: list[float] = Field(default_factory=list, description="MoE layer: each routed expert's routing load "
                                     "on the calibration tokens, its share of the top-k choices (the least-routed go)")
    expert_channels: list[list[int]] = Field(default_factory=list, description="MoE layer: per kept expert, in order, "
                                             "its channels removed")
    shared_expert_channels: list[int] = Field(default_factory=list, description="MoE layer: shared experts' "
                                              "channels removed")


class PruneCandidate(_Model):
    """A layout pruning tried: what every layer would keep."""

    kv_groups: int
    heads_per_group: int
    channels: int = Field(description="MLP intermediate channels")
    experts: int | None = Field(None, description="MoE: routed experts per MoE layer")
    expert_channels: int | None = Field(None, description="MoE: intermediate channels per expert")
    calibration_loss: float = Field(description="cross-entropy on calibration tokens, pruned, before recovery")
    latency_ms: float | None = Field(None, description="ONNX Runtime, batch 8 x 128 (timed when within the "
                                     "tolerance and more than one layout is)")


class Pruning(_Model):
    """Structured pruning: the same layout in every decoder layer."""

    rule: Literal["lowest-loss", "fastest-within-tolerance", "given-ratios"] = Field(
        description="how the layout was chosen among the candidates")
    target_ratio: float | None = Field(None, description="--prune: share of decoder-layer parameters to remove")
    ppl_tolerance_pct: float = Field(0.0, description="fastest-within-tolerance: calibration perplexity within "
                                     "this % of the best layout's")
    kv_heads: tuple[int, int] = Field(description="key/value groups per layer, before and after")
    query_heads: tuple[int, int] = Field(description="per layer, before and after")
    mlp_channels: tuple[int, int] = Field(description="per layer, before and after")
    attention: Literal["gqa", "mla"] = Field("gqa", description="mla (DeepSeek-V3): one key/value head per query "
                                             "head, expanded from a shared latent, so kv_heads = query_heads")
    experts: tuple[int, int] | None = Field(None, description="MoE: routed experts per MoE layer, before and after")
    expert_channels: tuple[int, int] | None = Field(None, description="MoE: intermediate channels per routed expert "
                                                    "(the same in every expert), before and after")
    shared_expert_channels: tuple[int, int] | None = Field(None, description="MoE: shared experts' channels per "
                                                           "layer, before and after")
    decoder_fraction_removed: float = Field(description="share of the decoder layers' parameters removed")
    total_fraction_removed: float = Field(description="share of all parameters removed")
    removed: list[LayerRemoval] = Field(description="per layer, what was removed")
    candidates: list[PruneCandidate] = Field(default_factory=list, description="every layout tried (--prune)")


class SparseStorage(_Model):
    """How unstructured-sparse weights are stored: every tensor at least 1/16 zeros as a bitmask of its
    nonzeros (1 bit an entry) and the nonzero values (fp32); sizes as the files are, against the same weights dense."""

    format: Literal["bitmask-values"] = "bitmask-values"
    model_bytes: int = Field(description="model/'s *.sparse.safetensors files")
    model_dense_bytes: int = Field(description="model/'s weights as fp32 safetensors (save_pretrained), before")
    onnx_bytes: dict[str, int] = Field(description="graph role -> its .onnx and .data files as stored")
    onnx_dense_bytes: dict[str, int] = Field(description="graph role -> the same graph with dense initializers")
    encoded: dict[str, int] = Field(description="model/ and each graph role -> tensors stored as bitmask + values")


class Sparsity(_Model):
    """Magnitude sparsity on the decoder's Linear weights, N:M or unstructured (masks held fixed through recovery)."""

    pattern: str = Field(description="N:M, e.g. 2:4; or 'unstructured F'")
    n: int | None = Field(None, description="N:M only")
    m: int | None = Field(None, description="N:M only")
    fraction: float | None = Field(None, description="unstructured: the share zeroed in each decoder Linear weight")
    weights: int = Field(description="decoder Linear weights masked")
    decoder_zero_share: float | None = Field(None, description="zeros in the masked weights, in the result")
    total_zero_share: float | None = Field(None, description="zeros in all parameters (embeddings included)")
    perplexity_masked: float | None = Field(None, description="held-out perplexity (PyTorch) right after masking, "
                                            "before recovery")
    storage: SparseStorage | None = Field(None, description="unstructured: the compressed storage, measured")
    sparse_kernels: bool = Field(description="whether sparse kernels ran it (else the latency is dense)")


class Recovery(_Model):
    """The fine-tuning after pruning or sparsity, with the dstool training engine, and its gate."""

    steps: int
    lr: float = Field(description="peak learning rate (warm-up, cosine decay)")
    distill: bool = Field(description="loss = cross-entropy + KL to the original model's logits")
    kept: bool = Field(description="false: it raised the calibration perplexity, the weights before it are kept")
    calibration_ppl_before: float = Field(description="on calibration tokens (training split), before recovery")
    calibration_ppl_after: float
    final_train_loss: float | None
    distill_kl: tuple[float, float] | None = Field(None, description="KL to the teacher, first and last window")


class Recipe(_Model):
    """What compress did, in order: prune, sparsify, recover, quantize."""

    pruning: Pruning | None = None
    sparsity: Sparsity | None = None
    recovery: Recovery | None = None
    quantization: Quantization | None = None


class Measured(_Model):
    """One model as measured: the input (before) or the result (after)."""

    parameters: int
    onnx_bytes: int = Field(description="the logits graph and its weights file")
    perplexity: float = Field(description="on the held-out tokens `heldout` names")
    zero_shot_accuracy: float | None = Field(description="the cloze task's accuracy (`zero_shot_items` items, chance "
                                             "1 / `zero_shot_choices`); None: the held-out text holds no items")
    latency_ms_batch1: float = Field(description="prefill: one logits-graph forward of batch 1 x latency_seq_len "
                                     "tokens, ONNX Runtime CPU, median (ms)")
    latency_ms_batch8: float
    decode_tokens_per_s_batch1: float = Field(description="generation: tokens per second of the key/value-cache "
                                              "decoder graph, decoding one token per sequence per step after a "
                                              "decode_prompt_len-token prompt, batch 1, median")
    decode_tokens_per_s_batch16: float


SpeedTarget = Literal["decode", "batched-decode", "prefill"]
SPEED_FIGURES: dict[str, tuple[str, str, str]] = {  # speed target -> Figures map, its key, what it is
    "decode": ("decode_speedup", "1", "decoding tokens/s at batch 1"),
    "batched-decode": ("decode_speedup", "16", "decoding tokens/s at batch 16"),
    "prefill": ("speedup", "8", "prefill latency at batch 8"),
}


class Figures(_Model):
    """Measured in the run that wrote the manifest: the input model (before) against the result (after)."""

    before: Measured
    after: Measured
    compression_ratio: float = Field(description="ONNX bytes after / before")
    perplexity_change_pct: float = Field(description="held-out perplexity change")
    top1_agreement: float = Field(description="share of the held-out positions perplexity scores where the result's "
                                  "most likely next token is the input model's")
    recovery: dict[str, float] = Field(default_factory=dict, description="the result's quality as a % of the input's "
                                       "(the field's measure): perplexity = before / after x 100 on the held-out "
                                       "tokens, cloze = accuracy after / before x 100")
    min_recovery: float | None = Field(None, description="the opt-in quality gate (--min-recovery): the perplexity "
                                       "recovery at least this %; null: no gate")
    zero_shot_items: int = Field(description="items of the cloze task (dstool.compress.quality) on the held-out text")
    zero_shot_choices: int = Field(description="candidate words per item (chance: 1 / choices)")
    speedup: dict[str, float] = Field(description="prefill: batch size -> latency before / after (ONNX Runtime CPU)")
    decode_speedup: dict[str, float] = Field(description="generation: batch size -> decoding tokens/s after / before")
    decode_prompt_len: int = Field(description="prompt tokens prefilled before the timed decoding steps")
    decode_new_tokens: int = Field(description="decoding steps timed per generation")
    speed_target: SpeedTarget | None = Field(None, description="the figure the opt-in speed gate compared "
                                             "(--speed-gate); null: no gate")
    latency_seq_len: int
    heldout: str = Field(description="which tokens the perplexity is measured on")
    machine: str

    def speedup_on(self, target: str) -> tuple[float, str]:
        """The speed-up (after against before: > 1 is faster) of the figure a speed target names, and what it is."""
        field, key, what = SPEED_FIGURES[target]
        return getattr(self, field)[key], what


class TorchaoFigures(_Model):
    """torchao int8, measured in PyTorch (CPU)."""

    int8_weights: int
    bytes: int
    fp32_bytes: int
    perplexity_fp32: float
    perplexity_int8: float
    latency_ms_batch8_fp32: float
    latency_ms_batch8_int8: float


class CompressedModel(Manifest):
    """A `dstool compress` output: the compressed PyTorch weights and both ONNX graphs, made by one recipe."""

    PRODUCER: ClassVar[str] = "dstool compress"

    kind: Literal["compressed-model"] = "compressed-model"
    source: SourceModel = Field(description="the input model")
    settings: dict = Field(description="the CompressConfig it ran with")
    model: str = Field("model", description="Hugging Face folder of the compressed weights (and the tokenizer)")
    graphs: dict[Literal["logits", "decoder", "fused"], Graph] = Field(
        description="logits: ids -> logits; decoder: with a key/value cache (prefill and decoding steps); fused: the "
        "fused-attention decoder NAME_llm runs (Llama-layout models only), the same recipe as the decoder")
    recipe: Recipe = Field(description="what was done to the model, as data")
    figures: Figures = Field(description="measured in this run: before against after")
    torchao: TorchaoFigures | None = Field(None, description="--engine torchao: the PyTorch-side figures")
    report: str = Field("report.md", description="the human-readable report (and report.png)")


# ---- dstool export -------------------------------------------------------------------------------------

class Deployment(_Model):
    """One version of one model family (NAME, NAME_decoder, ..., NAME_generate) in a Triton repository."""

    name: str = Field(description="the family's name (the tensor model's)")
    version: int = Field(description="the version folder every model of the family got")
    models: dict[str, str] = Field(description="role -> Triton model name")
    source: SourceModel = Field(description="the Hugging Face folder the graphs and the tokenizer come from")
    compressed: str | None = Field(None, description="the dstool compress output it was deployed from")
    recipe: Recipe | None = Field(None, description="that output's recipe (None: fp32, exported here)")
    graphs: dict[str, str] = Field(description="role -> sha256 of the deployed .onnx file (logits, decoder; fused: "
                                   "NAME_llm's fused-attention decoder, where it has one; mtp1..mtpD: its MTP draft "
                                   "graphs, a DeepSeek-V3 model's MTP depths)")
    settings: dict = Field(description="the ExportConfig it was written with")
    adapters: dict[str, str] = Field(default_factory=dict, description="LoRA adapter name -> sha256 of its files "
                                     "(those NAME_llm loads at start; more may be loaded at run time)")
    created: str = Field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%S%z"))


class Repository(Manifest):
    """A Triton model repository written by `dstool export`: what each deployed version is made of."""

    PRODUCER: ClassVar[str] = "dstool export"

    kind: Literal["model-repository"] = "model-repository"
    deployments: list[Deployment] = Field(default_factory=list, description="newest last")


class EdgePart(_Model):
    """One ORT-format graph of an edge package."""

    path: str = Field(description="the .ort file, relative to the manifest")
    bytes: int
    layers: list[int] = Field(default_factory=list, description="the decoder layers it runs (blocks)")
    inputs: list[str] = Field(description="what it takes: input_ids, hidden.N, attention_mask, position_ids, "
                              "past_key_values.layers.N.*")
    outputs: list[str] = Field(description="what it gives: hidden.N, cache.layers.N.*, logits")


class EdgeParity(_Model):
    """The package against the unsplit decoder graph it was cut from, both in onnxruntime, at export."""

    max_abs_logit_diff: float = Field(description="over a prefill and single-token decoding steps")
    greedy_tokens: int = Field(description="greedy tokens generated by both, all equal (else the export fails)")


class EdgePackage(Manifest):
    """A `dstool export --target edge` package: the decoder graph cut into ORT-format parts, the embedding and head
    resident, the decoder layers in blocks a runner loads on demand."""

    PRODUCER: ClassVar[str] = "dstool export --target edge"

    kind: Literal["edge-package"] = "edge-package"
    source: SourceModel = Field(description="the Hugging Face folder the graph and the tokenizer come from")
    compressed: str | None = Field(None, description="the dstool compress output whose decoder graph was cut")
    recipe: Recipe | None = Field(None, description="that output's recipe (None: fp32, exported here)")
    onnxruntime: str = Field(description="the onnxruntime that converted the parts: that release or a newer one runs "
                             "them")
    ort_format_version: str = Field(description="the ORT format version the files declare (a runtime refuses "
                                    "versions it does not know)")
    opset: int = Field(description="the ai.onnx opset of the graphs")
    target_platform: Literal["arm"] = Field("arm", description="convert_onnx_models_to_ort --target_platform: no "
                                            "x86-only layouts (NCHWc)")
    optimization: str = Field(description="the graph optimizations baked into the .ort files")
    embed: EdgePart = Field(description="resident: input_ids -> hidden.0")
    head: EdgePart = Field(description="resident: hidden.L (final norm, lm_head) -> logits")
    blocks: list[EdgePart] = Field(description="loaded on demand: hidden.I and the layers' caches -> hidden.J and "
                                   "the grown caches")
    layers: int = Field(description="decoder layers")
    layers_per_block: int
    resident_bytes: int = Field(description="the embedding's and the head's files")
    head_last_position: bool = Field(description="measured at export: the head gives the last position the same "
                                     "logits alone as within the whole prompt, so a prefill runs it on that position "
                                     "only (false where a per-tensor int8 activation scale spans every position)")
    cache: dict[str, list[int]] = Field(description="past_key_values.layers.N.* -> [kv_heads, head_dim]")
    operators_config: str = Field(description="the operators and types the parts use, for an ONNX Runtime minimal "
                                  "build (build.py --minimal_build --include_ops_by_config FILE "
                                  "--enable_reduced_operator_type_support)")
    tokenizer: str = Field("tokenizer", description="folder of the tokenizer files (tokenizer.json as transformers "
                           "configures it)")
    eos_token_ids: list[int]
    max_positions: int
    parity: EdgeParity


# ---- dstool batch --------------------------------------------------------------------------------------

class BatchInput(_Model):
    """The data set a batch job read."""

    path: str = Field(description="file or folder, or the embedded prompts")
    format: Literal["jsonl", "parquet", "csv", "embedded"]
    fingerprint: str = Field(description="sha256 over its files' contents (the embedded prompts: over their text)")
    rows: int = Field(description="rows used (after --max-rows)")


class BatchPartition(_Model):
    """One output partition, written atomically by the task that computed it."""

    index: int
    file: str = Field(description="its rows, relative to the output folder")
    rows: int = Field(description="rows in the file")
    failed: int = Field(description="rows recorded in failures.jsonl instead")
    prompt_tokens: int
    generated_tokens: int
    seconds: float = Field(description="the task's computing time")


class BatchFigures(_Model):
    """What the run that finished the job measured (partitions done by an earlier run count their own time)."""

    rows: int
    failed: int
    prompt_tokens: int
    generated_tokens: int
    seconds: float = Field(description="wall time of this run's Spark job")
    rows_per_s: float
    generated_tokens_per_s: float
    partitions_skipped: int = Field(description="partitions an earlier run had finished")


class BatchOutput(Manifest):
    """A `dstool batch` output: each partition's rows, which model version made them, and the figures."""

    PRODUCER: ClassVar[str] = "dstool batch"

    kind: Literal["batch-output"] = "batch-output"
    job: str = Field(description="sha256 of what decides the results (input, model version, task, options): a "
                     "re-run with the same job resumes, another one is refused")
    status: Literal["running", "done"]
    input: BatchInput
    task: Literal["generate", "score"]
    engine: Literal["onnx", "triton"]
    deployment: Deployment = Field(description="the repository's entry for the model version used")
    settings: dict = Field(description="the BatchConfig it ran with")
    partitions: list[BatchPartition] = Field(default_factory=list, description="finished partitions, by index")
    planned_partitions: int
    failures: str | None = Field(None, description="failures.jsonl: the rows that could not run, with the reason")
    figures: BatchFigures | None = None


KINDS: tuple[type[Manifest], ...] = (TrainRun, HFModel, GGUFModel, Checkpoint, UniversalCheckpoint, CompressedModel,
                                      Repository, EdgePackage, BatchOutput)


def weights_sha256(folder: Path) -> str:
    """A model folder's fingerprint: sha256 over its weight files' names and sha256 digests."""
    h = hashlib.sha256()
    for p in sorted(Path(folder).glob("*.safetensors")) + sorted(Path(folder).glob("*.bin")):
        h.update(f"{p.name}:{sha256_file(p)}\n".encode())
    return h.hexdigest()


def source_model(folder: Path) -> SourceModel:
    kind = kind_of(folder) or "huggingface"
    origin = GGUFModel.read(folder) if kind == "gguf-model" else None
    return SourceModel(path=str(Path(folder).resolve()), kind=kind, weights_sha256=weights_sha256(folder),
                       gguf=origin.source if origin else None, gguf_sha256=origin.source_sha256 if origin else None)
