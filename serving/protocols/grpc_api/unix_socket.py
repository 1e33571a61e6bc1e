"""--grpc_socket_path: the Unix socket file that gRPC serves on besides --port, as tensorflow_model_server does.

Workers cannot share one socket file the way SO_REUSEPORT lets them share a TCP port. gRPC unlinks the socket
file at the path before it binds, so each worker would take the path over from the one before (whose socket would
then serve nobody), and a worker that stops unlinks the path even when it belongs to a sibling by then. So one
worker serves it: the one that holds a lock in the server's private runtime folder. The kernel drops the lock when
that worker dies, and the worker gunicorn starts in its place takes the socket over. Connections over the socket
therefore go to one worker; --port spreads them over all of them.
"""
from __future__ import annotations

import fcntl
import os
import socket
import stat

LOCK_FILE = "grpc_socket.lock"
PROBE_TIMEOUT_S = 1.0
MAX_PATH_BYTES = 107  # sockaddr_un's sun_path, less its terminating NUL

_held: list[int] = []  # the lock's descriptor, open for as long as this worker lives


def claim(lock_dir: str) -> bool:
    """Whether this worker serves the socket: the only worker does (no `lock_dir`); of several, the one that takes
    the lock in `lock_dir` (serving/worker.py's folder shared by the workers)."""
    if not lock_dir:
        return True
    fd = os.open(os.path.join(lock_dir, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return False
    _held.append(fd)
    return True


def check_free(path: str) -> None:
    """OSError unless the path is free or holds a stale socket (one nobody listens on), which gRPC replaces. A file
    that is not a socket, or a socket another server answers on, is never removed."""
    if len(os.fsencode(path)) > MAX_PATH_BYTES:
        raise OSError(f"--grpc_socket_path {path!r} is longer than a Unix socket path can be ({MAX_PATH_BYTES} bytes)")
    if not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        raise OSError(f"--grpc_socket_path {path!r}: its folder does not exist")
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise OSError(f"--grpc_socket_path {path!r} exists and is not a socket; not replacing it")
    if answers(path):
        raise OSError(f"--grpc_socket_path {path!r}: another server is listening on it")


def answers(path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(PROBE_TIMEOUT_S)
        try:
            probe.connect(path)
        except OSError:  # ECONNREFUSED: a socket file left by a server that is gone
            return False
    return True


def remove_stale(path: str) -> None:
    """At exit: gRPC unlinks the socket when its server stops, but a worker that was killed leaves it behind."""
    try:
        if stat.S_ISSOCK(os.lstat(path).st_mode) and not answers(path):
            os.unlink(path)
    except FileNotFoundError:
        pass
