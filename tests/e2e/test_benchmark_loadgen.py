"""benchmarks/serving.py's load generator against a real `petal serve`: its gRPC clients speak HTTP/2 on raw
sockets (so they cost the shared machine little), which is only worth anything if what they count as answered was
answered. Calls that succeed count as requests without errors; calls the server refuses (an unknown method, bytes
that are not the message) count as errors, every one, and never as requests (images/s, latencies and CPU per image
are the successful calls'); and over HTTP a refused request is an error too."""
from __future__ import annotations

import importlib.util
import os
import sys

import pytest

from server_harness import jpeg

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("benchmark_serving", os.path.join(ROOT, "benchmarks", "serving.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def photos():
    return [jpeg(seed=i) for i in range(3)]


def run(bench, requests, concurrency: int = 3) -> dict:
    result = bench.loadgen(requests, concurrency, duration=1.0, warmup=0.2)
    assert result["requests"] + result["errors"] > 0, result
    return result


def refused_every_time(result: dict) -> bool:
    return result["requests"] == 0 and result["errors"] > 0 and result["p50"] != result["p50"]  # NaN: no latency


def test_grpc_predict_calls_are_answered(bench, tiny_server, photos):
    requests = bench.grpc_requests(tiny_server.grpc_port, tiny_server.proc.pid, photos)
    result = run(bench, requests)
    assert result["errors"] == 0, result
    assert result["server_cpu_ms"] > 0 and result["loadgen_cpu_ms"] > 0


def test_grpc_health_checks_are_answered(bench, tiny_server):
    assert run(bench, bench.health_requests("grpc", tiny_server.grpc_port, tiny_server.proc.pid))["errors"] == 0


@pytest.mark.parametrize("path, body", [("/tensorflow.serving.PredictionService/NoSuchMethod", b""),
                                        ("/tensorflow.serving.PredictionService/Predict", b"\xff\xff\xff")])
def test_refused_grpc_calls_are_errors(bench, tiny_server, path, body):
    requests = bench.Requests("grpc", tiny_server.grpc_port, path, [body], {}, tiny_server.proc.pid)
    result = run(bench, requests)
    assert refused_every_time(result), result


def test_many_calls_on_one_connection_keep_flowing(bench, tiny_server):
    """More data than HTTP/2's initial 64 KiB windows, both ways, on one connection: the client's window
    bookkeeping must neither stall (its run would fail) nor overrun the server's (its calls would). A call of 64
    photos makes the answers big enough to pass the window in tens of calls, and the run lasts as long as this
    machine needs for them (a fixed 2 s carried 18 KB of answers on a loaded CI machine)."""
    import grpc
    import tensorflow as tf
    from tensorflow_serving.apis import predict_pb2

    request = predict_pb2.PredictRequest()
    request.model_spec.name = bench.MODEL
    request.inputs["image_bytes"].CopyFrom(tf.make_tensor_proto([jpeg(seed=i) for i in range(64)]))
    requests = bench.Requests("grpc", tiny_server.grpc_port, bench.GRPC_PREDICT, [request.SerializeToString()], {},
                              tiny_server.proc.pid)
    with grpc.insecure_channel(f"127.0.0.1:{tiny_server.grpc_port}") as channel:
        answer = channel.unary_unary(requests.path)(requests.bodies[0])
    calls = 2 * 65535 / min(len(requests.bodies[0]), len(answer))
    rate = run(bench, requests, concurrency=1)["rps"]
    result = bench.loadgen(requests, 1, duration=min(60.0, 2 * calls / rate), warmup=0.2)
    sent, received = (result["requests"] * n for n in (len(requests.bodies[0]), len(answer)))
    assert result["errors"] == 0 and min(sent, received) > 2 * 65535, (result, sent, received)


def test_a_message_larger_than_the_windows_is_sent_as_they_open(bench, tiny_server):
    """A request over HTTP/2's initial 64 KiB windows goes out in parts, each once the server has made room."""
    big = jpeg(size=400, quality=95)
    assert len(big) > 2 * 65535
    requests = bench.grpc_requests(tiny_server.grpc_port, tiny_server.proc.pid, [big])
    assert run(bench, requests, concurrency=2)["errors"] == 0


def test_refused_http_requests_are_errors(bench, tiny_server, photos):
    requests = bench.rest_requests(tiny_server.rest_port, tiny_server.proc.pid, photos)
    assert run(bench, requests)["errors"] == 0
    refused = bench.Requests("http", tiny_server.rest_port, "/v1/models/no_such_model:predict", requests.bodies,
                             requests.headers, tiny_server.proc.pid)
    result = run(bench, refused)
    assert refused_every_time(result), result


def test_the_floor_answers_the_rest_columns_requests_and_refuses_an_empty_image(bench, photos):
    """The floor (a route with no model on Petal's front end) is only a floor if it does a predict's reading: every
    REST request is answered, and one whose image is empty is refused."""
    with bench.baseline_server("--floor") as (port, pid):
        assert run(bench, bench.rest_requests(port, pid, photos))["errors"] == 0
        assert refused_every_time(run(bench, bench.rest_requests(port, pid, [b""])))
