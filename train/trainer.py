"""The training loop of one rank as an object, as torchtitan's Trainer has it: the model in a DeepSpeed engine, a
batch generator over the global sample order, the train step (forward and backward, distillation, N:M masks), and
the components that decide their own timing: the checkpointer (when to save, and when to stop), the metrics window
(when to write a row), the validator (when to evaluate). `Trainer(...).run()` reads top to bottom: steps until
max_steps or a stop, then the final checkpoint, a last evaluation and the consolidated Hugging Face folder.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.utils import groups
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.integrations import HfDeepSpeedConfig
from transformers.modeling_layers import GradientCheckpointingLayer

from dstool import log as dlog
from dstool import models
from dstool.artifacts import HFModel, Parity, TrainRun
from dstool.files import replace_folder, write_json_atomic
from dstool.train import (
    autobatch,
    checkpoint,
    data,
    expert_parallel,
    lora,
    mtp,
    pipeline_parallel,
    preempt,
    tensor_parallel,
)
from dstool.train.config import TrainConfig
from dstool.train.metrics import MetricsLog, declared_peak_tflops, flops_per_token
from dstool.train.observe import Observer

log = dlog.log


class NonFiniteLoss(RuntimeError):
    pass


class Trainer:
    """One rank's training run. Built once the process group is up; `run()` trains."""

    def __init__(self, run: dict, cfg: TrainConfig, ds_config: dict, gate: preempt.StepGate, resume: Path | None,
                 restarts: int):
        self.cfg, self.out, self.precision = cfg, Path(cfg.output), run["precision"]
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self._build_engine(ds_config)
        run_data = data.open_run(self.out / "data")
        self.train_split, val_split = run_data.train, run_data.val
        self.order = run_data.order(cfg.seed)
        self.start_step, self.data_offset = self._resume(resume)
        self.step = self.start_step
        failed_at = _last_heartbeat(self.out) if restarts and self.rank == 0 else None
        self.recovery = (failed_at, restarts)
        self.metrics = MetricsLog(self.out, cfg.tensorboard) if self.rank == 0 else None
        self.observer = Observer(cfg, self.out, self.rank, self.start_step, restarts, self.metrics)
        self.trace = open(self.out / f"samples.rank{self.rank}.jsonl", "a", buffering=1) if cfg.trace_samples else None
        samples_per_step = self.micro * self.accum * self.dp_world
        self.checkpointer = Checkpointer(self.engine, self.out, cfg, gate, self.observer, self.shapes,
                                         samples_per_step, self.data_offset, self.start_step if resume else -1)
        flops = self._flops_per_token(run["on_gpu"])
        if self.start_step:
            log.info(f"dstool: resumed at step {self.start_step} from {resume}")
        self.progress = _Progress(self.rank, self.start_step, cfg.max_steps)
        self.window = MetricsWindow(self.engine, cfg, self.metrics, self.observer, self.progress, self.world,
                                    samples_per_step * cfg.seq_len, flops, self.scheduler,
                                    distilling=self.teacher is not None, mtp_layers=cfg.mtp_layers)
        self.validator = Validator(self.engine, val_split, cfg, self.metrics)

    @classmethod
    def fits(cls, cfg: TrainConfig, ds_config: dict, micro: int) -> bool:
        """Whether one real step (forward, backward, optimizer step) at micro batch `micro` fits every rank's
        memory, on a throw-away engine (a collective)."""
        probe = cls.__new__(cls)
        probe.cfg, probe.out = cfg, Path(cfg.output)
        failed = False
        try:
            probe._build_engine(autobatch.with_micro(ds_config, micro, accumulation=1))
            split = data.open_run(probe.out / "data").train
            batch = data.collate([split[i % len(split)] for i in range(micro)], probe.engine.device)
            probe.engine.backward(mtp.objective(probe.engine(**batch), cfg.mtp_loss_weight))
            probe.engine.step()
        except (torch.OutOfMemoryError, RuntimeError) as e:  # cuBLAS and NCCL say it in RuntimeErrors of their own
            if not autobatch.is_out_of_memory(e):
                raise
            failed = True
        finally:
            engine = getattr(probe, "engine", None)
            if engine is not None:
                engine.destroy()
        return not autobatch.out_of_memory_anywhere(failed)

    # ---- set-up --------------------------------------------------------------------------------------------
    def _build_engine(self, ds_config: dict) -> None:
        """The Hugging Face model (built partitioned under ZeRO-3), as pipeline stages when asked, in a DeepSpeed
        engine; the masks of its exact zeros and the distillation teacher when asked."""
        cfg = self.cfg
        hf_ds_config = HfDeepSpeedConfig(ds_config)  # while alive, ZeRO-3 builds the model already partitioned
        self.tokenizer = AutoTokenizer.from_pretrained(self.out / "tokenizer")
        if models.is_preset(cfg.model):
            t = self.tokenizer
            specials = {"bos_token_id": t.bos_token_id, "eos_token_id": t.eos_token_id, "pad_token_id": t.pad_token_id}
            model = AutoModelForCausalLM.from_config(models.preset_config(cfg.model, len(t), specials),
                                                     dtype=torch.float32)
        else:
            model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32)
        model.config.use_cache = False
        if cfg.mtp_layers:  # before activation checkpointing, which then recomputes them too
            loaded = mtp.attach(model, cfg.mtp_layers, None if models.is_preset(cfg.model) else cfg.model)
            log.info(f"dstool: multi-token prediction: {cfg.mtp_layers} MTP layer(s) at model.layers."
                     f"{model.config.num_hidden_layers}+" + (f", {loaded} loaded from {cfg.model}" if loaded else ""))
        model.train()  # from_pretrained leaves a model in eval mode
        if cfg.activation_checkpointing and cfg.pipeline_stages == 1:
            # transformers' mechanism: each decoder layer runs again in the backward pass (torch.utils.checkpoint,
            # non-reentrant, which ZeRO-3's gather-on-use weights need)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

            recomputed = sum(isinstance(m, GradientCheckpointingLayer) for m in model.modules())
            log.info(f"dstool: activation checkpointing: {recomputed} decoder layers recomputed in the backward pass")
        self.model = model
        self.shapes = checkpoint.model_shapes(model)  # whole shapes: AutoTP and pipeline stages hold parts
        self.adapter = lora.wrap(model, cfg) if cfg.lora else None
        self.total_params, self.active_params = models.count_parameters(model)  # whole, before any is cut
        module = (pipeline_parallel.build(model, cfg.pipeline_stages, cfg.activation_checkpointing,
                                          cfg.tensor_parallel) if cfg.pipeline_stages > 1 else self.adapter or model)
        if cfg.tensor_parallel > 1 and cfg.pipeline_stages == 1:  # MLA's shared rotary key under AutoTP

            tensor_parallel.sum_mla_rope_gradients(model, groups.get_tensor_model_parallel_group)
        if cfg.activation_checkpointing and cfg.pipeline_stages > 1:
            recomputed = sum(type(m).__name__ == "_Decoder" for m in module.modules())
            log.info(f"dstool: activation checkpointing (DeepSpeed's, per pipeline stage): {recomputed} decoder "
                     "layers of this stage recomputed in the backward pass")
        self.engine, _, _, self.scheduler = deepspeed.initialize(
            model=module, model_parameters=[p for p in module.parameters() if p.requires_grad], config=ds_config)
        del hf_ds_config  # later from_pretrained calls (the parity check on rank 0) must not be ZeRO-3 collectives
        self.micro, self.accum = self.engine.train_micro_batch_size_per_gpu(), self.engine.gradient_accumulation_steps()
        # Data is sharded over model replicas: tensor-parallel peers and pipeline stages read the same samples.
        self.dp_rank, self.dp_world = dist.get_rank(group=self.engine.data_parallel_group), self.engine.dp_world_size
        self.masks = _zero_masks(self.engine.module) if cfg.keep_zero_weights else {}
        self.teacher = _teacher(cfg.distill_from, self.engine) if cfg.distill_from else None

    def _resume(self, resume: Path | None) -> tuple[int, int]:
        """(the step to start at, the data offset): zero unless the global batch changed with the world size, the
        data position being the samples consumed."""
        if not resume:
            return 0, 0
        _, client = self.engine.load_checkpoint(str(resume.parent), tag=resume.name,
                                                load_module_strict=self.adapter is None)  # LoRA: adapters only
        step = client["step"]
        return step, client["samples_consumed"] - step * self.micro * self.accum * self.dp_world

    def _flops_per_token(self, on_gpu: bool) -> tuple[float, float]:
        """(model FLOPs per token, the declared peak TFLOP/s of one rank), for MFU."""
        cores = int(os.environ.get("OMP_NUM_THREADS", "1"))
        peak = self.cfg.peak_tflops or declared_peak_tflops(torch.cuda.get_device_name() if on_gpu else "cpu", cores)
        embedding = self.model.get_input_embeddings().weight
        matmul_params = self.active_params - getattr(embedding, "ds_numel", embedding.numel())
        c = self.model.config
        matmul_params += self.cfg.mtp_layers * c.vocab_size * c.hidden_size  # each MTP depth runs the shared head again
        log.info(f"dstool: {self.total_params:,} parameters ({self.active_params:,} active per token); MFU against a "
                 f"declared peak of {peak:g} TFLOP/s per rank")
        return flops_per_token(matmul_params, c.num_hidden_layers + self.cfg.mtp_layers, c.hidden_size,
                               self.cfg.seq_len), peak

    # ---- the loop ------------------------------------------------------------------------------------------
    def run(self) -> None:
        stopping = False
        try:
            while self.step < self.cfg.max_steps:
                started = time.perf_counter()
                grad_norm = self.train_step()
                self.window.stepped(time.perf_counter() - started)
                self.progress.update()
                self._beat()
                saving, stopping = self.checkpointer.decide(self.step)
                if self.window.due(self.step, saving):
                    self.window.write(self.step, grad_norm, self._diverged)
                self.validator.maybe(self.step)
                if saving:
                    self.checkpointer.save(self.step)
                if stopping:
                    self.checkpointer.stop(self.step)
                    break
        except NonFiniteLoss as e:
            if self.rank == 0:
                write_json_atomic(self.out / "failure.json", {"step": self.step, "message": str(e)})
                log.error(str(e))
            raise SystemExit(3) from None
        finally:
            self.progress.close()
            self.observer.close()
            if self.trace:
                self.trace.close()
        if not stopping:
            self.checkpointer.final(self.step)
            self.validator.final(self.step)
        if self.metrics:
            self.metrics.close()
        if not stopping:
            _save_hf_folder(self.engine, self.model, self.tokenizer, self.validator.split, self.out, self.precision,
                            self.step, self.adapter, self.cfg.mtp_layers)

    def batches(self):
        """The step's micro-batches, as the global sample order deals them to this model replica."""
        for m in range(self.accum):
            ids = self.order.micro_batch(self.step, m, self.dp_rank, self.dp_world, self.micro, self.accum,
                                         self.data_offset)
            if self.trace:
                self.trace.write(json.dumps({"step": self.step, "micro": m, "samples": ids}) + "\n")
            yield data.collate([self.train_split[i] for i in ids], self.engine.device)

    def train_step(self) -> float | None:
        """One optimizer step over the step's micro-batches; DeepSpeed's global gradient norm after it."""
        engine = self.engine
        if self.cfg.pipeline_stages > 1:  # the pipeline engine runs the step's micro-batches itself
            loss = engine.train_batch(data_iter=((b["input_ids"], b["labels"]) for b in self.batches()))
            self.window.add(loss.float().reshape(()))  # shape (1,) off the last stage: the step's mean
        else:
            cfg = self.cfg
            weight = mtp.loss_weight(self.step, cfg.max_steps, cfg.mtp_loss_weight, cfg.mtp_loss_weight_final,
                                     cfg.mtp_loss_drop_ratio)
            for batch in self.batches():
                outputs = engine(**batch)
                loss = outputs.loss
                kl = distill_kl(outputs.logits, self.teacher, batch["input_ids"]) if self.teacher is not None else None
                if kl is not None:
                    loss = loss + kl
                engine.backward(mtp.objective(outputs, weight) if cfg.mtp_layers else loss)
                engine.step()
                if self.masks and engine.is_gradient_accumulation_boundary():
                    _apply_masks(self.masks)
                self.window.add(loss.detach().float() / self.accum,
                                None if kl is None else kl.detach().float() / self.accum,
                                outputs.mtp_losses.detach().float() / self.accum if cfg.mtp_layers else None, weight)
        self.step += 1
        self.observer.stepped()
        # DeepSpeed's global grad norm is already agreed by all ranks: checking it every step costs no collective,
        # and a NaN/inf loss on any rank makes it non-finite. fp16 overflows are routine (the loss scaler skips the
        # step), so there only the loss check of the metrics window applies.
        g = engine.get_global_grad_norm()
        grad_norm = None if g is None else float(g)
        if self.precision != "fp16" and grad_norm is not None and not math.isfinite(grad_norm):
            raise self._diverged(f"gradient norm became {grad_norm}")
        return grad_norm

    def _beat(self) -> None:
        """Rank 0's heartbeat after each step, and after an elastic restart the recovery's metrics row, once."""
        if self.rank != 0:
            return
        write_json_atomic(self.out / "heartbeat.json", {"step": self.step, "time": time.time()})
        failed_at, restarts = self.recovery
        if failed_at and self.metrics:
            _log_recovery(self.metrics, failed_at, restarts, self.start_step, self.step)
            self.recovery = (None, restarts)

    def _diverged(self, what: str) -> NonFiniteLoss:
        latest = self.out / "checkpoints" / "latest"
        kept = latest.read_text().strip() if latest.is_file() else "none yet"
        return NonFiniteLoss(f"{what} at step {self.step}; the last good checkpoint is kept ({kept}): lower --lr or "
                             "enable --grad-clip")


class Checkpointer:
    """When to save (every --save-every steps, at max_steps, when the clock says so or a stop was asked: the gate
    agrees it over all ranks each step) and how; the data position saved is one number, samples consumed."""

    def __init__(self, engine, out: Path, cfg: TrainConfig, gate: preempt.StepGate, observer: Observer, shapes,
                 samples_per_step: int, data_offset: int, last_saved: int):
        self.engine, self.out, self.cfg, self.gate, self.observer = engine, out, cfg, gate, observer
        self.shapes = shapes
        self.samples_per_step, self.data_offset, self.last_saved = samples_per_step, data_offset, last_saved
        self.tag: Path | None = None

    def decide(self, step: int) -> tuple[bool, bool]:
        """(save now, stop after saving): a collective, every rank calls it each step."""
        due, stopping = self.gate.check(self.engine.device)
        return step % self.cfg.save_every == 0 or step == self.cfg.max_steps or due or stopping, stopping

    def save(self, step: int) -> Path:
        self.tag = checkpoint.save(self.engine, self.out / "checkpoints", step,
                                   {"step": step, "samples_consumed": self.data_offset + step * self.samples_per_step},
                                   self.cfg.keep_checkpoints, self.shapes, lora.spec(self.cfg), self.cfg.archive,
                                   last=step == self.cfg.max_steps,
                                   model_parallel=(self.cfg.pipeline_stages, self.cfg.tensor_parallel))
        self.gate.saved()
        self.observer.checkpointed(step)
        self.last_saved = step
        return self.tag

    def stop(self, step: int) -> None:
        """Record the stop (one record per node: the run folder may be local) after its checkpoint."""
        assert self.tag is not None
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            preempt.record(self.out, step, self.tag, self.gate.reason())
        log.info(f"dstool: stopping at step {step} ({self.gate.reason()}): checkpoint {self.tag.name} written")

    def final(self, step: int) -> None:
        """The last checkpoint, unless this step's is written (resumed at max_steps: nothing was trained)."""
        if self.last_saved != step:
            self.save(step)


class MetricsWindow:
    """What was measured since the last metrics row (the loss summed locally, all-reduced once per row), and when
    to write the next: every --log-every steps and at every save."""

    def __init__(self, engine, cfg: TrainConfig, metrics: MetricsLog | None, observer: Observer, progress: _Progress,
                 world: int, tokens_per_step: int, flops: tuple[float, float], scheduler, distilling: bool,
                 mtp_layers: int = 0):
        self.cfg, self.metrics, self.observer, self.world, self.scheduler = cfg, metrics, observer, world, scheduler
        self.progress = progress
        self.tokens_per_step, (self.flops_per_token, self.peak) = tokens_per_step, flops
        self.loss = torch.zeros((), device=engine.device)
        self.kl = torch.zeros((), device=engine.device) if distilling else None
        self.mtp = torch.zeros(mtp_layers, device=engine.device) if mtp_layers else None  # each depth's loss
        self.mtp_weight: float | None = None
        self.seconds, self.steps = 0.0, 0

    def add(self, loss: torch.Tensor, kl: torch.Tensor | None = None, mtp_losses: torch.Tensor | None = None,
            mtp_weight: float | None = None) -> None:
        self.loss += loss
        if kl is not None and self.kl is not None:
            self.kl += kl
        if mtp_losses is not None and self.mtp is not None:
            self.mtp += mtp_losses
            self.mtp_weight = mtp_weight

    def stepped(self, seconds: float) -> None:
        self.seconds, self.steps = self.seconds + seconds, self.steps + 1

    def due(self, step: int, saving: bool) -> bool:
        return step % self.cfg.log_every == 0 or saving

    def write(self, step: int, grad_norm: float | None, diverged) -> None:
        """The row of this window (a collective): loss, lr, gradient norm, tokens/s, MFU, step time."""
        dist.all_reduce(self.loss)
        mean_loss = self.loss.item() / (self.world * self.steps)
        if not math.isfinite(mean_loss):
            raise diverged(f"loss became {mean_loss}")
        tok_s = self.tokens_per_step * self.steps / self.seconds
        row = {"loss": mean_loss, "lr": self.scheduler.get_last_lr()[0], "grad_norm": grad_norm,
               "tokens_per_s": tok_s, "mfu": tok_s * self.flops_per_token / self.world / (self.peak * 1e12),
               "step_time_s": self.seconds / self.steps}
        if self.kl is not None:
            dist.all_reduce(self.kl)
            row["distill_kl"] = self.kl.item() / (self.world * self.steps)
            self.kl.zero_()
        if self.mtp is not None:  # the main loss is `loss`; each MTP depth's cross-entropy, and the λ of the last step
            dist.all_reduce(self.mtp)
            row.update({f"mtp_loss_{k}": v / (self.world * self.steps) for k, v in enumerate(self.mtp.tolist(), 1)})
            row["mtp_loss_weight"] = self.mtp_weight
            self.mtp.zero_()
        if self.metrics:
            self.metrics.write(step, **row)
            self.observer.window(step, row)
            self.progress.line(step, row)
        self.seconds, self.steps = 0.0, 0
        self.loss.zero_()


class Validator:
    """The held-out loss every --eval-every steps, and at the end unless that step's was just measured."""

    def __init__(self, engine, split: data.Split, cfg: TrainConfig, metrics: MetricsLog | None):
        self.engine, self.split, self.cfg, self.metrics = engine, split, cfg, metrics
        self.last: int | None = None

    def maybe(self, step: int) -> None:
        if self.cfg.eval_every and step % self.cfg.eval_every == 0:
            self.now(step)

    def final(self, step: int) -> None:
        if self.last != step:
            self.now(step)

    def now(self, step: int) -> None:
        self.last = step
        val = evaluate(self.engine, self.split, self.engine.train_micro_batch_size_per_gpu(), self.cfg.eval_batches)
        if self.metrics:
            ppl = math.exp(val) if val < 50 else float("inf")
            self.metrics.write(step, val_loss=val, val_perplexity=ppl)
            log.info(f"dstool: step {step} held-out loss {val:.4f} perplexity {ppl:.2f}")


def _zero_masks(module) -> dict:
    """Masks of the weights inside the decoder layers (matrices, and MoE experts' stacked matrices) that hold exact
    zeros (N:M sparsity)."""
    return {p: p.detach() != 0 for name, p in module.named_parameters()
            if p.dim() >= 2 and ".layers." in name and bool((p == 0).any())}


@torch.no_grad()
def _apply_masks(masks: dict) -> None:
    for param, mask in masks.items():
        param.mul_(mask)


def _teacher(folder: str, engine):
    """The frozen teacher for distillation, in the engine's compute dtype, on its device."""
    dtype = next(engine.module.parameters()).dtype
    teacher = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(engine.device).eval()
    if teacher.config.vocab_size != engine.module.config.vocab_size:
        raise ValueError(f"teacher {folder} has vocabulary {teacher.config.vocab_size}, the student "
                         f"{engine.module.config.vocab_size}: distillation needs the same tokenizer")
    teacher.config.use_cache = False
    teacher.requires_grad_(False)
    return teacher


def distill_kl(student_logits: torch.Tensor, teacher, ids: torch.Tensor) -> torch.Tensor:
    """Mean per-token KL(teacher || student) of the next-token distributions, computed in fp32."""
    with torch.no_grad():
        target = torch.log_softmax(teacher(input_ids=ids).logits.float(), dim=-1)
    log_probs = torch.log_softmax(student_logits.float(), dim=-1)
    return torch.nn.functional.kl_div(log_probs.flatten(0, -2), target.flatten(0, -2), log_target=True,
                                      reduction="batchmean")


def _last_heartbeat(out: Path) -> dict | None:
    try:
        return json.loads((out / "heartbeat.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _log_recovery(metrics: MetricsLog, failed_at: dict, restarts: int, start_step: int, step: int) -> None:
    """One metrics row per elastic restart: seconds from the last step before the failure to the first after."""
    now = time.time()
    row = {"event": "restart", "restart": restarts, "failed_after_step": failed_at["step"],
           "resumed_from_step": start_step, "steps_lost": failed_at["step"] - start_step,
           "recovery_s": now - failed_at["time"], "time": now}
    metrics.write(step, **row)
    log.info(f"dstool: restart {restarts}: failed after step {failed_at['step']}, resumed from step {start_step} "
             f"({row['steps_lost']} steps redone); first step after resume {row['recovery_s']:.1f} s after the "
             "last step before the failure")


@torch.no_grad()
def evaluate(engine, split: data.Split, micro: int, batches: int) -> float:
    """Mean held-out loss; every model replica evaluates its own shard of the split (same count on all)."""
    rank, world = dist.get_rank(group=engine.data_parallel_group), engine.dp_world_size
    n = len(split)
    per_rank = max(1, min(batches, n // (micro * world)))
    shard = (data.collate([split[((b * world + rank) * micro + k) % n] for k in range(micro)], engine.device)
             for b in range(per_rank))
    if engine.pipeline_parallelism:  # the mean over the micro-batches, on every stage
        mean = engine.eval_batch(((b["input_ids"], b["labels"]) for b in shard), num_micro_batches=per_rank).reshape(())
        total = mean * per_rank
    else:
        engine.eval()
        total = sum(engine(**batch).loss.float() for batch in shard)
        engine.train()
    dist.all_reduce(total)  # every rank holds its replica's total: the mean over all ranks is the mean over replicas
    return total.item() / (per_rank * dist.get_world_size())


def _save_hf_folder(engine, module, tokenizer, val_split, out: Path, precision: str, step: int, adapter,
                    mtp_layers: int = 0) -> None:
    """Consolidate the weights the engine computes with into out/model (`module`: the Hugging Face model; with
    `adapter`, the PEFT model around it, merged into it and saved beside it in out/adapter; its `mtp_layers` MTP
    layers as DeepSeek's model.layers.{L}...), then prove it: reload with transformers and compare logits with the
    engine's on held-out tokens."""
    rank = dist.get_rank()
    probe = torch.stack([torch.from_numpy(val_split.tokens(i % len(val_split)).astype("int64")) for i in range(2)])
    probe = probe[:, :64]
    if engine.pipeline_parallelism:  # collectives; logits and full dict on rank 0
        engine_logits = pipeline_parallel.logits(engine, probe.to(engine.device))
        state = pipeline_parallel.hf_state_dict(engine, module)
    else:
        engine.eval()
        with torch.no_grad():
            engine_logits = engine(input_ids=probe.to(engine.device)).logits.float().cpu()
        preset = (engine.config.get("expert_parallel") or {}).get("preset_model")
        if preset:
            state = expert_parallel.hf_state_dict(engine, preset)  # collective; experts joined on rank 0
        elif engine.zero_optimization_stage() == 3 or engine.autotp_size() > 1:
            state = engine._consolidated_16bit_state_dict()  # collective; ZeRO-3 and AutoTP shards joined on rank 0
            if state is not None:  # AutoTP's leaves out persistent buffers (DeepSeek-V3's e_score_correction_bias)
                have = {name for name, _ in engine.module.named_parameters()} | set(state)
                state.update({k: v for k, v in engine.module.state_dict().items() if k not in have})
        else:
            state = engine.module.state_dict() if rank == 0 else None
    if rank != 0 or state is None:
        return
    if adapter is not None:
        state = lora.save_and_merge(adapter, state, out / "adapter")
    target, tmp = out / "model", out / ".model.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    if mtp_layers:
        state = mtp.hf_state(state, module.config, mtp_layers)
    if hasattr(module.config, "num_mtp_layers"):  # DeepSeek-V3's config.json `num_nextn_predict_layers`: what is saved
        module.config.num_mtp_layers = mtp_layers
    module.config.use_cache = True
    module.config.dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    module.save_pretrained(tmp, state_dict={k: v.detach().cpu() for k, v in state.items()}, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp, dtype=module.config.dtype).eval()
    with torch.no_grad():
        hf_logits = reloaded(input_ids=probe).logits.float()
    diff = (hf_logits - engine_logits).abs().max().item()
    tolerance = 1e-4 if precision == "fp32" else 5e-2
    if not diff <= tolerance:
        raise RuntimeError(f"consolidated model disagrees with the engine: max |logit diff| {diff:.3g} > {tolerance}")
    torch.save({"input_ids": probe, "logits": engine_logits}, out / "probe_logits.pt")
    split = TrainRun.read(out).data  # the run's data split, so compress measures on its held-out tokens
    HFModel(step=step, precision=precision, run="..",
            data=split.model_copy(update={"folder": f"../{split.folder}"}) if split else None,
            parity=Parity(max_abs_logit_diff=diff, tolerance=tolerance, probe_shape=list(probe.shape))).write(tmp)
    replace_folder(tmp, target)
    log.info(f"dstool: wrote {target} (transformers reload matches the engine: max |logit diff| {diff:.2e})")


class _Progress:
    """Rank 0's progress: a bar on a terminal, and a line per logging window (on the console unless quiet)."""

    def __init__(self, rank: int, start: int, total: int):
        # stdout: the launcher's stderr goes to a log file, its stdout is the terminal dstool was started from
        self.bar = dlog.progress(total, "train", initial=start, stream=dlog.console_stream()) if rank == 0 else None

    def update(self) -> None:
        if self.bar:
            self.bar.update(1)

    def line(self, step: int, row: dict) -> None:
        if self.bar:
            self.bar.set_postfix(loss=f"{row['loss']:.4f}")
        norm = "n/a" if row["grad_norm"] is None else f"{row['grad_norm']:.3f}"  # DeepSpeed gives none at ZeRO-0 fp32
        log.info(f"step {step} loss {row['loss']:.4f} lr {row['lr']:.3g} grad_norm {norm} "
                 f"tok/s {row['tokens_per_s']:,.0f} mfu {row['mfu']:.2%}" +
                 "".join(f" mtp_loss_{k} {row[f'mtp_loss_{k}']:.4f}" for k in range(1, 9) if f"mtp_loss_{k}" in row))

    def close(self) -> None:
        if self.bar:
            self.bar.close()
