"""Where a worker is in its life, as its DataPlane and the protocol adapters read it: started (its initial model
load has finished and every port it serves is open), and draining. The worker (serving/process/worker.py `Worker`) owns
the gate and moves it on; the DataPlane says when the load is over.

TF Serving opens its ports only after the models in its config have loaded, so its clients never see a configured
model as missing or loading; a client that connects as soon as the port opens is served. Petal's REST port opens at
once instead, so that liveness probes answer while a large model loads; its model APIs wait here (up to their
deadline) rather than answer "loading", and readiness stays false until the gate opens. The gRPC server binds only
after the load (serving/process/worker.py) and holds the gate until it has, so /readyz never turns 200 before a gRPC
client could connect. Once the worker drains (SIGTERM) readiness is false for good.
"""
from __future__ import annotations

import threading

from serving import threads


class Startup:
    """A gate that opens once the initial load is over and each port still to open has opened, and the drain that
    follows it."""

    def __init__(self, ports: int = 0, loaded: bool = False) -> None:
        self._lock = threading.Lock()
        self._loaded = loaded
        self._ports = ports
        self._draining = False
        self._waiters: list[threads.Waker] = []

    @property
    def done(self) -> bool:
        return self._loaded and self._ports <= 0

    @property
    def draining(self) -> bool:
        """Whether the worker has begun to drain: readiness is false from then on, and nothing new starts."""
        return self._draining

    def drain(self) -> None:
        """The worker stops: requests in flight still complete."""
        self._draining = True

    def loaded(self) -> None:
        """The initial load is over (whoever sees it first says so; saying it again changes nothing)."""
        with self._lock:
            self._loaded = True
            self._wake_if_done()

    def port_opened(self) -> None:
        with self._lock:
            self._ports -= 1
            self._wake_if_done()

    def _wake_if_done(self) -> None:
        if self.done:
            waiters, self._waiters = self._waiters, []
            for waker in waiters:
                waker.set()

    def wait(self, deadline: float | None = None) -> bool:
        """Block (a greenlet on the gevent loop yields, never the loop itself) until the gate opens or the deadline
        (time.monotonic() seconds) passes; whether it opened."""
        if self.done:  # once open it stays open: every later request passes without the lock
            return True
        with self._lock:
            if self.done:
                return True
            waker = threads.new_waker()
            self._waiters.append(waker)
        return waker.wait(threads.timeout_until(deadline))
