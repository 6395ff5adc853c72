"""GPU hardware figures during training: temperature, power, memory used and total, utilisation and PCIe traffic of
each GPU of rank 0's node, read through NVML (nvidia-ml-py's `pynvml`) every few seconds by a thread of their own,
never by the training loop (one PCIe reading alone takes NVML 20 ms; ctypes lets the loop run meanwhile).

Rank 0 reads every GPU its node's ranks train on (local rank N trains on device N, worker.py): NVML sees the whole
node whatever CUDA_VISIBLE_DEVICES says, and each device is found by its UUID, so the figures are those of the right
board in any device order. Other nodes' GPUs are not read (rank 0's endpoint and TensorBoard speak for its node). A run
without an NVIDIA GPU, or whose NVML does not start (no driver, no pynvml), monitors no GPU: `gpus` is 0, which the
endpoint exports as `dstool_train_gpus 0` and the dashboard shows as "no GPU".
"""

from __future__ import annotations

import os
import socket
import threading
from typing import Any

import torch

from dstool import log as dlog

log = dlog.log

INTERVAL_S = 5.0  # between samples (Prometheus scrapes the training job every 5 s)
# Per-GPU gauges on rank 0's endpoint (labels gpu, host): name, help, the key of a sample.
GAUGES = [
    ("dstool_train_gpu_temperature_celsius", "GPU core temperature (NVML)", "temperature_celsius"),
    ("dstool_train_gpu_power_watts", "GPU power draw (NVML)", "power_watts"),
    ("dstool_train_gpu_memory_used_bytes", "GPU memory in use, all processes (NVML)", "memory_used_bytes"),
    ("dstool_train_gpu_memory_total_bytes", "GPU memory in total (NVML)", "memory_total_bytes"),
    ("dstool_train_gpu_utilization_percent", "Share of the last sample period in which a kernel ran on the GPU "
     "(NVML, 0-100)", "utilization_percent"),
    ("dstool_train_gpu_pcie_tx_bytes_per_second", "PCIe traffic out of the GPU (NVML, over 20 ms)",
     "pcie_tx_bytes_per_second"),
    ("dstool_train_gpu_pcie_rx_bytes_per_second", "PCIe traffic into the GPU (NVML, over 20 ms)",
     "pcie_rx_bytes_per_second"),
]


def local_gpus() -> list[tuple[int, str]]:
    """(device index, UUID as CUDA gives it) of each GPU this node's ranks train on; none without an NVIDIA
    accelerator."""
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None or accelerator.type != "cuda" or torch.version.hip:  # NVML knows NVIDIA's boards only
        return []
    env = os.environ
    per_node = int(env.get("LOCAL_WORLD_SIZE") or env.get("LOCAL_SIZE") or env.get("WORLD_SIZE") or 1)
    count = min(per_node, torch.accelerator.device_count())
    return [(i, str(torch.cuda.get_device_properties(i).uuid)) for i in range(count)]


def _handle(nvml: Any, uuid: str) -> Any:
    """NVML's handle of a device CUDA names by its bare UUID: NVML spells a board GPU-<uuid>, a MIG instance
    MIG-<uuid>."""
    if uuid.startswith(("GPU-", "MIG-")):
        return nvml.nvmlDeviceGetHandleByUUID(uuid)
    try:
        return nvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
    except nvml.NVMLError:
        return nvml.nvmlDeviceGetHandleByUUID(f"MIG-{uuid}")


class GpuMonitor:
    """The latest figures of each GPU in `gpus` ((device index, UUID) pairs), sampled by a daemon thread every
    `interval_s` seconds from the start; `latest` is replaced whole, so a reader always gets one sample's figures."""

    def __init__(self, gpus: list[tuple[int, str]], interval_s: float = INTERVAL_S):
        self.host = socket.gethostname()
        self.interval_s = interval_s
        self.latest: dict[int, dict[str, float]] = {}  # device index -> sample key -> value
        self._nvml: Any = None
        self._handles: dict[int, Any] = self._open(gpus) if gpus else {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self._handles:
            self._thread = threading.Thread(target=self._run, name="dstool-gpu-monitor", daemon=True)
            self._thread.start()

    @property
    def gpus(self) -> int:
        """GPUs monitored: 0 on a CPU run, or where NVML did not start."""
        return len(self._handles)

    def _open(self, gpus: list[tuple[int, str]]) -> dict[int, Any]:
        """NVML started and a handle per GPU, or {} and one line saying why not."""
        try:
            import pynvml  # noqa: PLC0415 (optional: without nvidia-ml-py the GPU metrics are off)
        except ImportError:
            log.info("dstool: GPU hardware metrics off: nvidia-ml-py (pynvml) is not installed (dstool_train_gpus 0)")
            return {}
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as e:
            log.info(f"dstool: GPU hardware metrics off: NVML did not start ({e}; no NVIDIA driver?) "
                     "(dstool_train_gpus 0)")
            return {}
        try:
            handles = {index: _handle(pynvml, uuid) for index, uuid in gpus}
        except pynvml.NVMLError as e:
            log.info(f"dstool: GPU hardware metrics off: NVML does not know this run's GPUs ({e}) "
                     "(dstool_train_gpus 0)")
            pynvml.nvmlShutdown()
            return {}
        self._nvml = pynvml
        return handles

    def sample(self) -> dict[int, dict[str, float]]:
        """One reading of every GPU; a figure the board does not report (NVML: not supported) is left out."""
        return {index: _read(self._nvml, handle) for index, handle in self._handles.items()}

    def _run(self) -> None:
        while True:
            try:
                self.latest = self.sample()
            except Exception as e:  # noqa: BLE001 - never a traceback from a monitoring thread
                log.info(f"dstool: GPU hardware metrics stopped: {type(e).__name__}: {e}")
                return
            if self._stop.wait(self.interval_s):
                return

    def close(self) -> None:
        """Stop sampling (the last figures stay) and release NVML."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout=5.0)
        if not self._thread.is_alive():
            self._nvml.nvmlShutdown()
        self._thread = None


def _read(nvml: Any, handle: Any) -> dict[str, float]:
    """One GPU's figures in base units: °C, W, bytes, percent, bytes/s (NVML gives mW and KiB/s)."""
    readings = {
        "temperature_celsius": lambda: nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU),
        "power_watts": lambda: nvml.nvmlDeviceGetPowerUsage(handle) / 1000,
        "memory": lambda: nvml.nvmlDeviceGetMemoryInfo(handle),
        "utilization_percent": lambda: nvml.nvmlDeviceGetUtilizationRates(handle).gpu,
        "pcie_tx_bytes_per_second": lambda: nvml.nvmlDeviceGetPcieThroughput(handle, nvml.NVML_PCIE_UTIL_TX_BYTES)
        * 1024,
        "pcie_rx_bytes_per_second": lambda: nvml.nvmlDeviceGetPcieThroughput(handle, nvml.NVML_PCIE_UTIL_RX_BYTES)
        * 1024,
    }
    values: dict[str, float] = {}
    for key, read in readings.items():
        try:
            value = read()
        except nvml.NVMLError:
            continue
        if key == "memory":
            values.update(memory_used_bytes=float(value.used), memory_total_bytes=float(value.total))
        else:
            values[key] = float(value)
    return values
