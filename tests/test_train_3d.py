"""Tensor parallelism for DeepSeek-V3 (MLA + MoE), and tensor x pipeline parallelism (PP2 x TP2 on 4 ranks) for Llama
and the MoE preset: the losses, gradient norms and trained weights of data parallelism, a resume on the same
layout, and the combinations refused in one line before any rank starts. Real DeepSpeed processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dstool.artifacts import Checkpoint

from conftest import PARALLEL, TRAIN_CODE, built_once, cli, dstool, losses, model_folder_matches, one_line_usage_error

RUN = [*PARALLEL, "--micro-batch-size", "4"]
THREE_D = ["--nproc", "4", "--pipeline-stages", "2", "--tensor-parallel", "2"]


def _rows(out: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r for r in rows if "loss" in r}


def _same_curve(out: Path, ref: Path, steps=range(1, 6)) -> None:
    a, b = _rows(out), _rows(ref)
    for step in steps:  # same weights, batch and lr: only the order of the float sums differs
        assert a[step]["loss"] == pytest.approx(b[step]["loss"], rel=1e-4), (step, losses(out), losses(ref))
        assert a[step]["grad_norm"] == pytest.approx(b[step]["grad_norm"], rel=1e-4), step  # clipping sees the same
    assert b[5]["loss"] < b[1]["loss"] - 0.2  # the curve being compared moves


@pytest.fixture(scope="module")
def runs(tmp_path_factory, worker_id, moe_reference):
    """For tiny and tiny-moe: the data-parallel reference (1 rank; tiny-moe's the session's `moe_reference`) and PP2
    x TP2 x DP1 on 4 ranks; for tiny-moe also AutoTP alone (TP2 x DP1 on 2 ranks). Each with its stdout."""
    def build(out: Path) -> None:
        dstool("train", "--output", str(out / "tiny_ref"), "--model", "tiny", "--nproc", "1", *RUN)
        for model in ("tiny", "tiny-moe"):
            (out / f"{model}_3d.stdout").write_text(dstool(
                "train", "--output", str(out / f"{model}_3d"), "--model", model, *RUN, *THREE_D, "--save-every",
                "2").stdout)  # steps 2, 4 and 5 kept
        (out / "tiny-moe_tp.stdout").write_text(dstool(
            "train", "--output", str(out / "tiny-moe_tp"), "--model", "tiny-moe", "--nproc", "2", "--tensor-parallel",
            "2", *RUN).stdout)

    made = built_once(tmp_path_factory, worker_id, "train_3d", build, TRAIN_CODE, (*RUN, *THREE_D, moe_reference))
    runs = {("tiny", "ref"): (made / "tiny_ref", ""), ("tiny-moe", "ref"): (moe_reference, "")}
    for key in (("tiny", "3d"), ("tiny-moe", "3d"), ("tiny-moe", "tp")):
        runs[key] = made / "_".join(key), (made / f"{'_'.join(key)}.stdout").read_text()
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny", "tiny-moe"])
def test_tensor_x_pipeline_matches_data_parallel(runs, model):
    (out, stdout), (ref, _) = runs[model, "3d"], runs[model, "ref"]
    assert "layout: PP2 x TP2 x DP1" in stdout
    _same_curve(out, ref)
    ds = json.loads((out / "ds_config.json").read_text())
    assert ds["zero_optimization"]["stage"] == 1 and "tensor_parallel" not in ds  # dstool cuts the stages' layers
    tag = out / "checkpoints" / "step-00000005"
    assert Checkpoint.read(tag, verify=True).world_size == 4
    names = {p.name for p in tag.iterdir()}  # DeepSpeed's pipeline layout, a file per layer and tensor-parallel rank
    layers = 6 if model == "tiny" else 5  # embedding, 4 or 3 decoder layers, head
    assert {f"layer_{i:02d}-model_{t:02d}-model_states.pt" for i in range(layers) for t in range(2)} <= names, names


@pytest.mark.slow
def test_moe_tensor_parallel_matches_data_parallel(runs):
    """AutoTP on MLA + MoE: attention heads, the dense MLP and the shared experts cut, the routed experts whole."""
    (out, _), (ref, _) = runs["tiny-moe", "tp"], runs["tiny-moe", "ref"]
    _same_curve(out, ref)
    tp = json.loads((out / "ds_config.json").read_text())["tensor_parallel"]
    assert tp["autotp_size"] == 2 and not tp["partition_config"]["use_default_specs"]
    names = {p.name for p in (out / "checkpoints" / "step-00000005").iterdir()}
    assert {"mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"} <= names, names


@pytest.mark.slow
@pytest.mark.parametrize("run", [("tiny", "3d"), ("tiny-moe", "3d"), ("tiny-moe", "tp")], ids="-".join)
def test_tensor_parallel_model_folder_is_the_whole_model(runs, run):
    """The shards joined into model/ reload in transformers with the engine's logits, and they are the weights the
    data-parallel run trained."""
    model_folder_matches(runs[run][0], reference=runs[run[0], "ref"][0])


@pytest.mark.slow
def test_tensor_x_pipeline_resumes_on_the_same_layout(runs, tmp_path):
    """PP2 x TP2 resumes from its step-2 checkpoint (each rank its own shards and optimizer state) and continues the
    uninterrupted curve. (A run killed mid-way, then resumed: test_train_deepspeed.py's bf16 runs.)"""
    out = tmp_path / "resumed"
    tag = runs["tiny-moe", "3d"][0] / "checkpoints" / "step-00000002"
    proc = dstool("train", "--output", str(out), "--model", "tiny-moe", *RUN, *THREE_D, "--resume", str(tag))
    assert "resumed at step 2" in proc.stdout
    _same_curve(out, runs["tiny-moe", "ref"][0], steps=range(3, 6))


def test_tensor_x_pipeline_checkpoint_refuses_another_layout(runs, tmp_path):
    """Per-stage and per-shard files load on their own layout only: another one is refused in one line, before any
    rank starts, naming the saved layout."""
    tag = runs["tiny-moe", "3d"][0] / "checkpoints" / "step-00000005"
    result = cli("train", "--output", str(tmp_path / "run"), "--model", "tiny-moe", *RUN, "--nproc", "4",
                 "--pipeline-stages", "4", "--resume", str(tag))
    one_line_usage_error(result, "was saved with --pipeline-stages 2 --tensor-parallel 2")


def _qwen2_folder(tmp_path: Path) -> str:
    from transformers import Qwen2Config

    folder = tmp_path / "qwen2"
    Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=512, architectures=["Qwen2ForCausalLM"]).save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("args,needle", [
    (["--nproc", "2", "--pipeline-stages", "2", "--tensor-parallel", "2"],
     "the 1 ranks of each pipeline stage (world 2 / --pipeline-stages 2) are not divisible by --tensor-parallel 2"),
    (["--nproc", "8", "--pipeline-stages", "2", "--tensor-parallel", "4"],
     "--tensor-parallel 4 does not divide the 6 attention heads of tiny"),
    (["--nproc", "6", "--pipeline-stages", "2", "--tensor-parallel", "3"],
     "--tensor-parallel 3 does not divide the 2 key-value heads of tiny"),
    (["--nproc", "3", "--tensor-parallel", "3", "--model", "tiny-moe"],
     "--tensor-parallel 3 does not divide the 4 attention heads of tiny-moe"),
    (["--nproc", "4", "--pipeline-stages", "2", "--tensor-parallel", "2", "--zero", "2"], "needs zero 0 or 1"),
    (["--nproc", "4", "--pipeline-stages", "2", "--tensor-parallel", "2", "--expert-parallel", "2", "--model",
      "tiny-moe"], "expert_parallel and pipeline_stages cannot be combined"),
    (["--nproc", "4", "--pipeline-stages", "2", "--tensor-parallel", "2", "--data-format", "chat"],
     "needs pipeline_stages 1"),
    (["--nproc", "4", "--pipeline-stages", "2", "--tensor-parallel", "2", "--model", "QWEN2"],
     "--pipeline-stages needs a model of type llama or deepseek_v3"),
])
def test_refused_combinations_are_one_line_before_launch(args, needle, tmp_path):
    args = [_qwen2_folder(tmp_path) if a == "QWEN2" else a for a in args]
    one_line_usage_error(cli("train", "--output", str(tmp_path / "run"), "--zero", "1", *args), needle)
    assert not (tmp_path / "run").exists()  # refused before the run folder, the data or a rank
