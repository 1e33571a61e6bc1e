"""gunicorn's gevent worker, adapted for Petal: connections on an event loop, TensorFlow on real OS threads.

Reading and parsing happen on the loop, so a connection that trickles its headers or body, or sits idle, costs a
greenlet and a socket instead of one of a fixed number of threads. Three changes to gunicorn's GeventWorker:

- `patch()` leaves `threading` and `queue` alone. With them patched, every lock created after the fork is a gevent
  lock, TensorFlow's own included, and OS threads contending on one deadlock. Petal's batch threads, unbatched
  runs and gRPC's executor stay native; only the waiting changes (serving/threads.py).
- `handle()` wraps each connection in `DeadlineSocket`, a read deadline in the manner of Apache's mod_reqtimeout:
  a request's headers must arrive within --request_header_timeout of their first byte, and its body within
  --request_body_timeout, extended by a second for every MIN_BODY_RATE bytes received, so a trickle is cut off
  while a large photo sent at any normal speed is not. gunicorn's own `keepalive` closes idle connections.
- Past --max_connections, a new connection is answered 503 with Retry-After and closed, instead of waiting unseen
  in the kernel's backlog.
"""
from __future__ import annotations

import json
import time

from gevent import monkey
from gevent import socket as gsocket
from gunicorn.http.errors import NoMoreData
from gunicorn.workers.ggevent import GeventWorker
from werkzeug.exceptions import RequestTimeout

from serving import threads

MIN_BODY_RATE = 64 * 1024  # bytes/s; each such chunk received buys one more second of body time
_REFUSAL = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n%s")


class ReadDeadline(NoMoreData, RequestTimeout):
    """gunicorn closes quietly on NoMoreData while it reads headers; a view reading the body gets Flask's 408."""

    def __init__(self, phase: str):
        NoMoreData.__init__(self, b"")
        RequestTimeout.__init__(self, f"The request {phase} did not arrive in time")

    def __str__(self) -> str:
        return RequestTimeout.__str__(self)


class DeadlineSocket:
    """A client socket whose reads fail once the current request's headers or body are overdue."""
    __slots__ = ("_sock", "_deadline", "_phase", "_header_s", "_body_s")

    def __init__(self, sock, header_s: float, body_s: float):
        self._sock = sock
        self._header_s, self._body_s = header_s, body_s
        self.idle()

    def __getattr__(self, name: str):
        return getattr(self._sock, name)

    def idle(self) -> None:
        """Between requests only gunicorn's keepalive applies; the header clock starts at the next first byte."""
        self._phase, self._deadline = "headers", None

    def start_body(self) -> None:
        self._phase, self._deadline = "body", time.monotonic() + self._body_s

    def recv(self, size: int, *flags) -> bytes:
        if self._deadline is None:
            data = self._sock.recv(size, *flags)
            if data:
                self._deadline = time.monotonic() + self._header_s
            return data
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            raise ReadDeadline(self._phase)
        self._sock.settimeout(remaining)
        try:
            data = self._sock.recv(size, *flags)
        except TimeoutError:
            raise ReadDeadline(self._phase) from None
        finally:
            self._sock.settimeout(None)
        if self._phase == "body":
            self._deadline += len(data) / MIN_BODY_RATE
        return data


class PetalGeventWorker(GeventWorker):
    """Settings come from gunicorn's config; Petal's three are set by serving/server.py as `petal_*` attributes."""

    petal_max_connections = 1000
    petal_header_timeout = 10.0
    petal_body_timeout = 10.0
    petal_os_threads = 4

    def patch(self) -> None:
        monkey.patch_all(thread=False, queue=False)
        self.sockets = [gsocket.socket(s.FAMILY, gsocket.SOCK_STREAM, fileno=s.sock.detach()) for s in self.sockets]
        threads.serve_on_gevent_loop(self.petal_os_threads)
        self._open = 0

    def handle(self, listener, client, addr) -> None:
        if self._open >= self.petal_max_connections:
            body = json.dumps({"error": "Too many connections to this worker; retry shortly"}).encode()
            try:
                client.sendall(_REFUSAL % (len(body), body))
            finally:
                client.close()
            return
        self._open += 1
        try:
            client.setblocking(1)
            super().handle(listener, DeadlineSocket(client, self.petal_header_timeout, self.petal_body_timeout),
                           addr)
        finally:
            self._open -= 1

    def handle_request(self, listener_name, req, sock, addr):
        sock.start_body()
        try:
            return super().handle_request(listener_name, req, sock, addr)
        finally:
            sock.idle()
