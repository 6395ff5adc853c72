"""`train(config)`: everything `dstool train` does, callable from Python.

Steps, each checked before the next: validate the config and output folder -> prepare tokenizer
and packed data -> choose the checkpoint to resume -> write the run plan -> launch the ranks ->
check the consolidated model folder.
"""

from __future__ import annotations

import fcntl
import json
import math
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch

from dstool import models
from dstool.config import TrainConfig, dump_yaml
from dstool.errors import TrainingFailed, UsageError
from dstool.manifest import ManifestError, read_manifest, verify_manifest, write_json_atomic, write_manifest
from dstool.train import checkpoint, data, deepspeed_config, launch, pipeline
from dstool.train.metrics import read_metrics

RUN_KIND = "train-run"
MODEL_KIND = "hf-model"


@dataclass
class TrainResult:
    output: Path
    model_dir: Path
    step: int
    train_loss: float | None
    val_loss: float | None


def train(cfg: TrainConfig, echo=print) -> TrainResult:
    """Run DeepSpeed training as `cfg` says; returns where the outputs are and the final losses."""
    on_gpu = torch.cuda.is_available()
    precision = _precision(cfg, on_gpu)
    models.check_model_ref(cfg.model)
    if cfg.pipeline_stages > 1:
        pipeline.check_model(cfg.model)
    if cfg.distill_from:
        models.check_model_folder(Path(cfg.distill_from))
    topo = launch.plan(cfg)
    ds_config = deepspeed_config.build(cfg, topo.world, precision, on_gpu)
    out = Path(cfg.output)
    docs = data.read_documents(cfg.data)

    with _lock(out):  # nodes sharing the output folder claim it and prepare data one at a time
        fingerprint = data.corpus_fingerprint(docs)
        manifest = read_manifest(out) or {}
        if manifest.get("data_fingerprint") not in (None, fingerprint):
            raise UsageError(f"output {out} was prepared from other data: use a new --output for this data")
        tokenizer = data.load_or_train_tokenizer(cfg.model, docs, cfg.vocab_size, out / "tokenizer")
        if not (out / "data" / "meta.json").is_file():
            data.prepare_dataset(docs, tokenizer, out / "data", cfg.val_fraction)
        resume = _resume_point(cfg, out, topo.world, len(tokenizer), echo)
        write_manifest(out, RUN_KIND, hash_files=False, data_fingerprint=fingerprint)

    meta = json.loads((out / "data" / "meta.json").read_text())
    replicas = deepspeed_config.data_parallel_size(cfg, topo.world)
    if meta["train_tokens"] // cfg.seq_len < deepspeed_config.batch_plan(cfg, topo.world)[0] * replicas:
        raise UsageError(f"data has {meta['train_tokens']} training tokens, fewer than one global micro-batch "
                         f"of {cfg.seq_len}-token sequences: add data or lower --seq-len/--micro-batch-size")

    run = {"config": cfg.model_dump(), "ds_config": ds_config, "precision": precision, "on_gpu": on_gpu,
           "world_size": topo.world, "resume": str(resume) if resume else None}
    write_json_atomic(out / "run.json", run)
    (out / "config.yaml").write_text(dump_yaml(cfg))
    write_json_atomic(out / "ds_config.json", ds_config)

    micro, accum = deepspeed_config.batch_plan(cfg, topo.world)
    echo(f"dstool train: {cfg.model} on {topo.world} rank(s) ({topo.nodes} node(s) x {topo.procs_per_node}, "
         f"{topo.launcher}, {'GPU/nccl' if on_gpu else 'CPU/gloo'}), ZeRO-{cfg.zero}, {precision}")
    if replicas != topo.world:
        echo(f"  model parallel: {cfg.pipeline_stages} pipeline stage(s) x {cfg.tensor_parallel} tensor-parallel "
             f"rank(s) per replica, {replicas} data-parallel replica(s)")
    echo(f"  data: {meta['train_tokens']:,} train / {meta['val_tokens']:,} held-out tokens, vocab {len(tokenizer)}; "
         f"global batch {micro} x {accum} x {replicas} = {micro * accum * replicas} sequences of {cfg.seq_len}")
    echo(f"  lr: peak {deepspeed_config.peak_lr(cfg, topo.world):.3g} (= {cfg.lr:g} x {replicas if cfg.lr_scaling == 'linear' else 1}, "
         f"lr_scaling={cfg.lr_scaling}), warmup {deepspeed_config.warmup_steps(cfg)} steps "
         f"({cfg.warmup_ratio:.0%}), cosine to {cfg.min_lr_ratio:g} x peak over {cfg.max_steps} steps")
    echo(f"  resume: {resume or 'fresh start'}")
    echo(f"effective config (saved as {out / 'config.yaml'}; DeepSpeed JSON in {out / 'ds_config.json'}):")
    echo("  " + dump_yaml(cfg).rstrip().replace("\n", "\n  "))

    (out / "failure.json").unlink(missing_ok=True)
    _run_ranks(launch.command(cfg, topo, out / "run.json"), launch.environment(cfg, topo, on_gpu), out)
    return _result(out, cfg)


def _precision(cfg: TrainConfig, on_gpu: bool) -> str:
    if cfg.precision == "auto":
        return "bf16" if on_gpu else "fp32"
    if cfg.precision == "fp16" and not on_gpu:
        raise UsageError("fp16 needs a GPU (DeepSpeed's CPU accelerator has no fp16): use --precision bf16 or fp32")
    return cfg.precision


def _claim_output(out: Path) -> None:
    """Refuse a folder holding someone else's files; never overwrite them."""
    if out.is_dir() and any(out.iterdir()):
        manifest = read_manifest(out)
        if manifest is None or manifest.get("kind") != RUN_KIND:
            raise UsageError(f"output {out} holds files dstool did not write: choose an empty or new --output")
    out.mkdir(parents=True, exist_ok=True)


class _lock:
    """Claim the output folder under an exclusive file lock (nodes sharing it prepare data once)."""

    def __init__(self, out: Path):
        self.out = out

    def __enter__(self):
        if self.out.exists() and not self.out.is_dir():
            raise UsageError(f"output {self.out} is a file: pass a folder for --output")
        self.out.parent.mkdir(parents=True, exist_ok=True)
        # The lock file sits beside the folder, so checking the folder's contents sees only real files.
        self.f = open(self.out.with_name(f".{self.out.name}.lock"), "w")
        fcntl.flock(self.f, fcntl.LOCK_EX)
        _claim_output(self.out)

    def __exit__(self, *exc):
        fcntl.flock(self.f, fcntl.LOCK_UN)
        self.f.close()


def _resume_point(cfg: TrainConfig, out: Path, world: int, vocab_size: int, echo) -> Path | None:
    """The checkpoint to continue from, checked against this model; converted to DeepSpeed's
    universal format when it was saved on another world size (the ranks then load that)."""
    root = out / "checkpoints"
    if cfg.resume == "none":
        if checkpoint.complete_tags(root):
            raise UsageError(f"output {out} already has checkpoints and --resume none would overwrite them: "
                             "use --resume auto or a new --output")
        return None
    tag = checkpoint.find_resume(root, warn=echo) if cfg.resume == "auto" else checkpoint.resolve_explicit(cfg.resume)
    if tag is None:
        return None
    _check_same_model(tag, cfg.model, vocab_size)
    saved_world = checkpoint.saved_world_size(tag)
    if saved_world != world and (cfg.pipeline_stages > 1 or cfg.tensor_parallel > 1):
        raise UsageError(f"checkpoint {tag} was saved on {saved_world} ranks; pipeline and tensor-parallel runs resume "
                         f"only on the same world size: use {saved_world} ranks or a new --output")
    if checkpoint.needs_universal(tag, world):
        if cfg.lr_scaling == "linear":
            echo(f"  note: world size {saved_world} -> {world} changes the peak lr (--lr-scaling linear); "
                 "use --lr-scaling none to keep it")
        try:
            checkpoint.universal(tag, echo)
        except RuntimeError as e:
            raise TrainingFailed(str(e), 1) from None
    return tag


def _check_same_model(tag: Path, model_ref: str, vocab_size: int) -> None:
    """Refuse, before any rank starts, a checkpoint whose parameter shapes are not this model's."""
    from transformers import AutoConfig, AutoModelForCausalLM

    saved = (read_manifest(tag) or {}).get("model_shapes")
    if not saved:  # written before shapes were recorded
        return
    hf_config = (models.preset_config(model_ref, vocab_size, {}) if models.is_preset(model_ref)
                 else AutoConfig.from_pretrained(model_ref))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    ours = checkpoint.model_shapes(model)
    if ours != saved:
        diff = next((n for n in ours if saved.get(n) != ours[n]), None) or next(n for n in saved if n not in ours)
        raise UsageError(f"checkpoint {tag} holds another model shape ({diff}: saved {saved.get(diff)}, "
                         f"--model {model_ref} has {ours.get(diff)}): resume with the model it was trained from "
                         "or use a new --output")


def _run_ranks(cmd: list[str], env: dict[str, str], out: Path) -> None:
    """Start the launcher in this process group (Ctrl-C reaches every rank); forward SIGTERM; wait."""
    proc = subprocess.Popen(cmd, env=env, preexec_fn=lambda: launch.die_with_parent(signal.SIGTERM))
    previous = signal.signal(signal.SIGTERM, lambda signum, _frame: proc.send_signal(signum))
    try:
        rc = proc.wait()
    except KeyboardInterrupt:  # the launcher got the same SIGINT and stops the ranks; wait for it
        rc = proc.wait()
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
    if rc != 0:
        failure = out / "failure.json"
        if failure.is_file():
            reason = json.loads(failure.read_text())["message"]
            raise TrainingFailed(f"training stopped: {reason}", 1)
        raise TrainingFailed(f"training ranks exited with code {rc} (see the rank logs above)", rc if rc > 0 else 1)


def _result(out: Path, cfg: TrainConfig) -> TrainResult:
    model_dir = out / "model"
    try:
        verify_manifest(model_dir, MODEL_KIND)
    except ManifestError as e:
        raise TrainingFailed(f"the consolidated model folder is not valid: {e}", 1) from None
    rows = read_metrics(out)
    train_rows = [r for r in rows if "loss" in r]
    val_rows = [r for r in rows if "val_loss" in r]
    last_val = val_rows[-1]["val_loss"] if val_rows else None
    return TrainResult(out, model_dir, train_rows[-1]["step"] if train_rows else 0,
                       train_rows[-1]["loss"] if train_rows else None,
                       last_val if last_val is None or math.isfinite(last_val) else None)
