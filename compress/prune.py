"""Structured pruning, whatever the architecture: `prune_structured` (explicit ratios) and `prune_to_ratio` (a share
of the decoder's parameters, the split chosen by measurement) physically shrink the projections and rewrite the
config, so the pruned model saves and reloads with `AutoModelForCausalLM.from_pretrained` as an ordinary, smaller
model of its architecture. What differs by architecture is a family's (family.py): `family_of` picks it once —
Llama-style (prune_llama.py) or DeepSeek-V2/V3 (prune_moe.py).

Own code rather than torch-pruning: the result must be the same layout in every layer, expressible as a
transformers config, with query heads kept in their key/value group; torch-pruning's dependency graph prunes per
module and leaves the config and GQA grouping to the caller.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any, Protocol

import torch
from torch import nn

from dstool import architectures
from dstool.compress.family import Family, Layout, PruneResult
from dstool.compress.prune_llama import LLAMA
from dstool.compress.prune_moe import DEEPSEEK_V2, DEEPSEEK_V3

__all__ = ["Layout", "LayoutTimer", "PruneResult", "candidate_layouts", "family_of",
           "no_layout_message", "prune_structured", "prune_to_ratio"]


class LayoutTimer(Protocol):
    """Times candidate layouts for `prune_to_ratio`: `add` receives each pruned trial model in turn (it may be
    freed afterwards), `latencies_ms` then returns one latency per trial, in order."""

    def add(self, trial: nn.Module) -> None: ...

    def latencies_ms(self) -> list[float]: ...


def family_of(model) -> Family:
    """The architecture family that prunes `model`; ValueError (one line, with what works instead) for none."""
    known = architectures.architecture(getattr(getattr(model, "config", None), "model_type", None))
    pruning = known.pruning if known is not None else "llama"
    if pruning != "llama":
        return {"deepseek_v2": DEEPSEEK_V2, "deepseek_v3": DEEPSEEK_V3}[pruning]
    try:
        LLAMA.check(model)
    except ValueError as e:
        raise ValueError(f"{e}: structured pruning knows Llama-style and DeepSeek-V2/V3 models; --bits 8 or 4 "
                         "works on this one") from None
    return LLAMA


def prune_structured(model, heads_ratio: float, mlp_ratio: float, calibration: torch.Tensor | None = None,
                     kv_ratio: float = 0.0, experts_ratio: float = 0.0) -> PruneResult:
    """Remove the least important key/value groups (each with its query heads), query heads (the same number
    in every kept group) and MLP channels.

    `kv_ratio` is the share of key/value groups removed, `heads_ratio` the share of query heads removed inside
    each kept group, `mlp_ratio` the share of MLP intermediate channels removed; 0 leaves that part as it is,
    ratios must lie in [0, 1). Importance is measured on `calibration` token ids [batch, seq] when given,
    otherwise from weight norms. DeepSeek-V2/V3: `heads_ratio` of the MLA heads, `mlp_ratio` of every MLP's channels
    (dense, routed and shared experts), `experts_ratio` of each MoE layer's routed experts (the least routed on
    `calibration`, which it then needs); no `kv_ratio` (MLA has no key/value groups).
    """
    for name, ratio in (("heads_ratio", heads_ratio), ("mlp_ratio", mlp_ratio), ("kv_ratio", kv_ratio),
                        ("experts_ratio", experts_ratio)):
        if not 0.0 <= ratio < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {ratio}")
    family = family_of(model)
    layout = family.structured_layout(model, heads_ratio, mlp_ratio, kv_ratio, experts_ratio)
    return family.apply_layout(model, layout, family.importance_scores(model, calibration))


def prune_to_ratio(model, ratio: float, calibration: torch.Tensor | None = None,
                   selection: torch.Tensor | None = None, timer: LayoutTimer | None = None,
                   ppl_tolerance: float = 0.0) -> PruneResult:
    """Remove at least `ratio` of the decoder layers' parameters, choosing the split by measurement.

    Every attention layout (key/value groups kept x query heads kept per group; DeepSeek-V2/V3: MLA heads kept x
    routed experts kept, see `prune_moe.DeepSeekMoE`) is paired with the MLP width that brings the removed
    share to `ratio` (channels rounded down to a multiple of 8, so slightly more may go); each candidate is
    pruned on a copy and its loss measured on `selection` token ids (default: `calibration`). Without `timer`
    the lowest-loss layout is applied to `model`. With `timer`, the layouts whose calibration perplexity (exp of
    their loss) is at most (1 + `ppl_tolerance`) times the best layout's are timed (none when only one is), and
    the fastest is applied: at the same parameter count, layouts differ in speed because attention costs more
    than its share of parameters (softmax, rotary, transposes per head).
    """
    if not 0.0 < ratio < 1.0:
        raise ValueError(f"ratio must be in (0, 1), got {ratio}")
    family = family_of(model)
    scores = family.importance_scores(model, calibration)
    layouts = family.layouts_for_ratio(model, ratio)

    def apply(target, layout: Layout) -> PruneResult:
        return family.apply_layout(target, layout, scores)
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


def candidate_layouts(model, ratio: float):
    """The layouts `prune_to_ratio` chooses among (from shapes alone: a model on the meta device will do)."""
    return family_of(model).layouts_for_ratio(model, ratio)


def no_layout_message(ratio: float) -> str:
    return (f"no layout removes {ratio:.0%} of the decoder parameters (too few attention heads and MLP channels to "
            "remove): choose a smaller --prune")


@torch.no_grad()
def _calibration_loss(model, ids: torch.Tensor) -> float:
    """Mean next-token cross-entropy on token ids [batch, seq] (eval mode, mode restored)."""
    was_training = model.training
    model.eval()
    try:
        return float(model(input_ids=ids, labels=ids).loss)
    finally:
        model.train(was_training)
