"""What structured pruning asks of an architecture family, and the layout and result types they share. A family
(`prune_llama.LLAMA`: Llama, Qwen2, Mistral and other Llama-style models; `prune_moe.DEEPSEEK_V2` and
`prune_moe.DEEPSEEK_V3`: multi-head latent attention and routed experts) says which layouts a model can take,
scores its heads and channels, and cuts a model to a layout; `prune.family_of` picks one per model, once."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass
class PruneResult:
    """Per-layer counts before and after pruning, parameter counts, and what was removed.

    `removed[i]` holds layer i's removed key/value groups, query heads and MLP channels as indices into the
    unpruned model (DeepSeek MoE layers also: experts, their routing load, each kept expert's channels, the
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
    # DeepSeek-V2/V3, before and after: routed experts per MoE layer, channels per expert, shared experts' channels
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


class Family(Protocol):
    """One architecture family's structured pruning."""

    name: str
    has_experts: bool  # routed experts that --prune-experts may remove

    def check(self, model) -> None:
        """Raise ValueError naming what this family's pruning needs and the model lacks."""

    def structured_layout(self, model, heads_ratio: float, mlp_ratio: float, kv_ratio: float,
                          experts_ratio: float) -> Layout:
        """The layout that removes these shares (ValueError for one the family has no such part for)."""

    def layouts_for_ratio(self, model, ratio: float) -> Sequence[Layout]:
        """Every layout that removes at least `ratio` of the decoder parameters (from shapes alone)."""

    def importance_scores(self, model, calibration: torch.Tensor | None) -> list:
        """Per decoder layer, the scores `apply_layout` keeps the highest of."""

    def apply_layout(self, model, layout: Layout, scores: list) -> PruneResult:
        """Cut `model` in place to `layout`, keeping the highest-scoring heads, channels (and experts)."""
