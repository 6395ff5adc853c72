"""LoRA adapters for tests: PEFT's own files for a model folder, with random nonzero weights (a freshly made PEFT
adapter's B is zero, which would change nothing)."""

from __future__ import annotations

from pathlib import Path


def make_adapter(model_dir: Path, out_dir: Path, rank: int = 8, seed: int = 0,
                 targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                             "down_proj"), alpha: float | None = None, scale: float = 0.3) -> Path:
    """A PEFT LoRA adapter of `model_dir`'s model in `out_dir` (adapter_config.json, adapter_model.safetensors)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha or 2 * rank, target_modules=list(targets),
                                                  task_type="CAUSAL_LM"))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * scale)
    peft_model.save_pretrained(out_dir)
    return out_dir


def merged(model_dir: Path, adapter_dir: Path):
    """`model_dir`'s model with the adapter merged in by PEFT (fp32, eval)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter_dir).merge_and_unload().eval()
