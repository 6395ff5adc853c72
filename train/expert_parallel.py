"""Expert parallelism for Hugging Face MoE models through DeepSpeed AutoEP, and back to the Hugging Face weights.

`deepspeed.initialize` replaces every MoE block (router + stacked routed experts + shared experts) with an
`AutoEPMoELayer` when the DeepSpeed config has an `expert_parallel` section: each rank of an expert-parallel group
keeps 1/K of the routed experts, tokens travel to their experts and back by all-to-all, shared experts and dense
layers stay data-parallel, and the model's own router (DeepSeek-V3's sigmoid group-limited top-k with its score
correction bias, V2's softmax top-k) is kept. ZeRO reduces expert gradients over the expert-data-parallel group.
`hf_state_dict` gathers the experts back into the Hugging Face names (the stacked `gate_up_proj` / `down_proj`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from dstool import architectures
from dstool.errors import UsageError


def check_model(hf_config, ep: int, model_ref: str) -> str:
    """The AutoEP preset for the model, or a one-line UsageError before any rank starts."""
    experts = getattr(hf_config, "n_routed_experts", None) or getattr(hf_config, "num_local_experts", None)
    if not experts:
        raise UsageError(f"--expert-parallel {ep} needs a mixture-of-experts model; {model_ref} "
                         f"({hf_config.model_type}) has no routed experts: drop --expert-parallel")
    # the AutoEP presets (same names as the model types) that `hf_state_dict` maps back
    known = architectures.architecture(hf_config.model_type)
    if known is None or not known.expert_parallel:
        supported = ", ".join(architectures.with_capability("expert_parallel"))
        raise UsageError(f"--expert-parallel supports the model types {supported}; {model_ref} is "
                         f"{hf_config.model_type}: drop --expert-parallel")
    if experts % ep:
        raise UsageError(f"--expert-parallel {ep} does not divide the {experts} routed experts of {model_ref}: use "
                         "a divisor of the expert count")
    return hf_config.model_type


def _layers(module) -> list[tuple[str, Any]]:
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer  # noqa: PLC0415 (deepspeed: the launcher (dstool.train.api) imports this module and starts no DeepSpeed)

    return [(name, m) for name, m in module.named_modules() if isinstance(m, AutoEPMoELayer)]


def _full(t: torch.Tensor) -> torch.Tensor:
    """A parameter whole on this rank (ZeRO-3 gathers it over its own partition group: experts over theirs)."""
    if hasattr(t, "ds_id"):
        from deepspeed.runtime.zero.partition_parameters import GatheredParameters  # noqa: PLC0415 (deepspeed: the launcher (dstool.train.api) imports this module and starts no DeepSpeed)

        with GatheredParameters([t]):
            return t.detach().cpu().clone()
    return t.detach().cpu()


def hf_state_dict(engine, preset: str) -> dict[str, torch.Tensor] | None:
    """Collective: the engine's weights under the Hugging Face names, on rank 0 (None elsewhere)."""
    from deepspeed.checkpoint.autoep_affine import autoep_experts_for_rank  # noqa: PLC0415 (deepspeed: the launcher (dstool.train.api) imports this module and starts no DeepSpeed)
    from deepspeed.module_inject.auto_ep_presets.registry import PRESET_MODELS  # noqa: PLC0415 (deepspeed: the launcher (dstool.train.api) imports this module and starts no DeepSpeed)

    p = PRESET_MODELS[preset]
    module, rank = engine.module, dist.get_rank()
    layers = dict(_layers(module))
    router = {"router.gate.weight": "weight", "router.gate.bias": "bias",
              "router.e_score_correction_bias": "e_score_correction_bias"}
    state: dict[str, torch.Tensor] = {}
    for name, t in module.state_dict(keep_vars=True).items():
        prefix = next((lp for lp in layers if name.startswith(lp + ".")), None)
        rest = name[len(prefix) + 1:] if prefix else ""
        if rest in ("experts.w1", "experts.w2", "experts.w3"):
            continue  # gathered below, per expert
        if prefix is None or rest.startswith(p.shared_experts_pattern + "."):
            hf_name = name
        elif rest in router:
            hf_name = f"{prefix}.{p.router_pattern}.{router[rest]}"
        else:
            raise RuntimeError(f"expert parallelism: no Hugging Face name for {name}")
        value = _full(t)  # a collective under ZeRO-3: every rank takes part
        if rank == 0:
            state[hf_name] = value
    for prefix, layer in layers.items():
        group_ranks = dist.get_process_group_ranks(layer.ep_group)
        gathered: dict[str, list[torch.Tensor]] = {}
        for w in ("w1", "w2", "w3"):  # every expert rank holds as many experts: shards of one shape
            local = _full(getattr(layer.experts, w)).to(engine.device)  # NCCL gathers device tensors only
            if 0 not in group_ranks:  # another expert-data-parallel replica: rank 0's group holds every expert
                continue
            parts = [torch.empty_like(local) for _ in group_ranks] if rank == 0 else []
            dist.gather(local, parts or None, dst=0, group=layer.ep_group)
            gathered[w] = [part.cpu() for part in parts]
        if rank != 0:
            continue
        by_expert: dict[int, dict[str, torch.Tensor]] = {}
        for ep_rank in range(len(group_ranks)):
            for i, e in enumerate(autoep_experts_for_rank(layer.expert_placement_descriptor, ep_rank)):
                by_expert[int(e)] = {w: gathered[w][ep_rank][i] for w in gathered}
        experts = [by_expert[e] for e in range(layer.num_experts)]
        # Hugging Face computes gate, up = x @ gate_up_proj[e].T chunked in two: the gate rows first
        state[f"{prefix}.{p.experts_pattern}.{p.expert_w1}"] = torch.stack(
            [torch.cat([x["w1"], x["w3"]], dim=0) for x in experts])
        state[f"{prefix}.{p.experts_pattern}.{p.expert_w2}"] = torch.stack([x["w2"] for x in experts])
    return state if rank == 0 else None
