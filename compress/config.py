"""`CompressConfig`: the options of `dstool compress`, validated; importing it loads no torch (fast CLI errors)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from dstool.artifacts import SpeedTarget
from dstool.config import CommandConfig, positional


class CompressConfig(CommandConfig):
    """Options of `dstool compress` (field names are the flags with dashes)."""

    model: str = positional("Hugging Face causal-LM folder (e.g. the model/ of a dstool train run), a .gguf file "
                            "(converted once) or smollm2 (a real pretrained model, fetched once)",
                            metavar="MODEL_DIR")
    output: str = Field(description="folder for model/, onnx/ (both graphs), dstool.json and report.{md,png}")
    bits: int | None = Field(None, description="8: int8 (ONNX Runtime, --int8 says which); 4: weight-only 4-bit "
                             "MatMulNBits")
    int8: Literal["weight-only", "dynamic"] = Field("weight-only", description="--bits 8: weight-only int8 "
                                                    "(MatMulNBits, per-block scales, activations quantized per block "
                                                    "or fp32), or dynamic (MatMulInteger: per-tensor activations, "
                                                    "fast on VNNI; real models' activation outliers cost accuracy)")
    int4: Literal["rtn", "gptq"] = Field("rtn", description="--bits 4: round-to-nearest (ONNX Runtime's quantizer), "
                                         "or GPTQ: each decoder Linear's rounding errors compensated on calibration "
                                         "activations, layer by layer on 64 x 256 calibration tokens "
                                         "(SmolLM2-135M: 8 minutes on 2 shared CPU cores); measured worse than "
                                         "rtn on SmolLM2 (docs/real-model.md)")
    group_size: int | None = Field(None, description="weight-only (4-bit, weight-only int8): input channels per "
                                   "scale [default: 128 for int8, 32 for 4-bit]")
    prune: float | None = Field(None, description="share of the decoder layers' parameters removed; the split between "
                                "key/value groups, query heads and MLP channels (MoE: heads, routed experts and "
                                "expert channels) is chosen by measured calibration loss and ONNX Runtime latency")
    prune_ppl_tolerance: float = Field(50.0, ge=0, description="--prune: of the layouts whose calibration perplexity "
                                       "is within this % of the best layout's, the fastest on ONNX Runtime is kept "
                                       "(0: the lowest-loss layout, untimed)")
    prune_heads: float | None = Field(None, description="share of query heads removed per key/value group (MoE: of "
                                      "the attention heads)")
    prune_mlp: float | None = Field(None, description="share of MLP intermediate channels removed (MoE: of every "
                                    "expert's too)")
    prune_experts: float | None = Field(None, description="MoE: share of each MoE layer's routed experts removed, "
                                        "the least routed on calibration tokens")
    sparsity: str | None = Field(None, description="N:M magnitude sparsity on decoder Linear layers, e.g. 2:4; or a "
                                 "fraction, e.g. 0.65: that share of every decoder Linear weight zeroed by magnitude "
                                 "(unstructured), stored as a bitmask and the nonzero values")
    recover_steps: int = Field(0, ge=0, description="fine-tuning steps after pruning/sparsity")
    recover_lr: float = Field(1e-3, gt=0, description="recovery peak learning rate (warm-up, cosine decay)")
    distill: bool = Field(False, description="recovery loss = cross-entropy + KL to the original model's logits")
    calibration: str | None = Field(None, description="text/jsonl data for importance, held-out perplexity and "
                                    "recovery")
    max_ppl_increase: float = Field(1.0, gt=0, description="--int8 dynamic: keep layers in fp32 until perplexity "
                                    "rises less than this %")
    speed_gate: SpeedTarget | None = Field(None, description="opt-in: fail, writing nothing, when the quantized "
                                           "model measures slower than fp32 on this figure: decode (tokens/s at "
                                           "batch 1), batched-decode (batch 16) or prefill (latency at batch 8 x "
                                           "128); without it the speeds are measured and reported, slower too",
                                           json_schema_extra={"cli": {"metavar": "FIGURE"}})
    min_recovery: float | None = Field(None, gt=0, le=100, description="opt-in: fail, writing nothing, when the "
                                       "result keeps less than this % of the input's held-out perplexity (before / "
                                       "after x 100)",
                                       json_schema_extra={"cli": {"metavar": "PCT"}})
    latency_repeats: int = Field(20, ge=1, description="timed ONNX Runtime runs per latency figure (per decoding "
                                 "figure: at most 5 generations of 32 tokens)")
    baseline_cache: bool = Field(True, description="reuse the fp32 baseline (both graphs, their figures) of an input "
                                 "compressed before with the same data and versions, kept in $DSTOOL_CACHE_DIR "
                                 "(~/.cache/dstool)")
    engine: Literal["onnxruntime", "torchao"] = Field("onnxruntime", description="int8 for ONNX Runtime, or "
                                                      "torchao's PyTorch int8")

    @field_validator("sparsity", mode="before")
    @classmethod
    def _number_as_text(cls, v):  # YAML reads `sparsity: 0.65` as a number
        return str(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v

    @property
    def sparsity_fraction(self) -> float | None:
        """--sparsity as a fraction (unstructured), None for N:M or none."""
        return None if self.sparsity is None or ":" in self.sparsity else float(self.sparsity)

    @property
    def block(self) -> int:
        """The weight-only block: --group-size, else what measured best on a real model (docs/real-model.md)."""
        return self.group_size or (128 if self.bits == 8 else 32)

    @property
    def prunes(self) -> bool:
        """Structured pruning asked for: --prune, or any of the explicit shares."""
        return bool(self.prune or self.prune_heads or self.prune_mlp or self.prune_experts)

    @model_validator(mode="after")
    def _check(self) -> CompressConfig:
        if self.bits not in (None, 8, 4):
            raise ValueError(f"bits must be 8 or 4, not {self.bits}")
        for name in ("prune", "prune_heads", "prune_mlp", "prune_experts"):
            v = getattr(self, name)
            if v is not None and not 0 < v < 1:
                raise ValueError(f"{name} must be a ratio strictly between 0 and 1, got {v}")
        given = self.prune_heads is not None or self.prune_mlp is not None or self.prune_experts is not None
        if self.prune is not None and given:
            raise ValueError("give --prune or --prune-heads/--prune-mlp/--prune-experts, not both")
        if self.sparsity is not None:
            m = re.fullmatch(r"(\d+):(\d+)", self.sparsity)
            f = re.fullmatch(r"0?\.\d+", self.sparsity)
            if not (m and 0 < int(m.group(1)) < int(m.group(2)) or f and 0 < float(self.sparsity) < 1):
                raise ValueError(f"sparsity must be an N:M pattern with 0 < N < M (e.g. 2:4) or a fraction strictly "
                                 f"between 0 and 1 (e.g. 0.65), got '{self.sparsity}'")
        if self.group_size is not None and self.group_size not in (16, 32, 64, 128, 256):
            raise ValueError(f"group_size must be 16, 32, 64, 128 or 256 (MatMulNBits blocks), not {self.group_size}")
        if "int8" in self.model_fields_set and self.bits != 8:
            raise ValueError("--int8 chooses how --bits 8 quantizes: give --bits 8 with it")
        if "int4" in self.model_fields_set and self.bits != 4:
            raise ValueError("--int4 chooses how --bits 4 quantizes: give --bits 4 with it")
        if "group_size" in self.model_fields_set and not (self.bits == 4 or self.bits == 8
                                                          and self.int8 == "weight-only"):
            raise ValueError("--group-size is the weight-only block: give it with --bits 4 or --bits 8 (weight-only)")
        if "max_ppl_increase" in self.model_fields_set and not (self.bits == 8 and self.int8 == "dynamic"):
            raise ValueError("--max-ppl-increase chooses what --int8 dynamic keeps in fp32: give --bits 8 --int8 "
                             "dynamic with it")
        if self.engine == "torchao" and self.bits != 8:
            raise ValueError("engine torchao is the PyTorch int8 path: use it with bits 8")
        if not (self.bits or self.prune or given or self.sparsity):
            raise ValueError("nothing to do: give --bits, --prune (or --prune-heads/--prune-mlp) or --sparsity")
        if self.recover_steps and not (self.prune or given or self.sparsity):
            raise ValueError("--recover-steps needs pruning or sparsity to recover from")
        if "prune_ppl_tolerance" in self.model_fields_set and not self.prune:
            raise ValueError("--prune-ppl-tolerance chooses among --prune's layouts: give --prune RATIO with it")
        if self.distill and not self.recover_steps:
            raise ValueError("--distill needs --recover-steps (it is the recovery fine-tuning's loss)")
        return self
