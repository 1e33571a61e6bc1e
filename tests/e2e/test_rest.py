"""Every REST endpoint and one bad input of each kind, against a real `petal serve` (gunicorn) subprocess."""
import concurrent.futures
import gzip
import io
import json
import re
import socket

import numpy as np
import pytest
import requests
import tensorflow as tf
from PIL import Image

from server_harness import LABELS, access_lines, b64, copy_model, jpeg, run_batching_server, run_server

MAX_REQUEST_BYTES = 1_000_000
MAX_IMAGE_PIXELS = 1_000_000


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("rest")
    base = str(root / "flowers")
    copy_model(base, 1)
    copy_model(base, 2)
    config = root / "models.config"
    config.write_text(f'model_config_list {{ config {{ name: "flowers" base_path: "{base}" model_platform: '
                      '"tensorflow" model_version_policy { all {} } version_labels { key: "stable" value: 1 } '
                      'version_labels { key: "canary" value: 2 } } }')
    # labels at start name versions not loaded yet: TF Serving needs the flag too
    with run_server(f"--model_config_file={config}", "--allow_version_labels_for_unavailable_models=true",
                    f"--max_request_bytes={MAX_REQUEST_BYTES}",
                    f"--max_image_pixels={MAX_IMAGE_PIXELS}") as s:
        yield s


def post(server, path, **kwargs):
    return requests.post(server.rest_url + path, timeout=60, **kwargs)


def get(server, path):
    return requests.get(server.rest_url + path, timeout=60)


# --- endpoints ------------------------------------------------------------------------------------------------

def test_status_of_all_versions_one_version_and_a_label(server):
    body = get(server, "/v1/models/flowers").json()
    assert sorted(body["model_version_status"], key=lambda s: s["version"]) == [
        {"version": v, "state": "AVAILABLE", "status": {"error_code": "OK", "error_message": ""}} for v in "12"]
    assert [s["version"] for s in get(server, "/v1/models/flowers/versions/1").json()["model_version_status"]] == ["1"]
    assert [s["version"] for s in get(server, "/v1/models/flowers/labels/canary").json()["model_version_status"]] \
        == ["2"]


def test_metadata(server):
    body = get(server, "/v1/models/flowers/versions/1/metadata").json()
    assert body["model_spec"] == {"name": "flowers", "signature_name": "", "version": "1"}
    sig = body["metadata"]["signature_def"]["signature_def"]["serving_default"]
    assert sig["method_name"] == "tensorflow/serving/predict"
    assert sig["inputs"]["image_bytes"]["dtype"] == "DT_STRING"
    assert sig["inputs"]["image_bytes"]["tensor_shape"]["dim"] == [{"size": "-1", "name": ""}]
    assert set(sig["outputs"]) == {"probabilities", "classid", "class"}
    assert get(server, "/v1/models/flowers/metadata").json()["model_spec"]["version"] == "2"


def test_predict_row_format(server):
    response = post(server, "/v1/models/flowers:predict", json={"instances": [b64(jpeg(seed=1)), b64(jpeg(seed=2))]})
    assert response.status_code == 200, response.text
    predictions = response.json()["predictions"]
    assert len(predictions) == 2
    for p in predictions:
        assert set(p) == {"probabilities", "classid", "class"}
        assert len(p["probabilities"]) == len(LABELS) and abs(sum(p["probabilities"]) - 1) < 1e-4
        assert p["class"] == LABELS[p["classid"]] == LABELS[int(np.argmax(p["probabilities"]))]


def test_predict_named_rows_columnar_and_signature(server):
    image = jpeg(seed=3)
    named = post(server, "/v1/models/flowers:predict", json={"instances": [{"image_bytes": b64(image)}]}).json()
    columnar = post(server, "/v1/models/flowers:predict", json={"inputs": {"image_bytes": [b64(image)]}}).json()
    assert columnar["outputs"]["classid"] == [named["predictions"][0]["classid"]]
    np.testing.assert_allclose(columnar["outputs"]["probabilities"][0], named["predictions"][0]["probabilities"],
                               rtol=1e-5)
    pixels = np.asarray(Image.open(io.BytesIO(image)).convert("RGB"), np.float32) / 127.5 - 1
    by_array = post(server, "/v1/models/flowers:predict",
                    json={"signature_name": "predict_images", "instances": [pixels.tolist()]})
    assert by_array.status_code == 200, by_array.text
    assert len(by_array.json()["predictions"][0]["probabilities"]) == len(LABELS)


def test_predict_by_version_and_label_and_case_insensitive_path(server):
    body = {"instances": [b64(jpeg())]}
    for path in ("/v1/models/flowers/versions/1:predict", "/v1/models/flowers/labels/stable:predict",
                 "/V1/Models/flowers/Versions/2:PREDICT"):
        response = post(server, path, json=body)
        assert response.status_code == 200, (path, response.text)


def test_gzip_body(server):
    data = gzip.compress(b'{"instances": [%s]}' % str(b64(jpeg())).replace("'", '"').encode())
    response = post(server, "/v1/models/flowers:predict", data=data,
                    headers={"Content-Encoding": "gzip", "Content-Type": "application/json"})
    assert response.status_code == 200, response.text


def test_classify_and_regress(server):
    response = post(server, "/v1/models/flowers:classify", json={"examples": [{"image_bytes": b64(jpeg())}]})
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    assert len(results) == 1 and {label for label, _ in results[0]} == set(LABELS)
    assert [s for _, s in results[0]] == sorted((s for _, s in results[0]), reverse=True)
    regress = post(server, "/v1/models/flowers:regress", json={"examples": [{"image_bytes": b64(jpeg())}]})
    assert regress.status_code == 400 and regress.json() == {"error": "Expected one output Tensor."}


def test_classify_image_raw_and_multipart(server):
    raw = post(server, "/v1/models/flowers/versions/1:classify_image?top_k=3", data=jpeg(seed=4),
               headers={"Content-Type": "image/jpeg"})
    assert raw.status_code == 200, raw.text
    body = raw.json()
    assert body["model"] == "flowers" and body["version"] == 1 and len(body["predictions"]) == 3
    assert all(set(p) == {"label", "score"} and p["label"] in LABELS for p in body["predictions"])
    multipart = post(server, "/v1/models/flowers/versions/1:classify_image?top_k=3",
                     files={"image": ("x.jpg", jpeg(seed=4), "image/jpeg")}).json()
    assert multipart == body
    assert post(server, "/v1/models/flowers:classify_image", data=jpeg(),
                headers={"Content-Type": "image/jpeg"}).json()["version"] == 2


def test_health_readiness_and_metrics(server):
    assert get(server, "/healthz").status_code == 200
    assert get(server, "/readyz").status_code == 200
    assert get(server, "/v2/health/live").status_code == 200
    assert get(server, "/v2/health/ready").status_code == 200
    post(server, "/v1/models/flowers:predict", json={"instances": [b64(jpeg())]})
    text = get(server, "/monitoring/prometheus/metrics").text
    for name in (':tensorflow:serving:request_count{model_name="flowers",status="OK"}',
                 ":tensorflow:serving:request_latency_bucket", ":tensorflow:serving:runtime_latency_count",
                 ":tensorflow:serving:batching_session:queuing_latency_count",
                 ":tensorflow:serving:batching_session:processed_batch_size_count",
                 ":tensorflow:serving:batching_session:padding_size_count", ":petal:serving:batch_queue_depth",
                 ":petal:serving:model_load_latency_count",
                 ':petal:serving:loaded_versions{model_name="flowers",version="2"} 1'):
        assert name in text, name


# --- bad inputs -----------------------------------------------------------------------------------------------

def bomb() -> bytes:
    buffer = io.BytesIO()
    Image.new("L", (2000, 2000)).save(buffer, format="JPEG")  # 4 Mpx of black in a few KB
    return buffer.getvalue()


PREDICT = "/v1/models/flowers:predict"
GOOD = b64(jpeg())
BAD_INPUTS = [  # one of each kind end to end; tests/inprocess/test_http_inprocess.py has the battery
    ("not JSON", PREDICT, {"data": b"{nope"}, 400, "JSON Parse error"),
    ("unknown model", "/v1/models/tulips:predict", {"json": {"instances": [GOOD]}}, 404,
     "Servable not found for request: Latest(tulips)"),
    ("oversized body", PREDICT, {"data": b"x" * (MAX_REQUEST_BYTES + 1)}, 413, "exceeds the capacity limit"),
    # chunked (requests sends an iterator so): werkzeug stopped reading at the limit, and the cut body was parsed
    ("oversized chunked body", PREDICT, {"data": iter([b"x" * (MAX_REQUEST_BYTES + 1)])}, 413,
     "exceeds the capacity limit"),
    ("oversized chunked image", "/v1/models/flowers:classify_image",
     {"data": iter([jpeg() + b"\0" * MAX_REQUEST_BYTES]), "headers": {"Content-Type": "image/jpeg"}}, 413,
     "exceeds the capacity limit"),
    ("oversized chunked V2 body", "/v2/models/flowers/infer", {"data": iter([b" " * (MAX_REQUEST_BYTES + 1)])},
     413, "exceeds the capacity limit"),
    ("gzip bomb", PREDICT, {"data": gzip.compress(b" " * (MAX_REQUEST_BYTES * 3)),
                            "headers": {"Content-Encoding": "gzip"}}, 413, "max_request_bytes"),
    ("decompression bomb", PREDICT, {"json": {"instances": [b64(bomb())]}}, 400, "pixels"),
    ("multipart without image", "/v1/models/flowers:classify_image", {"files": {"file": ("a", b"x")}}, 400,
     "'image'"),
]


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_gets_json_4xx(server, case):
    _, path, kwargs, status, fragment = case
    response = post(server, path, **kwargs)
    assert response.status_code == status, response.text
    assert response.headers["Content-Type"].startswith("application/json")
    assert fragment in response.json()["error"]


UNPARSABLE = [  # what gunicorn's parser refuses before Flask sees the request
    ("Content-Length not a number",
     b"POST /v1/models/flowers:predict HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n", 400, "CONTENT-LENGTH"),
    ("unknown Transfer-Encoding", b"POST /v1/models/flowers:predict HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n"
     b"\r\n{}", 400, "TRANSFER-ENCODING"),
    ("a header past the limit", b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n", 431,
     "header"),
    # gunicorn parses a chunked body as the view reads it: these were a 500 and a traceback in the log
    ("a chunk size not in hex", b"POST /v1/models/flowers:predict HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: "
     b"chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n", 400, "Malformed request body: Invalid chunk size"),
    ("a chunk without its terminator", b"POST /v2/models/flowers/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: "
     b"chunked\r\n\r\n2\r\n{}XX0\r\n\r\n", 400, "Malformed request body: Invalid chunk terminator"),
]


@pytest.mark.parametrize("case", UNPARSABLE, ids=[c[0] for c in UNPARSABLE])
def test_a_request_the_parser_refuses_gets_json_too(server, case):
    """These got gunicorn's HTML page."""
    _, raw, status, fragment = case
    with socket.create_connection(("127.0.0.1", server.rest_port), timeout=10) as sock:
        sock.sendall(raw)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    assert lines[0].startswith(f"HTTP/1.1 {status} "), answer
    assert "Content-Type: application/json" in lines, answer
    assert "X-Content-Type-Options: nosniff" in lines, answer
    assert fragment.lower() in json.loads(body)["error"].lower(), answer


def test_bad_paths(server):
    assert get(server, "/v1/models/flowers:predict").status_code == 400
    metadata = get(server, "/v1/models/flowers/versions/\u00b2/metadata")
    assert metadata.status_code == 400 and "Malformed request" in metadata.json()["error"]
    response = get(server, "/nothing/here")
    assert response.status_code == 404 and "error" in response.json()


# --- batching and deadlines ----------------------------------------------------------------------------------

BATCH_SIZE_METRIC = ":tensorflow:serving:batching_session:processed_batch_size"


@pytest.fixture(scope="module")
def batching_server(tmp_path_factory):
    """A 50 ms batch window and one batch thread, so concurrent requests merge into batches."""
    with run_batching_server(str(tmp_path_factory.mktemp("batching")),
                             "max_batch_size { value: 16 } batch_timeout_micros { value: 50000 } "
                             "num_batch_threads { value: 1 }") as s:
        yield s


def merged_batches(server) -> int:
    """Batches of more than one row the server has run, from its batch-size histogram."""
    text = get(server, "/monitoring/prometheus/metrics").text
    labels = '{model_name="flowers"'
    total = re.search(rf'^{BATCH_SIZE_METRIC}_count{labels}}} (\S+)$', text, re.M)
    single = re.search(rf'^{BATCH_SIZE_METRIC}_bucket{labels},le="1"}} (\S+)$', text, re.M)
    return int(float(total.group(1))) - int(float(single.group(1))) if total else 0


def test_bad_image_in_a_merged_batch_fails_only_its_request(batching_server):
    before = merged_batches(batching_server)

    def send(i):
        image = b"garbage bytes, not a jpeg" if i == 5 else jpeg(seed=i)
        response = post(batching_server, PREDICT, json={"instances": [b64(image)]})
        return i, (response.status_code, response.json())
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        answers = dict(pool.map(send, range(12)))
    status, body = answers.pop(5)
    assert status == 400 and "image" in body["error"].lower(), body
    assert {status for status, _ in answers.values()} == {200}
    assert all(len(body["predictions"]) == 1 for _, body in answers.values())
    assert merged_batches(batching_server) > before, "the requests should have run in merged batches"


class Slow(tf.Module):
    """Signatures that busy-wait for `seconds` inside the graph, to hold a request past its deadline."""

    @staticmethod
    def _wait(seconds: tf.Tensor) -> tf.Tensor:
        end = tf.timestamp() + tf.cast(seconds, tf.float64)
        return tf.while_loop(lambda i: tf.timestamp() < end, lambda i: i + 1, [tf.constant(0)])[0]

    @tf.function(input_signature=[tf.TensorSpec([], tf.float32, name="seconds")])
    def unbatched(self, seconds):
        # a check of the model's own, failing inside TensorFlow's call as many models refuse a client's input
        refused = tf.debugging.assert_non_negative(seconds, message="seconds must not be negative")
        with tf.control_dependencies([refused, self._wait(seconds)]):
            return {"waited": tf.identity(seconds)}

    @tf.function(input_signature=[tf.TensorSpec([None], tf.float32, name="seconds")])
    def batched(self, seconds):
        with tf.control_dependencies([self._wait(tf.reduce_max(seconds))]):
            return {"waited": tf.identity(seconds)}


DEADLINE_MS = 1000


@pytest.fixture(scope="module", params=["true", "false"], ids=["batching", "no-batching"])
def slow_server(request, tmp_path_factory):
    """A model whose serving_default has no batch dimension and whose `batched` signature has one; an access log,
    whose lines say when what a request made the worker write has reached the log."""
    base = tmp_path_factory.mktemp("slow") / "slow"
    module = Slow()
    tf.saved_model.save(module, str(base / "1"), signatures={"serving_default": module.unbatched,
                                                             "batched": module.batched})
    with run_server(f"--model_base_path={base}", "--model_name=slow", "--port=0", "--access_log",
                    f"--enable_batching={request.param}", f"--rest_api_timeout_in_ms={DEADLINE_MS}") as s:
        yield s


def test_a_call_the_model_refuses_is_a_400_without_a_traceback_in_the_log(slow_server):
    """A signature without a batch dimension runs unbatched, on the event loop's pool of OS threads, whose gevent
    pool logged the traceback of every call that raised: 18 lines in the server's log per bad request."""
    answered = len(access_lines(slow_server, lambda lines: True))
    refused = post(slow_server, "/v1/models/slow:predict", json={"inputs": -1.0})
    assert refused.status_code == 400 and "seconds must not be negative" in refused.json()["error"], refused.text
    # the request's own access-log line follows on the worker's stderr whatever the pool printed as it failed
    assert len(access_lines(slow_server, lambda lines: len(lines) > answered)) > answered
    assert "Traceback" not in slow_server.log(), slow_server.log()[-3000:]


@pytest.mark.parametrize("signature, quick, slow", [("serving_default", 0.0, 3.0), ("batched", [0.0], [3.0])])
def test_request_past_the_deadline_gets_504_with_or_without_batching(slow_server, signature, quick, slow):
    def predict(seconds):
        return post(slow_server, "/v1/models/slow:predict", json={"signature_name": signature, "inputs": seconds})
    predict(quick)  # the first call of a signature also builds it: not what the deadline is about
    in_time, late = predict(quick), predict(slow)
    assert in_time.status_code == 200 and in_time.json()["outputs"] == quick, in_time.text
    assert late.status_code == 504 and "Deadline exceeded" in late.json()["error"], late.text
