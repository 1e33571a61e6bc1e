"""gunicorn's gevent worker, adapted for Petal: connections on an event loop, TensorFlow on real OS threads.

Reading and parsing happen on the loop, so a connection that trickles its headers or body, or sits idle, costs a
greenlet and a socket instead of one of a fixed number of threads. Three changes to gunicorn's GeventWorker:

- `patch()` leaves `threading` and `queue` alone. With them patched, every lock created after the fork is a gevent
  lock, TensorFlow's own included, and OS threads contending on one deadlock. Petal's batch threads, unbatched
  runs and gRPC's executor stay native; only the waiting changes (serving/threads.py).
- `handle()` wraps each connection in `DeadlineSocket`, a read deadline in the manner of Apache's mod_reqtimeout:
  a request's headers must arrive within --request_header_timeout of their first byte, and its body within
  --request_body_timeout, extended by a second for every MIN_BODY_RATE bytes received, so a trickle is cut off
  while a large photo sent at any normal speed is not; an answer must be taken within the same time as a body.
  gunicorn's own `keepalive` closes idle connections.
- At --max_connections, a new connection takes the place of the one that has waited longest for a next request, as
  nginx does when its connections run out (ngx_drain_connections), so idle sockets cannot hold the port; when every
  connection is in a request, one of an address holding more connections than the new one's is cut (a request
  still arriving, the oldest), so one peer's many connections cannot keep others out; failing that the new one is
  answered 503 with Retry-After and closed, instead of waiting unseen in the kernel's backlog.

With --ssl_config_file the worker does TLS itself rather than through gunicorn's `certfile`: gevent's server
would complete each handshake before `handle()` runs, with no deadline and outside --max_connections. Here the
handshake happens inside `handle()`, counted as a connection and bounded by --request_header_timeout, and the
deadlines above then apply to the decrypted stream.
"""
from __future__ import annotations

import asyncio
import errno
import json
import logging
import sys
import time
from collections import Counter
from typing import Any

from gevent import Timeout, monkey
from gevent import socket as gsocket
from gevent import ssl as gssl
from gunicorn.http.errors import NoMoreData
from gunicorn.workers.ggevent import GeventWorker
from werkzeug.exceptions import RequestTimeout

from serving import threads
from serving.options.config import MIN_BODY_RATE, TLSOptions

logger = logging.getLogger(__name__)

COALESCE_LIMIT = 64 * 1024  # a larger first body write goes after the header block rather than being copied
_REFUSAL = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
            b"X-Content-Type-Options: nosniff\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s")


class ReadDeadline(NoMoreData, RequestTimeout):
    """gunicorn closes quietly on NoMoreData while it reads headers; a view reading the body gets Flask's 408."""

    def __init__(self, phase: str):
        NoMoreData.__init__(self, b"")
        RequestTimeout.__init__(self, f"The request {phase} did not arrive in time")

    def __str__(self) -> str:
        return RequestTimeout.__str__(self)


def tls_context(tls: TLSOptions, cert_path: str, key_path: str) -> gssl.SSLContext:
    """The REST port's TLS context (a gevent one, so handshakes and reads yield to the loop). Python loads a
    certificate chain only from files (serving/process/server.py writes them); the CA is PEM text. With custom_ca but no
    client_verify a client certificate is asked for and checked when sent; the gRPC port asks for none
    (docs/security.md, 'What Petal does not do')."""
    context = gssl.SSLContext(gssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = gssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert_path, key_path)
    if tls.custom_ca:
        context.load_verify_locations(cadata=tls.custom_ca)
        context.verify_mode = gssl.CERT_REQUIRED if tls.client_verify else gssl.CERT_OPTIONAL
    return context


class DeadlineSocket:
    """A client socket whose reads fail once the current request's headers or body are overdue, and which sends a
    response's header block together with the first piece of its body.

    gunicorn writes the header block and the body separately. Each send releases the GIL, and getting it back on a
    busy worker means waiting for a batch thread's Python, so one write instead of two is a wait fewer per request
    (and one packet instead of two)."""
    __slots__ = ("_sock", "_deadline", "_phase", "_header_s", "_body_s", "_hold", "_held", "_idle_since", "request",
                 "peer")
    _deadline: float | None  # None: the next request's first byte has not arrived

    def __init__(self, sock, header_s: float, body_s: float, peer: str = ""):
        self._sock = sock
        self.peer = peer  # the client's address, shared by all its connections
        self._header_s, self._body_s = header_s, body_s
        self._hold, self._held = False, b""
        self.request: Any = None  # gunicorn's request being answered on this connection, if one is
        self.idle()

    def __getattr__(self, name: str):
        return getattr(self._sock, name)

    def idle(self) -> None:
        """Between requests only gunicorn's keepalive applies; the header clock starts at the next first byte."""
        self._phase, self._deadline, self._idle_since = "headers", None, time.monotonic()

    def idle_since(self) -> float | None:
        """When the connection began to wait for a next request of which no byte has arrived; None once one has (a
        head that trickles in is bounded by --request_header_timeout instead) and while a request is served."""
        return self._idle_since if self._deadline is None else None

    def unanswered(self) -> tuple[bool, float] | None:
        """For a request of which no answer has been written: whether its body has begun (its head is complete),
        and when its current phase began; None while the connection is idle or an answer is being written."""
        if self._deadline is None or (self._phase == "body" and not self._hold):
            return None
        return self._phase == "body", self._deadline - (self._header_s if self._phase == "headers" else self._body_s)

    def cut(self) -> None:
        """Close the connection now, whatever it is doing (gunicorn's handler sees the end of input and finishes)."""
        try:
            self._sock.shutdown(gsocket.SHUT_RDWR)
        except OSError:
            pass

    def close_when_idle(self) -> None:
        """End a keep-alive connection once it has no request: at once if it waits for a next one none of which has
        arrived (gunicorn's handler then sees the end of input and finishes, instead of holding the worker's drain
        for --graceful_timeout); after its answer, which says `Connection: close`, if one is being answered (the
        answer said keep-alive, and the connection stayed open for gunicorn's keep-alive timeout)."""
        if self.request is not None:
            self.request.must_close = True
        elif self._deadline is None and self._phase == "headers":
            try:
                self._sock.shutdown(gsocket.SHUT_RDWR)
            except OSError:
                pass

    def start_body(self) -> None:
        """A request's headers have arrived: its body is next, and the response's first write is its header block.
        Called again by a request that waited for the server's start-up before reading its body (its clock starts
        once the server is ready to read it)."""
        self._phase, self._deadline = "body", time.monotonic() + self._body_s
        self._hold = True

    def sendall(self, data, *flags) -> None:
        if self._hold:
            self._hold, self._held = False, bytes(data)
            return
        held, self._held = self._held, b""
        if held and len(data) > COALESCE_LIMIT:
            self._send(held)
        elif held:
            data = held + data
        self._send(data, *flags)

    def _send(self, data, *flags) -> None:
        """A write within --request_body_timeout, plus a second for every MIN_BODY_RATE bytes, as a body's read:
        without one, a client that asked and never read kept its connection, and its slot of --max_connections,
        for as long as it liked. Past it the connection breaks as if the client had gone (gunicorn closes it)."""
        deadline = time.monotonic() + self._body_s + len(data) / MIN_BODY_RATE
        self._sock.settimeout(deadline - time.monotonic())
        try:
            self._sock.sendall(data, *flags)
        except OSError:  # a TLS socket's timeout is an SSLError, not a TimeoutError
            if time.monotonic() < deadline:
                raise
            raise BrokenPipeError(errno.EPIPE, "the client did not read its answer in time") from None
        finally:
            self._sock.settimeout(None)

    def sendfile(self, *args, **kwargs):
        """A file's answer (the web UI's assets): each write of it within --request_body_timeout."""
        self.flush()
        self._sock.settimeout(self._body_s)
        try:
            return self._sock.sendfile(*args, **kwargs)
        finally:
            self._sock.settimeout(None)

    def flush(self) -> None:
        """The response is complete: send what is held (the header block of a response without a body)."""
        self._hold = False
        if self._held:
            self.sendall(b"")

    def discard(self) -> None:
        """The response failed before its body: gunicorn answers with an error or closes instead."""
        self._hold, self._held = False, b""

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
        except OSError:  # a TLS socket's timeout is an SSLError, not a TimeoutError
            if time.monotonic() < self._deadline:
                raise
            raise ReadDeadline(self._phase) from None
        finally:
            self._sock.settimeout(None)
        if self._phase == "body":
            self._deadline += len(data) / MIN_BODY_RATE
        return data


class SettledConfig:
    """A worker's gunicorn Config, each value read once. gunicorn reads its settings through `Config.__getattr__` and
    `Setting.get` on every use, 23 times a request; a worker's settings never change once it runs (a reload starts
    new workers), so each value is kept here on first use and later reads are plain attribute reads."""

    def __init__(self, cfg) -> None:
        self._cfg = cfg

    def __getattr__(self, name: str):
        value = getattr(self._cfg, name)
        setattr(self, name, value)
        return value


OBJECT_STORE_CLIENTS = ("s3fs", "gcsfs", "adlfs")


class RealSelectorPolicy(asyncio.DefaultEventLoopPolicy):
    """asyncio loops with the operating system's selector. The object stores' clients (exported_models/storage.py)
    run an asyncio loop on a real thread of its own; with gevent's selector it would wait on that thread's hub, which
    has nothing else to run, and die (`LoopExit: This operation would block forever`)."""

    def new_event_loop(self) -> asyncio.AbstractEventLoop:
        return asyncio.SelectorEventLoop(monkey.get_original("selectors", "DefaultSelector")())


class PetalGeventWorker(GeventWorker):
    """Settings come from gunicorn's config; Petal's are set by serving/process/server.py as `petal_*` attributes
    (`petal_tls`: the TLSOptions and the paths of the certificate and key files, or None)."""

    petal_max_connections = 1000
    petal_header_timeout = 10.0
    petal_body_timeout = 10.0
    petal_os_threads = 4
    petal_tls: tuple[TLSOptions, str, str] | None = None

    def patch(self) -> None:
        # The master imported an object store's client to read a file in a bucket (--model_config_file=s3://…):
        # its asyncio loop runs on a real thread (RealSelectorPolicy) and needs the real ssl, which gevent's patch,
        # coming after the import, breaks (RecursionError in SSLContext). The REST port's TLS is gevent's own
        # (`tls_context`), patched or not.
        keep_ssl = any(client in sys.modules for client in OBJECT_STORE_CLIENTS)
        monkey.patch_all(thread=False, queue=False, ssl=not keep_ssl)
        asyncio.set_event_loop_policy(RealSelectorPolicy())
        self.sockets: list[gsocket.socket] = [gsocket.socket(s.FAMILY, gsocket.SOCK_STREAM, fileno=s.sock.detach())
                                              for s in self.sockets]
        threads.serve_on_gevent_loop(self.petal_os_threads, alone=lambda: self._open == 1)
        self.start_serving()

    def start_serving(self) -> None:
        """What `handle` keeps for the connections it serves. Apart from `patch`, which changes the whole process,
        so that a test can hand `handle` a plain socket."""
        self.cfg: Any = SettledConfig(self.cfg)
        self._open = 0
        self._clients: set[DeadlineSocket] = set()
        self._tls = tls_context(*self.petal_tls) if self.petal_tls else None

    def handle(self, listener, client, addr) -> None:
        peer = addr[0] if isinstance(addr, tuple) and addr else str(addr)
        if self._open >= self.petal_max_connections and not self.make_room(peer):
            self.refuse(client)
            return
        self._open += 1
        try:
            client.setblocking(1)
            if self._tls is not None:
                client = self.handshake(client, addr)
                if client is None:
                    return
            sock = DeadlineSocket(client, self.petal_header_timeout, self.petal_body_timeout, peer)
            self._clients.add(sock)
            try:
                super().handle(listener, sock, addr)
            finally:
                self._clients.discard(sock)
        finally:
            self._open -= 1

    def make_room(self, peer: str) -> bool:
        """Make room for a new connection from `peer`. First by closing the connection that has waited longest for a
        next request, which HTTP/1.1 allows at any time (a client resends a request whose keep-alive connection
        closed under it): of the address that holds the most connections if that holds more than `peer` does, else
        of any address holding as many as `peer` (a peer with many never closes the one of a client with fewer).
        Failing that, by cutting a connection of that greediest address whose request is unanswered, a head
        still arriving first (a slow-loris's), the oldest first: so a client that opens --max_connections
        connections and trickles requests on all of them cannot keep another client out. False when every
        connection has a request arriving or being served and no address holds more than `peer`: one address
        alone, or several holding as many, still meet the 503. The closed one leaves `_clients` at once, so the
        next arrival closes another, and `_open` when its handler has seen the end of input and finished, on the
        loop's next turn."""
        held = Counter(sock.peer for sock in self._clients)
        top = max(held, key=held.__getitem__, default=None)
        greediest = top if top is not None and held[top] > held[peer] else None
        idle = [(since, sock) for sock in self._clients
                if (since := sock.idle_since()) is not None and held[sock.peer] >= held[peer]]
        idle = [pair for pair in idle if pair[1].peer == greediest] or idle
        if idle:
            longest = min(idle, key=lambda pair: pair[0])[1]
            self._clients.discard(longest)
            longest.close_when_idle()
            return True
        unanswered = [(state, sock) for sock in self._clients if sock.peer == greediest
                      and (state := sock.unanswered()) is not None]
        if not unanswered:
            return False
        oldest = min(unanswered, key=lambda pair: pair[0])[1]
        self._clients.discard(oldest)
        oldest.cut()
        logger.info("connection cut for a fairer share", extra={"fields": {"peer": oldest.peer,
                                                                           "connections": held[oldest.peer]}})
        return True

    def close_idle_connections(self) -> None:
        """Part of the worker's drain (serving/process/worker.py `Worker.drain`): keep-alive connections waiting for a
        next request close now; those with a request in flight close once it is answered."""
        for sock in list(self._clients):
            sock.close_when_idle()

    def refuse(self, client) -> None:
        """503 in plain HTTP; a TLS client is only closed, since answering it would first cost a handshake, the
        very work an overloaded worker is shedding."""
        try:
            if self._tls is None:
                body = json.dumps({"error": "Too many connections to this worker; retry shortly"}).encode()
                client.sendall(_REFUSAL % (len(body), body))
        finally:
            client.close()

    def handshake(self, client, addr):
        """The TLS handshake, whole within --request_header_timeout (a timeout on each read let a ClientHello sent a
        byte at a time hold its connection for ever); None (and the connection closed) if it fails."""
        try:
            secure = self._tls.wrap_socket(client, server_side=True, do_handshake_on_connect=False)
            with Timeout(self.petal_header_timeout, TimeoutError("the TLS handshake did not finish in time")):
                secure.do_handshake()
        except OSError as error:  # ssl.SSLError and timeouts alike: a refused certificate, plain HTTP, a stall
            logger.info("TLS handshake failed", extra={"fields": {"peer": str(addr), "error": str(error)}})
            client.close()
            return None
        secure.settimeout(None)
        return secure

    def handle_request(self, listener_name, req, sock, addr):
        sock.start_body()
        sock.request = req
        try:
            super().handle_request(listener_name, req, sock, addr)  # gevent's returns nothing
            sock.flush()
        except StopIteration:  # gunicorn's way of saying the response is complete and the connection closes
            sock.flush()
            raise
        except BaseException:
            sock.discard()
            raise
        finally:
            sock.request = None
            sock.idle()
