"""A fair share for every client on the gRPC port, on a real `petal serve` over loopback HTTP/2: under each of the
HTTP/2 attacks of 2023–2024 (load_tests/peer_attacks.py: the `h2` library's frames on raw sockets, from 127.0.0.2),
a normal client on 127.0.0.1 calling Predict every 50 ms with a 2 s deadline has every call answered OK, during
the attack and after it; the worker grows by less than its memory budget and stays up. Held streams (calls kept
open with empty DATA frames, never finishing their message) are tried from 16 connections, from as many as
--max_connections allows, and from the normal client's own address (fairness between its connections then keeps
the normal client served). docs/security.md, "A fair share for every client". Not yet held: 64 connections of 64
streams, whose calls pile up in grpc core's own backlog of calls not yet taken by Python, past its limit
(grpc.server.max_pending_requests, 1000), where grpc refuses calls at random, the normal client's too, CANCELLED,
before Petal sees them (docs/security.md)."""
from __future__ import annotations

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
from server_harness import run_server, tiny_model_base, worker_pid

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
    (held_streams(8), MAX_CONNECTIONS, ATTACKER),  # as many as --max_connections allows, the normal client's aside
    (held_streams(100), 16, NORMAL),  # the normal client's own address: fair between its connections
], ids=["rapid_reset", "continuation", "ping_flood", "settings_flood", "held_streams_16",
        "held_streams_max_connections", "held_streams_same_address"])
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
