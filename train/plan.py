"""`plan(cfg)`: the capacity and cost plan of a training run, for several cluster sizes side by side.

Memory per device for each ZeRO stage is DeepSpeed's model-state estimate (the formulas of its `estimate_zero2/3_...`
functions, mixed-precision Adam) for the parameters a rank holds under the layout (pipeline x tensor x data parallel,
expert parallel: train/layout.py) plus an activation estimate; step time and total time follow from the FLOPs per token
(6N + 12LHS), the device's declared peak, an achievable MFU (published figures, or measured by a run), the pipeline
bubble and an assumed scaling efficiency across nodes; the bytes each device sends per step are counted by kind (data,
tensor, pipeline, expert parallel). The formulas and their sources are in docs/plan.md.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from pydantic import BaseModel, Field, ValidationError

from dstool import models
from dstool.artifacts import kind_of
from dstool.errors import UsageError
from dstool.train import deepspeed_config
from dstool.train.config import PlanConfig, TrainConfig
from dstool.train.layout import Layout
from dstool.train.metrics import GPU_MEMORY_GIB, GPU_PEAK_TFLOPS, declared_peak_tflops, flops_per_token, read_metrics

GIB = float(1 << 30)
# Achievable MFU of dense bf16 training (docs/plan.md): Llama 3 reports 38-43 % on 8-16 K H100s (Dubey et al. 2024,
# table 4); Megatron-LM 52 % of peak on 3,072 A100s counting the recomputed forward pass (Narayanan et al., SC21),
# ~39 % as MFU. With offload, ZeRO-Offload's 40 TFLOP/s per V100 for a 10 B model (Ren et al., ATC21): 32 % of 125.
GPU_MFU, OFFLOAD_MFU = 0.40, 0.30
# Share of device memory a plan may fill: the rest is the CUDA context, allocator fragmentation, NCCL buffers.
USABLE = 0.9
# With activation checkpointing the forward pass runs twice: 8N instead of 6N FLOPs per token on the hardware.
RECOMPUTE = 6 / 8
# Fewer logging windows than this (after the warm-up) make --from-run's median unreliable.
MIN_WINDOWS = 5


class StageMemory(BaseModel):
    """One ZeRO stage at one cluster size."""

    zero: int
    device_gib: float = Field(description="per device: DeepSpeed's model-state estimate + activations (for cpu "
                              "also the rank's share of host memory)")
    cpu_gib_per_node: float = Field(description="host memory per node, DeepSpeed's estimate (offloaded states, "
                                    "loading buffers; ZeRO-1/2 with offload as its ZeRO-3 estimator counts a node)")
    fits: bool = Field(description=f"device_gib is at most {USABLE:.0%} of the device's memory")
    data_parallel_bytes: float = Field(description="bytes each device sends per optimizer step for gradients (and "
                                       "ZeRO-3's weights) over its data-parallel and expert-data-parallel groups")


class Communication(BaseModel):
    """Bytes each device sends per optimizer step, by kind (ring collectives; the formulas are in docs/plan.md)."""

    data_parallel: float | None = Field(description="the planned stage's data_parallel_bytes; None: nothing fits")
    tensor_parallel: float = Field(description="all-reduces of activations, 2 forward + 2 backward per layer")
    pipeline: float = Field(description="activations forward and their gradients backward, to the next and previous "
                            "stage")
    expert_parallel: float = Field(description="all-to-all of routed tokens, dispatch + combine, forward and backward, "
                                   "per MoE layer")


class NotApplicable(BaseModel):
    """A cluster size the layout does not divide."""

    gpus: int
    reason: str


class ClusterPlan(BaseModel):
    """One cluster size: memory per stage, throughput, time, cost and communication."""

    gpus: int
    nodes: int
    layout: str = Field(description="e.g. PP2 x TP4 x DP16, EP8 (each routed expert on 8 rank(s) per stage)")
    data_parallel: int = Field(description="replicas of the dense weights (ZeRO partitions them over these ranks)")
    expert_data_parallel: int = Field(description="replicas of each routed expert (ZeRO partitions them over these)")
    parameters_per_gpu: float = Field(description="dense / (TP x PP) + routed experts / (EP x PP), before ZeRO")
    memory: list[StageMemory] = Field(description="ZeRO 0-3; 0-1 with pipeline stages")
    zero: int | None = Field(description="stage planned (the given one, or the lowest that fits); None: nothing fits")
    peak_tflops: float = Field(description="declared peak per device")
    scaling_efficiency: float
    tokens_per_s: float
    micro_batch_size: int
    gradient_accumulation_steps: int
    step_time_s: float
    steps: int
    hours: float
    gpu_hours: float
    cost: float | None
    pipeline_bubble: float = Field(description="share of the step a 1F1B pipeline idles: (PP - 1) / (m + PP - 1), "
                                   "m micro-batches per step")
    communication: Communication


class Plan(BaseModel):
    """`dstool plan`'s answer (`--format json` prints it)."""

    model: str
    parameters: int
    active_parameters: int = Field(description="per token (MoE: the routed experts' share)")
    routed_expert_parameters: int = Field(description="the routed experts' (the rest is dense: attention, shared "
                                          "experts, dense MLPs, embeddings)")
    largest_layer_parameters: int = Field(description="largest module's own parameters (ZeRO-3's gathered layer)")
    flops_per_token: float = Field(description="6N + 12LHS, N: active parameters that do matmuls")
    tokens: int
    seq_len: int
    device: str
    device_memory_gib: float = Field(description="per device (cpu: the whole machine, shared by its ranks)")
    mfu: float = Field(description="model FLOPs utilisation planned (recomputation already taken off)")
    mfu_source: str
    notes: list[str] = Field(default_factory=list, description="caveats of the MFU planned (--from-run: too few "
                             "windows, measured on another kind of device)")
    node_scaling: float
    gpus_per_node: int
    offload_optimizer: bool
    offload_params: bool
    tensor_parallel: int
    pipeline_stages: int
    expert_parallel: int
    activation_checkpointing: bool
    activations_gib: float = Field(description="per device, as planned (estimate; with pipeline stages the first "
                                   "stage's, which holds PP micro-batches)")
    activations_other_gib: float = Field(description="per device with activation checkpointing switched the other way")
    price: float | None
    clusters: list[ClusterPlan]
    not_applicable: list[NotApplicable] = Field(default_factory=list, description="cluster sizes the layout does not "
                                                "divide")


@dataclass
class _Shape:
    total: int
    active: int
    experts: int  # routed experts' parameters
    largest: int
    largest_dense: int  # the largest module's own parameters, among the modules that are not routed experts
    largest_expert: int  # among the routed experts' (a fused module holds a layer's experts)
    layers: int
    moe_layers: int
    routed: int  # routed experts per MoE layer
    top_k: int
    heads: int
    hidden: int
    vocab: int
    flops_per_token: float


@dataclass
class _Device:
    name: str
    cpu: bool
    memory_gib: float  # per GPU; the whole machine for cpu
    peak_tflops: float | None  # per GPU; the whole machine for cpu (None: FLOP/cycle x clock x cores per rank)
    cores: int

    def memory(self, n: int) -> float:
        return self.memory_gib / n if self.cpu else self.memory_gib

    def peak(self, n: int) -> float:
        if not self.cpu:
            assert self.peak_tflops is not None
            return self.peak_tflops
        return self.peak_tflops / n if self.peak_tflops else declared_peak_tflops("cpu", self.cores // n)


def plan(cfg: PlanConfig) -> Plan:
    """Memory per device for each ZeRO stage, throughput, time and cost at each cluster size `cfg` names."""
    device = _device(cfg)
    shape = _model_shape(cfg.model, cfg.vocab_size, cfg.seq_len)
    counts = cfg.device_counts() or _ladder(device)
    if device.cpu and counts[-1] > device.cores:
        raise UsageError(f"this machine has {device.cores} cores: plan at most {device.cores} ranks on it "
                         f"(--gpus 1,...,{device.cores})")
    mfu, source, notes = _mfu(cfg, device)
    acts = _activations(shape, cfg.seq_len, cfg.micro_batch_size, cfg.activation_checkpointing)
    clusters = []
    for n in counts:
        memory = [_stage(shape, device, n, z, cfg) for z in range(4)]
        fitting = [m.zero for m in memory if m.fits and (cfg.zero is None or m.zero == cfg.zero)]
        micro, accum = deepspeed_config.batch_plan(TrainConfig(
            micro_batch_size=cfg.micro_batch_size, gradient_accumulation_steps=cfg.gradient_accumulation_steps,
            global_batch_size=cfg.global_batch_size), n)
        efficiency = _scaling(n, cfg.gpus_per_node, cfg.node_scaling, device.cpu)
        tok_s = n * mfu * device.peak(n) * 1e12 * efficiency / shape.flops_per_token
        step_tokens = micro * accum * n * cfg.seq_len
        steps = math.ceil(cfg.token_budget() / step_tokens)
        hours = steps * step_tokens / tok_s / 3600
        clusters.append(ClusterPlan(
            gpus=n, nodes=1 if device.cpu else math.ceil(n / cfg.gpus_per_node), memory=memory,
            zero=min(fitting) if fitting else None, peak_tflops=device.peak(n), scaling_efficiency=efficiency,
            tokens_per_s=tok_s, micro_batch_size=micro, gradient_accumulation_steps=accum,
            step_time_s=step_tokens / tok_s, steps=steps, hours=hours, gpu_hours=hours * n,
            cost=hours * n * cfg.price if cfg.price is not None else None))
    if all(c.zero is None for c in clusters):
        raise UsageError(_fits_nowhere(cfg, shape, device, counts, clusters))
    return Plan(
        model=cfg.model, parameters=shape.total, active_parameters=shape.active,
        largest_layer_parameters=shape.largest, flops_per_token=shape.flops_per_token, tokens=cfg.token_budget(),
        seq_len=cfg.seq_len, device=_label(device), device_memory_gib=device.memory_gib, mfu=mfu, mfu_source=source,
        notes=notes,
        node_scaling=cfg.node_scaling, gpus_per_node=cfg.gpus_per_node, offload_optimizer=cfg.offload_optimizer,
        offload_params=cfg.offload_params, activation_checkpointing=cfg.activation_checkpointing,
        activations_gib=acts / GIB,
        activations_other_gib=_activations(shape, cfg.seq_len, cfg.micro_batch_size,
                                           not cfg.activation_checkpointing) / GIB,
        price=cfg.price, clusters=clusters)


# ---- inputs ----------------------------------------------------------------------------------------------------


def _device(cfg: PlanConfig) -> _Device:
    cores = os.cpu_count() or 1
    name = cfg.gpu
    if name == "this":
        import torch

        if not torch.cuda.is_available():
            name = "cpu"
        else:
            found = torch.cuda.get_device_name()
            name = next((k for k in GPU_PEAK_TFLOPS if k in found.upper()), found)
            if name not in GPU_PEAK_TFLOPS and cfg.peak_tflops is None:
                raise UsageError(f"this machine's GPU {found} has no declared peak here: give its --peak-tflops")
            memory = cfg.gpu_memory or torch.cuda.get_device_properties(0).total_memory / GIB
            return _Device(name, False, memory, cfg.peak_tflops or GPU_PEAK_TFLOPS[name], cores)
    if name == "cpu":
        import psutil

        return _Device("cpu", True, cfg.gpu_memory or psutil.virtual_memory().total / GIB, cfg.peak_tflops, cores)
    return _Device(name, False, cfg.gpu_memory or GPU_MEMORY_GIB[name], cfg.peak_tflops or GPU_PEAK_TFLOPS[name],
                   cores)


def _label(device: _Device) -> str:
    if device.cpu:
        return f"cpu ({device.cores} cores of this machine)"
    return device.name


def _ladder(device: _Device) -> list[int]:
    if device.cpu:
        return [1 << i for i in range(device.cores.bit_length()) if 1 << i <= device.cores]
    return [1, 8, 64, 512]


def _model_shape(ref: str, vocab_size: int | None, seq_len: int) -> _Shape:
    """Parameter counts of `ref` from its config alone (the model is built on torch's meta device: no weights)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    models.check_model_ref(ref)
    if models.is_preset(ref):
        hf_config = models.preset_config(ref, vocab_size or models.PRESET_VOCAB.get(ref, 4096), {})
    else:
        hf_config = AutoConfig.from_pretrained(ref)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    total, active = models.count_parameters(model)
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    layers, hidden = model.config.num_hidden_layers, model.config.hidden_size
    matmul = active - model.get_input_embeddings().weight.numel()  # as the training loop counts it
    return _Shape(total, active, largest, layers, hidden, model.config.vocab_size,
                  flops_per_token(matmul, layers, hidden, seq_len))


def _mfu(cfg: PlanConfig, device: _Device) -> tuple[float, str, list[str]]:
    """The MFU planned, where it comes from and its caveats; with activation checkpointing the recomputed forward
    pass is taken off a figure measured or published without it (and added back to a run that had it)."""
    notes: list[str] = []
    if cfg.from_run:
        mfu, source, run_recomputed, notes = measured_mfu(Path(cfg.from_run), device)
    elif cfg.mfu is not None:
        mfu, source, run_recomputed = cfg.mfu, "given (--mfu)", cfg.activation_checkpointing
    elif device.cpu:
        raise UsageError("there is no published MFU for training on CPUs: measure one with a short dstool train run "
                         "on this machine and plan from it (--from-run RUN), or give --mfu")
    elif cfg.offload_optimizer:
        mfu, source, run_recomputed = OFFLOAD_MFU, "default with offload (ZeRO-Offload: 40 TFLOP/s per V100)", False
    else:
        mfu, source, run_recomputed = GPU_MFU, "default (published bf16 training at scale: Llama 3, Megatron-LM)", False
    if cfg.activation_checkpointing != run_recomputed:
        mfu *= RECOMPUTE if cfg.activation_checkpointing else 1 / RECOMPUTE
        source += f"; x{RECOMPUTE if cfg.activation_checkpointing else 1 / RECOMPUTE:.3g} for recomputation"
    return mfu, source, notes


def step_windows(run: Path) -> list[dict]:
    """`run`'s metrics.jsonl step rows, less the first logging window and the first after each restart (warm-up)."""
    rows, warm_up = [], True
    for row in read_metrics(run):
        if row.get("event") == "restart":
            warm_up = True
        elif "mfu" in row:
            if not warm_up:
                rows.append(row)
            warm_up = False
    return rows


def measured_mfu(run: Path, device: _Device) -> tuple[float, str, bool, list[str]]:
    """(median MFU of `run`'s step windows, a description, whether the run recomputed activations, the caveats of
    planning `device` with it: too few windows, another kind of device)."""
    if kind_of(run) != "train-run":
        raise UsageError(f"--from-run {run} is not a dstool train run (no train-run dstool.json there): pass the "
                         "--output folder of a dstool train run")
    values = [row["mfu"] for row in step_windows(run)]
    if not values:
        raise UsageError(f"--from-run {run}: metrics.jsonl has no step rows after the first logging window (the "
                         "warm-up): train more steps than --log-every, or log more often")
    info = json.loads((run / "run.json").read_text()) if (run / "run.json").is_file() else {}
    config = info.get("config", {})
    on_gpu = info.get("on_gpu")
    measured_on = "?" if on_gpu is None else "a GPU" if on_gpu else "CPU"
    where = f"{config.get('model', '?')}, {info.get('world_size', '?')} rank(s), {measured_on}"
    windows = f"{len(values)} window{'s' if len(values) != 1 else ''}"
    notes = []
    if len(values) < MIN_WINDOWS:
        notes.append(f"--from-run {run} has {windows} after the warm-up, too few for a reliable median (at least "
                     f"{MIN_WINDOWS}: train more steps or log more often, --log-every)")
    if on_gpu is not None and on_gpu == device.cpu:
        notes.append(f"the MFU was measured on {measured_on} and is applied to {_label(device)}: a ratio to each "
                     "device's peak, it may not transfer between CPU and GPU; plan from a run on the device you will "
                     "use, or give --mfu")
    return (statistics.median(values), f"measured: median of {windows} of {run} ({where})",
            bool(config.get("activation_checkpointing")), notes)


# ---- memory ------------------------------------------------------------------------------------------------------


def model_states(shape: _Shape, zero: int, gpus: int, gpus_per_node: int, offload_optimizer: bool,
                 offload_params: bool) -> tuple[float, float]:
    """(bytes per device, host bytes per node) of parameters, gradients and Adam states: DeepSpeed's estimators.
    ZeRO-3 and ZeRO-2 are theirs (ZeRO-2's host figure with offload made per node); ZeRO-1 is ZeRO-2 with the 16-bit
    gradients whole on every device; ZeRO-0 is ZeRO-2 on one device (nothing partitioned: 20 bytes per parameter,
    DeepSpeed counting 4-byte fp32 gradients on top of the ZeRO paper's 16)."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    per_node, nodes = min(gpus, gpus_per_node), math.ceil(gpus / gpus_per_node)
    if zero == 3:
        cpu, device, _ = estimate_zero3_model_states_mem_needs(
            shape.total, shape.largest, num_gpus_per_node=per_node, num_nodes=nodes, cpu_offload=offload_optimizer,
            cpu_offload_params=offload_params, zero_init=True)
        return float(device), float(cpu)
    if zero == 0:
        _, device = estimate_zero2_model_states_mem_needs(shape.total, 1, 1, cpu_offload=False)
        cpu, _ = estimate_zero2_model_states_mem_needs(shape.total, per_node, nodes, cpu_offload=False)
        return float(device), float(cpu)
    cpu, device = estimate_zero2_model_states_mem_needs(shape.total, per_node, nodes, cpu_offload=offload_optimizer)
    if offload_optimizer:
        # DeepSpeed's ZeRO-2 host figure, Ψ·max(4·all GPUs, 16)·1.5, is all nodes' together; one node holds its ranks'
        # fp32 loading copies or its share of the offloaded states, as the ZeRO-3 estimator counts a node without
        # zero_init: Ψ·max(4·GPUs per node, 16 / nodes)·1.5
        cpu, _, _ = estimate_zero3_model_states_mem_needs(
            shape.total, shape.largest, num_gpus_per_node=per_node, num_nodes=nodes, cpu_offload=True,
            cpu_offload_params=False, zero_init=False)
    if zero == 1:
        device += 2 * shape.total * (1 if offload_optimizer else 1 - 1 / gpus)
    return float(device), float(cpu)


def _activations(shape: _Shape, seq_len: int, micro: int, checkpointing: bool) -> float:
    """Activation bytes per device (an estimate): Korthikanti et al. 2022, eq. 2, s*b*h*34 per layer in 16 bit
    without the 5*a*s/h attention-score term (SDPA/flash attention keeps no s x s scores), plus 4*s*b*V for the fp32
    logits of the loss; with checkpointing each layer keeps only its 16-bit input (2*s*b*h) and one layer is
    rebuilt at a time."""
    sbh = seq_len * micro * shape.hidden
    logits = 4 * seq_len * micro * shape.vocab
    if checkpointing:
        return float(shape.layers * 2 * sbh + 34 * sbh + logits)
    return float(shape.layers * 34 * sbh + logits)


def _stage(shape: _Shape, device: _Device, gpus: int, zero: int, cfg: PlanConfig) -> StageMemory:
    offload_optimizer = cfg.offload_optimizer and zero > 0
    offload_params = cfg.offload_params and zero == 3
    per_device, host = model_states(shape, zero, gpus, gpus if device.cpu else cfg.gpus_per_node, offload_optimizer,
                                    offload_params)
    per_device += _activations(shape, cfg.seq_len, cfg.micro_batch_size, cfg.activation_checkpointing)
    if device.cpu:  # the ranks' device memory is the host's: each rank takes its share of the host estimate too
        per_device += host / gpus
    return StageMemory(zero=zero, device_gib=per_device / GIB, cpu_gib_per_node=host / GIB,
                       fits=per_device <= USABLE * device.memory(gpus) * GIB)


def _first_fit(cfg: PlanConfig, shape: _Shape, device: _Device, stages: list[int], gpus: int) -> int | None:
    return next((z for z in stages if _stage(shape, device, gpus, z, cfg).fits), None)


def _fits_nowhere(cfg: PlanConfig, shape: _Shape, device: _Device, counts: list[int],
                  clusters: list[ClusterPlan]) -> str:
    """One line: what does not fit, by how much, and what would."""
    stages: list[int] = [cfg.zero] if cfg.zero is not None else [0, 1, 2, 3]
    n = counts[-1]
    best = min((m for m in clusters[-1].memory if m.zero in stages), key=lambda m: m.device_gib)
    head = (f"{cfg.model} ({_params(shape.total)} parameters) fits no {_label(device)} at "
            f"{f'ZeRO-{cfg.zero}' if cfg.zero is not None else 'any ZeRO stage'} on {','.join(map(str, counts))} "
            f"device(s): it needs {best.device_gib:.3g} GiB per device at best (ZeRO-{best.zero} on {n}), "
            f"{USABLE * device.memory(n):.3g} GiB usable")
    ideas = []
    if device.cpu:
        ideas.append(f"a machine with {best.device_gib * n / USABLE:.0f} GiB of memory or more")
    else:
        more = next((g for g in (1 << i for i in range(1, 21)) if g > n and _first_fit(cfg, shape, device, stages, g)
                     is not None), None)
        if more:
            ideas.append(f"{more} GPUs (--gpus {more}: ZeRO-{_first_fit(cfg, shape, device, stages, more)})")
        offloaded = cfg.model_copy(update={"offload_optimizer": True, "offload_params": 3 in stages})
        z = None if cfg.offload_params else _first_fit(offloaded, shape, device, [s for s in stages if s], n)
        if z is not None:
            ideas.append("--offload-optimizer" + (" --offload-params" if z == 3 else "") + f" (ZeRO-{z})")
        bigger = next((name for name, gib in sorted(GPU_MEMORY_GIB.items(), key=lambda kv: kv[1])
                       if gib > device.memory_gib and _first_fit(cfg, shape, replace(device, memory_gib=gib), stages, n)
                       is not None), None)
        if bigger:
            ideas.append(f"a GPU with more memory (--gpu {bigger}: {GPU_MEMORY_GIB[bigger]:g} GiB)")
    if cfg.zero is not None and (z := _first_fit(cfg, shape, device, [0, 1, 2, 3], n)) is not None:
        ideas.append(f"ZeRO-{z} (--zero {z})")
    if not cfg.activation_checkpointing and _first_fit(cfg.model_copy(update={"activation_checkpointing": True}),
                                                       shape, device, stages, n) is not None:
        ideas.append("--activation-checkpointing")
    if cfg.micro_batch_size > 1 and _first_fit(cfg.model_copy(update={"micro_batch_size": 1}), shape, device, stages,
                                               n) is not None:
        ideas.append("--micro-batch-size 1")
    return head + "; would fit: " + ("; ".join(ideas) if ideas else "none of the options planned here (a smaller "
                                     "model, or a shorter --seq-len)")


# ---- throughput ----------------------------------------------------------------------------------------------------


def _scaling(gpus: int, gpus_per_node: int, node_scaling: float, cpu: bool) -> float:
    """1.0 within a node; `node_scaling` for each doubling of the node count beyond one."""
    if cpu or gpus <= gpus_per_node:
        return 1.0
    return node_scaling ** math.log2(math.ceil(gpus / gpus_per_node))


# ---- the table ------------------------------------------------------------------------------------------------------


def _duration(seconds: float) -> str:
    if seconds < 1:
        return f"{seconds * 1000:.3g} ms"
    if seconds < 120:
        return f"{seconds:.3g} s"
    if seconds < 7200:
        return f"{seconds / 60:.3g} min"
    if seconds < 240 * 3600:
        return f"{seconds / 3600:.3g} h"
    return f"{seconds / 86400:.3g} d"


def _params(n: int) -> str:
    return f"{n / 1e9:.3g} B" if n >= 1e9 else f"{n / 1e6:.3g} M" if n >= 1e6 else f"{n:,}"


def _count(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def format_table(p: Plan) -> str:
    """The plan as a header and one row per cluster size (what `dstool plan` prints)."""
    unit = "rank" if p.device.startswith("cpu") else "GPU"
    c0 = p.clusters[0]
    offload = ", ".join(k for k, on in (("optimizer", p.offload_optimizer), ("parameters", p.offload_params)) if on)
    lines = [
        f"dstool plan: {p.model}, {_params(p.parameters)} parameters ({_params(p.active_parameters)} active), "
        f"{p.tokens:,} tokens of {p.seq_len}-token sequences, micro-batch {c0.micro_batch_size} per {unit}",
        f"  device: {p.device}, {p.device_memory_gib:.3g} GiB{' (shared by the ranks)' if unit == 'rank' else ''}, "
        f"{c0.peak_tflops * (c0.gpus if unit == 'rank' else 1):.3g} TFLOP/s declared peak; a plan fills at most "
        f"{USABLE:.0%} of device memory",
        f"  MFU {p.mfu:.1%}: {p.mfu_source}; {p.flops_per_token:.3g} FLOPs per token (6N + 12LHS)",
        *(f"  note: {n}" for n in p.notes),
        f"  scaling efficiency: 1.0 within a node of {p.gpus_per_node}, x{p.node_scaling:g} per doubling of nodes"
        if unit == "GPU" else "  scaling efficiency: 1.0 (the ranks share this machine's cores)",
        f"  memory per {unit}: DeepSpeed's model-state estimators + activations (an estimate: "
        f"{p.activations_gib:.3g} GiB; {p.activations_other_gib:.3g} GiB "
        f"{'without' if p.activation_checkpointing else 'with'} activation checkpointing); offload: "
        f"{offload or 'none'}",
        "",
    ]
    head = [f"{unit}s", "nodes", *(f"ZeRO-{z}" for z in range(4)), "planned", "scaling", "tokens/s", "step",
            "time", f"{unit}-hours"] + (["cost"] if p.price is not None else [])
    rows = [head]
    for c in p.clusters:
        row = [str(c.gpus), str(c.nodes)]
        row += [f"{m.device_gib:.3g} GiB {'ok' if m.fits else 'no'}" for m in c.memory]
        if c.zero is None:
            row += ["does not fit", f"{c.scaling_efficiency:.2f}"] + ["-"] * (len(head) - len(row) - 2)
        else:
            row += [f"ZeRO-{c.zero}", f"{c.scaling_efficiency:.2f}", _count(c.tokens_per_s),
                    _duration(c.step_time_s), _duration(c.hours * 3600), _count(c.gpu_hours)]
            row += [_count(c.cost)] if c.cost is not None else []
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines += ["  ".join(cell.rjust(w) for cell, w in zip(r, widths)) for r in rows]
    if p.offload_optimizer:
        host = [f"{c.gpus} {unit}{'s' if c.gpus > 1 else ''}{f' ({c.nodes} nodes)' if c.nodes > 1 else ''}: "
                f"{_count(c.memory[c.zero].cpu_gib_per_node)} GiB" for c in p.clusters if c.zero is not None]
        lines += ["", "host memory per node for the planned stage (DeepSpeed's estimators): " + ", ".join(host)]
    if p.price is not None:
        lines.append(f"cost: {p.price:g} per {unit}-hour (in the currency of --price)")
    return "\n".join(lines)
