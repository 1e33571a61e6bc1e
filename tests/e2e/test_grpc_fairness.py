"""A fair share for every client on the gRPC port, on a real `petal serve` over loopback HTTP/2: under each of the
HTTP/2 attacks of 2023–2024 (load_tests/peer_attacks.py: the `h2` library's frames on raw sockets, from 127.0.0.2),
a normal client on 127.0.0.1 calling Predict every 50 ms with a 2 s deadline has every call answered OK, during
the attack and after it; the worker grows by less than its memory budget and stays up. Held streams (calls kept
open with empty DATA frames, never finishing their message) are tried from 16 connections, from as many as
--max_connections allows, and from the normal client's own address (fairness between its connections then keeps
the normal client served), and from 64 connections of 64 streams, whose calls past the slots and places to wait
are refused only after a hold, so that they are not reopened faster than grpcio refuses them. docs/security.md,
"A fair share for every client"."""
from __future__ import annotations

import time

import pytest

from grpc_calls import predict_request
from load_tests.peer_attacks import (
    ATTACKER,
    Attack,
    Normal,
    continuation,
    held_streams,
    ping_flood,
    rapid_reset,
    settings_flood,
)
from load_tests.pixel_flood import reset_peak, status_kb
from server_harness import memory_held, run_server, tiny_model_base, worker_pid

BUDGET = 1 << 30  # --memory_budget_bytes: half for bodies, 4 receive slots of two 64 MiB messages each
MAX_CONNECTIONS = 100
ATTACK_S = 3.0
AFTER_S = 1.0
NORMAL = "127.0.0.1"


@pytest.fixture(scope="module")
def server():
    with run_server(f"--model_base_path={tiny_model_base()}", "--model_name=flowers", "--workers=1",
                    "--request_body_timeout=2", f"--memory_budget_bytes={BUDGET}",
                    f"--max_connections={MAX_CONNECTIONS}") as running:
        yield running


@pytest.fixture
def normal(server):
    client = Normal(server.grpc_target, predict_request())
    assert client.calls(0.2).ok, "the normal client is served before the attack"
    yield client
    client.close()


@pytest.mark.parametrize(("attack", "connections", "source"), [
    (rapid_reset, 4, ATTACKER),
    (continuation, 4, ATTACKER),
    (ping_flood, 2, ATTACKER),
    (settings_flood, 2, ATTACKER),
    (held_streams(100), 16, ATTACKER),
    (held_streams(64), 64, ATTACKER),
    (held_streams(8), MAX_CONNECTIONS, ATTACKER),  # as many as --max_connections allows, the normal client's aside
    (held_streams(100), 16, NORMAL),  # the normal client's own address: fair between its connections
], ids=["rapid_reset", "continuation", "ping_flood", "settings_flood", "held_streams_16",
        "held_streams_64", "held_streams_max_connections", "held_streams_same_address"])
def test_a_normal_client_is_served_through_an_attack(server, normal, attack, connections, source):
    worker = worker_pid(server.proc.pid)
    before = status_kb(worker, "VmRSS") * 1024
    reset_peak(worker)
    running = Attack(server.grpc_target, attack, connections, source=source)
    try:
        during = normal.calls(ATTACK_S)
    finally:
        running.end()
    grown = status_kb(worker, "VmHWM") * 1024 - before
    after = normal.calls(AFTER_S)
    assert during.ok == len(during.results) and after.ok == len(after.results), \
        f"during: {during.summary()}; after: {after.summary()}"
    assert server.proc.poll() is None, "the server died"
    assert grown < BUDGET, f"the worker grew by {grown >> 20} MiB, past its memory budget"




def held_calls(target: str, connections: int = 3, streams: int = 64) -> dict:
    """`connections` connections from ATTACKER, each with `streams` calls that declare a message and send none of
    it: {socket: its h2 connection}."""
    import h2.config
    import h2.connection

    from load_tests.peer_attacks import connect, grpc_headers

    opened = {}
    for _ in range(connections):
        sock = connect(target, ATTACKER)
        h2c = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        h2c.initiate_connection()
        for _ in range(streams):
            stream = h2c.get_next_available_stream_id()
            h2c.send_headers(stream, grpc_headers(target))
            h2c.send_data(stream, b"\x00\x00\x00\x00\x10")  # a 16-byte message declared, none of it sent
        sock.sendall(h2c.data_to_send())
        opened[sock] = h2c
    return opened


def test_a_call_refused_for_want_of_a_slot_is_answered_only_after_a_hold_so_its_stream_is_not_reopened_at_once(
        server):
    """One peer alone opens more calls that never send their message than the worker has receive slots and places
    to wait (4 + 2 x 64 here: 3 connections of 64 streams). The calls past those are refused RESOURCE_EXHAUSTED,
    but only after half to all of --request_body_timeout (2 s): refused at once, a peer that reopens each ended
    call sends them faster than grpcio ends them (gate.py's `hold_back`). Meanwhile they hold some of the memory
    budget, given back as soon as the peer goes. (Calls of the connections holding the most are cut at once for
    the others: fairness within an address, as tests/unit/test_grpc_shares.py has it.)"""
    import select

    from serving.protocols.grpc_api.gate import REFUSED_DETAILS

    refused_after: list[float] = []
    start = time.monotonic()
    connections = held_calls(server.grpc_target)
    try:
        while time.monotonic() - start < 1.9:  # before the calls holding slots are late
            ready, _, _ = select.select(list(connections), [], [], 0.1)
            for sock in ready:
                for event in connections[sock].receive_data(sock.recv(1 << 16)):
                    trailers = dict(getattr(event, "headers", None) or ())
                    if trailers.get("grpc-message", "").startswith(REFUSED_DETAILS[:40]):
                        refused_after.append(round(time.monotonic() - start, 2))
                sock.sendall(connections[sock].data_to_send())
    finally:
        for sock in connections:
            sock.close()
    assert refused_after, "no call was refused"
    assert min(refused_after) >= 0.9, f"calls refused after {sorted(refused_after)[:10]} s"

    connections = held_calls(server.grpc_target)
    time.sleep(0.3)
    held = memory_held(server)["bodies"]
    for sock in connections:
        sock.close()
    time.sleep(0.3)  # the held-back calls' hold is 1 to 2 s: only their ending frees them now
    assert held > 0 and memory_held(server)["bodies"] == 0, f"held {held} bytes, then {memory_held(server)}"
