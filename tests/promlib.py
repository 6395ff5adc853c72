"""A real Prometheus for the tests: started on the shipped deploy/prometheus/prometheus.yml (intervals cut to 1 s)
with the tests' own targets files, answering PromQL as Grafana would send it."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import yaml

from dstool.proc import free_port

ROOT = Path(__file__).resolve().parent.parent
PROMETHEUS = shutil.which("prometheus")


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


class Prometheus:
    """A real Prometheus on deploy/prometheus/prometheus.yml (intervals cut to 1 s) with our targets files: job name
    -> the addresses it scrapes (training, gateway, triton)."""

    def __init__(self, folder: Path, targets: dict[str, list[str]]):
        assert PROMETHEUS is not None, "no prometheus binary (Debian: apt-get install prometheus)"
        config = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
        config["global"]["scrape_interval"] = "1s"
        for job in config["scrape_configs"]:
            job["scrape_interval"] = "1s"
        (folder / "targets").mkdir(parents=True)
        (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
        for name in ("training", "gateway", "triton"):
            (folder / "targets" / f"{name}.yml").write_text(yaml.safe_dump([{"targets": targets.get(name, [])}]))
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = open(folder / "prometheus.log", "w")
        self.proc = subprocess.Popen([PROMETHEUS, f"--config.file={folder / 'prometheus.yml'}",
                                      f"--storage.tsdb.path={folder / 'data'}",
                                      f"--web.listen-address={self.url.removeprefix('http://')}"],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 60
        while True:
            try:
                scrape(self.url + "/-/ready")
                break
            except OSError:
                assert self.proc.poll() is None and time.time() < deadline, (folder / "prometheus.log").read_text()
                time.sleep(0.2)

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        params = {"query": expr, **({"time": str(at)} if at is not None else {})}
        answer = json.loads(scrape(f"{self.url}/api/v1/query?{urllib.parse.urlencode(params)}"))
        assert answer["status"] == "success", (expr, answer)
        return answer["data"]["result"]

    def label_values(self, label: str) -> list[str]:
        """What Grafana's label_values(LABEL) lists."""
        answer = json.loads(scrape(f"{self.url}/api/v1/label/{label}/values"))
        assert answer["status"] == "success", (label, answer)
        return answer["data"]

    def targets_up(self, job: str) -> int:
        answer = json.loads(scrape(f"{self.url}/api/v1/targets"))["data"]["activeTargets"]
        return sum(t["health"] == "up" for t in answer if t["labels"]["job"] == job)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()
