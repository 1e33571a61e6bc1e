"""Hostile connections against a real `petal serve` (gevent front end): tricklers and idlers neither stop nor slow
normal clients, tricklers are cut off, and a large upload at a normal speed is not. What happens at
--max_connections: tests/e2e/test_front_end_floods.py."""
import json
import socket
import threading
import time

import pytest
import requests

from server_harness import b64, jpeg, predict_body, rest_address, run_server, tiny_model_base

PER_KIND = 100  # connections of each kind: header tricklers, body tricklers, idlers
TIMEOUTS = ("--request_header_timeout=2", "--request_body_timeout=2", "--keepalive_timeout=3")
MAX_CONNECTIONS = 400
ASKED = 300  # answers a client that never reads asks for: 14 MB of /openapi.json


@pytest.fixture(scope="module")
def server():
    with run_server("--model_name=flowers",
                    f"--model_base_path={tiny_model_base()}", "--port=0", f"--max_connections={MAX_CONNECTIONS}",
                    *TIMEOUTS) as running:
        yield running


def connect(server) -> socket.socket:
    sock = socket.create_connection(rest_address(server), timeout=5)
    sock.setblocking(False)
    return sock


class Attack:
    """Header tricklers, body tricklers and idlers, fed one byte each every 0.5 s from one thread."""

    def __init__(self, server, per_kind: int = PER_KIND):
        head = b"POST /v1/models/flowers:predict HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200
        body = predict_body()
        self.pending = {}
        for _ in range(per_kind):
            self.pending[connect(server)] = head
            sock = connect(server)
            sock.send(b"POST /v1/models/flowers:predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n" % len(body))
            self.pending[sock] = body
            self.pending[connect(server)] = b""
        self.closed_after: list[float] = []
        self.stop = threading.Event()
        self.started = time.monotonic()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.stop.wait(0.5) and self.pending:
            for sock, rest in list(self.pending.items()):
                try:
                    if rest:
                        sock.send(rest[:1])
                        self.pending[sock] = rest[1:]
                    elif sock.recv(1) == b"":
                        raise ConnectionResetError
                except BlockingIOError:
                    continue
                except OSError:
                    self.closed_after.append(time.monotonic() - self.started)
                    del self.pending[sock]
                    sock.close()

    def end(self) -> None:
        self.stop.set()
        self.thread.join(10)
        for sock in self.pending:
            sock.close()


def timed(call) -> float:
    started = time.monotonic()
    response = call()
    assert response.status_code == 200, response.text
    return time.monotonic() - started


def throughput(server, seconds: float = 2.0, clients: int = 4) -> float:
    """Predictions per second from `clients` keep-alive clients in a closed loop, every one answered 200 (checked
    here, in the test's thread: an assert in a client's thread would only end that thread)."""
    done, failed, stop = [], [], time.monotonic() + seconds

    def client():
        try:
            with requests.Session() as session:
                while time.monotonic() < stop:
                    response = session.post(server.rest_url + "/v1/models/flowers:predict", data=predict_body(),
                                            timeout=10)
                    (done if response.status_code == 200 else failed).append(response.status_code)
        except requests.RequestException as error:
            failed.append(repr(error))
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert done and not failed, f"{len(done)} answered 200; not: {failed[:5]}"
    return len(done) / seconds


def attacked_throughput(server) -> tuple[float, float]:
    """Throughput before and during an attack (whose tricklers and idlers must all be cut off), with normal
    requests answering within a second meanwhile."""
    before = throughput(server)
    attack = Attack(server)
    try:
        latencies = []
        for _ in range(5):
            latencies.append(timed(lambda: requests.get(server.rest_url + "/readyz", timeout=5)))
            latencies.append(timed(lambda: requests.post(server.rest_url + "/v1/models/flowers:predict",
                                                         data=predict_body(), timeout=5)))
        during = max(throughput(server), throughput(server))  # the better of two: a passing spike elsewhere on the
        # machine should not fail the test; a server the attack slows is slow in both
        deadline = time.monotonic() + 15
        while attack.pending and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        attack.end()
    assert max(latencies) < 1.0, latencies
    # every trickler and idler was cut off, by the 2 s read deadlines or the 3 s keep-alive timeout
    assert not attack.pending and len(attack.closed_after) == 3 * PER_KIND
    assert max(attack.closed_after) < 10, sorted(attack.closed_after)[-5:]
    return before, during


@pytest.mark.serial
def test_tricklers_and_idlers_neither_stop_nor_slow_normal_clients(server):
    """A second attack is measured only when the first shows a loss: this shared 2-core machine has slow spells
    of several seconds, while a server that the attack really slows loses both times."""
    runs = [attacked_throughput(server)]
    if runs[0][1] < 0.8 * runs[0][0]:
        runs.append(attacked_throughput(server))
    assert any(during >= 0.8 * before for before, during in runs), \
        "under attack against before: " + ", ".join(f"{during:.0f}/s against {before:.0f}/s" for before, during in runs)


def test_a_large_photo_at_a_normal_speed_is_not_cut_off(server):
    """3 s to send 2 MB (about 700 KB/s) outlasts the 2 s body timeout, which every 64 KiB received extends."""
    photo = jpeg(1000, quality=100)
    body = json.dumps({"instances": [b64(photo)]}).encode()
    sock = socket.create_connection(rest_address(server), timeout=30)
    sock.sendall(b"POST /v1/models/flowers:predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body))
    chunk = len(body) // 30 + 1
    for offset in range(0, len(body), chunk):
        sock.sendall(body[offset:offset + chunk])
        time.sleep(0.1)
    response = b""
    while data := sock.recv(65536):
        response += data
    sock.close()
    assert len(body) > 1_000_000 and response.startswith(b"HTTP/1.1 200"), response[:300]
    assert b'"predictions"' in response


def test_a_body_that_stops_arriving_gets_408(server):
    """werkzeug's body stream turns any OSError into a 400 ("The browser (or proxy) sent a request that this server
    could not understand"), the body deadline's error too."""
    with socket.create_connection(("127.0.0.1", server.rest_port), timeout=10) as sock:
        sock.sendall(b"POST /v1/models/flowers:predict HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"inst")
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 408 ") and b'{"error":"The request body did not arrive in time"}' in answer, \
        answer



def test_a_client_that_never_reads_its_answers_is_cut_off(server):
    """Clients that ask and never read: each answer must be taken within the body timeout (2 s, plus a second every
    64 KiB), or the connection breaks. Without that deadline they kept their connections, and with as many as
    --max_connections, every new client got 503, for as long as they liked."""
    ask = b"GET /openapi.json HTTP/1.1\r\nHost: x\r\n\r\n" * ASKED
    readers = []
    for _ in range(8):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(rest_address(server))
        sock.sendall(ask)
        readers.append(sock)
    answer = requests.get(f"{server.rest_url}/openapi.json", timeout=10)
    assert answer.status_code == 200
    time.sleep(2 + len(answer.content) / 65536 + 3)  # past the write deadline, with slack for a loaded machine
    for sock in readers:
        received = 0
        sock.settimeout(5)
        try:
            while data := sock.recv(1 << 20):
                received += len(data)
        except ConnectionResetError:
            pass
        except TimeoutError:
            pytest.fail(f"the connection is still open: {received} bytes of {ASKED * len(answer.content)} sent")
        finally:
            sock.close()
        assert received < ASKED * len(answer.content)  # more than the kernel buffers of both ends hold
