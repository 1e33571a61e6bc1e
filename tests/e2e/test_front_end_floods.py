"""Floods that cost an attacker sockets but no bandwidth, against a real `petal serve` (gevent front end): idle
connections at --max_connections make room for new ones (only connections all in a request get the 503, and not
from another address than the peer holding the most), and
declared but unsent bodies hold none of the memory budget (docs/security.md)."""
import http.client
import socket
import time

import pytest
import requests

from load_tests.peer_attacks import Attack, NormalRest, slow_heads
from server_harness import memory_held, predict_body, rest_address, run_server, tiny_model_base

MAX_CONNECTIONS = 20
MiB = 1 << 20
PIECE = 64 * 1024  # what the front end reads of a body at a time, each piece charged as it arrives
CLAIM = MiB  # each attacker's declared body: allowed, and 4 MiB charged if the claim were charged
CLAIMS = 3  # claims the budget's body share holds, charged in full, with room for no predict besides
PIXELS = 100_000  # the pixel share, and the largest image
BODY_SHARE = CLAIMS * 4 * CLAIM + 100


@pytest.fixture(scope="module")
def server():
    with run_server("--model_name=flowers",
                    f"--model_base_path={tiny_model_base()}", "--port=0", f"--max_connections={MAX_CONNECTIONS}",
                    f"--max_request_bytes={4 * CLAIM}", f"--max_image_pixels={PIXELS}",
                    f"--max_inflight_pixels={PIXELS}", f"--memory_budget_bytes={PIXELS * 4 + BODY_SHARE}") as running:
        yield running


def connect(server) -> socket.socket:
    return socket.create_connection(rest_address(server), timeout=5)


def post_head(length: int) -> bytes:
    return (b"POST /v1/models/flowers:predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % length)


def response(sock: socket.socket) -> tuple[int, bytes]:
    """One response's status and body, read off a connection that stays open."""
    answer = http.client.HTTPResponse(sock)
    answer.begin()
    return answer.status, answer.read()


def closed_by_server(sock: socket.socket) -> bool:
    """Whether the server has closed this connection, on which the client sent nothing more."""
    sock.settimeout(0.2)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def timed_status(call) -> tuple[int, float]:
    started = time.monotonic()
    return call().status_code, time.monotonic() - started


@pytest.mark.parametrize("kept_alive", [False, True], ids=["never_sent_a_byte", "kept_alive_after_a_request"])
def test_idle_connections_at_max_connections_make_room_for_new_ones(server, kept_alive):
    """As nginx does when its connections run out: the one idle longest is closed, and the new one is served (it
    was refused 503 for as long as the idlers stayed, 75 s by default)."""
    idle = [connect(server) for _ in range(MAX_CONNECTIONS)]
    try:
        if kept_alive:
            for sock in idle:
                sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
                assert response(sock)[0] == 200
        else:
            time.sleep(0.5)  # every connection accepted
        probe = timed_status(lambda: requests.get(server.rest_url + "/healthz", timeout=5))
        predict = timed_status(lambda: requests.post(server.rest_url + "/v1/models/flowers:predict",
                                                     data=predict_body(), timeout=5))
        assert probe[0] == 200 and predict[0] == 200, (probe, predict)
        assert probe[1] < 1.0 and predict[1] < 1.0, (probe, predict)
        assert closed_by_server(idle[0]) and not closed_by_server(idle[-1]), "the one idle longest is closed"
    finally:
        for sock in idle:
            sock.close()


def test_when_every_connection_is_in_a_request_a_new_one_gets_503_and_none_is_cut(server):
    """Half the connections are part way through a request's head (slowloris), half through its body, all within
    their deadlines: none is idle, so the new connection is refused and each of them is then answered in full."""
    body = predict_body()
    request = post_head(len(body)) + body
    parts = [(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: a", b"\r\n\r\n"), (request[:-10], request[-10:])]
    busy = [connect(server) for _ in range(MAX_CONNECTIONS)]
    try:
        for i, sock in enumerate(busy):
            sock.sendall(parts[i % 2][0])
        time.sleep(0.5)  # every connection accepted and its bytes read
        refused = requests.get(server.rest_url + "/healthz", timeout=5)
        assert refused.status_code == 503 and refused.headers["Retry-After"] == "1", refused.text
        assert "Too many connections" in refused.json()["error"]
        assert refused.headers["X-Content-Type-Options"] == "nosniff"
        for i, sock in enumerate(busy):
            sock.sendall(parts[i % 2][1])
        assert [response(sock)[0] for sock in busy] == [200] * MAX_CONNECTIONS
    finally:
        for sock in busy:
            sock.close()


def test_declared_bodies_that_do_not_arrive_hold_none_of_the_memory_budget(server):
    """Attackers declare large bodies (allowed, and together more than the budget's body share) and send a first
    piece: only the pieces are held, so a normal predict meanwhile is served (it was a 503, the claims charged in
    full for as long as the attackers trickled). A claim the budget could never hold is still a 413 before any of
    its body is sent, and what the attackers held is given back when they go."""
    attackers = [connect(server) for _ in range(CLAIMS + 1)]
    try:
        for sock in attackers:
            sock.sendall(post_head(CLAIM) + b" " * PIECE)
        charged = len(attackers) * PIECE * 4
        deadline = time.monotonic() + 5
        while memory_held(server).get("bodies", 0) < charged and time.monotonic() < deadline:
            time.sleep(0.05)
        predict = requests.post(server.rest_url + "/v1/models/flowers:predict", data=predict_body(), timeout=5)
        assert predict.status_code == 200, predict.text
        assert memory_held(server)["bodies"] == charged, "each attacker's first piece is held, and no more"
        with connect(server) as too_large:
            too_large.sendall(post_head(4 * CLAIM))
            status, answer = response(too_large)
        assert status == 413 and b"memory budget" in answer, answer
    finally:
        for sock in attackers:
            sock.close()
    deadline = time.monotonic() + 5
    while memory_held(server)["bodies"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert memory_held(server)["bodies"] == 0


def test_one_peer_holding_every_connection_cannot_keep_another_out(server):
    """A peer (127.0.0.2) opens --max_connections connections and trickles a request head on each, within its
    deadline: a client from another address (127.0.0.1) has each of its predictions answered, every one taking the
    place of one of the peer's heads (until 2026-12-07 they were all refused 503 for as long as the peer kept on).
    From the peer's own address a new connection still meets the 503 (the test above)."""
    attack = Attack(f"127.0.0.1:{rest_address(server)[1]}", slow_heads, MAX_CONNECTIONS)
    try:
        time.sleep(1.0)  # every connection of the peer open and in its head
        normal = NormalRest(server.rest_url + "/v1/models/flowers:predict", predict_body(), deadline_s=5)
        calls = normal.calls(2.0)
        normal.close()
    finally:
        attack.end()
    assert calls.ok == len(calls.results) > 0, calls.summary()
