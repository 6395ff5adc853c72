"""`--micro-batch-size auto`: the largest micro batch that fits the GPU's memory, the global batch kept by gradient
accumulation. Every rank tries the real step (forward, backward, optimizer step) at the candidate sizes, largest
first; a size at which any rank runs out of memory is given up by all. A CPU run needs no search."""

from __future__ import annotations

import gc
from collections.abc import Callable

import torch
import torch.distributed as dist

from dstool import log as dlog
from dstool.errors import UsageError
from dstool.train import deepspeed_config
from dstool.train.config import TrainConfig

log = dlog.log
CPU_MICRO = 8


def resolve(cfg: TrainConfig, on_gpu: bool, world: int) -> tuple[TrainConfig, list[int] | None]:
    """(the config with a number for an `auto` micro batch, the sizes the ranks try on a GPU, largest first)."""
    if cfg.micro_batch_size != "auto":
        return cfg, None
    dp = deepspeed_config.data_parallel_size(cfg, world)
    total = cfg.global_batch_size or CPU_MICRO * (cfg.gradient_accumulation_steps or 1) * dp
    if total % dp:
        raise UsageError(f"global_batch_size {total} is not a multiple of the data-parallel size {dp}: choose a "
                         "multiple")
    per_replica = total // dp
    sizes = [m for m in range(per_replica, 0, -1) if per_replica % m == 0]
    fixed = {"global_batch_size": total, "gradient_accumulation_steps": None}
    if not on_gpu:
        micro = next(m for m in sizes if m <= CPU_MICRO)
        log.info(f"  micro batch: auto searches GPU memory; a CPU run needs no search (a batch too large for host "
                 f"memory swaps rather than failing): {micro} per rank, the global batch {total} kept by "
                 "accumulation")
        return cfg.model_copy(update={"micro_batch_size": micro, **fixed}), None
    return cfg.model_copy(update={"micro_batch_size": sizes[-1], **fixed}), sizes


def search(sizes: list[int], fits: Callable[[int], bool]) -> int:
    """The first of `sizes` (largest first) at which `fits` holds; `fits` agrees over the ranks."""
    for micro in sizes:
        if fits(micro):
            return micro
        log.info(f"dstool: micro batch {micro} ran out of memory; trying {next_size(sizes, micro)}")
    raise UsageError("even a micro batch of 1 runs out of GPU memory: add --activation-checkpointing, offload "
                     "(--offload-optimizer; --zero 3 --offload-params), or more GPUs")


def next_size(sizes: list[int], micro: int) -> str:
    later = sizes[sizes.index(micro) + 1:]
    return str(later[0]) if later else "none left"


def with_micro(ds_config: dict, micro: int, accumulation: int | None = None) -> dict:
    """The DeepSpeed JSON at another micro batch: its global batch kept by accumulation, or with `accumulation`
    (a probe's single step) that many micro-steps."""
    total, per_step = ds_config["train_batch_size"], ds_config["train_micro_batch_size_per_gpu"]
    ranks = total // (per_step * ds_config["gradient_accumulation_steps"])
    accum = accumulation or total // (micro * ranks)
    return {**ds_config, "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accum,
            "train_batch_size": micro * accum * ranks}


def is_out_of_memory(e: BaseException) -> bool:
    """torch's out-of-memory error, or a library's RuntimeError that says the same."""
    said = str(e).lower()
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in said or "alloc_failed" in said


def out_of_memory_anywhere(failed: bool) -> bool:
    """Whether any rank ran out of memory (a collective); frees what the failed try held."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    flag = torch.tensor(int(failed), device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return bool(flag.item())
