"""A Hugging Face Llama or DeepSeek-V3 causal LM as a DeepSpeed PipelineModule, and back.

The model's own modules are cut into a flat list of layers — embedding, one layer per decoder layer
(it computes its rotary position embeddings and causal mask from the sequence length, so only the
hidden states travel between stages), final norm + lm_head — that DeepSpeed partitions over the
stages by parameter count. The weights stay the model's tensors, so a run starts from exactly the
weights a data-parallel run would, and `hf_state_dict` gathers the trained stages back into the
model's own names. With tensor parallelism the grid is PP x DP x TP (DeepSpeed's PipeModelDataParallelTopology) and
each stage's layers are cut over its tensor-parallel group (train/tensor_parallel.py); the shards are joined again
in `hf_state_dict`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dstool import architectures, models
from dstool.errors import UsageError
from dstool.train import tensor_parallel


def check_model(model_ref: str) -> None:
    """Refuse, before any rank starts, a model the pipeline cannot cut (one-line UsageError)."""
    cfg = models.model_config(model_ref, 256)
    known = architectures.architecture(cfg.model_type)
    if known is None or not known.pipeline:
        supported = " or ".join(architectures.with_capability("pipeline"))
        raise UsageError(f"--pipeline-stages needs a model of type {supported}; {model_ref} is "
                         f"{cfg.model_type}: use --model tiny, tiny-moe or such a folder, or train it data-parallel")
    if cfg.tie_word_embeddings:
        raise UsageError(f"{model_ref} ties its input and output embeddings, which the pipeline cannot split: "
                         "train it without --pipeline-stages")


class _Embedding(nn.Module):
    def __init__(self, embed_tokens: nn.Embedding):
        super().__init__()
        self.embed_tokens = embed_tokens

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        return {"model.embed_tokens.weight": self.embed_tokens.weight}


class _Decoder(nn.Module):
    def __init__(self, layer: nn.Module, index: int, rotary_emb: nn.Module, config):
        super().__init__()
        self.layer, self.index, self.rotary_emb, self.config = layer, index, rotary_emb, config

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask  # noqa: PLC0415 (0.9 s: the launcher imports this module)

        position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        mask = create_causal_mask(config=self.config, inputs_embeds=hidden, attention_mask=None, cache=None,
                                  position_ids=position_ids)
        return self.layer(hidden, attention_mask=mask, position_ids=position_ids,
                          position_embeddings=self.rotary_emb(hidden, position_ids=position_ids))

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        # keep_vars: the parameters themselves, which say whether they are tensor-parallel shards
        return {f"model.layers.{self.index}.{k}": v for k, v in self.layer.state_dict(keep_vars=True).items()}


class _Head(nn.Module):
    def __init__(self, norm: nn.Module, lm_head: nn.Linear):
        super().__init__()
        self.norm, self.lm_head = norm, lm_head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        return {"model.norm.weight": self.norm.weight, "lm_head.weight": self.lm_head.weight}


def next_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of each position's prediction of the next token (the ForCausalLM models' loss)."""
    return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())


def build(hf_model, stages: int, activation_checkpointing: bool = False, tensor: int = 1):
    """`hf_model` (LlamaForCausalLM, DeepseekV3ForCausalLM) as a PipelineModule over `stages` stages, balanced by
    parameters, each stage cut over `tensor` tensor-parallel ranks; with `activation_checkpointing` DeepSpeed's
    mechanism recomputes every layer in the backward pass."""
    from deepspeed.pipe import PipelineModule  # noqa: PLC0415 (deepspeed: the launcher (dstool.train.api) imports this module and starts no DeepSpeed)
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology  # noqa: PLC0415 (deepspeed: the launcher (dstool.train.api) imports this module and starts no DeepSpeed)

    inner = hf_model.model
    layers = [_Embedding(inner.embed_tokens),
              *(_Decoder(layer, i, inner.rotary_emb, hf_model.config) for i, layer in enumerate(inner.layers)),
              _Head(inner.norm, hf_model.lm_head)]
    if stages > len(layers):
        raise UsageError(f"--pipeline-stages {stages} exceeds the model's {len(layers)} pipeline layers "
                         f"(embedding, {len(inner.layers)} decoder layers, head): use fewer stages")
    # DeepSpeed's grid: ranks ordered pipe, data, model (tensor-parallel peers adjacent)
    topology = PipeModelDataParallelTopology(num_pp=stages, num_mp=tensor,
                                             num_dp=dist.get_world_size() // (stages * tensor)) if tensor > 1 else None
    # dynamic_shape: evaluation and the parity probe use other batch shapes than training
    module = PipelineModule(layers=layers, num_stages=None if topology else stages, topology=topology,
                            loss_fn=next_token_loss, partition_method="parameters", dynamic_shape=True,
                            activation_checkpoint_interval=1 if activation_checkpointing else 0,
                            checkpointable_layers=["_Decoder"])
    if tensor > 1:
        tensor_parallel.shard_pipeline(module, hf_model.config.model_type)
    return module


def hf_state_dict(engine, hf_model) -> dict[str, torch.Tensor] | None:
    """Collective: every stage's weights under their Hugging Face names (tensor-parallel shards joined), on rank 0
    (None elsewhere)."""
    local = {}
    for layer in engine.module.children():
        if hasattr(layer, "hf_state_dict"):
            local.update(layer.hf_state_dict())
    grid = engine.module._grid
    local = tensor_parallel.gather_whole(local, grid.get_slice_parallel_group())
    local = {k: v.cpu() for k, v in local.items()} if grid.get_slice_parallel_rank() == 0 else {}
    parts: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(local, parts, dst=0)
    if parts is None:
        return None
    state = {k: v for part in parts if part is not None for k, v in part.items()}
    missing = sorted(set(hf_model.state_dict()) - set(state))
    if missing:
        raise RuntimeError(f"pipeline stages did not return {len(missing)} weights, e.g. {missing[0]}")
    return state


@torch.no_grad()
def logits(engine, input_ids: torch.Tensor) -> torch.Tensor | None:
    """Collective: the pipeline's logits for `input_ids` (one micro-batch), on rank 0 (None elsewhere)."""
    engine.reset_activation_shape()  # another shape than training's: tensor-parallel stages cache the old one
    _, out = engine.eval_batch(iter([(input_ids, input_ids)]), return_logits=True, num_micro_batches=1)
    engine.reset_activation_shape()
    parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(None if out is None else out.float().cpu(), parts, dst=0)
    return None if parts is None else next(p for p in parts if p is not None)
