"""Start-up as TF Serving's clients expect (docs/flags.md, "Start-up order"), against a real `petal serve` whose model
takes seconds to warm up: while it loads, the REST port answers its probes, gRPC (TCP and Unix socket) refuses
connections, and model calls over REST wait; a client that waits for the gRPC port and calls at once is served.

Before this, Petal bound gRPC as its worker started and answered "Model slow is loading; retry shortly"
(UNAVAILABLE, or 503 over REST) to exactly these calls. The whole start-up is one scenario, run once by the
fixture and recorded, so the tests below can run in any order; the server is stopped at its end, so the
removal of the socket file can be seen too.
"""
from __future__ import annotations

import base64
import json
import os
import socket
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
from tensorflow_serving.apis import (
    get_model_status_pb2,
    model_service_pb2_grpc,
    prediction_service_pb2_grpc,
)

from exported_models.model_format import WarmupRequest, write_warmup
from grpc_calls import predict_request
from server_harness import copy_model, get_status, jpeg, run_server

# 1000 warmup records (TF Serving's most) of six 128 px JPEGs: about 5 s of warmup on one idle core, while the
# probes below take milliseconds.
WARMUP_RECORDS, WARMUP_IMAGES, WARMUP_SIDE = 1000, 6, 128
PORT_WAIT_S = 240


def slow_model(root: str) -> str:
    base = os.path.join(root, "slow")
    version = copy_model(base, 1)
    images = np.array([jpeg(size=WARMUP_SIDE, seed=i) for i in range(WARMUP_IMAGES)], dtype=object)
    write_warmup(version, "slow", [WarmupRequest("serving_default", {"image_bytes": images})] * WARMUP_RECORDS)
    return base


def connects(address) -> bool:
    family = socket.AF_UNIX if isinstance(address, str) else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.settimeout(1)
        try:
            probe.connect(address)
        except OSError:
            return False
    return True


def post(url: str, body: dict) -> tuple[int, dict, float]:
    """Status, JSON body and when the answer came (time.monotonic())."""
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=PORT_WAIT_S) as response:
            return response.status, json.load(response), time.monotonic()
    except urllib.error.HTTPError as error:
        return error.code, json.load(error), time.monotonic()


def predict(target: str) -> tuple[str, object]:
    """Predict and GetModelStatus at once, without waiting for the channel to be ready: the code of each and what
    they returned (the outputs' names, the version states)."""
    request = predict_request("slow", jpegs=[jpeg(seed=1)])
    with grpc.insecure_channel(target) as channel:
        try:
            outputs = prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(request, timeout=60).outputs
            status = model_service_pb2_grpc.ModelServiceStub(channel).GetModelStatus(
                get_model_status_pb2.GetModelStatusRequest(model_spec=request.model_spec), timeout=60)
        except grpc.RpcError as error:
            return error.code().name, error.details()
    return "OK", (sorted(outputs), [get_model_status_pb2.ModelVersionStatus.State.Name(s.state)
                                    for s in status.model_version_status])


@pytest.fixture(scope="module")
def startup(tmp_path_factory) -> dict:
    root = str(tmp_path_factory.mktemp("startup"))
    base = slow_model(root)
    path = os.path.join(root, "grpc.sock")
    image = base64.b64encode(jpeg(size=256, seed=1)).decode()  # past the front end's first read of 8 KiB
    seen: dict = {}
    # A REST deadline of about 300 years: far past threading.TIMEOUT_MAX, where a wait raised OverflowError (500).
    # A body timeout shorter than the load: a REST call's body is read once the load is over, its clock started then
    # (it was started as the head arrived, and a load longer than the timeout answered 408).
    # Two flags that change nothing in Petal, and one Petal takes silently (its own behaviour).
    with run_server(f"--model_base_path={base}", "--model_name=slow", f"--grpc_socket_path={path}",
                    "--rest_api_timeout_in_ms=10000000000000", "--num_load_threads=2",
                    "--xla_cpu_compilation_enabled=false", "--enable_grpc_healthcheck_service=true",
                    "--request_body_timeout=1", wait_ready=False) as server:
        grpc_address = ("127.0.0.1", server.grpc_port)
        seen["readyz while live"] = get_status(server.rest_url + "/readyz")
        seen["grpc port open while live"] = connects(grpc_address)
        seen["socket open while live"] = connects(path)
        with ThreadPoolExecutor(2) as pool:
            seen["rest sent"] = time.monotonic()
            v1 = pool.submit(post, server.rest_url + "/v1/models/slow:predict", {"instances": [{"b64": image}]})
            v2 = pool.submit(post, server.rest_url + "/v2/models/slow/infer", {"inputs": [
                {"name": "image_bytes", "shape": [1], "datatype": "BYTES", "parameters": {"content_type": "base64"},
                 "data": [image]}]})
            deadline = time.monotonic() + PORT_WAIT_S
            while not connects(grpc_address) and time.monotonic() < deadline:
                time.sleep(0.01)
            seen["grpc open"] = time.monotonic()
            seen["grpc"] = predict(server.grpc_target)
            seen["unix"] = predict(f"unix:{path}")
            seen["v1"], seen["v2"] = v1.result(), v2.result()
        seen["readyz after"] = get_status(server.rest_url + "/readyz")
        seen["socket while serving"] = os.path.exists(path)
        seen["log"] = server.log()
    seen["socket after exit"] = os.path.exists(path)
    return seen


def test_while_the_model_loads_rest_answers_probes_and_grpc_is_closed(startup):
    assert startup["readyz while live"] == 503, "the model loaded before the probe: no loading window to test"
    assert not startup["grpc port open while live"]
    assert not startup["socket open while live"]


def test_a_client_that_waits_for_the_grpc_port_is_served_at_once(startup):
    assert startup["grpc"] == ("OK", (["class", "classid", "probabilities"], ["AVAILABLE"]))
    assert startup["unix"] == ("OK", (["class", "classid", "probabilities"], ["AVAILABLE"]))
    assert startup["readyz after"] == 200


def test_model_calls_over_rest_made_while_loading_wait_and_succeed(startup):
    assert startup["rest sent"] < startup["grpc open"], "the REST calls were sent after the load"
    for api in ("v1", "v2"):
        status, body, answered = startup[api]
        assert status == 200, (api, body)
        assert answered >= startup["grpc open"] - 0.5, f"{api} was answered before the load was over"
    assert len(startup["v1"][1]["predictions"]) == 1
    assert {o["name"] for o in startup["v2"][1]["outputs"]} == {"class", "classid", "probabilities"}


def test_one_warning_line_names_the_flags_that_change_nothing(startup):
    lines = [json.loads(line) for line in startup["log"].splitlines()
             if "flags that change nothing" in line and line.startswith("{")]
    assert len(lines) == 1
    assert set(lines[0]["flags"]) == {"--num_load_threads=2", "--xla_cpu_compilation_enabled=false"}
    assert "Internal error" not in startup["log"] and "OverflowError" not in startup["log"]


def test_the_socket_file_is_removed_at_exit(startup):
    assert startup["socket while serving"] and not startup["socket after exit"]
