"""The --grpc_socket_path socket's ownership (serving/protocols/grpc_api/unix_socket.py): which worker of a server
binds it, taking it over from another server, giving it back at exit, and the paths refused at start. Each worker is
a process of its own that claims the path as a worker of `petal serve` does, holding the server's lock while it
lives, so that a worker's end is a process's end, as the kernel sees it. Servers that serve the path run in
tests/e2e/test_grpc_socket.py."""
from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from server_harness import ROOT
from serving.protocols.grpc_api import unix_socket

# A worker: claims the path, says what it got (its Binding, or null), and lives until its standard input closes.
WORKER = """
import dataclasses, json, sys
from serving.protocols.grpc_api import unix_socket
binding = unix_socket.claim(sys.argv[1], sys.argv[2])
print(json.dumps(binding and dataclasses.asdict(binding)), flush=True)
sys.stdin.read()
"""


class Worker:
    """One worker process of a server whose private runtime folder is `runtime_dir`, and the binding it claimed."""

    def __init__(self, path: Path, runtime_dir: Path):
        self._process = subprocess.Popen([sys.executable, "-c", WORKER, str(path), str(runtime_dir)],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.pid = self._process.pid
        claimed = json.loads(self._process.stdout.readline())
        self.binding = unix_socket.Binding(**claimed) if claimed else None

    def end(self) -> None:
        """The worker dies: the kernel drops the lock it held."""
        if self._process.poll() is None:
            self._process.stdin.close()
            self._process.wait(10)
            self._process.stdout.close()


@pytest.fixture
def start_worker() -> Iterator[Callable[[Path, Path], Worker]]:
    """Starts workers; those still alive when the test ends are ended then."""
    started: list[Worker] = []

    def start(path: Path, runtime_dir: Path) -> Worker:
        started.append(Worker(path, runtime_dir))
        return started[-1]
    yield start
    for worker in started:
        worker.end()


def listening(path: str) -> socket.socket:
    """A server's socket listening at `path`."""
    server = socket.socket(socket.AF_UNIX)
    server.settimeout(5)  # an accept that nothing reaches fails the test rather than hanging it
    server.bind(path)
    server.listen()
    return server


def bind_and_publish(binding: unix_socket.Binding | None) -> socket.socket:
    """What the worker's gRPC server does with its binding: listen on the bound name, then publish it."""
    assert binding is not None, "the worker claimed the path"
    server = listening(binding.bound)
    binding.publish()
    return server


def test_only_one_worker_claims_the_socket_and_the_lock_frees_with_its_holder(tmp_path, start_worker):
    path = tmp_path / "grpc.sock"
    holder = start_worker(path, tmp_path)
    assert holder.binding is not None
    assert start_worker(path, tmp_path).binding is None  # a sibling is refused while the holder lives
    holder.end()
    assert start_worker(path, tmp_path).binding is not None


def test_a_new_server_takes_a_live_socket_over_naming_its_owner_and_removes_only_its_own(tmp_path, caplog,
                                                                                          start_worker):
    path, mine, theirs = tmp_path / "grpc.sock", tmp_path / "mine", tmp_path / "theirs"
    mine.mkdir()
    theirs.mkdir()
    old = listening(str(path))  # another server's, this test process standing in for it
    worker = start_worker(path, mine)
    binding = worker.binding
    assert binding is not None
    assert binding.bound == f"{path}.{worker.pid}" and binding.old_owner.startswith(f"pid {os.getpid()} (")
    with caplog.at_level(logging.WARNING, logger=unix_socket.__name__):
        new = bind_and_publish(binding)
    [warning] = [r for r in caplog.records if r.name == unix_socket.__name__]
    assert warning.fields == {"path": str(path), "old_owner": binding.old_owner}
    assert sorted(os.listdir(tmp_path)) == ["grpc.sock", "mine", "theirs"]  # the bound name was renamed
    with socket.socket(socket.AF_UNIX) as client:  # the path leads to the new socket now
        client.connect(str(path))
        accepted, _ = new.accept()
        accepted.close()
    newest = bind_and_publish(start_worker(path, theirs).binding)  # a third server takes it over in turn
    unix_socket.release(str(path), str(mine))  # the second server exits: the path is not its socket any more
    assert path.exists()
    unix_socket.release(str(path), str(theirs))
    assert not path.exists()
    for server in (old, new, newest):
        server.close()


def test_a_replacement_worker_takes_its_servers_socket_back_but_not_a_newer_servers(tmp_path, start_worker):
    path, mine, theirs = tmp_path / "grpc.sock", tmp_path / "mine", tmp_path / "theirs"
    mine.mkdir()
    theirs.mkdir()
    first_worker = start_worker(path, mine)
    first = bind_and_publish(first_worker.binding)
    first_worker.end()
    first.close()  # the worker died; its socket file stays
    replacement = start_worker(path, mine)
    assert replacement.binding is not None and not replacement.binding.old_owner  # its own stale socket: no warning
    second = bind_and_publish(replacement.binding)
    replacement.end()
    newer = bind_and_publish(start_worker(path, theirs).binding)  # another server takes the path
    second.close()
    declining = start_worker(path, mine)
    assert declining.binding is None  # the next replacement leaves it to the newer server
    declining.end()
    newer.close()  # ... unless that one is gone too
    assert start_worker(path, mine).binding is not None


def test_a_socket_path_petal_cannot_bind_fails_at_start_naming_it(tmp_path):
    with pytest.raises(OSError, match="longer than a Unix socket path"):
        unix_socket.check_path("/tmp/" + "s" * 103)
    with pytest.raises(OSError, match="its folder does not exist"):
        unix_socket.check_path(str(tmp_path / "missing" / "grpc.sock"))
    taken = tmp_path / "grpc.sock"
    taken.write_text("not a socket")
    result = subprocess.run([sys.executable, "-m", "petal", "serve", f"--grpc_socket_path={taken}"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and f"--grpc_socket_path {str(taken)!r} exists and is not a socket" in result.stderr
    assert taken.read_text() == "not a socket"
