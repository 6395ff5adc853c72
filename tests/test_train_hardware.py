"""GPU hardware monitoring during training (train/hardware.py) against a small fake of pynvml: the figures and their
units, the device-to-board mapping by UUID, sampling off the caller's thread, the labels rank 0's endpoint gives them,
TensorBoard's tags, and the no-GPU path (a CPU run, NVML that does not start, no pynvml) as `dstool_train_gpus 0`.
The exposition of a real CPU run is checked in test_train_observe.py."""

from __future__ import annotations

import logging
import socket
import sys
import threading
import time
import types
import urllib.request
from types import SimpleNamespace

import pytest
import torch

from dstool.train import hardware, observe
from dstool.train.config import TrainConfig

NOT_SUPPORTED, NOT_FOUND, DRIVER_NOT_LOADED = 3, 6, 9
# Two boards as NVML knows them, by UUID (CUDA gives it without NVML's GPU- prefix): device 0 of the run is the second
# board NVML enumerates.
BOARDS = {
    "GPU-bbbb": dict(temperature=61, power_mw=312_500, used=40 << 30, total=80 << 30, util=97, tx_kib=1000, rx_kib=3),
    "GPU-aaaa": dict(temperature=44, power_mw=90_000, used=1 << 30, total=80 << 30, util=0, tx_kib=0, rx_kib=7),
}
RUN_GPUS = [(0, "bbbb"), (1, "aaaa")]


class FakeNVMLError(Exception):
    def __init__(self, value: int):
        self.value = value

    def __str__(self) -> str:
        return {NOT_SUPPORTED: "Not Supported", NOT_FOUND: "Not Found",
                DRIVER_NOT_LOADED: "Driver Not Loaded"}.get(self.value, "Unknown")


def fake_pynvml(init_error: int | None = None, unsupported: frozenset[str] = frozenset(), slow_s: float = 0.0):
    """A module with the part of pynvml's API the monitor uses; `calls` records what was called."""
    nvml = types.ModuleType("pynvml")
    nvml.calls = []  # type: ignore[attr-defined]
    nvml.NVMLError = FakeNVMLError  # type: ignore[attr-defined]
    nvml.NVML_TEMPERATURE_GPU, nvml.NVML_PCIE_UTIL_TX_BYTES, nvml.NVML_PCIE_UTIL_RX_BYTES = 0, 0, 1  # type: ignore

    def api(name):
        def wrap(fn):
            def call(*args):
                nvml.calls.append(name)
                if name in unsupported:
                    raise FakeNVMLError(NOT_SUPPORTED)
                return fn(*args)
            setattr(nvml, name, call)
        return wrap

    @api("nvmlInit")
    def _init():
        if init_error is not None:
            raise FakeNVMLError(init_error)

    api("nvmlShutdown")(lambda: None)

    @api("nvmlDeviceGetHandleByUUID")
    def _handle(uuid):
        if uuid not in BOARDS:
            raise FakeNVMLError(NOT_FOUND)
        return BOARDS[uuid]

    api("nvmlDeviceGetTemperature")(lambda h, sensor: h["temperature"])
    api("nvmlDeviceGetPowerUsage")(lambda h: h["power_mw"])
    api("nvmlDeviceGetMemoryInfo")(lambda h: SimpleNamespace(used=h["used"], total=h["total"],
                                                             free=h["total"] - h["used"]))
    api("nvmlDeviceGetUtilizationRates")(lambda h: SimpleNamespace(gpu=h["util"], memory=0))

    @api("nvmlDeviceGetPcieThroughput")
    def _pcie(h, counter):
        time.sleep(slow_s)  # NVML measures over 20 ms
        return h["tx_kib"] if counter == 0 else h["rx_kib"]

    return nvml


@pytest.fixture
def nvml(monkeypatch):
    """Installs a fake pynvml; call it with fake_pynvml's arguments."""
    def install(**kwargs):
        fake = fake_pynvml(**kwargs)
        monkeypatch.setitem(sys.modules, "pynvml", fake)
        return fake
    return install


def _wait_sampled(monitor: hardware.GpuMonitor) -> dict:
    deadline = time.time() + 10
    while not monitor.latest:
        assert time.time() < deadline, "no sample in 10 s"
        time.sleep(0.01)
    return monitor.latest


def test_figures_in_base_units_by_device_index(nvml):
    fake = nvml()
    monitor = hardware.GpuMonitor(RUN_GPUS, interval_s=0.01)
    try:
        assert monitor.gpus == 2
        latest = _wait_sampled(monitor)
        assert latest[0] == {"temperature_celsius": 61.0, "power_watts": 312.5, "memory_used_bytes": float(40 << 30),
                             "memory_total_bytes": float(80 << 30), "utilization_percent": 97.0,
                             "pcie_tx_bytes_per_second": 1000 * 1024.0, "pcie_rx_bytes_per_second": 3 * 1024.0}
        assert latest[1]["temperature_celsius"] == 44.0 and latest[1]["utilization_percent"] == 0.0
        assert {key for _, _, key in hardware.GAUGES} == set(latest[0])
        samples = fake.calls.count("nvmlDeviceGetTemperature")
        time.sleep(0.2)
        assert fake.calls.count("nvmlDeviceGetTemperature") > samples  # it keeps sampling
    finally:
        monitor.close()
    assert fake.calls[-1] == "nvmlShutdown" and fake.calls.count("nvmlInit") == 1
    stopped = len(fake.calls)
    time.sleep(0.1)
    assert len(fake.calls) == stopped and monitor.latest[0]["power_watts"] == 312.5  # stopped; the last figures stay


def test_sampling_never_holds_up_the_caller(nvml):
    """A slow NVML (a PCIe reading takes 20 ms on a real board; 0.3 s here) keeps only its own thread waiting."""
    nvml(slow_s=0.3)
    started = time.perf_counter()
    monitor = hardware.GpuMonitor(RUN_GPUS, interval_s=0.01)
    try:
        assert time.perf_counter() - started < 0.3 and monitor.latest == {}
        assert any(t.name == "dstool-gpu-monitor" and t.daemon for t in threading.enumerate())
        _wait_sampled(monitor)
    finally:
        monitor.close()


def test_a_figure_the_board_does_not_report_is_left_out(nvml, caplog):
    nvml(unsupported={"nvmlDeviceGetPowerUsage", "nvmlDeviceGetPcieThroughput"})
    monitor = hardware.GpuMonitor(RUN_GPUS, interval_s=0.01)
    try:
        latest = _wait_sampled(monitor)
    finally:
        monitor.close()
    assert set(latest[0]) == {"temperature_celsius", "memory_used_bytes", "memory_total_bytes", "utilization_percent"}
    assert not caplog.records


@pytest.mark.parametrize("case", ["cpu", "driver", "no-pynvml", "unknown-uuid"])
def test_no_gpu(case, nvml, monkeypatch, caplog):
    """A CPU run never touches NVML and says nothing; NVML that does not start, or no pynvml, or a board NVML does not
    know: one info line, no traceback. Each monitors 0 GPUs and starts no thread."""
    caplog.set_level(logging.INFO, logger="dstool")
    fake = nvml(init_error=DRIVER_NOT_LOADED if case == "driver" else None)
    if case == "no-pynvml":
        monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    gpus = {"cpu": [], "unknown-uuid": [(0, "cccc")]}.get(case, RUN_GPUS)
    threads = threading.active_count()
    monitor = hardware.GpuMonitor(gpus, interval_s=0.01)
    monitor.close()
    assert monitor.gpus == 0 and monitor.latest == {} and threading.active_count() == threads
    lines = [r.getMessage() for r in caplog.records]
    if case == "cpu":
        assert lines == [] and fake.calls == []
        return
    assert len(lines) == 1 and lines[0].startswith("dstool: GPU hardware metrics off: ") and lines[0].endswith(
        "(dstool_train_gpus 0)"), lines
    assert {"driver": "Driver Not Loaded", "no-pynvml": "nvidia-ml-py (pynvml) is not installed",
            "unknown-uuid": "NVML does not know this run's GPUs"}[case] in lines[0]
    assert not any(r.exc_info for r in caplog.records)
    if case == "unknown-uuid":
        assert fake.calls[-1] == "nvmlShutdown"


def test_local_gpus_are_this_nodes_ranks_devices_by_uuid(monkeypatch):
    """Local rank N trains on device N: rank 0 reads devices 0..LOCAL_WORLD_SIZE-1 (no more than there are), each
    named by its UUID; NVML finds a board's as GPU-UUID, a MIG instance's as MIG-UUID."""
    if torch.accelerator.current_accelerator() is None:  # this machine: a CPU run
        assert hardware.local_gpus() == []
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: torch.device("cuda"))
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 8)
    monkeypatch.setattr(torch.version, "hip", None)
    uuids = {0: "bbbb", 1: "dddd", 2: "aaaa"}
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(uuid=uuids[i]))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert hardware.local_gpus() == [(0, "bbbb"), (1, "dddd"), (2, "aaaa")]
    nvml = fake_pynvml()
    monkeypatch.setitem(BOARDS, "MIG-dddd", dict(BOARDS["GPU-aaaa"], temperature=50))
    assert [hardware._handle(nvml, uuid)["temperature"] for _, uuid in hardware.local_gpus()] == [61, 50, 44]
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 1)
    assert hardware.local_gpus() == [(0, "bbbb")]
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: torch.device("xpu"))
    assert hardware.local_gpus() == []


class _Scalars:
    def __init__(self):
        self.written: dict[str, float] = {}

    def scalars(self, step: int, values: dict) -> None:
        self.written.update(values)


def _observer(tmp_path, monkeypatch, gpus, tensorboard=True) -> tuple[observe.Observer, str, _Scalars]:
    monkeypatch.setattr(hardware, "local_gpus", lambda: gpus)
    cfg = TrainConfig(output=str(tmp_path / "run"), metrics_port=0, tensorboard=tensorboard)
    (tmp_path / "run").mkdir()
    metrics = _Scalars()
    observer = observe.Observer(cfg, tmp_path / "run", rank=0, start_step=0, restarts=0, metrics=metrics)
    assert observer.endpoint is not None
    return observer, f"http://127.0.0.1:{observer.endpoint.server.server_port}/metrics", metrics


def _series(text: str) -> dict[tuple[str, tuple], float]:
    """(name, sorted labels) -> value of each sample of an exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value for family in text_string_to_metric_families(text)
            for s in family.samples}


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


ROW = {"loss": 2.0, "lr": 1e-3, "tokens_per_s": 100.0, "mfu": 0.1, "step_time_s": 0.5, "grad_norm": 1.0}


def _scrape_then_close(observer, url: str) -> dict:
    """The endpoint's series, scraped before one logging window is written; then the observer is closed."""
    try:
        text = _scrape(url)
        observer.window(2, ROW)
    finally:
        observer.close()
        observer.endpoint.server.shutdown()
    return _series(text)


def test_endpoint_and_tensorboard_label_each_gpu(tmp_path, monkeypatch, nvml):
    """Rank 0's /metrics: dstool_train_gpus and each figure of each GPU labelled run, host, gpu (the device index);
    TensorBoard: gpu/KEY/INDEX at each logging window."""
    nvml()
    observer, url, metrics = _observer(tmp_path, monkeypatch, RUN_GPUS)
    assert observer.gpus is not None
    _wait_sampled(observer.gpus)
    series = _scrape_then_close(observer, url)
    host = socket.gethostname()
    assert series[("dstool_train_gpus", (("host", host), ("run", "run")))] == 2
    per_gpu = {key: value for key, value in series.items() if key[0].startswith("dstool_train_gpu_")}
    assert {labels for _, labels in per_gpu} == {(("gpu", str(i)), ("host", host), ("run", "run")) for i in (0, 1)}
    gpu = {(name, labels[0][1]): value for (name, labels), value in per_gpu.items()}
    assert gpu == {(name, str(i)): value for i, board in enumerate(BOARDS.values()) for name, value in (
        ("dstool_train_gpu_temperature_celsius", board["temperature"]),
        ("dstool_train_gpu_power_watts", board["power_mw"] / 1000),
        ("dstool_train_gpu_memory_used_bytes", board["used"]), ("dstool_train_gpu_memory_total_bytes", board["total"]),
        ("dstool_train_gpu_utilization_percent", board["util"]),
        ("dstool_train_gpu_pcie_tx_bytes_per_second", board["tx_kib"] * 1024),
        ("dstool_train_gpu_pcie_rx_bytes_per_second", board["rx_kib"] * 1024))}
    assert metrics.written["gpu/temperature_celsius/0"] == 61.0 and metrics.written["gpu/power_watts/1"] == 90.0
    assert {k for k in metrics.written if k.startswith("gpu/")} == {f"gpu/{key}/{i}" for _, _, key in hardware.GAUGES
                                                                   for i in (0, 1)}


def test_endpoint_of_a_cpu_run_says_no_gpu(tmp_path, monkeypatch, nvml):
    """dstool_train_gpus 0 and no per-GPU series (the dashboard shows "no GPU", not zeros); nothing to TensorBoard."""
    fake = nvml()
    observer, url, metrics = _observer(tmp_path, monkeypatch, [])
    series = _scrape_then_close(observer, url)
    assert series[("dstool_train_gpus", (("host", socket.gethostname()), ("run", "run")))] == 0
    assert not any(name.startswith("dstool_train_gpu_") for name, _ in series) and fake.calls == []
    assert not any(k.startswith("gpu/") for k in metrics.written) and "memory/rss_bytes" in metrics.written


def test_no_monitor_without_endpoint_or_tensorboard(tmp_path, monkeypatch, nvml):
    fake = nvml()
    monkeypatch.setattr(hardware, "local_gpus", lambda: RUN_GPUS)
    cfg = TrainConfig(output=str(tmp_path), tensorboard=False)
    assert observe.Observer(cfg, tmp_path, 0, 0, 0, None).gpus is None and fake.calls == []
    cfg = TrainConfig(output=str(tmp_path), tensorboard=True)
    assert observe.Observer(cfg, tmp_path, 1, 0, 0, None).gpus is None  # rank 0 only
