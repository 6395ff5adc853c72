"""LoRA fine-tuning with PEFT: the model wrapped with adapters (only they train), and at the end the adapter saved
in PEFT's format and merged into the weights, so model/ stays a plain Hugging Face folder."""

from __future__ import annotations

import copy
import hashlib
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from dstool import log as dlog
from dstool.errors import UsageError

log = dlog.log

def spec(cfg) -> dict | None:
    """The adapter's shape, recorded with every checkpoint (a run resumes only the same adapter)."""
    if not cfg.lora:
        return None
    return {"rank": cfg.lora, "alpha": cfg.lora_alpha or 2.0 * cfg.lora, "dropout": cfg.lora_dropout,
            "targets": list(cfg.lora_targets), "base": base_id(cfg.model)}


def base_id(model: str) -> str:
    """Which base weights the adapter is trained on (checkpoints hold the adapter only): a preset's name, or a
    digest of the model folder's weight files' names, sizes and mtimes (a base trained further is another base)."""
    folder = Path(model)
    if not folder.is_dir():
        return f"preset:{model}"
    stamp = sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in folder.iterdir()
                   if f.suffix in (".safetensors", ".bin"))
    return hashlib.sha256(repr(stamp).encode()).hexdigest()[:16]


def wrap(model, cfg, quiet: bool = False):
    """The PEFT model around `model` (its weights frozen, adapters trainable)."""
    from peft import LoraConfig, get_peft_model  # noqa: PLC0415 (peft: only for --lora; the launcher imports this module)

    s = spec(cfg)
    assert s is not None
    targets = s["targets"][0] if s["targets"] == ["all-linear"] else s["targets"]
    try:
        peft_model = get_peft_model(model, LoraConfig(r=s["rank"], lora_alpha=s["alpha"], lora_dropout=s["dropout"],
                                                      target_modules=targets, task_type="CAUSAL_LM"))
    except ValueError as e:  # PEFT names the targets it could not find or cannot adapt
        first = str(e).strip().splitlines()[0]
        raise UsageError(f"--lora on {type(model).__name__}: {first[:300]} (choose --lora-target names among its "
                         "linear layers, e.g. q_proj, or all-linear)") from None
    if quiet:
        return peft_model
    numel = [getattr(p, "ds_numel", p.numel()) for p in peft_model.parameters()]
    trained = sum(n for n, p in zip(numel, peft_model.parameters()) if p.requires_grad)
    adapted = sum(1 for name, _ in peft_model.named_modules() if name.endswith(".lora_A"))
    log.info(f"dstool: LoRA rank {s['rank']} (alpha {s['alpha']:g}) on {adapted} modules: {trained:,} of "
             f"{sum(numel):,} parameters train ({trained / sum(numel):.2%})")
    return peft_model


def save_and_merge(adapter, state: dict[str, torch.Tensor], folder: Path) -> dict[str, torch.Tensor]:
    """Save the adapter of the PEFT model's full state dict `state` in `folder` (PEFT's files: adapter_config.json,
    adapter_model.safetensors) and return the base model's state dict with the adapter merged in, by PEFT's own
    merge on a copy built from `state` (linear layers and the stacked MoE experts PEFT adapts alike)."""
    from peft import get_peft_model  # noqa: PLC0415 (peft: only for --lora; the launcher imports this module)
    from peft.utils import get_peft_model_state_dict  # noqa: PLC0415 (peft: only for --lora; the launcher imports this module)

    config = adapter.peft_config["default"]
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    weights = get_peft_model_state_dict(adapter, state_dict=state)
    save_file({k: v.detach().cpu().contiguous() for k, v in weights.items()}, folder / "adapter_model.safetensors")
    with torch.device("meta"):
        clone = get_peft_model(AutoModelForCausalLM.from_config(adapter.get_base_model().config),
                               copy.deepcopy(config))
    clone.load_state_dict({k: v.detach().cpu() for k, v in state.items()}, assign=True)
    return clone.merge_and_unload().state_dict()

