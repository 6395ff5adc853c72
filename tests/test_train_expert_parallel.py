"""Expert parallelism (--expert-parallel K, DeepSpeed AutoEP) on real DeepSpeed ranks: the tiny DeepSeek-V3 preset
trains to the single-rank losses on 2 and 4 ranks, its checkpoints resume on another expert layout, model/ is the
plain Hugging Face folder; what cannot work is refused in one line before any rank starts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from dstool.artifacts import Checkpoint, HFModel

from conftest import PARALLEL, TRAIN_CODE, built_once, cli, dstool, losses, model_folder_matches, one_line_usage_error

# fp32, the same global batch of 8 sequences and the same peak lr on every world size
RUN = ["--model", "tiny-moe", *PARALLEL, "--save-every", "2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, worker_id, moe_reference) -> dict[str, Path]:
    """The same 5 steps on 1 rank (the session's `moe_reference`: the model's own MoE blocks) and expert-parallel on
    2 and 4 ranks."""
    layouts = {"ep2": ("--nproc", "2", "--micro-batch-size", "4", "--expert-parallel", "2"),
               "ep4": ("--nproc", "4", "--micro-batch-size", "2", "--expert-parallel", "4")}

    def build(root: Path) -> None:
        for name, args in layouts.items():
            dstool("train", "--output", str(root / name), *RUN, *args, timeout=900)
    root = built_once(tmp_path_factory, worker_id, "expert_parallel", build, TRAIN_CODE, (*RUN, layouts))
    return {"single": moe_reference, **{name: root / name for name in layouts}}


@pytest.mark.parametrize("layout", ["ep2", "ep4"])
def test_expert_parallel_losses_equal_single_rank(runs, layout):
    single, sharded = losses(runs["single"]), losses(runs[layout])
    assert sorted(sharded) == [1, 2, 3, 4, 5]
    for step, loss in single.items():
        assert sharded[step] == pytest.approx(loss, rel=1e-4, abs=1e-4), (step, sharded, single)
    assert sharded[5] < sharded[1] - 0.1  # it learns


def test_expert_parallel_model_folder_is_plain_hugging_face(runs):
    """model/ holds the stacked experts under their Hugging Face names: transformers loads it with no missing or
    unexpected keys and reproduces the engine's logits, which are the single-rank run's weights'."""
    from transformers import AutoConfig

    out = runs["ep4"]
    model_folder_matches(out, reference=runs["single"])
    config = AutoConfig.from_pretrained(out / "model")
    assert (config.n_routed_experts, config.moe_intermediate_size) == (4, 128)
    assert json.loads((out / "ds_config.json").read_text())["expert_parallel"]["autoep_size"] == 4
    assert Checkpoint.read(out / "checkpoints" / "step-00000004").expert_parallel == 4


def test_four_rank_expert_checkpoint_resumes_on_two_ranks(runs, tmp_path):
    """EP4 on 4 ranks, step 2's checkpoint resumed on 2 ranks as EP2 (through the universal form): steps 3-5 are the
    uninterrupted 4-rank run's."""
    out, tag = tmp_path / "resumed", tmp_path / "ep4" / "checkpoints" / "step-00000002"
    shutil.copytree(runs["ep4"] / "checkpoints" / tag.name, tag)  # its universal form is written beside it
    proc = dstool("train", "--output", str(out), *RUN, "--nproc", "2", "--micro-batch-size", "4",
                  "--expert-parallel", "2", "--resume", str(tag), timeout=900)
    assert "to a universal checkpoint" in proc.stdout + proc.stderr
    first, second = losses(runs["ep4"]), losses(out)
    assert sorted(second) == [3, 4, 5]
    for step in (3, 4, 5):
        assert second[step] == pytest.approx(first[step], rel=1e-4, abs=1e-4), (step, first, second)


def test_deepseek_v2_folder_expert_parallel_equals_data_parallel(runs, tmp_path):
    """A DeepSeek-V2 Hugging Face folder (softmax top-k router): EP2 gives the data-parallel run's losses."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, DeepseekV2Config

    tok = AutoTokenizer.from_pretrained(runs["single"] / "tokenizer")
    config = DeepseekV2Config(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                              hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=4, max_position_embeddings=256, moe_intermediate_size=32,
                              n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                              kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                              n_group=1, topk_group=1)
    torch.manual_seed(0)
    folder = tmp_path / "v2"
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    args = ["--model", str(folder), "--nproc", "2", "--zero", "2", "--seq-len", "32", "--micro-batch-size", "4",
            "--max-steps", "3", "--save-every", "3", "--log-every", "1", "--eval-batches", "1", "--no-tensorboard"]
    dstool("train", "--output", str(tmp_path / "dp"), *args, timeout=900)
    dstool("train", "--output", str(tmp_path / "ep"), *args, "--expert-parallel", "2", timeout=900)
    dp, ep = losses(tmp_path / "dp"), losses(tmp_path / "ep")
    assert sorted(ep) == [1, 2, 3] and all(ep[s] == pytest.approx(dp[s], rel=1e-4, abs=1e-4) for s in dp), (dp, ep)
    assert HFModel.read(tmp_path / "ep" / "model", verify=True).parity.max_abs_logit_diff < 1e-4
    # AutoTP's route stops on DeepSeek-V2's attention on the ranks: refused here instead
    one_line_usage_error(cli("train", "--output", str(tmp_path / "tp"), *args, "--tensor-parallel", "2"),
                         "--tensor-parallel supports DeepSeek-V3's attention, not DeepSeek-V2's")


@pytest.mark.parametrize("args, needle", [
    (["--model", "tiny", "--nproc", "2", "--expert-parallel", "2"], "needs a mixture-of-experts model"),
    (["--model", "tiny-moe", "--nproc", "3", "--expert-parallel", "3"], "does not divide the 4 routed experts"),
    (["--model", "tiny-moe", "--nproc", "3", "--expert-parallel", "2"], "world size 3 is not divisible by "
                                                                         "--expert-parallel 2"),
    (["--model", "tiny-moe", "--nproc", "4", "--expert-parallel", "2", "--pipeline-stages", "2", "--zero", "1"],
     "expert_parallel and pipeline_stages cannot be combined"),
    (["--model", "tiny-moe", "--nproc", "4", "--expert-parallel", "2", "--tensor-parallel", "2"],
     "expert_parallel and tensor_parallel cannot be combined"),
    (["--model", "tiny-moe", "--nproc", "2", "--expert-parallel", "2", "--lora", "8"],
     "lora and expert_parallel cannot be combined"),
])
def test_expert_parallel_refusals_are_one_line(args, needle, tmp_path):
    one_line_usage_error(cli("train", "--output", str(tmp_path / "run"), *args), needle)
    assert not (tmp_path / "run" / "run.json").exists()  # refused before any rank was planned


@pytest.mark.parametrize("saved, args, needle", [
    ("single", ["--expert-parallel", "2"], "holds the model's own MoE blocks"),
    ("ep2", ["--tensor-parallel", "2"], "holds expert-parallel MoE layers (DeepSpeed AutoEP), which pipeline stages"),
])
def test_checkpoint_of_another_moe_layout_refused(runs, saved, args, needle, tmp_path):
    tag = runs[saved] / "checkpoints" / "step-00000002"
    result = cli("train", "--output", str(tmp_path / "run"), *RUN, "--nproc", "2", "--micro-batch-size", "4", *args,
                 "--resume", str(tag))
    one_line_usage_error(result, needle)


def test_deepspeed_json_may_not_set_the_layout(tmp_path):
    """The layout's checks, checkpoints and model/ follow --expert-parallel: a JSON that would change it is refused
    rather than silently winning."""
    user = tmp_path / "ds.json"
    user.write_text(json.dumps({"expert_parallel": {"enabled": True, "autoep_size": 1}}))
    result = cli("train", "--output", str(tmp_path / "run"), *RUN, "--nproc", "2", "--micro-batch-size", "4",
                 "--expert-parallel", "2", "--deepspeed-config", str(user))
    one_line_usage_error(result, "sets 'expert_parallel', which dstool derives from --expert-parallel")
