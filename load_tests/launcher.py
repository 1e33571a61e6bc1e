"""Start `petal serve` as a subprocess on free loopback ports, wait until it is ready, and stop it.

The one launcher that `petal loadtest --start-server`, the tests (tests/server_harness.py) and the benchmarks
share. It talks to the server only as a process and over loopback, so it imports nothing of the server: `petal
loadtest` stays free of TensorFlow and Flask (`python -X importtime -c "import load_tests.launcher"` shows it).
"""
from __future__ import annotations

import logging
import os
import random
import shlex
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 180
STOP_TIMEOUT_S = 60.0
LOG_TAIL_CHARS = 4000  # enough for a Python traceback and the lines before it
POLL_S = 0.1
EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
PORTS_FROM = 10000  # below: ports that other services on a machine are likelier to claim
MIN_POOL = 1000


class ServerStartError(RuntimeError):
    """`petal serve` exited before it was ready, or was not ready in time; the message ends with its log's tail."""


@dataclass
class Server:
    rest_url: str
    grpc_target: str
    rest_port: int
    grpc_port: int  # 0 when the flags gave --port
    proc: subprocess.Popen
    log_path: str

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()


Probe = Callable[[Server], bool]


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """Distinct free ports below the kernel's ephemeral range (above it when that range starts low), each socket
    bound until all are chosen, so no two are the same.

    A server binds its ports seconds after they are chosen: gRPC's only once its models have loaded. Meanwhile a
    port from the ephemeral range can be taken by any outgoing connection on the machine, or by anyone's bind to
    port 0; a port outside it only by someone who names it."""
    low, high = _ephemeral_ports()
    pool = range(PORTS_FROM, low) if low - PORTS_FROM >= MIN_POOL else range(high + 1, 65536)
    sockets: list[socket.socket] = []
    try:
        for port in random.sample(pool, len(pool)) if len(pool) >= MIN_POOL else [0] * count:
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            sockets.append(s)
            if len(sockets) == count:
                return [s.getsockname()[1] for s in sockets]
        raise OSError(f"fewer than {count} free ports")
    finally:
        for s in sockets:
            s.close()


def _ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for ports it picks itself (Linux's default where it cannot be read)."""
    try:
        with open(EPHEMERAL_RANGE_FILE) as f:
            low, high = map(int, f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def get_status(url: str, context: ssl.SSLContext | None = None) -> int:
    """The HTTP status of a GET, or 0 when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=2, context=context) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
    except OSError:
        return 0


def answers(path: str, context: ssl.SSLContext | None = None) -> Probe:
    """A readiness probe: a GET of `path` on the server's REST port answers 200 (/readyz: every model loaded)."""
    return lambda server: get_status(server.rest_url + path, context) == 200


READYZ = answers("/readyz")


def _has_flag(flags: Sequence[str], name: str) -> bool:
    return any(a == name or a.startswith(name + "=") for a in flags)


def _flag_value(flags: Sequence[str], name: str) -> str | None:
    return next((a.split("=", 1)[1] for a in flags if a.startswith(name + "=")), None)


def start(flags: Sequence[str], log_path: str, *, tls: bool = False, env: Mapping[str, str] | None = None,
          cwd: str | None = None, wrapper: Sequence[str] = (), python: str = sys.executable) -> Server:
    """`petal serve FLAGS` in the background on free ports, its output in `log_path`; returns at once.

    It binds 127.0.0.1 unless FLAGS say `--host=ADDRESS` (another loopback address, say), and the URLs follow. A
    gRPC port is chosen unless FLAGS give `--port`. With `tls` (a server given --ssl_config_file) the REST URL is
    https. The server's environment is this one, with TensorFlow's C++ logs at warnings unless that says otherwise,
    and `env` on top. A `wrapper` command runs it (it must exec the command it is given last, so that the process
    started is the server's). `python` is the interpreter, so another virtualenv's dependencies can be measured.
    """
    host = _flag_value(flags, "--host") or "127.0.0.1"
    grpc = not _has_flag(flags, "--port")
    rest_port, *chosen = free_ports(2 if grpc else 1)
    grpc_port = chosen[0] if grpc else 0
    command = [*wrapper, python, "-m", "petal", "serve", f"--host={host}", f"--rest_api_port={rest_port}",
               *([f"--port={grpc_port}"] if grpc else []), *flags]
    log.info("starting server", extra={"fields": {"command": shlex.join(command), "log": log_path}})
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(command, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                env={"TF_CPP_MIN_LOG_LEVEL": "2", **os.environ, **(env or {})})
    scheme = "https" if tls else "http"
    return Server(f"{scheme}://{host}:{rest_port}", f"{host}:{grpc_port}", rest_port, grpc_port, proc, log_path)


def wait_ready(server: Server, ready: Probe = READYZ, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
    """Until `ready(server)`; a server that exits first, or is not ready within `timeout_s`, is an error."""
    deadline = time.monotonic() + timeout_s
    while not ready(server):
        if server.proc.poll() is not None:
            raise ServerStartError(f"`petal serve` exited with code {server.proc.returncode}; "
                                   f"log {server.log_path}:\n{server.log()[-LOG_TAIL_CHARS:]}")
        if time.monotonic() > deadline:
            raise ServerStartError(f"`petal serve` not ready after {timeout_s:g}s; "
                                   f"log {server.log_path}:\n{server.log()[-LOG_TAIL_CHARS:]}")
        time.sleep(POLL_S)
    log.info("server ready", extra={"fields": {"rest_url": server.rest_url, "grpc_target": server.grpc_target}})


def stop(server: Server, timeout_s: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM, which lets the server drain; SIGKILL if it is still running after `timeout_s`."""
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
        try:
            server.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait()


@contextmanager
def running(flags: Sequence[str], *, ready: Probe = READYZ, log_path: str | None = None,
            timeout_s: float = STARTUP_TIMEOUT_S, stop_timeout_s: float = STOP_TIMEOUT_S, tls: bool = False,
            env: Mapping[str, str] | None = None, cwd: str | None = None,
            wrapper: Sequence[str] = (), python: str = sys.executable) -> Iterator[Server]:
    """`petal serve FLAGS` (see `start`) from the moment `ready` holds until the block ends, then stopped.

    Without `log_path` the log goes to a temporary file, removed afterwards.
    """
    temporary = log_path is None
    if log_path is None:
        with tempfile.NamedTemporaryFile(prefix="petal-serve-", suffix=".log", delete=False) as f:
            log_path = f.name
    try:
        server = start(flags, log_path, tls=tls, env=env, cwd=cwd, wrapper=wrapper, python=python)
        try:
            wait_ready(server, ready, timeout_s)
            yield server
        finally:
            stop(server, stop_timeout_s)
    finally:
        if temporary:
            os.unlink(log_path)
