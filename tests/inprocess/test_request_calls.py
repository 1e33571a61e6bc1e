"""A deterministic guard on the request path's Python: the Python function calls that one REST predict, one V2
binary infer and one gRPC Predict make, through the real front end and app (gunicorn's parser and Petal's gevent
worker on a plain socket, the Flask app) or the real gRPC gate and servicer, over a real DataPlane.

CPU time is noisy on a shared machine and never asserted; calls are deterministic. Each ceiling is the count
reached when the guard was written plus 10% (docs/performance.md, 'Per-request Python'): a change that adds per-request
work fails here and says where the calls went. A lone request runs on its own thread (serving/core/batching.py),
so the whole path runs on the calling thread, which is the one counted.
"""
from __future__ import annotations

import base64
import collections
import json
import os
import socket
import struct
import sys
from collections.abc import Callable

import grpc
import numpy as np
import pytest
from gunicorn import glogging
from tensorflow_serving.apis import predict_pb2

from server_harness import jpeg, tiny_model_base
from serving.process.flags import parse_args
from serving.process.server import PetalApplication
from serving.protocols.codec import tensor_proto
from serving.protocols.grpc_api import server as grpc_server
from serving.protocols.grpc_api.tfserving import PredictionService
from serving.protocols.rest.app import create_app

# Reached with TF2 models in a Session (docs/performance.md, 'Per-request Python'), plus 10%.
REACHED = {"rest_predict": 601, "v2_binary_infer": 610, "grpc_predict": 271}
CEILINGS = {name: int(calls * 1.1) for name, calls in REACHED.items()}
PREDICT_METHOD = "/tensorflow.serving.PredictionService/Predict"
JPEG = jpeg(seed=1)


@pytest.fixture(scope="module")
def options():
    return parse_args([f"--model_base_path={tiny_model_base()}", "--model_name=flowers"])


@pytest.fixture(scope="module")
def dataplane(make_dataplane):
    """With a memory budget, as a server measures one once its models have loaded: each request holds a share."""
    return make_dataplane(model_base_path=tiny_model_base(), model_name="flowers", memory_budget_bytes=1 << 30)


@pytest.fixture(scope="module")
def worker(dataplane, options):
    """Petal's gevent worker as gunicorn configures it, serving the real app; gevent's patching is left out, so
    `handle` reads and writes a plain socket on the calling thread."""
    application = PetalApplication(options)
    worker = application.worker_class()(0, os.getpid(), [], application, 30, application.cfg,
                                        glogging.Logger(application.cfg))
    worker.wsgi = create_app(dataplane, options.protocols, options.security)
    worker.start_serving()
    return worker


def counted(call: Callable[[], object]) -> collections.Counter:
    """The Python functions `call` runs on this thread, with how often each ran ("call" events: a generator
    resumed counts again)."""
    calls: collections.Counter = collections.Counter()

    def profile(frame, event, arg) -> None:
        if event == "call" and frame.f_code.co_filename != __file__:  # the test's own lines are not the path's
            code = frame.f_code
            calls[f"{code.co_filename}:{code.co_firstlineno}:{code.co_qualname}"] += 1
    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return calls


def per_request(serve: Callable[[int], object]) -> collections.Counter:
    """The calls of one more request: `serve(n)` serves n requests (on one keep-alive connection, for HTTP), so
    what one connection costs once is left out. Served first to warm every cache the path fills on first use."""
    serve(2)
    return counted(lambda: serve(2)) - counted(lambda: serve(1))


def http_connection(worker, request: bytes) -> Callable[[int], list[bytes]]:
    """Serves n copies of `request` on one connection through the worker, returning the responses."""
    def serve(n: int) -> list[bytes]:
        ours, theirs = socket.socketpair()
        with ours:
            ours.sendall(request * n)
            ours.shutdown(socket.SHUT_WR)
            worker.handle(theirs, theirs, ("127.0.0.1", 50000))
            data = b"".join(iter(lambda: ours.recv(1 << 16), b""))
        responses = data.split(b"HTTP/1.1 ")[1:]
        assert len(responses) == n and all(r.startswith(b"200 ") for r in responses), data[:300]
        return responses
    return serve


def http_request(path: str, body: bytes, **headers: str) -> bytes:
    head = "".join(f"{k.replace('_', '-')}: {v}\r\n" for k, v in headers.items())
    return f"POST {path} HTTP/1.1\r\nHost: petal\r\n{head}Content-Length: {len(body)}\r\n\r\n".encode() + body


class Context:
    """What the gRPC gate and servicer ask of grpc's ServicerContext on a call that succeeds; `end` is the call's
    end, once the client has read its answer."""

    def __init__(self) -> None:
        self.callbacks: list[Callable[[], None]] = []

    def time_remaining(self) -> float:
        return 10.0

    def add_callback(self, callback: Callable[[], None]) -> bool:
        self.callbacks.append(callback)
        return True

    def cancel(self) -> None:
        self.end()

    def end(self) -> None:
        for callback in self.callbacks:
            callback()


def grpc_calls(dataplane, options) -> Callable[[int], None]:
    """Serves n Predict calls through the gate (its deserializer, as grpcio's poller runs it, and its handler) and
    the PredictionService, serializing each response."""
    gate = grpc_server.gate(dataplane, options.protocols, options.security)
    servicer = PredictionService(dataplane, options.protocols.grpc_max_message_bytes)
    handler = grpc.unary_unary_rpc_method_handler(servicer.Predict, predict_pb2.PredictRequest.FromString,
                                                  predict_pb2.PredictResponse.SerializeToString)
    details = type("Details", (), {"method": PREDICT_METHOD, "invocation_metadata": ()})()
    request = predict_pb2.PredictRequest()
    request.model_spec.name = "flowers"
    request.inputs["image_bytes"].CopyFrom(tensor_proto.encode(np.array([JPEG], dtype=object)))
    wire = request.SerializeToString()

    def serve(n: int) -> None:
        for _ in range(n):
            gated = gate.intercept_service(lambda _: handler, details)
            context = Context()
            response = gated.unary_unary(gated.request_deserializer(wire), context)
            assert predict_pb2.PredictResponse.FromString(gated.response_serializer(response)).outputs
            context.end()
    return serve


def check(name: str, calls: collections.Counter) -> None:
    total = sum(calls.values())
    top = "\n".join(f"{n:5} {where}" for where, n in calls.most_common(int(os.environ.get("TOPN", 25))))
    print(f"{name}: {total} Python calls per request\n{top}")
    assert total <= CEILINGS[name], f"{name}: {total} Python calls per request, over {CEILINGS[name]}:\n{top}"


def test_rest_predict(worker):
    body = json.dumps({"instances": [{"b64": base64.b64encode(JPEG).decode()}]}).encode()
    check("rest_predict", per_request(http_connection(
        worker, http_request("/v1/models/flowers:predict", body, Content_Type="application/json"))))


def test_v2_binary_infer(worker):
    raw = struct.pack("<I", len(JPEG)) + JPEG
    header = json.dumps({"inputs": [{"name": "image_bytes", "shape": [1], "datatype": "BYTES",
                                     "parameters": {"binary_data_size": len(raw)}}]}).encode()
    check("v2_binary_infer", per_request(http_connection(worker, http_request(
        "/v2/models/flowers/infer", header + raw, Content_Type="application/octet-stream",
        Inference_Header_Content_Length=str(len(header))))))


def test_grpc_predict(dataplane, options):
    check("grpc_predict", per_request(grpc_calls(dataplane, options)))
