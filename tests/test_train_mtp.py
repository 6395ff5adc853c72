"""DeepSeek-V3 multi-token prediction (`dstool train --mtp-layers N`): trained on real DeepSpeed ranks (gloo),
saved under DeepSeek's checkpoint names, loaded back, resumed exactly, with ZeRO-2/3 and expert parallelism."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import TRAIN_CODE, built_once, cli, dstool, one_line_usage_error

# 2 ranks, ZeRO-2, 6 steps, λ 0.3 for the first half then 0.1
RUN = ["--model", "tiny-moe", "--nproc", "2", "--zero", "2", "--max-steps", "6", "--save-every", "3", "--seq-len", "64",
       "--micro-batch-size", "2", "--log-every", "1", "--no-tensorboard"]
MTP = [*RUN, "--mtp-layers", "1", "--mtp-loss-drop-ratio", "0.5"]


def _rows(out: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r for r in rows if "loss" in r}  # a resumed run's later rows win


@pytest.fixture(scope="module")
def mtp_runs(tmp_path_factory, worker_id):
    """An uninterrupted run, and the same resumed in another folder from the first one's step-3 checkpoint (a run
    killed, then resumed: test_train_deepspeed.py's bf16 runs), with its stdout."""
    def build(out: Path) -> None:
        dstool("train", "--output", str(out / "ref"), *MTP)
        (out / "resumed.stdout").write_text(dstool("train", "--output", str(out / "resumed"), *MTP, "--resume",
                                                   str(out / "ref" / "checkpoints" / "step-00000003")).stdout)
    made = built_once(tmp_path_factory, worker_id, "mtp_runs", build, TRAIN_CODE, MTP)
    return made / "ref", made / "resumed", (made / "resumed.stdout").read_text()


def test_mtp_trains_and_logs_each_depth(mtp_runs):
    ref = mtp_runs[0]
    rows = _rows(ref)
    assert sorted(rows) == list(range(1, 7))
    for r in rows.values():
        assert r["loss"] == r["loss"] and r["mtp_loss_1"] == r["mtp_loss_1"]  # finite, both logged
    assert rows[6]["mtp_loss_1"] < rows[1]["mtp_loss_1"] and rows[6]["loss"] < rows[1]["loss"], rows
    assert [rows[s]["mtp_loss_weight"] for s in range(1, 7)] == [0.3] * 3 + [0.1] * 3  # the schedule
    assert "mtp_layers: 1" in (ref / "config.yaml").read_text()


def test_model_folder_has_deepseek_mtp_names(mtp_runs):
    """model/ is what DeepSeek's checkpoints, vLLM's DeepSeekMTP and SGLang's nextn loader read: the MTP layer at
    model.layers.{num_hidden_layers} with enorm, hnorm, eh_proj, shared_head.norm/head, embed_tokens and a full
    decoder layer (per-expert weights), and num_nextn_predict_layers in config.json."""
    from safetensors import safe_open

    folder = mtp_runs[0] / "model"
    config = json.loads((folder / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1 and config["num_hidden_layers"] == 3
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        p = "model.layers.3."
        for name in ("eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight",
                     "shared_head.head.weight", "embed_tokens.weight", "self_attn.q_a_proj.weight",
                     "self_attn.kv_b_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight",
                     "mlp.gate.weight", "mlp.gate.e_score_correction_bias", "mlp.shared_experts.down_proj.weight",
                     "mlp.experts.0.gate_proj.weight", "mlp.experts.3.down_proj.weight"):
            assert p + name in keys, name
        assert f.get_tensor(p + "eh_proj.weight").shape == (192, 384)
        # the shared weights are the main model's
        assert torch.equal(f.get_tensor(p + "shared_head.head.weight"), f.get_tensor("lm_head.weight"))
        assert torch.equal(f.get_tensor(p + "embed_tokens.weight"), f.get_tensor("model.embed_tokens.weight"))
        assert not any(k.startswith("model.layers.4.") for k in keys)


def _batch(folder: Path) -> torch.Tensor:
    return torch.load(folder.parent / "probe_logits.pt")["input_ids"]


def test_saved_mtp_equals_the_engines_and_transformers_mtp_layer(mtp_runs):
    """The MTP weights read back from model/ (dstool's loader) are the engine's final ones (the ZeRO checkpoint's
    fp32 weights give the same MTP losses), and transformers' own MtpLayer built on them gives the same depth-1
    logits: the names and the concatenation order are DeepSeek's."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoModelForCausalLM
    from transformers.masking_utils import create_causal_mask
    from transformers.modeling_layers import MtpLayer
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

    from dstool.train import mtp

    ref = mtp_runs[0]
    folder = ref / "model"
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert mtp.attach(loaded, 1, str(folder)) == 1
    engine = AutoModelForCausalLM.from_config(loaded.config)
    mtp.attach(engine, 1)
    state = get_fp32_state_dict_from_zero_checkpoint(str(ref / "checkpoints"), tag="step-00000006")
    engine.load_state_dict(state, strict=True)
    ids = _batch(folder)
    losses_of = {}
    for name, model in (("folder", loaded), ("checkpoint", engine)):
        model.train()
        with torch.no_grad():
            losses_of[name] = model(input_ids=ids, labels=ids).mtp_losses
    assert torch.allclose(losses_of["folder"], losses_of["checkpoint"], atol=1e-6), losses_of

    layer = mtp.layers(loaded)[0]
    theirs = MtpLayer(loaded.config.get_mtp_config(), DeepseekV3DecoderLayer, DeepseekV3RMSNorm, 0)
    renamed = {}
    for key, value in layer.state_dict().items():
        head = key.split(".")[0]
        renamed[key if head in ("enorm", "hnorm", "eh_proj") else "post_norm.weight" if head == "shared_head"
                else "mtp_block." + key] = value
    theirs.load_state_dict(renamed, strict=True)
    loaded.eval()
    with torch.no_grad():
        hidden = loaded.model(input_ids=ids).last_hidden_state
        embeds = loaded.model.embed_tokens(ids)
        n = ids.shape[1] - 1
        pos = torch.arange(n).unsqueeze(0)
        rope = loaded.model.rotary_emb(embeds, pos)
        mask = create_causal_mask(config=loaded.config, inputs_embeds=embeds[:, 1:], attention_mask=None, cache=None,
                                  position_ids=pos)
        ours = loaded.lm_head(layer.shared_head.norm(layer(hidden[:, :n], embeds[:, 1:], attention_mask=mask,
                                                           position_ids=pos, position_embeddings=rope)))
        ref_logits = loaded.lm_head(theirs(embeds[:, 1:], hidden[:, :n], position_embeddings=rope, attention_mask=mask,
                                           position_ids=pos, cache=None))
    assert (ours - ref_logits).abs().max().item() < 1e-5


def test_resume_continues_the_main_and_mtp_losses_exactly(mtp_runs):
    ref, again, resumed = mtp_runs
    assert "resumed at step 3" in resumed
    a, b = _rows(ref), _rows(again)
    assert sorted(b) == list(range(4, 7))
    for step in range(4, 7):
        for key in ("loss", "mtp_loss_1"):
            assert b[step][key] == pytest.approx(a[step][key], abs=1e-6), (step, key, a[step], b[step])
        assert b[step]["mtp_loss_weight"] == 0.1


def test_resume_refuses_another_mtp_depth(mtp_runs, tmp_path):
    """A checkpoint with MTP layers is refused, in one line before any rank starts, by a run without them."""
    again = shutil.copytree(mtp_runs[1], tmp_path / "again")  # (a refusal is logged in the run's train.log)
    one_line_usage_error(cli("train", "--output", str(again), *RUN), "trained 1 MTP layers (--mtp-layers 1)")


def test_expert_parallel_shards_the_mtp_experts_with_the_same_losses(mtp_runs, tmp_path):
    """--expert-parallel 2: AutoEP replaces the MTP layer's MoE block too (model.layers.3.mlp), and the losses are
    the data-parallel run's; model/ gathers its experts back under DeepSeek's names."""
    out = tmp_path / "ep"
    dstool("train", "--output", str(out), *MTP, "--expert-parallel", "2")
    # DeepSpeed's per-expert files: tiny-moe's two MoE layers and the MTP layer's
    tag = out / "checkpoints" / "step-00000006"
    assert {p.name.split("_expert_")[0] for p in tag.glob("layer_*_expert_*_model_states.pt")} == {
        "layer_0", "layer_1", "layer_2"}
    a, b = _rows(mtp_runs[0]), _rows(out)
    for step in range(1, 7):
        for key in ("loss", "mtp_loss_1"):
            assert b[step][key] == pytest.approx(a[step][key], abs=1e-4), (step, key, a[step], b[step])
    from safetensors import safe_open

    with safe_open(str(out / "model" / "model.safetensors"), "pt") as f:
        assert "model.layers.3.mlp.experts.3.up_proj.weight" in set(f.keys())


def test_zero3_continues_from_the_saved_folder_with_its_mtp_layer(mtp_runs, tmp_path):
    """`--model MODEL_DIR --mtp-layers 1` under ZeRO-3 loads the folder's MTP layer (not a fresh one): one step at a
    negligible learning rate writes model/ with the same MTP weights (a fresh layer would differ by ~0.02)."""
    from safetensors import safe_open

    folder = mtp_runs[0] / "model"
    out = tmp_path / "again"
    proc = dstool("train", "--model", str(folder), "--output", str(out), "--mtp-layers", "1", "--nproc", "1",
                  "--zero", "3", "--max-steps", "1", "--lr", "1e-9", "--weight-decay", "0", "--seq-len", "64",
                  "--micro-batch-size", "2", "--log-every", "1", "--no-tensorboard")
    assert f"1 loaded from {folder}" in proc.stdout
    assert json.loads((out / "model" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    with safe_open(str(folder / "model.safetensors"), "pt") as a, \
            safe_open(str(out / "model" / "model.safetensors"), "pt") as b:
        names = [k for k in a.keys() if k.startswith("model.layers.3.")]
        assert len(names) == 32 and set(names) <= set(b.keys())
        for name in names:
            assert torch.allclose(a.get_tensor(name), b.get_tensor(name), atol=1e-6), name


def test_refused_for_a_llama_preset_and_other_layouts(tmp_path):
    one_line_usage_error(cli("train", "--model", "tiny", "--mtp-layers", "1", "--output", str(tmp_path / "a")),
                         "--mtp-layers 1 needs a DeepSeek-V3 layout")
    assert not (tmp_path / "a").exists()
    one_line_usage_error(cli("train", "--model", "tiny-moe", "--mtp-layers", "1", "--pipeline-stages", "2",
                             "--zero", "1", "--output", str(tmp_path / "b")), "mtp_layers 1 trains with data")
    one_line_usage_error(cli("train", "--mtp-loss-weight", "0.5", "--output", str(tmp_path / "c")),
                         "need --mtp-layers N")
