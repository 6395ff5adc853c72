"""free_port: a port another process cannot take between its draw and its bind — not the source port of an outgoing
connection (the OS draws those from its own range), not one handed to another process on this machine."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

from dstool import proc

DRAW = "from dstool.proc import free_port; print(*(free_port() for _ in range(40)))"


def _os_range() -> tuple[int, int]:
    low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
    return int(low), int(high)


def test_a_port_is_drawn_below_the_range_outgoing_connections_take_theirs_from():
    low, _ = _os_range()
    ports = [proc.free_port() for _ in range(20)]
    assert all(proc.PORTS_FROM <= p < low for p in ports), (ports, low)
    with socket.socket() as s:  # and it can be listened on
        s.bind(("127.0.0.1", ports[0]))
        s.listen()


def test_processes_drawing_at_once_are_never_handed_the_same_port():
    runs = [subprocess.Popen([sys.executable, "-c", DRAW], stdout=subprocess.PIPE, text=True) for _ in range(4)]
    ports = [int(p) for r in runs for p in r.communicate(timeout=60)[0].split()]
    assert len(ports) == 160 and len(set(ports)) == 160, sorted(ports)


def test_a_ledger_that_cannot_be_used_still_gives_a_port(tmp_path, monkeypatch):
    monkeypatch.setattr(proc.tempfile, "gettempdir", lambda: str(tmp_path / "missing"))
    port = proc.free_port()
    assert proc.PORTS_FROM <= port < _os_range()[0]


def test_a_port_with_offsets_has_them_free_below_the_range_and_handed_out_with_it():
    """A Redis Cluster node's bus port is its port + 10000: both drawn, both bindable, both in the ledger."""
    port = proc.free_port(also=(10000,))
    assert proc.PORTS_FROM <= port and port + 10000 < _os_range()[0]
    for taken in (port, port + 10000):
        with socket.socket() as s:
            s.bind(("127.0.0.1", taken))
    with proc._ledger() as handed:
        assert port in handed and port + 10000 in handed
