"""The gRPC port against clients that hold it up, on a real `petal serve` over loopback HTTP/2: a call without a valid
token is refused before any of its message is read; a call whose message does not arrive within
--request_body_timeout is ended DEADLINE_EXCEEDED and its receive slot passes on at once; one connection may open
at most --grpc_max_threads streams. Calls no grpc client would make (a message declared and never finished,
hundreds of streams without one) are written as raw HTTP/2 frames (serving/protocols/grpc_api/gate.py, server.py)."""
from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

from grpc_calls import CHANNEL_OPTIONS, predict_request
from server_harness import access_lines, run_server, tiny_model_base, worker_pid

PREDICT_TOKEN = "predict-token-0123456789abcdef"
ADMIN_TOKEN = "admin-token-0123456789abcdef"
BODY_TIMEOUT_S = 2.0  # --request_body_timeout
THREADS = 16  # --grpc_max_threads: also the streams a connection may open
# --memory_budget_bytes of 1 GiB leaves half to bodies, which receive two 64 MiB messages a slot: 4 receive slots.
RECEIVERS = 4
DECLARED = 60_000_000  # the message size a stalled call's first DATA frame declares
PREDICT = "/tensorflow.serving.PredictionService/Predict"
RELOAD = "/tensorflow.serving.ModelService/HandleReloadConfigRequest"
STREAM = "/inference.GRPCInferenceService/ModelStreamInfer"  # V2's one stream, which Petal does not serve
SLACK_S = 1.5  # for a loaded two-core machine
MAX_CONNECTIONS = 40  # --max_connections: gRPC connections per worker too
KEEPALIVE_S = 3.0  # --keepalive_timeout: a gRPC connection without a call closes after it


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tokens = tmp_path_factory.mktemp("attacks") / "tokens"
    tokens.write_text(f"{PREDICT_TOKEN}\n{ADMIN_TOKEN} admin\n")
    with run_server(f"--model_base_path={tiny_model_base()}", "--model_name=flowers", "--workers=1",
                    f"--auth_token_file={tokens}", f"--request_body_timeout={BODY_TIMEOUT_S}",
                    "--memory_budget_bytes=1073741824", f"--grpc_max_threads={THREADS}", "--access_log",
                    f"--max_connections={MAX_CONNECTIONS}", f"--keepalive_timeout={KEEPALIVE_S}") as running:
        yield running


@pytest.fixture(scope="module")
def channel(server):
    with grpc.insecure_channel(server.grpc_target, options=CHANNEL_OPTIONS) as channel:
        yield channel


def bearer(token: str) -> tuple[str, str]:
    return ("authorization", f"Bearer {token}")


def timed_predict(channel: grpc.Channel, timeout: float) -> tuple[grpc.StatusCode, float]:
    """A normal Predict with the predict token: its status and how long it took."""
    started = time.monotonic()
    try:
        prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(
            predict_request(), metadata=[bearer(PREDICT_TOKEN)], timeout=timeout)
        code = grpc.StatusCode.OK
    except grpc.RpcError as err:
        code = err.code()
    return code, time.monotonic() - started


def silent(stop: threading.Event) -> Iterator[bytes]:
    """A request stream that sends no message until `stop` (a call's headers alone, its message never coming)."""
    stop.wait(60)
    yield from ()


# --- raw HTTP/2 (RFC 9113), as gRPC frames it -------------------------------------------------------------------------
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY = 0, 1, 3, 4, 6, 7
END_STREAM, ACK, END_HEADERS = 0x1, 0x1, 0x4
MAX_CONCURRENT_STREAMS, REFUSED_STREAM = 0x3, 0x7


def frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return len(payload).to_bytes(3, "big") + bytes((kind, flags)) + stream.to_bytes(4, "big") + payload


def literal(name: str, value: str) -> bytes:
    """An HPACK literal header field without indexing, neither part Huffman-coded (lengths under 127)."""
    return b"\x00" + bytes((len(name),)) + name.encode() + bytes((len(value),)) + value.encode()


class H2:
    """One raw HTTP/2 connection to the gRPC port. `call` opens a stream: its HEADERS, and optionally a first DATA
    frame; `pump` reads what the server sends, answering its SETTINGS and PINGs so the connection stays healthy,
    and notes each stream's end (trailers, or a reset and its code) and when it came."""

    def __init__(self, target: str):
        host, port = target.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=5)
        self.sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + frame(SETTINGS, 0, 0, b""))
        self.next_stream, self.pending = 1, b""
        self.settings: dict[int, int] | None = None  # the server's, once received
        self.ended: dict[int, tuple[str, float]] = {}  # stream: ("trailers" or "reset <code>", time.monotonic())
        self.goaway: bytes | None = None
        until = time.monotonic() + 5
        while self.settings is None and time.monotonic() < until:  # acknowledged at once: the server waits for that
            self.pump(0.1)
        assert self.settings is not None, "the server sent no SETTINGS"

    def call(self, path: str, token: str | None, first_data: bytes | None = None) -> int:
        stream, self.next_stream = self.next_stream, self.next_stream + 2
        fields = [(":method", "POST"), (":scheme", "http"), (":path", path), (":authority", "127.0.0.1"),
                  ("content-type", "application/grpc"), ("te", "trailers")]
        fields += [bearer(token)] if token else []
        block = frame(HEADERS, END_HEADERS, stream, b"".join(literal(k, v) for k, v in fields))
        self.sock.sendall(block + (frame(DATA, 0, stream, first_data) if first_data is not None else b""))
        return stream

    def pump(self, seconds: float) -> None:
        until = time.monotonic() + seconds
        while (left := until - time.monotonic()) > 0:
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(1 << 16)
            except TimeoutError:
                return
            if not data:
                return
            self.read(self.pending + data)

    def read(self, buffer: bytes) -> None:
        at, replies = 0, b""
        while len(buffer) - at >= 9:
            length = int.from_bytes(buffer[at:at + 3], "big")
            if len(buffer) - at < 9 + length:
                break
            kind, flags = buffer[at + 3], buffer[at + 4]
            stream = int.from_bytes(buffer[at + 5:at + 9], "big") & 0x7FFFFFFF
            payload = buffer[at + 9:at + 9 + length]
            at += 9 + length
            if kind == SETTINGS and not flags & ACK:
                self.settings = {int.from_bytes(payload[i:i + 2], "big"): int.from_bytes(payload[i + 2:i + 6], "big")
                                 for i in range(0, len(payload), 6)}
                replies += frame(SETTINGS, ACK, 0, b"")
            elif kind == PING and not flags & ACK:
                replies += frame(PING, ACK, 0, payload)
            elif kind == RST_STREAM:
                self.ended.setdefault(stream, (f"reset {int.from_bytes(payload, 'big')}", time.monotonic()))
            elif kind == GOAWAY:
                self.goaway = payload
            elif kind == HEADERS and flags & END_STREAM:
                self.ended.setdefault(stream, ("trailers", time.monotonic()))
        self.pending = buffer[at:]
        if replies:
            self.sock.sendall(replies)

    def close(self) -> None:
        self.sock.close()


def stalled_message() -> bytes:
    """A DATA frame's payload that declares a DECLARED-byte message and carries 200 bytes of it."""
    return b"\x00" + DECLARED.to_bytes(4, "big") + b"\x0a\x00" * 100


# --- tokens: refused on the metadata, before the message ----------------------------------------------------------
@pytest.mark.parametrize(("method", "token", "code", "details"), [
    (PREDICT, None, grpc.StatusCode.UNAUTHENTICATED, "Missing bearer token: send 'Authorization: Bearer <token>'"),
    (PREDICT, "nope-nope-nope-nope-nope", grpc.StatusCode.UNAUTHENTICATED, "Invalid bearer token"),
    (RELOAD, PREDICT_TOKEN, grpc.StatusCode.PERMISSION_DENIED, "Model control needs a token with the admin role"),
    # a stream method's token is checked as a unary one's: no client learns what is served without one
    (STREAM, None, grpc.StatusCode.UNAUTHENTICATED, "Missing bearer token: send 'Authorization: Bearer <token>'"),
    (STREAM, PREDICT_TOKEN, grpc.StatusCode.UNIMPLEMENTED, "ModelStreamInfer is not served by Petal"),
], ids=["no-token", "wrong-token", "predict-token-reloads", "stream-no-token", "stream-with-token"])
def test_a_call_without_a_valid_token_is_refused_before_it_sends_its_message(channel, method, token, code, details):
    """The call sends its headers and never its message: the answer must not wait for it."""
    stop = threading.Event()
    started = time.monotonic()
    try:
        channel.stream_unary(method, request_serializer=bytes, response_deserializer=bytes)(
            silent(stop), metadata=[bearer(token)] if token else None, timeout=BODY_TIMEOUT_S / 2)
        pytest.fail("the call was served")
    except grpc.RpcError as err:
        assert (err.code(), err.details()) == (code, details), "refused on its metadata, the same status as ever"
    finally:
        stop.set()
    assert time.monotonic() - started < BODY_TIMEOUT_S / 2


def test_a_large_message_without_a_token_is_neither_received_nor_held(server, channel):
    """Three 40 MB Predicts without a token: each refused with nothing of it received (bytes_in 0), and the worker
    does not grow by their size."""
    request = predict_pb2.PredictRequest()
    request.model_spec.name = "flowers"
    request.inputs["image_bytes"].string_val.append(b"\xff\xd8" + b"x" * 40_000_000)
    stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
    worker = worker_pid(server.proc.pid)
    before = peak_rss(worker)
    for i in range(3):
        with pytest.raises(grpc.RpcError) as caught:
            stub.Predict(request, metadata=[("x-request-id", f"big-tokenless-{i}")], timeout=30)
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    grown = peak_rss(worker) - before
    ids = {f"big-tokenless-{i}" for i in range(3)}
    lines = [line for line in access_lines(server, lambda found: ids <= {x.get("request_id") for x in found})
             if line.get("request_id") in ids]
    assert len(lines) == 3 and all(line["status"] == "UNAUTHENTICATED" and line["bytes_in"] == 0 for line in lines), \
        lines
    assert grown < 32 * 2**20, f"the worker's peak grew by {grown >> 20} MiB for messages it refused"


def peak_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


# --- a message that does not arrive ---------------------------------------------------------------------------------
def test_stalled_messages_lose_their_slots_at_the_body_timeout_and_a_normal_call_gets_one(server, channel):
    """RECEIVERS + 2 calls, each on its own connection, declare a 60 MB message, send 200 bytes of it and stall (as
    a client on a dead link would, its connection alive): every receive slot is taken and two calls wait for one.
    A normal Predict made meanwhile waits at most the body timeout and is served; every stalled call is ended by the
    server at the body timeout."""
    attackers = [H2(server.grpc_target) for _ in range(RECEIVERS + 2)]
    try:
        opened = time.monotonic()
        streams = [h2.call(PREDICT, PREDICT_TOKEN, stalled_message()) for h2 in attackers]
        time.sleep(0.3)
        code, took = timed_predict(channel, timeout=BODY_TIMEOUT_S + 3 * SLACK_S)
        assert code == grpc.StatusCode.OK and took < BODY_TIMEOUT_S + SLACK_S, (code, took)
        while time.monotonic() < opened + BODY_TIMEOUT_S + SLACK_S \
                and not all(stream in h2.ended for h2, stream in zip(attackers, streams, strict=True)):
            for h2 in attackers:
                h2.pump(0.02)
        ended = [h2.ended.get(stream) for h2, stream in zip(attackers, streams, strict=True)]
        assert all(ended), f"stalled calls still open past the body timeout: {ended}"
    finally:
        for h2 in attackers:
            h2.close()


def test_a_call_whose_message_never_comes_ends_deadline_exceeded_and_is_logged(server, channel):
    stop = threading.Event()
    started = time.monotonic()
    try:
        channel.stream_unary(PREDICT, request_serializer=bytes, response_deserializer=bytes)(
            silent(stop), metadata=[bearer(PREDICT_TOKEN), ("x-request-id", "never-sends")],
            timeout=BODY_TIMEOUT_S + 3 * SLACK_S)
        pytest.fail("the call was served")
    except grpc.RpcError as err:
        assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "did not arrive in time" in err.details() and "--request_body_timeout" in err.details(), err.details()
    finally:
        stop.set()
    assert BODY_TIMEOUT_S - 0.2 < time.monotonic() - started < BODY_TIMEOUT_S + SLACK_S
    lines = access_lines(server, lambda found: any(x.get("request_id") == "never-sends" for x in found))
    line = next(x for x in lines if x.get("request_id") == "never-sends")
    assert (line["status"], line["bytes_in"], line["path"]) == ("DEADLINE_EXCEEDED", 0, PREDICT)


# --- streams per connection -----------------------------------------------------------------------------------------
def test_one_connection_opens_at_most_grpc_max_threads_streams(server, channel):
    """The server advertises MAX_CONCURRENT_STREAMS = --grpc_max_threads and refuses streams past it; 300 calls
    without a message on one connection delay a normal call by at most the body timeout."""
    h2 = H2(server.grpc_target)
    try:
        assert h2.settings.get(MAX_CONCURRENT_STREAMS) == THREADS, h2.settings
        h2.sock.sendall(b"".join(frame(HEADERS, END_HEADERS, 1 + 2 * i, b"".join(literal(k, v) for k, v in (
            (":method", "POST"), (":scheme", "http"), (":path", PREDICT), (":authority", "127.0.0.1"),
            ("content-type", "application/grpc"), ("te", "trailers"), bearer(PREDICT_TOKEN)))) for i in range(300)))
        time.sleep(0.3)
        code, took = timed_predict(channel, timeout=BODY_TIMEOUT_S + 3 * SLACK_S)
        assert code == grpc.StatusCode.OK and took < BODY_TIMEOUT_S + SLACK_S, (code, took)
        h2.pump(1.0)
        refused = sum(1 for how, _ in h2.ended.values() if how == f"reset {REFUSED_STREAM}")
        assert refused >= 300 - THREADS, h2.ended
    finally:
        h2.close()



def test_message_less_calls_past_the_slots_and_places_to_wait_end_at_once_and_a_normal_call_is_served(
        server, channel):
    """Four connections of THREADS message-less calls each, more than the worker's receive slots and its places to
    wait for one (twice the threads): the calls past them are refused, or cut for a fairer share, RESOURCE_EXHAUSTED
    at once, and a normal Predict made meanwhile takes a slot from a connection holding more and is served at once.
    Before the bound the calls queued behind the threads without end, and the normal call waited for two rounds of
    body timeouts ahead of it; before the fair shares (2026-12-07) it was refused or waited a body timeout."""
    attackers = [H2(server.grpc_target) for _ in range(4)]
    try:
        opened = time.monotonic()
        streams = [[h2.call(PREDICT, PREDICT_TOKEN) for _ in range(THREADS)] for h2 in attackers]
        for h2 in attackers:
            h2.pump(0.2)
        code, took = timed_predict(channel, timeout=BODY_TIMEOUT_S + 3 * SLACK_S)
        assert code == grpc.StatusCode.OK and took < SLACK_S, (code, took)
        ended_at_once = sum(1 for h2, ids in zip(attackers, streams, strict=True) for stream in ids
                            if stream in h2.ended and h2.ended[stream][1] < opened + SLACK_S)
        assert ended_at_once >= 4 * THREADS - RECEIVERS - 2 * THREADS, ended_at_once
    finally:
        for h2 in attackers:
            h2.close()
        settled(channel)


def settled(channel: grpc.Channel) -> None:
    """Wait until the stalled calls have left the worker (each within the body timeout), so that the module's later
    tests, in whatever order they run, meet a worker that takes calls again."""
    until = time.monotonic() + BODY_TIMEOUT_S + 4 * SLACK_S
    while timed_predict(channel, timeout=BODY_TIMEOUT_S + SLACK_S)[0] != grpc.StatusCode.OK:
        assert time.monotonic() < until, "the worker still refuses calls after the attack"
        time.sleep(0.2)


def test_connections_past_max_connections_are_closed_and_idle_ones_after_the_keepalive_timeout(server, channel):
    """Idle connections kept every file descriptor of the worker (REST's port went with them): past
    --max_connections grpc closes a new one at once, and one without a call closes after --keepalive_timeout."""
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + frame(SETTINGS, 0, 0, b"")
    host, port = server.grpc_target.rsplit(":", 1)
    sockets = [socket.create_connection((host, int(port)), timeout=5) for _ in range(MAX_CONNECTIONS + 10)]
    try:
        for sock in sockets:
            sock.sendall(preface)
        assert MAX_CONNECTIONS - 10 < sum(not closed(sock, 0.05) for sock in sockets) <= MAX_CONNECTIONS
        time.sleep(KEEPALIVE_S + SLACK_S)
        assert all(closed(sock, 0.05) for sock in sockets)
        assert timed_predict(channel, timeout=5)[0] == grpc.StatusCode.OK
    finally:
        for sock in sockets:
            sock.close()


def closed(sock: socket.socket, wait: float) -> bool:
    """Whether the server has closed the connection (what it sent meanwhile is read and dropped)."""
    sock.settimeout(wait)
    try:
        while sock.recv(1 << 16):
            pass
        return True
    except TimeoutError:
        return False
    except OSError:
        return True
