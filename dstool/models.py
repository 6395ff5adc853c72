"""Model factory: named presets built from a config (random init) or a local Hugging Face folder."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoConfig, DeepseekV2Config, DeepseekV3Config, LlamaConfig, PretrainedConfig

from dstool.artifacts import model_hint
from dstool.errors import UsageError


def _tiny(vocab_size: int) -> PretrainedConfig:
    # DeepSeek LLM (7B/67B) is the Llama architecture; grouped-query attention (6 query heads per
    # 2 key/value heads) so pruning and export exercise GQA.
    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=192, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=1024,
        rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
    )


def _tiny_moe(vocab_size: int) -> PretrainedConfig:
    # DeepSeek-V3: multi-head latent attention (q/kv LoRA ranks) and routed + shared experts.
    return DeepseekV3Config(
        vocab_size=vocab_size, hidden_size=192, intermediate_size=512, moe_intermediate_size=128,
        num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
        q_lora_rank=96, kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
        max_position_embeddings=1024, tie_word_embeddings=False, rope_scaling=None,
    )


def _deepseek_7b(vocab_size: int) -> PretrainedConfig:
    # deepseek-ai/deepseek-llm-7b-base shape (its own tokenizer has 102,400 entries).
    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=4096, intermediate_size=11008, num_hidden_layers=30,
        num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
        rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
    )


def _deepseek_v3(vocab_size: int) -> PretrainedConfig:
    # deepseek-ai/DeepSeek-V3 shape (671 B parameters, 37 B active; its tokenizer has 129,280 entries), without the
    # multi-token-prediction module; 4K positions, as pre-trained before the YaRN extension.
    return DeepseekV3Config(
        vocab_size=vocab_size, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, first_k_dense_replace=3, num_attention_heads=128, num_key_value_heads=128,
        n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        max_position_embeddings=4096, tie_word_embeddings=False,
    )


def _deepseek_v2_lite(vocab_size: int) -> PretrainedConfig:
    # deepseek-ai/DeepSeek-V2-Lite shape (15.7 B parameters, 2.4 B active; its tokenizer has 102,400 entries).
    return DeepseekV2Config(
        vocab_size=vocab_size, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
        num_hidden_layers=27, first_k_dense_replace=1, num_attention_heads=16, num_key_value_heads=16,
        n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, q_lora_rank=None, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, max_position_embeddings=4096,
        tie_word_embeddings=False,
    )


PRESETS = {"tiny": _tiny, "tiny-moe": _tiny_moe, "deepseek-7b": _deepseek_7b, "deepseek-v3": _deepseek_v3,
           "deepseek-v2-lite": _deepseek_v2_lite}
PRESET_VOCAB = {"deepseek-7b": 102400, "deepseek-v3": 129280, "deepseek-v2-lite": 102400}


def is_preset(name: str) -> bool:
    return name in PRESETS


def check_model_ref(ref: str) -> None:
    """Fail early, in one line, when `ref` is neither a preset nor a Hugging Face causal-LM folder."""
    if is_preset(ref):
        return
    p = Path(ref)
    if not p.exists():
        raise UsageError(f"unknown model '{ref}': use a preset ({', '.join(PRESETS)}), a real model (smollm2), a "
                         "local Hugging Face folder or a .gguf file")
    if not (p / "config.json").is_file():
        hint = model_hint(p) or ": pass a Hugging Face model folder"
        raise UsageError(f"model folder {ref} has no config.json{hint}")
    if any(p.glob("*.sparse.safetensors")):
        raise UsageError(f"model folder {ref} holds sparse weights (bitmask + values, from `dstool compress "
                         "--sparsity F`) that transformers does not load: pass that compress output folder to dstool "
                         "export, or load it in Python with dstool.compress.load")
    cfg = AutoConfig.from_pretrained(p)
    archs = getattr(cfg, "architectures", None) or []
    if archs and not any(a.endswith("ForCausalLM") for a in archs):
        raise UsageError(f"model folder {ref} is a {archs[0]}, not a causal LM")


def check_model_folder(folder: Path) -> None:
    """A local Hugging Face causal-LM folder that holds weights, else a one-line UsageError."""
    check_model_ref(str(folder))
    if not any(Path(folder).glob("*.safetensors")) and not any(Path(folder).glob("*.bin")):
        raise UsageError(f"model folder {folder} has no weights (*.safetensors or *.bin)")


def model_config(ref: str, vocab_size: int) -> PretrainedConfig:
    """The Hugging Face config of a preset (with `vocab_size`) or of a model folder (its own): shapes, no weights."""
    return preset_config(ref, vocab_size, {}) if is_preset(ref) else AutoConfig.from_pretrained(ref)


def preset_config(name: str, vocab_size: int, special_ids: dict[str, int]) -> PretrainedConfig:
    """The config of preset `name` with the tokenizer's vocabulary and special-token ids."""
    cfg = PRESETS[name](vocab_size)
    for key, value in special_ids.items():
        setattr(cfg, key, value)
    cfg.architectures = [type(cfg).__name__.removesuffix("Config") + "ForCausalLM"]
    return cfg


def count_parameters(model) -> tuple[int, int]:
    """(total, active per token): routed experts count only for the share of experts each token uses."""
    total = active = 0
    cfg = model.config
    share = 1.0
    if getattr(cfg, "n_routed_experts", None):
        share = cfg.num_experts_per_tok / cfg.n_routed_experts
    for name, p in model.named_parameters():
        n = p.ds_numel if hasattr(p, "ds_numel") else p.numel()
        total += n
        active += int(n * share) if is_routed_expert(name) else n
    return total, active


def is_routed_expert(name: str) -> bool:
    """Whether parameter `name` (or a module's name + ".") belongs to a routed expert (not the shared experts)."""
    return ".experts." in name
