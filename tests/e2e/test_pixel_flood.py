"""A pixel flood against a real server: large flat-colour JPEGs (cheap on the wire, 108 MB each decoded) from
several clients at once, over REST JSON, V2 binary, multipart `:classify_image` and gRPC. The worker's memory
budget (serving/core/budget.py) keeps the server's peak within its idle size plus the budget (and the 15% its
estimate may be off by); every request is answered 200, 503 or 504; and once the flood is over nothing of the budget
is still held."""
import json
import re
import struct
import threading
import time
from collections.abc import Callable

import grpc
import pytest
import requests
import tensorflow as tf
from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

from server_harness import b64, flat_jpeg, reset_peak, run_server, status_kb, tiny_model_base, worker_pid

SIDE = 6000  # 36 Mpx: under the default --max_image_pixels
MB = 2**20
# 144 MB of it kept for decoding one 36 Mpx image, 112 MB for request bodies (each charged 4 bytes for a byte sent)
BUDGET = 256 * MB
# 8 requests of 10 images (7 MB of JSON each), more than the budget's 112 MB for bodies holds over any protocol.
# benchmarks/memory.py sends 32 a request, which takes longer over REST (one image decodes at a time either way);
# gRPC gets those 32 (17 MB a message), since what grpcio receives before the budget can refuse it grows with them.
CLIENTS, IMAGES, GRPC_IMAGES = 8, 10, 32
GRPC_STATUS = {grpc.StatusCode.OK: 200, grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.DEADLINE_EXCEEDED: 504}
CHANNEL_OPTIONS = [("grpc.max_send_message_length", 64 * MB), ("grpc.max_receive_message_length", 64 * MB)]


@pytest.fixture(scope="module")
def image() -> bytes:
    return flat_jpeg(SIDE)


@pytest.fixture(scope="module")
def server():
    with run_server(f"--model_base_path={tiny_model_base()}", "--tensorflow_inter_op_parallelism=8",
                    f"--max_image_pixels={SIDE * SIDE}", f"--memory_budget_bytes={BUDGET}",
                    "--rest_api_timeout_in_ms=15000") as server:
        pid = worker_pid(server.proc.pid)
        server.worker = pid
        server.idle = status_kb(pid, "VmRSS") * 1024
        yield server


def flood(server, sends: list[Callable[[], int]]) -> tuple[list[int], int]:
    """Every request at once; the statuses, and how far the worker grew past its idle size."""
    reset_peak(server.worker)
    statuses, lock = [], threading.Lock()

    def one(send: Callable[[], int]) -> None:
        status = send()
        with lock:
            statuses.append(status)
    threads = [threading.Thread(target=one, args=(send,)) for send in sends]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    return statuses, status_kb(server.worker, "VmHWM") * 1024 - server.idle


def post(url: str, **kwargs) -> Callable[[], int]:
    return lambda: requests.post(url, timeout=60, **kwargs).status_code


def grpc_predict(target: str, image: bytes) -> Callable[[], int]:
    request = predict_pb2.PredictRequest()
    request.model_spec.name = "flowers"
    request.inputs["image_bytes"].CopyFrom(tf.make_tensor_proto([image] * GRPC_IMAGES, dtype=tf.string))

    def send() -> int:
        with grpc.insecure_channel(target, options=CHANNEL_OPTIONS) as channel:
            try:
                prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(request, timeout=15)
                return 200
            except grpc.RpcError as error:
                return GRPC_STATUS.get(error.code(), error.code().value[0])
    return send


def requests_for(protocol: str, server, image: bytes) -> list[Callable[[], int]]:
    if protocol == "rest":
        body = json.dumps({"instances": [b64(image)] * IMAGES}).encode()
        return [post(server.rest_url + "/v1/models/flowers:predict", data=body,
                     headers={"Content-Type": "application/json"})] * CLIENTS
    if protocol == "v2":
        raw = (struct.pack("<I", len(image)) + image) * IMAGES
        header = json.dumps({"inputs": [{"name": "image_bytes", "datatype": "BYTES", "shape": [IMAGES],
                                         "parameters": {"binary_data_size": len(raw)}}]}).encode()
        return [post(server.rest_url + "/v2/models/flowers/infer", data=header + raw,
                     headers={"Content-Type": "application/octet-stream",
                              "Inference-Header-Content-Length": str(len(header))})] * CLIENTS
    if protocol == "multipart":  # one image a request, so as many requests as the others send images, at once
        return [post(server.rest_url + "/v1/models/flowers:classify_image",
                     files={"image": ("flat.jpg", image, "image/jpeg")})] * (CLIENTS * IMAGES)
    return [grpc_predict(server.grpc_target, image)] * CLIENTS


def held(server) -> dict[str, str]:
    text = requests.get(server.rest_url + "/monitoring/prometheus/metrics", timeout=10).text
    return dict(re.findall(r':petal:serving:memory_budget_held_bytes\{kind="(\w+)"\} (\S+)', text))


@pytest.mark.parametrize("protocol", ["rest", "v2", "multipart", "grpc"])
def test_the_memory_budget_bounds_the_server_under_a_flood(server, image, protocol):
    sends = requests_for(protocol, server, image)
    statuses, grown = flood(server, sends)
    assert len(statuses) == len(sends), "every request is answered"
    assert set(statuses) <= {200, 503, 504} and 200 in statuses, statuses
    assert 503 in statuses, "the flood is larger than the budget, so some of it must be refused"
    assert grown <= BUDGET * 1.15, f"the worker grew by {grown / MB:.0f} MB over its idle size"
    # a request answered 504 may leave its image decoding (a TF call cannot be stopped), which then gives it back
    deadline = time.monotonic() + 30
    while held(server) != {"bodies": "0", "pixels": "0"} and time.monotonic() < deadline:
        time.sleep(0.2)
    assert held(server) == {"bodies": "0", "pixels": "0"}, "every request gave back what it held"
