"""Whether this server may take its ports, decided before anything loads.

gRPC binds with SO_REUSEPORT so that the workers share --port, which means a second server on the first's --port
would not fail: it would silently take half of the first's connections, serving its own models. A listener is seen
by a bind without SO_REUSEPORT; a `petal serve` still loading its models, whose workers have not bound --port yet,
is seen by the claim every server holds on its --port from start to exit (`claim_grpc_port`). gunicorn would only
retry a taken REST port for 5 s.
"""
from __future__ import annotations

import errno
import socket
import sys

from serving.options.config import ProtocolOptions, bind_address


def taken_ports(protocols: ProtocolOptions) -> list[str]:
    """What this server would listen on that something on the machine already listens on."""
    ports = [("REST", "--rest_api_port", protocols.rest_api_port)]
    ports += [("gRPC", "--port", protocols.port)] if protocols.port else []
    return [f"the {name} port {bind_address(protocols.host, port)} is in use (another server listens there); "
            f"give {flag} another port" for name, flag, port in ports if _listened_on(protocols.host, port)]


def _listened_on(host: str, port: int) -> bool:
    """Whether a bind without SO_REUSEPORT fails for want of the address (a listener holds it). Any other failure
    (a host that does not resolve, a privileged port) is left for the server's own bind to report."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)[0]
    except OSError:
        return False
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed connection's TIME_WAIT holds nothing
        try:
            probe.bind(address)
        except OSError as error:
            return error.errno == errno.EADDRINUSE
    return False


def claim_grpc_port(protocols: ProtocolOptions) -> tuple[socket.socket | None, str]:
    """The claim on --port that this server holds until it exits, or why it cannot have it.

    The claim is a Linux abstract Unix socket named after the port: its name is taken atomically, lives in the
    network namespace that the port does, and is released by the kernel however the process ends, kill -9 too
    (the workers inherit it, so it lasts while any of them may hold the port). It is keyed on the port alone, as
    SO_REUSEPORT lets 0.0.0.0 and 127.0.0.1 share one. Other systems have no abstract names: no claim there."""
    if not protocols.port or not sys.platform.startswith("linux"):
        return None, ""
    claim = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        claim.bind(f"\0petal-serve-grpc-port-{protocols.port}")
    except OSError as error:
        claim.close()
        if error.errno != errno.EADDRINUSE:
            raise
        return None, (f"the gRPC port {bind_address(protocols.host, protocols.port)} is taken by another petal serve "
                      "that is still loading its models; give --port another port")
    return claim, ""
