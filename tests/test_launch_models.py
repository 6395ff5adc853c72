from __future__ import annotations

import pytest
import torch

from dstool import models
from dstool.errors import UsageError
from dstool.train import TrainConfig, launch


def test_hostfile_and_deepspeed_command(tmp_path):
    hf = tmp_path / "hostfile"
    hf.write_text("# two nodes\nnode0 slots=2\nnode1 slots=2  # rack B\n")
    cfg = TrainConfig(hostfile=str(hf), node_rank=1, master_addr="10.0.0.1", master_port=29555)
    topo = launch.plan(cfg)
    assert (topo.launcher, topo.nodes, topo.world) == ("deepspeed", 2, 4)
    cmd = launch.command(cfg, topo, tmp_path / "run.json")
    assert "deepspeed.launcher.runner" in cmd and "--no_ssh" in cmd
    assert cmd[cmd.index("--node_rank") + 1] == "1" and cmd[cmd.index("--master_addr") + 1] == "10.0.0.1"
    hf.write_text("node0 slots=2\nnode0 slots=2\n")
    with pytest.raises(UsageError, match="twice"):
        launch.plan(cfg)


def test_torchrun_multinode_and_env(tmp_path):
    cfg = TrainConfig(num_nodes=2, node_rank=0, nproc=3, env={"NCCL_SOCKET_IFNAME": "ib0"})
    topo = launch.plan(cfg)
    assert (topo.launcher, topo.world, topo.master_port) == ("torchrun", 6, 29500)
    cmd = launch.command(cfg, topo, tmp_path / "run.json")
    assert "--nnodes=2" in cmd and "--nproc_per_node=3" in cmd
    env = launch.environment(cfg, topo, on_gpu=False)
    assert env["NCCL_SOCKET_IFNAME"] == "ib0" and env["DS_ACCELERATOR"] == "cpu"
    with pytest.raises(UsageError, match="node-rank"):
        launch.plan(TrainConfig(num_nodes=2))


def test_presets():
    from transformers import AutoModelForCausalLM

    tiny = AutoModelForCausalLM.from_config(models.preset_config("tiny", 4096, {"eos_token_id": 0}))
    total, _ = models.count_parameters(tiny)
    assert 1_000_000 < total < 10_000_000 and tiny.config.num_key_value_heads < tiny.config.num_attention_heads
    moe = AutoModelForCausalLM.from_config(models.preset_config("tiny-moe", 4096, {}))
    total, active = models.count_parameters(moe)
    assert type(moe).__name__ == "DeepseekV3ForCausalLM" and active < total and moe.config.kv_lora_rank
    with torch.device("meta"):
        big = AutoModelForCausalLM.from_config(models.preset_config("deepseek-7b", 102400, {}))
    assert 6.8e9 < models.count_parameters(big)[0] < 7.0e9  # DeepSeek LLM 7B: 6.9 B parameters


def test_model_folder_that_is_not_a_causal_lm(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "bert", "architectures": ["BertForMaskedLM"]}')
    with pytest.raises(UsageError, match="not a causal LM"):
        models.check_model_ref(str(tmp_path))
