"""Structured pruning of the DeepSeek MLA/MoE family (transformers' DeepseekV2ForCausalLM and
DeepseekV3ForCausalLM): multi-head latent attention (MLA) heads, dense and expert MLP channels, and whole routed
experts chosen by their measured routing load. The two versions share every module this prunes; they differ in the
router: V3 scores experts by sigmoid with a bias (`e_score_correction_bias`, kept for the kept experts) and ranks a
routing group by its top 2, V2 by softmax (greedy, or group-limited by each group's best expert), with no bias.

The Hugging Face config can only say a uniform layout, so that is what is made: every layer keeps the same number of
attention heads (`num_attention_heads`; MLA gives each head its own key and value, expanded from a shared latent,
so `num_key_value_heads` follows it and any count is valid), every MoE layer the same number of routed experts
(`n_routed_experts`; each layer drops its own least-routed ones, the same number from every routing group so
`n_group` stays valid), and every expert the same width (`moe_intermediate_size`; each expert keeps its own
highest-scoring channels, the shared experts `n_shared_experts` times that width). The latent projections
(q_a_proj, kv_a_proj_with_mqa) and the router's inputs keep their sizes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from dstool.compress.family import Layout, PruneResult
from dstool.compress.surgery import calibrate, check_calibration, complement, round_channels, rows, shrink


@dataclass(frozen=True)
class MoeLayout(Layout):
    """What every layer keeps: attention heads (as `kv_groups` of one head each: MLA), dense MLP channels, routed
    experts per MoE layer and channels per expert."""

    experts: int = 0
    expert_channels: int = 0


@dataclass
class DenseScores:
    """A dense layer's head scores and MLP channel scores."""

    heads: torch.Tensor
    channels: torch.Tensor


@dataclass
class MoeScores:
    """A MoE layer's head scores, shared-expert channel scores, routed experts' channel scores [experts, channels]
    and their routing load (None without calibration)."""

    heads: torch.Tensor
    shared: torch.Tensor
    experts: torch.Tensor
    load: torch.Tensor | None


# the fewest channels pruning leaves an expert: transformers' grouped expert kernels (the default on reload) need
# 16-byte strides, so an expert's width must be a multiple of 4 fp32 (8 bf16) values; _round_channels gives 8s
EXPERT_WIDTH_MIN = 8


class DeepSeekMoE:
    """A DeepSeek MLA/MoE version (multi-head latent attention; dense layers, then MoE layers with routed and shared
    experts): `model_type` names it, `group_top` is how many experts score a routing group (so each kept group keeps
    at least that many)."""

    has_experts = True

    def __init__(self, name: str, model_type: str, group_top: int):
        self.name, self.model_type, self.group_top = name, model_type, group_top

    def check(self, model) -> None:
        if getattr(getattr(model, "config", None), "model_type", None) != self.model_type:
            raise ValueError(f"{type(model).__name__} is not a {self.name} model (config.model_type "
                             f"{self.model_type})")

    def structured_layout(self, model, heads_ratio: float, mlp_ratio: float, kv_ratio: float,
                          experts_ratio: float) -> MoeLayout:
        if kv_ratio:
            raise ValueError("multi-head latent attention has no key/value groups to remove: prune heads instead")
        return _structured_layout(model, heads_ratio, mlp_ratio, experts_ratio, self.group_top)

    def layouts_for_ratio(self, model, ratio: float) -> list[MoeLayout]:
        return _layouts_for_ratio(model, ratio, self.group_top)

    def importance_scores(self, model, calibration: torch.Tensor | None) -> list:
        return _importance_scores(model, calibration)

    def apply_layout(self, model, layout, scores: list) -> PruneResult:
        return _apply_layout(model, layout, scores, self.group_top)


DEEPSEEK_V2 = DeepSeekMoE("DeepSeek-V2", "deepseek_v2", group_top=1)
DEEPSEEK_V3 = DeepSeekMoE("DeepSeek-V3", "deepseek_v3", group_top=2)


def layers(model) -> nn.ModuleList:
    return model.model.layers


def _is_moe(layer: nn.Module) -> bool:
    return hasattr(layer.mlp, "experts")


def _attention_out(attn: nn.Module) -> nn.Linear:
    """The projection whose rows are the query heads: q_b_proj (with a query LoRA rank) or q_proj."""
    return attn.q_b_proj if attn.q_b_proj is not None else attn.q_proj


def routing_groups(config) -> int:
    """The groups the router picks experts in: V2's greedy router ignores `n_group`."""
    if getattr(config, "topk_method", None) == "greedy":
        return 1
    return config.n_group or 1


def expert_counts(config, group_top: int = 2) -> list[int]:
    """Routed experts a MoE layer may keep, most first: the same number in each routing group, at least `group_top`
    per group (the router scores a group by its best `group_top`) and enough that top-k can still pick
    `num_experts_per_tok` from the `topk_group` groups it keeps."""
    groups, experts = routing_groups(config), config.n_routed_experts
    per_group = experts // groups
    chosen = config.topk_group if groups > 1 and config.topk_group else groups
    least = min(per_group, max(group_top, math.ceil(config.num_experts_per_tok / chosen)))
    return [k * groups for k in range(per_group, least - 1, -1)]


def layout_of(model) -> MoeLayout:
    c = model.config
    return MoeLayout(kv_groups=c.num_attention_heads, heads_per_group=1, channels=c.intermediate_size,
                     experts=c.n_routed_experts, expert_channels=c.moe_intermediate_size)


def _structured_layout(model, heads_ratio: float, mlp_ratio: float, experts_ratio: float,
                       group_top: int) -> MoeLayout:
    """The layout that removes these shares of heads, of every MLP's channels and of each group's experts (every
    expert keeping at least EXPERT_WIDTH_MIN channels)."""
    now = layout_of(model)

    def width(channels: int) -> int:
        return channels if mlp_ratio == 0 else round_channels(round((1 - mlp_ratio) * channels))

    wanted = now.experts - round(experts_ratio * now.experts)  # the nearest valid count at or above it
    counts = expert_counts(model.config, group_top)
    experts = min((k for k in counts if k >= wanted), default=counts[-1])
    return MoeLayout(kv_groups=max(1, now.kv_groups - round(heads_ratio * now.kv_groups)), heads_per_group=1,
                     channels=width(now.channels), experts=experts,
                     expert_channels=max(width(now.expert_channels), min(EXPERT_WIDTH_MIN, now.expert_channels)))


def _layouts_for_ratio(model, ratio: float, group_top: int) -> list[MoeLayout]:
    """Every (heads, experts) pair, each with the dense and expert widths that bring the removed share of the decoder
    layers' parameters to at least `ratio`: the same share of channels comes out of every MLP (dense, routed and
    shared experts), rounded down to a multiple of 8. Pairs whose heads and experts alone remove more than 5 % over
    the target, or that would leave an expert under EXPERT_WIDTH_MIN channels, are skipped."""
    now, decoder = layout_of(model), layers(model)
    per_head, per_channel, per_expert_channel, per_expert = _unit_sizes(model)
    target = ratio * sum(p.numel() for p in decoder.parameters())
    dense = sum(not _is_moe(layer) for layer in decoder)
    moe = len(decoder) - dense
    shared = model.config.n_shared_experts or 0
    out = []
    for heads in range(now.kv_groups, 0, -1):
        for experts in expert_counts(model.config, group_top) if moe else [now.experts]:
            fixed = (now.kv_groups - heads) * per_head + (now.experts - experts) * per_expert
            every_channel = now.channels * per_channel + now.expert_channels * (experts + shared) * per_expert_channel
            share = max(0.0, target - fixed) / every_channel  # of every MLP's channels
            channels = now.channels if not dense else round_channels(now.channels - math.ceil(share * now.channels))
            expert_channels = now.expert_channels if not moe else round_channels(
                now.expert_channels - math.ceil(share * now.expert_channels))
            if fixed > target * 1.05 or share >= 1 or expert_channels < min(EXPERT_WIDTH_MIN, now.expert_channels):
                continue
            out.append(MoeLayout(heads, 1, channels, experts, expert_channels))
    return out


def _unit_sizes(model) -> tuple[int, int, int, int]:
    """Decoder parameters held by one attention head (in every layer), one dense MLP channel (in every dense
    layer), one channel of one routed or shared expert (in every MoE layer) and one whole routed expert."""
    c = model.config
    head = channel = expert_channel = expert = 0
    for layer in layers(model):
        attn = layer.self_attn
        head += (_attention_out(attn).weight.numel() + attn.kv_b_proj.weight.numel()
                 + attn.o_proj.weight.numel()) // c.num_attention_heads
        if _is_moe(layer):
            experts = layer.mlp.experts
            expert_channel += 3 * c.hidden_size
            expert += (experts.gate_up_proj[0].numel() + experts.down_proj[0].numel()
                       + layer.mlp.gate.weight.shape[1])
        else:
            channel += 3 * c.hidden_size
    return head, channel, expert_channel, expert


def _importance_scores(model, calibration: torch.Tensor | None) -> list[DenseScores | MoeScores]:
    """Activations on `calibration` token ids [batch, seq] (one no-grad, eval-mode forward) x output-projection
    norms, as for Llama: heads by the norm of their output (o_proj input), channels by their mean |activation|
    (down-projection input), a routed expert's channels over the tokens routed to it, weighted by their routing
    weight; and each expert's routing load, its share of the top-k choices. Weight norms without calibration (no
    load then)."""
    decoder = layers(model)
    heads = model.config.num_attention_heads
    if calibration is None:
        return [MoeScores(_head_weight_scores(layer.self_attn, heads), _mlp_weight_scores(layer.mlp.shared_experts),
                          _expert_weight_scores(layer.mlp.experts), None) if _is_moe(layer) else
                DenseScores(_head_weight_scores(layer.self_attn, heads), _mlp_weight_scores(layer.mlp))
                for layer in decoder]
    check_calibration(calibration)
    inputs: dict[nn.Module, torch.Tensor] = {}
    routed: dict[nn.Module, tuple[torch.Tensor, torch.Tensor]] = {}

    def record(module, args):
        inputs[module] = args[0].detach().float()

    def route(module, args):  # experts(hidden_states [tokens, hidden], top_k_index, top_k_weights)
        x, index, weights = (a.detach() for a in args[:3])
        routed[module] = _expert_channel_activity(module, x.float(), index, weights.float())

    hooks = []
    for layer in decoder:
        hooks.append(layer.self_attn.o_proj.register_forward_pre_hook(record))
        if _is_moe(layer):
            hooks.append(layer.mlp.shared_experts.down_proj.register_forward_pre_hook(record))
            hooks.append(layer.mlp.experts.register_forward_pre_hook(route))
        else:
            hooks.append(layer.mlp.down_proj.register_forward_pre_hook(record))
    calibrate(model, calibration, hooks)

    def channel_scores(mlp: nn.Module) -> torch.Tensor:
        return inputs[mlp.down_proj].abs().flatten(0, -2).mean(dim=0) * mlp.down_proj.weight.detach().float().norm(
            dim=0)

    scores: list[DenseScores | MoeScores] = []
    for layer in decoder:
        attn = layer.self_attn
        per_head = inputs[attn.o_proj].unflatten(-1, (heads, -1)).norm(dim=-1).flatten(0, -2).mean(dim=0)
        head_scores = per_head * _o_proj_head_norms(attn, heads)
        if _is_moe(layer):
            activity, load = routed[layer.mlp.experts]
            scores.append(MoeScores(head_scores, channel_scores(layer.mlp.shared_experts),
                                    activity * layer.mlp.experts.down_proj.detach().float().norm(dim=1), load))
        else:
            scores.append(DenseScores(head_scores, channel_scores(layer.mlp)))
    return scores


def _expert_channel_activity(experts: nn.Module, x: torch.Tensor, index: torch.Tensor,
                             weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """([experts, channels] mean routing-weighted |act(gate(x)) * up(x)| over the tokens routed to each expert,
    [experts] share of the top-k choices that picked it), recomputed as the experts' own eager forward does."""
    count = experts.num_experts
    activity = torch.zeros(count, experts.intermediate_dim)
    for e in range(count):
        chosen = index == e
        tokens = chosen.any(dim=-1)
        if tokens.any():
            gate, up = F.linear(x[tokens], experts.gate_up_proj[e].detach().float()).chunk(2, dim=-1)
            weight = (weights * chosen).sum(dim=-1)[tokens, None]
            activity[e] = (experts.act_fn(gate) * up * weight).abs().mean(dim=0)
    load = torch.bincount(index.flatten(), minlength=count)[:count].float() / index.numel()
    return activity, load


def _apply_layout(model, layout: MoeLayout, scores: list[DenseScores | MoeScores], group_top: int) -> PruneResult:
    """Shrink every layer to `layout`, keeping the highest-scoring heads and channels and the most-routed experts."""
    decoder, config = layers(model), model.config
    now = layout_of(model)
    if layout.experts < now.experts and any(isinstance(s, MoeScores) and s.load is None for s in scores):
        raise ValueError("removing routed experts needs calibration tokens: their routing load is measured")
    if layout.experts not in expert_counts(config, group_top) and layout.experts != now.experts:
        raise ValueError(f"{layout.experts} routed experts is not a valid count for n_group={config.n_group}, "
                         f"topk_group={config.topk_group}, num_experts_per_tok={config.num_experts_per_tok}: "
                         f"choose one of {expert_counts(config, group_top)}")
    shared = config.n_shared_experts or 0
    params_before = sum(p.numel() for p in model.parameters())
    decoder_before = sum(p.numel() for p in decoder.parameters())
    qk_head, kv_head, v_head = config.qk_nope_head_dim + config.qk_rope_head_dim, (
        config.qk_nope_head_dim + config.v_head_dim), config.v_head_dim
    removed = []
    for layer, layer_scores in zip(decoder, scores, strict=True):
        attn = layer.self_attn
        kept_heads = layer_scores.heads.topk(layout.kv_groups).indices.sort().values
        if layout.kv_groups < now.kv_groups:
            if attn.q_b_proj is not None:
                attn.q_b_proj = shrink(attn.q_b_proj, rows(kept_heads, qk_head), dim=0)
            else:
                attn.q_proj = shrink(attn.q_proj, rows(kept_heads, qk_head), dim=0)
            attn.kv_b_proj = shrink(attn.kv_b_proj, rows(kept_heads, kv_head), dim=0)
            attn.o_proj = shrink(attn.o_proj, rows(kept_heads, v_head), dim=1)
            attn.num_heads = layout.kv_groups
        record: dict[str, list] = {"kv_groups": complement(kept_heads, now.kv_groups),
                                   "query_heads": complement(kept_heads, now.kv_groups), "mlp_channels": []}
        if isinstance(layer_scores, MoeScores):
            record.update(_shrink_moe(layer.mlp, layout, layer_scores, config))
        else:
            channels = layer_scores.channels.topk(layout.channels).indices.sort().values
            if layout.channels < now.channels:
                _shrink_mlp(layer.mlp, channels)
            record["mlp_channels"] = complement(channels, now.channels)
        removed.append(record)

    config.num_attention_heads = config.num_key_value_heads = layout.kv_groups
    config.intermediate_size = layout.channels
    config.n_routed_experts = layout.experts
    config.moe_intermediate_size = layout.expert_channels
    return PruneResult(heads_before=now.kv_groups, heads_after=layout.kv_groups, kv_heads_before=now.kv_groups,
                       kv_heads_after=layout.kv_groups, intermediate_before=now.channels,
                       intermediate_after=layout.channels, params_before=params_before,
                       params_after=sum(p.numel() for p in model.parameters()), decoder_params_before=decoder_before,
                       decoder_params_after=sum(p.numel() for p in decoder.parameters()), removed=removed,
                       experts=(now.experts, layout.experts),
                       expert_channels=(now.expert_channels, layout.expert_channels),
                       shared_expert_channels=(now.expert_channels * shared, layout.expert_channels * shared)
                       if shared else None)


def _shrink_moe(moe: nn.Module, layout: MoeLayout, scores: MoeScores, config) -> dict[str, list]:
    """Drop the least-routed experts (the same number per routing group), then each kept expert's lowest-scoring
    channels, and the shared experts' to `n_shared_experts` x that width; returns what went, as original indices."""
    experts, router = moe.experts, moe.gate
    count, width = experts.num_experts, experts.intermediate_dim
    groups = routing_groups(config)
    load = scores.load if scores.load is not None else torch.zeros(count)
    by_group = load.view(groups, -1)
    most = (-by_group).argsort(dim=1, stable=True)[:, :layout.experts // groups]  # ties: the lower index stays
    kept = (most.sort(dim=1).values + by_group.shape[1] * torch.arange(groups)[:, None]).flatten()
    channel_scores = scores.experts[kept]
    channels = channel_scores.topk(layout.expert_channels, dim=1).indices.sort(dim=1).values  # [kept, channels]
    with torch.no_grad():
        gate_up = experts.gate_up_proj.detach()[kept]
        rows = torch.cat([channels, channels + width], dim=1)  # gate rows, then up rows
        experts.gate_up_proj = nn.Parameter(gate_up.gather(1, rows[:, :, None].expand(-1, -1, gate_up.shape[2])),
                                            requires_grad=experts.gate_up_proj.requires_grad)
        down = experts.down_proj.detach()[kept]
        experts.down_proj = nn.Parameter(down.gather(2, channels[:, None, :].expand(-1, down.shape[1], -1)),
                                         requires_grad=experts.down_proj.requires_grad)
        router.weight = nn.Parameter(router.weight.detach()[kept].clone(), requires_grad=router.weight.requires_grad)
        if getattr(router, "e_score_correction_bias", None) is not None:  # V3's bias; V2 has none
            router.e_score_correction_bias = router.e_score_correction_bias[kept].clone()
    experts.num_experts = router.num_experts = layout.experts
    experts.intermediate_dim = layout.expert_channels
    shared_width = layout.expert_channels * (config.n_shared_experts or 1)
    shared = scores.shared.topk(shared_width).indices.sort().values
    if shared_width < moe.shared_experts.intermediate_size:
        _shrink_mlp(moe.shared_experts, shared)
    return {"experts": complement(kept, count), "expert_load": [round(float(x), 6) for x in load],
            "expert_channels": [complement(c, width) for c in channels],
            "shared_expert_channels": complement(shared, len(scores.shared))}


def _shrink_mlp(mlp: nn.Module, channels: torch.Tensor) -> None:
    mlp.gate_proj = shrink(mlp.gate_proj, channels, dim=0)
    mlp.up_proj = shrink(mlp.up_proj, channels, dim=0)
    mlp.down_proj = shrink(mlp.down_proj, channels, dim=1)
    mlp.intermediate_size = len(channels)


def _o_proj_head_norms(attn: nn.Module, heads: int) -> torch.Tensor:
    o = attn.o_proj.weight.detach().float()
    return o.view(o.shape[0], heads, -1).norm(dim=(0, 2))


def _head_weight_scores(attn: nn.Module, heads: int) -> torch.Tensor:
    q = _attention_out(attn).weight.detach().float()
    return q.view(heads, -1).norm(dim=1) * _o_proj_head_norms(attn, heads)


def _mlp_weight_scores(mlp: nn.Module) -> torch.Tensor:
    gate, up, down = (proj.weight.detach().float() for proj in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
    return gate.norm(dim=1) * up.norm(dim=1) * down.norm(dim=0)


def _expert_weight_scores(experts: nn.Module) -> torch.Tensor:
    """[experts, channels]: gate row norm x up row norm x down column norm, per expert."""
    gate, up = experts.gate_up_proj.detach().float().chunk(2, dim=1)
    return gate.norm(dim=2) * up.norm(dim=2) * experts.down_proj.detach().float().norm(dim=1)
