"""A lone request's TF call runs on the gevent worker's event loop, in a real `petal serve` (docs/performance.md, 'A
lone request on the event loop'): one client on one keep-alive connection never wakes a batch thread, and clients on
several connections at once are handed to them, and the loop runs the model's graph itself, not on TensorFlow's pool;
so does a lone gRPC Predict's thread. The batch threads and gRPC's handler threads carry their names in /proc
(serving/threads.py, `name_native_thread`), as TensorFlow's do, and the kernel counts each one's sleeps: a thread
handed work wakes for it and sleeps again after.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import requests
from tensorflow_serving.apis import prediction_service_pb2_grpc

from grpc_calls import predict_request
from server_harness import b64, jpeg, run_server, tiny_model_base, worker_pid

REQUESTS = 40


def thread_sleeps(worker: int, prefix: str) -> dict[str, int]:
    """The voluntary context switches so far of each of the worker's threads whose name starts with `prefix`, by
    name and thread id."""
    sleeps = {}
    for tid in os.listdir(f"/proc/{worker}/task"):
        with open(f"/proc/{worker}/task/{tid}/comm") as f:
            name = f.read().strip()
        if name.startswith(prefix):
            with open(f"/proc/{worker}/task/{tid}/status") as f:
                sleeps[f"{name}/{tid}"] = next(int(line.split()[1]) for line in f
                                               if line.startswith("voluntary_ctxt_switches"))
    return sleeps


def batch_thread_sleeps(worker: int) -> dict[str, int]:
    return {name.split("/")[0]: count for name, count in thread_sleeps(worker, "petal-batch-").items()}


def predict(session: requests.Session, url: str, body: dict) -> None:
    response = session.post(url, json=body, timeout=60)
    assert response.status_code == 200, response.text


@pytest.mark.serial  # on a loaded machine the tiny model's calls outgrow the loop's 10 ms bound and are handed over
def test_one_client_never_wakes_a_batch_thread_and_several_do():
    with run_server("--model_name=flowers", f"--model_base_path={tiny_model_base()}") as server:
        worker = worker_pid(server.proc.pid)
        url, body = f"{server.rest_url}/v1/models/flowers:predict", {"instances": [b64(jpeg())]}
        with requests.Session() as session:
            for _ in range(3):  # the first call is handed over: the loop runs only a call it has timed as short
                predict(session, url, body)
            before, pool_before = batch_thread_sleeps(worker), thread_sleeps(worker, "tf_")
            assert sorted(before) == ["petal-batch-0", "petal-batch-1"] and pool_before
            for _ in range(REQUESTS):
                predict(session, url, body)
            alone, pool_alone = batch_thread_sleeps(worker), thread_sleeps(worker, "tf_")
        # Handed over, each request wakes a batch thread (REQUESTS sleeps or more); on the loop none does, but a
        # call that a loaded machine made longer than the loop's bound (10 ms) hands the next one over.
        assert sum(alone.values()) - sum(before.values()) < REQUESTS // 2, (before, alone)
        # The loop runs the graph itself (serving/core/runtimes.py, SessionModel): TensorFlow's pool threads, which
        # woke several times a request when the Session ran it on them, stay asleep.
        assert sum(pool_alone.values()) - sum(pool_before.values()) < REQUESTS // 2, (pool_before, pool_alone)

        sessions = [requests.Session() for _ in range(4)]
        with ThreadPoolExecutor(len(sessions)) as pool:
            list(pool.map(lambda i: predict(sessions[i % len(sessions)], url, body), range(REQUESTS)))
        for session in sessions:
            session.close()
        woken = batch_thread_sleeps(worker)
    assert sum(woken.values()) - sum(alone.values()) >= REQUESTS // 2, (alone, woken)


@pytest.mark.serial
def test_a_lone_grpc_predict_runs_the_graph_on_its_own_thread():
    with run_server("--model_name=flowers", f"--model_base_path={tiny_model_base()}") as server, \
            grpc.insecure_channel(server.grpc_target) as channel:
        worker = worker_pid(server.proc.pid)
        stub, request = prediction_service_pb2_grpc.PredictionServiceStub(channel), predict_request()
        stub.Predict(request, timeout=60)
        before, handlers_before = thread_sleeps(worker, "tf_"), thread_sleeps(worker, "petal-grpc")
        for _ in range(REQUESTS):
            stub.Predict(request, timeout=60)
        after, handlers_after = thread_sleeps(worker, "tf_"), thread_sleeps(worker, "petal-grpc")
    # Run on TensorFlow's pool, each Predict woke its threads several times.
    assert before and sum(after.values()) - sum(before.values()) < REQUESTS // 2, (before, after)
    # gRPC's handler threads carry their name too, and they are the ones the calls woke: about once a call, since a
    # call reaches a thread with its message in (37 of 40 calls slept one, where a thread that was still awake took
    # the next call; twice a call before, when the thread also slept until its message came: serving/protocols/
    # grpc_api/gate.py's Starter).
    assert handlers_before and sum(handlers_after.values()) - sum(handlers_before.values()) >= REQUESTS // 2, \
        (handlers_before, handlers_after)
