"""load_tests.launcher's free ports, which need no server: distinct, and released for the server to bind (starting and
stopping `petal serve` is tests/e2e/test_launcher.py), and outside the range of ports the kernel hands out itself."""
from __future__ import annotations

import socket

from load_tests import launcher


def test_free_ports_are_distinct_and_released():
    # 500: ports chosen one bind-and-close at a time repeat among that many almost surely (the kernel's picks are
    # spread over some 28,000), so only sockets held until all are chosen pass this.
    ports = launcher.free_ports(500)
    assert len(set(ports)) == 500
    for port in ports:  # every socket was closed again, so each port is free to bind
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_free_ports_are_outside_the_kernels_ephemeral_range():
    """A port in that range can be taken by any outgoing connection between its choice and the server's bind."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:  # the kernel's own range
        low, high = map(int, f.read().split())
    assert all(not low <= port <= high for port in launcher.free_ports(50))


def test_free_ports_come_from_above_the_range_when_it_starts_low(tmp_path, monkeypatch):
    ranges = tmp_path / "ip_local_port_range"
    ranges.write_text("1024\t50000\n")
    monkeypatch.setattr(launcher, "EPHEMERAL_RANGE_FILE", str(ranges))
    assert all(port > 50000 for port in launcher.free_ports(20))
