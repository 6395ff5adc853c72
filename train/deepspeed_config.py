"""The DeepSpeed JSON for a run: generated from TrainConfig, then the user's JSON merged over it."""

from __future__ import annotations

import json
from pathlib import Path

from dstool.errors import UsageError
from dstool.train.config import TrainConfig
from dstool.train.layout import Layout


def layout(cfg: TrainConfig, world: int) -> Layout:
    """How the world splits (train/layout.py), or a one-line UsageError."""
    return Layout(world, cfg.pipeline_stages, cfg.tensor_parallel, cfg.expert_parallel).check()


def data_parallel_size(cfg: TrainConfig, world: int) -> int:
    """Model replicas: the world divided into pipeline stages and tensor-parallel groups (expert parallelism folds
    over the replicas: each still reads its own samples)."""
    return layout(cfg, world).data


def batch_plan(cfg: TrainConfig, world: int) -> tuple[int, int]:
    """(micro batch, accumulation steps) such that micro * accumulation * data-parallel size is the global batch
    (`auto` counts as 1 here: the ranks choose it, train/autobatch.py)."""
    micro = cfg.micro_batch_size if isinstance(cfg.micro_batch_size, int) else 1
    dp = data_parallel_size(cfg, world)
    if cfg.global_batch_size is None:
        return micro, cfg.gradient_accumulation_steps or 1
    accum, rest = divmod(cfg.global_batch_size, micro * dp)
    if rest or accum == 0:
        raise UsageError(f"global_batch_size {cfg.global_batch_size} is not a multiple of micro_batch_size {micro} "
                         f"x {'world' if dp == world else 'data-parallel'} size {dp} = {micro * dp}: choose a multiple")
    if cfg.gradient_accumulation_steps not in (None, accum):
        raise UsageError(f"gradient_accumulation_steps {cfg.gradient_accumulation_steps} disagrees with "
                         f"global_batch_size "
                         f"{cfg.global_batch_size} = {micro} x {dp} x {accum}: set one of them")
    return micro, accum


def peak_lr(cfg: TrainConfig, world: int) -> float:
    return cfg.lr * data_parallel_size(cfg, world) if cfg.lr_scaling == "linear" else cfg.lr


def warmup_steps(cfg: TrainConfig) -> int:
    return max(1, round(cfg.max_steps * cfg.warmup_ratio))


def build(cfg: TrainConfig, world: int, precision: str, on_gpu: bool, expert_preset: str | None = None,
          expert_parallel: int | None = None, tensor_partition: dict | None = None) -> dict:
    """`expert_preset`: the model's DeepSpeed AutoEP preset, to shard its experts over `expert_parallel` ranks
    (default --expert-parallel; 1 keeps AutoEP's module layout, a run resumed from an expert-parallel checkpoint).
    `tensor_partition`: AutoTP's partition_config for the model (train/tensor_parallel.py), when it needs one."""
    micro, accum = batch_plan(cfg, world)
    zero: dict = {"stage": cfg.zero}
    if cfg.zero == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    if cfg.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": on_gpu}
    if cfg.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": on_gpu}
    adam = {"lr": peak_lr(cfg, world), "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": cfg.weight_decay}
    if not on_gpu and not cfg.offload_optimizer:
        # torch's AdamW on CPU (DeepSpeed's FusedAdam is JIT-built there: docs/train.md); offload needs CPUAdam
        adam["torch_adam"] = True
    ds = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum,
        "train_batch_size": micro * accum * _batch_ranks(cfg, world),
        "gradient_clipping": cfg.grad_clip,
        "steps_per_print": 1 << 30,
        "zero_optimization": zero,
        "bf16": {"enabled": precision == "bf16"},
        "fp16": {"enabled": precision == "fp16", "loss_scale": 0, "initial_scale_power": 16},
        "optimizer": {"type": "AdamW", "params": adam},
        "scheduler": {"type": "WarmupCosineLR", "params": {
            "total_num_steps": cfg.max_steps, "warmup_num_steps": warmup_steps(cfg), "warmup_min_ratio": 0.0,
            "cos_min_ratio": cfg.min_lr_ratio, "warmup_type": "linear"}},
    }
    if cfg.tensor_parallel > 1 and cfg.pipeline_stages == 1:  # in pipeline stages dstool cuts the layers itself
        tp: dict = {"autotp_size": cfg.tensor_parallel}
        if tensor_partition:
            tp["partition_config"] = tensor_partition
        ds["tensor_parallel"] = tp
    if expert_preset:
        ds["expert_parallel"] = {"enabled": True, "autoep_size": expert_parallel or cfg.expert_parallel,
                                 "preset_model": expert_preset}
    if cfg.deepspeed_config:
        user = _read_user_json(cfg.deepspeed_config)
        for key, flag in (("expert_parallel", "--expert-parallel"), ("tensor_parallel", "--tensor-parallel"),
                          ("pipeline", "--pipeline-stages")):
            if key in user:  # the layout's checks, checkpoints and model/ follow the flag: the JSON may not differ
                raise UsageError(f"DeepSpeed config {cfg.deepspeed_config} sets '{key}', which dstool derives from "
                                 f"{flag}: drop the key and use {flag}")
        ds = merge(ds, user)
        _check_batch(ds, _batch_ranks(cfg, world))
    return ds


def _batch_ranks(cfg: TrainConfig, world: int) -> int:
    """The rank count DeepSpeed's batch check multiplies by: a pipeline engine counts data-parallel ranks
    (its topology is known); AutoTP's config check (0.19.8) counts every rank, tensor-parallel peers too."""
    return world if cfg.tensor_parallel > 1 and cfg.pipeline_stages == 1 else data_parallel_size(cfg, world)


def merge(base: dict, override: dict) -> dict:
    """Recursive dict merge; `override` wins."""
    out = dict(base)
    for k, v in override.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _read_user_json(path: str) -> dict:
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"DeepSpeed config {path} does not exist")
    try:
        obj = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise UsageError(f"DeepSpeed config {path} is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise UsageError(f"DeepSpeed config {path} must be a JSON object")
    return obj


def _check_batch(ds: dict, world: int) -> None:
    micro, accum = ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]
    total = ds["train_batch_size"]
    if micro * accum * world != total:
        raise UsageError(f"DeepSpeed batch sizes disagree: train_batch_size {total} != micro {micro} x accumulation "
                         f"{accum} x ranks {world}; fix the JSON or drop its batch keys")
