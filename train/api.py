"""`train(config)`: everything `dstool train` does, callable from Python.

Steps, each checked before the next: validate the config and output folder -> prepare tokenizer
and packed data -> choose the checkpoint to resume -> write the run plan -> launch the ranks ->
check the consolidated model folder.
"""

from __future__ import annotations

import fcntl
import json
import math
import re
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from dstool import gguf, models
from dstool import log as dlog
from dstool.artifacts import DataSplit, HFModel, ManifestError, TrainRun, kind_of
from dstool.config import changed, dump_yaml
from dstool.errors import StageFailed, TrainingFailed, UsageError
from dstool.files import write_json_atomic
from dstool.proc import check_port_free, die_with_parent
from dstool.train import (
    archive,
    autobatch,
    checkpoint,
    data,
    deepspeed_config,
    expert_parallel,
    launch,
    lora,
    pipeline_parallel,
    preempt,
    sources,
    tensor_parallel,
)
from dstool.train.config import TrainConfig
from dstool.train.metrics import read_metrics

log = dlog.log


@dataclass
class TrainResult:
    output: Path
    model_dir: Path
    step: int
    train_loss: float | None
    val_loss: float | None


def train(cfg: TrainConfig) -> TrainResult:
    """Run DeepSpeed training as `cfg` says; returns where the outputs are and the final losses."""
    on_gpu = torch.cuda.is_available()
    cfg = cfg.model_copy(update={"model": gguf.resolve(cfg.model)})
    precision = _precision(cfg, on_gpu)
    models.check_model_ref(cfg.model)
    if cfg.archive:  # an unknown protocol, an unwritable place: refused before anything is prepared
        archive.check(cfg.archive)
    if cfg.pipeline_stages > 1:
        pipeline_parallel.check_model(cfg.model)
    tensor_partition = tensor_parallel.check_model(cfg.model, cfg.tensor_parallel, cfg.pipeline_stages)
    experts = (expert_parallel.check_model(models.model_config(cfg.model, 256), cfg.expert_parallel, cfg.model)
               if cfg.expert_parallel > 1 else None)
    if cfg.mtp_layers:
        from dstool.train import mtp  # noqa: PLC0415 (its layers import transformers' modeling: 1.2 s, for --mtp-layers only)

        mtp.check_model(models.model_config(cfg.model, 256), cfg.mtp_layers, cfg.model)
    if cfg.distill_from:
        models.check_model_folder(Path(cfg.distill_from))
    topo = launch.plan(cfg)
    cfg, micro_search = autobatch.resolve(cfg, on_gpu, topo.world)
    _check_metrics_port(cfg, topo)
    ds_config = deepspeed_config.build(cfg, topo.world, precision, on_gpu, experts, tensor_partition=tensor_partition)
    out = Path(cfg.output)
    srcs = sources.parse(cfg.data)

    with _lock(out):  # nodes sharing the output folder claim it and prepare data one at a time
        fingerprint = data.fingerprint(cfg, srcs)
        earlier = TrainRun.read(out) if kind_of(out) == "train-run" else None
        if earlier is not None and earlier.data_fingerprint != fingerprint:
            raise UsageError(f"output {out} was prepared from other data (or another --data-format): use a new "
                             "--output for this data")
        dlog.to_file(out / "train.log")
        tokenizer = data.load_or_train_tokenizer(cfg.model, srcs, cfg, out / "tokenizer")
        recorded = earlier.data.sha256 if earlier is not None and earlier.data is not None else {}
        meta_file = out / "data" / "meta.json"
        if meta_file.is_file():
            packed_as = json.loads(meta_file.read_text())
            if packed_as.get("seq_len") != cfg.seq_len:
                raise UsageError(f"output {out} packed its data in {packed_as.get('seq_len')}-token sequences: use "
                                 f"that --seq-len, or a new --output for {cfg.seq_len}")
            if packed_as.get("val_fraction") != cfg.val_fraction:
                raise UsageError(f"output {out} held out --val-fraction {packed_as.get('val_fraction')} of its data: "
                                 f"use that, or a new --output for {cfg.val_fraction}")
        else:
            data.prepare(cfg, srcs, tokenizer, out / "data")
            recorded = {}  # packed now: nothing to compare with
        meta = json.loads(meta_file.read_text())
        packed = data.run_sha256(out / "data")
        if changed_file := _packed_change(out / "data", recorded, packed, "since the run packed it"):
            raise UsageError(changed_file)
        if cfg.lora:  # PEFT refuses targets the model lacks here, before any rank starts
            lora.wrap(_meta_model(cfg.model, len(tokenizer)), cfg, quiet=True)
        resume = _resume_point(cfg, out, topo.world, len(tokenizer), precision)
        if resume and experts is None and checkpoint.manifest(resume).expert_parallel:
            # an expert-parallel checkpoint on one rank per expert group: AutoEP's module layout, unsharded
            experts = expert_parallel.check_model(models.model_config(cfg.model, 256), 1, cfg.model)
            ds_config = deepspeed_config.build(cfg, topo.world, precision, on_gpu, experts, expert_parallel=1,
                                               tensor_partition=tensor_partition)
        TrainRun(data_fingerprint=fingerprint, data=DataSplit(
            folder="data", dtype=meta["dtype"], train_tokens=meta["train_tokens"], val_tokens=meta["val_tokens"],
            fingerprint=fingerprint, sha256=packed), archive=cfg.archive).write(out, hash_files=False)

    replicas = deepspeed_config.data_parallel_size(cfg, topo.world)
    if meta["train_sequences"] < deepspeed_config.batch_plan(cfg, topo.world)[0] * replicas:
        raise UsageError(f"data has {meta['train_sequences']} training sequences of {cfg.seq_len} tokens, fewer than "
                         "one global micro-batch: add data or lower --seq-len/--micro-batch-size")

    run = {"config": cfg.model_dump(), "ds_config": ds_config, "precision": precision, "on_gpu": on_gpu,
           "micro_batch_search": micro_search,
           "world_size": topo.world, "resume": str(resume) if resume else None,
           "console": dlog.console_shows_info()}  # rank 0's step lines: shown, or in its log file only
    write_json_atomic(out / "run.json", run)
    (out / "config.yaml").write_text(dump_yaml(cfg))
    write_json_atomic(out / "ds_config.json", ds_config)

    micro, accum = deepspeed_config.batch_plan(cfg, topo.world)
    log.info(f"dstool train: {cfg.model} on {topo.world} rank(s) ({topo.nodes} node(s) x {topo.procs_per_node}, "
             f"{topo.launcher}, {'GPU/nccl' if on_gpu else 'CPU/gloo'}), ZeRO-{cfg.zero}, {precision}")
    if replicas != topo.world or cfg.expert_parallel > 1:
        log.info(f"  layout: {deepspeed_config.layout(cfg, topo.world).describe()}")
    log.info(f"  data: {_sources_line(meta)}; {meta['train_sequences']:,} train / {meta['val_sequences']:,} "
             f"held-out sequences, vocab {len(tokenizer)}; global batch {micro} x {accum} x {replicas} = "
             f"{micro * accum * replicas} sequences "
             f"of {cfg.seq_len}")
    log.info(f"  lr: peak {deepspeed_config.peak_lr(cfg, topo.world):.3g} (= {cfg.lr:g} x "
             f"{replicas if cfg.lr_scaling == 'linear' else 1}, lr_scaling={cfg.lr_scaling}), warmup "
             f"{deepspeed_config.warmup_steps(cfg)} steps ({cfg.warmup_ratio:.0%}), cosine to {cfg.min_lr_ratio:g} x "
             f"peak over {cfg.max_steps} steps")
    log.info(f"  resume: {resume or 'fresh start'}")
    log.info(f"  options set: {', '.join(f'{k}={v}' for k, v in changed(cfg).items()) or 'none (all defaults)'}; the "
             f"whole config: {out / 'config.yaml'}, DeepSpeed's: {out / 'ds_config.json'}, logs: {out / 'train.log'}, "
             f"{out / 'logs'}/")
    log.debug("effective config:\n" + dump_yaml(cfg))

    (out / "failure.json").unlink(missing_ok=True)
    preempt.clear(out)
    _run_ranks(launch.command(cfg, topo, out / "run.json"), launch.environment(cfg, topo, on_gpu), out,
               cfg.preempt_grace_s)
    if cfg.archive and (cfg.node_rank or 0) == 0:  # a copy rank 0 could not finish (it retries at each save)
        checkpoint.settle(out / "checkpoints", cfg.keep_checkpoints, cfg.archive)
    if changed_file := _packed_change(out / "data", packed, data.run_sha256(out / "data"), "while the run read it"):
        raise StageFailed(changed_file)
    return _result(out, cfg)


def _sources_line(meta: dict) -> str:
    """The data set in a few words: format, sources (weights), rows, and what packing cut or dropped."""
    srcs = ", ".join(f"{s['spec']}" + (f" x{s['weight']:g}" if s["weight"] is not None else "") +
                     f" ({len(s['shards'])} shard{'s' * (len(s['shards']) != 1)})" for s in meta["sources"])
    line = f"{meta['format']} from {srcs}, {meta['documents']:,} rows"
    if meta["tail_tokens"] > 0.01 * max(meta["tokens"], 1):
        line += (f" ({meta['tail_tokens']:,} tokens at shard ends fill no whole sequence and are not trained on: "
                 "fewer, larger shards or a smaller --seq-len)")
    if meta["truncated"] or meta["dropped"]:
        line += (f" ({meta['truncated']:,} cut to --seq-len {meta['seq_len']}, {meta['dropped']:,} dropped with "
                 "nothing left to learn)")
    return line


def _packed_change(folder: Path, recorded: dict[str, str], now: dict[str, str], when: str) -> str | None:
    """None when the packed token files are those `recorded`, else one line naming the first that differs."""
    for name, digest in recorded.items():
        if now.get(name) != digest:
            return (f"{folder / name} changed {when} (its sha256 differs from the one recorded in "
                    f"{folder.parent / 'dstool.json'}): restore it, or delete {folder} to pack the corpus again (the "
                    "checkpoints then continue on the new packing)")
    return None


def _check_metrics_port(cfg: TrainConfig, topo: launch.Topology) -> None:
    """Refuse a --metrics-port in use on this node when rank 0 runs here, before any rank starts (elsewhere, rank 0
    reports it in failure.json)."""
    ssh_launched = topo.launcher == "deepspeed" and topo.hosts is not None and cfg.node_rank is None
    if not cfg.metrics_port or (cfg.node_rank or 0) != 0 or ssh_launched:
        return
    try:
        check_port_free("0.0.0.0", cfg.metrics_port)
    except UsageError as e:
        raise UsageError(f"--metrics-port: {e}: choose another port, or 0 for a free one") from None


def _precision(cfg: TrainConfig, on_gpu: bool) -> str:
    if cfg.precision == "auto":
        return "bf16" if on_gpu else "fp32"
    if cfg.precision == "fp16" and not on_gpu:
        raise UsageError("fp16 needs a GPU (DeepSpeed's CPU accelerator has no fp16): use --precision bf16 or fp32")
    return cfg.precision


def _claim_output(out: Path) -> None:
    """Refuse a folder holding someone else's files; never overwrite them."""
    if out.is_dir() and any(out.iterdir()):
        if kind_of(out) != "train-run":
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


def _resume_point(cfg: TrainConfig, out: Path, world: int, vocab_size: int, precision: str) -> Path | None:
    """The checkpoint to continue from, checked against this model; converted to DeepSpeed's
    universal format when it was saved on another world size (the ranks then load that)."""
    root = out / "checkpoints"
    if cfg.resume == "none":
        if checkpoint.complete_tags(root):
            raise UsageError(f"output {out} already has checkpoints and --resume none would overwrite them: "
                             "use --resume auto or a new --output")
        if cfg.archive and archive.Archive(cfg.archive).tags():
            raise UsageError(f"--archive {cfg.archive} already holds checkpoints and --resume none would overwrite "
                             "them: use --resume auto or another --archive")
        return None
    tag = (checkpoint.find_resume(root, archive=cfg.archive) if cfg.resume == "auto"
           else checkpoint.resolve_explicit(cfg.resume))
    if tag is None:
        return None
    _check_same_model(tag, cfg.model, vocab_size, cfg.mtp_layers)
    saved = checkpoint.manifest(tag)
    asked = lora.spec(cfg)
    if saved.lora and asked and {**saved.lora, "base": ""} == {**asked, "base": ""} \
            and saved.lora.get("base") != asked["base"]:
        raise UsageError(f"checkpoint {tag} holds LoRA adapters trained on other base weights than {cfg.model}'s now "
                         "(its weight files changed since): resume on the base it was trained on, or use a new "
                         "--output")
    if saved.lora != asked:
        what = f"LoRA adapters {saved.lora}" if saved.lora else "every weight (no --lora)"
        raise UsageError(f"checkpoint {tag} trained {what}; this run asks {asked or 'no --lora'}: resume "
                         "with the same LoRA options, or use a new --output")
    if saved.precision and saved.precision != precision:
        raise UsageError(f"checkpoint {tag} holds a {saved.precision} engine's optimizer state, which a {precision} "
                         f"engine cannot load: resume with --precision {saved.precision}, or write its weights (the "
                         f"same command with --precision {saved.precision} --max-steps {saved.step}) and start the "
                         f"{precision} phase from them: --model {out / 'model'} --output NEW")
    if cfg.expert_parallel > 1 and not saved.expert_parallel:
        raise UsageError(f"checkpoint {tag} holds the model's own MoE blocks (no --expert-parallel), which an "
                         "expert-parallel engine cannot load: resume without --expert-parallel, or start the "
                         f"expert-parallel run from its weights: --model {out / 'model'} --output NEW")
    if saved.expert_parallel and (cfg.pipeline_stages > 1 or cfg.tensor_parallel > 1):
        raise UsageError(f"checkpoint {tag} holds expert-parallel MoE layers (DeepSpeed AutoEP), which pipeline stages "
                         "and tensor parallelism cannot load: resume with --expert-parallel and data parallelism, or "
                         f"start the new layout from its weights: --model {out / 'model'} --output NEW")
    asked_mp = (cfg.pipeline_stages, cfg.tensor_parallel)
    if saved.pipeline_stages is not None and (saved.pipeline_stages, saved.tensor_parallel or 1) != asked_mp:
        raise UsageError(f"checkpoint {tag} was saved with --pipeline-stages {saved.pipeline_stages} "
                         f"--tensor-parallel {saved.tensor_parallel}, whose per-stage and per-shard files load on "
                         "that layout only: resume with those, or start the new layout from its weights: --model "
                         f"{out / 'model'} --output NEW")
    saved_world = checkpoint.saved_world_size(tag)
    if saved.expert_parallel and saved.zero_stage == 0 and (saved_world, saved.expert_parallel) != (
            world, cfg.expert_parallel):
        raise UsageError(f"checkpoint {tag} is a ZeRO-0 expert-parallel one (EP{saved.expert_parallel} on "
                         f"{saved_world} ranks), whose per-expert-rank optimizer state DeepSpeed cannot re-shard: "
                         f"resume with --expert-parallel {saved.expert_parallel} on {saved_world} ranks (train with "
                         "--zero 1-3 to change layouts later)")
    if saved_world != world and (cfg.pipeline_stages > 1 or cfg.tensor_parallel > 1):
        raise UsageError(f"checkpoint {tag} was saved on {saved_world} ranks; pipeline and tensor-parallel runs resume "
                         f"only on the same world size: use {saved_world} ranks or a new --output")
    if checkpoint.needs_universal(tag, world, cfg.expert_parallel if saved.expert_parallel else None):
        if cfg.lr_scaling == "linear" and saved_world != world:
            log.info(f"  note: world size {saved_world} -> {world} changes the peak lr (--lr-scaling linear); "
                     "use --lr-scaling none to keep it")
        checkpoint.universal(tag)
    return tag


def _meta_model(model_ref: str, vocab_size: int, mtp_layers: int = 0):
    """The model's modules with no weights (the meta device): shapes and names only (with its MTP layers)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(models.model_config(model_ref, vocab_size))
        if mtp_layers:
            from dstool.train import mtp  # noqa: PLC0415 (its layers import transformers' modeling: 1.2 s, for --mtp-layers only)

            mtp.attach(model, mtp_layers)
        return model


def _check_same_model(tag: Path, model_ref: str, vocab_size: int, mtp_layers: int = 0) -> None:
    """Refuse, before any rank starts, a checkpoint whose parameter shapes are not this model's."""
    saved = checkpoint.manifest(tag).model_shapes
    if not saved:  # written before shapes were recorded
        return
    model = _meta_model(model_ref, vocab_size, mtp_layers)
    ours = checkpoint.model_shapes(model)
    first = getattr(model.config, "num_hidden_layers", 0)
    saved_mtp = sum(f"model.layers.{first + k}.eh_proj.weight" in saved for k in range(8))
    if saved_mtp != mtp_layers:
        raise UsageError(f"checkpoint {tag} trained {saved_mtp} MTP layers (--mtp-layers {saved_mtp}), this run asks "
                         f"{mtp_layers}: resume with --mtp-layers {saved_mtp}, or start from its weights: --model "
                         f"{tag.parent.parent / 'model'} --output NEW")
    if ours != saved:
        diff = next((n for n in ours if saved.get(n) != ours[n]), None) or next(n for n in saved if n not in ours)
        raise UsageError(f"checkpoint {tag} holds another model shape ({diff}: saved {saved.get(diff)}, "
                         f"--model {model_ref} has {ours.get(diff)}): resume with the model it was trained from "
                         "or use a new --output")


def _run_ranks(cmd: list[str], env: dict[str, str], out: Path, grace_s: float) -> None:
    """Start the launcher in this process group (Ctrl-C reaches every rank); on SIGTERM/SIGUSR1 the ranks checkpoint
    and stop (train/preempt.py); wait. The ranks print dstool's lines on stdout; what the launcher and the libraries
    write on stderr (tracebacks, C++ warnings) goes to logs/launcher.log, unless -v."""
    (out / "logs").mkdir(exist_ok=True)
    # DeepSpeed's pdsh runner starts each host's launcher at INFO whatever its own --log_level: those lines are
    # sifted out of what the hosts print (the ranks' stdout is no terminal there anyway)
    remote = "deepspeed.launcher.runner" in cmd and "--no_ssh" not in cmd and not dlog.verbose()
    with open(out / "logs" / "launcher.log", "ab") as launcher_log:
        proc = subprocess.Popen(cmd, env=env, stderr=None if dlog.verbose() else launcher_log,
                                stdout=subprocess.PIPE if remote else None,
                                preexec_fn=lambda: die_with_parent(signal.SIGTERM))
    sifting = threading.Thread(target=_sift, args=(proc.stdout, out / "logs" / "launcher.log"), daemon=True) \
        if remote else None
    if sifting is not None:
        sifting.start()
    watch = preempt.Watch(out, proc, grace_s)
    try:
        rc = proc.wait()
    except KeyboardInterrupt:  # the launcher got the same SIGINT and stops the ranks; wait for it
        rc = proc.wait()
        raise
    finally:
        watch.restore()
        if sifting is not None:
            sifting.join(10)
    if (out / preempt.PREEMPTED).is_file():
        done = json.loads((out / preempt.PREEMPTED).read_text())
        raise preempt.Preempted(f"preempted ({done['reason']}): the ranks stopped after step {done['step']} with "
                                f"checkpoint {done['checkpoint']}; run the same command again (--resume auto) to "
                                "continue from it", log=out / "logs")
    if watch.signal is not None:
        raise preempt.Preempted(f"preempted ({watch.signal}): the ranks stopped before they could checkpoint; the "
                                f"last checkpoint is {_latest_tag(out) or 'none'} (run the same command again to "
                                "continue from it)", log=out / "logs")
    if rc != 0:
        failure = out / "failure.json"
        if failure.is_file():
            reason = json.loads(failure.read_text())["message"]
            raise TrainingFailed(f"training stopped: {reason}", log=out / "logs")
        if _killed(out / "logs" / "launcher.log"):
            raise TrainingFailed("a training rank was killed (SIGKILL): on Linux most often the kernel's out-of-memory "
                                 "killer (`dmesg` says): lower --micro-batch-size or --nproc, add "
                                 "--activation-checkpointing, drop --offload-* (it moves state into host memory)",
                                 log=out / "logs", exit_code=rc if rc > 0 else 1)
        raise TrainingFailed(f"training ranks exited with code {rc}", log=out / "logs", exit_code=rc if rc > 0 else 1)


def _killed(launcher_log: Path) -> bool:
    """Whether the launcher reported a rank ended by SIGKILL (torchrun: "exitcode  : -9", DeepSpeed: "-9")."""
    try:
        with open(launcher_log, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - 65536))
            tail = f.read().decode("utf-8", "replace")
    except OSError:
        return False
    return bool(re.search(r"exitcode\s*:\s*-9\b|Signal 9 \(SIGKILL\)|exits with return code = -9", tail))


_LAUNCHER_INFO = re.compile(rb"^(\S+: )?\[[\d:, -]+\] \[INFO\] \[(launch|runner|multinode_runner)\.py:\d+:")


def _sift(stream, log_path: Path) -> None:
    """The hosts' output: DeepSpeed launchers' INFO lines to the launcher log, the rest (dstool's lines) on."""
    with open(log_path, "ab") as log_file:
        for line in iter(stream.readline, b""):
            if _LAUNCHER_INFO.match(line):
                log_file.write(line)
                log_file.flush()
            else:
                sys.stdout.write(line.decode("utf-8", "replace"))
                sys.stdout.flush()


def _result(out: Path, cfg: TrainConfig) -> TrainResult:
    model_dir = out / "model"
    try:
        HFModel.read(model_dir, verify=True)
    except ManifestError as e:
        raise TrainingFailed(f"the consolidated model folder is not valid: {e}", log=out / "logs") from None
    rows = read_metrics(out)
    train_rows = [r for r in rows if "loss" in r]
    val_rows = [r for r in rows if "val_loss" in r]
    last_val = val_rows[-1]["val_loss"] if val_rows else None
    return TrainResult(out, model_dir, train_rows[-1]["step"] if train_rows else 0,
                       train_rows[-1]["loss"] if train_rows else None,
                       last_val if last_val is None or math.isfinite(last_val) else None)


def _latest_tag(out: Path) -> str | None:
    tag = checkpoint.find_resume(out / "checkpoints", warn=lambda _msg: None)
    return str(tag) if tag else None
