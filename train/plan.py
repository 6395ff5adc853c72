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

import psutil
from pydantic import BaseModel, Field, ValidationError

from dstool import gguf, models
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
    tensor_parallel: float = Field(description="all-gathers and reduce-scatters of activations (sequence parallelism), "
                                   "as much as 2 all-reduces forward + 2 backward per layer")
    pipeline: float = Field(description="activations forward and their gradients backward, to the next and previous "
                            "stage (a middle stage's)")
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
    """Memory per device for each ZeRO stage, throughput, time, cost and communication at each cluster size `cfg`
    names, under its layout."""
    cfg = cfg.model_copy(update={"model": gguf.resolve(cfg.model)})
    device = _device(cfg)
    shape = _model_shape(cfg.model, cfg.vocab_size, cfg.seq_len)
    _check_layout(cfg, shape)
    counts = cfg.device_counts() or _ladder(device)
    if device.cpu and counts[-1] > device.cores:
        raise UsageError(f"this machine has {device.cores} cores: plan at most {device.cores} ranks on it "
                         f"(--gpus 1,...,{device.cores})")
    layouts = [_layout(cfg, n) for n in counts]
    if all(lay.problem() for lay in layouts):
        multiple = cfg.pipeline_stages * math.lcm(cfg.tensor_parallel, cfg.expert_parallel)
        raise UsageError(f"the layout {_flags(cfg)} divides none of the device counts planned "
                         f"({','.join(map(str, counts))}): each must be a multiple of {multiple} (e.g. --gpus "
                         f"{multiple},{2 * multiple},{4 * multiple})")
    mfu, source, notes = _mfu(cfg, device)
    notes += _train_refuses(cfg)
    clusters, skipped = [], []
    for layout in layouts:
        n = layout.world
        if why := layout.problem():
            skipped.append(NotApplicable(gpus=n, reason=why))
            continue
        micro, accum = deepspeed_config.batch_plan(TrainConfig(
            micro_batch_size=cfg.micro_batch_size, gradient_accumulation_steps=cfg.gradient_accumulation_steps,
            global_batch_size=cfg.global_batch_size), layout.data)
        memory = [_stage(shape, device, layout, z, cfg, accum) for z in _stages(cfg)]
        fitting = [m.zero for m in memory if m.fits and (cfg.zero is None or m.zero == cfg.zero)]
        zero = min(fitting) if fitting else None
        bubble = (layout.pipeline - 1) / (accum + layout.pipeline - 1)
        efficiency = _scaling(n, cfg.gpus_per_node, cfg.node_scaling, device.cpu)
        tok_s = n * mfu * device.peak(n) * 1e12 * efficiency * (1 - bubble) / shape.flops_per_token
        step_tokens = micro * accum * layout.data * cfg.seq_len
        steps = math.ceil(cfg.token_budget() / step_tokens)
        hours = steps * step_tokens / tok_s / 3600
        tp, pp, ep = _model_parallel_bytes(shape, layout, cfg, accum)
        clusters.append(ClusterPlan(
            gpus=n, nodes=_nodes(cfg, device, n), layout=layout.describe(), data_parallel=layout.data,
            expert_data_parallel=layout.expert_data, parameters_per_gpu=sum(psi for psi, _ in _parts(shape, layout)),
            memory=memory, zero=zero, peak_tflops=device.peak(n), scaling_efficiency=efficiency,
            tokens_per_s=tok_s, micro_batch_size=micro, gradient_accumulation_steps=accum,
            step_time_s=step_tokens / tok_s, steps=steps, hours=hours, gpu_hours=hours * n,
            cost=hours * n * cfg.price if cfg.price is not None else None, pipeline_bubble=bubble,
            communication=Communication(data_parallel=None if zero is None else memory[zero].data_parallel_bytes,
                                        tensor_parallel=tp, pipeline=pp, expert_parallel=ep)))
    if all(c.zero is None for c in clusters):
        raise UsageError(_fits_nowhere(cfg, shape, device, clusters))
    return Plan(
        model=cfg.model, parameters=shape.total, active_parameters=shape.active,
        routed_expert_parameters=shape.experts, largest_layer_parameters=shape.largest,
        flops_per_token=shape.flops_per_token, tokens=cfg.token_budget(),
        seq_len=cfg.seq_len, device=_label(device), device_memory_gib=device.memory_gib, mfu=mfu, mfu_source=source,
        notes=notes,
        node_scaling=cfg.node_scaling, gpus_per_node=cfg.gpus_per_node, offload_optimizer=cfg.offload_optimizer,
        offload_params=cfg.offload_params, tensor_parallel=cfg.tensor_parallel, pipeline_stages=cfg.pipeline_stages,
        expert_parallel=cfg.expert_parallel, activation_checkpointing=cfg.activation_checkpointing,
        activations_gib=_activations(shape, cfg, cfg.activation_checkpointing) / GIB,
        activations_other_gib=_activations(shape, cfg, not cfg.activation_checkpointing) / GIB,
        price=cfg.price, clusters=clusters, not_applicable=skipped)


# ---- layout ------------------------------------------------------------------------------------------------------


def _layout(cfg: PlanConfig, gpus: int) -> Layout:
    return Layout(gpus, pipeline=cfg.pipeline_stages, tensor=cfg.tensor_parallel, expert=cfg.expert_parallel)


def _flags(cfg: PlanConfig) -> str:
    return " ".join(f"--{flag} {k}" for flag, k in (("pipeline-stages", cfg.pipeline_stages),
                                                     ("tensor-parallel", cfg.tensor_parallel),
                                                     ("expert-parallel", cfg.expert_parallel)) if k > 1)


def _nodes(cfg: PlanConfig, device: _Device, gpus: int) -> int:
    return 1 if device.cpu else math.ceil(gpus / cfg.gpus_per_node)


def _check_layout(cfg: PlanConfig, shape: _Shape) -> None:
    """The layout's degrees against the model: experts, attention heads and layers to split."""
    if cfg.expert_parallel > 1 and not shape.routed:
        raise UsageError(f"--expert-parallel {cfg.expert_parallel} needs an MoE model: {cfg.model} has no routed "
                         "experts")
    if shape.routed % cfg.expert_parallel:
        raise UsageError(f"--expert-parallel {cfg.expert_parallel} does not divide the {shape.routed} routed experts "
                         f"of each MoE layer of {cfg.model}: use a divisor of {shape.routed}")
    if shape.heads % cfg.tensor_parallel:
        raise UsageError(f"--tensor-parallel {cfg.tensor_parallel} does not divide the {shape.heads} attention heads "
                         f"of {cfg.model}: use a divisor of {shape.heads}")
    if cfg.pipeline_stages > shape.layers:
        raise UsageError(f"--pipeline-stages {cfg.pipeline_stages} is more than the {shape.layers} layers of "
                         f"{cfg.model}")


def _train_refuses(cfg: PlanConfig) -> list[str]:
    """A note when `dstool train` does not run this layout (its own check says why)."""
    try:
        TrainConfig(pipeline_stages=cfg.pipeline_stages, tensor_parallel=cfg.tensor_parallel,
                    expert_parallel=cfg.expert_parallel, zero=0)
    except ValidationError as e:
        why = str(e.errors()[0]["msg"]).removeprefix("Value error, ")
        return [f"dstool train does not run this layout: {why}; the plan is of a Megatron-style run of it"]
    return []


def _stages(cfg: PlanConfig) -> list[int]:
    """The ZeRO stages the layout allows: DeepSpeed's pipeline engine partitions neither gradients nor weights."""
    return [0, 1] if cfg.pipeline_stages > 1 else [0, 1, 2, 3]


def _parts(shape: _Shape, layout: Layout) -> list[tuple[float, int]]:
    """(parameters a rank holds, the ranks ZeRO partitions them over), for the dense weights (cut by TP x PP, over the
    data-parallel group) and for the routed experts (cut by EP x PP, over the expert-data-parallel group)."""
    dense = shape.total - shape.experts
    return [(dense / (layout.tensor * layout.pipeline), layout.data),
            (shape.experts / (layout.expert * layout.pipeline), layout.expert_data)]


def _largest(shape: _Shape, layout: Layout) -> float:
    """The largest module a rank gathers under ZeRO-3: a dense one's TP shard, or its share of a layer's experts."""
    return max(shape.largest_dense / layout.tensor, shape.largest_expert / layout.expert)


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
    from transformers import AutoModelForCausalLM

    models.check_model_ref(ref)
    hf_config = models.model_config(ref, vocab_size or models.PRESET_VOCAB.get(ref, 4096))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    total, active = models.count_parameters(model)
    own = {name: sum(p.numel() for p in m.parameters(recurse=False)) for name, m in model.named_modules()}
    expert = {name for name in own if models.is_routed_expert(name + ".")}
    c = model.config
    layers, hidden = c.num_hidden_layers, c.hidden_size
    matmul = active - model.get_input_embeddings().weight.numel()  # as the training loop counts it
    return _Shape(
        total, active, experts=sum(own[name] for name in expert), largest=max(own.values()),
        largest_dense=max(n for name, n in own.items() if name not in expert),
        largest_expert=max((own[name] for name in expert), default=0), layers=layers,
        moe_layers=sum(not models.is_routed_expert(name.rpartition(".")[0] + ".") for name in expert),
        routed=getattr(c, "n_routed_experts", None) or getattr(c, "num_local_experts", None) or 0,
        top_k=getattr(c, "num_experts_per_tok", None) or 0, heads=c.num_attention_heads, hidden=hidden,
        vocab=c.vocab_size, flops_per_token=flops_per_token(matmul, layers, hidden, seq_len))


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


def model_states(parts: list[tuple[float, int]], largest: float, zero: int, ranks_per_node: int,
                 offload_optimizer: bool, offload_params: bool) -> tuple[float, float]:
    """(bytes per device, host bytes per node) of parameters, gradients and Adam states: the formulas of DeepSpeed's
    estimators (`estimate_zero2/3_model_states_mem_needs`, mixed-precision Adam) over the `parts` a rank holds, each
    (its parameters, the ranks ZeRO partitions them over); `largest` is the largest module a rank gathers (ZeRO-3).
    ZeRO-1 is ZeRO-2 with the 16-bit gradients whole on every device; ZeRO-0 is ZeRO-2 on one device (nothing
    partitioned: 20 bytes per parameter, DeepSpeed counting 4-byte fp32 gradients on top of the ZeRO paper's 16). On
    the host, per rank x1.5 (buffers): its fp32 loading copy (ZeRO-3: of its largest module) or, with offload, its
    share of the offloaded states (ZeRO-1/2 the larger of the two, as the ZeRO-3 estimator counts a node without
    zero_init)."""
    held = sum(psi for psi, _ in parts)
    share = sum(psi / group for psi, group in parts)
    if zero == 0:
        device, host = 20 * held, 4 * held
    elif zero == 3:
        device = 4 * largest + (0 if offload_params else 2 * share if offload_optimizer else 18 * share)
        host = (18 if offload_params else 16) * share if offload_optimizer else 4 * largest
    else:  # 16-bit weights whole; gradients whole (ZeRO-1), partitioned (ZeRO-2) or offloaded with the optimizer
        grads = held if zero == 1 else 0 if offload_optimizer else share
        device = 2 * held + 2 * grads + (0 if offload_optimizer else 16 * share)
        host = max(4 * held, 16 * share) if offload_optimizer else 4 * held
    return float(device), float(host * 1.5 * ranks_per_node)


def _activations(shape: _Shape, cfg: PlanConfig, checkpointing: bool) -> float:
    """Activation bytes per device (an estimate): Korthikanti et al. 2022, eq. 4 (eq. 2 for t = 1), t tensor-parallel
    ranks with sequence parallelism: s*b*h*34/t per layer in 16 bit, without the 5*a*s/h attention-score term
    (SDPA/flash attention keeps no s x s scores), plus 4*s*b*V/t for the fp32 logits of the loss (vocabulary-parallel);
    with checkpointing each layer keeps only its 16-bit input (2*s*b*h/t) and one layer is rebuilt at a time. With p
    pipeline stages (1F1B) the first stage holds p micro-batches of its L/p layers, the last one and the logits."""
    t, p = cfg.tensor_parallel, cfg.pipeline_stages
    sb = cfg.seq_len * cfg.micro_batch_size
    layer = 34 * sb * shape.hidden / t
    kept, rebuilt = (2 * sb * shape.hidden / t, layer) if checkpointing else (layer, 0.0)
    return max(shape.layers * kept, shape.layers / p * kept + 4 * sb * shape.vocab / t) + rebuilt


def _stage(shape: _Shape, device: _Device, layout: Layout, zero: int, cfg: PlanConfig, accum: int) -> StageMemory:
    offload_optimizer = cfg.offload_optimizer and zero > 0
    offload_params = cfg.offload_params and zero == 3
    per_device, host = model_states(_parts(shape, layout), _largest(shape, layout), zero,
                                    min(layout.world, layout.world if device.cpu else cfg.gpus_per_node),
                                    offload_optimizer, offload_params)
    per_device += _activations(shape, cfg, cfg.activation_checkpointing)
    if device.cpu:  # the ranks' device memory is the host's: each rank takes its share of the host estimate too
        per_device += host / layout.world
    return StageMemory(zero=zero, device_gib=per_device / GIB, cpu_gib_per_node=host / GIB,
                       fits=per_device <= USABLE * device.memory(layout.world) * GIB,
                       data_parallel_bytes=_data_parallel_bytes(shape, layout, zero, accum))


def _first_fit(cfg: PlanConfig, shape: _Shape, device: _Device, stages: list[int], gpus: int) -> int | None:
    layout = _layout(cfg, gpus)
    if layout.problem():
        return None
    return next((z for z in stages if _stage(shape, device, layout, z, cfg, 1).fits), None)


def _fits_nowhere(cfg: PlanConfig, shape: _Shape, device: _Device, clusters: list[ClusterPlan]) -> str:
    """One line: what does not fit, by how much, and what would."""
    allowed = _stages(cfg)
    stages: list[int] = [cfg.zero] if cfg.zero is not None else allowed
    n = clusters[-1].gpus
    best = min((m for m in clusters[-1].memory if m.zero in stages), key=lambda m: m.device_gib)
    head = (f"{cfg.model} ({_params(shape.total)} parameters) fits no {_label(device)} at "
            f"{f'ZeRO-{cfg.zero}' if cfg.zero is not None else 'any ZeRO stage'} on "
            f"{','.join(str(c.gpus) for c in clusters)} device(s){f' with {_flags(cfg)}' if _flags(cfg) else ''}: it "
            f"needs {best.device_gib:.3g} GiB per device at best (ZeRO-{best.zero} on {n}), "
            f"{USABLE * device.memory(n):.3g} GiB usable")
    ideas = []
    offload = None  # optimizer (and parameter) offload, when that alone fits
    if device.cpu:
        ideas.append(f"a machine with {best.device_gib * n / USABLE:.0f} GiB of memory or more")
    else:
        more = next((g for g in (1 << i for i in range(1, 21)) if g > n and _first_fit(cfg, shape, device, stages, g)
                     is not None), None)
        if more:
            ideas.append(f"{more} GPUs (--gpus {more}: ZeRO-{_first_fit(cfg, shape, device, stages, more)})")
        offloaded = cfg.model_copy(update={"offload_optimizer": True})
        if not cfg.offload_params:
            if (z := _first_fit(offloaded, shape, device, [s for s in stages if s], n)) is not None:
                offload = f"--offload-optimizer (ZeRO-{z})"
            elif 3 in stages and _first_fit(offloaded.model_copy(update={"offload_params": True}), shape, device, [3],
                                            n) is not None:
                offload = "--offload-optimizer --offload-params (ZeRO-3)"
        ideas += [offload] if offload else []
        bigger = next((name for name, gib in sorted(GPU_MEMORY_GIB.items(), key=lambda kv: kv[1])
                       if gib > device.memory_gib and _first_fit(cfg, shape, replace(device, memory_gib=gib), stages, n)
                       is not None), None)
        if bigger:
            ideas.append(f"a GPU with more memory (--gpu {bigger}: {GPU_MEMORY_GIB[bigger]:g} GiB)")
    # a wider expert or tensor split; with optimizer offload when offload alone does not fit
    variants: list[tuple[dict, str]] = [({}, "")]
    if not (device.cpu or offload or cfg.offload_optimizer):
        variants.append(({"offload_optimizer": True}, " --offload-optimizer"))
    for flag, field, splits in (("--expert-parallel", "expert_parallel", shape.routed),
                                ("--tensor-parallel", "tensor_parallel", shape.heads)):
        degrees = [k for k in (getattr(cfg, field) << i for i in range(1, 11)) if splits and splits % k == 0]
        for extra, also in variants:
            wider = next((k for k in degrees if _first_fit(cfg.model_copy(update={field: k, **extra}), shape, device,
                                                           [s for s in stages if s or not extra], n) is not None), None)
            if wider:
                ideas.append(f"{flag} {wider}{also}")
                break
    if cfg.zero is not None and (z := _first_fit(cfg, shape, device, allowed, n)) is not None:
        ideas.append(f"ZeRO-{z} (--zero {z})")
    if not cfg.activation_checkpointing and _first_fit(cfg.model_copy(update={"activation_checkpointing": True}),
                                                       shape, device, stages, n) is not None:
        ideas.append("--activation-checkpointing")
    if cfg.micro_batch_size > 1 and _first_fit(cfg.model_copy(update={"micro_batch_size": 1}), shape, device, stages,
                                               n) is not None:
        ideas.append("--micro-batch-size 1")
    return head + "; would fit: " + ("; ".join(ideas) if ideas else "none of the options planned here (a smaller "
                                     "model, or a shorter --seq-len)")


# ---- communication -------------------------------------------------------------------------------------------------


def _data_parallel_bytes(shape: _Shape, layout: Layout, zero: int, accum: int) -> float:
    """Bytes a device sends per optimizer step for its parts' 16-bit gradients and weights: a ring reduce-scatter or
    all-gather of Ψ parameters over N ranks sends 2·Ψ·(N-1)/N bytes. ZeRO-0 all-reduces (both) and ZeRO-1
    reduce-scatters and all-gathers the updated weights once per step; ZeRO-2 reduce-scatters every micro-step;
    ZeRO-3 also all-gathers the weights for each forward and backward pass, every micro-step."""
    ring = sum(2 * psi * (group - 1) / group for psi, group in _parts(shape, layout))
    return ring * (2 if zero < 2 else accum + 1 if zero == 2 else 3 * accum)


def _model_parallel_bytes(shape: _Shape, layout: Layout, cfg: PlanConfig, accum: int) -> tuple[float, float, float]:
    """(tensor, pipeline, expert parallel) bytes a device sends per optimizer step of `accum` micro-batches, for its
    stage's L/PP layers; a micro-batch's 16-bit activation is A = 2·b·s·h bytes, A/t on each of t tensor-parallel ranks
    (sequence parallelism). Tensor: per layer and pass (forward, backward, and the recomputed forward with
    checkpointing) 2 all-gathers + 2 reduce-scatters of A, as much as 2 all-reduces, 2·A·(t-1)/t sent each. Pipeline:
    a middle stage sends A/t forward and its gradient backward per micro-batch. Expert: dispatch and combine
    all-to-alls per MoE layer and pass, each sending top_k copies of A/t, (EP-1)/EP of them to other ranks."""
    t, p, e = layout.tensor, layout.pipeline, layout.expert
    act = 2 * cfg.seq_len * cfg.micro_batch_size * shape.hidden
    passes = 3 if cfg.activation_checkpointing else 2
    tensor = accum * shape.layers / p * 2 * passes * 2 * act * (t - 1) / t
    pipeline = accum * act / t * min(p - 1, 2)
    expert = accum * shape.moe_layers / p * 2 * passes * shape.top_k * act / t * (e - 1) / e
    return tensor, pipeline, expert


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


def _gb(x: float | None) -> str:
    return "-" if x is None else _count(x / 1e9)


def format_table(p: Plan) -> str:
    """The plan as a header and one row per cluster size (what `dstool plan` prints)."""
    unit = "rank" if p.device.startswith("cpu") else "GPU"
    c0 = p.clusters[0]
    offload = ", ".join(k for k, on in (("optimizer", p.offload_optimizer), ("parameters", p.offload_params)) if on)
    split = p.tensor_parallel * p.pipeline_stages * p.expert_parallel > 1
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
        *([f"  layout: PP{p.pipeline_stages} x TP{p.tensor_parallel} x DP, EP{p.expert_parallel}: parameters per "
           f"{unit} = dense {_params(p.parameters - p.routed_expert_parameters)} / (TP x PP) + routed experts "
           f"{_params(p.routed_expert_parameters)} / (EP x PP), ZeRO partitioning them over DP and EDP (expert data "
           "parallel)" if p.routed_expert_parameters else f"  layout: PP{p.pipeline_stages} x TP{p.tensor_parallel} "
           f"x DP: parameters per {unit} = {_params(p.parameters)} / (TP x PP), ZeRO partitioning them over DP"]
          if split else []),
        f"  memory per {unit}: DeepSpeed's model-state estimators + activations (an estimate: "
        f"{p.activations_gib:.3g} GiB; {p.activations_other_gib:.3g} GiB "
        f"{'without' if p.activation_checkpointing else 'with'} activation checkpointing); offload: "
        f"{offload or 'none'}",
        f"  GB sent per {unit} per step: DP gradients (and ZeRO-3 weights) at the planned stage / TP activation "
        "collectives / PP activations / EP all-to-all",
        "",
    ]
    head = [f"{unit}s", "nodes", *(["DP/EDP" if p.expert_parallel > 1 else "DP"] if split else []),
            *(f"ZeRO-{m.zero}" for m in c0.memory), "planned", "scaling",
            *(["bubble"] if p.pipeline_stages > 1 else []), "tokens/s", "step", "time", f"{unit}-hours",
            *(["cost"] if p.price is not None else []), "GB DP/TP/PP/EP"]
    rows = []
    for c in p.clusters:
        row = [str(c.gpus), str(c.nodes)]
        if split:
            row.append(f"{c.data_parallel}/{c.expert_data_parallel}" if p.expert_parallel > 1 else str(c.data_parallel))
        row += [f"{m.device_gib:.3g} GiB {'ok' if m.fits else 'no'}" for m in c.memory]
        row += [f"ZeRO-{c.zero}" if c.zero is not None else "does not fit", f"{c.scaling_efficiency:.2f}"]
        row += [f"{c.pipeline_bubble:.0%}"] if p.pipeline_stages > 1 else []
        run = [_count(c.tokens_per_s), _duration(c.step_time_s), _duration(c.hours * 3600), _count(c.gpu_hours)]
        run += [_count(c.cost)] if c.cost is not None else []
        row += run if c.zero is not None else ["-"] * len(run)
        comm = c.communication
        row.append("/".join(map(_gb, (comm.data_parallel, comm.tensor_parallel, comm.pipeline, comm.expert_parallel))))
        rows.append((c.gpus, row))
    for s in p.not_applicable:
        nodes = 1 if unit == "rank" else math.ceil(s.gpus / p.gpus_per_node)
        rows.append((s.gpus, [str(s.gpus), str(nodes), "n/a"] + ["-"] * (len(head) - 3)))
    table = [head] + [row for _, row in sorted(rows, key=lambda r: r[0])]
    widths = [max(len(r[i]) for r in table) for i in range(len(head))]
    lines += ["  ".join(cell.rjust(w) for cell, w in zip(r, widths)) for r in table]
    if p.not_applicable:
        lines += [""] + [f"n/a: {s.gpus} {unit}{'s' if s.gpus > 1 else ''}: {s.reason}" for s in p.not_applicable]
    if p.offload_optimizer:
        host = [f"{c.gpus} {unit}{'s' if c.gpus > 1 else ''}{f' ({c.nodes} nodes)' if c.nodes > 1 else ''}: "
                f"{_count(c.memory[c.zero].cpu_gib_per_node)} GiB" for c in p.clusters if c.zero is not None]
        lines += ["", "host memory per node for the planned stage (DeepSpeed's estimators): " + ", ".join(host)]
    if p.price is not None:
        lines.append(f"cost: {p.price:g} per {unit}-hour (in the currency of --price)")
    return "\n".join(lines)
