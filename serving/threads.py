"""Where TensorFlow runs, and how a request handler waits for it, under either HTTP worker.

TensorFlow always runs on real OS threads: the batcher's threads, a lone request's own thread, and for unbatched
runs the calling thread or, on the gevent worker's event loop, a pool of OS threads; the loop thread itself runs
only a lone request's short call while it serves a single connection. The gevent worker
(serving/process/gevent_worker.py) leaves `threading` unpatched, so every lock, condition and thread here is native.
What differs is only the waiting: a request greenlet on the event loop must never block on a native Event (that would
freeze every connection of the worker), so it waits on a gevent Event that the OS thread sets through the hub's
thread-safe callback queue. gthread request threads and gRPC's threads wait on a plain threading.Event, as before.
"""
from __future__ import annotations

import ctypes
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

T = TypeVar("T")

# A deadline further off than this is no deadline: no request waits that long, and a wait's timeout past
# threading.TIMEOUT_MAX (about 292 years) raises OverflowError instead of waiting. gRPC clients such as Triton's
# perf_analyzer send deadlines that far.
FAR_DEADLINE_S = 365 * 24 * 3600.0

_loop: dict[str, Any] = {}  # "thread": ident of this worker's gevent loop thread, "pool": its OS thread pool
_marks = threading.local()  # .alone: this OS thread serves the only call in flight (CallCount); native, unpatched


class Waker(Protocol):
    def set(self) -> None: ...
    def wait(self, timeout: float | None) -> bool: ...


def timeout_until(deadline: float | None) -> float | None:
    """What a wait for `deadline` (time.monotonic() seconds) passes as its timeout: at least 0, and None (wait
    without a limit) for no deadline or one beyond FAR_DEADLINE_S."""
    if deadline is None:
        return None
    remaining = deadline - time.monotonic()
    return None if remaining > FAR_DEADLINE_S else max(0.0, remaining)


def name_native_thread(name: str) -> None:
    """Give the calling OS thread `name` (its first 15 bytes, the kernel's limit), as `top -H`, `ps -L` and
    /proc/PID/task/TID/comm show it: Python 3.11 names only its own Thread objects, so every thread of a worker
    showed as the worker. Linux only; elsewhere nothing changes."""
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # 15: PR_SET_NAME


def serve_on_gevent_loop(os_threads: int, alone: Callable[[], bool] = lambda: False) -> None:
    """Called once by the gevent worker, on its loop thread, after patching: requests from now on are greenlets.
    `alone` says whether the worker serves a single connection at the moment."""
    from gevent.threadpool import ThreadPool

    _loop["thread"] = threading.get_ident()
    _loop["pool"] = ThreadPool(os_threads)
    _loop["alone"] = alone


def on_event_loop() -> bool:
    return _loop.get("thread") == threading.get_ident()


def alone() -> bool:
    """Whether the calling thread serves the worker's only request in flight: the event loop while it serves a
    single connection, or a thread whose call a CallCount found alone. Such a thread may run a TF graph itself
    rather than hand it to TensorFlow's pool and wait, as nothing else is there to be served meanwhile
    (serving/core/runtimes.py)."""
    return alone_on_loop() if on_event_loop() else getattr(_marks, "alone", False)


class CallCount:
    """The calls in flight on a server's OS threads (the gRPC server's), entered for each call's duration: a call
    that starts as the only one marks its thread `alone` until it ends."""

    def __init__(self) -> None:
        self._count = 0
        self._lock = threading.Lock()

    def __enter__(self) -> None:
        with self._lock:
            self._count += 1
            _marks.alone = self._count == 1

    def __exit__(self, *exc_info: object) -> None:
        _marks.alone = False
        with self._lock:
            self._count -= 1


def alone_on_loop() -> bool:
    """Whether the event loop serves a single connection: then the loop may run a short TF call itself, since no
    other client is there to wait meanwhile but one that connects during those milliseconds
    (serving/core/batching.py decides which calls are short)."""
    return _loop["alone"]()


class _GreenletWaker:
    """Set from any OS thread, waited on by one greenlet: the OS thread never touches the gevent Event itself
    (gevent documents it as single-threaded), it queues `Event.set` on the hub, which wakes the loop."""
    __slots__ = ("_event", "_loop")

    def __init__(self) -> None:
        import gevent
        from gevent.event import Event

        self._event = Event()
        self._loop = gevent.get_hub().loop

    def set(self) -> None:
        self._loop.run_callback_threadsafe(self._event.set)

    def wait(self, timeout: float | None) -> bool:
        return self._event.wait(timeout)


def new_waker() -> Waker:
    """What a request waits on for a result computed on another OS thread."""
    return _GreenletWaker() if on_event_loop() else threading.Event()


def run_off_loop(fn: Callable[..., T], *args: object) -> T:
    """Call `fn` on an OS thread: the caller's own, unless the caller is the event loop, which must keep serving
    connections meanwhile (then a pool thread runs it and only the calling greenlet waits)."""
    if on_event_loop():
        raised, value = _loop["pool"].spawn(_outcome, fn, args).get()
        if raised:
            raise value
        return value
    return fn(*args)


def _outcome(fn: Callable[..., T], args: tuple) -> tuple[bool, Any]:
    """What `fn` returned or raised, for the greenlet to raise again: gevent's pool would itself log the traceback
    of a call that raised, and for a client's bad input (a 400) that is 18 lines of the server's log per request."""
    try:
        return False, fn(*args)
    except Exception as error:
        return True, error
