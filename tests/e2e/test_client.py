"""serving.client against a real server: REST and gRPC answers, clear 4xx errors, retries of 503 through a
real HTTP proxy in front of it that answers 503 for its first requests (as a load balancer does while a
backend restarts), and retries of gRPC UNAVAILABLE from a real server whose batch queue is full."""
from __future__ import annotations

import concurrent.futures
import http.server
import re
import threading
import time
import urllib.request

import numpy as np
import pytest
import requests
import tensorflow as tf

from server_harness import copy_model, free_port, run_server, tiny_model_base
from serving.client import Client, RequestError, ServerError, predict
from training.synth import CLASSES, render


@pytest.fixture(scope="module")
def images() -> list[bytes]:
    return [render(label, seed=31, size=(44, 44)) for label in CLASSES[2:5]]


@pytest.fixture(scope="module")
def expected(images) -> list[list[tuple[str, float]]]:
    signature = tf.saved_model.load(f"{tiny_model_base()}/1").signatures["serving_default"]
    probabilities = signature(image_bytes=tf.constant(images))["probabilities"].numpy()
    return [[(CLASSES[i], float(row[i])) for i in np.argsort(-row, kind="stable")] for row in probabilities]


class FlakyProxy(http.server.ThreadingHTTPServer):
    """Answers the first `failures` POSTs with 503 (optionally after `delay` seconds), then forwards upstream."""

    def __init__(self, upstream: str, failures: int, delay: float = 0.0) -> None:
        self.upstream, self.failures, self.delay, self.seen = upstream, failures, delay, 0
        super().__init__(("127.0.0.1", 0), ProxyHandler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server_address[1]}"


class ProxyHandler(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        proxy: FlakyProxy = self.server  # type: ignore[assignment]
        body = self.rfile.read(int(self.headers["Content-Length"]))
        proxy.seen += 1
        time.sleep(proxy.delay)
        if proxy.seen <= proxy.failures:
            self.reply(503, b'{"error": "backend restarting"}', {"Content-Type": "application/json"})
            return
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length")}
        request = urllib.request.Request(proxy.upstream + self.path, data=body, headers=headers, method="POST")
        with urllib.request.urlopen(request, timeout=30) as response:
            self.reply(response.status, response.read(), dict(response.headers))

    def reply(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        self.send_response(status)
        for key, value in headers.items():
            if key.lower() not in ("content-length", "transfer-encoding", "connection", "date", "server"):
                self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.mark.parametrize("use_grpc", [False, True], ids=["rest", "grpc"])
def test_predict_top_k_matches_in_process(tiny_server, images, expected, use_grpc):
    address = tiny_server.grpc_target if use_grpc else tiny_server.rest_url
    with Client(address, use_grpc=use_grpc) as client:
        predictions = client.predict(images, top_k=2)
    assert len(predictions) == len(images)
    for prediction, ranked in zip(predictions, expected, strict=False):
        assert [label for label, _ in prediction.top_k] == [label for label, _ in ranked[:2]]
        np.testing.assert_allclose([s for _, s in prediction.top_k], [s for _, s in ranked[:2]], rtol=1e-4)
        assert (prediction.label, prediction.score) == prediction.top_k[0]


def test_rest_and_grpc_give_the_same_scores(tiny_server, images):
    """Every class's score, to the last digit: REST's were Triton's classification strings, six decimals."""
    answers = []
    for address, use_grpc in ((tiny_server.rest_url, False), (tiny_server.grpc_target, True)):
        with Client(address, use_grpc=use_grpc) as client:
            answers.append([p.top_k for p in client.predict(images, top_k=len(CLASSES))])
    assert answers[0] == answers[1]


def test_module_level_predict_and_file_paths(tiny_server, images, expected, tmp_path):
    path = tmp_path / "flower.jpg"
    path.write_bytes(images[0])
    [prediction] = predict([str(path)], tiny_server.rest_url.removeprefix("http://"), top_k=1)
    assert prediction.label == expected[0][0][0]


@pytest.mark.parametrize("use_grpc", [False, True], ids=["rest", "grpc"])
def test_client_errors_are_request_errors(tiny_server, images, use_grpc):
    address = tiny_server.grpc_target if use_grpc else tiny_server.rest_url
    with Client(address, use_grpc=use_grpc) as client:
        with pytest.raises(RequestError) as info:
            client.predict([images[0], b"not an image"])
        assert info.value.code == ("INVALID_ARGUMENT" if use_grpc else "HTTP 400")
    with Client(address, use_grpc=use_grpc, model="nope") as client:
        with pytest.raises(RequestError) as info:
            client.predict(images[:1])
        assert info.value.code == ("NOT_FOUND" if use_grpc else "HTTP 404") and "nope" in info.value.message


def test_retries_503_then_succeeds(tiny_server, images, expected):
    proxy = FlakyProxy(tiny_server.rest_url, failures=2)
    try:
        with Client(proxy.address, retries=3, backoff=0.01) as client:
            [prediction] = client.predict(images[:1], top_k=1)
        assert prediction.label == expected[0][0][0]
        assert proxy.seen == 3
    finally:
        proxy.shutdown()
        proxy.server_close()


def test_gives_up_after_the_retries(tiny_server, images):
    proxy = FlakyProxy(tiny_server.rest_url, failures=10)
    try:
        with Client(proxy.address, retries=2, backoff=0.01) as client:
            with pytest.raises(ServerError) as info:
                client.predict(images[:1])
        assert info.value.code == "HTTP 503" and "restarting" in info.value.message
        assert proxy.seen == 3
    finally:
        proxy.shutdown()
        proxy.server_close()


def test_timeout_is_a_server_error(tiny_server, images):
    proxy = FlakyProxy(tiny_server.rest_url, failures=0, delay=2.0)
    try:
        started = time.monotonic()
        with Client(proxy.address, timeout=0.3) as client:
            with pytest.raises(ServerError) as info:
                client.predict(images[:1])
        assert info.value.code == "DEADLINE_EXCEEDED"
        assert time.monotonic() - started < 1.5
    finally:
        proxy.shutdown()
        proxy.server_close()


@pytest.mark.parametrize("use_grpc", [False, True], ids=["rest", "grpc"])
def test_nothing_listening_is_unavailable_after_backoff(images, use_grpc):
    with Client(f"127.0.0.1:{free_port()}", use_grpc=use_grpc, retries=2, backoff=0.05, timeout=10) as client:
        with pytest.raises(ServerError) as info:
            client.predict(images[:1])
    assert info.value.code == "UNAVAILABLE"


def request_counts(server) -> dict[str, int]:
    """The server's own count of answered requests by status, from its Prometheus metrics."""
    text = requests.get(server.rest_url + "/monitoring/prometheus/metrics", timeout=10).text
    return {status: int(float(count)) for status, count in re.findall(
        r'^:tensorflow:serving:request_count\{model_name="flowers",status="(\w+)"\} (\S+)$', text, re.M)}


def test_grpc_retries_unavailable_from_a_full_batch_queue(tmp_path, images, expected):
    base = str(tmp_path / "flowers")
    copy_model(base, 1)
    batching = tmp_path / "batching.config"
    # Two rows fit in the queue and a batch waits 200 ms for company: a burst of 16 overflows it.
    batching.write_text("max_batch_size { value: 2 } batch_timeout_micros { value: 200000 } "
                        "max_enqueued_batches { value: 1 } num_batch_threads { value: 1 }")
    burst = 16
    with run_server("--model_name=flowers",
                    f"--model_base_path={base}", f"--batching_parameters_file={batching}") as srv:
        with Client(srv.grpc_target, use_grpc=True, retries=0, timeout=30) as client, \
                concurrent.futures.ThreadPoolExecutor(burst) as pool:
            outcomes = list(pool.map(lambda _: _outcome(client, images[:1]), range(burst)))
        refused = [o for o in outcomes if isinstance(o, ServerError)]
        assert refused and all(e.code == "UNAVAILABLE" and "queue" in e.message for e in refused), outcomes

        # A burst the server refuses none of (its threads started too far apart, on a loaded machine) proves no
        # retry: bursts are sent until one is refused in part, and each must have every image answered once.
        for _ in range(5):
            before = request_counts(srv)
            with Client(srv.grpc_target, use_grpc=True, retries=40, backoff=0.05, timeout=60) as client, \
                    concurrent.futures.ThreadPoolExecutor(burst) as pool:
                predictions = list(pool.map(lambda _: client.predict(images[:1], top_k=1)[0], range(burst)))
            after = request_counts(srv)
            assert [p.label for p in predictions] == [expected[0][0][0]] * burst
            assert after["OK"] - before.get("OK", 0) == burst
            if after.get("UNAVAILABLE", 0) > before.get("UNAVAILABLE", 0):
                break
    # The attempts the server refused were all sent again.
    assert after.get("UNAVAILABLE", 0) - before.get("UNAVAILABLE", 0) > 0, (before, after)


def _outcome(client: Client, images: list[bytes]):
    try:
        return client.predict(images, top_k=1)[0]
    except ServerError as error:
        return error
