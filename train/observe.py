"""Training observability beside metrics.jsonl: rank 0's Prometheus endpoint (--metrics-port), memory and GPU hardware
scalars in TensorBoard (the GPUs of rank 0's node, train/hardware.py), and the torch profiler over --profile-steps A:B
on every rank.

The worker makes one `Observer` per rank and calls it at four points of its loop: `stepped` after each optimizer
step, `window` after each logging window's metrics row (rank 0), `checkpointed` after each checkpoint, `close` when
the loop ends. The endpoint then keeps serving the final figures until the process exits.
"""

from __future__ import annotations

import math
import socket
import time
from pathlib import Path

import psutil
import torch
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from torch.profiler import ProfilerAction, ProfilerActivity, profile, tensorboard_trace_handler

from dstool import log as dlog
from dstool.files import write_json_atomic
from dstool.train import hardware
from dstool.train.config import TrainConfig
from dstool.train.metrics import MetricsLog

log = dlog.log

ENDPOINT_FILE = "metrics_endpoint.json"  # {"url", "host", "port"} of the live endpoint, written by rank 0
PROFILE_FOLDER = Path("tensorboard") / "profile"  # a TensorBoard run: *.pt.trace.json, one per rank

# Gauges set from each logging window's row: metric name, help, row key.
WINDOW_GAUGES = [
    ("dstool_train_loss", "Mean training loss over the last logging window", "loss"),
    ("dstool_train_learning_rate", "Learning rate at the last logged step", "lr"),
    ("dstool_train_tokens_per_second", "Training tokens per second over the last logging window, all ranks",
     "tokens_per_s"),
    ("dstool_train_mfu_ratio", "Model FLOPs utilisation over the last logging window (0-1, against the declared "
     "peak)", "mfu"),
    ("dstool_train_step_time_seconds", "Mean optimizer step time over the last logging window", "step_time_s"),
    ("dstool_train_grad_norm", "Global gradient norm at the last logged step (NaN where DeepSpeed gives none)",
     "grad_norm"),
]
CUDA_GAUGES = [
    ("dstool_train_cuda_memory_allocated_bytes", "Memory held by tensors on rank 0's GPU", "cuda_allocated_bytes"),
    ("dstool_train_cuda_memory_reserved_bytes", "Memory held by the caching allocator on rank 0's GPU",
     "cuda_reserved_bytes"),
    ("dstool_train_cuda_memory_max_allocated_bytes", "Peak memory held by tensors on rank 0's GPU since it started",
     "cuda_max_allocated_bytes"),
]


def memory(device: int | None) -> dict[str, float]:
    """This process's resident memory and, with a CUDA device, its allocator's figures, in bytes."""
    values = {"rss_bytes": float(psutil.Process().memory_info().rss)}
    if device is not None:
        values.update(cuda_allocated_bytes=float(torch.cuda.memory_allocated(device)),
                      cuda_reserved_bytes=float(torch.cuda.memory_reserved(device)),
                      cuda_max_allocated_bytes=float(torch.cuda.max_memory_allocated(device)))
    return values


class Observer:
    """One per rank; each part is off unless configured (the endpoint and the TensorBoard scalars live on rank 0)."""

    def __init__(self, cfg: TrainConfig, out: Path, rank: int, start_step: int, restarts: int,
                 metrics: MetricsLog | None):
        self.metrics = metrics
        self.device = torch.cuda.current_device() if torch.cuda.is_available() else None  # this rank's GPU
        self.profiler = _profiler(cfg, out, rank, start_step)
        wanted = rank == 0 and (cfg.metrics_port is not None or cfg.tensorboard)
        self.gpus = hardware.GpuMonitor(hardware.local_gpus()) if wanted else None  # its own thread samples NVML
        self.endpoint = (_Endpoint(cfg, out, start_step, restarts, self.device, self.gpus)
                         if rank == 0 and cfg.metrics_port is not None else None)

    def stepped(self) -> None:
        """After each optimizer step."""
        if self.profiler is not None:
            self.profiler.step()

    def window(self, step: int, row: dict) -> None:
        """After a logging window's row is written (rank 0): memory and the GPUs' latest sample to TensorBoard, the
        row to the endpoint."""
        if self.metrics is not None:
            self.metrics.scalars(step, {f"memory/{k}": v for k, v in memory(self.device).items()})
            if self.gpus is not None:
                self.metrics.scalars(step, {f"gpu/{key}/{index}": value for index, values in self.gpus.latest.items()
                                            for key, value in values.items()})
        if self.endpoint is not None:
            self.endpoint.window(step, row)

    def checkpointed(self, step: int) -> None:
        if self.endpoint is not None:
            self.endpoint.checkpointed(step)

    def close(self) -> None:
        """Stop the profiler (a range cut short by an error is still written) and the GPU sampling (the endpoint keeps
        its last figures)."""
        if self.profiler is not None:
            self.profiler.stop()
            self.profiler = None
        if self.gpus is not None:
            self.gpus.close()


def _profiler(cfg: TrainConfig, out: Path, rank: int, start_step: int):
    """A started torch profiler recording optimizer steps A..B (warm-up on the step before), or None."""
    if cfg.profile_steps is None:
        return None

    first, last = cfg.profile_range()
    first = max(first, start_step + 1)  # resumed inside the range: the steps still to come
    if first > last:
        if rank == 0:
            log.info(f"dstool: --profile-steps {cfg.profile_steps}: those steps ran before step {start_step}, where "
                     "this run resumed; nothing to profile")
        return None

    def action(n: int) -> ProfilerAction:  # n: the optimizer step whose work comes next
        if n == first - 1:
            return ProfilerAction.WARMUP
        if first <= n < last:
            return ProfilerAction.RECORD
        return ProfilerAction.RECORD_AND_SAVE if n == last else ProfilerAction.NONE

    folder = out / PROFILE_FOLDER
    write = tensorboard_trace_handler(str(folder), worker_name=f"rank{rank}")

    def ready(prof) -> None:
        write(prof)
        if rank == 0:
            log.info(f"dstool: profiler trace of steps {first}-{last} written to {folder} (every rank): "
                     f"tensorboard --logdir {out / 'tensorboard'}, or open a file in https://ui.perfetto.dev")

    cuda = [ProfilerActivity.CUDA] if torch.cuda.is_available() else []
    prof = profile(activities=[ProfilerActivity.CPU, *cuda], schedule=action, on_trace_ready=ready,
                   record_shapes=True, profile_memory=True)
    prof.start()
    for _ in range(start_step + 1):  # idle steps, so that ProfilerStep#N is the work of optimizer step N
        prof.step()
    return prof


class _Endpoint:
    """Rank 0's /metrics: the last window's figures (one consistent set per scrape), counters, and figures read at
    scrape time (checkpoint age, memory), and the GPUs' latest sample."""

    def __init__(self, cfg: TrainConfig, out: Path, start_step: int, restarts: int, device: int | None,
                 gpus: hardware.GpuMonitor | None):
        self.device, self.gpus = device, gpus
        self.run, self.max_steps, self.restarts = Path(cfg.output).resolve().name, cfg.max_steps, restarts
        self.last_step, self.tokens, self.checkpoints = start_step, 0, 0
        self.values: dict[str, float] = {"step": float(start_step)}  # replaced whole, never updated in place
        latest = out / "checkpoints" / "latest"
        self.checkpoint_step: int | None = None
        self.checkpoint_time = time.time()  # no checkpoint yet: the age of the unsaved work, from now
        if latest.is_file():
            self.checkpoint_step = int(latest.read_text().strip().rsplit("-", 1)[1])
            self.checkpoint_time = latest.stat().st_mtime
        registry = CollectorRegistry()
        registry.register(self)
        try:
            self.server, _ = start_http_server(cfg.metrics_port or 0, registry=registry)
        except OSError as e:
            raise RuntimeError(f"cannot serve metrics on port {cfg.metrics_port} ({e.strerror or e}): choose "
                               "another --metrics-port, or 0 for a free one") from None
        port = self.server.server_port
        url = f"http://{socket.gethostname()}:{port}/metrics"
        write_json_atomic(out / ENDPOINT_FILE, {"url": url, "host": socket.gethostname(), "port": port})
        log.info(f"dstool: Prometheus metrics at {url}")

    def window(self, step: int, row: dict) -> None:
        self.tokens += round(row["tokens_per_s"] * row["step_time_s"]) * (step - self.last_step)
        self.last_step = step
        self.values = {"step": float(step), "time": time.time(),
                       **{key: math.nan if row[key] is None else float(row[key]) for _, _, key in WINDOW_GAUGES}}

    def checkpointed(self, step: int) -> None:
        self.checkpoint_step, self.checkpoint_time, self.checkpoints = step, time.time(), self.checkpoints + 1

    def collect(self):
        """prometheus_client's Collector protocol: called by the HTTP server's thread at each scrape."""
        values, run = self.values, [self.run]

        def gauge(name: str, doc: str, value: float, **labels: str) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=["run", *labels])
            family.add_metric([*run, *labels.values()], value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=["run"])
            family.add_metric(run, value)
            return family

        yield gauge("dstool_train_step", "Optimizer steps done (the last logged step)", values["step"])
        yield gauge("dstool_train_max_steps", "Optimizer steps the run trains in total", self.max_steps)
        for name, doc, key in WINDOW_GAUGES:
            if key in values:
                yield gauge(name, doc, values[key])
        if "time" in values:
            yield gauge("dstool_train_last_log_timestamp_seconds", "Unix time of the last logging window",
                        values["time"])
        yield gauge("dstool_train_checkpoint_age_seconds", "Seconds since the last checkpoint was written (before "
                    "the first: since this process started training)", time.time() - self.checkpoint_time)
        if self.checkpoint_step is not None:
            yield gauge("dstool_train_last_checkpoint_step", "Step of the last checkpoint", self.checkpoint_step)
        yield counter("dstool_train_checkpoints", "Checkpoints this process wrote", self.checkpoints)
        yield counter("dstool_train_tokens", "Training tokens (all ranks) in the steps this process ran", self.tokens)
        yield counter("dstool_train_restarts", "Elastic restarts of the run so far (torchrun --max-restarts)",
                      self.restarts)
        now = memory(self.device)
        yield gauge("dstool_train_resident_memory_bytes", "Resident memory of rank 0's process", now["rss_bytes"])
        if self.device is not None:
            for name, doc, key in CUDA_GAUGES:
                yield gauge(name, doc, now[key], device=str(self.device))
        if self.gpus is not None:
            yield from _gpu_families(self.gpus, self.run)


def _gpu_families(gpus: hardware.GpuMonitor, run: str):
    """`dstool_train_gpus` (0: no GPU monitored, which the dashboard shows as "no GPU") and each GPU's latest figures,
    labelled by device index and host."""
    count = GaugeMetricFamily("dstool_train_gpus", "GPUs of rank 0's node monitored through NVML (0: none: a CPU "
                              "run, or NVML did not start)", labels=["run", "host"])
    count.add_metric([run, gpus.host], gpus.gpus)
    yield count
    latest = gpus.latest
    for name, doc, key in hardware.GAUGES:
        family = GaugeMetricFamily(name, doc, labels=["run", "host", "gpu"])
        for index, values in sorted(latest.items()):
            if key in values:
                family.add_metric([run, gpus.host, str(index)], values[key])
        if family.samples:
            yield family
