"""Warmup before readiness, hot reload under load, a broken version, and SIGTERM draining, on one real server."""
import base64
import os
import signal
import threading
import time

import pytest
import requests
import tensorflow as tf
from tensorflow_serving.apis import prediction_log_pb2

from grpc_calls import predict_request
from server_harness import b64, copy_model, jpeg, run_server

WARMUP_RECORDS = 200


def write_warmup(version_dir: str, count: int) -> None:
    """Warmup records of 1024 px noise JPEGs: each takes milliseconds to decode on any machine, so the whole
    warmup lasts seconds and the first readiness probe reliably lands before it ends."""
    request = predict_request(jpegs=[jpeg(1024)])
    record = prediction_log_pb2.PredictionLog(predict_log=prediction_log_pb2.PredictLog(request=request))
    with tf.io.TFRecordWriter(os.path.join(version_dir, "assets.extra", "tf_serving_warmup_requests")) as writer:
        for _ in range(count):
            writer.write(record.SerializeToString())


def classify(url: str, timeout: float = 30) -> requests.Response:
    return requests.post(url + "/v1/models/flowers:classify_image", data=jpeg(), timeout=timeout,
                         headers={"Content-Type": "image/jpeg"})


def predict(url: str, timeout: float = 30) -> requests.Response:
    return requests.post(url + "/v1/models/flowers:predict", timeout=timeout,
                         json={"instances": [b64(jpeg())]})


def v2_infer(url: str) -> requests.Response:
    return requests.post(url + "/v2/models/flowers/infer", timeout=30, json={"inputs": [
        {"name": "image_bytes", "shape": [1], "datatype": "BYTES", "parameters": {"content_type": "base64"},
         "data": [base64.b64encode(jpeg()).decode()]}]})


def versions(url: str) -> dict[str, dict]:
    return {s["version"]: s for s in requests.get(url + "/v1/models/flowers", timeout=10).json()
            ["model_version_status"]}


def wait_for(predicate, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def lifecycle_server(root, warmup_records: int = 0):
    """A real server polling a base path, given as a file:// URL as TF Serving takes it, whose version 1 has
    `warmup_records` slow warmup records."""
    base = str(root / "flowers")
    staging = copy_model(str(root / "staging"), 1)
    if warmup_records:
        write_warmup(staging, warmup_records)
    os.makedirs(base)
    os.rename(staging, os.path.join(base, "1"))
    batching = root / "batching.config"
    batching.write_text("max_batch_size { value: 16 } batch_timeout_micros { value: 300000 } "
                        "num_batch_threads { value: 2 }")
    return run_server("--model_name=flowers", f"--model_base_path=file://{base}", "--file_system_poll_wait_seconds=0.3",
                      f"--batching_parameters_file={batching}", "--graceful_timeout=20", "--port=0",
                      wait_ready=False)


@pytest.fixture(scope="module")
def lifecycle(tmp_path_factory):
    """One server for the tests that only add versions; each works from whatever version is newest."""
    root = tmp_path_factory.mktemp("lifecycle")
    with lifecycle_server(root) as server:
        wait_for(lambda: requests.get(server.rest_url + "/readyz", timeout=10).status_code == 200)
        yield server, str(root / "flowers")


def test_a_file_url_base_path_that_exists_is_not_said_to_be_missing(lifecycle):
    """The check at start looked for a folder named `file:///...` and warned that the model's base path did not
    exist yet, for a model that then loaded."""
    server, _ = lifecycle
    assert "does not exist yet" not in server.log(), server.log()[-2000:]


def newest_available(url: str) -> int:
    return max(int(v) for v, s in versions(url).items() if s["state"] == "AVAILABLE")


def test_readiness_waits_for_warmup(tmp_path):
    with lifecycle_server(tmp_path, WARMUP_RECORDS) as server:
        check_readiness_waits_for_warmup(server)


def check_readiness_waits_for_warmup(server) -> None:
    first = requests.get(server.rest_url + "/readyz", timeout=10)
    assert first.status_code == 503 and "error" in first.json()
    assert requests.get(server.rest_url + "/v2/health/ready", timeout=10).status_code == 503
    assert requests.get(server.rest_url + "/healthz", timeout=10).status_code == 200
    # both protocols wait for the warmup to end rather than answer "loading", as TF Serving's closed ports make a
    # client wait (docs/flags.md, "Start-up order")
    for early in (predict(server.rest_url, timeout=90), v2_infer(server.rest_url)):
        assert early.status_code == 200, (early.url, early.text)
    assert requests.get(server.rest_url + "/readyz", timeout=10).status_code == 200
    assert versions(server.rest_url)["1"]["state"] == "AVAILABLE"
    metrics = requests.get(server.rest_url + "/monitoring/prometheus/metrics", timeout=10).text
    assert f':petal:serving:warmup_requests{{model_name="flowers",version="1"}} {WARMUP_RECORDS}' in metrics


def test_hot_reload_under_load_loses_nothing(lifecycle):
    server, base = lifecycle
    old = newest_available(server.rest_url)
    seen, predicted, failures, stop = [[], [], []], [], [], threading.Event()

    def client(send, record):
        while not stop.is_set():
            response = send(server.rest_url)
            if response.status_code == 200:
                record(response.json())
            else:
                failures.append((response.url, response.text))
    threads = [threading.Thread(target=client, args=(classify, lambda body, mine=mine: mine.append(body["version"])))
               for mine in seen]
    threads += [threading.Thread(target=client, args=(predict, predicted.append)) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    copy_model(base, old + 1)
    wait_for(lambda: versions(server.rest_url).get(str(old), {}).get("state") == "END")
    time.sleep(1.0)
    stop.set()
    for t in threads:
        t.join()
    assert failures == []
    assert predicted and all(len(body["predictions"]) == 1 for body in predicted)
    # Each client's requests follow one another, so each sees the version switch once and never back; across
    # clients, a request still in flight on the old version may finish after another's first answer from the new.
    for mine in seen:
        assert mine[0] == old and mine[-1] == old + 1 and sorted(mine) == mine, "the version switches once"


def test_broken_version_is_reported_and_service_continues(lifecycle):
    server, base = lifecycle
    serving, broken = newest_available(server.rest_url), "99"
    staging = os.path.join(os.path.dirname(base), "broken")
    os.makedirs(staging)
    with open(os.path.join(staging, "saved_model.pb"), "wb") as f:
        f.write(b"not a saved model")
    os.rename(staging, os.path.join(base, broken))
    wait_for(lambda: versions(server.rest_url).get(broken, {}).get("state") == "END")
    status = versions(server.rest_url)
    assert status[broken]["status"]["error_code"] != "OK" and status[broken]["status"]["error_message"]
    assert status[str(serving)]["state"] == "AVAILABLE"
    assert requests.get(server.rest_url + "/readyz", timeout=10).status_code == 200
    response = classify(server.rest_url)
    assert response.status_code == 200 and response.json()["version"] == serving


def test_sigterm_finishes_requests_in_flight(tmp_path):
    """Requests in flight finish, each answered with `Connection: close` (they said keep-alive, and their
    connections stayed open for gunicorn's keep-alive timeout); a keep-alive connection idle between requests does
    not hold the drain until the 20 s --graceful_timeout (it is closed at once, as gunicorn's own keep-alive timeout
    would later)."""
    with lifecycle_server(tmp_path) as server:
        wait_for(lambda: requests.get(server.rest_url + "/readyz", timeout=10).status_code == 200)
        results = []

        def send():
            try:
                response = classify(server.rest_url)
                results.append((response.status_code, response.headers.get("Connection")))
            except requests.RequestException as error:
                results.append(repr(error))
        idle = requests.Session()
        assert idle.get(server.rest_url + "/healthz", timeout=10).status_code == 200  # then kept open, idle
        threads = [threading.Thread(target=send) for _ in range(6)]
        for t in threads:
            t.start()
        time.sleep(0.15)  # all six are now waiting in the 300 ms batch window
        started = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join()
        assert results == [(200, "close")] * 6
        assert server.proc.wait(30) == 0
        assert time.monotonic() - started < 10, "an idle keep-alive connection held the drain"
        idle.close()
