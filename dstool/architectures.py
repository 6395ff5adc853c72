"""The architectures (model families) dstool knows and what each stage can do with each — one table the stages read
(as torchtitan's TrainSpec), so that an architecture gains a capability in one place: the fused-attention decoder of
export and compress, train's tensor, pipeline and expert parallelism, compress's structured pruning. A model type
that is not here still trains data-parallel (ZeRO), quantizes and exports, through Hugging Face's own classes."""

from __future__ import annotations

from dataclasses import dataclass

# train --tensor-parallel: (a Linear layer's name, relative to a decoder layer, as a regex; how it is cut)
_LLAMA_SPLITS = ((r"self_attn\.[qkv]_proj", "column"), (r"self_attn\.o_proj", "row"),
                 (r"mlp\.(gate|up)_proj", "column"), (r"mlp\.down_proj", "row"))
_DEEPSEEK_V3_SPLITS = ((r"self_attn\.(q_proj|q_b_proj|kv_b_proj)", "column"), (r"self_attn\.o_proj", "row"),
                       (r"mlp\.(shared_experts\.)?(gate|up)_proj", "column"),
                       (r"mlp\.(shared_experts\.)?down_proj", "row"))


@dataclass(frozen=True)
class Architecture:
    """One model type (a Hugging Face config's `model_type`) and what dstool does with it beyond the common path."""

    model_type: str
    name: str  # as messages name it
    fused_decoder: bool = False  # the Llama layout: export's and compress's fused-attention decoder graph
    tensor_splits: tuple[tuple[str, str], ...] = ()  # train --tensor-parallel's own cut (else AutoTP's tp_plan)
    pipeline: bool = False  # train --pipeline-stages cuts it
    expert_parallel: bool = False  # train --expert-parallel: DeepSpeed's AutoEP preset of the same name
    pruning: str = "llama"  # compress --prune: the pruning family (compress/prune_llama.py, prune_moe.py)
    mtp: bool = False  # train --mtp-layers: DeepSeek-V3's multi-token prediction layers (train/mtp.py)


ARCHITECTURES = {a.model_type: a for a in (
    Architecture("llama", "Llama", fused_decoder=True, tensor_splits=_LLAMA_SPLITS, pipeline=True),
    Architecture("qwen2", "Qwen2", fused_decoder=True),
    Architecture("mistral", "Mistral", fused_decoder=True),
    Architecture("deepseek_v2", "DeepSeek-V2", expert_parallel=True, pruning="deepseek_v2"),
    Architecture("deepseek_v3", "DeepSeek-V3", tensor_splits=_DEEPSEEK_V3_SPLITS, pipeline=True, expert_parallel=True,
           pruning="deepseek_v3", mtp=True),
)}


def architecture(model_type: str | None) -> Architecture | None:
    """The architecture of a model type (None: one dstool has no table for)."""
    return ARCHITECTURES.get(model_type or "")


def with_capability(capability: str) -> tuple[str, ...]:
    """The model types that have `capability` (an Architecture field that is true or non-empty), for messages."""
    return tuple(t for t, a in ARCHITECTURES.items() if getattr(a, capability))
