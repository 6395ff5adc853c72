"""DeepSeek-V3's multi-token prediction (MTP, the V3 report's section 2.2), trained alongside the main model.

Depth k (1..D) is one more decoder layer with its own input: for position i, h'_i = eh_proj([enorm(Emb(t_{i+k}));
hnorm(h_i^{k-1})]) (the embedding first, as DeepSeek's checkpoints, vLLM, SGLang and transformers' MtpLayer read
`eh_proj`), then the decoder layer (attention + MoE, a full layer as V3's), then the main model's output head behind
the depth's own RMSNorm (`shared_head.norm`) predicts t_{i+k+1}. h^0 is the main model's last hidden state (after its
final norm, what the inference engines hand their MTP layer); depth k+1 reads depth k's decoder-layer output. Each
depth sees the sequence truncated by k (positions 0..T-k-1, their own position ids). The embedding and the head are
the main model's (shared, as in V3), so their gradients from every depth land on the same weights.

The layers live in the Hugging Face model at DeepSeek's own place, `model.layers.{L + k - 1}` (L =
num_hidden_layers): transformers' DeepseekV3Model runs `layers[:num_hidden_layers]` only, DeepSpeed AutoEP's
DeepSeek-V3 preset (`model.layers.N.mlp`) shards their experts like the main model's, ZeRO partitions and
checkpoints them like any weight, and the consolidated state dict already carries DeepSeek's names. The saved folder
adds `model.layers.{L+k-1}.embed_tokens.weight` and `.shared_head.head.weight` (copies of the shared weights, as
DeepSeek's checkpoint holds them and vLLM's DeepSeekMTP loads them) and `num_nextn_predict_layers: D` in config.json.

Loss: L = L_main + λ/D Σ_k CE_k, λ `mtp_loss_weight` until `mtp_loss_drop_ratio` of the steps, then
`mtp_loss_weight_final` (V3: 0.3 for the first 10T of 14.8T tokens, then 0.1). The returned `loss` is the main loss
alone (metrics' `loss`, the held-out loss and every existing comparison stay the main model's); `mtp_losses` holds
CE_k, one per depth.
"""

from __future__ import annotations

import math
import types
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import MoeCausalLMOutputWithPast
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

from dstool import architectures
from dstool.errors import UsageError

# the per-depth weights that are the main model's, stored again under each MTP layer in DeepSeek's layout
SHARED = {"embed_tokens.weight": "model.embed_tokens.weight", "shared_head.head.weight": "lm_head.weight"}


def check_model(hf_config, layers: int, model_ref: str) -> None:
    """A one-line UsageError (before any rank starts) unless the model has DeepSeek-V3's layout."""
    known = architectures.architecture(getattr(hf_config, "model_type", None))
    if known is None or not known.mtp:
        model_type = getattr(hf_config, "model_type", "unknown")
        raise UsageError(f"--mtp-layers {layers} needs a DeepSeek-V3 layout (model type "
                         f"{', '.join(architectures.with_capability('mtp'))}); {model_ref} is {model_type}: drop "
                         "--mtp-layers, or train --model tiny-moe, deepseek-v3 or a DeepSeek-V3 folder")


class MTPLayer(DeepseekV3DecoderLayer):
    """One MTP depth: a DeepSeek-V3 decoder layer (self_attn, mlp, its two norms) plus `enorm`, `hnorm`, `eh_proj`
    and `shared_head.norm`, under the names DeepSeek's checkpoints give `model.layers.{L}`."""

    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)  # layer_idx >= first_k_dense_replace: an MoE layer, as V3's
        self.enorm = DeepseekV3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.hnorm = DeepseekV3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.shared_head = nn.Module()
        self.shared_head.norm = DeepseekV3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden, embeds, attention_mask=None, position_ids=None, position_embeddings=None, **kwargs):
        """hidden: h^{k-1} at positions 0..n-1; embeds: Emb(t_{i+k}) at the same positions -> h^k."""
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        return super().forward(x, attention_mask=attention_mask, position_ids=position_ids,
                               position_embeddings=position_embeddings)


@dataclass
class MTPOutput(MoeCausalLMOutputWithPast):
    """The causal-LM output, `loss` the main model's, and each depth's cross-entropy."""

    mtp_losses: torch.Tensor | None = None


def attach(model, depth: int, folder: str | None = None) -> int:
    """Append `depth` MTP layers to the Hugging Face DeepSeek-V3 `model` (at model.layers[L:]) and route its
    training forward through them. Their weights come from `folder` where it holds them (a dstool or DeepSeek
    checkpoint: `model.layers.{L+k}.*`), else a fresh init as the model's own; returns how many were loaded."""
    config = model.config
    first = config.num_hidden_layers
    layers = [MTPLayer(config, first + k) for k in range(depth)]
    for layer in layers:
        for module in layer.modules():
            model._init_weights(module)
    loaded = _load(layers, Path(folder), first) if folder else 0
    model.model.layers.extend(layers)
    model.forward = types.MethodType(_forward, model)
    model.mtp_depth = depth
    return loaded


def layers(model) -> list[MTPLayer]:
    return [m for m in model.model.layers[model.config.num_hidden_layers:] if isinstance(m, MTPLayer)]


def _load(layers: list[MTPLayer], folder: Path, first: int) -> int:
    """Each depth's weights from the folder's safetensors, where it has that depth (every one of its tensors, else
    a UsageError): the number of depths loaded."""
    found: dict[int, dict[str, torch.Tensor]] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                parts = key.split(".", 3)
                if len(parts) < 4 or parts[:2] != ["model", "layers"] or not parts[2].isdigit():
                    continue
                k = int(parts[2]) - first
                if 0 <= k < len(layers) and parts[3] not in SHARED:
                    found.setdefault(k, {})[parts[3]] = f.get_tensor(key)
    for k, state in found.items():
        missing, _ = layers[k].load_state_dict(_stack_experts(state), strict=False)
        if missing:
            raise UsageError(f"{folder} holds MTP layer model.layers.{first + k} without {', '.join(missing[:3])}: "
                             "pass a complete checkpoint, or train its MTP layers afresh from a folder without them")
    return len(found)


def _stack_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """DeepSeek's per-expert names (mlp.experts.E.gate_proj/up_proj/down_proj.weight, as transformers saves them)
    as the stacked parameters the module holds (mlp.experts.gate_up_proj: each expert's gate rows, then up's)."""
    experts = sorted({int(key.split(".")[2]) for key in state if key.startswith("mlp.experts.")
                      and key.split(".")[2].isdigit()})
    if not experts:
        return state
    state = dict(state)
    per = [{w: state.pop(f"mlp.experts.{e}.{w}_proj.weight") for w in ("gate", "up", "down")} for e in experts]
    state["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([x["gate"], x["up"]], dim=0) for x in per])
    state["mlp.experts.down_proj"] = torch.stack([x["down"] for x in per])
    return state


def _forward(self, input_ids=None, attention_mask=None, position_ids=None, labels=None, **kwargs):
    """The model's forward, and in training with labels its MTP depths too (one embedding and one trunk pass)."""
    if labels is None or input_ids is None or not self.training:
        return type(self).forward(self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                  labels=labels, **kwargs)
    base = self.model
    embeds = base.embed_tokens(input_ids)
    hidden = base(inputs_embeds=embeds, attention_mask=attention_mask, position_ids=position_ids,
                  use_cache=False).last_hidden_state
    logits = self.lm_head(hidden)
    loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size)
    length = input_ids.shape[1]
    if position_ids is None:
        position_ids = torch.arange(length, device=input_ids.device).unsqueeze(0)
    losses = []
    for k, layer in enumerate(layers(self), start=1):
        n = length - k  # positions whose token t_{i+k} exists
        pos = position_ids[:, :n]
        mask = create_causal_mask(config=self.config, inputs_embeds=embeds[:, :n],
                                  attention_mask=None if attention_mask is None else attention_mask[:, :n],
                                  cache=None, position_ids=pos)
        hidden = layer(hidden[:, :n], embeds[:, k:], attention_mask=mask, position_ids=pos,
                       position_embeddings=base.rotary_emb(embeds, pos))
        depth_logits = self.lm_head(layer.shared_head.norm(hidden))
        losses.append(self.loss_function(logits=depth_logits, labels=labels[:, k:], vocab_size=self.config.vocab_size))
    return MTPOutput(loss=loss, logits=logits, mtp_losses=torch.stack(losses))


def loss_weight(step: int, max_steps: int, weight: float, final: float, drop_ratio: float) -> float:
    """λ at optimizer step `step` (0-based, the step being trained): `weight` for the first drop_ratio of the run,
    then `final`."""
    return weight if step < math.ceil(drop_ratio * max_steps) else final


def objective(outputs, weight: float) -> torch.Tensor:
    """What the step minimises: the main loss plus λ times the mean of the depths' losses."""
    if getattr(outputs, "mtp_losses", None) is None:
        return outputs.loss
    return outputs.loss + weight * outputs.mtp_losses.mean()


def hf_state(state: dict[str, torch.Tensor], config, depth: int) -> dict[str, torch.Tensor]:
    """The consolidated state dict with DeepSeek's per-layer copies of the shared embedding and head added (copies:
    safetensors stores no shared tensors)."""
    first = config.num_hidden_layers
    for k in range(depth):
        for name, source in SHARED.items():
            state[f"model.layers.{first + k}.{name}"] = state[source].detach().clone()
    return state

