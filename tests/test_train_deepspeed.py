"""Real DeepSpeed training in several processes (gloo on this CPU), through the `dstool` CLI."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import torch

from dstool.artifacts import Checkpoint, HFModel

from conftest import DSTOOL, FAST, TRAIN_CODE, built_once, cli, crash_after_first_checkpoint, dstool, losses

BF16 = ["--nproc", "2", "--zero", "2", "--precision", "bf16", "--max-steps", "16", "--save-every", "4",
        "--trace-samples", *FAST]


@pytest.fixture(scope="module")
def bf16_runs(tmp_path_factory, worker_id):
    """An uninterrupted ZeRO-2 bf16 run, and the same run SIGKILLed after its first checkpoint, then resumed: (the
    run, the crashed run, the checkpoint it was killed at, its sample traces then, the resumed run's stdout)."""
    def build(out: Path) -> None:
        dstool("train", "--output", str(out / "ref"), *BF16)
        crashed = out / "crashed"
        crash_after_first_checkpoint(crashed, *BF16)
        killed = {"at": (crashed / "checkpoints" / "latest").read_text().strip(),
                  "trace": {r: _trace(crashed, r) for r in (0, 1)}}
        killed["resumed"] = dstool("train", "--output", str(crashed), "--resume", "auto", *BF16).stdout
        (out / "killed.json").write_text(json.dumps(killed))
    made = built_once(tmp_path_factory, worker_id, "bf16_runs", build, TRAIN_CODE, BF16)
    killed = json.loads((made / "killed.json").read_text())
    return made / "ref", made / "crashed", killed["at"], {int(r): t for r, t in killed["trace"].items()}, \
        killed["resumed"]


def _trace(out: Path, rank: int) -> list[dict]:
    path = out / f"samples.rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def test_bf16_zero2_trains_with_falling_loss(bf16_runs):
    ref = bf16_runs[0]
    curve = losses(ref)
    assert sorted(curve) == list(range(1, 17))
    assert sum(curve[s] for s in range(13, 17)) / 4 < curve[1] - 1.0, curve
    ds = json.loads((ref / "ds_config.json").read_text())
    assert ds["bf16"]["enabled"] and ds["zero_optimization"]["stage"] == 2 and ds["train_batch_size"] == 8
    assert "precision: bf16" in (ref / "config.yaml").read_text()


def test_checkpoints_are_genuine_deepspeed_and_hashed(bf16_runs):
    ref = bf16_runs[0]
    root = ref / "checkpoints"
    assert (root / "latest").read_text().strip() == "step-00000016"
    tags = sorted(p.name for p in root.iterdir() if p.is_dir())
    assert tags == ["step-00000008", "step-00000012", "step-00000016"]  # keep_checkpoints=3
    tag = root / "step-00000016"
    names = {p.name for p in tag.iterdir()}
    assert "mp_rank_00_model_states.pt" in names
    for rank in (0, 1):  # every rank saved its optimizer shard (bf16_zero_pp_rank_… under bf16)
        assert any(n.endswith(f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt") for n in names), names
    assert Checkpoint.read(tag, verify=True).world_size == 2
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state = get_fp32_state_dict_from_zero_checkpoint(str(root), tag="step-00000016")
    assert state["lm_head.weight"].dtype == torch.float32 and state["lm_head.weight"].shape[1] == 192


def test_resume_after_crash_continues_the_loss_curve_exactly(bf16_runs):
    ref, crashed, killed_at, _, resumed = bf16_runs
    start = int(killed_at.split("-")[1])
    assert f"resumed at step {start}" in resumed
    ref_curve, crash_curve = losses(ref), losses(crashed)
    assert sorted(crash_curve) == list(range(1, 17))
    for step in range(start + 1, 17):  # same step, data position and LR schedule -> the same losses
        assert crash_curve[step] == pytest.approx(ref_curve[step], abs=1e-6), (step, crash_curve, ref_curve)


def test_resume_sees_no_sample_twice(bf16_runs):
    ref, crashed, killed_at, crash_trace, _ = bf16_runs
    start = int(killed_at.split("-")[1])
    for rank in (0, 1):
        ref_steps = {(r["step"], r["micro"]): r["samples"] for r in _trace(ref, rank)}
        after = _trace(crashed, rank)[len(crash_trace[rank]):]  # rows the resumed run wrote
        assert min(r["step"] for r in after) == start  # 0-based: the first step after the checkpoint
        committed = [r for r in crash_trace[rank] if r["step"] < start] + after
        assert {(r["step"], r["micro"]): r["samples"] for r in committed} == ref_steps
    seen = [i for rank in (0, 1) for r in _trace(ref, rank) for i in r["samples"]]
    assert len(seen) == len(set(seen)) == 16 * 8


def _popen_train(out: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([*DSTOOL, "train", "--output", str(out), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _wait_for_step(out: Path, proc: subprocess.Popen, step: int) -> None:
    deadline, beat = time.time() + 300, out / "heartbeat.json"
    while not beat.exists() or json.loads(beat.read_text())["step"] < step:
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.05)


@pytest.mark.slow
def test_sigterm_checkpoints_the_step_and_resume_continues_exactly(bf16_runs, tmp_path):
    """Preemption: SIGTERM to `dstool train` -> every rank finishes its step, that step is checkpointed, exit 143
    (retry); the same command again continues the uninterrupted run's loss curve exactly."""
    ref, out = bf16_runs[0], tmp_path / "preempted"
    proc = _popen_train(out, *BF16)
    _wait_for_step(out, proc, 5)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143, stderr
    record = json.loads((out / "preempted.json").read_text())
    step = record["step"]
    assert 5 <= step < 16 and record["reason"].startswith("stop-requested"), record
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step-{step:08d}"
    assert Checkpoint.read(out / "checkpoints" / f"step-{step:08d}", verify=True).step == step
    assert "preempted" in stderr and f"after step {step}" in stderr and not (out / "model").exists()
    resumed = dstool("train", "--output", str(out), *BF16)
    assert f"resumed at step {step}" in resumed.stdout
    ref_curve, curve = losses(ref), losses(out)
    assert sorted(curve) == list(range(1, 17))
    for s in range(1, 17):
        assert curve[s] == pytest.approx(ref_curve[s], abs=1e-6), (s, curve, ref_curve)


def test_save_every_minutes_and_sigusr1_to_every_process(tmp_path):
    """--save-every-minutes checkpoints by the clock between --save-every steps; SIGUSR1 to every process of the
    run (as SLURM sends it) stops it with a checkpoint too, under torchrun's agent."""
    out = tmp_path / "run"
    proc = _popen_train(out, "--nproc", "2", "--zero", "0", "--max-steps", "400", "--save-every", "1000",
                        "--save-every-minutes", "0.002", "--keep-checkpoints", "10", *FAST)
    _wait_for_step(out, proc, 6)
    for p in [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]:
        p.send_signal(signal.SIGUSR1)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143, stderr
    step = json.loads((out / "preempted.json").read_text())["step"]
    tags = sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step-"))
    assert len(tags) >= 3 and tags[-1] == f"step-{step:08d}", tags  # every ~0.12 s, none of them at step 1000
    assert "SIGUSR1" in stderr


def test_model_folder_loads_and_matches_engine_logits(bf16_runs):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ref = bf16_runs[0]
    manifest = HFModel.read(ref / "model", verify=True)
    model = AutoModelForCausalLM.from_pretrained(ref / "model").eval()
    assert model.dtype == torch.bfloat16  # the weights the engine computed with
    probe = torch.load(ref / "probe_logits.pt")
    with torch.no_grad():
        logits = model(input_ids=probe["input_ids"]).logits.float()
    assert (logits - probe["logits"]).abs().max().item() <= manifest.parity.tolerance
    tok = AutoTokenizer.from_pretrained(ref / "model")
    assert tok.decode(tok("To be, or not to be")["input_ids"]) == "To be, or not to be"


def test_damaged_checkpoint_is_refused(bf16_runs, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(bf16_runs[0], run)
    victim = run / "checkpoints" / "step-00000016" / "mp_rank_00_model_states.pt"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    proc = cli("train", "--output", str(run), "--resume", str(run / "checkpoints" / "step-00000016"), *BF16)
    assert proc.returncode == 2 and "damaged checkpoint" in proc.stderr and "sha256" in proc.stderr


MOE_Z3 = ["--model", "tiny-moe", "--nproc", "2", "--zero", "3", "--gradient-accumulation-steps", "2",
          "--micro-batch-size", "2", "--max-steps", "6", "--save-every", "3", "--seq-len", "64", "--log-every", "1"]


@pytest.fixture(scope="module")
def moe_z3(tmp_path_factory, worker_id) -> Path:
    return built_once(tmp_path_factory, worker_id, "moe_z3", lambda out: dstool("train", "--output", str(out), *MOE_Z3),
                      TRAIN_CODE, MOE_Z3)


def test_tiny_moe_zero3_with_accumulation(moe_z3):
    out = moe_z3
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out / "model")
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    probe = torch.load(out / "probe_logits.pt")
    with torch.no_grad():
        diff = (model(input_ids=probe["input_ids"]).logits - probe["logits"]).abs().max().item()
    assert diff < 1e-4
    assert json.loads((out / "ds_config.json").read_text())["gradient_accumulation_steps"] == 2
    curve = losses(out)
    assert curve[6] < curve[1]
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))


@pytest.mark.slow
def test_activation_checkpointing_keeps_the_losses(moe_z3, tmp_path):
    """--activation-checkpointing on the DeepSeek-V3 MoE preset under ZeRO-3: every decoder layer is recomputed in
    the backward pass (transformers' mechanism), and the losses are the run's without it."""
    out = tmp_path / "ac"
    proc = dstool("train", "--output", str(out), *MOE_Z3, "--activation-checkpointing", "--no-tensorboard")
    assert "activation checkpointing: 3 decoder layers recomputed" in proc.stdout
    a, b = losses(out), losses(moe_z3)
    assert sorted(a) == list(range(1, 7))
    for step in a:
        assert a[step] == pytest.approx(b[step], abs=1e-5), (step, a, b)


@pytest.fixture(scope="module")
def zero1_single_node(tmp_path_factory, worker_id):
    args = ("--nproc", "2", "--zero", "1", "--max-steps", "4", "--save-every", "4", *FAST)
    return built_once(tmp_path_factory, worker_id, "zero1_single_node",
                      lambda out: dstool("train", "--output", str(out), *args), TRAIN_CODE, args)


@pytest.mark.slow
def test_two_nodes_on_localhost_with_torchrun(zero1_single_node, tmp_path):
    out = tmp_path / "two_nodes"
    port = str(29600 + os.getpid() % 300)
    common = ["train", "--output", str(out), "--nproc", "1", "--num-nodes", "2", "--master-addr", "127.0.0.1",
              "--master-port", port, "--zero", "1", "--max-steps", "4", "--save-every", "4",
              "--env", "NCCL_SOCKET_IFNAME=lo", *FAST]
    nodes = [subprocess.Popen([*DSTOOL, *common, "--node-rank", str(r)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    outputs = [n.communicate(timeout=600)[0] for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], outputs
    assert "2 rank(s) (2 node(s) x 1" in outputs[0]
    a, b = losses(out), losses(zero1_single_node)
    assert all(a[s] == pytest.approx(b[s], abs=1e-5) for s in b)  # 2 nodes x 1 == 1 node x 2


def test_the_deepspeed_launcher_with_zero0_from_user_json_equals_zero1_under_torchrun(zero1_single_node, tmp_path):
    """A hostfile (one local host, 2 slots) starts the ranks with DeepSpeed's launcher; the user's DeepSpeed JSON is
    merged over dstool's (ZeRO stage 0 over --zero 1); the losses are the ZeRO-1 torchrun run's."""
    (tmp_path / "hostfile").write_text("localhost slots=2\n")
    user = tmp_path / "ds.json"
    user.write_text(json.dumps({"wall_clock_breakdown": False, "zero_optimization": {"stage": 0}}))
    out = tmp_path / "ds_launcher"
    proc = dstool("train", "--output", str(out), "--hostfile", str(tmp_path / "hostfile"), "--zero", "1",
                  "--deepspeed-config", str(user), "--max-steps", "4", "--save-every", "4", *FAST)
    assert "deepspeed, CPU/gloo" in proc.stdout
    assert "[INFO]" not in proc.stdout  # the launcher's lines: with -v only
    ds = json.loads((out / "ds_config.json").read_text())
    assert ds["zero_optimization"]["stage"] == 0 and ds["wall_clock_breakdown"] is False
    a, b = losses(out), losses(zero1_single_node)
    assert a.keys() == b.keys() and all(a[s] == pytest.approx(b[s], abs=1e-5) for s in a)


@pytest.mark.slow
def test_offload_optimizer_and_params_zero3(tmp_path):
    out = tmp_path / "offload"
    dstool("train", "--output", str(out), "--nproc", "2", "--zero", "3", "--offload-optimizer", "--offload-params",
           "--max-steps", "3", "--save-every", "3", *FAST, timeout=900)
    zero = json.loads((out / "ds_config.json").read_text())["zero_optimization"]
    assert zero["offload_optimizer"]["device"] == "cpu" and zero["offload_param"]["device"] == "cpu"
    assert HFModel.read(out / "model", verify=True).parity.max_abs_logit_diff < 1e-4


def test_continue_from_a_model_folder_on_jsonl_data(bf16_runs, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    lines = [json.dumps({"text": f"Line {i}: the quality of mercy is not strained."}) for i in range(400)]
    (corpus / "part1.jsonl").write_text("\n".join(lines))
    (corpus / "notes.txt").write_text("It droppeth as the gentle rain from heaven. " * 200)
    out = tmp_path / "finetune"
    dstool("train", "--output", str(out), "--model", str(bf16_runs[0] / "model"), "--data", str(corpus),
           "--nproc", "1", "--zero", "0", "--max-steps", "3", "--save-every", "3", *FAST)
    src = json.loads((bf16_runs[0] / "model" / "tokenizer.json").read_text())
    reused = json.loads((out / "tokenizer" / "tokenizer.json").read_text())["model"]
    assert reused == src["model"]  # reused, not retrained
    assert json.loads((out / "data" / "meta.json").read_text())["documents"] == 401


def test_diverging_loss_stops_and_keeps_last_good_checkpoint(tmp_path):
    out = tmp_path / "diverge"
    proc = dstool("train", "--output", str(out), "--nproc", "2", "--lr", "1e4", "--grad-clip", "0",
                  "--max-steps", "12", "--save-every", "2", *FAST, check=False)
    assert proc.returncode != 0
    assert "became" in proc.stderr and "last good checkpoint is kept" in proc.stderr, proc.stderr[-2000:]
    assert len(proc.stderr.strip().splitlines()) == 1 and f"(log: {out / 'logs'})" in proc.stderr  # no traceback
    failure = json.loads((out / "failure.json").read_text())
    latest = (out / "checkpoints" / "latest").read_text().strip()
    assert int(latest.split("-")[1]) < failure["step"]
    Checkpoint.read(out / "checkpoints" / latest, verify=True)
    assert not (out / "model").exists()
