"""serving.launcher's free ports, which need no server: distinct, and released for the server to bind (starting and
stopping `petal serve` is tests/e2e/test_launcher.py)."""
from __future__ import annotations

import socket

from serving import launcher


def test_free_ports_are_distinct_and_released():
    # 500: ports chosen one bind-and-close at a time repeat among that many almost surely (the kernel's picks are
    # spread over some 28,000), so only sockets held until all are chosen pass this.
    ports = launcher.free_ports(500)
    assert len(set(ports)) == 500
    for port in ports:  # every socket was closed again, so each port is free to bind
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
