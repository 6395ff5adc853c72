"""Structured pruning of Llama-style causal LMs (Llama, Qwen2, Mistral, and any model with `model.model.layers[i]`
holding self_attn.{q,k,v,o}_proj and mlp.{gate,up,down}_proj): key/value groups (each with its query heads), query
heads (the same number in every kept group) and MLP channels. The result is the same layout in every layer,
expressible as a transformers config (num_attention_heads, num_key_value_heads, intermediate_size), query heads kept
in their key/value group: an index_select on seven Linear layers per decoder layer.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from dstool.compress.family import Layout, PruneResult
from dstool.compress.surgery import calibrate, check_calibration, complement, round_channels, rows, shrink

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


class Llama:
    """The Llama-style family (GQA attention, gated MLP)."""

    name = "Llama-style"
    has_experts = False

    def check(self, model) -> None:
        _decoder_layers(model)

    def structured_layout(self, model, heads_ratio: float, mlp_ratio: float, kv_ratio: float,
                          experts_ratio: float) -> Layout:
        if experts_ratio:
            raise ValueError(f"{type(model).__name__} has no routed experts to remove (that is for DeepSeek-V2/V3 MoE "
                             "models): prune heads or MLP channels")
        config = model.config
        kv_heads, group, intermediate = config.num_key_value_heads, _group_size(model), config.intermediate_size
        return Layout(
            kv_groups=kv_heads if kv_ratio == 0 else max(1, kv_heads - round(kv_ratio * kv_heads)),
            heads_per_group=group if heads_ratio == 0 else max(1, group - round(heads_ratio * group)),
            channels=intermediate if mlp_ratio == 0 else round_channels(round((1 - mlp_ratio) * intermediate)))

    def layouts_for_ratio(self, model, ratio: float) -> list[Layout]:
        """Every GQA layout whose head count divides the hidden size, with the MLP width that brings the removed
        share of a decoder layer's parameters to `ratio`; layouts whose attention alone removes over 5 % more are
        skipped."""
        layers = _decoder_layers(model)
        config = model.config
        kv_heads, group, intermediate = config.num_key_value_heads, _group_size(model), config.intermediate_size
        per_head, per_group, per_channel = _unit_sizes(layers[0], config.num_attention_heads, kv_heads, intermediate)
        target = ratio * sum(p.numel() for p in layers[0].parameters())
        layouts = []
        for kv_groups in range(kv_heads, 0, -1):
            for heads_per_group in range(group, 0, -1):
                if config.hidden_size % (kv_groups * heads_per_group):
                    continue  # transformers' configs require hidden_size divisible by num_attention_heads
                heads_removed = kv_heads * group - kv_groups * heads_per_group
                attention = heads_removed * per_head + (kv_heads - kv_groups) * per_group
                kept = intermediate - max(0, math.ceil((target - attention) / per_channel))
                if attention > target * 1.05 or kept < 1:  # kept < 1: not even every channel would reach the ratio
                    continue
                channels = round_channels(kept)
                layouts.append(Layout(kv_groups, heads_per_group, channels))
        return layouts

    def importance_scores(self, model, calibration: torch.Tensor | None) -> list:
        return _importance_scores(model, calibration)

    def apply_layout(self, model, layout: Layout, scores: list) -> PruneResult:
        return _apply_layout(model, layout, scores)


LLAMA = Llama()


def _importance_scores(model, calibration: torch.Tensor | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per decoder layer (query-head scores, MLP-channel scores): activations on `calibration` token ids when
    given, weight norms otherwise."""
    layers = _decoder_layers(model)
    heads = model.config.num_attention_heads
    if calibration is None:
        return [(_head_weight_scores(layer.self_attn, heads), _channel_weight_scores(layer.mlp)) for layer in layers]
    return _activation_scores(model, layers, calibration, heads)


def _apply_layout(model, layout: Layout, scores) -> PruneResult:
    """Shrink every decoder layer to `layout`, keeping the highest-scoring groups, heads and channels."""
    layers = _decoder_layers(model)
    config = model.config
    heads, kv_heads, intermediate = config.num_attention_heads, config.num_key_value_heads, config.intermediate_size
    group, head_dim = heads // kv_heads, layers[0].self_attn.head_dim
    if config.hidden_size % (layout.kv_groups * layout.heads_per_group):
        raise ValueError(f"{layout.kv_groups} key/value groups x {layout.heads_per_group} query heads would leave "
                         f"{layout.kv_groups * layout.heads_per_group} attention heads, which do not divide hidden "
                         "size "
                         f"{config.hidden_size} (transformers rejects such a config): choose other ratios")
    params_before = sum(p.numel() for p in model.parameters())
    decoder_before = sum(p.numel() for p in layers.parameters())
    removed = []
    for layer, (head_scores, channel_scores) in zip(layers, scores):
        attn, mlp = layer.self_attn, layer.mlp
        by_group = head_scores.view(kv_heads, group)
        groups = by_group.sum(dim=1).topk(layout.kv_groups).indices.sort().values
        in_group = by_group[groups].topk(layout.heads_per_group, dim=1).indices.sort(dim=1).values
        kept_heads = (in_group + group * groups[:, None]).flatten()
        if len(kept_heads) < heads:
            attn.q_proj = shrink(attn.q_proj, rows(kept_heads, head_dim), dim=0)
            attn.o_proj = shrink(attn.o_proj, rows(kept_heads, head_dim), dim=1)
            attn.num_key_value_groups = layout.heads_per_group
        if len(groups) < kv_heads:
            attn.k_proj = shrink(attn.k_proj, rows(groups, head_dim), dim=0)
            attn.v_proj = shrink(attn.v_proj, rows(groups, head_dim), dim=0)
        channels = channel_scores.topk(layout.channels).indices.sort().values
        if layout.channels < intermediate:
            mlp.gate_proj = shrink(mlp.gate_proj, channels, dim=0)
            mlp.up_proj = shrink(mlp.up_proj, channels, dim=0)
            mlp.down_proj = shrink(mlp.down_proj, channels, dim=1)
            mlp.intermediate_size = layout.channels
        removed.append({"kv_groups": complement(groups, kv_heads), "query_heads": complement(kept_heads, heads),
                        "mlp_channels": complement(channels, intermediate)})

    config.head_dim = head_dim  # pinned first: a derived head_dim would change with num_attention_heads
    config.num_attention_heads = layout.kv_groups * layout.heads_per_group
    config.num_key_value_heads = layout.kv_groups
    config.intermediate_size = layout.channels
    return PruneResult(heads_before=heads, heads_after=config.num_attention_heads, kv_heads_before=kv_heads,
                         kv_heads_after=layout.kv_groups, intermediate_before=intermediate,
                         intermediate_after=layout.channels, params_before=params_before,
                         params_after=sum(p.numel() for p in model.parameters()), decoder_params_before=decoder_before,
                         decoder_params_after=sum(p.numel() for p in layers.parameters()), removed=removed)


def _group_size(model) -> int:
    config = model.config
    return config.num_attention_heads // config.num_key_value_heads


def _unit_sizes(layer: nn.Module, heads: int, kv_heads: int, intermediate: int) -> tuple[float, float, float]:
    """Parameters one query head, one key/value head and one MLP channel hold in a decoder layer."""
    def size(linear: nn.Linear, with_bias: bool = True) -> int:
        return linear.weight.numel() + (linear.bias.numel() if with_bias and linear.bias is not None else 0)

    attn, mlp = layer.self_attn, layer.mlp
    return ((size(attn.q_proj) + size(attn.o_proj, with_bias=False)) / heads,
            (size(attn.k_proj) + size(attn.v_proj)) / kv_heads,
            (size(mlp.gate_proj) + size(mlp.up_proj) + size(mlp.down_proj, with_bias=False)) / intermediate)


def _decoder_layers(model) -> nn.ModuleList:
    """model.model.layers, after checking every layer has the Llama attention and MLP projections."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList) or not all(
            isinstance(getattr(getattr(layer, part, None), proj, None), nn.Linear)
            for layer in layers for part, projs in (("self_attn", ATTENTION), ("mlp", MLP)) for proj in projs):
        raise ValueError(f"{type(model).__name__} is not a Llama-style causal LM (model.model.layers[i] with "
                         f"self_attn.{{q,k,v,o}}_proj and mlp.{{gate,up,down}}_proj)")
    return layers


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
    check_calibration(calibration)
    inputs: dict[nn.Module, torch.Tensor] = {}

    def record(module, args):
        inputs[module] = args[0].detach().float()

    calibrate(model, calibration, [proj.register_forward_pre_hook(record) for layer in layers
                                   for proj in (layer.self_attn.o_proj, layer.mlp.down_proj)])

    scores = []
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        per_head = inputs[attn.o_proj].unflatten(-1, (heads, -1)).norm(dim=-1).flatten(0, -2).mean(dim=0)
        per_channel = inputs[mlp.down_proj].abs().flatten(0, -2).mean(dim=0)
        scores.append((per_head * _o_proj_head_norms(attn, heads),
                       per_channel * mlp.down_proj.weight.detach().float().norm(dim=0)))
    return scores
