"""--grpc_socket_path: the Unix socket file that gRPC serves on besides --port, as tensorflow_model_server does.

Between servers, the newest owns the path, as gRPC binds it: a server given a path that another one serves takes
it over (one warning names the old owner), so that servers started one after another on one path all start, and
a client of the path reaches the last. Petal binds its socket under a name of its own in the same folder and
renames it onto the path once bound: the takeover is atomic, with no moment when the path is missing, and gRPC,
which unlinks the name it bound when its server stops, cannot remove the socket of a server that took over since.
For the same reason a server removes the path at exit only if the socket there is its own.

Within one server, one worker serves it, since workers cannot share a socket file the way SO_REUSEPORT lets them
share a TCP port: the worker that holds a lock in the server's private runtime folder. The kernel drops the lock
when that worker dies, and the worker gunicorn starts in its place takes the path over again, unless another
server has taken it since. Connections over the socket therefore go to one worker; --port spreads them over all.
"""
from __future__ import annotations

import fcntl
import logging
import os
import socket
import stat
import struct
from dataclasses import dataclass

logger = logging.getLogger(__name__)

LOCK_FILE = "grpc_socket.lock"
OWNED_FILE = "grpc_socket.inode"  # the inode of the socket this server put at the path last
PROBE_TIMEOUT_S = 1.0
MAX_PATH_BYTES = 107  # sockaddr_un's sun_path, less its terminating NUL

_held: list[int] = []  # the lock's descriptor, open for as long as this worker lives


def check_path(path: str) -> None:
    """OSError for a path that no socket can take: too long, in a folder that does not exist, or a file that is
    not a socket (never removed). A socket there, live or stale, is taken over."""
    if len(os.fsencode(path)) > MAX_PATH_BYTES:
        raise OSError(f"--grpc_socket_path {path!r} is longer than a Unix socket path can be ({MAX_PATH_BYTES} bytes)")
    if not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        raise OSError(f"--grpc_socket_path {path!r}: its folder does not exist")
    found = _lstat(path)
    if found is not None and not stat.S_ISSOCK(found.st_mode):
        raise OSError(f"--grpc_socket_path {path!r} exists and is not a socket; not replacing it")


@dataclass
class Binding:
    """What one worker binds for the path: `address` for gRPC, then `publish` once its server has started."""
    path: str
    runtime_dir: str
    bound: str  # the name gRPC binds: a sibling of the path, or the path itself when a sibling's name is too long
    old_owner: str  # who served the path before this server, for the warning; "" if nobody did

    @property
    def address(self) -> str:
        return f"unix:{self.bound}"

    def publish(self) -> None:
        """Put the bound socket at the path (an atomic rename) and remember its inode as this server's."""
        if self.bound != self.path:
            os.replace(self.bound, self.path)
        with open(os.path.join(self.runtime_dir, OWNED_FILE), "w") as f:
            f.write(str(os.stat(self.path).st_ino))
        if self.old_owner:
            logger.warning("--grpc_socket_path was served by another process; this server serves it now",
                           extra={"fields": {"path": self.path, "old_owner": self.old_owner}})


def claim(path: str, runtime_dir: str) -> Binding | None:
    """The binding of this worker, or None when it does not serve the path: a sibling holds the lock in
    `runtime_dir` (the server's private folder), or, for a worker that replaces the one that served it, another
    server has taken the path over since."""
    fd = os.open(os.path.join(runtime_dir, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    _held.append(fd)
    owned = _owned_inode(runtime_dir)
    current = _inode(path)
    if owned is not None and current not in (None, owned) and answers(path):
        logger.info("--grpc_socket_path is another server's now; not taking it back",
                    extra={"fields": {"path": path, "owner": owner(path)}})
        return None
    old_owner = owner(path) if owned is None and current is not None and answers(path) else ""
    sibling = f"{path}.{os.getpid()}"
    bound = sibling if len(os.fsencode(sibling)) <= MAX_PATH_BYTES else path
    return Binding(path, runtime_dir, bound, old_owner)


def release(path: str, runtime_dir: str) -> None:
    """At the server's exit: remove the path if the socket there is the one this server put there (a worker that
    was killed leaves it behind), never another server's."""
    owned = _owned_inode(runtime_dir)
    if owned is not None and _inode(path) == owned:
        os.unlink(path)


def answers(path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(PROBE_TIMEOUT_S)
        try:
            probe.connect(path)
        except OSError:  # ECONNREFUSED: a socket file left by a server that is gone
            return False
    return True


def owner(path: str) -> str:
    """The process listening on the socket, as "pid N (command line)", from the peer credentials of a connection."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(PROBE_TIMEOUT_S)
        try:
            probe.connect(path)
            pid, _, _ = struct.unpack("3i", probe.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                             struct.calcsize("3i")))
        except OSError:
            return "unknown"
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        command = ""
    return f"pid {pid} ({command})" if command else f"pid {pid}"


def _lstat(path: str) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def _inode(path: str) -> int | None:
    found = _lstat(path)
    return None if found is None else found.st_ino


def _owned_inode(runtime_dir: str) -> int | None:
    try:
        with open(os.path.join(runtime_dir, OWNED_FILE)) as f:
            return int(f.read())
    except (FileNotFoundError, ValueError):
        return None
