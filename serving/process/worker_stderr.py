"""What a worker process writes to its stderr reaches the server's log as JSON lines, through the master.

Petal's own logs are JSON lines (one object per line), but C and C++ inside a worker also write to file
descriptor 2 on their own: libjpeg, inside TensorFlow's decoder, prints a line for some corrupt JPEGs a client
sends ("Input file read error"), TensorFlow's C++ runtime writes absl's format, a crash writes its last words
(faulthandler's traceback, "terminate called after ..."). Each worker's descriptor 2 is therefore a pipe whose
read end the gunicorn master holds: the master outlives its workers, so a crashed worker's last words are still
read after it died. The master writes each line on: a JSON line as it is, any other line as a JSON record of its
own (absl's severity letter gives its level, CPython's `Fatal Python error:` is critical, any other line is a
warning), with the worker's pid. The lines a
worker says to whoever started the server ("ready: ..."), which are the first screen and not logs, go to the
descriptor 2 the worker was born with.
"""
from __future__ import annotations

import faulthandler
import functools
import json
import os
import sys
import threading
import time
from typing import Any

from serving.tensorflow_logs import ABSL_LINE, SEVERITIES, relay_lines, write_all

LOGGER = "petal.worker.stderr"
FATAL = b"Fatal Python error: "  # how CPython (and its faulthandler) begins a crash's last words

_console: dict[str, int] = {}  # "fd": in a worker, the descriptor 2 it was born with
_relays: list[threading.Thread] = []  # in the master, one reader per worker it forked


def say(line: str) -> None:
    """A line for whoever started the server, beside the logs (which are JSON, and warnings only by default)."""
    sys.stderr.flush()
    write_all(_console.get("fd", 2), (line + "\n").encode())


def pre_fork(server: Any, worker: Any) -> None:
    """In the master, before it forks `worker`: the pipe that will be the worker's stderr, and its reader."""
    read_end, write_end = os.pipe()
    worker.petal_stderr = (read_end, write_end)
    relay = threading.Thread(target=relay_lines, args=(read_end, 2, functools.partial(_as_record, worker=worker)),
                             name="petal-worker-stderr", daemon=True)
    relay.start()
    _relays[:] = [*(each for each in _relays if each.is_alive()), relay]


def drain(timeout_s: float) -> None:
    """In the master, once every worker has exited: until their readers have written out their last lines."""
    deadline = time.monotonic() + timeout_s
    for relay in _relays:
        relay.join(max(0.0, deadline - time.monotonic()))


def post_fork(server: Any, worker: Any) -> None:
    """In the worker, just after the fork: its stderr becomes the pipe; the siblings' pipes are closed, so that
    each pipe ends when its own worker does. Python's faulthandler is on, so a worker that TensorFlow's native code
    crashes (a segmentation fault, a failed CHECK's abort) leaves every thread's Python stack as its last words."""
    read_end, write_end = worker.petal_stderr
    sys.stderr.flush()
    _console["fd"] = os.dup(2)
    os.dup2(write_end, 2)
    for fd in (read_end, write_end, *(fd for sibling in server.WORKERS.values()
                                      for fd in getattr(sibling, "petal_stderr", ()))):
        os.close(fd)
    _relays.clear()  # the master's readers, not this process's
    faulthandler.enable(all_threads=True)


def child_exit(server: Any, worker: Any) -> None:
    """In the master, once `worker` has exited: its pipe's last writer goes, so the reader writes out what is left
    and stops."""
    fds = getattr(worker, "petal_stderr", None)
    if fds is not None:
        os.close(fds[1])


def _as_record(line: bytes, worker: Any) -> bytes:
    return as_json(line, getattr(worker, "pid", None))  # the pid is the master's to set, just after the fork


def as_json(line: bytes, pid: int | None) -> bytes:
    """A JSON object's line as it is; any other line as a record in the shape of Petal's JSON logs; a blank line
    as nothing."""
    stripped = line.strip()
    if not stripped:
        return b""
    if stripped.startswith(b"{"):
        try:
            if isinstance(json.loads(stripped), dict):
                return stripped + b"\n"
        except ValueError:
            pass
    match = ABSL_LINE.match(stripped)
    level = SEVERITIES[match.group(1)] if match else "CRITICAL" if stripped.startswith(FATAL) else "WARNING"
    return json.dumps({"ts": round(time.time(), 3), "level": level, "logger": LOGGER,
                       "msg": stripped.decode("utf-8", "replace"), "pid": pid}).encode() + b"\n"
