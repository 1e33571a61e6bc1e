"""gRPC on --grpc_socket_path (a Unix socket file) beside --port, and deadlines from tiny to centuries, against a real
two-worker `petal serve` called with TF Serving's stock stubs. One worker serves the socket (docs/flags.md); when it
dies, the worker that replaces it takes the socket over. Between servers the newest owns the path, as TF Serving's
test harness expects of servers that it starts one after another with one --grpc_socket_path.

The REST side runs gthread workers, whose request threads wait on a native threading.Event: there a REST deadline
past threading.TIMEOUT_MAX raised "OverflowError: timestamp out of range for platform time_t" (a 500), as a far
gRPC deadline did for Triton's perf_analyzer."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from contextlib import ExitStack

import grpc
import numpy as np
import pytest
import requests
import tensorflow as tf
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tensorflow_serving.apis import (
    get_model_status_pb2,
    model_service_pb2_grpc,
    prediction_service_pb2_grpc,
)

from exported_models.tf_serving_models import half_plus_two
from grpc_calls import predict_request
from server_harness import b64, jpeg, run_server, tiny_model_base

TOKEN = "socket-test-token-0123456789"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
TEN_YEARS_S = 3e8
TAKEOVER_WAIT_S = 180


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("socket")
    tokens = root / "tokens.txt"
    tokens.write_text(f"{TOKEN}\n")
    path = str(root / "petal.sock")
    with run_server(f"--model_base_path={tiny_model_base()}", "--model_name=flowers", f"--grpc_socket_path={path}",
                    "--workers=2", f"--auth_token_file={tokens}", "--rest_api_timeout_in_ms=10000000000000",
                    "--worker_class=gthread") as srv:
        srv.socket_path = path
        yield srv


def call_predict(target: str, **kwargs):
    with grpc.insecure_channel(target) as channel:
        return prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(predict_request(), **kwargs)


def test_predict_and_model_status_over_the_unix_socket(server):
    with grpc.insecure_channel(f"unix:{server.socket_path}") as channel:
        response = prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(
            predict_request(), metadata=AUTH, timeout=60)
        status = model_service_pb2_grpc.ModelServiceStub(channel).GetModelStatus(
            get_model_status_pb2.GetModelStatusRequest(model_spec=predict_request().model_spec), metadata=AUTH,
            timeout=60)
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=60)
    assert response.model_spec.name == "flowers" and response.model_spec.version.value == 1
    assert tf.make_ndarray(response.outputs["probabilities"]).shape == (1, 5)
    assert [(s.version, s.state) for s in status.model_version_status] == [
        (1, get_model_status_pb2.ModelVersionStatus.AVAILABLE)]
    assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_the_socket_asks_for_the_same_token_as_the_port(server):
    for target in (f"unix:{server.socket_path}", server.grpc_target):
        with pytest.raises(grpc.RpcError) as error:
            call_predict(target, timeout=60)
        assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize("transport", ["tcp", "unix"])
def test_a_ten_year_deadline_is_served_and_a_tiny_one_exceeded(server, transport):
    target = server.grpc_target if transport == "tcp" else f"unix:{server.socket_path}"
    response = call_predict(target, metadata=AUTH, timeout=TEN_YEARS_S)
    assert tf.make_ndarray(response.outputs["probabilities"]).shape == (1, 5)
    with pytest.raises(grpc.RpcError) as error:
        call_predict(target, metadata=AUTH, timeout=1e-6)
    assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def test_rest_and_v2_with_a_300_year_timeout_are_served(server):
    """--rest_api_timeout_in_ms above puts every REST deadline past threading.TIMEOUT_MAX."""
    headers = {"Authorization": f"Bearer {TOKEN}"}
    v1 = requests.post(f"{server.rest_url}/v1/models/flowers:predict", json={"instances": [b64(jpeg(seed=3))]},
                       headers=headers, timeout=60)
    assert v1.status_code == 200, v1.text
    v2 = requests.post(f"{server.rest_url}/v2/models/flowers/infer", headers=headers, timeout=60, json={"inputs": [
        {"name": "image_bytes", "shape": [1], "datatype": "BYTES", "parameters": {"content_type": "base64"},
         "data": [b64(jpeg(seed=3))["b64"]]}]})
    assert v2.status_code == 200, v2.text


def socket_owners(master: int, path: str) -> list[int]:
    """The worker processes holding a listening socket bound to `path` (from /proc/net/unix and their fds)."""
    with open("/proc/net/unix") as f:  # a socket is listed under the name it was bound to: `path.<pid>`, renamed
        inodes = {line.split()[6] for line in f.readlines()[1:] if line.split()[-1].startswith(f"{path}.")}
    workers = [int(pid) for pid in subprocess.run(["pgrep", "-P", str(master)], capture_output=True,
                                                  text=True).stdout.split()]
    owners = []
    for pid in workers:
        try:
            links = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
        except OSError:  # a worker that just exited
            continue
        if any(f"socket:[{inode}]" in links for inode in inodes):
            owners.append(pid)
    return owners


def test_one_worker_serves_the_socket_and_its_replacement_takes_it_over(server):
    [owner] = socket_owners(server.proc.pid, server.socket_path)
    os.kill(owner, signal.SIGKILL)
    deadline, served = time.monotonic() + TAKEOVER_WAIT_S, None
    while time.monotonic() < deadline:
        owners = socket_owners(server.proc.pid, server.socket_path)
        if owners and owners != [owner]:
            served = call_predict(f"unix:{server.socket_path}", metadata=AUTH, timeout=60)
            break
        time.sleep(0.2)
    assert served is not None, f"no worker took the socket over:\n{server.log()[-3000:]}"
    assert len(owners) == 1 and owners[0] != owner
    assert tf.make_ndarray(served.outputs["probabilities"]).shape == (1, 5)


def half_plus_two_predict(target: str, model: str):
    """tensorflow_model_server_test_client.py's request: x = [2.0]."""
    with grpc.insecure_channel(target) as channel:
        return prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(
            predict_request(model, x=np.array([2.0], np.float32)), timeout=60)


def test_servers_started_one_after_another_on_one_socket_path_all_serve_and_the_newest_owns_it(tmp_path):
    """TF Serving's harness starts each server with --grpc_socket_path=/tmp/tf-serving.sock and keeps the earlier
    ones running. Each server here serves the model under its own name, so the socket's answers say whose it is."""
    half_plus_two(str(tmp_path / "hpt" / "00000123"))
    path = str(tmp_path / "tf-serving.sock")
    names = ["first", "second", "third"]
    with ExitStack() as stack:
        servers = []
        for name in names:
            servers.append(stack.enter_context(run_server(
                f"--model_base_path={tmp_path / 'hpt'}", f"--model_name={name}", f"--grpc_socket_path={path}")))
            assert half_plus_two_predict(f"unix:{path}", name).model_spec.name == name  # the newest, at once
        for server, name in zip(servers, names, strict=True):  # all still serve their TCP ports
            assert tf.make_ndarray(half_plus_two_predict(server.grpc_target, name).outputs["y"]).tolist() == [3.0]
        with pytest.raises(grpc.RpcError) as error:
            half_plus_two_predict(f"unix:{path}", "first")
        assert error.value.details() == "Servable not found for request: Latest(first)"
        for server, previous in zip(servers, [None, *names[:-1]], strict=True):
            warnings = [line for line in server.log().splitlines() if "--grpc_socket_path was served by" in line]
            if previous is None:
                assert not warnings
            else:  # one line, naming the process that served it before: a worker of the previous server
                assert len(warnings) == 1 and f"--model_name={previous} " in warnings[0], warnings
        for server in servers[:2]:  # the older servers stop; unlike gRPC's unlink, that leaves the newest's socket
            server.proc.send_signal(signal.SIGTERM)
            server.proc.wait(timeout=60)
        assert half_plus_two_predict(f"unix:{path}", "third").model_spec.name == "third"
    assert not os.path.exists(path)  # the last server, at its exit, removed its own socket


def test_the_gthread_front_end_warns_it_has_no_limits_on_slow_clients(server):
    assert "--worker_class=gthread has none of the gevent front end's limits on slow clients" in server.log()
