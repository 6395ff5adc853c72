"""A fake cluster on this machine for the multi-host tests: scripts/netns-cluster.sh makes each "host" a network
namespace (own eth0 address, hostname, /etc/hosts and sshd) joined by a bridge in a private switch namespace."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "netns-cluster.sh"


def unavailable() -> str | None:
    """Why no cluster can be made here (not root, no network-namespace capability), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None and not Path("/usr/sbin/ip").exists():
        return None  # a missing package is a set-up error: `up` fails and says so (scripts/setup.sh installs it)
    probe = f"dsprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"no network-namespace capability here ({made.stderr.strip()})"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


class Cluster:
    """`hosts` hosts node0.. under a namespace prefix and 10.x subnet of this process's own."""

    def __init__(self, base: Path, hosts: int):
        self.base, self.hosts = base, [f"node{i}" for i in range(hosts)]
        self.env = dict(os.environ, NETNS_CLUSTER_DIR=str(base), NETNS_CLUSTER_PREFIX=f"dsmh{os.getpid()}",
                        NETNS_CLUSTER_NET=f"10.{200 + os.getpid() % 50}.{os.getpid() // 50 % 250}")

    def _script(self, *args: str, timeout: float = 120) -> str:
        proc = subprocess.run(["bash", str(SCRIPT), *args], env=self.env, capture_output=True, text=True,
                              timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"netns-cluster.sh {' '.join(args)} exited {proc.returncode}: {proc.stderr[-2000:]}")
        return proc.stdout

    def up(self) -> None:
        self._script("up", str(len(self.hosts)))

    def down(self) -> None:
        self._script("down")

    def address(self, host: str) -> str:
        return f"{self.env['NETNS_CLUSTER_NET']}.{int(host.removeprefix('node')) + 1}"

    def on(self, host: str, *argv: str) -> list[str]:
        """The command line that runs `argv` on `host`."""
        return ["bash", str(SCRIPT), "on", host, *argv]

    def run(self, host: str, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(self.on(host, *argv), env=self.env, capture_output=True, text=True, timeout=timeout)

    def fault(self, host: str, what: str) -> None:
        self._script("fault", host, what)

    def sshd(self, host: str, what: str, *sshd_args: str) -> None:
        self._script("sshd", host, what, *sshd_args)

    def loopback_hostname(self, host: str, on: bool) -> None:
        """Debian's '127.0.1.1 <hostname>' line in `host`'s /etc/hosts, or not."""
        self._script("loopback", host, "on" if on else "off")

    def ip(self, host: str, *args: str) -> None:
        """`ip ARGS` inside `host`'s network namespace."""
        subprocess.run(["ip", "-n", f"{self.env['NETNS_CLUSTER_PREFIX']}-{host}", *args], check=True)

    def hostfile(self, path: Path, hosts: list[str]) -> Path:
        path.write_text("".join(f"{h} slots=1\n" for h in hosts))
        return path

    def processes(self) -> list[int]:
        """PIDs inside the hosts' namespaces other than their sshd listeners (ranks, launchers, ssh sessions)."""
        listeners = {int(p.read_text()) for p in self.base.glob("node*/sshd.pid")}
        pids = []
        for h in self.hosts:
            out = subprocess.run(["ip", "netns", "pids", f"{self.env['NETNS_CLUSTER_PREFIX']}-{h}"],
                                 capture_output=True, text=True).stdout
            pids += [int(p) for p in out.split() if int(p) not in listeners]
        return pids
