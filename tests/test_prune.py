"""Structured pruning and 2:4 sparsity on tiny, randomly initialised transformers Llama models."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from dstool.compress.prune import PruneResult, prune_structured, prune_to_ratio
from dstool.compress.sparse import apply_n_m_sparsity, check_n_m

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 96, 128, 6, 2, 16, 2


def tiny_llama(seed: int = 0, attention: str = "sdpa") -> LlamaForCausalLM:
    """Grouped-query attention: 6 query heads in 2 key/value groups of 3."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=128, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                         num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                         max_position_embeddings=64, attn_implementation=attention)
    return LlamaForCausalLM(config).eval()


def token_batch(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(seed))


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_prune_heads_and_mlp_shapes_config_and_reload(tmp_path):
    model = tiny_llama()
    result = prune_structured(model, heads_ratio=1 / 3, mlp_ratio=0.5)

    removed = LAYERS * (2 * 2 * HEAD_DIM * HIDDEN + 3 * 64 * HIDDEN)  # per layer: 2 q/o heads, 64 MLP channels
    assert result == PruneResult(heads_before=6, heads_after=4, kv_heads_before=2, kv_heads_after=2,
                                 intermediate_before=128, intermediate_after=64, params_before=result.params_before,
                                 params_after=result.params_before - removed,
                                 decoder_params_before=result.decoder_params_before,
                                 decoder_params_after=result.decoder_params_before - removed, removed=result.removed)
    for layer_removed in result.removed:
        assert layer_removed["kv_groups"] == [] and len(layer_removed["mlp_channels"]) == 64
        heads = layer_removed["query_heads"]
        assert len(heads) == 2 and sorted(h // 3 for h in heads) == [0, 1]  # one query head from each group
    assert result.params_after == sum(p.numel() for p in model.parameters())
    c = model.config
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size) == (4, 2, 16, 64)
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        assert attn.q_proj.weight.shape == (4 * HEAD_DIM, HIDDEN)
        assert attn.k_proj.weight.shape == attn.v_proj.weight.shape == (2 * HEAD_DIM, HIDDEN)
        assert attn.o_proj.weight.shape == (HIDDEN, 4 * HEAD_DIM)
        assert (attn.num_key_value_groups, attn.head_dim) == (2, HEAD_DIM)
        assert mlp.gate_proj.weight.shape == mlp.up_proj.weight.shape == (64, HIDDEN)
        assert mlp.down_proj.weight.shape == (HIDDEN, 64)

    ids = token_batch()
    pruned = logits(model, ids)
    assert pruned.shape == (2, 16, 128) and torch.isfinite(pruned).all()
    assert model.generate(ids[:, :4], max_new_tokens=3, do_sample=False).shape == (2, 7)  # with a KV cache

    model.save_pretrained(tmp_path)
    loaded, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert (loaded.config.num_attention_heads, loaded.config.head_dim, loaded.config.intermediate_size) == (4, 16, 64)
    assert torch.equal(logits(loaded.eval(), ids), pruned)


def test_zero_ratios_leave_the_model_unchanged():
    model = tiny_llama()
    original = copy.deepcopy(model)
    result = prune_structured(model, heads_ratio=0.0, mlp_ratio=0.0, calibration=token_batch())
    assert (result.heads_after, result.intermediate_after) == (HEADS, INTERMEDIATE)
    assert result.params_after == result.params_before
    ids = token_batch(seed=2)
    torch.testing.assert_close(logits(model, ids), logits(original, ids), rtol=0, atol=1e-6)


@pytest.mark.parametrize("calibrated", [False, True])
@pytest.mark.parametrize("attention", ["eager", "sdpa"])  # eager reads the module's num_key_value_groups
def test_kept_query_heads_stay_with_their_kv_group(calibrated, attention):
    """Head 0 (group 0) and head 4 (group 1) are made negligible; the pruned model must equal the original
    with exactly those heads silenced, which holds only if heads 1, 2 still read kv head 0 and 3, 5 kv head 1."""
    model = tiny_llama(attention=attention)
    with torch.no_grad():
        for layer in model.model.layers:
            o = layer.self_attn.o_proj.weight.view(HIDDEN, HEADS, HEAD_DIM)
            o[:, [0, 4]] *= 1e-3
    silenced = copy.deepcopy(model)
    with torch.no_grad():
        for layer in silenced.model.layers:
            layer.self_attn.o_proj.weight.view(HIDDEN, HEADS, HEAD_DIM)[:, [0, 4]] = 0
    before = [{name: getattr(layer.self_attn, name).weight.clone() for name in ("q_proj", "k_proj", "v_proj", "o_proj")}
              for layer in model.model.layers]

    prune_structured(model, heads_ratio=1 / 3, mlp_ratio=0.0, calibration=token_batch() if calibrated else None)

    kept = [1, 2, 3, 5]
    for layer, old in zip(model.model.layers, before):
        attn = layer.self_attn
        assert torch.equal(attn.q_proj.weight.view(4, HEAD_DIM, HIDDEN),
                           old["q_proj"].view(HEADS, HEAD_DIM, HIDDEN)[kept])
        assert torch.equal(attn.o_proj.weight.view(HIDDEN, 4, HEAD_DIM),
                           old["o_proj"].view(HIDDEN, HEADS, HEAD_DIM)[:, kept])
        assert torch.equal(attn.k_proj.weight, old["k_proj"]) and torch.equal(attn.v_proj.weight, old["v_proj"])
    ids = token_batch(seed=2)
    torch.testing.assert_close(logits(model, ids), logits(silenced, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_removing_a_key_value_group_takes_its_query_heads(attention, tmp_path):
    """Group 0 (query heads 0-2, kv head 0) is made negligible: pruning half the groups must remove exactly it,
    and the pruned model must equal the original with those heads silenced (kv head 1 still serves 3-5)."""
    model = tiny_llama(attention=attention)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.view(HIDDEN, HEADS, HEAD_DIM)[:, :3] *= 1e-3
    silenced = copy.deepcopy(model)
    with torch.no_grad():
        for layer in silenced.model.layers:
            layer.self_attn.o_proj.weight.view(HIDDEN, HEADS, HEAD_DIM)[:, :3] = 0
    k_before = [layer.self_attn.k_proj.weight.clone() for layer in model.model.layers]

    result = prune_structured(model, heads_ratio=0.0, mlp_ratio=0.0, calibration=token_batch(), kv_ratio=0.5)

    assert (result.kv_heads_after, result.heads_after) == (1, 3)
    assert all(r == {"kv_groups": [0], "query_heads": [0, 1, 2], "mlp_channels": []} for r in result.removed)
    for layer, k in zip(model.model.layers, k_before):
        assert torch.equal(layer.self_attn.k_proj.weight, k[HEAD_DIM:])  # the kept group's key head
    ids = token_batch(seed=2)
    torch.testing.assert_close(logits(model, ids), logits(silenced, ids), rtol=1e-5, atol=1e-5)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert (loaded.config.num_attention_heads, loaded.config.num_key_value_heads) == (3, 1)
    torch.testing.assert_close(logits(loaded, ids), logits(model, ids), rtol=1e-5, atol=1e-5)  # reloads as sdpa
    assert model.generate(ids[:, :4], max_new_tokens=3, do_sample=False).shape == (2, 7)  # KV cache of 1 head


def test_prune_to_ratio_removes_that_share_with_the_best_measured_layout(tmp_path):
    model = tiny_llama()
    ranking, selection = token_batch(seed=3), token_batch(seed=4)

    result = prune_to_ratio(model, 0.4, calibration=ranking, selection=selection)

    decoder = sum(p.numel() for p in model.model.layers.parameters())
    assert decoder == result.decoder_params_after and 0.4 <= result.decoder_fraction_removed < 0.45
    layouts = {(c["kv_groups"], c["heads_per_group"]) for c in result.candidates}
    assert layouts == {(2, 3), (2, 2), (2, 1), (1, 3), (1, 2), (1, 1)}  # every GQA layout was measured
    best = min(result.candidates, key=lambda c: c["calibration_loss"])
    assert (result.kv_heads_after, result.heads_after // result.kv_heads_after, result.intermediate_after) == (
        best["kv_groups"], best["heads_per_group"], best["channels"])
    for candidate in result.candidates:  # each layout's MLP width brings its removed share to >= 40 %
        trial = tiny_llama()
        prune_structured(trial, 1 - candidate["heads_per_group"] / 3, 1 - candidate["channels"] / INTERMEDIATE,
                         kv_ratio=1 - candidate["kv_groups"] / 2)
        kept = sum(p.numel() for p in trial.model.layers.parameters())
        assert 0.4 <= 1 - kept / result.decoder_params_before < 0.45
    for layer_removed in result.removed:
        assert len(layer_removed["query_heads"]) == HEADS - result.heads_after
        assert len(layer_removed["kv_groups"]) == KV_HEADS - result.kv_heads_after
        assert len(layer_removed["mlp_channels"]) == INTERMEDIATE - result.intermediate_after
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert torch.equal(logits(loaded, selection), logits(model, selection))
    with pytest.raises(ValueError, match=r"ratio must be in \(0, 1\)"):
        prune_to_ratio(tiny_llama(), 1.0)


class FakeTimer:
    """A prune.LayoutTimer whose latency for a trial is its attention head count (fewer heads, faster)."""

    def __init__(self):
        self.heads = []

    def add(self, trial) -> None:
        self.heads.append(trial.config.num_attention_heads)

    def latencies_ms(self) -> list[float]:
        return [float(h) for h in self.heads]


@pytest.mark.parametrize("tolerance", [0.0, 0.02, 10.0])
def test_timed_layout_choice_is_the_fastest_within_the_perplexity_tolerance(tolerance):
    import math

    model, timer = tiny_llama(), FakeTimer()
    result = prune_to_ratio(model, 0.4, calibration=token_batch(seed=3), selection=token_batch(seed=4), timer=timer,
                            ppl_tolerance=tolerance)

    assert len(result.candidates) == 6
    best_loss = min(c["calibration_loss"] for c in result.candidates)
    allowed = [c for c in result.candidates if math.exp(c["calibration_loss"] - best_loss) <= 1 + tolerance + 1e-9]
    timed = [c for c in result.candidates if "latency_ms" in c]
    # only the layouts within the tolerance are timed, once each, and none when only one is
    assert timed == (allowed if len(allowed) > 1 else []) and [c["latency_ms"] for c in timed] == timer.heads
    fastest = min(allowed, key=lambda c: c.get("latency_ms", 0.0))
    assert (result.kv_heads_after, result.heads_after, result.intermediate_after) == (
        fastest["kv_groups"], fastest["kv_groups"] * fastest["heads_per_group"], fastest["channels"])
    if tolerance == 10.0:  # a tolerance wider than every gap: the fastest of all, one head
        assert result.heads_after == 1
    if tolerance == 0.0:  # no slack: the lowest-loss layout, whatever its speed
        assert min(result.candidates, key=lambda c: c["calibration_loss"]) is fastest


def test_layouts_transformers_would_reject_are_skipped(tmp_path):
    """8 query heads in 4 groups, hidden 128: 6 or 3 heads do not divide the hidden size (LlamaConfig refuses)."""
    def build() -> LlamaForCausalLM:
        torch.manual_seed(0)
        return LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256,
                                            num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=4)).eval()

    model = build()
    result = prune_to_ratio(model, 0.4, calibration=token_batch())
    heads = {c["kv_groups"] * c["heads_per_group"] for c in result.candidates}
    assert heads and not heads & {3, 6} and all(128 % h == 0 for h in heads)
    model.save_pretrained(tmp_path)  # the chosen layout is a config transformers saves and loads
    assert AutoModelForCausalLM.from_pretrained(tmp_path).config.num_attention_heads == result.heads_after
    with pytest.raises(ValueError, match="do not divide hidden size 128"):
        prune_structured(build(), 0.0, 0.0, kv_ratio=0.25)  # 3 groups x 2 heads


def test_calibration_keeps_a_dominant_mlp_channel():
    model = tiny_llama().train()
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[:, 37] *= 100
    dominant = model.model.layers[0].mlp.down_proj.weight[:, 37].clone()

    result = prune_structured(model, heads_ratio=0.0, mlp_ratio=0.9, calibration=token_batch())

    assert result.intermediate_after == 8  # round(12.8) = 13, rounded down to a multiple of 8
    down = model.model.layers[0].mlp.down_proj.weight
    assert any(torch.equal(down[:, i], dominant) for i in range(down.shape[1]))
    assert model.training  # calibration ran in eval mode and the mode was restored


def test_calibration_drops_a_channel_that_is_dead_on_the_data():
    """A channel with huge weights whose gate is always far negative (SiLU ~ 0): weight norms keep it,
    activations show it contributes nothing."""
    def build():
        model = tiny_llama()
        with torch.no_grad():
            model.model.embed_tokens.weight += 1.0  # every token's hidden state ~ the all-ones direction
            model.model.layers[0].mlp.gate_proj.weight[5] = -1.0  # gate(x) ~ -96 on every token
        return model

    def keeps_dead_channel(model) -> bool:
        return bool((model.model.layers[0].mlp.gate_proj.weight == -1.0).all(dim=1).any())

    by_weights, by_activations = build(), build()
    prune_structured(by_weights, heads_ratio=0.0, mlp_ratio=0.5)
    prune_structured(by_activations, heads_ratio=0.0, mlp_ratio=0.5, calibration=token_batch())
    assert keeps_dead_channel(by_weights)
    assert not keeps_dead_channel(by_activations)


@pytest.mark.parametrize("heads_ratio, mlp_ratio", [(-0.1, 0.0), (1.0, 0.0), (0.0, 1.0), (0.0, 2.0),
                                                     (0.0, float("nan"))])
def test_bad_ratios_raise(heads_ratio, mlp_ratio):
    with pytest.raises(ValueError, match=r"ratio must be in \[0, 1\)"):
        prune_structured(tiny_llama(), heads_ratio, mlp_ratio)


def test_non_llama_model_raises():
    with pytest.raises(ValueError, match="not a Llama-style"):
        prune_structured(nn.Sequential(nn.Linear(4, 4)), 0.5, 0.5)
    with pytest.raises(ValueError, match="not a Llama-style"):
        apply_n_m_sparsity(nn.Linear(4, 4))


def test_2_4_sparsity_masks_and_their_check():
    model = tiny_llama()
    lm_head, embed = model.lm_head.weight.clone(), model.model.embed_tokens.weight.clone()

    masks = apply_n_m_sparsity(model)

    names = {f"model.layers.{i}.{part}.{proj}.weight" for i in range(LAYERS)
             for part, projs in (("self_attn", "qkvo"), ("mlp", ("gate", "up", "down"))) for proj in
             (f"{p}_proj" for p in projs)}
    assert set(masks) == names
    params = dict(model.named_parameters())
    for name, mask in masks.items():
        assert mask.dtype == torch.bool and mask.shape == params[name].shape
        assert mask.float().mean().item() == 0.5
        assert (params[name] == 0).float().mean().item() == 0.5
        assert torch.equal(params[name] != 0, mask)
    assert torch.equal(model.lm_head.weight, lm_head) and torch.equal(model.model.embed_tokens.weight, embed)
    check_n_m(model, masks)

    name = "model.layers.1.mlp.down_proj.weight"
    zero = (~masks[name]).nonzero()[0]
    with torch.no_grad():
        params[name][tuple(zero)] = 1.0
    with pytest.raises(AssertionError, match=name):
        check_n_m(model, masks)


def test_n_m_rejects_bad_patterns_before_changing_anything():
    model = tiny_llama()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=r"width 96, not a multiple of M=5 .* e\.g\. 2:4"):
        apply_n_m_sparsity(model, n=2, m=5)  # hidden size 96 is not a multiple of 5
    with pytest.raises(ValueError, match="0 < n < m"):
        apply_n_m_sparsity(model, n=4, m=4)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
