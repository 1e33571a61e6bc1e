"""Overload and timeouts on a server with a tiny batch queue: 503 + Retry-After, 504, and recovery."""
import concurrent.futures

import pytest
import requests

from server_harness import b64, jpeg, run_batching_server

BODY = {"instances": [b64(jpeg())]}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # A batch closes when 4 rows are queued or after 300 ms; one batch may wait while one runs.
    with run_batching_server(str(tmp_path_factory.mktemp("overload")),
                             "max_batch_size { value: 4 } batch_timeout_micros { value: 300000 } "
                             "max_enqueued_batches { value: 1 } num_batch_threads { value: 1 }",
                             "--rest_api_timeout_in_ms=150", "--threads=48") as s:
        yield s


def predict(server, body=BODY):
    return requests.post(server.rest_url + "/v1/models/flowers:predict", json=body, timeout=30)


def test_request_past_the_timeout_gets_504(server):
    response = predict(server)  # alone, it waits 300 ms for company, past the 150 ms limit
    assert response.status_code == 504 and "Deadline" in response.json()["error"]


def test_full_queue_gets_503_with_retry_after_then_recovers(server):
    with concurrent.futures.ThreadPoolExecutor(40) as pool:
        responses = list(pool.map(lambda _: predict(server), range(40)))
    rejected = [r for r in responses if r.status_code == 503]
    assert rejected, [r.status_code for r in responses]
    assert all(r.headers.get("Retry-After") == "1" and "queue" in r.json()["error"] for r in rejected)
    assert {r.status_code for r in responses} <= {200, 503, 504}
    full_batch = {"instances": BODY["instances"] * 4}  # fills a batch, so it runs at once
    recovered = predict(server, full_batch)
    assert recovered.status_code == 200 and len(recovered.json()["predictions"]) == 4
    metrics = requests.get(server.rest_url + "/monitoring/prometheus/metrics", timeout=10).text
    assert f':petal:serving:rejected_requests{{model_name="flowers",reason="queue_full"}} {len(rejected)}' \
        in metrics
