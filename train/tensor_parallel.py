"""Tensor parallelism for the architectures AutoTP cannot split by itself, and inside pipeline stages.

Which linear layers are cut, per model type (Megatron's rule): the projections into the attention heads and the
MLP's gate/up projections by output rows (column-parallel: the input's gradient is summed over the tensor-parallel
group in the backward pass), the attention output and MLP down projections by input columns (row-parallel: the
output is summed in the forward pass), the output head by vocabulary with its logits gathered. Everything else is
replicated on the tensor-parallel ranks and computes the same values on each of them.

DeepSeek-V3 (multi-head latent attention + MoE): q_b_proj and kv_b_proj split by heads, the low-rank q_a/kv_a
projections and their norms replicated; the shared experts and the dense MLP of the first layers split as MLPs;
the router and the routed experts replicated on the tensor-parallel ranks (each computes the whole MoE for its
tokens; --expert-parallel is the way to divide the experts). MLA's rotary key is one head shared by all heads, so
each rank's attention gives it only its heads' part of the gradient: `_SumGradient` adds the parts up
(Hugging Face's 'mla_kv_a_proj' style).

Without pipeline stages, DeepSpeed's AutoTP splits the model from `partition_config` (DeepSeek-V3; Llama and other
architectures keep AutoTP's own Hugging Face tp_plan route). With pipeline stages, `shard_pipeline` cuts each
stage's layers with AutoTP's own layer classes (LinearLayer, LinearAllreduce) over the pipeline grid's
tensor-parallel group; their weights are marked tensor-model-parallel, so DeepSpeed's gradient norm counts each
shard once and each replicated weight once.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dstool import architectures, models
from dstool.errors import UsageError

# how each architecture's Linear layers are cut: dstool.architectures (Architecture.tensor_splits); the head as here
_HEAD = (r"lm_head", "column")  # logits gathered: the loss sees the whole vocabulary


def _splits(model_type: str) -> tuple[tuple[str, str], ...]:
    known = architectures.architecture(model_type)
    return known.tensor_splits if known is not None else ()


def check_model(model_ref: str, tensor: int, pipeline_stages: int) -> dict | None:
    """Refuse, before any rank starts, a model that --tensor-parallel `tensor` cannot cut evenly (one line); returns
    the AutoTP partition_config the run's DeepSpeed JSON needs (None: none, or no AutoTP)."""
    if tensor == 1:
        return None
    c = models.model_config(model_ref, 256)
    if c.model_type == "deepseek_v2":  # AutoTP's tp_plan route stops on its 'mla_kv_a_proj' style
        raise UsageError(f"--tensor-parallel supports DeepSeek-V3's attention, not DeepSeek-V2's ({model_ref}): train "
                         "it data-parallel, with --expert-parallel for its experts")
    if not _splits(c.model_type):
        if pipeline_stages > 1:
            raise UsageError(f"--tensor-parallel with --pipeline-stages needs a model of type "
                             f"{' or '.join(architectures.with_capability('tensor_splits'))}; {model_ref} is "
                             f"{c.model_type}: drop one of the two")
        return None  # AutoTP's own Hugging Face tp_plan route
    sizes = {"attention heads": c.num_attention_heads}
    if c.model_type == "llama":
        sizes["key-value heads"] = c.num_key_value_heads
    sizes["intermediate_size"] = c.intermediate_size
    if c.model_type == "deepseek_v3":
        sizes["moe_intermediate_size x n_shared_experts"] = c.moe_intermediate_size * (c.n_shared_experts or 0)
    if pipeline_stages > 1:
        sizes["vocabulary (output head)"] = c.vocab_size
    for what, n in sizes.items():
        if n and n % tensor:
            raise UsageError(f"--tensor-parallel {tensor} does not divide the {n} {what} of {model_ref}: use a "
                             "tensor-parallel size that divides it")
    return autotp_partition_config(c.model_type) if pipeline_stages == 1 else None


def autotp_partition_config(model_type: str) -> dict | None:
    """DeepSpeed's `tensor_parallel.partition_config` for AutoTP training (None: AutoTP's own route)."""
    if model_type != "deepseek_v3":
        return None
    specs: list[dict[str, Any]] = [{"patterns": [rf".*\.{pattern}\.weight$"], "partition_type": kind}
             for pattern, kind in _splits(model_type)]
    specs.append({"patterns": [rf"(^|.*\.){_HEAD[0]}\.weight$"], "partition_type": "column", "gather_output": True})
    return {"use_default_specs": False, "layer_specs": specs}


class _SumGradient(torch.autograd.Function):
    """Identity forward; the backward pass sums the gradient over the tensor-parallel group."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def sum_mla_rope_gradients(model: nn.Module, group) -> int:
    """Hook every MLA attention's kv_a_proj_with_mqa so the rotary key's gradient is summed over `group` (a process
    group, or a function returning it once it exists); returns the projections hooked."""
    hooked = 0
    for module in model.modules():
        proj = getattr(module, "kv_a_proj_with_mqa", None)
        if proj is None:
            continue
        latent = module.kv_lora_rank

        def hook(_mod, _args, out, latent=latent):
            nope, rope = out[..., :latent], out[..., latent:]
            return torch.cat([nope, _SumGradient.apply(rope, group() if callable(group) else group)], dim=-1)

        proj.register_forward_hook(hook)
        hooked += 1
    return hooked


def _kind(model_type: str, name: str) -> str | None:
    for pattern, kind in [*_splits(model_type), _HEAD]:
        if re.search(rf"(^|\.){pattern}$", name):
            return kind
    return None


def shard_pipeline(module, model_type: str) -> int:
    """Cut the linear layers of this rank's pipeline layers over the grid's tensor-parallel group (AutoTP's layer
    classes: shards of the whole weights, which the layers already hold); returns the layers cut."""
    from deepspeed.module_inject.layers import LinearAllreduce, LinearLayer, set_autotp_mode  # noqa: PLC0415 (deepspeed: the launcher (dstool.train.api) imports this module and starts no DeepSpeed)

    set_autotp_mode(training=True)
    group = module._grid.get_slice_parallel_group()
    cut = 0
    for layer in module.forward_funcs:
        if not isinstance(layer, nn.Module):
            continue
        for parent_name, parent in list(layer.named_modules()):
            for name, child in list(parent.named_children()):
                full = f"{parent_name}.{name}" if parent_name else name
                kind = _kind(model_type, full) if type(child) is nn.Linear else None
                if kind is None:
                    continue
                split: Any = (LinearLayer(child, group, gather_output=name == "lm_head") if kind == "column"
                              else LinearAllreduce(child, group))
                split.weight.dstool_tp_dim = 0 if kind == "column" else 1
                setattr(parent, name, split)
                cut += 1
        sum_mla_rope_gradients(layer, group)
    return cut


def gather_whole(state: dict[str, torch.Tensor], group) -> dict[str, torch.Tensor]:
    """Collective over the tensor-parallel `group`: `state` with each shard (marked by `shard_pipeline`) joined into
    the whole weight; the same key order on every rank of the group."""
    world = dist.get_world_size(group)
    out = {}
    for key in sorted(state):
        value = state[key]
        dim = getattr(value, "dstool_tp_dim", None)
        if dim is not None and world > 1:
            parts = [torch.empty_like(value.detach()) for _ in range(world)]
            dist.all_gather(parts, value.detach().contiguous(), group=group)
            out[key] = torch.cat(parts, dim=dim)
        else:
            out[key] = value.detach()
    return out
