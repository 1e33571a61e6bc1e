"""Petal's serving speed against the in-process limit and a naive Flask baseline (docs/protocols.md), per protocol.

    .venv/bin/python benchmarks/serving.py [--model_base_path exported_models/flowers | --model mobilenet_v2]
        [--duration 4]

1. The images are what users send: synthetic flower photos from training.synth.render, 480x360 JPEGs (the
   primary table), and 64x64 thumbnails (so the case where HTTP overhead dominates is not hidden).
2. The limit: the exported `serving_default` signature called in-process on batches of the same JPEGs (best
   images/s over batch sizes, called by one thread or by one per core, under TensorFlow's default thread pools and
   under Petal's one intra-op thread per caller), and its fastest single-image latency, measured in every round in
   its turn among the servers (the median round is the one used).
3. Petal (`petal serve`, defaults: the gevent front end) is driven over REST predict
   ({"instances": [{"b64": JPEG}]}), gRPC Predict (a DT_STRING TensorProto, the way TF Serving's example clients
   send it) and KServe V2 infer with Triton's binary BYTES extension; a second Petal with `--worker_class=gthread`
   (the older front end), with --ab_args a third Petal with those flags added, with --before an earlier
   checkout's Petal over all three protocols (a change on the request path against the previous main), and the baseline
   (benchmarks/naive_flask.py) get the same REST body. Each run is a separate load-generator process on loopback:
   closed loop, one keep-alive connection per client, fixed concurrency, warmup, then a fixed duration, with whole
   requests built before the clock starts. HTTP clients share one selector thread (raw sockets), and so do gRPC
   clients (HTTP/2 on raw sockets, a connection each): grpcio's own client costs 3-4 times their CPU a call.
4. The load generator is checked not to be the bottleneck: its ceiling on a trivial endpoint (/healthz, gRPC
   health Check) at the same concurrency is printed beside the rates measured, and so is its own CPU per request.
5. CPU is accounted per image (the server's whole process tree from /proc, the load generator's own), which gives
   the bound the cores allow: every image needs the model's best-batch CPU plus at least a trivial request's CPU,
   client included, since both share this machine. A ratio to the limit is read against that bound. Each server's
   CPU per image is a column of the table, and at the first concurrency it is also compared with the CPU of one
   in-process single-image call, and its threads' context switches per request are counted.
Everything runs side by side in one run, in interleaved rounds (each cell is the median round; each round runs the
columns in an order of its own, shuffled from --seed, so no column always follows another, and starts every server
afresh, so no server's own luck lasts beyond its round), so the ratios hold even though absolute times on a shared
machine do not. Against an earlier checkout, each round's own ratio is
printed too, lowest to highest: a ratio of medians means something only beside that spread.
"""
from __future__ import annotations

import argparse
import base64
import contextlib
import dataclasses
import functools
import http.client
import json
import os
import pickle
import random
import selectors
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from load_tests.launcher import Server

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
MODEL = "flowers"
PREDICT_PATH = f"/v1/models/{MODEL}:predict"
INFER_PATH = f"/v2/models/{MODEL}/infer"
GRPC_PREDICT = "/tensorflow.serving.PredictionService/Predict"
GRPC_HEALTH = "/grpc.health.v1.Health/Check"
PHOTOS = 8  # distinct photos per image set, cycled through by every client
LIMIT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)


# --- load generator (runs in its own process; imports neither TensorFlow nor the server) ----------------------

@dataclasses.dataclass
class Requests:
    """What one load-generator run sends: `bodies` cycled per client, over HTTP (method, path, headers) or gRPC."""
    protocol: str  # "http" or "grpc"
    port: int
    path: str
    bodies: list[bytes]
    headers: dict[str, str]
    server_pid: int  # its CPU time (with its worker processes) is sampled over the measured window


def server_usage(pid: int) -> tuple[float, int]:
    """User + system CPU seconds of a server's whole process tree (gunicorn's master, its workers, anything they
    started), with the CPU of the children each has reaped, and the context switches of its live threads, from
    /proc: every live process descended from `pid`."""
    stats = process_stats()
    tree = process_tree(pid, stats)
    ticks = sum(int(f) for p in tree if p in stats for f in stats[p][11:15])
    switches = sum(int(line.split()[1]) for p in tree for task in _list(f"/proc/{p}/task")
                   for line in _read(f"/proc/{p}/task/{task}/status").splitlines() if "ctxt_switches" in line)
    return ticks / os.sysconf("SC_CLK_TCK"), switches


def process_stats() -> dict[int, list[str]]:
    """Every live process's /proc/PID/stat fields after its name: [1] is the parent; [11]-[14] utime, stime, cutime,
    cstime."""
    stats: dict[int, list[str]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            fields = _read(f"/proc/{name}/stat").rsplit(")", 1)[-1].split()
            if len(fields) > 14:
                stats[int(name)] = fields
    return stats


def process_tree(pid: int, stats: dict[int, list[str]]) -> set[int]:
    """`pid` and every live process descended from it, of `process_stats()`."""
    tree, grown = {pid}, True
    while grown:
        found = {p for p, fields in stats.items() if int(fields[1]) in tree} - tree
        tree |= found
        grown = bool(found)
    return tree


def _list(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _http_payloads(requests: Requests) -> list[bytes]:
    """Whole HTTP/1.1 requests, built once, so sending one is a single write."""
    method = "POST" if requests.bodies[0] else "GET"
    head = f"{method} {requests.path} HTTP/1.1\r\nHost: 127.0.0.1\r\n" + "".join(
        f"{k}: {v}\r\n" for k, v in requests.headers.items())
    return [(head + (f"Content-Length: {len(b)}\r\n" if method == "POST" else "") + "\r\n").encode() + b
            for b in requests.bodies]


def _response_end(buffer: bytes) -> tuple[int, bool] | None:
    """(length, is 200) of the first complete response in `buffer`, or None while it is still arriving."""
    head_end = buffer.find(b"\r\n\r\n")
    if head_end < 0:
        return None
    head = buffer[:head_end].lower()
    at = head.find(b"\r\ncontent-length:")
    if at < 0:
        raise ConnectionError("response without Content-Length")
    line_end = head.find(b"\r\n", at + 2)
    length = int(head[at + 17:line_end if line_end >= 0 else len(head)])
    total = head_end + 4 + length
    return (total, head[9:12] == b"200") if len(buffer) >= total else None


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


class _H1Client:
    """One HTTP/1.1 client on a keep-alive connection: a request is one write of a whole request built in advance,
    its answer complete once its Content-Length has arrived (OK when it is a 200)."""

    def __init__(self, port: int, payloads: list[bytes]):
        self.sock = _connect(port)
        self.payloads = payloads
        self.buffer = b""

    def call(self, n: int) -> None:
        self.sock.sendall(self.payloads[n % len(self.payloads)])

    def read(self, data: bytes) -> bool | None:
        """Feed received bytes: True or False once the answer is whole (a 200 or not), None until then."""
        self.buffer += data
        end = _response_end(self.buffer)
        if end is None:
            return None
        self.buffer = self.buffer[end[0]:]
        return end[1]


# HTTP/2 as gRPC speaks it (RFC 9113): frame types, flags, and the settings this client sends
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_DATA, _HEADERS, _RST_STREAM, _SETTINGS, _PING, _GOAWAY, _WINDOW_UPDATE = 0, 1, 3, 4, 6, 7, 8
_END_STREAM, _ACK = 0x1, 0x1
_MAX_WINDOW = (1 << 31) - 1
_DEFAULT_FRAME = 16384  # the largest frame a peer must accept before its SETTINGS say more


def _frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return len(payload).to_bytes(3, "big") + bytes((kind, flags)) + stream.to_bytes(4, "big") + payload


def _literal(name: str, value: str) -> bytes:
    """An HPACK literal header without indexing and with a literal name (no Huffman): the same bytes every call,
    so the server's decoder never depends on this client's table."""
    return b"\x00" + bytes((len(name),)) + name.encode() + bytes((len(value),)) + value.encode()


def _grpc_head(requests: Requests) -> bytes:
    return b"".join(_literal(k, v) for k, v in ((":method", "POST"), (":scheme", "http"), (":path", requests.path),
                                               (":authority", f"127.0.0.1:{requests.port}"),
                                               ("content-type", "application/grpc"), ("te", "trailers")))


class _H2Client:
    """One gRPC client on a raw HTTP/2 connection: a unary call is its HEADERS frame (a header block built once)
    and its message's DATA frames, written at once as far as the server's flow-control windows allow and the rest as
    they open; its answer is read frame by frame. It is OK when a response message came and the stream ended after
    it (a failed call ends with trailers only, or a reset, and no message). This client opens its own receive
    windows to the maximum at once, so the server never waits for it."""

    def __init__(self, requests: Requests):
        self.sock = _connect(requests.port)
        self.bodies = requests.bodies
        self.head = _grpc_head(requests)
        self.stream, self.send_window, self.initial_window, self.stream_window = -1, 65535, 65535, 65535
        self.unsent = b""  # the rest of the current call's message, for when the server's windows open
        self.pending = b""  # bytes of a frame not complete yet
        self.got_message = False
        self.received = 0  # DATA bytes not yet given back to the server's connection window
        settings = (4).to_bytes(2, "big") + _MAX_WINDOW.to_bytes(4, "big")  # SETTINGS_INITIAL_WINDOW_SIZE
        self.sock.sendall(_H2_PREFACE + _frame(_SETTINGS, 0, 0, settings)
                          + _frame(_WINDOW_UPDATE, 0, 0, (_MAX_WINDOW - 65535).to_bytes(4, "big")))

    def call(self, n: int) -> None:
        body = self.bodies[n % len(self.bodies)]
        self.stream += 2
        self.got_message = False
        self.stream_window = self.initial_window
        self.unsent = b"\x00" + len(body).to_bytes(4, "big") + body
        self.sock.sendall(_frame(_HEADERS, 0x4, self.stream, self.head) + self._data())  # 0x4: END_HEADERS

    def _data(self) -> bytes:
        """DATA frames for as much of the message as both windows hold; the last one ends the stream."""
        room = min(self.send_window, self.stream_window, len(self.unsent))
        if room <= 0:
            return b""
        chunk, self.unsent = self.unsent[:room], self.unsent[room:]
        self.send_window -= room
        self.stream_window -= room
        return b"".join(_frame(_DATA, 0 if self.unsent or at + _DEFAULT_FRAME < room else _END_STREAM, self.stream,
                               chunk[at:at + _DEFAULT_FRAME]) for at in range(0, room, _DEFAULT_FRAME))

    def read(self, data: bytes) -> bool | None:
        """Feed received bytes: True or False once the current call ended (OK or not), None until then."""
        buffer = self.pending + data
        at, ended, replies = 0, None, []
        while len(buffer) - at >= 9:
            length = int.from_bytes(buffer[at:at + 3], "big")
            if len(buffer) - at < 9 + length:
                break
            kind, flags = buffer[at + 3], buffer[at + 4]
            stream = int.from_bytes(buffer[at + 5:at + 9], "big") & _MAX_WINDOW
            payload = buffer[at + 9:at + 9 + length]
            at += 9 + length
            if kind == _SETTINGS and not flags & _ACK:
                for i in range(0, len(payload), 6):
                    if int.from_bytes(payload[i:i + 2], "big") == 4:  # the server's INITIAL_WINDOW_SIZE
                        value = int.from_bytes(payload[i + 2:i + 6], "big")
                        self.stream_window += value - self.initial_window  # RFC 9113, 6.9.2
                        self.initial_window = value
                replies.append(_frame(_SETTINGS, _ACK, 0, b""))
            elif kind == _PING and not flags & _ACK:
                replies.append(_frame(_PING, _ACK, 0, payload))
            elif kind == _WINDOW_UPDATE and stream in (0, self.stream):
                increment = int.from_bytes(payload, "big") & _MAX_WINDOW
                if stream:
                    self.stream_window += increment
                else:
                    self.send_window += increment
            elif kind == _GOAWAY:
                raise ConnectionError("GOAWAY")
            elif stream == self.stream:
                if kind == _DATA:
                    self.received += length
                    self.got_message |= length > 0
                if kind == _RST_STREAM:
                    ended = False
                elif kind in (_DATA, _HEADERS) and flags & _END_STREAM:
                    ended = self.got_message
        self.pending = buffer[at:]
        if self.received > _MAX_WINDOW // 2:  # give the server back what it has sent, long before it must stop
            replies.append(_frame(_WINDOW_UPDATE, 0, 0, self.received.to_bytes(4, "big")))
            self.received = 0
        if self.unsent and ended is None:
            replies.append(self._data())
        if replies:
            self.sock.sendall(b"".join(replies))
        return ended


def _closed_loop(make_client: Callable[[], _H1Client | _H2Client], concurrency: int, start_at: float,
                 stop_at: float, latencies: list[list[float]], errors: list[int]) -> None:
    """Every client's own connection on one selector in one thread, each making one call at a time (as a blocking
    stub or a keep-alive HTTP client does): a few microseconds of Python a call, where http.client in a thread per
    client costs about 0.15 ms and grpcio's client 0.22–0.48 ms however it is driven (a thread a client, futures,
    asyncio), CPU that on this shared machine comes out of the server's share. A client whose connection fails is
    counted an error and connects again. A call counts when it completes inside [start_at, stop_at], the window
    over which the server's CPU is sampled (one that had to be sent inside it too would lose each client's call in
    flight at the start, about latency / duration of the rate); `latencies` gets the successful ones, `errors` the
    others, which the images/s, percentiles and CPU per image therefore never include."""
    selector = selectors.DefaultSelector()
    clients: list[_H1Client | _H2Client] = []
    sent, counts = [0.0] * concurrency, list(range(concurrency))

    def connect(i: int) -> None:
        client = make_client()
        if i < len(clients):
            clients[i] = client
        else:
            clients.append(client)
        selector.register(client.sock, selectors.EVENT_READ, i)

    def fire(i: int) -> bool:
        sent[i] = time.monotonic()
        if sent[i] >= stop_at:
            return False
        clients[i].call(counts[i])
        counts[i] += 1
        return True

    for i in range(concurrency):
        connect(i)
    open_clients = sum(fire(i) for i in range(concurrency))
    while open_clients:
        events = selector.select(timeout=60)
        if not events:
            raise TimeoutError("no client heard from the server for 60 s")
        for key, _ in events:
            i = key.data
            try:
                data = key.fileobj.recv(1 << 20)
                if not data:
                    raise ConnectionError("closed")
                ended = clients[i].read(data)
                if ended is None:
                    continue
                ok = ended
            except (OSError, ValueError):
                selector.unregister(key.fileobj)
                key.fileobj.close()
                connect(i)
                ok = False
            done = time.monotonic()
            if start_at <= done <= stop_at:  # counted by when it completed, as the server's CPU is sampled
                if ok:
                    latencies[i].append(done - sent[i])
                else:
                    errors[i] += 1
            open_clients -= not fire(i)
    for client in clients:
        client.sock.close()


def loadgen(requests: Requests, concurrency: int, duration: float, warmup: float) -> dict:
    """Closed loop: each client sends its next request when the previous answer arrives."""
    latencies: list[list[float]] = [[] for _ in range(concurrency)]
    errors = [0] * concurrency
    start_at = time.monotonic() + warmup
    stop_at = start_at + duration
    payloads = _http_payloads(requests) if requests.protocol == "http" else []
    make_client: Callable[[], _H1Client | _H2Client] = (
        functools.partial(_H2Client, requests) if requests.protocol == "grpc" else
        functools.partial(_H1Client, requests.port, payloads))
    failed: list[BaseException] = []

    def clients() -> None:
        try:
            _closed_loop(make_client, concurrency, start_at, stop_at, latencies, errors)
        except BaseException as error:  # a run whose clients broke down measured nothing: say so, do not report it
            failed.append(error)
    thread = threading.Thread(target=clients)
    thread.start()
    time.sleep(max(0.0, start_at - time.monotonic()))
    own, (server, switches) = time.process_time(), server_usage(requests.server_pid)
    time.sleep(max(0.0, stop_at - time.monotonic()))
    after = server_usage(requests.server_pid)
    own, server, switches = time.process_time() - own, after[0] - server, after[1] - switches
    thread.join()
    if failed:
        raise failed[0]
    flat = np.array([x for per in latencies for x in per]) * 1000
    percentile = (lambda q: float(np.percentile(flat, q))) if flat.size else (lambda q: float("nan"))
    return {"requests": int(flat.size), "errors": int(sum(errors)), "rps": flat.size / duration,
            "p50": percentile(50), "p95": percentile(95), "p99": percentile(99),
            "loadgen_cpu_share": own / duration, "loadgen_cpu_ms": 1000 * own / max(1, flat.size),
            "server_cpu_share": server / duration, "server_cpu_ms": 1000 * server / max(1, flat.size),
            "server_switches": switches / max(1, flat.size)}


def median_run(runs: list[dict]) -> dict:
    """The run with the median images/s (its latencies and CPU with it, so a row stays one real run)."""
    return sorted(runs, key=lambda r: r["rps"])[len(runs) // 2]


def run_loadgen(requests: Requests, levels: list[int], duration: float, warmup: float) -> dict[int, dict]:
    """One load-generator process for every concurrency level of one column (so its start-up is paid once)."""
    with tempfile.NamedTemporaryFile(suffix=".pickle", delete=False) as f:
        pickle.dump(dataclasses.asdict(requests), f)  # plain data: the loader need not import this module
    try:
        out = subprocess.run([sys.executable, __file__, "--_loadgen", f.name, ",".join(map(str, levels)),
                              str(duration), str(warmup)], check=True, capture_output=True, text=True)
    finally:
        os.unlink(f.name)
    return {int(c): r for c, r in json.loads(out.stdout).items()}


def loadgen_main(argv: list[str]) -> int:
    path, levels, duration, warmup = argv
    with open(path, "rb") as f:
        requests = Requests(**pickle.load(f))
    print(json.dumps({c: loadgen(requests, int(c), float(duration), float(warmup)) for c in levels.split(",")}))
    return 0


# --- request bodies, one per photo, per protocol --------------------------------------------------------------

def rest_requests(port: int, pid: int, photos: list[bytes]) -> Requests:
    bodies = [json.dumps({"instances": [{"b64": base64.b64encode(p).decode()}]}).encode() for p in photos]
    return Requests("http", port, PREDICT_PATH, bodies, {"Content-Type": "application/json"}, pid)


def petal_rest_requests(server, photos: list[bytes]) -> Requests:
    """REST predict requests for a `petal serve` started by load_tests.launcher."""
    return rest_requests(server.rest_port, server.proc.pid, photos)


def v2_binary_requests(port: int, pid: int, photos: list[bytes]) -> Requests:
    """Triton's binary extension: JSON header, then the BYTES element framed (serving/protocols/codec/v2_bytes.py)."""
    from serving.protocols.codec.v2_bytes import frame

    bodies, lengths = [], set()
    for photo in photos:
        raw = frame([photo])
        header = json.dumps({"inputs": [{"name": "image_bytes", "shape": [1], "datatype": "BYTES",
                                         "parameters": {"binary_data_size": len(raw)}}]}).encode()
        bodies.append(header + raw)
        lengths.add(len(header))
    if len(lengths) != 1:  # the header length is a request header, shared by all bodies of a run
        raise ValueError("V2 headers differ in length")
    return Requests("http", port, INFER_PATH, bodies, {"Content-Type": "application/octet-stream",
                                                      "Inference-Header-Content-Length": str(lengths.pop())}, pid)


def grpc_requests(port: int, pid: int, photos: list[bytes]) -> Requests:
    import tensorflow as tf
    from tensorflow_serving.apis import predict_pb2

    bodies = []
    for photo in photos:
        request = predict_pb2.PredictRequest()
        request.model_spec.name = MODEL
        request.inputs["image_bytes"].CopyFrom(tf.make_tensor_proto([photo]))
        bodies.append(request.SerializeToString())
    return Requests("grpc", port, GRPC_PREDICT, bodies, {}, pid)


def requests_for(protocol: str, server, photos: list[bytes]) -> Requests:
    """One of a Petal's three image columns."""
    if protocol == "grpc":
        return grpc_requests(server.grpc_port, server.proc.pid, photos)
    if protocol == "v2":
        return v2_binary_requests(server.rest_port, server.proc.pid, photos)
    return petal_rest_requests(server, photos)


def health_requests(protocol: str, port: int, pid: int) -> Requests:
    if protocol == "grpc":
        return Requests("grpc", port, GRPC_HEALTH, [b""], {}, pid)  # an empty HealthCheckRequest: service ""
    return Requests("http", port, "/healthz", [b""], {}, pid)


# --- the in-process limit -------------------------------------------------------------------------------------

# How the limit calls the model: its signature as TensorFlow's own API gives it, under TensorFlow's thread pools and
# under Petal's split (one intra-op thread per caller on a machine with as many cores as callers), and the way
# Petal's workers call it (serving/core/runtimes.py: a standalone TF2 graph through a Session callable, 1.05-1.18x
# faster than the function), with Petal's split. The limit is the best of them, so a server tuned like Petal is not
# flattered by a limit that is not. Each: (intra-op threads, 0 for TensorFlow's choice; through Petal's loader).
LIMIT = "limit"  # the in-process limit's turn in a round, among the columns
THREAD_SETTINGS = {"TensorFlow's default threads": (0, False), "1 intra-op thread per caller": (1, False),
                   "Petal's Session callable, 1 intra-op thread per caller": (1, True)}


@dataclasses.dataclass
class Limit:
    rate: float  # best images/s
    batch: int  # at this batch size
    callers: int  # with this many threads calling at once
    cpu_ms: float  # CPU per image there
    single_ms: float  # p50 latency of a one-image call
    single_cpu_ms: float = 0.0  # CPU per one-image call
    threads: str = ""  # the THREAD_SETTINGS entry


def in_process_limits(model_dir: str, photos: list[bytes], seconds: float) -> list[Limit]:
    """The limit under each thread setting, each in a process of its own (TensorFlow fixes its pools at start)."""
    with tempfile.NamedTemporaryFile(suffix=".pickle", delete=False) as f:
        pickle.dump(photos, f)
    try:
        return [Limit(**{**json.loads(subprocess.run(
            [sys.executable, __file__, "--_limit", model_dir, f.name, str(seconds), str(intra), str(int(loader))],
            check=True, capture_output=True, text=True).stdout), "threads": name})
            for name, (intra, loader) in THREAD_SETTINGS.items()]
    finally:
        os.unlink(f.name)


def median_limits(rounds: list[list[Limit]]) -> list[Limit]:
    """Each thread setting's limit over the rounds: the round of the median rate, with the median single-image
    latency and CPU of all of them. The limit is measured in every round, in its turn among the servers, so a ratio
    to it compares figures of the same stretch of the machine's drift."""
    medians = []
    for each in zip(*rounds, strict=True):
        middle = sorted(each, key=lambda limit: limit.rate)[len(each) // 2]
        medians.append(dataclasses.replace(middle, single_ms=float(np.median([x.single_ms for x in each])),
                                           single_cpu_ms=float(np.median([x.single_cpu_ms for x in each]))))
    return medians


def limit_main(argv: list[str]) -> int:
    model_dir, path, seconds, intra, loader = argv
    if int(loader):  # a worker has a memory budget by default
        from serving.host.memory import allocate_within_a_budget

        allocate_within_a_budget()
    with open(path, "rb") as f:
        photos = pickle.load(f)
    print(json.dumps(dataclasses.asdict(in_process_limit(model_dir, photos, float(seconds), int(intra),
                                                         bool(int(loader))))))
    return 0


def _call_until(stop_at: float, call, batches: list, size: int, counts: list[int], i: int) -> None:
    """Caller `i` of the limit: batches of `size` photos in turn until `stop_at`, counting images into counts[i]."""
    while time.monotonic() < stop_at:
        call(batches[(counts[i] // size + i) % len(batches)])
        counts[i] += size


def model_call(model_dir: str, loader: bool):
    """The model's probabilities for a batch of JPEGs, and the batch as that call takes it: the signature through
    tf.saved_model.load, or (`loader`) through Petal's own loader as its workers call it."""
    import tensorflow as tf

    if loader:
        from serving.core import runtimes

        model = runtimes.load(model_dir, runtimes.LoadOptions())
        return (lambda batch: model.run("serving_default", {"image_bytes": batch}, ["probabilities"]),
                lambda jpegs: np.array(jpegs, dtype=object))
    signature = tf.saved_model.load(model_dir).signatures["serving_default"]
    return (lambda batch: signature(image_bytes=batch)["probabilities"].numpy()), tf.constant


def in_process_limit(model_dir: str, photos: list[bytes], seconds: float, intra: int, loader: bool) -> Limit:
    """The model called directly on batches of the same photos, by one thread and by one per core (the graph
    alone may not fill every core, and the server runs a batch per core), and one photo at a time."""
    import tensorflow as tf

    from serving.host.cpus import available_cores

    if intra:
        tf.config.threading.set_intra_op_parallelism_threads(intra)
    call, batch_of = model_call(model_dir, loader)
    best = Limit(0.0, 1, 1, 0.0, 0.0)
    for size in LIMIT_BATCH_SIZES:
        batches = [batch_of([photos[(i + j) % len(photos)] for j in range(size)]) for i in range(len(photos))]
        call(batches[0])
        for callers in sorted({1, available_cores()}):
            counts = [0] * callers
            stop_at = time.monotonic() + seconds
            started, cpu = time.monotonic(), time.process_time()
            threads = [threading.Thread(target=_call_until, args=(stop_at, call, batches, size, counts, i))
                       for i in range(callers)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            count = sum(counts)
            rate, cpu = count / (time.monotonic() - started), time.process_time() - cpu
            if rate > best.rate:
                best = Limit(rate, size, callers, 1000 * cpu / count, 0.0)
    singles = [batch_of([p]) for p in photos]
    times = []
    cpu = time.process_time()
    for i in range(max(200, int(seconds * 100))):
        started = time.monotonic()
        call(singles[i % len(singles)])
        times.append(time.monotonic() - started)
    best.single_cpu_ms = 1000 * (time.process_time() - cpu) / len(times)
    best.single_ms = float(np.percentile(times, 50) * 1000)
    return best


# --- servers --------------------------------------------------------------------------------------------------

def wait_for_every_worker(requests: Requests, connections: int = 16, timeout: float = 180.0) -> None:
    """/readyz answers from one worker only; with --workers > 1 the others may still be loading their model,
    so wait until predictions on many fresh connections (spread over the workers by the kernel) all succeed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(_post_ok(requests) for _ in range(connections)):
            return
        time.sleep(0.5)
    raise TimeoutError("not every worker became ready")


def _post_ok(requests: Requests) -> bool:
    conn = http.client.HTTPConnection("127.0.0.1", requests.port, timeout=60)
    try:
        conn.request("POST", requests.path, body=requests.bodies[0], headers=requests.headers)
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()


@contextlib.contextmanager
def baseline_server(model_dir: str) -> Iterator[tuple[int, int]]:
    """benchmarks/naive_flask.py on a free port, as (port, pid), for as long as the block runs; given "--floor"
    rather than a model, its route without a model on Petal's front end."""
    from load_tests.launcher import free_port, get_status

    port = free_port()
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "benchmarks", "naive_flask.py"), model_dir,
                             str(port)], env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 180
        while get_status(f"http://127.0.0.1:{port}/healthz") != 200:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise TimeoutError("baseline did not start")
            time.sleep(0.2)
        yield port, proc.pid
    finally:
        proc.terminate()
        proc.wait(30)


def default_model(image_size: int) -> str:
    """The shipped model when it exists; otherwise an untrained "compact" model exported to a temp dir."""
    from exported_models.model_format import DEFAULT_MODEL_BASE_PATH, exported_versions

    if exported_versions(DEFAULT_MODEL_BASE_PATH):
        return DEFAULT_MODEL_BASE_PATH
    return random_weights_model("compact", image_size, tempfile.mkdtemp(prefix="petal-bench-"))


def random_weights_model(name: str, image_size: int, folder: str) -> str:
    """A model of training/models.py with random weights (nothing downloaded), exported by Petal's own export with
    its JPEG signature into `folder`, once: a later run finds it there."""
    from exported_models.model_format import exported_versions
    from training.export import export_saved_model
    from training.models import build_model
    from training.synth import CLASSES

    base = os.path.join(folder, MODEL)
    if not exported_versions(base):
        export_saved_model(build_model(name, len(CLASSES), image_size), base, list(CLASSES), image_size, version=1)
    return base


def photo_sets(sizes: list[tuple[int, int]]) -> dict[str, list[bytes]]:
    """Synthetic flower photos, one of each class in turn, JPEG-encoded at the recipe's quality range."""
    from training.synth import CLASSES, render

    return {f"{w}x{h}": [render(CLASSES[i % len(CLASSES)], seed=i, size=(w, h)) for i in range(PHOTOS)]
            for w, h in sizes}


@dataclasses.dataclass
class Fleet:
    """One round's servers: this checkout's Petal, the other Petals it is compared with, and the baseline."""
    petal: Server
    others: dict[str, Server]  # column -> a REST-only Petal (gthread, --ab_args)
    before: dict[str, Server]  # checkout name -> its Petal
    baseline: tuple[int, int]  # port, pid

    def requests(self, photos: list[bytes]) -> dict[str, Requests]:
        """Every column's requests for these photos."""
        port, pid = self.baseline
        return {**{protocol: requests_for(protocol, self.petal, photos) for protocol in PROTOCOLS},
                **{col: petal_rest_requests(other, photos) for col, other in self.others.items()},
                "baseline": rest_requests(port, pid, photos),
                **{f"{protocol}@{tree}": requests_for(protocol, earlier, photos)
                   for tree, earlier in self.before.items() for protocol in PROTOCOLS}}


@contextlib.contextmanager
def fleet(args: argparse.Namespace, base: str, model_dir: str, photos: list[bytes]) -> Iterator[Fleet]:
    """Every server of a round, started for that round alone, so that whatever speed a server process has for its
    whole life is drawn anew each round and the median round does not carry one draw into every sample. Kept
    across rounds, one server's REST served 0.66-0.89x another's in each of 4 rounds, both of one request path
    (docs/performance.md, 'Servers started each round')."""
    from load_tests import launcher

    with contextlib.ExitStack() as stack:
        petal = lambda *flags: stack.enter_context(  # noqa: E731
            launcher.running(["--model_name=flowers", f"--model_base_path={base}", *args.petal_args.split(), *flags],
                             cwd=ROOT))
        server = petal()
        others = {"gthread": petal("--port=0", "--worker_class=gthread")}  # REST only: no second gRPC port
        if args.ab_args:
            others["ab"] = petal("--port=0", *args.ab_args.split())
        model = os.path.join(ROOT, base)
        before = {os.path.basename(os.path.normpath(tree)): stack.enter_context(launcher.running(
            ["--model_name=flowers", f"--model_base_path={own_model(tree, model) if args.before_own_model else model}",
             *args.petal_args.split()], cwd=tree, python=interpreter(tree)))
            for tree in args.before}
        baseline = stack.enter_context(baseline_server(model_dir))
        servers = Fleet(server, others, before, baseline)
        for each in (server, *others.values(), *before.values()):
            wait_for_every_worker(petal_rest_requests(each, photos))
        yield servers


def load_generator_ceilings(servers: Fleet, levels: list[int], duration: float, warmup: float,
                            photos: list[bytes]) -> dict[str, dict[int, dict]]:
    """The load generator's rate on trivial requests (/healthz, gRPC health Check) at the busy levels, and on the
    REST column's own requests to the floor: a Flask route on Petal's front end that decodes them and answers a
    constant, with no model."""
    busy = [c for c in levels if c >= 16] or levels[-1:]
    petal = servers.petal
    ceilings = {protocol: run_loadgen(health_requests(protocol, port, petal.proc.pid), busy, duration, warmup)
                for protocol, port in (("http", petal.rest_port), ("grpc", petal.grpc_port))}
    ceilings["flask"] = run_loadgen(health_requests("http", *servers.baseline), busy, duration, warmup)
    with baseline_server("--floor") as floor:
        ceilings["floor"] = run_loadgen(rest_requests(*floor, photos), busy, duration, warmup)
    return ceilings


# --- report ---------------------------------------------------------------------------------------------------

TITLES = {"rest": "Petal REST", "grpc": "Petal gRPC", "v2": "Petal V2 binary",
          "gthread": "Petal REST, gthread front end", "baseline": "naive Flask"}
SHORT = {"rest": "REST", "grpc": "gRPC", "v2": "V2", "baseline": "baseline", "gthread": "gthread", "ab": "A/B"}
PROTOCOLS = ("rest", "grpc", "v2")
STACK = ("tensorflow", "gunicorn", "gevent", "flask", "werkzeug", "grpcio", "orjson", "msgspec", "prometheus_client")


def before_columns(trees: list[str]) -> dict[str, str]:
    """The columns of each --before checkout, keyed "<protocol>@<checkout's name>", with their titles."""
    return {f"{protocol}@{os.path.basename(os.path.normpath(tree))}":
            f"{TITLES[protocol]}, {os.path.basename(os.path.normpath(tree))}"
            for tree in trees for protocol in PROTOCOLS}


def own_model(tree: str, model: str) -> str:
    """The model a --before checkout ships in place of this checkout's, for --before_own_model."""
    return os.path.join(tree, os.path.relpath(model, ROOT))


def interpreter(tree: str) -> str:
    """The Python a --before checkout is served by: its own virtualenv's when it has one (so that a dependency's
    release is measured against the one before, as code is), this one's otherwise."""
    own = os.path.join(tree, ".venv", "bin", "python")
    return own if os.path.exists(own) else sys.executable


def stack_versions(python: str) -> str:
    """The versions of the serving stack's packages an interpreter imports, for the run's header."""
    probe = ("from importlib.metadata import version; print(', '.join(f'{p} {version(p)}' for p in "
             f"{STACK!r}))")
    return subprocess.run([python, "-c", probe], capture_output=True, text=True, check=True).stdout.strip()


def cell(r: dict) -> str:
    return f"{r['rps']:.0f} ({r['p50']:.1f} / {r['p95']:.1f} / {r['p99']:.1f})"


def report(name: str, photos: list[bytes], limits: list[Limit], results: dict[str, dict[int, dict]],
           ceilings: dict[str, dict[int, dict]], levels: list[int], titles: dict[str, str]) -> None:
    """Ratios against the best limit, and the overhead against the fastest single-image call. `titles` names the
    columns in order: TITLES's, then the --ab_args one and the --before ones if any."""
    columns = list(titles)
    mean_kb = sum(map(len, photos)) / len(photos) / 1024
    print(f"\n### {name} photos ({mean_kb:.0f} KB JPEG on average)\n")
    for each in limits:
        print(f"- in-process with {each.threads}: {each.rate:.0f} images/s (batch {each.batch}, {each.callers} "
              f"calling, {each.cpu_ms:.2f} ms CPU per image), single image {each.single_ms:.2f} ms "
              f"({each.single_cpu_ms:.2f} ms CPU)")
    limit = dataclasses.replace(max(limits, key=lambda each: each.rate), cpu_ms=min(each.cpu_ms for each in limits),
                                single_ms=min(each.single_ms for each in limits),
                                single_cpu_ms=min(each.single_cpu_ms for each in limits))
    print(f"- the limit: {limit.rate:.0f} images/s; single image {limit.single_ms:.2f} ms, "
          f"{limit.single_cpu_ms:.2f} ms CPU\n")
    ratios = ([("grpc", "rest"), ("v2", "rest")]
              + [("rest", other) for other in ("baseline", "gthread", "ab") if other in titles]
              + [(col.split("@")[0], col) for col in titles if "@" in col])
    print("| concurrency | " + " | ".join(f"{titles[c]} img/s (p50 / p95 / p99 ms)" for c in columns)
          + " | REST / limit | gRPC / limit | V2 / limit | "
          + " | ".join(f"{SHORT[a]} / {SHORT.get(b, b)}" for a, b in ratios) + " | "
          + " | ".join(f"{titles[c]} server CPU ms/image" for c in columns) + " |")
    print("|---" * (2 * len(columns) + 4 + len(ratios)) + "|")
    for c in levels:
        r = {col: results[col][c] for col in columns}
        print(f"| {c} | " + " | ".join(cell(r[col]) for col in columns)
              + "".join(f" | {r[col]['rps'] / limit.rate:.2f}" for col in ("rest", "grpc", "v2"))
              + "".join(f" | {r[a]['rps'] / max(r[b]['rps'], 1e-9):.2f}" for a, b in ratios)
              + "".join(f" | {r[col]['server_cpu_ms']:.2f}" for col in columns) + " |")
    first = levels[0]
    print(f"\np50 overhead at concurrency {first} over the in-process {limit.single_ms:.2f} ms: "
          + ", ".join(f"{titles[col]} {results[col][first]['p50'] - limit.single_ms:+.2f} ms" for col in columns))
    print(f"server CPU per image at concurrency {first} over the in-process single image's "
          f"{limit.single_cpu_ms:.2f} ms: "
          + ", ".join(f"{titles[col]} {results[col][first]['server_cpu_ms'] / max(limit.single_cpu_ms, 1e-9):.2f}x"
                      for col in columns))
    print(f"server thread switches per request at concurrency {first}: "
          + ", ".join(f"{titles[col]} {results[col][first]['server_switches']:.1f}" for col in columns))
    for c in ceilings["http"]:
        print(f"at concurrency {c}, CPU per image (server + load generator): "
              + ", ".join(f"{titles[col]} {r['server_cpu_ms']:.2f} + {r['loadgen_cpu_ms']:.2f} ms"
                          for col, r in ((col, results[col][c]) for col in columns))
              + f"; load generator ceiling {ceilings['http'][c]['rps']:.0f} req/s on /healthz, "
              f"{ceilings['grpc'][c]['rps']:.0f} on gRPC health Check")
        _bound(limit, ceilings, c)


def spread(samples: dict[str, list[dict[int, dict]]], levels: list[int], titles: dict[str, str]) -> None:
    """Each round's own ratio of a column to its earlier checkout's, lowest to highest: two medians can differ by
    what the machine did between two runs, so a ratio of medians means something only beside this spread. The
    columns run in another order each round, and two identical servers differ by as much here."""
    for col in (c for c in titles if "@" in c):
        mine = col.split("@")[0]
        per_level = []
        for c in levels:
            ratios = sorted(a[c]["rps"] / max(b[c]["rps"], 1e-9)
                            for a, b in zip(samples[mine], samples[col], strict=True))
            per_level.append(f"{c}: {ratios[0]:.2f}–{ratios[-1]:.2f}")
        print(f"{SHORT[mine]} / {titles[col]}, each round's ratio of images/s, lowest–highest, by concurrency: "
              + ", ".join(per_level))


def _bound(limit: Limit, ceilings: dict[str, dict[int, dict]], c: int) -> None:
    """What the cores allow when every image pays the model's least CPU per image (the least of the thread
    settings' best batches) plus the cheapest possible request (the server's and the load generator's CPU for a
    /healthz or health Check on the same machine)."""
    from serving.host.cpus import available_cores

    cores = available_cores()
    servers = {"http": "Petal REST/Petal V2 binary", "grpc": "Petal gRPC",
               "flask": "any Flask app on gunicorn gthread (the baseline's /healthz)",
               "floor": "a Flask route on Petal's front end decoding the REST column's predict and answering a "
                        "constant (benchmarks/naive_flask.py --floor)"}
    for protocol, name in servers.items():
        trivial = ceilings[protocol][c]
        per_image = limit.cpu_ms + trivial["server_cpu_ms"] + trivial["loadgen_cpu_ms"]
        bound = 1000 * cores / per_image
        request = "its request" if protocol == "floor" else "a trivial request"
        print(f"  {name}: {cores} cores / ({limit.cpu_ms:.2f} model + "
              f"{trivial['server_cpu_ms']:.2f} server + {trivial['loadgen_cpu_ms']:.2f} load generator ms for "
              f"{request}) = at most {bound:.0f} images/s = {bound / limit.rate:.2f} x the limit")


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--_loadgen":
        return loadgen_main(sys.argv[2:])
    if len(sys.argv) > 1 and sys.argv[1] == "--_limit":
        return limit_main(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model_base_path", default=None, help="default: exported_models/flowers")
    parser.add_argument("--model", choices=("shipped", "mobilenet_v2"), default="shipped",
                        help="mobilenet_v2: a model of realistic size instead of the shipped one, MobileNetV2 at "
                        "--image_size 224 with random weights, exported by Petal's export (kept in the temporary "
                        "folder for later runs)")
    parser.add_argument("--image_size", type=int, default=None,
                        help="model input size: of --model mobilenet_v2 (default 224), or if no model is shipped "
                        "(default 64)")
    parser.add_argument("--photo_sizes", default="480x360,640x427,64x64",
                        help="WxH of the photo sets, first is primary")
    parser.add_argument("--concurrency", default="1,4,16,64")
    parser.add_argument("--duration", type=float, default=4.0, help="seconds measured per run")
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds sent before measuring")
    parser.add_argument("--rounds", type=int, default=3,
                        help="interleaved rounds, an odd number; each cell is their median")
    parser.add_argument("--seed", type=int, default=0, help="shuffles each round's column order (printed)")
    parser.add_argument("--limit_seconds", type=float, default=1.0, help="seconds per in-process batch size")
    parser.add_argument("--petal_args", default="", help="extra `petal serve` flags, space-separated")
    parser.add_argument("--ab_args", default="", help="one more REST column: a Petal with these flags added, to "
                        "measure what they change side by side (say --tensorflow_thread_nice=0)")
    parser.add_argument("--before", action="append", default=[], help="a checkout of an earlier Petal (say a "
                        "worktree of the previous main): its REST, gRPC and V2 columns run side by side with this "
                        "one's, under its own .venv if it has one; may be given more than once")
    parser.add_argument("--before_own_model", action="store_true", help="each --before checkout serves the model "
                        "it ships, not this checkout's: for a change of the export (the in-process limit is this "
                        "checkout's model's alone)")
    args = parser.parse_args()
    if args.rounds % 2 == 0:
        parser.error("--rounds must be odd: each cell is the median round, one real run")
    from serving.host.cpus import available_cores
    from serving.tensorflow_logs import import_tensorflow_quietly

    import_tensorflow_quietly()  # without its C++ start-up lines, as `petal serve` does (the request bodies need it)

    if args.model == "mobilenet_v2":
        size = args.image_size or 224
        base = random_weights_model("mobilenet_v2", size, os.path.join(tempfile.gettempdir(),
                                                                        f"petal-bench-mobilenet_v2-{size}"))
    else:
        base = args.model_base_path or default_model(args.image_size or 64)
    from exported_models.model_format import latest_version

    model_dir = latest_version(base)
    levels = [int(c) for c in args.concurrency.split(",")]
    sets = photo_sets([tuple(int(x) for x in s.split("x")) for s in args.photo_sizes.split(",")])
    load = os.getloadavg()
    print(f"model {model_dir}; {available_cores()} cores; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; "
          f"{args.duration:g}s per run after {args.warmup:g}s warmup", flush=True)
    print(f"this checkout: {stack_versions(sys.executable)}")
    for tree in args.before:
        print(f"{os.path.basename(os.path.normpath(tree))}: {interpreter(tree)}, {stack_versions(interpreter(tree))}")

    run = lambda requests: run_loadgen(requests, levels, args.duration, args.warmup)  # noqa: E731
    titles = (dict(TITLES) | ({"ab": f"Petal REST, {args.ab_args}"} if args.ab_args else {})
              | before_columns(args.before))
    samples = {name: {col: [] for col in titles} for name in sets}
    limit_rounds: dict[str, list[list[Limit]]] = {name: [] for name in sets}
    ceilings: dict[str, dict[int, dict]] = {}
    columns = [*titles, LIMIT]
    shuffle = random.Random(args.seed)
    for round_ in range(args.rounds):  # interleaved, so a slow spell on the machine hits every column alike,
        order = shuffle.sample(columns, len(columns))  # in a new order, so none always runs after another
        started = time.monotonic()
        with fleet(args, base, model_dir, next(iter(sets.values()))) as servers:
            print(f"round {round_ + 1} order: {', '.join(order)} (servers started in "
                  f"{time.monotonic() - started:.0f} s)", flush=True)
            if not ceilings:
                ceilings = load_generator_ceilings(servers, levels, args.duration, args.warmup,
                                                   next(iter(sets.values())))
            for name, photos in sets.items():
                requests = servers.requests(photos)
                for col in order:
                    if col == LIMIT:
                        limit_rounds[name].append(in_process_limits(model_dir, photos, args.limit_seconds))
                    else:
                        samples[name][col].append(run(requests[col]))
        print(f"round {round_ + 1} of {args.rounds} done", flush=True)
    results = {name: {col: {c: median_run([each[c] for each in runs]) for c in levels} for col, runs in per.items()}
               for name, per in samples.items()}

    for name, photos in sets.items():
        report(name, photos, median_limits(limit_rounds[name]), results[name], ceilings, levels, titles)
        print("in-process, each round: " + "; ".join(
            f"{each[0].threads}: " + ", ".join(f"{limit.rate:.0f}" for limit in each) + " images/s, single image "
            + ", ".join(f"{limit.single_ms:.2f}" for limit in each) + " ms"
            for each in zip(*limit_rounds[name], strict=True)))
        spread(samples[name], levels, titles)
    load = os.getloadavg()
    print(f"\nload average at the end {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    failed = {f"{name} {titles[col]} at {c}": r["errors"] for name, per in samples.items()
              for col, runs in per.items() for each in runs for c, r in each.items() if r["errors"]}
    errors = sum(failed.values())
    cells = ", ".join(f"{cell}: {n}" for cell, n in failed.items())
    print(f"errors: {errors}" + (f" ({cells})" if failed else ""))
    return 0 if errors == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
