"""Training observability: rank 0's Prometheus endpoint scraped while a real 2-rank run trains (and, where a
`prometheus` binary is installed, by Prometheus itself with the shipped config), the profiler trace, TensorBoard's
memory scalars, the GPU hardware series (on a CPU run: `dstool_train_gpus 0`, which the dashboard shows as "no GPU";
the sampler itself against a fake NVML in test_train_hardware.py), the Grafana dashboards' queries against what the
real endpoints export, the compose profile."""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from dstool.proc import free_port
from dstool.train import hardware
from dstool.train.observe import CUDA_GAUGES, ENDPOINT_FILE, PROFILE_FOLDER

from conftest import DSTOOL, cli, one_line_usage_error
from promlib import PROMETHEUS, Prometheus, scrape

ROOT = Path(__file__).resolve().parent.parent
DASHBOARDS = ROOT / "deploy" / "grafana" / "dashboards"
STEPS, PROFILED = 12, (3, 5)
# micro-batch 4 x 2 ranks x 64 tokens per optimizer step
TRAIN = ["--nproc", "2", "--zero", "2", "--max-steps", str(STEPS), "--save-every", "6", "--seq-len", "64",
         "--micro-batch-size", "4", "--log-every", "2", "--profile-steps", f"{PROFILED[0]}:{PROFILED[1]}"]
TOKENS_PER_STEP = 4 * 2 * 64
GPU_ONLY = {name for name, _, _ in CUDA_GAUGES} | {name for name, _, _ in hardware.GAUGES}
# GPUs rank 0 monitors: those of its node's 2 ranks (none on a CPU run)
GPUS = min(2, torch.cuda.device_count())
# the training row's key behind each gauge
GAUGE_ROW = {"dstool_train_loss": "loss", "dstool_train_learning_rate": "lr", "dstool_train_grad_norm": "grad_norm",
             "dstool_train_tokens_per_second": "tokens_per_s", "dstool_train_mfu_ratio": "mfu",
             "dstool_train_step_time_seconds": "step_time_s"}


# ---- helpers ----------------------------------------------------------------------------------------------------

def _samples(text: str) -> dict[str, float]:
    """name -> value of each sample (the training endpoint has one series per name, or one per device)."""
    from prometheus_client.parser import text_string_to_metric_families

    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


def _exported_names(text: str) -> set[str]:
    """The series names of an exposition as Prometheus stores them (prometheus_client's parser would rename Triton's
    counters to NAME_total); for a family without samples yet (a labelled counter nothing has counted), the names
    prometheus_client gives its samples."""
    samples = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    names = set(samples)
    for _, _, family, kind in (line.split() for line in text.splitlines() if line.startswith("# TYPE ")):
        if not any(name.startswith(family) for name in samples):
            base = family.removesuffix("_total")
            names |= {"counter": {base + "_total"},
                      "histogram": {family + "_bucket", family + "_sum", family + "_count"}}.get(kind, {family})
    return names


def _dashboard(name: str) -> dict:
    return json.loads((DASHBOARDS / f"{name}.json").read_text())


def _queries(dashboard: dict) -> list[str]:
    """Each panel target's PromQL (rows hold no queries)."""
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset", "and", "or",
                "unless", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: identifiers that are not functions, keywords, label matchers,
    grouping labels, ranges or strings."""
    s = re.sub(r'"(?:\\.|[^"\\])*"', "", expr)
    s = re.sub(r"\{[^}]*\}|\[[^\]]*\]", "", s)
    s = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", s)
    return {m.group() for m in re.finditer(r"(?<![\w.:])[A-Za-z_:][\w:]*(?![\w:])(?!\s*\()", s)
            if m.group().lower() not in PROMQL_WORDS}


def _variable_metrics(dashboard: dict) -> set[str]:
    return {re.match(r"label_values\((\w+),", v["definition"]).group(1) for v in dashboard["templating"]["list"]}


# ---- one real run, scraped while it lives -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def observed(tmp_path_factory):
    """`dstool train` on 2 ranks with --metrics-port and --profile-steps: every scrape of its endpoint from the moment
    the endpoint file appears until the process ends, and (with a prometheus binary) Prometheus scraping it too."""
    tmp = tmp_path_factory.mktemp("observe")
    out, port = tmp / "run", free_port()
    prom = Prometheus(tmp / "prometheus", {"training": [f"127.0.0.1:{port}"]}) if PROMETHEUS else None
    log = open(tmp / "train.log", "w")
    proc = subprocess.Popen([*DSTOOL, "train", "--output", str(out), "--metrics-port", str(port), *TRAIN],
                            stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    scrapes: list[str] = []
    deadline, closed = time.time() + 600, False
    try:
        while proc.poll() is None:
            assert time.time() < deadline, "training did not end in 600 s"
            if not closed and (out / ENDPOINT_FILE).is_file():
                # until rank 0 has exited (refused after answering): whatever listens on the port after that (another
                # test's server whose port was free when this one was drawn) is not this run's
                try:
                    text = scrape(f"http://127.0.0.1:{port}/metrics")
                    if "# HELP dstool_train_" in text:
                        scrapes.append(text)
                    else:
                        closed = True
                except urllib.error.URLError as e:
                    closed = bool(scrapes) and isinstance(e.reason, ConnectionRefusedError)
                except (OSError, http.client.HTTPException):
                    pass  # the process is ending
            time.sleep(0.1)
    finally:
        log.close()
    assert proc.returncode == 0, (tmp / "train.log").read_text()[-4000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    yield SimpleNamespace(out=out, port=port, scrapes=scrapes, rows={r["step"]: r for r in rows if "loss" in r},
                          log=(tmp / "train.log").read_text(), prometheus=prom)
    if prom:
        prom.stop()


def test_endpoint_agrees_with_metrics_jsonl(observed):
    endpoint = json.loads((observed.out / ENDPOINT_FILE).read_text())
    assert endpoint["port"] == observed.port and endpoint["url"] == f"http://{socket.gethostname()}:{observed.port}" \
        "/metrics" and f"Prometheus metrics at {endpoint['url']}" in observed.log
    scrapes = [_samples(text) for text in observed.scrapes]
    logged = [s for s in scrapes if "dstool_train_loss" in s]
    assert logged, f"{len(scrapes)} scrapes, none after a logging window"
    for s in logged:  # each scrape is one window's figures: those of the metrics.jsonl row of its step
        row = observed.rows[int(s["dstool_train_step"])]
        for name, key in GAUGE_ROW.items():
            assert s[name] == row[key], (name, s[name], row)
        assert s["dstool_train_tokens_total"] == s["dstool_train_step"] * TOKENS_PER_STEP
    last = scrapes[-1]  # after the loop, while the run consolidates its model: the final figures
    assert "dstool_train_step" in last, f"the last of {len(scrapes)} scrapes: {observed.scrapes[-1]:.500}"
    assert last["dstool_train_step"] == last["dstool_train_max_steps"] == STEPS
    assert last["dstool_train_loss"] == observed.rows[STEPS]["loss"]
    assert last["dstool_train_last_checkpoint_step"] == STEPS and last["dstool_train_checkpoints_total"] == 2
    assert last["dstool_train_restarts_total"] == 0
    assert 0 <= last["dstool_train_checkpoint_age_seconds"] < 600 and last["dstool_train_resident_memory_bytes"] > 1e8
    assert 0 < last["dstool_train_last_log_timestamp_seconds"] <= time.time()
    assert ({name for name, _, _ in CUDA_GAUGES} <= set(last)) == torch.cuda.is_available()
    assert set(re.findall(r'run="([^"]*)"', observed.scrapes[-1])) == {observed.out.name}
    # the GPU hardware series: one per GPU of rank 0's node, labelled by host and device index; a CPU run says no GPU
    from prometheus_client.parser import text_string_to_metric_families

    samples = [s for f in text_string_to_metric_families(observed.scrapes[-1]) for s in f.samples]
    labels = {"run": observed.out.name, "host": socket.gethostname()}
    assert [(s.labels, s.value) for s in samples if s.name == "dstool_train_gpus"] == [(labels, GPUS)]
    for name, _, _ in hardware.GAUGES:
        assert [s.labels for s in samples if s.name == name] == [{**labels, "gpu": str(i)} for i in range(GPUS)], name
    if not GPUS:
        assert "dstool_train_gpu_" not in observed.scrapes[-1] and "GPU hardware metrics off" not in observed.log


def test_profiler_trace_covers_the_profiled_steps(observed):
    """One Chrome/TensorBoard trace per rank, in a TensorBoard run folder; its step markers are exactly A..B."""
    traces = sorted((observed.out / PROFILE_FOLDER).glob("*.pt.trace.json"))
    assert [t.name.split(".")[0] for t in traces] == ["rank0", "rank1"]
    for trace in traces:
        events = json.loads(trace.read_text())["traceEvents"]
        steps = {int(e["name"].removeprefix("ProfilerStep#")) for e in events
                 if e.get("name", "").startswith("ProfilerStep#")}
        assert steps == set(range(PROFILED[0], PROFILED[1] + 1)), (trace.name, steps)
        assert any(e.get("name", "").startswith("aten::") for e in events)  # the operators ran inside the steps
    assert f"profiler trace of steps {PROFILED[0]}-{PROFILED[1]} written" in observed.log


def test_tensorboard_has_memory_scalars(observed):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(observed.out / "tensorboard"))
    events.Reload()
    rss = events.Scalars("memory/rss_bytes")
    assert [e.step for e in rss] == sorted(observed.rows) and min(e.value for e in rss) > 1e8
    assert ("memory/cuda_max_allocated_bytes" in events.Tags()["scalars"]) == torch.cuda.is_available()
    gpu_tags = {tag for tag in events.Tags()["scalars"] if tag.startswith("gpu/")}
    assert gpu_tags == {f"gpu/{key}/{i}" for _, _, key in hardware.GAUGES for i in range(GPUS)}, gpu_tags


@pytest.mark.skipif(PROMETHEUS is None, reason="no prometheus binary (Debian: apt-get install prometheus)")
def test_prometheus_scrapes_the_run_and_answers_every_training_panel(observed):
    """The shipped prometheus.yml (job dstool-train) really scraped the run: its stored samples are the jsonl rows',
    and each training dashboard query returns data at the time of its last sample."""
    prom = observed.prometheus
    steps = prom.query("dstool_train_step{job='dstool-train'}[30m]")
    assert len(steps) == 1, steps
    at_step = {ts: float(v) for ts, v in steps[0]["values"]}
    losses = {ts: float(v) for ts, v in prom.query("dstool_train_loss[30m]")[0]["values"]}
    matched = [ts for ts in losses if ts in at_step]
    assert matched
    for ts in matched:
        assert losses[ts] == observed.rows[int(at_step[ts])]["loss"]
    last = max(at_step)
    for expr in _queries(_dashboard("training")):
        if metric_names(expr) & GPU_ONLY and not torch.cuda.is_available():
            continue
        expr = expr.replace("$run", re.escape(observed.out.name))
        assert prom.query(expr, at=last), f"no data for {expr}"


def test_training_dashboard_names_only_exported_metrics(observed):
    exported = _exported_names(observed.scrapes[-1]) | (set() if torch.cuda.is_available() else GPU_ONLY)
    dashboard = _dashboard("training")
    for expr in _queries(dashboard):
        assert metric_names(expr) and metric_names(expr) <= exported, (expr, metric_names(expr) - exported)
    assert _variable_metrics(dashboard) <= exported


def test_training_dashboard_says_no_gpu_rather_than_zeros():
    """`dstool_train_gpus` 0 (a CPU run, NVML not started) shows as "no GPU"; a panel of per-GPU series shows "no GPU"
    when there are none, and every per-GPU gauge has a panel."""
    panels = [p for p in _dashboard("training")["panels"] if p["type"] != "row"]
    hardware_names = {name for name, _, _ in hardware.GAUGES}
    count = [p for p in panels if any("dstool_train_gpus" in metric_names(t["expr"]) for t in p["targets"])]
    assert len(count) == 1, count
    mappings = count[0]["fieldConfig"]["defaults"]["mappings"]
    assert any(m["type"] == "value" and m["options"]["0"]["text"] == "no GPU" for m in mappings), mappings
    per_gpu = [p for p in panels if any(metric_names(t["expr"]) & hardware_names for t in p["targets"])]
    assert {name for p in per_gpu for t in p["targets"] for name in metric_names(t["expr"])} == hardware_names
    for p in per_gpu:
        assert p["fieldConfig"]["defaults"]["noValue"] == "no GPU", p["title"]
        assert all("{{gpu}}" in t["legendFormat"] and "{{host}}" in t["legendFormat"] for t in p["targets"])


def test_serving_dashboard_names_only_exported_metrics(server, gateway, gateway_server, tmp_path):
    """Names from real scrapes of Triton (all five models, NAME_llm's own metrics included) and of the gateway, and
    with a prometheus binary every serving panel's query answered by Prometheus scraping them."""
    _serving_traffic(server, gateway)
    triton = [f"127.0.0.1:{srv.metrics_port}" for srv in (server, gateway_server)]
    exported = _exported_names(scrape(f"http://{gateway.http_url}/metrics"))
    for target in triton:
        exported |= _exported_names(scrape(f"http://{target}/metrics"))
    dashboard = _dashboard("serving")
    for expr in _queries(dashboard):
        assert metric_names(expr) and metric_names(expr) <= exported, (expr, metric_names(expr) - exported)
    assert _variable_metrics(dashboard) <= exported
    if PROMETHEUS is None:
        pytest.skip("the dashboard's metric names were checked against real scrapes; Prometheus answering its "
                    "queries needs a prometheus binary (Debian: apt-get install prometheus)")
    prom = Prometheus(tmp_path / "prometheus", {"gateway": [gateway.http_url], "triton": triton})
    try:
        deadline = time.time() + 120
        while prom.targets_up("dstool-gateway") + prom.targets_up("triton") < 3:
            assert time.time() < deadline, "Prometheus did not reach the gateway and both Tritons"
            time.sleep(0.5)
        _serving_traffic(server, gateway)  # counted between two scrapes: every rate() has an increase to show
        for expr in _queries(dashboard):
            if "tenant" in expr:  # a --auth keys gateway's series: test_tenants.py scrapes them
                continue
            expr = expr.replace("$model", ".*")
            while not prom.query(expr):  # a rate() needs two scrapes
                assert time.time() < deadline, f"no data for {expr}"
                time.sleep(0.5)
    finally:
        prom.stop()


def _serving_traffic(server, gateway) -> None:
    """What makes every serving series exist: a cache miss, a hit, a bypass and a bad request through the gateway,
    a generation on NAME_llm."""
    body = json.dumps({"inputs": [{"name": "INPUT0", "shape": [3], "datatype": "FP32",
                                   "data": [time.time(), 1.0, 2.0]}]}).encode()
    infer = f"http://{gateway.http_url}/v2/models/echo_fp32/infer"
    for headers in ({}, {}, {"Cache-Control": "no-cache"}):
        urllib.request.urlopen(urllib.request.Request(infer, body, headers), timeout=60).read()
    with pytest.raises(urllib.error.HTTPError):
        urllib.request.urlopen(urllib.request.Request(infer, b"{not json"), timeout=60)
    generate = json.dumps({"text_input": "ROMEO:", "max_new_tokens": 2}).encode()
    urllib.request.urlopen(urllib.request.Request(f"http://{server.http_url}/v2/models/dstool_lm_llm/generate",
                                                  generate), timeout=120).read()


# ---- bad input, the compose profile -------------------------------------------------------------------------------

@pytest.mark.parametrize("steps,needle", [
    ("3-5", "is not A:B"), ("5", "is not A:B"), ("0:3", "outside the run"), ("5:3", "outside the run"),
    ("10:13", "max_steps (12)"),
])
def test_bad_profile_steps(steps, needle, tmp_path):
    one_line_usage_error(cli("train", "--output", str(tmp_path / "run"), "--max-steps", "12", "--profile-steps", steps),
                         needle)
    assert not (tmp_path / "run").exists()


def test_metrics_port_in_use_is_refused_before_any_rank_starts(tmp_path):
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        one_line_usage_error(cli("train", "--output", str(tmp_path / "run"), "--metrics-port", str(port)),
                             f"--metrics-port: port {port} on 0.0.0.0 is already in use")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("compose,targets", [("docker-compose.yml", "compose"), ("docker-compose.cpu.yml", "cpu")])
def test_compose_profile_provisions_prometheus_and_grafana(compose, targets):
    """Profile "observability": Prometheus on the shipped config and this file's targets, Grafana with the datasource
    and both dashboards (the tools' own checks of these files: the two tests below)."""
    services = yaml.safe_load((ROOT / compose).read_text())["services"]
    prometheus, grafana = services["prometheus"], services["grafana"]
    assert prometheus["profiles"] == grafana["profiles"] == ["observability"]
    mounts = {m.split(":")[1]: ROOT / m.split(":")[0] for m in prometheus["volumes"] + grafana["volumes"]}
    assert mounts["/etc/prometheus/prometheus.yml"] == ROOT / "deploy/prometheus/prometheus.yml"
    assert mounts["/etc/prometheus/targets"] == ROOT / "deploy/prometheus/targets" / targets
    assert all(path.exists() for path in mounts.values()), mounts
    provisioning = mounts["/etc/grafana/provisioning"]
    datasource = yaml.safe_load((provisioning / "datasources/prometheus.yml").read_text())["datasources"][0]
    assert datasource["url"] == "${DSTOOL_PROMETHEUS_URL}" and grafana["environment"]["DSTOOL_PROMETHEUS_URL"]
    provider = yaml.safe_load((provisioning / "dashboards/dstool.yml").read_text())["providers"][0]
    assert provider["options"]["path"] == "/etc/dstool/dashboards" and mounts[provider["options"]["path"]] == DASHBOARDS
    for name in ("training", "serving"):
        dashboard = _dashboard(name)
        panels = [p for p in dashboard["panels"] if p["type"] != "row"]
        assert dashboard["uid"] == f"dstool-{name}" and len({p["id"] for p in dashboard["panels"]}) == len(
            dashboard["panels"])
        assert all(p["datasource"]["uid"] == datasource["uid"] and p["targets"] for p in panels)
    for path in (provisioning / "datasources/prometheus.yml", provisioning / "dashboards/dstool.yml"):
        assert yaml.safe_load(path.read_text())["apiVersion"] == 1


@pytest.mark.skipif(not shutil.which("docker-compose"), reason="no docker-compose binary to check the compose files")
@pytest.mark.parametrize("compose", ["docker-compose.yml", "docker-compose.cpu.yml"])
def test_docker_compose_accepts_the_observability_profile(compose):
    proc = subprocess.run(["docker-compose", "-f", str(ROOT / compose), "--profile", "observability", "config", "-q"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.skipif(not shutil.which("promtool"), reason="no promtool binary (Debian: apt-get install prometheus)")
@pytest.mark.parametrize("targets", ["compose", "cpu"])
def test_promtool_accepts_the_shipped_prometheus_config(targets, tmp_path):
    shutil.copy(ROOT / "deploy/prometheus/prometheus.yml", tmp_path)  # the layout inside the container
    shutil.copytree(ROOT / "deploy/prometheus/targets" / targets, tmp_path / "targets")
    proc = subprocess.run(["promtool", "check", "config", str(tmp_path / "prometheus.yml")], capture_output=True,
                          text=True)
    assert proc.returncode == 0 and "WARNING" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr


def test_prometheus_image_passes_hadolint():
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))
    proc = subprocess.run([hadolint, "--no-color", str(ROOT / "deploy/prometheus/Dockerfile")], capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
