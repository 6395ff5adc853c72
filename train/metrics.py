"""Training metrics: metrics.jsonl, TensorBoard events, tokens/s and model FLOPs utilisation."""

from __future__ import annotations

import json
import os
from pathlib import Path

# Declared dense bf16/fp16 peak per device in TFLOP/s (vendor datasheets, without sparsity).
GPU_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0, "L4": 121.0,
                   "V100": 125.0, "MI300X": 1307.0}
# Memory per device in GiB as the driver reports it, for the same devices (the largest variant: A100 and H100 80 GB,
# V100 32 GB); `dstool plan --gpu-memory` gives another.
GPU_MEMORY_GIB = {"H200": 140.0, "H100": 80.0, "A100": 80.0, "L40S": 45.0, "A10": 22.5, "L4": 22.5, "V100": 32.0,
                  "MI300X": 192.0}


def _cpuinfo(key: str) -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith(key):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_flops_per_cycle() -> int:
    """Declared fp32 FLOPs per cycle of one x86 core: two FMA units x vector lanes x 2 (FMA)."""
    flags = set(_cpuinfo("flags").split())
    return 64 if "avx512f" in flags else 32 if "fma" in flags else 16


def _cpu_hz() -> float:
    mhz = _cpuinfo("cpu MHz")
    return float(mhz) * 1e6 if mhz else 2.5e9


def declared_peak_tflops(device_name: str, cores_per_rank: int) -> float:
    for key, value in GPU_PEAK_TFLOPS.items():
        if key in device_name.upper():
            return value
    return cpu_flops_per_cycle() * _cpu_hz() * cores_per_rank / 1e12


def flops_per_token(matmul_params: int, layers: int, hidden: int, seq_len: int) -> float:
    """Training FLOPs per token: 6N over the weights that do matmuls (not the input embedding lookup)
    plus 12*L*H*S for attention scores (PaLM, appendix B)."""
    return 6.0 * matmul_params + 12.0 * layers * hidden * seq_len


class MetricsLog:
    """Rank 0's sink: one JSON object per line, plus TensorBoard scalars when enabled."""

    def __init__(self, output: Path, tensorboard: bool):
        self.path = Path(output) / "metrics.jsonl"
        self._file = open(self.path, "a", buffering=1)
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(Path(output) / "tensorboard"))

    def write(self, step: int, **values) -> None:
        self._file.write(json.dumps({"step": step, **values}) + "\n")
        self.scalars(step, values)

    def scalars(self, step: int, values: dict) -> None:
        """The numbers among `values` to TensorBoard only (when enabled)."""
        if self._tb is not None:
            for k, v in values.items():
                if isinstance(v, (int, float)):
                    self._tb.add_scalar(k, v, step)

    def close(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(output: Path) -> list[dict]:
    path = Path(output) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
