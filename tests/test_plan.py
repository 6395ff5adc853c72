"""`dstool plan`: memory per ZeRO stage is DeepSpeed's own estimate, throughput follows the MFU, --from-run reads a
real run's, the doesn't-fit error names what would fit. Pure computation (no rank is started), in this process."""

from __future__ import annotations

import json
import math
import shutil
import statistics

import pytest

from conftest import cli, one_line_usage_error

GIB = float(1 << 30)


def _plan(**kw):
    from dstool.train.config import PlanConfig
    from dstool.train.plan import plan

    return plan(PlanConfig(**{"tokens": "1B", **kw}))


def test_memory_per_stage_is_deepspeeds_estimate_and_counts_come_from_the_config():
    import torch
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs, model_to_params
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    from transformers import AutoModelForCausalLM

    from dstool import models

    torch.manual_seed(0)
    real = AutoModelForCausalLM.from_config(models.preset_config("tiny", 4096, {}))  # 3 M weights, allocated
    total, largest = model_to_params(real)
    for offload in (False, True):
        p = _plan(model="tiny", gpu="A100", gpus="1,8,16", offload_optimizer=offload, offload_params=offload)
        assert (p.parameters, p.largest_layer_parameters) == (total, largest)
        for c in p.clusters:  # 16 GPUs: 2 nodes of 8
            per_node, nodes = min(c.gpus, 8), math.ceil(c.gpus / 8)
            states = {z: m.device_gib - p.activations_gib for z, m in enumerate(c.memory)}
            cpu3, gpu3, _ = estimate_zero3_model_states_mem_needs(total, largest, per_node, nodes, cpu_offload=offload,
                                                                  cpu_offload_params=offload, zero_init=True)
            cpu2, gpu2 = estimate_zero2_model_states_mem_needs(total, per_node, nodes, cpu_offload=offload)
            _, gpu0 = estimate_zero2_model_states_mem_needs(total, 1, 1, cpu_offload=False)
            assert states[3] == pytest.approx(gpu3 / GIB) and c.memory[3].cpu_gib_per_node == pytest.approx(cpu3 / GIB)
            if offload:  # DeepSpeed's ZeRO-2 host figure is all nodes' together: per node as its ZeRO-3 one counts
                cpu2 = estimate_zero3_model_states_mem_needs(total, largest, per_node, nodes, cpu_offload=True,
                                                             cpu_offload_params=False, zero_init=False)[0]
            assert states[2] == pytest.approx(gpu2 / GIB) and c.memory[2].cpu_gib_per_node == pytest.approx(cpu2 / GIB)
            assert states[0] == pytest.approx(gpu0 / GIB) == pytest.approx(20 * total / GIB)
            assert states[1] == pytest.approx((gpu2 + 2 * total * (1 if offload else 1 - 1 / c.gpus)) / GIB)


def test_zero3_memory_per_device_falls_with_the_gpu_count_and_zero0_does_not():
    p = _plan(model="tiny-moe", gpu="H100", gpus="1,2,4,8,16,64,512")
    zero3 = [c.memory[3].device_gib for c in p.clusters]
    zero0 = {c.memory[0].device_gib for c in p.clusters}
    assert all(a > b for a, b in zip(zero3, zero3[1:])) and len(zero0) == 1
    assert p.parameters > p.active_parameters  # routed experts: only the top-k share is active per token


def test_throughput_time_and_cost_follow_the_mfu_and_the_scaling_assumed():
    p = _plan(model="tiny", gpu="A100", gpus="1,8,64", mfu=0.5, node_scaling=0.9, price=2.5, seq_len=256,
              micro_batch_size=4, global_batch_size=256)
    one, node, nodes8 = p.clusters
    assert one.tokens_per_s == pytest.approx(0.5 * 312e12 / p.flops_per_token)
    assert (node.scaling_efficiency, nodes8.scaling_efficiency) == (1.0, pytest.approx(0.9 ** 3))
    assert nodes8.tokens_per_s == pytest.approx(64 * one.tokens_per_s * 0.9 ** 3)
    assert [c.gradient_accumulation_steps for c in p.clusters] == [64, 8, 1]  # the global batch stays 256
    for c in p.clusters:
        assert c.step_time_s == pytest.approx(256 * 256 / c.tokens_per_s)
        assert c.steps == math.ceil(1e9 / (256 * 256)) and c.hours == pytest.approx(c.steps * c.step_time_s / 3600)
        assert c.gpu_hours == pytest.approx(c.hours * c.gpus) and c.cost == pytest.approx(c.gpu_hours * 2.5)
    plain = _plan(model="tiny", gpu="A100", gpus="1")
    recomputed = _plan(model="tiny", gpu="A100", gpus="1", activation_checkpointing=True)
    assert (plain.mfu, recomputed.mfu) == (0.40, pytest.approx(0.40 * 6 / 8))  # the forward pass is done twice
    assert recomputed.clusters[0].tokens_per_s == pytest.approx(plain.clusters[0].tokens_per_s * 6 / 8)
    assert recomputed.activations_gib == plain.activations_other_gib < plain.activations_gib


def test_from_run_reads_the_measured_mfu_of_a_real_run(trained):
    run = trained.parent  # 40 steps, 1 rank, seq 64, micro-batch 4, a window per step
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    windows = [r for r in rows if "mfu" in r][1:]  # the first window is the warm-up
    p = _plan(model="tiny", gpu="cpu", gpus="1", from_run=str(run), seq_len=64, micro_batch_size=4)
    assert p.mfu == pytest.approx(statistics.median(r["mfu"] for r in windows))
    assert f"median of {len(windows)} windows" in p.mfu_source
    # the same model on the same machine: the plan gives back the run's own median throughput
    measured = statistics.median(r["tokens_per_s"] for r in windows)
    assert p.clusters[0].tokens_per_s == pytest.approx(measured, rel=0.02)


def test_host_memory_per_node_is_one_nodes():
    """With offload, ZeRO-1/2 hold on each node its ranks' fp32 loading copies (4 bytes/parameter each) or its share
    of the offloaded states (16 bytes/parameter over the nodes), x1.5 buffers: 64 GPUs on 8 nodes need what 8 GPUs on
    one node need, not 8 times that (DeepSpeed's ZeRO-2 estimator counts every node's loading copies)."""
    from dstool.train.plan import format_table

    p = _plan(model="tiny", gpu="A100", gpus="1,8,64", offload_optimizer=True)
    one, node, nodes8 = p.clusters
    for c, per_node, nodes in ((one, 1, 1), (node, 8, 1), (nodes8, 8, 8)):
        for z in (1, 2):
            expected = p.parameters * max(4 * per_node, 16 / nodes) * 1.5 / GIB
            assert c.memory[z].cpu_gib_per_node == pytest.approx(expected, rel=1e-6), (c.gpus, z)
    assert nodes8.memory[2].cpu_gib_per_node == pytest.approx(node.memory[2].cpu_gib_per_node)
    host = format_table(p).splitlines()[-1]
    assert host.startswith("host memory per node for the planned stage") and "1 GPU: " in host, host
    assert "64 GPUs (8 nodes): " in host and "1 GPUs" not in host, host


def _fake_run(folder, windows: int, on_gpu: bool):
    """A dstool train run's files as `plan --from-run` reads them: `windows` logging windows after the warm-up."""
    folder.mkdir()
    (folder / "dstool.json").write_text(json.dumps({"kind": "train-run"}))
    (folder / "run.json").write_text(json.dumps({"on_gpu": on_gpu, "world_size": 1, "config": {"model": "tiny"}}))
    rows = [{"step": s, "loss": 5.0, "mfu": 0.2 + s / 1000, "tokens_per_s": 100.0} for s in range(1, windows + 2)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_from_run_says_when_its_mfu_is_few_windows_or_another_device(tmp_path):
    """A run with one window: "median of 1 window" and a note that it is too few; a CPU run planning an A100: the
    plan still comes, with a note (table header and json) that the MFU was measured on a CPU."""
    from dstool.train.plan import format_table

    one = _fake_run(tmp_path / "one", 1, on_gpu=False)
    p = _plan(model="tiny", gpu="cpu", gpus="1", from_run=str(one))
    assert "median of 1 window of" in p.mfu_source and p.mfu == pytest.approx(0.202)
    assert [n for n in p.notes if "1 window" in n and "too few" in n] and not [n for n in p.notes if "measured on" in n]
    many = _fake_run(tmp_path / "many", 9, on_gpu=False)
    assert "median of 9 windows of" in _plan(model="tiny", gpu="cpu", gpus="1", from_run=str(many)).mfu_source
    assert _plan(model="tiny", gpu="cpu", gpus="1", from_run=str(many)).notes == []
    on_a100 = _plan(model="tiny", gpu="A100", gpus="1", from_run=str(many))
    note = next(n for n in on_a100.notes if "measured on CPU" in n)
    assert "A100" in note and "--mfu" in note, note
    assert "  note: " + note in format_table(on_a100).splitlines()
    on_gpu = _fake_run(tmp_path / "gpu", 9, on_gpu=True)
    assert "measured on a GPU" in " ".join(_plan(model="tiny", gpu="cpu", gpus="1", from_run=str(on_gpu)).notes)
    assert _plan(model="tiny", gpu="H100", gpus="1", from_run=str(on_gpu)).notes == []


def test_the_cli_prints_the_table_and_the_json():
    result = cli("plan", "--model", "tiny", "--tokens", "2B", "--gpu", "h100", "--gpus", "64,1,8", "--price", "3")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["GPUs", "nodes"])
    assert lines[header].split()[2:6] == ["ZeRO-0", "ZeRO-1", "ZeRO-2", "ZeRO-3"] and "cost" in lines[header]
    assert [line.split()[0] for line in lines[header + 1:header + 4]] == ["1", "8", "64"]
    assert "2,000,000,000 tokens" in lines[0] and "H100" in result.stdout
    result = cli("plan", "--model", "tiny", "--tokens", "2B", "--gpu", "H100", "--format", "json")
    from dstool.train.plan import Plan

    p = Plan.model_validate_json(result.stdout)
    assert [c.gpus for c in p.clusters] == [1, 8, 64, 512] and p.tokens == 2_000_000_000 and p.mfu == 0.40


def test_a_model_that_fits_nowhere_is_one_line_naming_what_would_fit():
    result = cli("plan", "--model", "tiny", "--tokens", "1M", "--gpu", "A100", "--gpu-memory", "0.05", "--gpus", "1")
    one_line_usage_error(result, "fits no A100 at any ZeRO stage on 1 device(s)")
    fix = result.stderr.split("would fit:")[1]
    assert "GPUs (--gpus " in fix and "--offload-optimizer --offload-params" in fix and "--gpu A10" in fix
    with_zero = cli("plan", "--model", "tiny", "--tokens", "1M", "--gpu-memory", "0.09", "--gpus", "8", "--zero", "0")
    one_line_usage_error(with_zero, "at ZeRO-0")
    assert "(--zero 1)" in with_zero.stderr


@pytest.mark.parametrize("args,needle", [
    (["--gpu", "B200"], "unknown GPU type 'B200'"),
    (["--tokens", "lots"], "token budget must be a positive number"),
    (["--tokens", "0"], "token budget must be a positive number"),
    (["--gpus", "1,x"], "device counts must be positive integers"),
    (["--gpu", "cpu"], "no published MFU for training on CPUs"),
    (["--gpu", "cpu", "--mfu", "0.1", "--gpus", "1,4096"], "plan at most"),
    (["--mfu", "0.3", "--from-run", "."], "give one of them"),
    (["--offload-params"], "add --offload-optimizer"),
    (["--pipeline-stages", "2", "--zero", "2"], "plans zero 0 or 1"),
    (["--expert-parallel", "2"], "needs an MoE model: tiny has no routed experts"),
    (["--model", "tiny-moe", "--expert-parallel", "3"], "does not divide the 4 routed experts"),
    (["--tensor-parallel", "4"], "does not divide the 6 attention heads of tiny"),
    (["--pipeline-stages", "5"], "more than the 4 layers of tiny"),
    (["--model", "tiny-moe", "--expert-parallel", "4", "--gpus", "1,2"], "--expert-parallel 4 divides none of the "
     "device counts planned (1,2): each must be a multiple of 4"),
])
def test_bad_input(args, needle):
    one_line_usage_error(cli("plan", "--tokens", "1M", *args), needle)


def test_from_run_on_a_folder_that_is_not_a_run_or_has_no_step_rows(tmp_path, trained):
    one_line_usage_error(cli("plan", "--tokens", "1M", "--from-run", str(tmp_path)), "is not a dstool train run")
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(trained.parent / "dstool.json", run / "dstool.json")
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 8.0, "mfu": 0.1, "tokens_per_s": 9.0}) + "\n")
    one_line_usage_error(cli("plan", "--tokens", "1M", "--from-run", str(run)), "no step rows after the first")


# ---- layouts: tensor, pipeline and expert parallelism ------------------------------------------------------------


def _states(p, c, zero):
    """Model-state bytes per device of cluster `c` at `zero` (the activation estimate taken off)."""
    return (c.memory[zero].device_gib - p.activations_gib) * GIB


def test_memory_per_rank_falls_with_ep_for_experts_and_with_tp_pp_for_dense_weights():
    """tiny-moe (4 routed experts, 4 heads, 3 layers) on 8 devices: a rank holds dense / (TP x PP) + experts / (EP x
    PP) parameters; ZeRO partitions the dense ones over DP = 8 / PP / TP ranks, the experts over EDP = 8 / PP / EP."""
    base = _plan(model="tiny-moe", gpus="8")
    experts, dense = base.routed_expert_parameters, base.parameters - base.routed_expert_parameters
    assert 0 < experts < base.parameters
    for tp, pp, ep in ((1, 1, 1), (1, 1, 2), (1, 1, 4), (2, 1, 1), (1, 2, 1), (2, 1, 4), (1, 2, 2)):
        p = _plan(model="tiny-moe", gpus="8", tensor_parallel=tp, pipeline_stages=pp, expert_parallel=ep)
        (c,) = p.clusters
        held = dense / (tp * pp) + experts / (ep * pp)
        share = dense / (tp * pp) / (8 // pp // tp) + experts / (ep * pp) / (8 // pp // ep)
        assert (c.data_parallel, c.expert_data_parallel) == (8 // pp // tp, 8 // pp // ep)
        assert c.parameters_per_gpu == pytest.approx(held) and f"PP{pp} x TP{tp} x DP{8 // pp // tp}" in c.layout
        assert _states(p, c, 0) == pytest.approx(20 * held)  # nothing partitioned
        assert _states(p, c, 1) == pytest.approx(4 * held + 16 * share)  # 16-bit weights and gradients whole
        assert [m.zero for m in c.memory] == ([0, 1] if pp > 1 else [0, 1, 2, 3])  # pipelines: ZeRO 0 or 1
        if pp == 1:
            assert _states(p, c, 2) == pytest.approx(2 * held + 18 * share)
    by = {(tp, pp, ep): _states(p, p.clusters[0], 1) for tp, pp, ep, p in (
        (tp, pp, ep, _plan(model="tiny-moe", gpus="8", tensor_parallel=tp, pipeline_stages=pp, expert_parallel=ep))
        for tp, pp, ep in ((1, 1, 1), (1, 1, 2), (1, 1, 4), (2, 1, 1), (1, 2, 1)))}
    assert by[1, 1, 1] > by[1, 1, 2] > by[1, 1, 4] and by[1, 1, 1] > by[2, 1, 1] and by[1, 1, 1] > by[1, 2, 1]


def test_activations_divide_by_tp_and_the_first_pipeline_stage_holds_pp_micro_batches():
    one = _plan(model="tiny", gpus="8", seq_len=256, micro_batch_size=2)
    tp = _plan(model="tiny", gpus="8", seq_len=256, micro_batch_size=2, tensor_parallel=2)
    pp = _plan(model="tiny", gpus="8", seq_len=256, micro_batch_size=2, pipeline_stages=2)
    assert tp.activations_gib == pytest.approx(one.activations_gib / 2)  # sequence parallelism: all of it
    logits = 4 * 256 * 2 * 4096 / GIB
    layers = one.activations_gib - logits
    # the first stage: 2 micro-batches of half the layers; the last: one of them and the logits (larger for tiny)
    assert pp.activations_gib == pytest.approx(max(layers, layers / 2 + logits)) == pytest.approx(layers / 2 + logits)


def test_a_cluster_size_the_layout_does_not_divide_is_not_applicable():
    from dstool.train.plan import format_table

    p = _plan(model="tiny-moe", gpus="2,3,4,6,8", expert_parallel=4, pipeline_stages=1)
    assert [c.gpus for c in p.clusters] == [4, 8]
    assert [(s.gpus, "--expert-parallel 4" in s.reason) for s in p.not_applicable] == [(2, True), (3, True), (6, True)]
    table = format_table(p).splitlines()
    header = next(i for i, line in enumerate(table) if line.split()[:3] == ["GPUs", "nodes", "DP/EDP"])
    assert [line.split()[:3] for line in table[header + 1:header + 6]] == [
        ["2", "1", "n/a"], ["3", "1", "n/a"], ["4", "1", "4/1"], ["6", "1", "n/a"], ["8", "1", "8/2"]]
    assert "n/a: 6 GPUs: world size 6 is not divisible by --expert-parallel 4" in "\n".join(table)


def test_communication_per_step_by_kind():
    """Bytes each device sends per step: EP all-to-all 0 without EP and growing with it, TP and PP 0 without them;
    the data-parallel figure per ZeRO stage (ZeRO-2 every micro-step, ZeRO-3 weights twice more)."""
    kw = dict(model="tiny-moe", gpus="8", seq_len=64, micro_batch_size=2, gradient_accumulation_steps=4)
    plans = {ep: _plan(expert_parallel=ep, **kw) for ep in (1, 2, 4)}
    comm = {ep: p.clusters[0].communication for ep, p in plans.items()}
    assert comm[1].expert_parallel == 0 < comm[2].expert_parallel < comm[4].expert_parallel
    # 2 MoE layers (first_k_dense_replace 1), 2 passes, dispatch + combine, top-2 copies of a 64 x 2 x 192 activation
    assert comm[4].expert_parallel == pytest.approx(4 * 2 * 2 * 2 * 2 * (2 * 64 * 2 * 192) * 3 / 4)
    assert {(c.tensor_parallel, c.pipeline) for c in comm.values()} == {(0, 0)}
    tp = _plan(tensor_parallel=2, **kw).clusters[0].communication
    assert tp.tensor_parallel == pytest.approx(4 * 3 * 2 * 2 * 2 * (2 * 64 * 2 * 192) / 2)  # 4 steps, 3 layers
    three = _plan(pipeline_stages=3, **{**kw, "gpus": "6"}).clusters[0].communication  # a middle stage: both ways
    assert three.pipeline == pytest.approx(4 * 2 * (2 * 64 * 2 * 192))
    assert _plan(pipeline_stages=2, **kw).clusters[0].communication.pipeline == pytest.approx(three.pipeline / 2)
    dp = {m.zero: m.data_parallel_bytes for m in plans[1].clusters[0].memory}
    assert dp[0] == pytest.approx(2 * 2 * plans[1].parameters * 7 / 8) == dp[1]
    assert (dp[2], dp[3]) == (pytest.approx(dp[0] * 5 / 2), pytest.approx(dp[0] * 12 / 2))
    assert comm[1].data_parallel == dp[plans[1].clusters[0].zero]


def test_the_json_carries_the_layout():
    from dstool.train.plan import Plan

    result = cli("plan", "--model", "tiny-moe", "--tokens", "1M", "--gpus", "4,8", "--tensor-parallel", "2",
                 "--expert-parallel", "2", "--format", "json")
    assert result.returncode == 0, result.stderr
    p = Plan.model_validate_json(result.stdout)
    assert (p.tensor_parallel, p.pipeline_stages, p.expert_parallel) == (2, 1, 2)
    assert [(c.layout, c.data_parallel, c.expert_data_parallel) for c in p.clusters] == [
        ("PP1 x TP2 x DP2, EP2 (each routed expert on 2 rank(s) per stage)", 2, 2),
        ("PP1 x TP2 x DP4, EP2 (each routed expert on 4 rank(s) per stage)", 4, 4)]
    assert all(c.communication.tensor_parallel > 0 and c.communication.expert_parallel > 0 for c in p.clusters)


def test_deepseek_v3_on_16_nodes_of_a100_as_docs_plan_says():
    """The presets count as published (meta device: no weights); 671 B does not fit 128 A100-80GB in the layout the
    guides suggest, and fits with the layout and optimizer offload docs/plan.md shows."""
    v3 = ["--model", "deepseek-v3", "--tokens", "100B", "--seq-len", "4096", "--micro-batch-size", "1",
          "--global-batch-size", "1024", "--gpu", "A100", "--gpus", "128", "--activation-checkpointing"]
    one_line_usage_error(cli("plan", *v3, "--tensor-parallel", "4", "--pipeline-stages", "2", "--expert-parallel", "8"),
                         "would fit: --expert-parallel 32 --offload-optimizer")
    p = _plan(**{k.removeprefix("--").replace("-", "_"): v for k, v in zip(v3[::2], v3[1::2])},
              activation_checkpointing=True, expert_parallel=128, offload_optimizer=True)
    assert p.parameters == pytest.approx(671e9, rel=0.02) and p.active_parameters == pytest.approx(37e9, rel=0.03)
    assert p.routed_expert_parameters == (61 - 3) * 256 * 3 * 7168 * 2048
    (c,) = p.clusters
    assert c.zero == 2 and c.memory[2].fits and not c.memory[1].fits and c.expert_data_parallel == 1
    lite = _plan(model="deepseek-v2-lite", gpu="H100", gpus="8", expert_parallel=8)
    assert lite.parameters == pytest.approx(15.7e9, rel=0.02)
    assert lite.routed_expert_parameters == (27 - 1) * 64 * 3 * 2048 * 1408
