"""The options of `dstool export`: how a model family is laid out in a Triton repository, and its names."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from dstool.config import CommandConfig, positional
from dstool.decoding.adapters import NAME as ADAPTER_NAME
from dstool.decoding.engine import Speculation

STREAM_INTERVAL = 1  # tokens per streamed response: docs/export-serve.md has the measurement
NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


def model_names(name: str) -> dict[str, str]:
    """The repository's models: NAME (token ids -> logits) and the text-generation models around it."""
    return {"logits": name, "decoder": f"{name}_decoder", "tokenizer": f"{name}_tokenizer",
            "detokenizer": f"{name}_detokenizer", "generate": f"{name}_generate", "llm": f"{name}_llm"}


class RepositorySettings(CommandConfig):
    """How a model family is laid out in a Triton repository (the export options but the paths)."""

    name: str = Field("dstool_lm", description="model name in the repository")
    version: int | None = Field(None, ge=1, description="version folder (default: the next one)")
    max_batch_size: int = Field(8, ge=0, description="0 = no batching")
    instances: int = Field(1, ge=1, description="model instances (instance_group count)")
    device: Literal["cpu", "gpu"] = Field("cpu", description="gpu: KIND_GPU for the onnxruntime_onnx models "
                                          "(python-backend models run on the CPU)")
    backend: Literal["python", "onnxruntime"] = Field(
        "python", description="python: python backend running onnxruntime (any Triton); onnxruntime: platform "
        "onnxruntime_onnx (Triton with the ONNX Runtime backend)")
    dynamic_batching: bool = Field(True, description="dynamic_batching block")
    queue_delay_us: int = Field(2000, ge=0, description="dynamic batching: longest wait for more requests (µs)")
    response_cache: bool = Field(False, description="enable Triton's response cache for NAME and NAME_generate")
    prefix_cache: bool = Field(True, description="NAME_llm keeps computed prompt prefixes and reuses them (blocks of "
                               "16 tokens, least recently used out, within the engine's cache budget)")
    fused_attention: bool = Field(True, description="NAME_llm runs a decoder with fused attention over a cache "
                                  "updated in place (Llama-layout models; others keep the exported decoder)")
    stream_interval: int = Field(STREAM_INTERVAL, ge=1, le=64, description="NAME_llm streams a request's tokens in "
                                 "responses of this many (the first token and the last response always at once), "
                                 "as vLLM's --stream-interval")
    speculative_config: str | None = Field(
        None, description="NAME_llm drafts tokens and verifies them in one step while a single request runs "
        "(vLLM's speculative decoding; outputs unchanged), as vLLM's --speculative-config: by prompt lookup, "
        "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4, "
        "\"prompt_lookup_min\": 2}', or with a DeepSeek-V3 model's own MTP module (dstool train --mtp-layers), "
        "'{\"method\": \"deepseek_mtp\", \"num_speculative_tokens\": 1}'",
        json_schema_extra={"cli": {"metavar": "JSON"}})
    enable_lora: bool = Field(False, description="NAME_llm serves LoRA adapters beside the base model, each request "
                              "its own in one batch, loaded and unloaded at run time (implied by --adapter; Llama-"
                              "layout models, whose NAME_llm runs the fused-attention decoder)")
    max_lora_rank: int = Field(64, ge=1, le=1024, description="the highest LoRA rank NAME_llm loads (as vLLM's "
                               "--max-lora-rank)")
    max_loras: int = Field(16, ge=1, le=256, description="adapters NAME_llm holds loaded at once (as vLLM's "
                           "--max-cpu-loras)")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME_RE.match(v) or v in (".", ".."):
            raise ValueError(f"'{v}' is not a name Triton accepts: use letters, digits, '_', '-' and '.'")
        return v

    @field_validator("speculative_config", mode="before")
    @classmethod
    def _speculative(cls, v):
        """vLLM's speculative config (JSON text, or a mapping in YAML), checked and written as vLLM writes it."""
        return None if v is None else Speculation.parse(v if isinstance(v, (str, dict)) else str(v)).text()

    @model_validator(mode="after")
    def _batching(self) -> RepositorySettings:
        if self.max_batch_size == 0 and self.dynamic_batching:
            raise ValueError("--max-batch-size 0 disables batching, so dynamic batching cannot be on: give a max "
                             "batch size >= 1 or --no-dynamic-batching")
        return self


class ExportConfig(RepositorySettings):
    """`dstool export`: a Triton model repository, or an edge package, from a Hugging Face folder or a `dstool
    compress` output."""

    model: str = positional("Hugging Face causal-LM folder, a dstool compress output, a .gguf file or smollm2",
                            metavar="MODEL_DIR")
    target: Literal["triton", "edge"] = Field("triton", description="triton: a Triton model repository "
                                              "(--repository); edge: an ONNX Runtime-format package for a device "
                                              "(--output): embedding and head resident, the decoder layers in "
                                              "blocks loaded on demand")
    repository: str = Field("model_repository", description="repository folder")
    output: str = Field("edge_package", description="--target edge: the package folder")
    layers_per_block: int = Field(1, ge=1, description="--target edge: decoder layers per block file")
    adapters: list[str] = Field(default_factory=list, description="a PEFT LoRA adapter served beside the base, "
                                "as NAME=FOLDER (repeat; e.g. a dstool train --lora run's adapter folder): clients "
                                "pick it by name", json_schema_extra={"cli": {"flag": "--adapter",
                                                                              "metavar": "NAME=FOLDER"}})

    @field_validator("adapters")
    @classmethod
    def _adapters(cls, v: list[str]) -> list[str]:
        names = []
        for item in v:
            name, eq, folder = item.partition("=")
            if not eq or not folder or not ADAPTER_NAME.fullmatch(name):
                raise ValueError(f"adapter {item[:80]!r}: give NAME=FOLDER, NAME 1-64 letters, digits, '.', '_' or "
                                 "'-' beginning with a letter or digit")
            if name in names:
                raise ValueError(f"adapter {name!r} is given twice: give each adapter one name")
            names.append(name)
        return v

    @model_validator(mode="after")
    def _target(self) -> ExportConfig:
        given = self.model_fields_set
        wrong = given & {"output", "layers_per_block"} if self.target == "triton" else \
            given & (set(RepositorySettings.model_fields) | {"repository", "adapters"})
        if wrong:
            other = "edge" if self.target == "triton" else "triton"
            raise ValueError(f"--{sorted(wrong)[0].replace('_', '-')} applies to --target {other} only")
        return self

    def settings(self) -> RepositorySettings:
        values = {k: getattr(self, k) for k in RepositorySettings.model_fields}
        return RepositorySettings(**{**values, "enable_lora": self.enable_lora or bool(self.adapters)})
