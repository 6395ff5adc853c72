"""`dstool doctor`: preflight checks for a training launch, one line each with pass/fail and the fix.

Versions equal on every node, passwordless ssh to remote hosts, the master port free, the network
interfaces named in NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME present on every node, no node whose own name
resolves to a loopback address (gloo would hand that address to the others), GPUs matching the hostfile
slots, the world size factoring into the requested PP x TP x DP and EP with tensor-parallel groups inside a node,
each node's GPU interconnect (NVLink or PCIe, through NVML) for those groups, the output folder writable from every
node, and a gloo all-reduce across local processes with its measured bandwidth. A check passes only on evidence (every
node's answer): one it could not make is [skip] with the reason, or [FAIL]; [warn] passes with a caveat.
"""

from __future__ import annotations

import inspect
import ipaddress
import json
import math
import os
import shlex
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import psutil

from dstool.train import launch
from dstool.train.layout import Layout


def gpu_topology() -> dict:
    """This node's NVIDIA GPUs through NVML: {"gpus": n, "links": active NVLinks per GPU, "ancestors": the NVML
    common-ancestor level (NVML_TOPOLOGY_*) of each pair}, or {"gpus": 0, "why": ...}. Runs in the probe: imports
    nothing of dstool."""
    try:
        import pynvml  # noqa: PLC0415 (the probe runs this function alone on each host, where nvidia-ml-py may be missing)
    except ImportError:
        return {"gpus": 0, "why": "no NVML here: nvidia-ml-py (pynvml) is not installed"}
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        return {"gpus": 0, "why": f"no NVIDIA GPU/NVML here ({e})"}

    def active(handle):
        count = 0
        for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
            try:
                count += pynvml.nvmlDeviceGetNvLinkState(handle, link) == pynvml.NVML_FEATURE_ENABLED
            except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_InvalidArgument):  # no NVLink; past its links
                pass
        return count

    try:
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        return {"gpus": len(handles), "links": [active(h) for h in handles],
                "ancestors": [[pynvml.nvmlDeviceGetTopologyCommonAncestor(a, b) if i != j else 0
                               for j, b in enumerate(handles)] for i, a in enumerate(handles)]}
    except pynvml.NVMLError as e:
        return {"gpus": 0, "why": f"NVML could not read the GPU topology here ({e})"}
    finally:
        pynvml.nvmlShutdown()


# Run on every node (here too): one marker line of JSON. Versions come from the installed packages' metadata, so
# nothing is imported that could print into the output (DeepSpeed's accelerator warning goes to stdout).
PROBE = inspect.getsource(gpu_topology) + r"""
import json, socket, sys
from importlib.metadata import version
def v(name):
    try:
        return version(name)
    except Exception:
        return "missing"
name = socket.gethostname()
try:
    address = socket.gethostbyname(name)
except OSError:
    address = None
try:
    import psutil
    ifs = {n: [a.address for a in al if a.family == socket.AF_INET] for n, al in psutil.net_if_addrs().items()}
except ImportError:
    ifs = {n: [] for _, n in socket.if_nameindex()}
print("DSTOOL-PROBE " + json.dumps({"versions": f"{sys.version.split()[0]} {v('torch')} {v('deepspeed')}",
                                    "hostname": name, "address": address, "interfaces": ifs,
                                    "topology": gpu_topology()}))
"""
PROBE_MARKER = "DSTOOL-PROBE "
ALLREDUCE_MB = 16
# NVML_TOPOLOGY_* levels: how far apart two GPUs sit on the PCIe tree
TOPOLOGY = {0: "same board", 10: "one PCIe switch", 20: "several PCIe switches", 30: "host bridge",
            40: "NUMA node", 50: "system (across CPU sockets)"}


@dataclass
class Check:
    name: str
    ok: bool | None  # None: not checked (skip), the reason in `detail`
    detail: str
    fix: str = ""
    warn: bool = False  # passes, with a caveat in `detail`

    def line(self) -> str:
        fix = f" -> fix: {self.fix}" if self.fix else ""
        mark = "skip" if self.ok is None else "FAIL" if not self.ok else "warn" if self.warn else "pass"
        return f"[{mark}] {self.name}: {self.detail}{fix}"


def is_local(host: str) -> bool:
    return host in ("localhost", "127.0.0.1", "::1", socket.gethostname(), socket.getfqdn())


def _ssh(host: str, command: str, timeout: float = 15) -> subprocess.CompletedProcess:
    return subprocess.run(["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5", host, command],
                          capture_output=True, text=True, timeout=timeout)


def check_ssh(host: str) -> Check:
    name = f"ssh {host}"
    if is_local(host):
        return Check(name, True, "local host, no ssh needed")
    reason = launch.unreachable(host)
    if reason:
        return Check(name, False, reason, f"fix the name in the hostfile (or /etc/hosts, DNS) and check {host} is up")
    try:
        proc = _ssh(host, "true")
    except FileNotFoundError:
        return Check(name, False, "no ssh client on this machine", "install openssh-client")
    except subprocess.TimeoutExpired:
        return Check(name, False, "ssh timed out",
                     f"check that sshd runs on {host} and a firewall lets port 22 through")
    if proc.returncode != 0:
        err = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
        return Check(name, False, f"passwordless ssh failed ({err})",
                     f"ssh-keygen -t ed25519 (once), then ssh-copy-id {host}, then 'ssh {host} true' once to accept "
                     "its host key")
    return Check(name, True, "passwordless ssh works")


def probe(host: str) -> dict | str:
    """What PROBE finds on `host` (here without ssh), or why it gave nothing."""
    argv = [sys.executable, "-c", PROBE]
    try:
        proc = (subprocess.run(argv, capture_output=True, text=True, timeout=60) if is_local(host)
                else _ssh(host, shlex.join(argv), timeout=60))
    except subprocess.TimeoutExpired:
        return "no answer within 60 s"
    for line in proc.stdout.splitlines():
        if line.startswith(PROBE_MARKER):
            return json.loads(line[len(PROBE_MARKER):])
    return f"no {sys.executable} there" if proc.returncode == 127 else \
        (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]


def _unanswered(probes: dict[str, dict | str], hosts: list[str]) -> dict[str, str]:
    """The hosts without a probe answer, and why: ssh did not reach them, or the probe failed there."""
    return {h: "no ssh" if h not in probes else str(probes[h]) for h in hosts if not isinstance(probes.get(h), dict)}


def _not_checked(probes: dict[str, dict | str], hosts: list[str]) -> str:
    missing = _unanswered(probes, hosts)
    if len(missing) == len(hosts):
        return "no node answered the probe (" + "; ".join(f"{h}: {why}" for h, why in missing.items()) + ")"
    return "; ".join(f"{h}: not checked ({why})" for h, why in missing.items())


def check_versions(probes: dict[str, dict | str], hosts: list[str]) -> Check:
    """Python, torch and DeepSpeed versions equal on every node; a reached node whose probe failed fails (the
    launcher runs the same interpreter there)."""
    answers = {h: p["versions"] for h, p in probes.items() if isinstance(p, dict)}
    failed = {h: p for h, p in probes.items() if not isinstance(p, dict)}
    detail = "; ".join([f"{h}: python/torch/deepspeed {v}" for h, v in answers.items()]
                       + ([_not_checked(probes, hosts)] if len(answers) < len(hosts) else []))
    if failed or len(set(answers.values())) > 1:
        local = next((v for h, v in answers.items() if is_local(h)), None)
        here = f" (this node: {local})" if local else ""
        run_it = f", and {sys.executable} runnable on {', '.join(failed)}" if failed else ""
        return Check("versions", False, detail, f"install the same versions on every node{here}{run_it}, e.g. one "
                     "venv on a shared path")
    return Check("versions", None if len(answers) < len(hosts) else True, detail)


def check_hostnames(probes: dict[str, dict | str], hosts: list[str], env: dict[str, str], on_gpu: bool) -> Check:
    """Several nodes: none whose own name resolves to a loopback address or to none (gloo then falls back to the
    loopback device), unless the ranks' socket interface is named (gloo takes its address from the host name; NCCL
    picks an interface itself)."""
    var = "NCCL_SOCKET_IFNAME" if on_gpu else "GLOO_SOCKET_IFNAME"
    if len(hosts) < 2:
        return Check("host names", True, "one node: loopback addresses are fine")
    if env.get("GLOO_SOCKET_IFNAME") or (on_gpu and env.get("NCCL_SOCKET_IFNAME")):
        return Check("host names", True, "the socket interface is named: the ranks use it whatever the host names "
                     "resolve to")
    bad = {h: p for h, p in probes.items() if isinstance(p, dict) and (p["address"] is None or
                                                                        _is_loopback(p["address"]))}
    if not bad:
        if _unanswered(probes, hosts):
            seen = [f"{h}: {p['hostname']} -> {p['address']}" for h, p in probes.items() if isinstance(p, dict)]
            return Check("host names", None, "; ".join([*seen, _not_checked(probes, hosts)]))
        return Check("host names", True, "every node's name resolves to a non-loopback address")
    named = "; ".join(f"{h}: {p['hostname']} -> {p['address'] or 'no address'}" for h, p in bad.items())
    cluster_ifs = sorted({n for p in bad.values() for n, addrs in p["interfaces"].items()
                          if any(not _is_loopback(a) for a in addrs)})
    example = cluster_ifs[0] if cluster_ifs else "eth0"
    return Check("host names", False, f"{named} (a loopback address, e.g. Debian's '127.0.1.1 <hostname>' line in "
                 "/etc/hosts, or none: gloo would hand the loopback address to the other nodes, whose connections "
                 "then fail or hang)",
                 f"set {var} to the cluster interface on every node, e.g. --env {var}={example} (interfaces with an "
                 f"address there: {', '.join(cluster_ifs) or 'none'}), or map the name to the host's cluster address")


def _is_loopback(address: str | None) -> bool:
    return address is not None and ipaddress.ip_address(address).is_loopback


def check_port(addr: str, port: int) -> Check:
    name = f"master port {port}"
    if not (is_local(addr) or _is_own_address(addr)):
        return Check(name, None, f"not checked: the master {addr} is another machine (run dstool doctor there)")
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1" if is_local(addr) else "0.0.0.0", port))
        except OSError as e:
            users = [c.pid for c in psutil.net_connections("tcp") if c.laddr and c.laddr.port == port and c.pid]
            who = f" by pid {users[0]}" if users else ""
            return Check(name, False, f"in use{who} ({e.strerror})", "pass --master-port with a free port, or stop "
                         "the process holding it")
    return Check(name, True, "free")


def _is_own_address(addr: str) -> bool:
    return any(a.address == addr for al in psutil.net_if_addrs().values() for a in al)


def check_interfaces(env: dict[str, str], probes: dict[str, dict | str], hosts: list[str]) -> list[Check]:
    """The interfaces NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME name, on every node that answered the probe (the
    others: not checked)."""
    interfaces = {h: sorted(p["interfaces"]) for h, p in probes.items() if isinstance(p, dict)}
    checks = []
    for var in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        value = env.get(var)
        if not value:
            checks.append(Check(var, True, "not set (the library picks an interface)"))
            continue
        missing = {h: [w for w in _interface_patterns(value) if not any(_if_matches(w, i) for i in present)]
                   for h, present in interfaces.items()}
        missing = {h: m for h, m in missing.items() if m}
        if missing:
            where = "; ".join([f"on {h} no interface matches {', '.join(m)} (there: {', '.join(interfaces[h])})"
                               for h, m in missing.items()]
                              + ([_not_checked(probes, hosts)] if _unanswered(probes, hosts) else []))
            choices = sorted(set.intersection(*(set(i) for i in interfaces.values())))
            checks.append(Check(var, False, f"{var}={value}: {where}",
                                f"set {var} to an interface every node has: {', '.join(choices) or 'none is common'}"))
        elif _unanswered(probes, hosts):
            seen = f" matches an interface on {', '.join(interfaces)};" if interfaces else ":"
            checks.append(Check(var, None, f"{var}={value}{seen} {_not_checked(probes, hosts)}"))
        else:
            checks.append(Check(var, True, f"{var}={value} matches an interface on "
                                f"{'every node' if len(interfaces) > 1 else next(iter(interfaces))}"))
    return checks


def _interface_patterns(value: str) -> list[str]:
    """NCCL syntax: comma list of prefixes, '=' for an exact name; '^' excludes (nothing to check)."""
    return [w for w in (p.strip() for p in value.split(",")) if w and not w.startswith("^")]


def _if_matches(pattern: str, name: str) -> bool:
    return name == pattern[1:] if pattern.startswith("=") else name.startswith(pattern)


def check_gpus(hosts: dict[str, int] | None) -> Check:
    """This node's GPUs against its hostfile slots (`hosts`: the hostfile; None: no hostfile)."""
    import torch

    slots = next((s for h, s in hosts.items() if is_local(h)), None) if hosts else None
    if hosts and slots is None:
        return Check("GPUs", None, "not checked: this node is not in the hostfile (run dstool doctor on a node)")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        return Check("GPUs", True, "no GPU visible on this node: training runs on CPU with gloo")
    if slots is not None and slots > count:
        return Check("GPUs", False, f"{count} GPU(s) visible, the hostfile gives this node slots={slots}",
                     f"set slots={count} in the hostfile, or check CUDA_VISIBLE_DEVICES")
    return Check("GPUs", True, f"{count} visible on this node" + (f", hostfile slots={slots}" if slots else ""))


def check_layout(hosts: dict[str, int], pipeline: int, tensor: int, expert: int, source: str) -> Check:
    """The world (`hosts`' slots summed) split by Layout's rule; ranks fill nodes in order, TP fastest, so each node's
    slots must be a multiple of TP (a TP group all-reduces every layer: NVLink, within a node); EP groups across nodes
    are a warning (their all-to-all crosses the network)."""
    world = sum(hosts.values())
    layout = Layout(world, pipeline, tensor, expert)
    if why := layout.problem():
        return Check("layout", False, why, f"change {source} or the parallel degrees")
    common = math.gcd(*hosts.values())
    if split := [f"{h} slots={s}" for h, s in hosts.items() if s % tensor]:
        return Check("layout", False, f"TP{tensor} groups would span nodes ({', '.join(split)}): tensor parallelism "
                     "all-reduces every layer and needs the GPUs of one node",
                     f"give every node a multiple of {tensor} slots, or a --tensor-parallel that divides {common}")
    detail = f"{world} ranks = {layout.describe()}"
    if split := [f"{h} slots={s}" for h, s in hosts.items() if s % expert]:
        return Check("layout", True, f"{detail}; EP{expert} groups span nodes ({', '.join(split)}): their all-to-all "
                     "crosses the network", f"an --expert-parallel that divides {common} keeps them in a node",
                     warn=True)
    return Check("layout", True, detail)


def check_topology(probes: dict[str, dict | str], hosts: dict[str, int], tensor: int) -> list[Check]:
    """Per node, the interconnect of the GPUs its TP groups use (local rank N on GPU N): NVLink when each GPU of a
    group has active links, else PCIe (the farthest common ancestor of a pair); a warning for TP > 1 over PCIe."""
    checks = []
    for host, slots in hosts.items():
        name = f"GPU topology {host}"
        answer = probes.get(host)
        if not isinstance(answer, dict):
            checks.append(Check(name, None, f"not checked ({'no ssh' if answer is None else answer})"))
            continue
        topology = answer["topology"]
        if not topology["gpus"]:
            checks.append(Check(name, None, f"{topology['why']}: no GPU interconnect to check"))
            continue
        used = min(slots, topology["gpus"])
        groups = [range(g, min(g + tensor, used)) for g in range(0, used, tensor)] if tensor > 1 else [range(used)]
        links = topology["links"][:used]
        far = max((topology["ancestors"][a][b] for g in groups for a in g for b in g if a < b), default=None)
        pcie = f"PCIe only (common ancestor: {TOPOLOGY.get(far, far)})" if far is not None else "no peer GPU"
        summary = f"{topology['gpus']} GPUs" + (f" ({used} in use: slots={slots})" if used < topology["gpus"] else "")
        if all(links):
            summary += (f", NVLink ({links[0]} active links each)" if len(set(links)) == 1
                        else f", NVLink ({min(links)}-{max(links)} active links)")
        else:
            summary += (f", {pcie}" if not any(links)
                        else f", NVLink on {sum(map(bool, links))} of them, the others {pcie}")
        if tensor > 1 and not all(links):
            checks.append(Check(name, True, f"{summary}; TP{tensor} all-reduces every layer over PCIe",
                                "put tensor parallelism on NVLink GPUs, or use --pipeline-stages / ZeRO data "
                                "parallelism on this node", warn=True))
        else:
            checks.append(Check(name, True, summary + (f"; TP{tensor} groups on NVLink" if tensor > 1 else "")))
    return checks


def check_output(output: str, hosts: list[str], reachable: set[str]) -> list[Check]:
    """Write, rename and remove a file in the output folder (and over ssh from every remote host)."""
    folder = Path(output).absolute()
    name = f"output {folder}"
    probe = f".dstool-doctor-{uuid.uuid4().hex[:8]}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / (probe + ".tmp")).write_text("ok")
        os.replace(folder / (probe + ".tmp"), folder / probe)
        (folder / probe).unlink()
    except OSError as e:
        return [Check(name, False, f"not writable here ({e.strerror}: {e.filename})",
                      "choose a folder you can write (on a filesystem every node mounts) with --output")]
    checks = [Check(name, True, "writable here")]
    for h in hosts:
        if is_local(h):
            continue
        if h not in reachable:
            checks.append(Check(f"output from {h}", None, "not checked (no ssh)"))
            continue
        q = shlex.quote(str(folder / probe))
        try:
            proc = _ssh(h, f"mkdir -p {shlex.quote(str(folder))} && touch {q} && rm {q}")
        except subprocess.TimeoutExpired:
            checks.append(Check(f"output from {h}", False, "no answer within 15 s", f"check that {folder} on {h} is "
                                "not a hung mount"))
            continue
        checks.append(Check(f"output from {h}", proc.returncode == 0, "writable" if proc.returncode == 0 else
                            "not writable there", "" if proc.returncode == 0 else
                            f"mount the same shared folder at {folder} on {h}"))
    return checks


def check_allreduce(procs: int, timeout: float = 120) -> Check:
    """`procs` local gloo processes all-reduce a 16 MB tensor; bus bandwidth as in nccl-tests."""
    name = f"all-reduce ({procs} local gloo processes)"
    port = launch.free_port()
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(procs), OMP_NUM_THREADS="1")
    workers = [subprocess.Popen([sys.executable, "-m", "dstool.train.doctor", "--allreduce-rank", str(r)],
                                env=dict(env, RANK=str(r)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for r in range(procs)]
    try:
        results = [w.communicate(timeout=timeout) for w in workers]
    except subprocess.TimeoutExpired:
        for w in workers:
            w.kill()
        return Check(name, False, f"no result within {timeout:.0f} s", "check that localhost TCP is not firewalled")
    if any(w.returncode for w in workers):
        err = next(r[1] for r, w in zip(results, workers) if w.returncode).strip().splitlines()[-1:]
        return Check(name, False, f"failed: {err[0] if err else 'no output'}", "see the error above; check "
                     "GLOO_SOCKET_IFNAME and that torch.distributed works")
    seconds = float(results[0][0].split()[0])
    nbytes = ALLREDUCE_MB * 2**20
    bus = 2 * (procs - 1) / procs * nbytes / seconds / 1e9
    return Check(name, True, f"{ALLREDUCE_MB} MB in {seconds * 1e3:.1f} ms: bus bandwidth {bus:.2f} GB/s")


def _allreduce_worker(rank: int) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
    x = torch.ones(ALLREDUCE_MB * 2**20 // 4)
    dist.all_reduce(x)  # warm-up: connections and buffers
    if x[0].item() != dist.get_world_size():
        raise SystemExit(f"all-reduce gave {x[0].item()}, expected {dist.get_world_size()}")
    times = []
    for _ in range(3):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(x)
        times.append(time.perf_counter() - t0)
    print(sorted(times)[1])
    dist.destroy_process_group()


def run(hostfile: str | None, master_addr: str | None, master_port: int, output: str, nproc: int,
        env: dict[str, str], pipeline: int = 1, tensor: int = 1, expert: int = 1, echo=print) -> int:
    """Run every check, print one line each; 0 when none fails, 1 otherwise."""
    import torch

    hosts = launch.parse_hostfile(hostfile) if hostfile else {"localhost": nproc}
    checks = [check_ssh(h) for h in hosts]
    reachable = {c.name.split(" ", 1)[1] for c in checks if c.ok}
    probes = {h: probe(h) for h in hosts if h in reachable}
    environment = {**os.environ, **env}
    checks.append(check_versions(probes, list(hosts)))
    checks.append(check_port(master_addr or (next(iter(hosts)) if hostfile else "127.0.0.1"), master_port))
    checks += check_interfaces(environment, probes, list(hosts))
    checks.append(check_hostnames(probes, list(hosts), environment, torch.cuda.is_available()))
    checks.append(check_gpus(hosts if hostfile else None))
    checks.append(check_layout(hosts, pipeline, tensor, expert, "the hostfile slots" if hostfile else "--nproc"))
    checks += check_topology(probes, hosts, tensor)
    checks += check_output(output, list(hosts), reachable)
    checks.append(check_allreduce(max(2, min(nproc, os.cpu_count() or 2))))
    return summarize(checks, echo)


def summarize(checks: list[Check], echo=print) -> int:
    """Print each check's line and the counts; 1 when one failed, else 0 (a skip or a warning is no failure)."""
    for c in checks:
        echo(c.line())
    passed, failed = sum(c.ok is True and not c.warn for c in checks), sum(c.ok is False for c in checks)
    warned = sum(c.ok is True and c.warn for c in checks)
    skipped = len(checks) - passed - warned - failed
    echo(f"doctor: {passed}/{len(checks)} checks pass" + (f", {warned} warn" if warned else "")
         + (f", {skipped} skipped" if skipped else "") + (f", {failed} fail" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--allreduce-rank":
        _allreduce_worker(int(sys.argv[2]))
