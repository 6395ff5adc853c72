"""The options of `dstool train` and `dstool doctor` (importing this loads no torch: option errors come fast)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from dstool.config import CommandConfig


class TrainConfig(CommandConfig):
    """Everything `dstool train` needs. Field names are the YAML keys; CLI flags use dashes."""

    # What to train on
    model: str = Field("tiny", description="preset (tiny, tiny-moe, deepseek-7b) or a local Hugging Face model folder")
    data: str | None = Field(None, description="text file, folder of .txt/.jsonl files, or none for the embedded "
                             "corpus")
    output: str = Field("runs/train", description="run folder: checkpoints/, model/, metrics.jsonl, tensorboard/")
    vocab_size: int = Field(4096, ge=256, le=65535, description="BPE vocabulary when a tokenizer is trained")
    seq_len: int = Field(128, ge=8, description="packed sequence length in tokens")
    val_fraction: float = Field(0.05, gt=0, lt=0.5, description="held-out share of the token stream")

    # Launch
    nproc: int = Field(1, ge=1, description="ranks per node")
    hostfile: str | None = Field(None, description="DeepSpeed hostfile ('host slots=N' per line)")
    num_nodes: int = Field(1, ge=1, description="nodes in the job (from the hostfile when one is given)")
    node_rank: int | None = Field(None, ge=0, description="this node's rank when each node is started by hand")
    master_addr: str = Field("127.0.0.1", description="address of node 0")
    master_port: int | None = Field(None, ge=1, le=65535, description="rendezvous port (free port when single-node)")
    launcher: Literal["auto", "torchrun", "deepspeed"] = "auto"
    env: dict[str, str] = Field(default_factory=dict, description="environment for every rank, e.g. NCCL_SOCKET_IFNAME")
    max_restarts: int = Field(0, ge=0, description="torchrun elastic restarts when a rank dies; each resumes from "
                              "the last valid checkpoint")

    # Optimisation
    zero: Literal[0, 1, 2, 3] = Field(2, description="ZeRO stage")
    offload_optimizer: bool = Field(False, description="ZeRO-Offload of optimizer state to CPU")
    offload_params: bool = Field(False, description="ZeRO-3 parameter offload to CPU")
    pipeline_stages: int = Field(1, ge=1, description="pipeline-parallel stages (DeepSpeed PipelineModule; Llama "
                                 "models, zero 0 or 1); data-parallel size = world / stages")
    tensor_parallel: int = Field(1, ge=1, description="tensor-parallel ranks per model replica (DeepSpeed AutoTP); "
                                 "data-parallel size = world / tensor_parallel")
    precision: Literal["auto", "fp32", "bf16", "fp16"] = Field("auto", description="auto: fp32 on CPU, bf16 on GPU")
    micro_batch_size: int = Field(8, ge=1, description="sequences per rank per micro-step")
    gradient_accumulation_steps: int | None = Field(None, ge=1, description="micro-steps per optimizer step")
    global_batch_size: int | None = Field(None, ge=1, description="sequences per optimizer step across all ranks")
    max_steps: int = Field(200, ge=1, description="optimizer steps in total")
    lr: float = Field(1e-3, gt=0, description="peak learning rate before world-size scaling")
    lr_scaling: Literal["linear", "none"] = Field("linear", description="linear: peak lr x data-parallel world size")
    warmup_ratio: float = Field(0.05, ge=0, lt=1, description="share of max_steps spent warming up")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="cosine decay floor as a share of peak lr")
    weight_decay: float = Field(0.1, ge=0)
    grad_clip: float = Field(1.0, ge=0, description="global gradient-norm clip (0 = off)")
    seed: int = 1234

    # Checkpoints, metrics
    save_every: int = Field(100, ge=1, description="checkpoint every N steps (and at the end)")
    keep_checkpoints: int = Field(3, ge=1, description="newest checkpoints kept")
    resume: str = Field("auto", description="auto (latest valid checkpoint), none, or a checkpoint folder")
    log_every: int = Field(10, ge=1)
    eval_every: int = Field(0, ge=0, description="held-out evaluation every N steps (0 = at the end only)")
    eval_batches: int = Field(8, ge=1, description="micro-batches per rank per evaluation")
    peak_tflops: float | None = Field(None, gt=0, description="declared per-rank peak for MFU (default by device)")
    tensorboard: bool = True
    trace_samples: bool = Field(False, description="write each rank's sample ids per step (data audit)")
    deepspeed_config: str | None = Field(None, description="DeepSpeed JSON merged over the generated config")
    keep_zero_weights: bool = Field(False, description="hold weights that start at exactly zero at zero (N:M sparsity)")
    distill_from: str | None = Field(None, description="teacher model folder: loss = cross-entropy + KL(teacher || "
                                     "student) on the logits (knowledge distillation)")

    @model_validator(mode="after")
    def _consistent(self) -> TrainConfig:
        if self.keep_zero_weights and self.zero == 3:
            raise ValueError("keep_zero_weights needs zero 0, 1 or 2 (ranks must hold whole weights)")
        if self.pipeline_stages > 1 and self.zero > 1:
            raise ValueError(f"pipeline_stages {self.pipeline_stages} needs zero 0 or 1 (DeepSpeed pipelines cannot "
                             "partition gradients or weights): add --zero 1")
        if self.pipeline_stages > 1 and self.tensor_parallel > 1:
            raise ValueError("pipeline_stages and tensor_parallel cannot be combined: choose one of them")
        if (self.pipeline_stages > 1 or self.tensor_parallel > 1) and (self.distill_from or self.keep_zero_weights):
            raise ValueError("distill_from and keep_zero_weights need data parallelism only: drop them or set "
                             "pipeline_stages and tensor_parallel to 1")
        if self.offload_params and self.zero != 3:
            raise ValueError("offload_params needs zero: 3")
        if self.node_rank is not None and self.node_rank >= self.num_nodes and not self.hostfile:
            raise ValueError(f"node_rank {self.node_rank} is not below num_nodes {self.num_nodes}")
        return self


class TrainCommand(TrainConfig):
    """`dstool train`: the run's TrainConfig, or with `emit` the Kubernetes manifest of that run instead."""

    emit: Literal["k8s"] | None = Field(None, description="print a Kubeflow PyTorchJob manifest (YAML) for this run "
                                        "instead of running it")
    image: str = Field("dstool:latest", description="container image for --emit k8s")
    pvc: str = Field("dstool-checkpoints", description="PersistentVolumeClaim shared by the pods, mounted at "
                     "/checkpoints (--emit k8s)")

    def train_config(self) -> TrainConfig:
        return TrainConfig(**self.model_dump(exclude={"emit", "image", "pvc"}))


class DoctorConfig(CommandConfig):
    """`dstool doctor`: preflight checks of a hostfile's nodes (or this machine) before a launch."""

    hostfile: str | None = Field(None, description="DeepSpeed hostfile to check every node of (default: this machine)")
    master_addr: str = Field("127.0.0.1", description="address of node 0")
    master_port: int = Field(29500, ge=1, le=65535, description="rendezvous port to check")
    output: str = Field("runs/train", description="the run folder to check")
    nproc: int = Field(2, ge=1, description="local processes for the all-reduce test")
    env: dict[str, str] = Field(default_factory=dict, description="as for train, e.g. NCCL_SOCKET_IFNAME=eth0")
