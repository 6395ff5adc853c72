"""The two peers `bench/train_throughput.py` measures dstool against, run under torchrun:

  python -m torch.distributed.run --nproc_per_node 2 bench/_peers.py {trainer|minimal} RUN_DIR STEPS RESULT.json

Both train the same model (the run's preset and tokenizer) on the same packed tokens with the
run's own ds_config.json, and record each optimizer step's wall time on rank 0.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from dstool import models
from dstool.train import TrainConfig, data


def _model_and_data(run_dir: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run = json.loads((run_dir / "run.json").read_text())
    cfg = TrainConfig(**run["config"])
    tok = AutoTokenizer.from_pretrained(run_dir / "tokenizer")
    specials = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    torch.manual_seed(cfg.seed)
    model = AutoModelForCausalLM.from_config(models.preset_config(cfg.model, len(tok), specials), dtype=torch.float32)
    model.config.use_cache = False
    return cfg, run["ds_config"], model, data.open_run(run_dir / "data").train


def minimal(run_dir: Path, steps: int) -> list[float]:
    """The smallest correct DeepSpeed loop: initialize, forward, backward, step."""
    import deepspeed
    import torch.distributed as dist

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # as dstool: skip the inference-only op build
    deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl")
    cfg, ds_config, model, split = _model_and_data(run_dir)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    rank, world = dist.get_rank(), dist.get_world_size()
    micro, accum = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    order = data.GlobalOrder(len(split), cfg.seed)
    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        for m in range(accum):
            batch = data.collate([split[i] for i in order.micro_batch(step, m, rank, world, micro, accum)],
                                 engine.device)
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
        loss.item()
        times.append(time.perf_counter() - t0)
    return times


def trainer(run_dir: Path, steps: int) -> list[float]:
    """Hugging Face Trainer with its DeepSpeed integration and the same DeepSpeed JSON."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    cfg, ds_config, model, split = _model_and_data(run_dir)

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return len(split)

        def __getitem__(self, i):
            return split[i]

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times, self._t = [], None

        def on_step_begin(self, args, state, control, **kw):
            self._t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.times.append(time.perf_counter() - self._t)

    opt, sched = ds_config["optimizer"]["params"], ds_config["scheduler"]["params"]
    args = TrainingArguments(
        output_dir=str(run_dir / "hf_trainer"), deepspeed=ds_config, max_steps=steps,
        per_device_train_batch_size=ds_config["train_micro_batch_size_per_gpu"],
        gradient_accumulation_steps=ds_config["gradient_accumulation_steps"], learning_rate=opt["lr"],
        weight_decay=opt["weight_decay"], adam_beta1=opt["betas"][0], adam_beta2=opt["betas"][1],
        adam_epsilon=opt["eps"], max_grad_norm=ds_config["gradient_clipping"], warmup_steps=sched["warmup_num_steps"],
        bf16=ds_config["bf16"]["enabled"], logging_steps=10 ** 6, save_strategy="no", report_to=[],
        dataloader_num_workers=0, seed=cfg.seed, use_cpu=not torch.cuda.is_available(), disable_tqdm=True)
    timer = StepTimer()
    Trainer(model=model, args=args, train_dataset=Rows(), callbacks=[timer]).train()
    return timer.times


if __name__ == "__main__":
    import torch.distributed as dist

    which, run_dir, steps, result = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    times = {"minimal": minimal, "trainer": trainer}[which](run_dir, steps)
    if dist.get_rank() == 0:
        result.write_text(json.dumps(times))
