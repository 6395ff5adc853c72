"""Structured pruning (key/value groups, query heads, MLP channels) and N:M sparsity for Llama-style causal LMs,
and for DeepSeek-V3 (MLA heads, expert channels, whole experts: `prune_moe`).

`prune_structured` (explicit ratios) and `prune_to_ratio` (a share of the decoder's parameters, split by
measurement) physically shrink the projections and rewrite the config, so the pruned model saves and
reloads with `AutoModelForCausalLM.from_pretrained` as an ordinary, smaller model of its architecture.
`apply_n_m_sparsity` zeroes weights in place (2:4 by default; nn.Linear weights and the routed experts' stacked
weights) and returns the masks that `reapply_masks` re-imposes after each optimizer step of recovery fine-tuning;
`check_n_m_fits` refuses a pattern whose M does not divide every covered layer's input width.

Own code rather than torch-pruning: the result must be the same layout in every layer, expressible as a
transformers config (num_attention_heads, num_key_value_heads, intermediate_size) with query heads kept in
their key/value group; here that is an index_select on seven Linear layers per decoder layer, while
torch-pruning's dependency graph prunes per module and leaves the config and GQA grouping to the caller.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


@dataclass
class PruneResult:
    """Per-layer counts before and after pruning, parameter counts, and what was removed.

    `removed[i]` holds layer i's removed key/value groups, query heads and MLP channels as indices into the
    unpruned model (DeepSeek-V3 MoE layers also: experts, their routing load, each kept expert's channels, the
    shared experts' channels); `candidates` (prune_to_ratio only) every layout tried with its calibration loss.
    """

    heads_before: int
    heads_after: int
    kv_heads_before: int
    kv_heads_after: int
    intermediate_before: int
    intermediate_after: int
    params_before: int
    params_after: int
    decoder_params_before: int
    decoder_params_after: int
    removed: list[dict[str, list[int]]] = field(default_factory=list, repr=False)
    candidates: list[dict] = field(default_factory=list, repr=False)
    # DeepSeek-V3, before and after: routed experts per MoE layer, channels per expert, shared experts' channels
    experts: tuple[int, int] | None = None
    expert_channels: tuple[int, int] | None = None
    shared_expert_channels: tuple[int, int] | None = None

    @property
    def decoder_fraction_removed(self) -> float:
        return 1 - self.decoder_params_after / self.decoder_params_before


@dataclass(frozen=True)
class Layout:
    """What every decoder layer keeps: key/value groups, query heads per group, MLP channels."""

    kv_groups: int
    heads_per_group: int
    channels: int


class LayoutTimer(Protocol):
    """Times candidate layouts for `prune_to_ratio`: `add` receives each pruned trial model in turn (it may be
    freed afterwards), `latencies_ms` then returns one latency per trial, in order."""

    def add(self, trial: nn.Module) -> None: ...

    def latencies_ms(self) -> list[float]: ...


def prune_structured(model, heads_ratio: float, mlp_ratio: float, calibration: torch.Tensor | None = None,
                     kv_ratio: float = 0.0, experts_ratio: float = 0.0) -> PruneResult:
    """Remove the least important key/value groups (each with its query heads), query heads (the same number
    in every kept group) and MLP channels.

    `kv_ratio` is the share of key/value groups removed, `heads_ratio` the share of query heads removed inside
    each kept group, `mlp_ratio` the share of MLP intermediate channels removed; 0 leaves that part as it is,
    ratios must lie in [0, 1). Importance is measured on `calibration` token ids [batch, seq] when given,
    otherwise from weight norms. DeepSeek-V3: `heads_ratio` of the MLA heads, `mlp_ratio` of every MLP's channels
    (dense, routed and shared experts), `experts_ratio` of each MoE layer's routed experts (the least routed on
    `calibration`, which it then needs); no `kv_ratio` (MLA has no key/value groups).
    """
    for name, ratio in (("heads_ratio", heads_ratio), ("mlp_ratio", mlp_ratio), ("kv_ratio", kv_ratio),
                        ("experts_ratio", experts_ratio)):
        if not 0.0 <= ratio < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {ratio}")
    from dstool.compress import prune_moe

    if prune_moe.is_deepseek_v3(model):
        if kv_ratio:
            raise ValueError("multi-head latent attention has no key/value groups to remove: prune heads instead")
        layout = prune_moe.structured_layout(model, heads_ratio, mlp_ratio, experts_ratio)
        return prune_moe.apply_layout(model, layout, prune_moe.importance_scores(model, calibration))
    if experts_ratio:
        raise ValueError(f"{type(model).__name__} has no routed experts to remove (that is for DeepSeek-V3 MoE "
                         "models): prune heads or MLP channels")
    _decoder_layers(model)  # raises for a model that is not Llama-style
    config = model.config
    kv_heads, group, intermediate = config.num_key_value_heads, _group_size(model), config.intermediate_size
    return _apply_layout(model, Layout(
        kv_groups=kv_heads if kv_ratio == 0 else max(1, kv_heads - round(kv_ratio * kv_heads)),
        heads_per_group=group if heads_ratio == 0 else max(1, group - round(heads_ratio * group)),
        channels=intermediate if mlp_ratio == 0 else _round_channels(round((1 - mlp_ratio) * intermediate))),
        importance_scores(model, calibration))


def prune_to_ratio(model, ratio: float, calibration: torch.Tensor | None = None,
                   selection: torch.Tensor | None = None, timer: LayoutTimer | None = None,
                   ppl_tolerance: float = 0.0) -> PruneResult:
    """Remove at least `ratio` of the decoder layers' parameters, choosing the split by measurement.

    Every attention layout (key/value groups kept x query heads kept per group; DeepSeek-V3: MLA heads kept x
    routed experts kept, see `prune_moe.layouts_for_ratio`) is paired with the MLP width that brings the removed
    share to `ratio` (channels rounded down to a multiple of 8, so slightly more may go); each candidate is
    pruned on a copy and its loss measured on `selection` token ids (default: `calibration`). Without `timer`
    the lowest-loss layout is applied to `model`. With `timer`, the layouts whose calibration perplexity (exp of
    their loss) is at most (1 + `ppl_tolerance`) times the best layout's are timed (none when only one is), and
    the fastest is applied: at the same parameter count, layouts differ in speed because attention costs more
    than its share of parameters (softmax, rotary, transposes per head).
    """
    if not 0.0 < ratio < 1.0:
        raise ValueError(f"ratio must be in (0, 1), got {ratio}")
    from dstool.compress import prune_moe

    layouts: Sequence[Layout]
    if prune_moe.is_deepseek_v3(model):
        moe_scores = prune_moe.importance_scores(model, calibration)
        layouts = prune_moe.layouts_for_ratio(model, ratio)

        def apply(target, layout):
            return prune_moe.apply_layout(target, layout, moe_scores)
    else:
        scores = importance_scores(model, calibration)
        layouts = _llama_layouts(model, ratio)

        def apply(target, layout):
            return _apply_layout(target, layout, scores)
    if not layouts:
        raise ValueError(no_layout_message(ratio))
    probe = selection if selection is not None else calibration
    candidates: list[dict[str, Any]] = []
    for layout in layouts:
        loss = None
        if probe is not None:
            trial = copy.deepcopy(model)
            apply(trial, layout)
            loss = _calibration_loss(trial, probe)
            del trial
        candidates.append({**dataclasses.asdict(layout), "calibration_loss": loss})
    chosen = min(range(len(layouts)), key=lambda i: (candidates[i]["calibration_loss"] or 0.0,
                                                     -layouts[i].kv_groups * layouts[i].heads_per_group))
    if timer is not None:
        limit = (candidates[chosen]["calibration_loss"] or 0.0) + math.log1p(ppl_tolerance)
        admitted = [i for i, c in enumerate(candidates) if (c["calibration_loss"] or 0.0) <= limit]
        if len(admitted) > 1:  # a layout outside the tolerance is never chosen: it is not timed
            for i in admitted:
                trial = copy.deepcopy(model)
                apply(trial, layouts[i])
                timer.add(trial)
                del trial
            for i, ms in zip(admitted, timer.latencies_ms(), strict=True):
                candidates[i]["latency_ms"] = ms
            chosen = min(admitted, key=lambda i: candidates[i]["latency_ms"])
    result = apply(model, layouts[chosen])
    result.candidates = candidates
    return result


def candidate_layouts(model, ratio: float) -> Sequence[Layout]:
    """The layouts `prune_to_ratio` chooses among (from shapes alone: a model on the meta device will do)."""
    from dstool.compress import prune_moe

    return prune_moe.layouts_for_ratio(model, ratio) if prune_moe.is_deepseek_v3(model) else _llama_layouts(model,
                                                                                                           ratio)


def no_layout_message(ratio: float) -> str:
    return (f"no layout removes {ratio:.0%} of the decoder parameters (too few attention heads and MLP channels to "
            "remove): choose a smaller --prune")


def _llama_layouts(model, ratio: float) -> list[Layout]:
    """Every GQA layout whose head count divides the hidden size, with the MLP width that brings the removed share
    of a decoder layer's parameters to `ratio`; layouts whose attention alone removes over 5 % more are skipped."""
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
            attention = (kv_heads * group - kv_groups * heads_per_group) * per_head + (kv_heads - kv_groups) * per_group
            kept = intermediate - max(0, math.ceil((target - attention) / per_channel))
            if attention > target * 1.05 or kept < 1:  # kept < 1: not even every channel would reach the ratio
                continue
            channels = _round_channels(kept)
            layouts.append(Layout(kv_groups, heads_per_group, channels))
    return layouts


def importance_scores(model, calibration: torch.Tensor | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
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
            attn.q_proj = _shrink(attn.q_proj, _rows(kept_heads, head_dim), dim=0)
            attn.o_proj = _shrink(attn.o_proj, _rows(kept_heads, head_dim), dim=1)
            attn.num_key_value_groups = layout.heads_per_group
        if len(groups) < kv_heads:
            attn.k_proj = _shrink(attn.k_proj, _rows(groups, head_dim), dim=0)
            attn.v_proj = _shrink(attn.v_proj, _rows(groups, head_dim), dim=0)
        channels = channel_scores.topk(layout.channels).indices.sort().values
        if layout.channels < intermediate:
            mlp.gate_proj = _shrink(mlp.gate_proj, channels, dim=0)
            mlp.up_proj = _shrink(mlp.up_proj, channels, dim=0)
            mlp.down_proj = _shrink(mlp.down_proj, channels, dim=1)
            mlp.intermediate_size = layout.channels
        removed.append({"kv_groups": _complement(groups, kv_heads), "query_heads": _complement(kept_heads, heads),
                        "mlp_channels": _complement(channels, intermediate)})

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


def _rows(heads: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Row indices of a projection's output that belong to `heads`."""
    return (heads[:, None] * head_dim + torch.arange(head_dim, device=heads.device)).flatten()


def _complement(kept: torch.Tensor, total: int) -> list[int]:
    return sorted(set(range(total)) - set(kept.tolist()))


def _unit_sizes(layer: nn.Module, heads: int, kv_heads: int, intermediate: int) -> tuple[float, float, float]:
    """Parameters one query head, one key/value head and one MLP channel hold in a decoder layer."""
    def size(linear: nn.Linear, with_bias: bool = True) -> int:
        return linear.weight.numel() + (linear.bias.numel() if with_bias and linear.bias is not None else 0)

    attn, mlp = layer.self_attn, layer.mlp
    return ((size(attn.q_proj) + size(attn.o_proj, with_bias=False)) / heads,
            (size(attn.k_proj) + size(attn.v_proj)) / kv_heads,
            (size(mlp.gate_proj) + size(mlp.up_proj) + size(mlp.down_proj, with_bias=False)) / intermediate)


@torch.no_grad()
def _calibration_loss(model, ids: torch.Tensor) -> float:
    """Mean next-token cross-entropy on token ids [batch, seq] (eval mode, mode restored)."""
    was_training = model.training
    model.eval()
    try:
        return float(model(input_ids=ids, labels=ids).loss)
    finally:
        model.train(was_training)


def apply_n_m_sparsity(model, n: int = 2, m: int = 4) -> dict[str, torch.Tensor]:
    """Zero the m - n smallest-magnitude weights in every group of m along the input dimension.

    Covers the weights `n_m_weights` names (decoder Linear layers and routed experts; not embeddings, lm_head or
    the MoE router) and returns {parameter name: bool mask}. Raises ValueError, before changing anything, if a
    covered weight's input width is not a multiple of m.
    """
    if not 0 < n < m:
        raise ValueError(f"N:M sparsity needs 0 < n < m, got n={n}, m={m}")
    check_n_m_fits(model, n, m)
    masks = {}
    with torch.no_grad():
        for name, weight in n_m_weights(model).items():
            groups = weight.abs().unflatten(-1, (-1, m))
            keep = groups.topk(n, dim=-1).indices
            mask = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, keep, True).view_as(weight)
            weight.mul_(mask)
            masks[name] = mask
    return masks


def n_m_weights(model) -> dict[str, nn.Parameter]:
    """{parameter name: weight} of what N:M sparsity covers, the input dimension last: every nn.Linear weight inside
    the decoder layers (model.model.layers) and the routed experts' stacked [experts, out, in] weights."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(model).__name__} is not a Llama-style or DeepSeek-V3 causal LM (no "
                         "model.model.layers), so N:M sparsity does not apply to it: --bits 8 or 4 does")
    inside = set()
    for module in layers.modules():
        if isinstance(module, nn.Linear):
            inside.add(id(module.weight))
        elif not getattr(module, "is_transposed", False):  # transformers' experts: [experts, out, in]
            inside |= {id(p) for p in module.parameters(recurse=False) if p.dim() == 3}
    return {name: p for name, p in model.named_parameters() if id(p) in inside}


def check_n_m_fits(model, n: int, m: int) -> None:
    """Raise ValueError (one line: the first layer whose input width M does not divide, and a pattern that fits
    every layer) unless every weight `n_m_weights` covers has an input width that is a multiple of m."""
    widths = {name: w.shape[-1] for name, w in n_m_weights(model).items()}
    for name, width in widths.items():
        if width % m:
            common = math.gcd(*widths.values())
            fits = [f"{k // 2}:{k}" for k in (4, 8, 2) if common % k == 0][:1] or ["none (widths share no factor)"]
            raise ValueError(f"N:M sparsity {n}:{m}: {name} has input width {width}, not a multiple of M={m} "
                             f"(input widths here: {', '.join(map(str, sorted(set(widths.values()))))}); a pattern "
                             f"whose M divides them all works, e.g. {fits[0]}")


def check_n_m(model, masks: dict[str, torch.Tensor], n: int = 2, m: int = 4) -> None:
    """Raise AssertionError naming the first masked layer with a group of m holding fewer than m - n zeros."""
    params = dict(model.named_parameters())
    for name in masks:
        weight = params[name]
        zeros = (weight == 0).unflatten(-1, (-1, m)).sum(dim=-1)
        bad = int((zeros < m - n).sum())
        if bad:
            raise AssertionError(f"{name}: {bad} of {zeros.numel()} groups of {m} have fewer than {m - n} zeros")


def reapply_masks(model, masks: dict[str, torch.Tensor]) -> None:
    """Multiply each masked weight by its mask again, e.g. after an optimizer step."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, mask in masks.items():
            params[name].mul_(mask.to(params[name].device))


def check_prunable(model) -> None:
    """Raise ValueError (one line, with what works instead) unless structured pruning knows the architecture."""
    from dstool.compress import prune_moe

    if not prune_moe.is_deepseek_v3(model):
        try:
            _decoder_layers(model)
        except ValueError as e:
            raise ValueError(f"{e}: structured pruning knows Llama-style and DeepSeek-V3 models; --bits 8 or 4 "
                             "works on this one") from None


def _decoder_layers(model) -> nn.ModuleList:
    """model.model.layers, after checking every layer has the Llama attention and MLP projections."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList) or not all(
            isinstance(getattr(getattr(layer, part, None), proj, None), nn.Linear)
            for layer in layers for part, projs in (("self_attn", ATTENTION), ("mlp", MLP)) for proj in projs):
        raise ValueError(f"{type(model).__name__} is not a Llama-style causal LM (model.model.layers[i] with "
                         f"self_attn.{{q,k,v,o}}_proj and mlp.{{gate,up,down}}_proj)")
    return layers


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


def calibrate(model, calibration: torch.Tensor, hooks: list) -> None:
    """One no-grad forward pass of `calibration` in eval mode for the forward `hooks` to record, which are then
    removed (the model's training mode restored)."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(input_ids=calibration.to(next(model.parameters()).device))
    finally:
        for hook in hooks:
            hook.remove()
        model.train(was_training)
