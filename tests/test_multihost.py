"""Several hosts for real: a fake cluster of network namespaces on this machine (tests/netns.py; each host has its
own address, hostname, /etc/hosts and sshd, joined by a bridge). Training over ssh (pdsh, the DeepSpeed launcher)
and with torchrun started on each host, a rank SIGKILLed on one host under --max-restarts, a host cut off for good,
host names that resolve to 127.0.1.1, and the doctor on a healthy and on a broken cluster. Needs root."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import netns
import psutil
import pytest

from conftest import FAST, TRAIN_CODE, built_once, cli, dstool, losses, one_line_usage_error

# Same global batch (8) on one host and on two, no lr scaling: the runs must give the same losses.
MH = ["--global-batch-size", "8", "--lr-scaling", "none", "--lr", "3e-3", "--max-steps", "6", "--save-every", "2",
      "--keep-checkpoints", "4", *FAST]
ON_CLUSTER = ["--env", "GLOO_SOCKET_IFNAME=eth0"]
LAUNCHED = ("dstool.train.worker", "deepspeed.launcher", "torch.distributed.run")


@pytest.fixture(scope="module")
def netns_cluster(tmp_path_factory):
    """Three hosts node0..node2, made once for the module and torn down whatever happens."""
    if reason := netns.unavailable():
        pytest.skip(reason)
    c = netns.Cluster(tmp_path_factory.mktemp("cluster"), 3)
    try:
        c.up()
        yield c
    finally:
        c.down()


@pytest.fixture
def cluster(netns_cluster):
    """The cluster; afterwards no rank or launcher is left on it (one a failed test left would hold the ports)."""
    yield netns_cluster
    for pid in _launched(netns_cluster):
        try:
            psutil.Process(pid).kill()
        except psutil.NoSuchProcess:
            pass


@pytest.fixture(scope="module")
def reference(tmp_path_factory, worker_id) -> dict[int, float]:
    """The losses of MH on one host, 2 ranks."""
    return losses(built_once(tmp_path_factory, worker_id, "multihost_reference",
                             lambda out: dstool("train", "--output", str(out), "--nproc", "2", *MH), TRAIN_CODE, MH))


def _on(cluster: netns.Cluster, host: str, *args: str) -> subprocess.Popen:
    """`dstool ARGS` started on `host`."""
    return subprocess.Popen(cluster.on(host, sys.executable, "-m", "dstool.cli", *args), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**cluster.env, "PYTHONUNBUFFERED": "1"})


def _finish(proc: subprocess.Popen, timeout: float = 420) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"no end within {timeout:.0f} s\n--- stdout\n{out[-3000:]}\n--- stderr\n"
                             f"{err[-3000:]}") from None


def _launched(cluster: netns.Cluster) -> dict[int, str]:
    """Ranks and launchers still running on the cluster's hosts: their command lines by PID."""
    found = {}
    for pid in cluster.processes():
        try:
            cmd = " ".join(psutil.Process(pid).cmdline())
        except psutil.NoSuchProcess:
            continue
        if any(name in cmd for name in LAUNCHED):
            found[pid] = cmd[:120]
    return found


def _environ(pid: int) -> dict[str, str]:
    try:
        return psutil.Process(pid).environ()
    except psutil.NoSuchProcess:
        return {}


def _nothing_left(cluster: netns.Cluster, within: float = 60) -> None:
    deadline = time.time() + within
    while (left := _launched(cluster)) and time.time() < deadline:
        time.sleep(0.5)
    assert not left, left


def _wait_for_checkpoint(out: Path, proc: subprocess.Popen, step: int = 2, timeout: float = 420) -> None:
    latest, deadline = out / "checkpoints" / "latest", time.time() + timeout
    while not (latest.is_file() and latest.read_text().strip() == f"step-{step:08d}"):
        assert proc.poll() is None and time.time() < deadline, f"no checkpoint {step}: {proc.communicate()}"
        time.sleep(0.02)


def test_rank_killed_on_one_host_recovers(cluster, reference, tmp_path):
    """torchrun on each host (c10d rendezvous), rank 1 SIGKILLed on node1 after checkpoint 2: both hosts restart
    their ranks, which agree on the store and on the checkpoint, and the loss curve is the uninterrupted one."""
    out = tmp_path / "elastic"
    nodes = [_on(cluster, f"node{r}", "train", "--num-nodes", "2", "--node-rank", str(r), "--master-addr", "node0",
                 "--max-restarts", "1", "--output", str(out), *ON_CLUSTER, *MH) for r in (0, 1)]
    _wait_for_checkpoint(out, nodes[0])
    rank1 = [pid for pid in cluster.processes() if _environ(pid).get("RANK") == "1"]
    assert len(rank1) == 1 and _environ(rank1[0]).get("GROUP_RANK") == "1", rank1
    psutil.Process(rank1[0]).kill()
    (out0, err0), (_, err1) = _finish(nodes[0]), _finish(nodes[1])
    assert [n.returncode for n in nodes] == [0, 0], (err0[-2000:], err1[-2000:])
    restart = next(r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "event" in r)
    assert restart["restart"] == 1 and restart["resumed_from_step"] in (2, 4), restart
    assert "dstool: restart 1: failed after step" in out0
    a = losses(out)
    assert sorted(a) == sorted(reference) and all(a[s] == pytest.approx(reference[s], abs=1e-5) for s in a), a


def test_host_cut_off_ends_the_run_naming_it_and_a_rerun_resumes(cluster, reference, tmp_path):
    """The DeepSpeed launcher starts node1's rank over pdsh/ssh (no --master-addr: the hostfile's first host is node 0;
    it used to be 127.0.0.1, and node1's rank waited for itself without a word). node1's link goes down for good after
    checkpoint 2: within --comm-timeout-s every rank on both hosts stops, `dstool train` says which host went silent,
    and once the link is back the same command resumes: the loss curve is the one of 2 ranks on one host."""
    hostfile = cluster.hostfile(tmp_path / "hostfile", ["node0", "node1"])
    out = tmp_path / "cut"
    args = ["train", "--hostfile", str(hostfile), "--output", str(out), "--comm-timeout-s", "10", *ON_CLUSTER, *MH]
    proc = _on(cluster, "node0", *args)
    _wait_for_checkpoint(out, proc)
    cluster.fault("node1", "down")
    try:
        _, stderr = _finish(proc, timeout=180)
        assert proc.returncode == 1
        lines = [line for line in stderr.splitlines() if line.strip()]
        assert "host node1 (node 1, rank(s) 1-1) went silent" in lines[-1], stderr[-3000:]
        _nothing_left(cluster)  # node1's own ranks gave up on the master as well
    finally:
        cluster.fault("node1", "up")
    stdout, stderr = _finish(_on(cluster, "node0", *args))
    assert "resumed at step" in stdout and "2 rank(s) (2 node(s) x 1, deepspeed, CPU/gloo)" in stdout, \
        (stdout[-2000:], stderr[-2000:])
    launcher_log = (out / "logs" / "launcher.log").read_text()
    assert "node1: " in launcher_log  # pdsh's prefix on what node1 printed
    assert "[INFO]" not in stdout and "[INFO] [launch.py" in launcher_log  # each host's launcher: in its log
    a = losses(out)
    assert sorted(a) == sorted(reference) and all(a[s] == pytest.approx(reference[s], abs=1e-5) for s in a), a
    _nothing_left(cluster)


def test_loopback_host_names_fail_every_node_with_the_fix(cluster, tmp_path):
    """Debian's '127.0.1.1 <hostname>' on both hosts and no GLOO_SOCKET_IFNAME: the rank that cannot connect says
    which variable to set, and the other host's rank stops too (it used to wait for ever)."""
    hostfile = cluster.hostfile(tmp_path / "hostfile", ["node0", "node1"])
    for host in ("node0", "node1"):
        cluster.loopback_hostname(host, True)
    try:
        proc = _on(cluster, "node0", "train", "--hostfile", str(hostfile), "--output", str(tmp_path / "run"), *MH)
        _, stderr = _finish(proc, timeout=300)
        assert proc.returncode == 1
        lines = [line for line in stderr.splitlines() if line.strip()]
        assert "loopback address" in lines[-1] and "GLOO_SOCKET_IFNAME=eth0" in lines[-1], stderr[-3000:]
        _nothing_left(cluster)
    finally:
        for host in ("node0", "node1"):
            cluster.loopback_hostname(host, False)


def _doctor(cluster: netns.Cluster, *args: str) -> tuple[int, dict[str, str]]:
    proc = _on(cluster, "node0", "doctor", *args)
    stdout, stderr = _finish(proc, timeout=300)
    checks = {line.split("] ", 1)[1].split(":", 1)[0]: line for line in stdout.splitlines() if line.startswith("[")}
    assert checks, (stdout, stderr)
    return proc.returncode, checks


def test_doctor_passes_a_healthy_cluster(cluster, tmp_path):
    """node1 answers the version probe over ssh with the same versions (DeepSpeed's accelerator warning, printed
    when it is imported, used to make them differ)."""
    hostfile = cluster.hostfile(tmp_path / "hostfile", ["node0", "node1"])
    code, checks = _doctor(cluster, "--hostfile", str(hostfile), "--output", str(tmp_path / "run"), *ON_CLUSTER)
    assert code == 0 and all(line.startswith("[skip]" if name.startswith("GPU topology") else "[pass]")
                             for name, line in checks.items()), checks
    assert "passwordless ssh works" in checks["ssh node1"] and "node1: python/torch/deepspeed" in checks["versions"]
    assert "every node" in checks["GLOO_SOCKET_IFNAME"] and "output from node1" in checks


def test_doctor_reports_a_broken_cluster(cluster, tmp_path):
    """A host without sshd, a host with another DeepSpeed whose own name resolves to 127.0.1.1 (and no
    GLOO_SOCKET_IFNAME), and an interface only node0 has."""
    fake = tmp_path / "fake-site"  # what node1's ssh sessions import first: another DeepSpeed's metadata
    (fake / "deepspeed-0.0.1.dist-info").mkdir(parents=True)
    (fake / "deepspeed-0.0.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: deepspeed\n"
                                                                 "Version: 0.0.1\n")
    hostfile = cluster.hostfile(tmp_path / "hostfile", ["node0", "node1", "node2"])
    cluster.sshd("node2", "stop")
    cluster.sshd("node1", "start", "-o", f"SetEnv=PYTHONPATH={fake}")
    cluster.loopback_hostname("node1", True)
    cluster.ip("node0", "link", "add", "clus0", "type", "veth", "peer", "name", "clus1")  # (no dummy driver here)
    try:
        code, checks = _doctor(cluster, "--hostfile", str(hostfile), "--output", str(tmp_path / "run"),
                               "--env", "NCCL_SOCKET_IFNAME=clus0")
    finally:
        cluster.ip("node0", "link", "del", "clus0")
        cluster.loopback_hostname("node1", False)
        cluster.sshd("node1", "start")
        cluster.sshd("node2", "start")
    failed = {name for name, line in checks.items() if line.startswith("[FAIL]")}
    assert code == 1 and failed == {"ssh node2", "versions", "NCCL_SOCKET_IFNAME", "host names"}, checks
    assert "does not answer on port 22" in checks["ssh node2"]
    assert "node1: python/torch/deepspeed" in checks["versions"] and " 0.0.1" in checks["versions"]
    assert "on node1 no interface matches clus0" in checks["NCCL_SOCKET_IFNAME"]
    assert "node0" not in checks["NCCL_SOCKET_IFNAME"] and "eth0" in checks["NCCL_SOCKET_IFNAME"]
    assert "node1: node1 -> 127.0.1.1" in checks["host names"] and "node0" not in checks["host names"]
    assert "--env GLOO_SOCKET_IFNAME=eth0" in checks["host names"]


@pytest.mark.parametrize("args,needle", [
    (["--launcher", "torchrun"], "--launcher torchrun starts one node per command"),
    (["--master-addr", "127.0.0.1"], "--master-addr 127.0.0.1 is a loopback address"),
])
def test_hostfile_usage_that_would_hang(args, needle, tmp_path):
    """Refused in one line before anything starts (torchrun used to start node0 alone and wait for ever)."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node0 slots=1\nnode1 slots=1\n")
    one_line_usage_error(cli("train", "--hostfile", str(hostfile), "--output", str(tmp_path / "run"), *args), needle)
    assert not (tmp_path / "run").exists()
