"""Tensor surgery every architecture family's structured pruning uses: a Linear layer cut to some of its rows or
columns, the rows of whole heads, the complement of what was kept, channel counts rounded for the kernels, and a
calibration forward pass for hooks to record."""

from __future__ import annotations

import torch
from torch import nn


def shrink(linear: nn.Linear, index: torch.Tensor, dim: int) -> nn.Linear:
    """A new nn.Linear holding only `index` of `linear`'s outputs (dim=0) or inputs (dim=1)."""
    weight = linear.weight.detach().index_select(dim, index)
    shrunk = nn.Linear(weight.shape[1], weight.shape[0], bias=linear.bias is not None, device="meta")
    shrunk.weight = nn.Parameter(weight, requires_grad=linear.weight.requires_grad)
    if linear.bias is not None:
        bias = linear.bias.detach()[index] if dim == 0 else linear.bias.detach().clone()
        shrunk.bias = nn.Parameter(bias, requires_grad=linear.bias.requires_grad)
    return shrunk


def rows(heads: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Row indices of a projection's output that belong to `heads`."""
    return (heads[:, None] * head_dim + torch.arange(head_dim, device=heads.device)).flatten()


def complement(kept: torch.Tensor, total: int) -> list[int]:
    return sorted(set(range(total)) - set(kept.tolist()))


def round_channels(count: int) -> int:
    """At least 1, and rounded down to a multiple of 8 (tensor-core-friendly) once 8 or more."""
    return count - count % 8 if count >= 8 else max(1, count)


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


def check_calibration(calibration: torch.Tensor) -> None:
    if calibration.dim() != 2 or calibration.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"calibration must be integer token ids [batch, seq], got {calibration.dtype} "
                         f"{tuple(calibration.shape)}")
