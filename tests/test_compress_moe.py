"""dstool compress on DeepSeek-V3 (the tiny-moe preset, trained 20 steps by `dstool train`): structured pruning of
MLA heads, expert channels and whole experts by routing load, N:M masks on the expert weights kept through
recovery, the routed experts quantized by int8, and patterns or ratios that cannot be met refused up front. The
compress steps run on their own (prune, sparsity, save and its reload gate) without the ONNX steps, which the tiny
preset's tests cover (a whole MoE run takes minutes here: docs/compress.md has every mode measured)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dstool.compress import CompressConfig
from dstool.compress.steps import Prune, Save, SparsifyNM, Work, plan, recovery_train_config

from conftest import FAST, TRAIN_CODE, built_once, cli, dstool, one_line_usage_error


@pytest.fixture(scope="module")
def moe_trained(tmp_path_factory, worker_id) -> Path:
    args = ("--model", "tiny-moe", "--nproc", "1", "--zero", "0", "--max-steps", "20", "--save-every", "20", "--lr",
            "3e-3", *FAST)
    return built_once(tmp_path_factory, worker_id, "moe_trained",
                      lambda out: dstool("train", "--output", str(out), *args), TRAIN_CODE, args) / "model"


def _job(model: Path, tmp_path: Path, **options) -> Work:
    cfg = CompressConfig(model=str(model), output=str(tmp_path / "out"), **options)
    (tmp_path / "stage").mkdir()
    (tmp_path / "work").mkdir()
    return Work.load(cfg, model, tmp_path / "stage", tmp_path / "work")


def _saved(job: Work) -> None:
    """The save step and its gate (transformers reloads the folder with the same logits)."""
    Save(checked=True).run(job)
    assert Save(checked=True).gate(job, None) is None


def _routing_load(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """Per MoE layer, how many of the calibration tokens' top-k choices picked each routed expert (from the
    router's own outputs)."""
    counts, hooks = [], []
    for layer in model.model.layers:
        if hasattr(layer.mlp, "gate"):
            def count(module, args, output):
                counts.append(torch.bincount(output[2].flatten(), minlength=module.num_experts))
            hooks.append(layer.mlp.gate.register_forward_hook(count))
    with torch.no_grad():
        model.eval()(input_ids=ids)
    for hook in hooks:
        hook.remove()
    return counts


def test_pruning_removes_the_least_routed_experts_and_reloads_smaller(moe_trained, tmp_path):
    """--prune-heads/--prune-mlp/--prune-experts 0.5: half the MLA heads, half of every MLP's channels and the two
    least-routed of each MoE layer's four experts go; the saved folder reloads in transformers (the save step's
    gate: the same logits as the pruned model in memory) with fewer parameters."""
    from transformers import AutoModelForCausalLM

    from dstool.compress import measure

    original = AutoModelForCausalLM.from_pretrained(moe_trained, dtype=torch.float32)
    job = _job(moe_trained, tmp_path, prune_heads=0.5, prune_mlp=0.5, prune_experts=0.5)
    ranking = torch.from_numpy(measure.windows(job.calib, 128, 24))[:16]  # what the prune step ranks on
    load = _routing_load(original, ranking)
    Prune().run(job)
    _saved(job)
    p = job.recipe.pruning
    assert p.rule == "given-ratios" and p.attention == "mla"
    assert (p.query_heads, p.kv_heads, p.experts, p.expert_channels, p.shared_expert_channels) == (
        (4, 2), (4, 2), (4, 2), (128, 64), (128, 64))
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "stage" / "model")
    c = reloaded.config
    assert (c.num_attention_heads, c.n_routed_experts, c.moe_intermediate_size, c.intermediate_size) == (2, 2, 64, 256)
    assert reloaded.num_parameters() < original.num_parameters()
    moe_layers = [r for r in p.removed if r.experts]
    assert len(moe_layers) == len(load) == 2
    for removed, counts in zip(moe_layers, load):
        assert removed.expert_load == pytest.approx((counts / counts.sum()).tolist(), abs=1e-6)
        least = sorted(torch.argsort(-counts, stable=True)[2:].tolist())  # on a tie the lower index stays
        assert removed.experts == least, (counts, removed.experts)
        assert len(removed.expert_channels) == 2 and all(len(ch) == 64 for ch in removed.expert_channels)
    i = next(i for i, r in enumerate(p.removed) if r.experts)
    kept = [e for e in range(4) if e not in p.removed[i].experts]
    before, after = original.model.layers[i].mlp, reloaded.model.layers[i].mlp
    assert torch.equal(after.gate.weight, before.gate.weight[kept])  # the router keeps the kept experts' rows
    channels = [ch for ch in range(128) if ch not in p.removed[i].expert_channels[0]]
    assert torch.equal(after.experts.down_proj[0], before.experts.down_proj[kept[0]][:, channels])


def test_prune_ratio_lowest_loss_layout(moe_trained, tmp_path):
    """--prune 0.4 --prune-ppl-tolerance 0: every (heads, experts) layout measured, the lowest-loss one kept,
    at least 40 % of the decoder-layer parameters removed; reloads with the same logits."""
    from transformers import AutoModelForCausalLM

    from dstool.compress import measure

    job = _job(moe_trained, tmp_path, prune=0.4, prune_ppl_tolerance=0)
    before = job.model.num_parameters()
    Prune().run(job)
    _saved(job)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "stage" / "model", dtype=torch.float32).eval()
    assert 1 < measure.perplexity_torch(reloaded, job.heldout, limit=8) < float("inf")
    p = job.recipe.pruning
    assert p.rule == "lowest-loss" and 0.4 <= p.decoder_fraction_removed < 0.46
    # fewer parameters, by what the recipe says (embeddings and lm_head, over half of tiny-moe, stay)
    assert reloaded.num_parameters() < before and 1 - reloaded.num_parameters() / before == pytest.approx(
        p.total_fraction_removed) and p.total_fraction_removed > 0.15
    assert {(c.kv_groups, c.experts) for c in p.candidates} == {(h, e) for h in (4, 3, 2, 1) for e in (4, 3, 2)}
    best = min(p.candidates, key=lambda c: c.calibration_loss)
    assert (best.kv_groups, best.experts, best.expert_channels, best.channels) == (
        p.query_heads[1], p.experts[1], p.expert_channels[1], p.mlp_channels[1])
    assert all(c.latency_ms is None for c in p.candidates)


def test_2_4_masks_the_expert_weights_and_recovery_keeps_them(moe_trained, tmp_path):
    """--sparsity 2:4 covers the routed experts' stacked weights, the shared experts, the dense MLP and attention;
    the saved weights have two zeros in every group of four, and `dstool train` with keep_zero_weights (what
    --recover-steps runs) changes the other weights and keeps those zeros."""
    from dstool.train import train

    job = _job(moe_trained, tmp_path, sparsity="2:4")
    SparsifyNM().run(job)
    _saved(job)
    assert {"model.layers.1.mlp.experts.gate_up_proj", "model.layers.2.mlp.experts.down_proj"} <= set(job.masks)
    saved = load_file(tmp_path / "stage" / "model" / "model.safetensors")  # transformers saves experts one by one
    masked = [name for name, w in saved.items() if ".layers." in name and w.dim() == 2
              and not name.endswith("mlp.gate.weight")]  # all but the router
    assert {"model.layers.1.mlp.experts.3.gate_proj.weight", "model.layers.2.mlp.experts.0.down_proj.weight",
            "model.layers.1.mlp.shared_experts.up_proj.weight", "model.layers.0.mlp.down_proj.weight",
            "model.layers.2.self_attn.kv_b_proj.weight"} <= set(masked)
    for name in masked:
        zeros = (saved[name] == 0).unflatten(-1, (-1, 4)).sum(dim=-1)
        assert (zeros >= 2).all(), name
    assert (saved["model.layers.1.mlp.gate.weight"] != 0).all()

    # 3 steps: the warm-up's first two run at lr 0; short, since the masks are the point
    config = recovery_train_config(tmp_path / "stage" / "model", tmp_path / "recover", 3, 1e-2, keep_zero_weights=True)
    result = train(config.model_copy(update={"seq_len": 64, "micro_batch_size": 2}))
    recovered = load_file(result.model_dir / "model.safetensors")
    experts = "model.layers.2.mlp.experts.1.up_proj.weight"
    assert not torch.equal(recovered[experts], saved[experts])  # fine-tuned
    for name in masked:
        assert (recovered[name][saved[name] == 0] == 0).all(), name


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
@pytest.mark.parametrize("args, needles", [
    (["--sparsity", "7:20"], ["not a multiple of M=20", "192", "e.g. 2:4"]),
    (["--prune", "0.95", "--bits", "8"], ["no layout removes 95% of the decoder parameters", "smaller --prune"]),
])
def test_what_cannot_be_met_is_refused_up_front(trained, moe_trained, tmp_path, preset, args, needles):
    """Read from the model's config alone (weights on the meta device): one line, exit 2, nothing written."""
    model = trained if preset == "tiny" else moe_trained
    result = cli("compress", str(model), *args, "--output", str(tmp_path / "o"))
    one_line_usage_error(result, needles[0])
    assert all(needle in result.stderr for needle in needles)
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.tmp").exists()  # before any work


def test_experts_alone_is_a_pruning_run():
    """--prune-experts on its own runs the prune step, and the save step's reload gate with it."""
    steps = plan(CompressConfig(model="m", output="o", prune_experts=0.5))
    assert [s.name for s in steps][:3] == ["baseline", "prune", "save"] and steps[2].has_gate


def test_experts_are_refused_on_a_model_without_them(trained, tmp_path):
    one_line_usage_error(cli("compress", str(trained), "--prune-experts", "0.5", "--output", str(tmp_path / "o")),
                         "has none")


def test_the_default_prune_layout_is_the_speed_aware_one():
    """--prune times the layouts within 50 % of the best calibration perplexity unless told 0 (the manifest's rule
    under the default: tests/test_compress.py); the default is no reason to refuse a run without --prune."""
    assert CompressConfig(model="m", output="o", prune=0.4).prune_ppl_tolerance == 50
    assert CompressConfig(model="m", output="o", bits=8).prune_ppl_tolerance == 50


MOE_SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                 first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
                 num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1, q_lora_rank=32, kv_lora_rank=16,
                 qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=64, rope_scaling=None)


@pytest.mark.parametrize("version, options", [
    ("V3", {}),
    ("V2", {"topk_method": "group_limited_greedy"}),
    ("V2", {"topk_method": "greedy", "n_group": None, "topk_group": None, "q_lora_rank": None}),  # V2-Lite's router
], ids=["v3", "v2-grouped", "v2-lite-greedy"])
def test_routing_groups_stay_valid(tmp_path, version, options):
    """8 experts in 2 routing groups (the router picks the best group, then top-2 inside it): removing half takes
    the 2 least-routed of each group, so n_group still divides n_routed_experts; the result reloads as saved. The
    same for DeepSeek-V2's routers (softmax, no bias; group-limited or greedy over all experts, V2-Lite's, with
    the query projection unfactored), picked by the model's type alone."""
    import transformers
    from transformers import AutoModelForCausalLM

    from dstool.compress.prune import family_of, prune_structured

    torch.manual_seed(0)
    config = getattr(transformers, f"Deepseek{version}Config")(**{**MOE_SHAPE, **options})
    model = getattr(transformers, f"Deepseek{version}ForCausalLM")(config).eval()
    assert family_of(model).name == f"DeepSeek-{version}"
    with torch.no_grad():
        model.model.layers[1].mlp.gate.weight.normal_(0, 1.0)  # a router that prefers some experts
    ids = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(1))
    counts = _routing_load(model, ids)[0]

    result = prune_structured(model, 0.0, 0.0, calibration=ids, experts_ratio=0.5)

    assert result.experts == (8, 4) and model.config.n_group == config.n_group
    removed = result.removed[1]["experts"]
    groups = 2 if config.n_group else 1
    size = 8 // groups
    for group in range(groups):
        inside = counts[size * group:size * group + size]
        assert sorted(e - size * group for e in removed if e // size == group) == sorted(
            torch.argsort(-inside, stable=True)[size // 2:].tolist())
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=1e-5)

    # nearly every channel asked away: each expert keeps 8 (grouped expert kernels need 16-byte strides), and the
    # result still reloads and runs
    again = prune_structured(reloaded, 0.0, 0.99, calibration=ids)
    assert again.expert_channels == (32, 8) and again.intermediate_after == 1
    reloaded.save_pretrained(tmp_path / "narrow")
    narrow = AutoModelForCausalLM.from_pretrained(tmp_path / "narrow").eval()
    with torch.no_grad():
        torch.testing.assert_close(narrow(input_ids=ids).logits, reloaded(input_ids=ids).logits, rtol=0, atol=1e-5)


def test_int8_quantizes_every_routed_expert(tmp_path):
    """The exporter's MoE layout: the experts' stacked weight [experts, in, out] one initializer, split and squeezed
    per expert in the graph. Folded into an initializer per expert (what the quantize step does first), every
    expert's MatMul becomes MatMulInteger on int8 weights stored once (not DynamicQuantizeLinear of an fp32 weight
    on every call): a quarter of the bytes, the same outputs within int8's error."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from dstool.compress import measure, quantize
    from dstool.onnx_export import ort_session

    rng = np.random.default_rng(0)
    experts = rng.normal(0, 0.05, (4, 64, 96)).astype(np.float32)
    nodes = [helper.make_node("Split", ["w"], [f"w{e}" for e in range(4)], axis=0, num_outputs=4)]
    for e in range(4):
        nodes += [helper.make_node("Squeeze", [f"w{e}", "axes"], [f"m{e}"]),
                  helper.make_node("MatMul", ["x", f"m{e}"], [f"y{e}"], name=f"expert_{e}")]
    nodes.append(helper.make_node("Concat", [f"y{e}" for e in range(4)], ["y"], axis=-1))
    graph = helper.make_graph(nodes, "moe", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 384])],
                              [numpy_helper.from_array(experts, "w"),
                               numpy_helper.from_array(np.array([0], np.int64), "axes")])
    fp32 = tmp_path / "model.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)]), fp32)
    x = rng.normal(0, 1, (8, 64)).astype(np.float32)
    reference = ort_session(fp32).run(None, {"x": x})[0]

    assert quantize.fold_weight_constants(fp32) == 5  # the Split and the four Squeezes
    folded = onnx.load(fp32)
    assert {n.op_type for n in folded.graph.node} == {"MatMul", "Concat"}
    assert quantize.weight_matmuls(fp32) == [f"expert_{e}" for e in range(4)]
    np.testing.assert_array_equal(ort_session(fp32).run(None, {"x": x})[0], reference)
    assert quantize.fold_weight_constants(fp32) == 0  # nothing left to fold

    int8 = quantize.quantize_int8(fp32, tmp_path / "model.int8.onnx", quantize.int8_choice_for_this_cpu())
    q = onnx.load(int8)
    ops = [n.op_type for n in q.graph.node]
    assert ops.count("MatMulInteger") == 4 and ops.count("DynamicQuantizeLinear") == 1  # of x only, once
    assert all(numpy_helper.to_array(i).dtype in (np.int8, np.uint8) for i in q.graph.initializer
               if numpy_helper.to_array(i).size >= 64 * 96)
    assert measure.onnx_bytes(int8) < 0.3 * experts.nbytes
    out = ort_session(int8).run(None, {"x": x})[0]
    assert np.abs(out - reference).max() < 0.05 * np.abs(reference).max()
