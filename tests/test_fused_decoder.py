"""The fused-attention decoder (dstool/fused_decoder.py) against transformers, for each architecture that has one
(Llama, Llama-3 rope scaling, Qwen2 with its QKV biases, tied embeddings); the DeepSeek ones keep the exported
decoder, and say why."""

from __future__ import annotations

import pytest

SMALL = {"vocab_size": 300, "hidden_size": 96, "intermediate_size": 160, "num_hidden_layers": 2,
         "num_attention_heads": 6, "num_key_value_heads": 2, "max_position_embeddings": 256}
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


def _model(kind: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    if kind == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**SMALL)).eval()
    extra = {"llama3-rope": {"rope_scaling": LLAMA3_ROPE}, "tied": {"tie_word_embeddings": True}}.get(kind, {})
    return LlamaForCausalLM(LlamaConfig(**SMALL, **extra)).eval()


@pytest.mark.parametrize("kind", ["llama", "llama3-rope", "qwen2", "tied"])
def test_the_fused_decoder_equals_transformers(kind, tmp_path):
    from dstool.fused_decoder import export_fused_decoder, parity, unsupported

    model = _model(kind)
    assert unsupported(model.config) is None
    path = export_fused_decoder(model, tmp_path / "fused").path  # gated: prefill, steps, a chunk after cached positions
    assert parity(model, path).diff < 1e-4
    other = _model("qwen2" if kind != "qwen2" else "llama")  # the gate sees a wrong graph
    if other.config.vocab_size == model.config.vocab_size:
        other.model.layers[0].mlp.up_proj.weight.data *= 1.5
        assert parity(other, path).diff > 1e-2


def test_deepseek_models_keep_the_exported_decoder():
    from transformers import DeepseekV2Config, DeepseekV3Config

    from dstool.fused_decoder import unsupported

    assert "not a Llama-layout model" in unsupported(DeepseekV3Config())
    assert "not a Llama-layout model" in unsupported(DeepseekV2Config())


def test_the_parity_gate_scales_with_the_logits():
    """1e-3 absolute plus 1e-4 of the largest |logit|: a real model's fp32 rounding passes, a wrong graph does not."""
    from dstool.onnx_export import Parity, ParityError

    Parity(1.75e-3, 30.0).check(1e-3, "the 2:4 SmolLM2")  # measured on a 2:4-pruned SmolLM2-135M
    with pytest.raises(ParityError, match=r"0\.00175 > 0\.0011 .*largest \|logit\| 1\)"):
        Parity(1.75e-3, 1.0).check(1e-3, "a tiny model")
    with pytest.raises(ParityError):
        Parity(0.05, 30.0).check(1e-3, "a wrong graph")
