"""One training rank. Started by torchrun or the DeepSpeed launcher: `python -m dstool.train.worker RUN.json`.

Reads top to bottom: set up the process group -> build the model -> wrap it in a DeepSpeed
engine -> resume -> the training loop -> final checkpoint -> consolidated Hugging Face folder.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import signal
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from dstool import log as dlog
from dstool import models
from dstool.artifacts import HFModel, Parity, TrainRun
from dstool.files import replace_folder, write_json_atomic
from dstool.proc import die_with_parent
from dstool.train import checkpoint, data, pipeline_parallel, preempt, watchdog
from dstool.train.config import TrainConfig
from dstool.train.metrics import MetricsLog, declared_peak_tflops, flops_per_token
from dstool.train.observe import Observer

log = dlog.log


class NonFiniteLoss(RuntimeError):
    pass


def main(run_file: str) -> None:
    die_with_parent(signal.SIGKILL)  # the launcher died: stop too rather than train on alone
    run = json.loads(Path(run_file).read_text())
    cfg = TrainConfig(**run["config"])
    ds_config = run["ds_config"]
    out = Path(cfg.output)
    os.environ.update(cfg.env)  # NCCL_* etc. must be set before the communicator is created
    dlog.setup()  # this rank's own voice: dstool's lines on the console, the libraries' in its log file
    dlog.to_file(out / "logs" / f"rank{os.environ.get('RANK', '0')}.log")
    dlog.prints_to_log()  # and what they print ("stage=1 layers=3") too

    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.integrations import HfDeepSpeedConfig

    dlog.adopt_libraries()
    accelerator = get_accelerator()
    if accelerator.device_name() == "cpu":
        # Measured on this CPU: the first init_distributed() JIT-builds deepspeed_shm_comm (~65 s); that op
        # serves only inference all-reduce, training all-reduces go through gloo.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    restarts = _init_process_group(accelerator.communication_backend_name(), cfg)  # elastic restarts so far
    deepspeed.init_distributed(dist_backend=accelerator.communication_backend_name())  # adopts the group above
    rank, world = dist.get_rank(), dist.get_world_size()
    gate = preempt.StepGate(out, cfg.save_every_minutes, clock_rank=rank == 0)  # a signal from here on is kept
    if rank != 0 or not run.get("console", True):
        dlog.quiet_console()  # one rank speaks; inside `dstool pipeline` even it keeps to its log file
    torch.manual_seed(cfg.seed)
    resume, universal = _resume_source(run, out, world, restarts)
    if universal:  # saved on another world size: DeepSpeed re-partitions the universal form
        ds_config = {**ds_config, "checkpoint": {**ds_config.get("checkpoint", {}), "load_universal": True}}

    # --- model --------------------------------------------------------------------------------
    hf_ds_config = HfDeepSpeedConfig(ds_config)  # while alive, ZeRO-3 builds the model already partitioned
    tokenizer = AutoTokenizer.from_pretrained(out / "tokenizer")
    if models.is_preset(cfg.model):
        specials = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
                    "pad_token_id": tokenizer.pad_token_id}
        hf_config = models.preset_config(cfg.model, len(tokenizer), specials)
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32)
    model.config.use_cache = False
    model.train()  # from_pretrained leaves a model in eval mode
    if cfg.activation_checkpointing and cfg.pipeline_stages == 1:
        # transformers' mechanism: each decoder layer runs again in the backward pass (torch.utils.checkpoint,
        # non-reentrant, which ZeRO-3's gather-on-use weights need)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        from transformers.modeling_layers import GradientCheckpointingLayer

        recomputed = sum(isinstance(m, GradientCheckpointingLayer) for m in model.modules())
        log.info(f"dstool: activation checkpointing: {recomputed} decoder layers recomputed in the backward pass")
    total_params, active_params = models.count_parameters(model)
    shapes = checkpoint.model_shapes(model)  # whole shapes: AutoTP and pipeline stages hold parts

    module = (pipeline_parallel.build(model, cfg.pipeline_stages, cfg.activation_checkpointing)
              if cfg.pipeline_stages > 1 else model)
    if cfg.activation_checkpointing and cfg.pipeline_stages > 1:
        recomputed = sum(type(m).__name__ == "_Decoder" for m in module.modules())
        log.info(f"dstool: activation checkpointing (DeepSpeed's, per pipeline stage): {recomputed} decoder layers of "
                 "this stage recomputed in the backward pass")
    engine, _, _, scheduler = deepspeed.initialize(model=module, model_parameters=module.parameters(), config=ds_config)
    del hf_ds_config  # later from_pretrained calls (the parity check on rank 0) must not be ZeRO-3 collectives
    micro, accum = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    # Data is sharded over model replicas: tensor-parallel peers and pipeline stages read the same samples.
    dp_rank, dp_world = dist.get_rank(group=engine.data_parallel_group), engine.dp_world_size
    masks = _zero_masks(engine.module) if cfg.keep_zero_weights else {}
    teacher = _teacher(cfg.distill_from, engine) if cfg.distill_from else None

    # --- data ---------------------------------------------------------------------------------
    train_split = data.open_split(out / "data", "train", cfg.seq_len)
    val_split = data.open_split(out / "data", "val", cfg.seq_len)
    order = data.GlobalOrder(len(train_split), cfg.seed)

    # --- resume -------------------------------------------------------------------------------
    start_step, data_offset = 0, 0
    if resume:
        _, client = engine.load_checkpoint(str(resume.parent), tag=resume.name)
        start_step = client["step"]
        # Zero unless the global batch changed with the world size: the data position is samples consumed.
        data_offset = client["samples_consumed"] - start_step * micro * accum * dp_world
    failed_at = _last_heartbeat(out) if restarts and rank == 0 else None
    metrics = MetricsLog(out, cfg.tensorboard) if rank == 0 else None
    observer = Observer(cfg, out, rank, start_step, restarts, metrics)  # Prometheus, memory, profiler
    trace = open(out / f"samples.rank{rank}.jsonl", "a", buffering=1) if cfg.trace_samples else None

    cores = int(os.environ.get("OMP_NUM_THREADS", "1"))
    device_name = torch.cuda.get_device_name() if run["on_gpu"] else "cpu"
    peak = cfg.peak_tflops or declared_peak_tflops(device_name, cores)
    embedding = model.get_input_embeddings().weight
    matmul_params = active_params - getattr(embedding, "ds_numel", embedding.numel())
    flops_tok = flops_per_token(matmul_params, model.config.num_hidden_layers, model.config.hidden_size, cfg.seq_len)
    tokens_per_step = micro * accum * dp_world * cfg.seq_len
    log.info(f"dstool: {total_params:,} parameters ({active_params:,} active per token); MFU against a declared "
             f"peak of {peak:g} TFLOP/s per rank")
    if start_step:
        log.info(f"dstool: resumed at step {start_step} from {resume}")

    progress = _progress(rank, start_step, cfg.max_steps)
    window_t, window_steps = 0.0, 0
    window_loss = torch.zeros((), device=engine.device)  # summed locally, all-reduced once per log window
    window_kl = torch.zeros((), device=engine.device)
    last_saved = start_step if resume else -1
    step, stopping = start_step, False

    def save(at: int) -> Path:  # the data position is one number: samples consumed globally
        tag = checkpoint.save(engine, out / "checkpoints", at,
                              {"step": at, "samples_consumed": data_offset + at * micro * accum * dp_world},
                              cfg.keep_checkpoints, shapes)
        gate.saved()
        observer.checkpointed(at)
        return tag

    def micro_batch(m: int) -> torch.Tensor:
        ids = order.micro_batch(step, m, dp_rank, dp_world, micro, accum, data_offset)
        if trace:
            trace.write(json.dumps({"step": step, "micro": m, "samples": ids}) + "\n")
        return torch.stack([train_split[i] for i in ids]).to(engine.device)

    def diverged(what: str) -> NonFiniteLoss:
        return NonFiniteLoss(f"{what} at step {step}; the last good checkpoint is kept "
                             f"({_latest(out) or 'none yet'}): lower --lr or enable --grad-clip")

    # --- the training loop ----------------------------------------------------------------------
    try:
        while step < cfg.max_steps:
            t0 = time.perf_counter()
            if cfg.pipeline_stages > 1:  # the pipeline engine runs the step's micro-batches itself
                batches = ((batch, batch) for batch in map(micro_batch, range(accum)))
                # shape (1,) off the last stage
                window_loss += engine.train_batch(data_iter=batches).float().reshape(())
            else:
                for m in range(accum):
                    batch = micro_batch(m)
                    outputs = engine(input_ids=batch, labels=batch)
                    loss = outputs.loss
                    if teacher is not None:
                        kl = distill_kl(outputs.logits, teacher, batch)
                        loss = loss + kl
                        window_kl += kl.detach().float() / accum
                    engine.backward(loss)
                    engine.step()
                    if masks and engine.is_gradient_accumulation_boundary():
                        _apply_masks(masks)
                    window_loss += loss.detach().float() / accum
            step += 1
            observer.stepped()
            # DeepSpeed's global grad norm is already agreed by all ranks: checking it every step costs no
            # collective, and a NaN/inf loss on any rank makes it non-finite. fp16 overflows are routine
            # (the loss scaler skips the step), so there only the loss check below applies.
            grad_norm = _grad_norm(engine)
            if run["precision"] != "fp16" and grad_norm is not None and not math.isfinite(grad_norm):
                raise diverged(f"gradient norm became {grad_norm}")
            window_t, window_steps = window_t + time.perf_counter() - t0, window_steps + 1
            progress.update()
            if rank == 0:
                _heartbeat(out, step)
                if failed_at and metrics:
                    _log_recovery(metrics, failed_at, restarts, start_step, step)
                    failed_at = None

            due, stopping = gate.check(engine.device)
            saving = step % cfg.save_every == 0 or step == cfg.max_steps or due or stopping
            if step % cfg.log_every == 0 or saving:
                dist.all_reduce(window_loss)
                mean_loss = window_loss.item() / (world * window_steps)
                if not math.isfinite(mean_loss):
                    raise diverged(f"loss became {mean_loss}")
                tok_s = tokens_per_step * window_steps / window_t
                row = {"loss": mean_loss, "lr": scheduler.get_last_lr()[0], "grad_norm": grad_norm,
                       "tokens_per_s": tok_s, "mfu": tok_s * flops_tok / world / (peak * 1e12),
                       "step_time_s": window_t / window_steps}
                if teacher is not None:
                    dist.all_reduce(window_kl)
                    row["distill_kl"] = window_kl.item() / (world * window_steps)
                    window_kl.zero_()
                if metrics:
                    metrics.write(step, **row)
                    observer.window(step, row)
                    progress.line(step, row)
                window_t, window_steps = 0.0, 0
                window_loss.zero_()
            if cfg.eval_every and step % cfg.eval_every == 0:
                _log_eval(engine, val_split, cfg, step, metrics)
            if saving:
                tag = save(step)
                last_saved = step
            if stopping:
                if int(os.environ.get("LOCAL_RANK", "0")) == 0:  # one record per node (the run folder may be local)
                    preempt.record(out, step, tag, gate.reason())
                log.info(f"dstool: stopping at step {step} ({gate.reason()}): checkpoint {tag.name} written")
                break
    except NonFiniteLoss as e:
        if rank == 0:
            write_json_atomic(out / "failure.json", {"step": step, "message": str(e)})
            log.error(str(e))
        sys.exit(3)
    finally:
        progress.close()
        observer.close()
        if trace:
            trace.close()

    if stopping:
        if metrics:
            metrics.close()
        dist.barrier()
        dist.destroy_process_group()
        return
    if last_saved != step:  # resumed at max_steps: nothing trained, the checkpoint is the final one
        save(step)
    _log_eval(engine, val_split, cfg, step, metrics)
    if metrics:
        metrics.close()
    _save_hf_folder(engine, model, tokenizer, val_split, out, run["precision"], step)
    dist.barrier()
    dist.destroy_process_group()


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
    from transformers import AutoModelForCausalLM

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


def _init_process_group(backend: str, cfg: TrainConfig) -> int:
    """The process group, its nodes watched for silence (train/watchdog.py); returns the elastic restarts so far,
    the same number on every rank. Under torchrun the ranks of a node share its agent's store, which outlives a
    restart (a restarted rank could read a dead rank's gloo address from it and hang), so each attempt gets its own
    key prefix. Agents on several nodes count restarts each their own way (a node restarted only because another
    one's rank died counts none), so dstool's multi-node elastic runs take a fresh store from every rendezvous round
    instead (launch.py), and the ranks agree on the highest count."""
    env = os.environ
    rank, world, local_rank = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", "0"))
    restarts = int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
    agent_store = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    prefix = f"dstool/attempt-{restarts}" if agent_store else "dstool"
    watch = watchdog.Watch(Path(cfg.output), cfg.comm_timeout_s, prefix,
                           elastic=int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0)
    try:
        if agent_store:
            store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world, is_master=False)
            dist.init_process_group(backend, store=dist.PrefixStore(prefix, store), rank=rank, world_size=world)
        else:
            dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world)
    except RuntimeError as e:
        if "[127." in str(e) and not env.get("GLOO_SOCKET_IFNAME"):  # gloo took a rank's address from its hostname
            raise RuntimeError(f"a rank advertised a loopback address to host {socket.gethostname()} (a host name "
                               "resolves to 127.0.1.1 in /etc/hosts, Debian's default): set GLOO_SOCKET_IFNAME to "
                               "the cluster interface, e.g. --env GLOO_SOCKET_IFNAME=eth0 ('dstool doctor --hostfile' "
                               f"names it); gloo said: {e}") from e
        raise
    watch.initialized = True
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    count = torch.tensor(restarts, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return int(count.item())


def _resume_source(run: dict, out: Path, world: int, restarts: int) -> tuple[Path | None, bool]:
    """(checkpoint folder to load, whether universal), the same on every rank: the run plan's choice, or after an
    elastic restart the newest checkpoint that passes its manifest check, which rank 0 picks and broadcasts (nodes
    that look at the shared folder moments apart, mid-save, would pick different ones)."""
    tag = Path(run["resume"]) if run["resume"] else None
    if restarts:
        chosen = [str(checkpoint.find_resume(out / "checkpoints") or tag or "") if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(chosen, src=0)
        tag = Path(chosen[0]) if chosen[0] else None
    return checkpoint.load_source(tag, world) if tag else (None, False)


def _heartbeat(out: Path, step: int) -> None:
    """Rank 0's last finished step and its wall time (a restarted run measures its recovery from it)."""
    write_json_atomic(out / "heartbeat.json", {"step": step, "time": time.time()})


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


def _grad_norm(engine) -> float | None:
    g = engine.get_global_grad_norm()
    return None if g is None else float(g)


def _latest(out: Path) -> str | None:
    p = out / "checkpoints" / "latest"
    return p.read_text().strip() if p.is_file() else None


@torch.no_grad()
def evaluate(engine, split: data.TokenSplit, micro: int, batches: int) -> float:
    """Mean held-out loss; every model replica evaluates its own shard of the split (same count on all)."""
    rank, world = dist.get_rank(group=engine.data_parallel_group), engine.dp_world_size
    n = len(split)
    per_rank = max(1, min(batches, n // (micro * world)))
    shard = (torch.stack([split[((b * world + rank) * micro + k) % n] for k in range(micro)]).to(engine.device)
             for b in range(per_rank))
    if engine.pipeline_parallelism:  # the mean over the micro-batches, on every stage
        mean = engine.eval_batch(((batch, batch) for batch in shard), num_micro_batches=per_rank).reshape(())
        total = mean * per_rank
    else:
        engine.eval()
        total = sum(engine(input_ids=batch, labels=batch).loss.float() for batch in shard)
        engine.train()
    dist.all_reduce(total)  # every rank holds its replica's total: the mean over all ranks is the mean over replicas
    return total.item() / (per_rank * dist.get_world_size())


def _log_eval(engine, split, cfg: TrainConfig, step: int, metrics: MetricsLog | None) -> None:
    val = evaluate(engine, split, engine.train_micro_batch_size_per_gpu(), cfg.eval_batches)
    if metrics:
        ppl = math.exp(val) if val < 50 else float("inf")
        metrics.write(step, val_loss=val, val_perplexity=ppl)
        log.info(f"dstool: step {step} held-out loss {val:.4f} perplexity {ppl:.2f}")


def _save_hf_folder(engine, module, tokenizer, val_split, out: Path, precision: str, step: int) -> None:
    """Consolidate the weights the engine computes with into out/model (`module`: the Hugging Face model),
    then prove it: reload with transformers and compare logits with the engine's on held-out tokens."""
    from transformers import AutoModelForCausalLM

    rank = dist.get_rank()
    probe = torch.stack([val_split[i % len(val_split)] for i in range(2)])[:, :64]
    if engine.pipeline_parallelism:  # collectives; logits and full dict on rank 0
        engine_logits = pipeline_parallel.logits(engine, probe.to(engine.device))
        state = pipeline_parallel.hf_state_dict(engine, module)
    else:
        engine.eval()
        with torch.no_grad():
            engine_logits = engine(input_ids=probe.to(engine.device)).logits.float().cpu()
        if engine.zero_optimization_stage() == 3 or engine.autotp_size() > 1:
            state = engine._consolidated_16bit_state_dict()  # collective; ZeRO-3 and AutoTP shards joined on rank 0
        else:
            state = engine.module.state_dict() if rank == 0 else None
    if rank != 0 or state is None:
        return
    target, tmp = out / "model", out / ".model.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
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


class _progress:
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
                 f"tok/s {row['tokens_per_s']:,.0f} mfu {row['mfu']:.2%}")

    def close(self) -> None:
        if self.bar:
            self.bar.close()


def _run(run_file: str) -> None:
    """`main`, and any failure it meets becomes failure.json (the launching `dstool train` reports it in one line)
    plus the traceback in this rank's log. Then the process ends without the interpreter's teardown: its final
    garbage collection over the engine's objects measured 15-20 s per rank here, after everything was written."""
    code = 0
    try:
        main(run_file)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except Exception as e:  # noqa: BLE001
        logging.getLogger("traceback").error("rank failed", exc_info=True)
        out = Path(json.loads(Path(run_file).read_text())["config"]["output"])
        rank = os.environ.get("RANK", "?")
        if not (out / "failure.json").exists():
            write_json_atomic(out / "failure.json", {"message": f"rank {rank}: {type(e).__name__}: {e}"})
        code = 1
    logging.shutdown()
    dlog.console_stream().flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _run(sys.argv[1])
