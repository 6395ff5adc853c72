"""How ranks are started: torchrun (one node, or each node by hand) or the DeepSpeed launcher (hostfile)."""

from __future__ import annotations

import ipaddress
import math
import os
import re
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from dstool import log as dlog
from dstool.errors import UsageError
from dstool.proc import free_port
from dstool.train.config import TrainConfig

_HOST_LINE = re.compile(r"^(\S+)\s+slots=(\d+)\s*$")


def parse_hostfile(path: str) -> dict[str, int]:
    """DeepSpeed's hostfile format, 'host slots=N' per line, '#' comments; one-line errors."""
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"hostfile {path} does not exist")
    hosts: dict[str, int] = {}
    for n, raw in enumerate(p.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = _HOST_LINE.match(line)
        if not m or int(m.group(2)) < 1:
            raise UsageError(f"hostfile {path} line {n} '{raw.strip()}' does not parse: write 'HOST slots=N'")
        if m.group(1) in hosts:
            raise UsageError(f"hostfile {path} lists host {m.group(1)} twice (line {n})")
        hosts[m.group(1)] = int(m.group(2))
    if not hosts:
        raise UsageError(f"hostfile {path} names no host: write 'HOST slots=N' per line")
    return hosts


@dataclass
class Topology:
    launcher: str  # torchrun | deepspeed
    nodes: int
    procs_per_node: int
    world: int
    hosts: dict[str, int] | None
    master_port: int
    master_addr: str = "127.0.0.1"


def plan(cfg: TrainConfig) -> Topology:
    """World size and launcher, decided (and checked) before any rank starts."""
    hosts = None
    if cfg.hostfile:
        hosts = parse_hostfile(cfg.hostfile)
        if cfg.num_nodes > 1:
            if cfg.num_nodes > len(hosts):
                raise UsageError(f"num_nodes {cfg.num_nodes} exceeds the {len(hosts)} hosts in {cfg.hostfile}")
            hosts = dict(list(hosts.items())[:cfg.num_nodes])
        if cfg.node_rank is not None and cfg.node_rank >= len(hosts):
            raise UsageError(f"node_rank {cfg.node_rank} is not below the {len(hosts)} hosts in {cfg.hostfile}")
        if len(set(hosts.values())) != 1:
            raise UsageError(f"hostfile {cfg.hostfile} gives hosts different slot counts; use the same on every node")
        launcher = "torchrun" if cfg.launcher == "torchrun" else "deepspeed"
        nodes, per_node = len(hosts), next(iter(hosts.values()))
        first = next(iter(hosts))
        if launcher == "torchrun" and nodes > 1 and cfg.node_rank is None:  # torchrun starts this node only
            raise UsageError(f"--launcher torchrun starts one node per command: run it on every host of {cfg.hostfile} "
                             f"with --node-rank R (0 on {first}), or drop --launcher torchrun to start them all over "
                             "ssh with the DeepSpeed launcher")
        if cfg.master_addr and _loopback(cfg.master_addr) and not _single_local_host(hosts):
            raise UsageError(f"--master-addr {cfg.master_addr} is a loopback address the other hosts of "
                             f"{cfg.hostfile} cannot reach: pass node 0's address, or leave it out ({first}, the "
                             "hostfile's first host)")
    else:
        if cfg.launcher == "deepspeed" and cfg.num_nodes > 1:
            raise UsageError("the DeepSpeed launcher needs --hostfile for several nodes")
        launcher = "deepspeed" if cfg.launcher == "deepspeed" else "torchrun"
        nodes, per_node = cfg.num_nodes, cfg.nproc
        if nodes > 1 and cfg.node_rank is None:
            raise UsageError("several nodes without a hostfile: start each node with --node-rank and --master-addr")
    if cfg.max_restarts and launcher == "deepspeed":
        raise UsageError("--max-restarts runs under torchrun's elastic agent: add --launcher torchrun (start each "
                         "node with --node-rank) or drop --max-restarts")
    if launcher == "deepspeed" and hosts and cfg.node_rank is None and not _single_local_host(hosts):
        for host in hosts:  # the DeepSpeed launcher will ssh to every host: fail now, in one line
            if reason := unreachable(host):
                raise UsageError(f"{reason}, named in hostfile {cfg.hostfile}: fix the hostfile (or DNS) or run "
                                 f"'dstool doctor --hostfile {cfg.hostfile}'")
    port = cfg.master_port or (free_port() if nodes == 1 else 29500)
    master = cfg.master_addr or (next(iter(hosts)) if hosts and not _single_local_host(hosts) else "127.0.0.1")
    return Topology(launcher, nodes, per_node, nodes * per_node, hosts, port, master)


def command(cfg: TrainConfig, topo: Topology, run_file: Path) -> list[str]:
    """The launcher command line that starts this node's ranks of `dstool.train.worker`."""
    worker = ["dstool.train.worker", str(run_file)]
    if topo.launcher == "deepspeed":
        cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--master_addr", topo.master_addr,
               "--master_port", str(topo.master_port), "--no_local_rank", "--module",
               "--log_level", "info" if dlog.verbose() else "warning"]  # its INFO lines: with -v only
        if cfg.hostfile:
            cmd += ["--hostfile", cfg.hostfile, "--num_nodes", str(topo.nodes)]
            if cfg.node_rank is not None or _single_local_host(topo.hosts):
                cmd += ["--no_ssh", "--node_rank", str(cfg.node_rank or 0)]
        else:
            cmd += ["--num_gpus", str(topo.procs_per_node)]
        return cmd + worker
    # A SIGUSR1 sent to every process (SLURM) must not kill the agent, and a signalled agent gives the ranks the
    # grace period to checkpoint (train/preempt.py) before it kills them.
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={topo.procs_per_node}",
           f"--nnodes={topo.nodes}", f"--max_restarts={cfg.max_restarts}",
           "--signals_to_handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
           f"--shutdown_timeout={math.ceil(cfg.preempt_grace_s)}"]
    if cfg.max_restarts and topo.nodes > 1:  # every node's agent must restart together: c10d rendezvous
        cmd += ["--rdzv_backend=c10d", f"--rdzv_endpoint={topo.master_addr}:{topo.master_port}",
                f"--rdzv_id=dstool-{Path(cfg.output).name}"]
    else:
        cmd += [f"--node_rank={cfg.node_rank or 0}", f"--master_addr={topo.master_addr}",
                f"--master_port={topo.master_port}"]
    return cmd + ["-m", *worker]


def unreachable(host: str, port: int = 22, timeout: float = 3.0) -> str | None:
    """Why `host` cannot be reached for ssh (name does not resolve, port closed), or None."""
    try:
        socket.getaddrinfo(host, port)
    except socket.gaierror:
        return f"host {host} does not resolve"
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as e:
        return f"host {host} does not answer on port {port} ({e.strerror or 'timed out'})"
    return None


def _loopback(addr: str) -> bool:
    try:
        return addr == "localhost" or ipaddress.ip_address(addr).is_loopback
    except ValueError:  # a host name
        return False


def _single_local_host(hosts: dict[str, int] | None) -> bool:
    return hosts is not None and len(hosts) == 1 and next(iter(hosts)) in ("localhost", "127.0.0.1",
                                                                           socket.gethostname())


def environment(cfg: TrainConfig, topo: Topology, on_gpu: bool) -> dict[str, str]:
    """The ranks' environment: the config's `env` (NCCL_* and friends) and sane CPU threading."""
    env = dict(os.environ)
    env.update(cfg.env)
    if not on_gpu:
        env.setdefault("DS_ACCELERATOR", "cpu")
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // topo.procs_per_node)))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if topo.launcher == "deepspeed" and topo.nodes > 1 and cfg.node_rank is None:
        # pdsh's ssh sessions: one to a host cut off for good ends (the ranks' watchdog has stopped them by then);
        # a shorter outage does not end it (train/watchdog.py)
        alive = f"-o ServerAliveInterval=5 -o ServerAliveCountMax={math.ceil(cfg.comm_timeout_s / 5) + 1}"
        env["PDSH_SSH_ARGS_APPEND"] = f"{env.get('PDSH_SSH_ARGS_APPEND', '')} {alive}".strip()
    if cfg.max_restarts and topo.nodes > 1:
        # a fresh store for the ranks from every rendezvous round, at an address all nodes agree on (the agents'
        # shared store would hold the last attempt's keys under prefixes the nodes number differently: worker.py)
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return env
