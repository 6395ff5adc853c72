"""Structured pruning (attention query heads, MLP channels) and N:M sparsity for Llama-style causal LMs.

`prune_structured` physically shrinks the projections and rewrites the config, so the pruned model
saves and reloads with `AutoModelForCausalLM.from_pretrained` as an ordinary, smaller Llama.
`apply_n_m_sparsity` zeroes weights in place (2:4 by default) and returns the masks that
`reapply_masks` re-imposes after each optimizer step of recovery fine-tuning.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


@dataclass
class PruneResult:
    """Per-layer counts before and after pruning, and whole-model parameter counts."""

    heads_before: int
    heads_after: int
    kv_heads: int
    intermediate_before: int
    intermediate_after: int
    params_before: int
    params_after: int


def prune_structured(model, heads_ratio: float, mlp_ratio: float,
                     calibration: torch.Tensor | None = None) -> PruneResult:
    """Remove the least important query heads (the same number in every key/value group) and MLP channels.

    Importance is measured on `calibration` token ids [batch, seq] when given, otherwise from weight norms.
    A ratio of 0 leaves that part as it is; ratios must lie in [0, 1).
    """
    for name, ratio in (("heads_ratio", heads_ratio), ("mlp_ratio", mlp_ratio)):
        if not 0.0 <= ratio < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {ratio}")
    layers = _decoder_layers(model)
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim, intermediate = layers[0].self_attn.head_dim, config.intermediate_size
    group = heads // kv_heads
    keep_per_group = group if heads_ratio == 0 else max(1, group - round(heads_ratio * group))
    keep_channels = intermediate if mlp_ratio == 0 else _round_channels(round((1 - mlp_ratio) * intermediate))
    params_before = sum(p.numel() for p in model.parameters())

    if calibration is None:
        scores = [(_head_weight_scores(layer.self_attn, heads), _channel_weight_scores(layer.mlp))
                  for layer in layers]
    else:
        scores = _activation_scores(model, layers, calibration, heads)

    for layer, (head_scores, channel_scores) in zip(layers, scores):
        attn, mlp = layer.self_attn, layer.mlp
        if keep_per_group < group:
            kept = head_scores.view(kv_heads, group).topk(keep_per_group, dim=1).indices.sort(dim=1).values
            kept_heads = (kept + group * torch.arange(kv_heads, device=kept.device)[:, None]).flatten()
            rows = (kept_heads[:, None] * head_dim + torch.arange(head_dim, device=kept.device)).flatten()
            attn.q_proj = _shrink(attn.q_proj, rows, dim=0)
            attn.o_proj = _shrink(attn.o_proj, rows, dim=1)
            attn.num_key_value_groups = keep_per_group
        if keep_channels < intermediate:
            channels = channel_scores.topk(keep_channels).indices.sort().values
            mlp.gate_proj = _shrink(mlp.gate_proj, channels, dim=0)
            mlp.up_proj = _shrink(mlp.up_proj, channels, dim=0)
            mlp.down_proj = _shrink(mlp.down_proj, channels, dim=1)
            mlp.intermediate_size = keep_channels

    config.head_dim = head_dim  # pinned first: a derived head_dim would change with num_attention_heads
    config.num_attention_heads = keep_per_group * kv_heads
    config.intermediate_size = keep_channels
    return PruneResult(heads_before=heads, heads_after=keep_per_group * kv_heads, kv_heads=kv_heads,
                       intermediate_before=intermediate, intermediate_after=keep_channels,
                       params_before=params_before, params_after=sum(p.numel() for p in model.parameters()))


def apply_n_m_sparsity(model, n: int = 2, m: int = 4) -> dict[str, torch.Tensor]:
    """Zero the m - n smallest-magnitude weights in every group of m along the input dimension.

    Covers every nn.Linear inside the decoder layers (not embeddings, not lm_head) and returns
    {parameter name: bool mask}. Raises ValueError, before changing anything, if a covered layer's
    in_features is not a multiple of m.
    """
    if not 0 < n < m:
        raise ValueError(f"N:M sparsity needs 0 < n < m, got n={n}, m={m}")
    linears = _decoder_linears(model)
    for name, linear in linears.items():
        if linear.in_features % m:
            raise ValueError(f"{name}: in_features={linear.in_features} is not a multiple of m={m}")
    masks = {}
    with torch.no_grad():
        for name, linear in linears.items():
            groups = linear.weight.abs().view(linear.out_features, -1, m)
            keep = groups.topk(n, dim=-1).indices
            mask = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, keep, True).view_as(linear.weight)
            linear.weight.mul_(mask)
            masks[name] = mask
    return masks


def check_n_m(model, masks: dict[str, torch.Tensor], n: int = 2, m: int = 4) -> None:
    """Raise AssertionError naming the first masked layer with a group of m holding fewer than m - n zeros."""
    params = dict(model.named_parameters())
    for name in masks:
        weight = params[name]
        zeros = (weight == 0).view(weight.shape[0], -1, m).sum(dim=-1)
        bad = int((zeros < m - n).sum())
        if bad:
            raise AssertionError(f"{name}: {bad} of {zeros.numel()} groups of {m} have fewer than {m - n} zeros")


def reapply_masks(model, masks: dict[str, torch.Tensor]) -> None:
    """Multiply each masked weight by its mask again, e.g. after an optimizer step."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, mask in masks.items():
            params[name].mul_(mask.to(params[name].device))


def _decoder_layers(model) -> nn.ModuleList:
    """model.model.layers, after checking every layer has the Llama attention and MLP projections."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList) or not all(
            isinstance(getattr(getattr(layer, part, None), proj, None), nn.Linear)
            for layer in layers for part, projs in (("self_attn", ATTENTION), ("mlp", MLP)) for proj in projs):
        raise ValueError(f"{type(model).__name__} is not a Llama-style causal LM (model.model.layers[i] with "
                         f"self_attn.{{q,k,v,o}}_proj and mlp.{{gate,up,down}}_proj)")
    return layers


def _decoder_linears(model) -> dict[str, nn.Linear]:
    """{weight parameter name: module} for every nn.Linear inside the decoder layers."""
    inside = {id(module) for module in _decoder_layers(model).modules() if isinstance(module, nn.Linear)}
    return {f"{name}.weight": module for name, module in model.named_modules() if id(module) in inside}


def _round_channels(count: int) -> int:
    """At least 1, and rounded down to a multiple of 8 (tensor-core-friendly) once 8 or more."""
    return count - count % 8 if count >= 8 else max(1, count)


def _shrink(linear: nn.Linear, index: torch.Tensor, dim: int) -> nn.Linear:
    """A new nn.Linear holding only `index` of `linear`'s outputs (dim=0) or inputs (dim=1)."""
    weight = linear.weight.detach().index_select(dim, index)
    shrunk = nn.Linear(weight.shape[1], weight.shape[0], bias=linear.bias is not None, device="meta")
    shrunk.weight = nn.Parameter(weight, requires_grad=linear.weight.requires_grad)
    if linear.bias is not None:
        bias = linear.bias.detach()[index] if dim == 0 else linear.bias.detach().clone()
        shrunk.bias = nn.Parameter(bias, requires_grad=linear.bias.requires_grad)
    return shrunk


def _o_proj_head_norms(attn: nn.Module, heads: int) -> torch.Tensor:
    """Per query head: L2 norm of the o_proj column block that reads that head's output."""
    o = attn.o_proj.weight.detach().float()
    return o.view(o.shape[0], heads, -1).norm(dim=(0, 2))


def _head_weight_scores(attn: nn.Module, heads: int) -> torch.Tensor:
    """Per query head: L2 norm of its q_proj rows times its o_proj column-block norm."""
    return attn.q_proj.weight.detach().float().view(heads, -1).norm(dim=1) * _o_proj_head_norms(attn, heads)


def _channel_weight_scores(mlp: nn.Module) -> torch.Tensor:
    """Per intermediate channel: gate_proj row norm x up_proj row norm x down_proj column norm."""
    gate, up, down = (proj.weight.detach().float() for proj in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
    return gate.norm(dim=1) * up.norm(dim=1) * down.norm(dim=0)


def _activation_scores(model, layers: nn.ModuleList, calibration: torch.Tensor,
                       heads: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (head scores, channel scores) from one no-grad, eval-mode forward over `calibration`.

    Every position of the batch counts (no attention mask).
    Heads: mean L2 norm of each head's attention output (o_proj input) x its o_proj column-block norm.
    Channels: mean |act_fn(gate(x)) * up(x)| (down_proj input) x its down_proj column norm.
    """
    if calibration.dim() != 2 or calibration.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"calibration must be integer token ids [batch, seq], got {calibration.dtype} "
                         f"{tuple(calibration.shape)}")
    inputs: dict[nn.Module, torch.Tensor] = {}

    def record(module, args):
        inputs[module] = args[0].detach().float()

    hooks = [proj.register_forward_pre_hook(record) for layer in layers
             for proj in (layer.self_attn.o_proj, layer.mlp.down_proj)]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(input_ids=calibration.to(next(model.parameters()).device))
    finally:
        for hook in hooks:
            hook.remove()
        model.train(was_training)

    scores = []
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        per_head = inputs[attn.o_proj].unflatten(-1, (heads, -1)).norm(dim=-1).flatten(0, -2).mean(dim=0)
        per_channel = inputs[mlp.down_proj].abs().flatten(0, -2).mean(dim=0)
        scores.append((per_head * _o_proj_head_norms(attn, heads),
                       per_channel * mlp.down_proj.weight.detach().float().norm(dim=0)))
    return scores
