"""The in-process HTTP tier: Flask's test client over a real serving DataPlane on the tiny test model, without
gunicorn or sockets, so the routing, parsing and error edges of TF Serving's REST API (docs/protocols.md), KServe V2
(docs/protocols.md, 'KServe V2'), the probes and the shared HTTP helpers are covered in milliseconds each.

test_rest.py and test_kserve.py cover the happy paths end to end through gunicorn; this module covers the edges.
"""
from __future__ import annotations

import base64
import gzip
import io
import itertools
import json
import re
import struct
import zlib

import numpy as np
import pytest
import tensorflow as tf
from openapi_spec_validator import validate as validate_openapi
from werkzeug.exceptions import RequestEntityTooLarge

from server_harness import LABELS, b64, tiny_model_base
from serving.core import Code, ServingError
from serving.options.config import ProtocolOptions
from serving.protocols.codec.tfserving_json import predict_response, to_json
from serving.protocols.codec.v2_bytes import frame
from serving.protocols.rest import httputil, web
from serving.protocols.rest.app import create_app
from serving.protocols.rest.openapi import contract
from training.synth import CLASSES, render

MAX_REQUEST_BYTES = 200_000
MAX_IMAGE_PIXELS = 5_000  # the 32x32 test images fit; a 100x100 one does not
PROTOCOLS = ProtocolOptions(max_request_bytes=MAX_REQUEST_BYTES, rest_api_timeout_in_ms=10_000)
JPEG = render("daisy", seed=1, size=(32, 32))
JPEG2 = render("roses", seed=2, size=(32, 32))
BIG_JPEG = render("tulips", seed=3, size=(100, 100))
NOT_AN_IMAGE = b"hello, this is not an image at all"
PREDICT = "/v1/models/flowers:predict"
INFER = "/v2/models/flowers/infer"
HEADER_LENGTH = "Inference-Header-Content-Length"
OUTPUTS = {"class", "classid", "probabilities"}


@pytest.fixture(scope="module")
def dataplane(make_dataplane, tmp_path_factory):
    """One DataPlane serving the tiny model as version 1 with the label "stable", small body and pixel limits."""
    config = tmp_path_factory.mktemp("inprocess") / "models.config"
    config.write_text(f'model_config_list {{ config {{ name: "flowers" base_path: "{tiny_model_base()}" '
                      'model_platform: "tensorflow" version_labels { key: "stable" value: 1 } } }')
    return make_dataplane(model_config_file=str(config), max_image_pixels=MAX_IMAGE_PIXELS)


@pytest.fixture(scope="module")
def client(dataplane):
    return create_app(dataplane, PROTOCOLS).test_client()


# --- helpers ----------------------------------------------------------------------------------------------------

def ok_json(response) -> dict:
    assert response.status_code == 200, response.get_data(as_text=True)
    assert response.mimetype == "application/json"
    return response.get_json()


def error_of(response, status: int) -> str:
    """The `{"error": message}` of a response that must have `status`; the body must have no other key."""
    assert response.status_code == status, response.get_data(as_text=True)
    assert response.mimetype == "application/json"
    body = response.get_json()
    assert set(body) == {"error"} and isinstance(body["error"], str) and body["error"]
    return body["error"]


def assert_error(response, status: int, message: str) -> None:
    """`message` is the whole error when it ends in "$", else a fragment of it."""
    error = error_of(response, status)
    if message.endswith("$"):
        assert error == message[:-1]
    else:
        assert message in error


def send(client, method: str, path: str, kwargs: dict):
    """The test client's answer to a request; form uploads given as bytes are sent as files."""
    if isinstance(kwargs.get("data"), dict):
        kwargs = {**kwargs, "data": {k: (io.BytesIO(v[0]), *v[1:]) for k, v in kwargs["data"].items()}}
    return client.open(path, method=method, **kwargs)


def raw(data: bytes, content_type: str = "application/json", **headers) -> dict:
    return {"data": data, "content_type": content_type, "headers": headers}


def b64s(data: bytes) -> str:
    return base64.b64encode(data).decode()


def binary_request(header: dict, tail: bytes, header_length: str | None = None) -> dict:
    """Test-client kwargs for a V2 request with a binary tail after its JSON header."""
    head = json.dumps(header).encode()
    return raw(head + tail, "application/octet-stream",
               **{HEADER_LENGTH: str(len(head)) if header_length is None else header_length})


def v2_bytes_input(*images: bytes, **extra) -> dict:
    return {"name": "image_bytes", "shape": [len(images)], "datatype": "BYTES", "data": [b64s(i) for i in images],
            "parameters": {"content_type": "base64"}, **extra}


def split_v2_response(response) -> tuple[dict, bytes]:
    """The JSON header and binary tail of a V2 response (the tail empty for a plain JSON answer)."""
    data = response.get_data()
    length = response.headers.get(HEADER_LENGTH)
    if length is None:
        return json.loads(data), b""
    return json.loads(data[:int(length)]), data[int(length):]


@pytest.fixture(scope="module")
def reference() -> np.ndarray:
    """The probabilities of [JPEG, JPEG2] from the SavedModel's own signature, called by TensorFlow apart from the
    server: the numbers every path must reproduce."""
    signature = tf.saved_model.load(f"{tiny_model_base()}/1").signatures["serving_default"]
    return signature(image_bytes=tf.constant([JPEG, JPEG2]))["probabilities"].numpy()


# --- TF Serving REST: status and metadata --------------------------------------------------------------------

STATUS_V1 = {"model_version_status": [{"version": "1", "state": "AVAILABLE",
                                       "status": {"error_code": "OK", "error_message": ""}}]}


@pytest.mark.parametrize("path", ["/v1/models/flowers", "/v1/models/flowers/versions/1",
                                  "/v1/models/flowers/labels/stable", "/V1/MODELS/flowers/",
                                  "/v1/Models/flowers/VERSIONS/01", "/v1/models/flowers/Labels/stable/"])
def test_status(client, path):
    assert ok_json(client.get(path)) == STATUS_V1


@pytest.mark.parametrize("path", ["/v1/models/flowers/metadata", "/v1/models/flowers/versions/1/metadata",
                                  "/v1/models/flowers/labels/stable/metadata", "/V1/MODELS/flowers/METADATA/"])
def test_metadata(client, path):
    body = ok_json(client.get(path))
    assert body["model_spec"] == {"name": "flowers", "signature_name": "", "version": "1"}
    signatures = body["metadata"]["signature_def"]["signature_def"]
    assert set(signatures) == {"serving_default", "predict_images", "__saved_model_init_op"}  # as TF Serving lists
    default = signatures["serving_default"]
    assert default["method_name"] == "tensorflow/serving/predict"
    assert default["inputs"] == {"image_bytes": {
        "dtype": "DT_STRING", "name": "serving_default_image_bytes:0",
        "tensor_shape": {"dim": [{"size": "-1", "name": ""}], "unknown_rank": False}}}
    assert set(default["outputs"]) == OUTPUTS
    assert [d["size"] for d in signatures["predict_images"]["inputs"]["images"]["tensor_shape"]["dim"]] == \
        ["-1", "32", "32", "3"]


# --- TF Serving REST: routing errors -------------------------------------------------------------------------

GOOD = {"json": {"instances": [b64(JPEG)]}}
ROUTING_ERRORS = [
    ("GET on a verb", "GET", PREDICT, {}, 400, "Malformed request: GET /v1/models/flowers:predict$"),
    ("POST on status", "POST", "/v1/models/flowers", GOOD, 400, "Malformed request: POST /v1/models/flowers$"),
    ("POST on metadata", "POST", "/v1/models/flowers/metadata", {}, 400,
     "Malformed request: POST /v1/models/flowers/metadata$"),
    ("PUT on status", "PUT", "/v1/models/flowers", {}, 400, "Malformed request: PUT /v1/models/flowers$"),
    ("DELETE on a verb", "DELETE", PREDICT, {}, 400, "Malformed request: DELETE /v1/models/flowers:predict$"),
    ("unknown verb", "POST", "/v1/models/flowers:explode", GOOD, 400,
     "Malformed request: POST /v1/models/flowers:explode$"),
    ("unknown verb, any case", "POST", "/V1/MODELS/flowers:EXPLODE", GOOD, 400,
     "Malformed request: POST /v1/models/flowers:explode$"),
    ("verb with a digit", "POST", "/v1/models/flowers:predict2", GOOD, 400, "Malformed request"),
    ("no model name", "GET", "/v1/models", {}, 400, "Missing model name in request.$"),  # http_rest_api_handler.cc
    ("version and label", "GET", "/v1/models/flowers/versions/1/labels/stable", {}, 400, "Malformed request"),
    ("unknown subresource", "GET", "/v1/models/flowers/versions/1/signatures", {}, 400, "Malformed request"),
    ("unknown model status", "GET", "/v1/models/nope", {}, 404, "Could not find any versions of model nope$"),
    ("model names keep their case", "GET", "/v1/models/FLOWERS", {}, 404,
     "Could not find any versions of model FLOWERS$"),
    ("unknown model metadata", "GET", "/v1/models/nope/metadata", {}, 404,
     "Servable not found for request: Latest(nope)$"),
    ("unknown model predict", "POST", "/v1/models/x:predict", GOOD, 404,
     "Servable not found for request: Latest(x)$"),
    ("unknown model regress", "POST", "/v1/models/x:regress", {"json": {"examples": [{"x": 1.0}]}}, 404,
     "Servable not found for request: Latest(x)$"),
    # TF Serving finds the model and signature before it reads "instances" or "inputs" (json_tensor.cc)
    ("unknown model, body without tensors", "POST", "/v1/models/x:predict", {"json": {}}, 404,
     "Servable not found for request: Latest(x)$"),
    ("unknown signature, body without tensors", "POST", "/v1/models/flowers:predict",
     {"json": {"signature_name": "nope"}}, 400, 'Serving signature name: "nope" not found in signature def$'),
    ("unknown version status", "GET", "/v1/models/flowers/versions/9", {}, 404,
     "Could not find version 9 of model flowers$"),
    ("unknown version predict", "POST", "/v1/models/flowers/versions/9:predict", GOOD, 404,
     "Servable not found for request: Specific(flowers, 9)$"),
    ("unknown label status", "GET", "/v1/models/flowers/labels/beta", {}, 400,
     "Unrecognized servable version label: beta$"),
    ("unknown label metadata", "GET", "/v1/models/flowers/labels/beta/metadata", {}, 400,
     "Unrecognized servable version label: beta$"),
    ("labels keep their case", "POST", "/v1/models/flowers/labels/Stable:predict", GOOD, 400,
     "Unrecognized servable version label: Stable$"),
    # TF Serving's path patterns take only digits as a version: any other segment is a path it does not have
    ("non-integer version", "POST", "/v1/models/flowers/versions/x:predict", GOOD, 400,
     "Malformed request: POST /v1/models/flowers/versions/x:predict$"),
    ("negative version", "GET", "/v1/models/flowers/versions/-1/metadata", {}, 400,
     "Malformed request: GET /v1/models/flowers/versions/-1/metadata$"),
    ("unicode digit version", "GET", "/v1/models/flowers/versions/\u00b2", {}, 400,
     "Malformed request: GET /v1/models/flowers/versions/\u00b2$"),
    ("unicode digit version predict", "POST", "/v1/models/flowers/versions/\u00b2:predict", GOOD, 400,
     "Malformed request: POST /v1/models/flowers/versions/\u00b2:predict$"),
]


@pytest.mark.parametrize("method, path, kwargs, status, message", [c[1:] for c in ROUTING_ERRORS],
                         ids=[c[0] for c in ROUTING_ERRORS])
def test_rest_routing_errors(client, method, path, kwargs, status, message):
    assert_error(send(client, method, path, kwargs), status, message)


# --- TF Serving REST: predict ---------------------------------------------------------------------------------

@pytest.mark.parametrize("path", [PREDICT, "/V1/MODELS/flowers:PREDICT", "/v1/models/flowers:predict/",
                                  "/v1/models/flowers/Versions/1:Predict", "/v1/models/flowers/labels/stable:predict"])
def test_predict_paths_any_case_version_label_trailing_slash(client, reference, path):
    body = ok_json(client.post(path, json={"instances": [b64(JPEG), b64(JPEG2)]}))
    np.testing.assert_allclose([row["probabilities"] for row in body["predictions"]], reference, rtol=1e-5)


def test_predict_row_format_answers_a_row_per_instance(client, reference):
    predictions = ok_json(client.post(PREDICT, json={"instances": [{"image_bytes": b64(JPEG)},
                                                                   {"image_bytes": b64(JPEG2)}]}))["predictions"]
    assert [set(p) for p in predictions] == [OUTPUTS, OUTPUTS]
    for row, expected in zip(predictions, reference, strict=False):
        np.testing.assert_allclose(row["probabilities"], expected, rtol=1e-5)
        assert row["class"] == LABELS[row["classid"]] == LABELS[int(np.argmax(expected))]


@pytest.mark.parametrize("inputs", [[b64(JPEG), b64(JPEG2)], {"image_bytes": [b64(JPEG), b64(JPEG2)]}],
                         ids=["unnamed", "named"])
def test_predict_columnar_format_answers_a_column_per_output(client, reference, inputs):
    outputs = ok_json(client.post(PREDICT, json={"inputs": inputs}))["outputs"]
    assert set(outputs) == OUTPUTS
    np.testing.assert_allclose(outputs["probabilities"], reference, rtol=1e-5)
    assert outputs["class"] == [LABELS[i] for i in outputs["classid"]]


def test_predict_other_signature_with_float_pixels(client):
    pixels = np.random.default_rng(0).uniform(-1, 1, (1, 32, 32, 3)).round(3).tolist()
    outputs = ok_json(client.post(PREDICT, json={"signature_name": "predict_images", "inputs": pixels}))["outputs"]
    assert len(outputs["probabilities"]) == 1 and abs(sum(outputs["probabilities"][0]) - 1) < 1e-4


COMPRESSIONS = [("gzip", "gzip", gzip.compress), ("deflate", "deflate", zlib.compress),
                ("encoding name in capitals", "GZIP", gzip.compress), ("identity", "identity", bytes),
                ("x-gzip, gzip's other name (RFC 9110)", "x-gzip", gzip.compress)]


@pytest.mark.parametrize("encoding, compress", [c[1:] for c in COMPRESSIONS], ids=[c[0] for c in COMPRESSIONS])
def test_predict_compressed_body(client, reference, encoding, compress):
    data = compress(json.dumps({"instances": [b64(JPEG), b64(JPEG2)]}).encode())
    body = ok_json(client.post(PREDICT, **raw(data, **{"Content-Encoding": encoding})))
    np.testing.assert_allclose([row["probabilities"] for row in body["predictions"]], reference, rtol=1e-5)


@pytest.mark.parametrize("encoding", ["gzip", "zstd"])
def test_a_multipart_form_with_a_content_encoding_is_415(client, encoding):
    """The form is parsed from the body as sent: an encoded one was read as garbage and answered 400 "no field
    named 'image'"."""
    form = {"image": (io.BytesIO(JPEG), "a.jpg")}
    response = client.post("/v1/models/flowers:classify_image", data=form, content_type="multipart/form-data",
                           headers={"Content-Encoding": encoding})
    assert_error(response, 415, "A multipart form is read as sent: send it without Content-Encoding$")
    plain = client.post("/v1/models/flowers:classify_image", data={"image": (io.BytesIO(JPEG), "a.jpg")},
                        content_type="multipart/form-data", headers={"Content-Encoding": "identity"})
    assert plain.status_code == 200, plain.get_data(as_text=True)


@pytest.mark.parametrize("path", [PREDICT, INFER, "/v1/models/flowers:classify_image"])
@pytest.mark.parametrize("encoding", ["br", "zstd", "compress", "gzip, br"])
def test_a_body_in_an_encoding_the_server_does_not_read_is_415(client, path, encoding):
    """It was read as if it were not encoded: plain JSON sent as `br` was answered 200."""
    body = {PREDICT: raw(json.dumps({"instances": [b64(JPEG)]}).encode()),
            INFER: raw(json.dumps({"inputs": [v2_bytes_input(JPEG)]}).encode())}.get(path, raw(JPEG, "image/jpeg"))
    body["headers"]["Content-Encoding"] = encoding
    assert_error(client.post(path, **body), 415,
                 f"Unsupported Content-Encoding '{encoding}': send the body as is, or with gzip or deflate$")


PREDICT_ERRORS = [
    # TF Serving's texts (json_tensor.cc, RapidJSON's parse errors), which its clients and tests match on
    ("empty body", raw(b""), 400, "JSON Parse error: The document is empty$"),
    ("blank body", raw(b" \r\n\t "), 400, "JSON Parse error: The document is empty. at offset: 5$"),
    ("gzip of nothing", raw(gzip.compress(b""), **{"Content-Encoding": "gzip"}), 400,
     "JSON Parse error: The document is empty$"),
    ("malformed JSON", raw(b'{"instances": [1,'), 400, "JSON Parse error: Invalid value. at offset: 17$"),
    ("TF Serving's malformed JSON", raw(b"instances = [1, 2]"), 400, "JSON Parse error: Invalid value. at offset: 0$"),
    ("not UTF-8", raw(b'{"instances": ["\xff"]}'), 400, "JSON Parse error: Invalid encoding in string."),
    ("JSON list", raw(b"[1, 2]"), 400, "JSON Value: [1, 2] Is not object$"),
    ("JSON string", raw(b'"instances"'), 400, 'JSON Value: "instances" Is not object$'),
    ("JSON null", raw(b"null"), 400, "JSON Value: null Is not object$"),
    ("instances and inputs", {"json": {"instances": [b64(JPEG)], "inputs": [b64(JPEG)]}}, 400,
     "Not formatted correctly expecting only one of 'inputs' or 'instances' keys to exist "),
    ("neither instances nor inputs", {"json": {"signature_name": "serving_default"}}, 400,
     "Missing 'inputs' or 'instances' key$"),
    ("empty instances", raw(b'{"instances": []}'), 400,
     """JSON Value: {"instances": []} No values in 'instances' array$"""),
    ("instances not a list", {"json": {"instances": b64(JPEG)}}, 400,
     "Expecting 'instances' to be an list/array"),
    ("named and plain instances", {"json": {"instances": [{"image_bytes": b64(JPEG)}, b64(JPEG)]}}, 400,
     "Instances must be all objects keyed by input name, or all plain values$"),
    ("instances with different names", {"json": {"instances": [{"image_bytes": b64(JPEG)}, {"x": b64(JPEG)}]}},
     400, "Every instance must have the same input names$"),
    ("unknown input name", {"json": {"instances": [{"pixels": b64(JPEG)}]}}, 400,
     "Input names must be ['image_bytes']; missing ['image_bytes'], unexpected ['pixels']$"),
    ("columnar without the input", {"json": {"inputs": {"pixels": b64(JPEG)}}}, 400,
     "Missing named input: image_bytes in 'inputs' object.$"),
    ("object inside a tensor", {"json": {"instances": [[{"a": 1}]]}}, 400,
     'Objects are only allowed as {"b64": ...} inside a tensor value$'),
    ("bad base64", {"json": {"instances": [{"b64": "###"}]}}, 400, "Unable to base64 decode 'b64'"),
    ("url-safe base64", {"json": {"instances": [{"b64": "_-8="}]}}, 400, "URL-safe base64 is not accepted"),
    ("partial padding", {"json": {"instances": [{"b64": "AP8=="}]}}, 400, "Unable to base64 decode 'b64'"),
    ("b64 not a string", {"json": {"instances": [{"b64": 5}]}}, 400,
     "'b64' must be a string of standard base64$"),
    ("numbers for strings", {"json": {"instances": [1, 2]}}, 400,
     "Input 'image_bytes' expects DT_STRING: expected strings, got int$"),
    ("float lists for strings", {"json": {"instances": [[1.5, 2.5]]}}, 400, "DT_STRING"),
    ("strings for floats", {"json": {"signature_name": "predict_images", "instances": ["a"]}}, 400,
     "Input 'images' expects DT_FLOAT"),
    ("wrong shape", {"json": {"signature_name": "predict_images", "instances": [[0.0, 1.0]]}}, 400,
     "Input 'images' has shape [1, 2] but the signature expects [-1, 32, 32, 3] (-1 is any size)$"),
    ("ragged", {"json": {"signature_name": "predict_images", "instances": [[[0.0]], [0.0]]}}, 400, "inhomogeneous"),
    ("unknown signature", {"json": {"signature_name": "nope", "instances": [b64(JPEG)]}}, 400,
     'Serving signature name: "nope" not found in signature def$'),
    ("signature_name a list", {"json": {"signature_name": ["serving_default"], "instances": [b64(JPEG)]}}, 400,
     "not formatted correctly. 'signature_name' key must be a string value."),
    ("signature_name null", {"json": {"signature_name": None, "instances": [b64(JPEG)]}}, 400,
     "not formatted correctly. 'signature_name' key must be a string value."),
    ("not an image", {"json": {"instances": [b64(NOT_AN_IMAGE)]}}, 400, "Unknown image file format"),
    ("truncated JPEG", {"json": {"instances": [b64(JPEG[:300])]}}, 400, "Invalid JPEG data"),
    ("image past the pixel limit", {"json": {"instances": [b64(BIG_JPEG)]}}, 400,
     f"Image too large: 10000 pixels exceeds the limit of {MAX_IMAGE_PIXELS} (--max_image_pixels)$"),
    ("bad gzip", raw(b"not gzip at all", **{"Content-Encoding": "gzip"}), 400, "Invalid gzip body: "),
    ("raw deflate without the zlib wrapper",
     raw(zlib.compress(b'{"instances": []}')[2:-4], **{"Content-Encoding": "deflate"}), 400,
     "Invalid deflate body: "),
    ("oversized body", raw(b" " * (MAX_REQUEST_BYTES + 1)), 413, "exceeds the capacity limit"),
    ("gzip bomb", raw(gzip.compress(b" " * (MAX_REQUEST_BYTES * 20)), **{"Content-Encoding": "gzip"}), 413,
     f"The decompressed body exceeds --max_request_bytes ({MAX_REQUEST_BYTES})$"),
    ("deflate bomb", raw(zlib.compress(b" " * (MAX_REQUEST_BYTES + 1)), **{"Content-Encoding": "deflate"}), 413,
     "exceeds --max_request_bytes"),
]


@pytest.mark.parametrize("kwargs, status, message", [c[1:] for c in PREDICT_ERRORS],
                         ids=[c[0] for c in PREDICT_ERRORS])
def test_predict_errors(client, kwargs, status, message):
    assert_error(client.post(PREDICT, **kwargs), status, message)


def test_body_of_exactly_the_limit_is_read(client):
    """The limit is inclusive: a body inflating to exactly max_request_bytes is parsed, not refused."""
    document = b'{"instances": []}'
    data = gzip.compress(document + b" " * (MAX_REQUEST_BYTES - len(document)))
    assert_error(client.post(PREDICT, **raw(data, **{"Content-Encoding": "gzip"})), 400,
                 "No values in 'instances' array")


DEEP = 900  # under the JSON parser's nesting limit, but the decoders recurse once per level on top of Flask's stack


@pytest.mark.parametrize("path, data", [
    (PREDICT, b"[" * 100_000),
    (PREDICT, b'{"inputs": ' + b"[" * DEEP + b"]" * DEEP + b"}"),
    (INFER, b'{"inputs": [{"name": "image_bytes", "shape": [1], "datatype": "BYTES", "data": '
     + b"[" * DEEP + b'"a"' + b"]" * DEEP + b"}]}"),
], ids=["rest-parser", "rest-b64-decoder", "kserve-flatten"])
def test_deeply_nested_json_is_400_not_500(client, path, data):
    assert_error(client.post(path, **raw(data)), 400, "arrays and objects nest deeper than the limit of 64 levels")


def test_multi_member_gzip_body(client):
    document = json.dumps({"instances": [b64(JPEG)]}).encode()
    data = gzip.compress(document[:10]) + gzip.compress(document[10:])
    assert len(ok_json(client.post(PREDICT, **raw(data, **{"Content-Encoding": "gzip"})))["predictions"]) == 1


def test_multi_member_gzip_bomb_is_413(client):
    """The limit is on the sum of the members, not on each one."""
    member = gzip.compress(b" " * (MAX_REQUEST_BYTES // 2 + 1))
    assert_error(client.post(PREDICT, **raw(member + member, **{"Content-Encoding": "gzip"})), 413,
                 f"The decompressed body exceeds --max_request_bytes ({MAX_REQUEST_BYTES})$")


# Hostile JSON (every malformed body is a fast 400: docs/security.md): (id, the JSON text of one tensor value, message).
DEEP_MESSAGE = "JSON Parse error: arrays and objects nest deeper than the limit of 64 levels"
HOSTILE_JSON = [
    ("nested-100", b"[" * 100 + b"1" + b"]" * 100, DEEP_MESSAGE),
    ("nested-90k-unclosed", b"[" * 90_000, DEEP_MESSAGE),
    ("nested-objects", b'{"a": ' * 70 + b"1" + b"}" * 70, DEEP_MESSAGE),
    ("duplicate-key", b'{"b64": "AP8=", "b64": "AP8="}', "JSON Parse error: duplicate key 'b64' in an object"),
    ("NaN", b"NaN", "JSON Parse error: NaN is not a JSON number"),
    ("Infinity", b"Infinity", "JSON Parse error: Infinity is not a JSON number"),
    ("-Infinity", b"-Infinity", "JSON Parse error: -Infinity is not a JSON number"),
    ("int-5000-digits", b"9" * 5000, "JSON Parse error: a number has more than 100 digits"),
    ("int-101-digits", b"-" + b"1" * 101, "JSON Parse error: a number has more than 100 digits"),
    ("float-101-digits", b"0." + b"1" * 101, "JSON Parse error: a number has more than 100 digits"),
    ("1e999", b"1e999", "JSON Value error: Number out of range - at `$."),
    ("-1E+400", b"-1E+400", "JSON Value error: Number out of range - at `$."),
    ("lone-high-surrogate", b'"\\ud800"', "JSON Parse error: a string holds a lone UTF-16 surrogate escape"),
    ("lone-low-surrogate", b'"a\\uDC00b"', "JSON Parse error: a string holds a lone UTF-16 surrogate escape"),
    ("reversed-pair", b'"\\ude00\\ud83d"', "JSON Parse error: a string holds a lone UTF-16 surrogate escape"),
    ("raw-utf8-surrogate", b'"\xed\xa0\x80"', "JSON Parse error: Invalid encoding in string."),
]
HOSTILE_BODIES = {  # where the hostile value goes in each API's request
    "predict": (PREDICT, b'{"instances": [%s]}'),
    "classify": ("/v1/models/flowers:classify", b'{"examples": [{"image_bytes": %s}]}'),
    "regress": ("/v1/models/flowers:regress", b'{"examples": [{"x": %s}]}'),
    "v2-infer": (INFER, b'{"inputs": [{"name": "images", "shape": [1], "datatype": "FP32", "data": [%s]}]}'),
}


@pytest.mark.parametrize("api", list(HOSTILE_BODIES))
@pytest.mark.parametrize("value, message", [c[1:] for c in HOSTILE_JSON], ids=[c[0] for c in HOSTILE_JSON])
def test_hostile_json_is_400(client, api, value, message):
    path, template = HOSTILE_BODIES[api]
    assert_error(client.post(path, **raw(template % value)), 400, message)


@pytest.mark.parametrize("api", list(HOSTILE_BODIES))
def test_hostile_json_in_the_request_object_itself(client, api):
    """Duplicate top-level keys: the second would silently win."""
    path, template = HOSTILE_BODIES[api]
    body = template % b"1"
    assert_error(client.post(path, **raw(body[:1] + b'"signature_name": "a", "signature_name": "b", ' + body[1:])),
                 400, "JSON Parse error: duplicate key 'signature_name' in an object$")


# --- response encoding ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, values, expected", [
    ("image_bytes", [b"\x00\xff"], [{"b64": "AP8="}]),
    ("thumb_bytes", [[b"ab"], [b"cd"]], [[{"b64": "YWI="}], [{"b64": "Y2Q="}]]),
    ("class", [b"daisy", "ros\u00e9".encode()], ["daisy", "ros\u00e9"]),
    ("class", [b"\xff"], [{"b64": "/w=="}]),
    ("classid", np.array([3, 1], dtype=np.int64), [3, 1]),
], ids=["_bytes-as-b64", "_bytes-nested", "text", "non-utf8-as-b64", "numbers"])
def test_output_naming(name, values, expected):
    array = values if isinstance(values, np.ndarray) else np.array(values, dtype=object)
    assert to_json(name, array) == expected


def test_predict_response_shapes():
    one = {"scores": np.array([[0.5, 0.5], [1.0, 0.0]], dtype=np.float32)}
    two = {"classid": np.array([1, 0]), "class": np.array([b"b", b"a"], dtype=object)}
    assert predict_response(one, row_format=True) == {"predictions": [[0.5, 0.5], [1.0, 0.0]]}
    assert predict_response(one, row_format=False) == {"outputs": [[0.5, 0.5], [1.0, 0.0]]}
    assert predict_response(two, row_format=True) == {"predictions": [{"classid": 1, "class": "b"},
                                                                      {"classid": 0, "class": "a"}]}
    assert predict_response(two, row_format=False) == {"outputs": {"classid": [1, 0], "class": ["b", "a"]}}


# --- TF Serving REST: classify and regress --------------------------------------------------------------------

@pytest.mark.parametrize("body", [
    {"examples": [{"image_bytes": b64(JPEG)}, {"image_bytes": b64(JPEG2)}]},
    {"examples": [{"image_bytes": [b64(JPEG)]}, {"image_bytes": [b64(JPEG2)]}]},
    {"context": {"image_bytes": b64(JPEG)}, "examples": [{}, {"image_bytes": b64(JPEG2)}]},
], ids=["features", "one-element-lists", "context"])
def test_classify_examples(client, reference, body):
    results = ok_json(client.post("/v1/models/flowers:classify", json=body))["results"]
    assert len(results) == 2
    for row, expected in zip(results, reference, strict=False):
        assert [label for label, _ in row] == [LABELS[i] for i in np.argsort(-expected, kind="stable")]
        np.testing.assert_allclose(sorted((s for _, s in row), reverse=True), sorted(expected, reverse=True),
                                   rtol=1e-5)


CLASSIFY_ERRORS = [  # TF Serving's texts (json_tensor.cc) for the body, Petal's for the image path
    ("no examples", {"signature_name": "serving_default"},
     " When method is classify, key 'examples' is expected and was not found"),
    ("empty examples", {"examples": []}, "JSON Value: {\"examples\":[]} 'examples' value is an empty array$"),
    ("example not an object", {"examples": [b64s(JPEG)]}, "Example must be JSON object but got JSON String$"),
    ("context not an object", {"context": [1], "examples": [{}]}, "Example must be JSON object but got JSON Array$"),
    ("no image feature", {"examples": [{"x": 1}]},
     "Example 0 needs one bytes feature 'image_bytes' holding the encoded image (over REST: {\"b64\": ...})$"),
    ("two images in a feature", {"examples": [{"image_bytes": [b64(JPEG), b64(JPEG)]}]}, "Example 0 needs"),
    ("signature_name an object", {"signature_name": {"a": 1}, "examples": [{"image_bytes": b64(JPEG)}]},
     "not formatted correctly. 'signature_name' key must be a string value."),
    ("not an image", {"examples": [{"image_bytes": b64(NOT_AN_IMAGE)}]}, "Unknown image file format"),
]


@pytest.mark.parametrize("body, message", [c[1:] for c in CLASSIFY_ERRORS], ids=[c[0] for c in CLASSIFY_ERRORS])
def test_classify_errors(client, body, message):
    assert_error(client.post("/v1/models/flowers:classify", json=body), 400, message)


@pytest.mark.parametrize("body, message", [
    ({"examples": [{"image_bytes": b64(JPEG)}]}, "Expected one output Tensor.$"),
    ({"signature_name": "nope", "examples": [{"x": 1.0}]}, "No signature was found with the name: nope$"),
], ids=["predict-signature", "unknown-signature"])
def test_regress_is_400(client, body, message):
    assert_error(client.post("/v1/models/flowers:regress", json=body), 400, message)


# --- Petal's :classify_image -----------------------------------------------------------------------------------

CLASSIFY_IMAGE = "/v1/models/flowers:classify_image"


def multipart(data: bytes, field: str = "image") -> dict:
    """Test-client kwargs for a form upload; `send` wraps the bytes in a fresh file for every request."""
    return {"data": {field: (data, "flower.jpg", "image/jpeg")}, "content_type": "multipart/form-data"}


@pytest.mark.parametrize("kwargs", [
    raw(JPEG, "image/jpeg"), raw(JPEG, "application/octet-stream"), raw(JPEG, "image/jpeg; charset=binary"),
    raw(gzip.compress(JPEG), "image/jpeg", **{"Content-Encoding": "gzip"}), multipart(JPEG),
], ids=["image/jpeg", "octet-stream", "mimetype-parameters", "gzip", "multipart"])
def test_classify_image(client, reference, kwargs):
    body = ok_json(send(client, "POST", CLASSIFY_IMAGE + "?top_k=2", kwargs))
    assert body["model"] == "flowers" and body["version"] == 1
    best = np.argsort(-reference[0], kind="stable")[:2]
    assert [p["label"] for p in body["predictions"]] == [LABELS[i] for i in best]
    np.testing.assert_allclose([p["score"] for p in body["predictions"]], reference[0][best], rtol=1e-5)


@pytest.mark.parametrize("query, count", [("", 5), ("?top_k=1", 1), ("?top_k=99", len(LABELS))])
def test_classify_image_top_k(client, query, count):
    predictions = ok_json(client.post(CLASSIFY_IMAGE + query, **raw(JPEG, "image/jpeg")))["predictions"]
    assert len(predictions) == count and {p["label"] for p in predictions} <= set(CLASSES)
    assert [p["score"] for p in predictions] == sorted((p["score"] for p in predictions), reverse=True)


CLASSIFY_IMAGE_ERRORS = [
    ("JSON body", CLASSIFY_IMAGE, {"json": {"instances": [b64(JPEG)]}}, 400,
     ("Send the image as the body (Content-Type: image/*) or as the multipart form field 'image'; got "
      "Content-Type 'application/json'$")),
    ("no content type", CLASSIFY_IMAGE, {"data": JPEG}, 400, "got Content-Type 'none'"),
    ("text body", CLASSIFY_IMAGE, raw(JPEG, "text/plain"), 400, "got Content-Type 'text/plain'"),
    ("empty body", CLASSIFY_IMAGE, raw(b"", "image/jpeg"), 400, "The image is empty$"),
    ("empty upload", CLASSIFY_IMAGE, multipart(b""), 400, "The image is empty$"),
    ("multipart without image", CLASSIFY_IMAGE, multipart(JPEG, field="file"), 400,
     "The multipart form has no field named 'image'$"),
    *[(f"top_k {top_k!r}", f"{CLASSIFY_IMAGE}?top_k={top_k}", raw(JPEG, "image/jpeg"), 400,
       f"top_k must be a positive integer, got {top_k!r}$") for top_k in ("0", "-1", "five", "\u00b2", "")],
    ("not an image", CLASSIFY_IMAGE, raw(NOT_AN_IMAGE, "image/jpeg"), 400, "Unknown image file format"),
    ("truncated JPEG", CLASSIFY_IMAGE, raw(JPEG[:200], "image/jpeg"), 400, "Invalid JPEG data"),
    ("pixel limit", CLASSIFY_IMAGE, raw(BIG_JPEG, "image/jpeg"), 400,
     f"Image too large: 10000 pixels exceeds the limit of {MAX_IMAGE_PIXELS} (--max_image_pixels)$"),
    ("pixel limit, multipart", CLASSIFY_IMAGE, multipart(BIG_JPEG), 400, "Image too large"),
    ("oversized body", CLASSIFY_IMAGE, raw(b"\xff" * (MAX_REQUEST_BYTES + 1), "image/jpeg"), 413,
     "exceeds the capacity limit"),
    ("unknown model", "/v1/models/x:classify_image", raw(JPEG, "image/jpeg"), 404,
     "Servable not found for request: Latest(x)$"),
]


@pytest.mark.parametrize("path, kwargs, status, message", [c[1:] for c in CLASSIFY_IMAGE_ERRORS],
                         ids=[c[0] for c in CLASSIFY_IMAGE_ERRORS])
def test_classify_image_errors(client, path, kwargs, status, message):
    assert_error(send(client, "POST", path, kwargs), status, message)


# --- KServe V2 -----------------------------------------------------------------------------------------------

def test_v2_server_metadata(client):
    assert ok_json(client.get("/v2")) == {"name": "petal", "version": "1",
                                          "extensions": ["binary_tensor_data", "classification",
                                                         "model_configuration", "statistics"]}


@pytest.mark.parametrize("path, body", [
    ("/v2/health/live", {"live": True}), ("/v2/health/ready", {"ready": True}),
    ("/v2/models/flowers/ready", {"name": "flowers", "ready": True}),
    ("/v2/models/flowers/versions/1/ready", {"name": "flowers", "ready": True}),
])
def test_v2_health_answers_carry_the_bodies_kserve_reads(client, path, body):
    """KServe's V2 health bodies (its server's ServerLiveResponse, ServerReadyResponse and ModelReadyResponse,
    which its client reads); Triton's clients read only the status."""
    assert ok_json(client.get(path)) == body


@pytest.mark.parametrize("path, status, message", [
    ("/v2/models/flowers/versions/9/ready", 404, "Could not find version 9 of model flowers$"),
    ("/v2/models/flowers/versions/71/ready", 404, "Could not find version 71 of model flowers$"),
    ("/v2/models/nope/ready", 404, "Could not find any versions of model nope$"),
    ("/v2/models/nope/versions/x/ready", 404, "Could not find any versions of model nope$"),
    ("/v2/models/flowers/versions/x/ready", 400, "Malformed request: version 'x' is not an integer$"),
    ("/v2/models/flowers/versions/-1/ready", 400, "Malformed request: version '-1' is not an integer$"),
])
def test_v2_model_ready_of_an_unknown_model_or_version_is_a_json_error(client, path, status, message):
    assert_error(client.get(path), status, message)


@pytest.mark.parametrize("path", ["/v2/models/flowers", "/v2/models/flowers/versions/1"])
def test_v2_model_metadata(client, path):
    body = ok_json(client.get(path))
    assert {k: body[k] for k in ("name", "versions", "platform", "inputs")} == {
        "name": "flowers", "versions": ["1"], "platform": "tensorflow_savedmodel",
        "inputs": [{"name": "image_bytes", "datatype": "BYTES", "shape": [-1, 1]}]}  # as Triton derives it
    assert sorted(body["outputs"], key=lambda o: o["name"]) == [
        {"name": "class", "datatype": "BYTES", "shape": [-1]}, {"name": "classid", "datatype": "INT64", "shape": [-1]},
        {"name": "probabilities", "datatype": "FP32", "shape": [-1, len(LABELS)]}]


@pytest.mark.parametrize("path, status, message", [
    ("/v2/models/nope", 404, "Servable not found for request: Latest(nope)$"),
    ("/v2/models/flowers/versions/9", 404, "Servable not found for request: Specific(flowers, 9)$"),
    ("/v2/models/flowers/versions/x", 400, "Malformed request: version 'x' is not an integer$"),
])
def test_v2_model_metadata_errors(client, path, status, message):
    assert_error(client.get(path), status, message)


def outputs_by_name(header: dict) -> dict[str, dict]:
    return {o["name"]: o for o in header["outputs"]}


@pytest.mark.parametrize("where", ["request", "input"])
def test_v2_infer_base64_bytes(client, reference, where):
    spec = v2_bytes_input(JPEG, JPEG2)
    body = {"id": "req-42", "inputs": [spec]}
    if where == "request":
        body["parameters"] = spec.pop("parameters")
    response = client.post(INFER, json=body)
    header = ok_json(response)
    assert (header["model_name"], header["model_version"], header["id"]) == ("flowers", "1", "req-42")
    outputs = outputs_by_name(header)
    assert set(outputs) == OUTPUTS
    assert outputs["probabilities"]["shape"] == [2, len(LABELS)] and outputs["probabilities"]["datatype"] == "FP32"
    np.testing.assert_allclose(np.reshape(outputs["probabilities"]["data"], (2, -1)), reference, rtol=1e-5)
    assert outputs["class"]["data"] == [LABELS[i] for i in outputs["classid"]["data"]]


def test_v2_infer_id_of_any_json_type_is_echoed_and_absent_id_is_not_invented(client):
    assert ok_json(client.post(INFER, json={"id": 7, "inputs": [v2_bytes_input(JPEG)]}))["id"] == 7
    assert "id" not in ok_json(client.post(INFER, json={"inputs": [v2_bytes_input(JPEG)]}))


def test_v2_infer_binary_extension_in_and_out(client, reference):
    tail = frame([JPEG, JPEG2])
    header = {"inputs": [{"name": "image_bytes", "shape": [2], "datatype": "BYTES",
                          "parameters": {"binary_data_size": len(tail)}}],
              "outputs": [{"name": "probabilities", "parameters": {"binary_data": True}},
                          {"name": "class", "parameters": {"binary_data": True}}, {"name": "classid"}]}
    response = client.post(INFER, **binary_request(header, tail))
    assert response.status_code == 200, response.get_data()
    assert response.mimetype == "application/octet-stream"
    answer, data = split_v2_response(response)
    outputs = outputs_by_name(answer)
    assert [o["name"] for o in answer["outputs"]] == ["probabilities", "class", "classid"]
    size = outputs["probabilities"]["parameters"]["binary_data_size"]
    assert size == 2 * len(LABELS) * 4 and "data" not in outputs["probabilities"]
    np.testing.assert_allclose(np.frombuffer(data[:size], "<f4").reshape(2, -1), reference, rtol=1e-5)
    classes = data[size:]
    assert len(classes) == outputs["class"]["parameters"]["binary_data_size"]
    assert classes == frame(LABELS[i].encode() for i in outputs["classid"]["data"])


def test_v2_infer_binary_output_for_all(client, reference):
    response = client.post(INFER, json={"inputs": [v2_bytes_input(JPEG)], "parameters": {
        "content_type": "base64", "binary_data_output": True}, "outputs": [{"name": "classid"}]})
    answer, data = split_v2_response(response)
    assert answer["outputs"] == [{"name": "classid", "datatype": "INT64", "shape": [1],
                                  "parameters": {"binary_data_size": 8}}]
    assert np.frombuffer(data, "<i8").tolist() == [int(np.argmax(reference[0]))]


def test_v2_infer_binary_fp32_pixels(client):
    pixels = np.random.default_rng(1).uniform(-1, 1, (2, 32, 32, 3)).astype(np.float32)
    header = {"parameters": {"signature_name": "predict_images"},
              "inputs": [{"name": "images", "shape": list(pixels.shape), "datatype": "FP32",
                          "parameters": {"binary_data_size": pixels.nbytes}}],
              "outputs": [{"name": "probabilities"}]}
    binary = outputs_by_name(ok_json(client.post(INFER, **binary_request(header, pixels.astype("<f4").tobytes()))))
    as_json = {**header, "inputs": [{"name": "images", "shape": list(pixels.shape), "datatype": "FP32",
                                     "data": pixels.reshape(-1).tolist()}]}
    expected = outputs_by_name(ok_json(client.post(INFER, json=as_json)))
    np.testing.assert_allclose(binary["probabilities"]["data"], expected["probabilities"]["data"], rtol=1e-6)
    np.testing.assert_allclose(np.reshape(binary["probabilities"]["data"], (2, -1)).sum(axis=1), 1, rtol=1e-5)


def test_v2_infer_requested_outputs_and_classification(client, reference):
    body = {"inputs": [v2_bytes_input(JPEG, JPEG2)],
            "outputs": [{"name": "probabilities", "parameters": {"classification": 2}}, {"name": "classid"}]}
    answer = ok_json(client.post(INFER, json=body))
    assert [o["name"] for o in answer["outputs"]] == ["probabilities", "classid"]
    top = outputs_by_name(answer)["probabilities"]
    assert (top["datatype"], top["shape"]) == ("BYTES", [2, 2])
    for entries, expected in zip(np.reshape(top["data"], (2, 2)), reference, strict=False):
        best = np.argsort(-expected, kind="stable")[:2]
        parsed = [entry.split(":") for entry in entries]
        assert [(int(index), label) for _, index, label in parsed] == [(i, LABELS[i]) for i in best]
        np.testing.assert_allclose([float(score) for score, _, _ in parsed], expected[best], atol=2e-6)


def test_v2_classification_of_a_model_that_does_not_batch_ranks_its_whole_output(make_dataplane, reference):
    """With batching off the model's configuration says max_batch_size 0, and Triton then ranks the whole output
    (extension_classification.md): two images' probabilities [2, 5] give the top 3 of all ten, shape [3], where the
    rows were ranked apart ([2, 3])."""
    unbatched = create_app(make_dataplane(model_base_path=tiny_model_base(), model_name="flowers",
                                          enable_batching=False), PROTOCOLS).test_client()
    assert ok_json(unbatched.get("/v2/models/flowers/config"))["max_batch_size"] == 0
    body = {"inputs": [v2_bytes_input(JPEG, JPEG2)], "outputs": [{"name": "probabilities",
                                                                  "parameters": {"classification": 3}}]}
    top = outputs_by_name(ok_json(unbatched.post(INFER, json=body)))["probabilities"]
    assert top["shape"] == [3]
    best = np.argsort(-np.ravel(reference[:2]), kind="stable")[:3]
    assert [int(entry.split(":")[1]) for entry in top["data"]] == best.tolist()


def test_v2_infer_versioned_and_gzip(client, reference):
    data = gzip.compress(json.dumps({"inputs": [v2_bytes_input(JPEG)]}).encode())
    answer = ok_json(client.post("/v2/models/flowers/versions/1/infer", **raw(data, **{"Content-Encoding": "gzip"})))
    assert answer["model_version"] == "1"
    np.testing.assert_allclose(outputs_by_name(answer)["probabilities"]["data"], reference[0], rtol=1e-5)


def bytes_spec(**changes) -> dict:
    """A valid V2 BYTES input with some fields changed (None deletes one)."""
    spec = {**v2_bytes_input(JPEG), **changes}
    return {k: v for k, v in spec.items() if v is not None}


BIN_HEADER = {"inputs": [{"name": "image_bytes", "shape": [1], "datatype": "BYTES",
                          "parameters": {"binary_data_size": len(JPEG) + 4}}]}
V2_ERRORS = [
    ("empty body", raw(b""), 400, "JSON Parse error: The document is empty$"),
    ("malformed JSON", raw(b"{nope"), 400, "JSON Parse error: "),
    ("JSON list", raw(b"[1]"), 400, "JSON Value: [1] Is not object$"),
    ("no inputs", {"json": {"inputs": []}}, 400, "JSON Value error: Expected `array` of length >= 1 - at `$.inputs`$"),
    ("input not an object", {"json": {"inputs": [1]}}, 400,
     "JSON Value error: Expected `object`, got `int` - at `$.inputs[0]`$"),
    ("input without a name", {"json": {"inputs": [bytes_spec(name=None)]}}, 400,
     "JSON Value error: Object missing required field `name` - at `$.inputs[0]`$"),
    ("negative shape", {"json": {"inputs": [bytes_spec(shape=[-1])]}}, 400,
     "JSON Value error: Expected `int` >= 0 - at `$.inputs[0].shape[0]`$"),
    ("shape of booleans", {"json": {"inputs": [bytes_spec(shape=[True])]}}, 400,
     "JSON Value error: Expected `int`, got `bool` - at `$.inputs[0].shape[0]`$"),
    ("unsupported datatype", {"json": {"inputs": [bytes_spec(datatype="COMPLEX")]}}, 400,
     "JSON Value error: Invalid enum value 'COMPLEX' - at `$.inputs[0].datatype`$"),
    ("datatype an object", {"json": {"inputs": [bytes_spec(datatype={})]}}, 400,
     "JSON Value error: Expected `str`, got `object` - at `$.inputs[0].datatype`$"),
    ("wrong datatype for the signature", {"json": {"inputs": [bytes_spec(datatype="FP32", data=[1.5])]}}, 400,
     "inference input 'image_bytes' data-type is 'FP32', but model 'flowers' expects 'BYTES'$"),
    ("numbers as BYTES", {"json": {"inputs": [bytes_spec(data=[1])]}}, 400,
     "Input 'image_bytes': BYTES data must be strings$"),
    ("shape and data disagree", {"json": {"inputs": [bytes_spec(shape=[2])]}}, 400,
     "Input 'image_bytes': 1 elements do not match shape [2]$"),
    ("no data", {"json": {"inputs": [bytes_spec(data=None)]}}, 400,
     "Input 'image_bytes' has neither 'data' nor parameters.binary_data_size$"),
    ("bad base64", {"json": {"inputs": [bytes_spec(data=["!!!"])]}}, 400,
     "Unable to base64 decode input 'image_bytes'"),
    ("not an image", {"json": {"inputs": [bytes_spec(data=[b64s(NOT_AN_IMAGE)])]}}, 400, "Unknown image file format"),
    ("pixel limit", {"json": {"inputs": [bytes_spec(data=[b64s(BIG_JPEG)])]}}, 400, "Image too large"),
    ("FP32 data of strings", {"json": {"parameters": {"signature_name": "predict_images"}, "inputs": [
        {"name": "images", "shape": [1], "datatype": "FP32", "data": ["x"]}]}}, 400,
     "Input 'images': data is not FP32: could not convert string to float: 'x'$"),
    ("unknown input name", {"json": {"inputs": [bytes_spec(name="pixels")]}}, 400, "Input names must be"),
    ("unknown output", {"json": {"inputs": [bytes_spec()], "outputs": [{"name": "nope"}]}}, 400,
     "output tensor alias not found in signature: nope Outputs expected to be in the set "
     "{class,classid,probabilities}.$"),
    ("outputs not a list", {"json": {"inputs": [bytes_spec()], "outputs": "classid"}}, 400,
     "JSON Value error: Expected `array`, got `str` - at `$.outputs`$"),
    ("classification on BYTES", {"json": {"inputs": [bytes_spec()], "outputs": [
        {"name": "class", "parameters": {"classification": 2}}]}}, 400,
     "Output 'class': class result not available for output due to unsupported type 'BYTES'$"),
    ("classification negative", {"json": {"inputs": [bytes_spec()], "outputs": [
        {"name": "probabilities", "parameters": {"classification": -1}}]}}, 400,
     "JSON Value error: Expected `int` >= 0 - at `$.outputs[0].parameters.classification`$"),
    ("classification a string", {"json": {"inputs": [bytes_spec()], "outputs": [
        {"name": "probabilities", "parameters": {"classification": "2"}}]}}, 400,
     "JSON Value error: Expected `int`, got `str` - at `$.outputs[0].parameters.classification`$"),
    ("classification true", {"json": {"inputs": [bytes_spec()], "outputs": [
        {"name": "probabilities", "parameters": {"classification": True}}]}}, 400,
     "JSON Value error: Expected `int`, got `bool` - at `$.outputs[0].parameters.classification`$"),
    ("binary_data_size true", binary_request(
        {"inputs": [{**BIN_HEADER["inputs"][0], "parameters": {"binary_data_size": True}}]}, frame([JPEG])),
     400, "JSON Value error: Expected `int`, got `bool` - at `$.inputs[0].parameters.binary_data_size`$"),
    ("request parameters a list", {"json": {"inputs": [bytes_spec()], "parameters": [1]}}, 400,
     "JSON Value error: Expected `object`, got `array` - at `$.parameters`$"),
    ("header length past the body", binary_request(BIN_HEADER, frame([JPEG]), "999999"), 400,
     f"{HEADER_LENGTH} '999999' does not fit a"),
    ("header length not a number", binary_request(BIN_HEADER, frame([JPEG]), "12a"), 400,
     f"{HEADER_LENGTH} '12a' does not fit a"),
    ("header length negative", binary_request(BIN_HEADER, frame([JPEG]), "-1"), 400,
     f"{HEADER_LENGTH} '-1' does not fit a"),
    ("header length unicode digit", binary_request(BIN_HEADER, frame([JPEG]), "\u00b2"), 400,
     f"{HEADER_LENGTH} '\u00b2' does not fit a"),
    ("header length zero", binary_request(BIN_HEADER, frame([JPEG]), "0"), 400,
     "JSON Parse error: The document is empty$"),
    # Triton refuses both (http_server.cc): bytes no input claims, and an input given both ways
    ("bytes past the inputs", binary_request(BIN_HEADER, frame([JPEG]) + b"JUNK"), 400,
     "unexpected additional input data: 4 bytes past the inputs' binary_data_size$"),
    ("data and binary_data_size", binary_request({"inputs": [{**BIN_HEADER["inputs"][0], "data": [b64s(JPEG)]}]},
                                                 frame([JPEG])), 400,
     "Input 'image_bytes' must set only one of the following fields: 'data', 'binary_data_size' in 'parameters'$"),
    ("header length cuts the JSON", binary_request(BIN_HEADER, frame([JPEG]), "10"), 400,
     "JSON Parse error: "),
    ("binary size past the tail", binary_request(BIN_HEADER, frame([JPEG])[:-1]), 400,
     f"Input 'image_bytes': binary_data_size {len(JPEG) + 4} exceeds the binary data sent$"),
    ("binary without the header", {"json": BIN_HEADER}, 400, "exceeds the binary data sent"),
    ("truncated element length", binary_request(
        {"inputs": [{**BIN_HEADER["inputs"][0], "shape": [2], "parameters": {"binary_data_size": 8}}]},
        frame([b"a"]) + b"\x01\x00\x00"), 400,
     "Input 'image_bytes': truncated BYTES element length$"),
    ("element overruns", binary_request(BIN_HEADER, struct.pack("<I", len(JPEG) + 1) + JPEG), 400,
     f"Input 'image_bytes': BYTES element of {len(JPEG) + 1} bytes overruns the binary data$"),
    ("binary BYTES shape past the bytes", binary_request(
        {"inputs": [{**BIN_HEADER["inputs"][0], "shape": [10 ** 9]}]}, frame([JPEG])), 400,
     f"Input 'image_bytes': {len(JPEG) + 4} bytes cannot hold the 1000000000 BYTES elements of shape [1000000000] "
     "(each takes at least 4)$"),
    ("binary BYTES shape past the elements", binary_request(
        {"inputs": [{**BIN_HEADER["inputs"][0], "shape": [2]}]}, frame([JPEG])), 400,
     "Input 'image_bytes': 1 elements do not match shape [2]$"),
    ("binary FP32 of the wrong size", binary_request(
        {"parameters": {"signature_name": "predict_images"},
         "inputs": [{"name": "images", "shape": [1, 32, 32, 3], "datatype": "FP32",
                     "parameters": {"binary_data_size": 12}}]}, b"\0" * 12), 400,
     "Input 'images': 12 bytes do not hold shape [1, 32, 32, 3] of FP32$"),
    ("oversized body", raw(b" " * (MAX_REQUEST_BYTES + 1)), 413, "exceeds the capacity limit"),
    ("gzip bomb", raw(gzip.compress(b" " * (MAX_REQUEST_BYTES * 20)), **{"Content-Encoding": "gzip"}), 413,
     "exceeds --max_request_bytes"),
]


@pytest.mark.parametrize("kwargs, status, message", [c[1:] for c in V2_ERRORS], ids=[c[0] for c in V2_ERRORS])
def test_v2_infer_errors(client, kwargs, status, message):
    assert_error(client.post(INFER, **kwargs), status, message)


@pytest.mark.parametrize("method, path, status, message", [
    ("POST", "/v2/models/nope/infer", 404, "Servable not found for request: Latest(nope)$"),
    ("POST", "/v2/models/flowers/versions/9/infer", 404, "Servable not found for request: Specific(flowers, 9)$"),
    ("POST", "/v2/models/flowers/versions/x/infer", 400, "Malformed request: version 'x' is not an integer$"),
    ("GET", INFER, 405, "The method is not allowed for the requested URL.$"),
])
def test_v2_infer_path_errors(client, method, path, status, message):
    assert_error(send(client, method, path, {"json": {"inputs": [bytes_spec()]}}), status, message)


@pytest.mark.parametrize("path, message", [
    ("/v2/models/nope/infer", "Servable not found for request: Latest(nope)$"),
    ("/v2/models/flowers/versions/9/infer", "Servable not found for request: Specific(flowers, 9)$")])
@pytest.mark.parametrize("body", [{"inputs": [bytes_spec(datatype={})]}, {"inputs": "x"}, b"{nope"],
                         ids=["datatype an object", "inputs a string", "not JSON"])
def test_v2_infer_looks_the_model_up_before_reading_the_body(client, path, message, body):
    """A request for a model or version the server does not have is its 404, whatever the body (once a 500)."""
    kwargs = raw(body) if isinstance(body, bytes) else {"json": body}
    assert_error(client.post(path, **kwargs), 404, message)


@pytest.mark.parametrize("datatype, value", [("INT8", 1000), ("UINT8", -1), ("INT32", 2 ** 40),
                                             ("UINT64", 2 ** 64), ("INT64", -(2 ** 63) - 1)])
def test_v2_out_of_range_integer_is_400(client, datatype, value):
    body = {"inputs": [{"name": "image_bytes", "shape": [1], "datatype": datatype, "data": [value]}]}
    assert_error(client.post(INFER, json=body), 400, f"Input 'image_bytes': data is not {datatype}: ")


@pytest.mark.parametrize("datatype", ["FP32", "INT32", "BOOL"])
def test_v2_null_in_numeric_data_is_400(client, datatype):
    body = {"parameters": {"signature_name": "predict_images"},
            "inputs": [{"name": "images", "shape": [1, 32, 32, 3], "datatype": datatype,
                        "data": [0] * 3071 + [None]}]}
    assert_error(client.post(INFER, json=body), 400, f"Input 'images': data is not {datatype}: null is not a number$")


# --- probes, metrics, unknown paths ---------------------------------------------------------------------------

def test_healthz_and_readyz(client):
    assert ok_json(client.get("/healthz")) == {"status": "live"}
    assert ok_json(client.get("/readyz")) == {"status": "ready", "models": ["flowers"]}


def test_shutting_down_is_not_ready_and_says_when_to_retry(client, dataplane, monkeypatch):
    monkeypatch.setattr(dataplane.startup, "_draining", True)
    response = client.get("/readyz")
    assert_error(response, 503, "Not ready: shutting down$")
    assert response.headers["Retry-After"] == "1"
    assert [(r.status_code, r.get_json()) for r in map(client.get, ("/v2/health/ready", "/v2/models/flowers/ready"))
            ] == [(503, {"ready": False}), (503, {"name": "flowers", "ready": False})]
    assert client.get("/healthz").status_code == 200 and client.get("/v2/health/live").status_code == 200


def test_metrics_count_requests_by_status(client):
    client.post(PREDICT, json={"instances": [b64(JPEG)]})
    client.post(PREDICT, json={"instances": [b64(NOT_AN_IMAGE)]})
    response = client.get("/monitoring/prometheus/metrics")
    assert response.status_code == 200 and response.mimetype == "text/plain"
    text = response.get_data(as_text=True)
    for line in (':tensorflow:serving:request_count{model_name="flowers",status="OK"}',
                 ':tensorflow:serving:request_count{model_name="flowers",status="INVALID_ARGUMENT"}',
                 ":tensorflow:serving:request_latency_bucket"):
        assert line in text, line


@pytest.mark.parametrize("method, path, status, message", [
    ("GET", "/nothing/here", 404, "Not found: GET /nothing/here$"),
    ("GET", "/v2/nothing", 404, "Not found: GET /v2/nothing$"),
    ("POST", "/healthz", 405, "The method is not allowed for the requested URL.$"),
])
def test_unknown_paths_get_json_errors(client, method, path, status, message):
    assert_error(send(client, method, path, {}), status, message)


@pytest.mark.parametrize("method, path, kwargs, status", [
    ("POST", PREDICT, {"json": {"instances": [b64(JPEG)]}}, 200),
    ("POST", PREDICT, raw(b"{nope"), 400),
    ("POST", INFER, raw(b" " * (MAX_REQUEST_BYTES + 1)), 413),
    ("GET", "/nothing/here", {}, 404),
    ("GET", "/v2/health/live", {}, 200),
])
def test_every_answer_says_nosniff_once(client, method, path, kwargs, status):
    """No browser may take a JSON answer, or an error echoing a client's text, for HTML or script."""
    response = send(client, method, path, kwargs)
    assert response.status_code == status
    assert response.headers.getlist("X-Content-Type-Options") == ["nosniff"]


# --- the OpenAPI contract -------------------------------------------------------------------------------------

HTTP_METHODS = {"get", "put", "post", "delete", "options", "head", "patch", "trace"}
_RULE_ARGUMENT = re.compile(r"<(?:(\w+)(?:\(([^)]*)\))?:)?\w+>")
# The /v1 catch-all answers every path no operation matches with 400 "Malformed request": an error path, which
# the contract states in its description rather than as an operation. The web UI's pages and assets are for
# people, not an API.
UNDOCUMENTED_ENDPOINTS = {"static", "tfserving_v1.malformed"}
UNDOCUMENTED_BLUEPRINTS = web.BLUEPRINTS


def rule_templates(rule: str) -> set[str]:
    """A werkzeug rule as OpenAPI path templates with unnamed parameters, one per value of an `any` converter."""
    pieces = _RULE_ARGUMENT.split(rule)  # text, converter, converter arguments, text, ...
    choices = []
    for i in range(0, len(pieces), 3):
        choices.append([pieces[i]])
        if i + 1 < len(pieces):
            converter, arguments = pieces[i + 1], pieces[i + 2]
            choices.append([a.strip() for a in arguments.split(",")] if converter == "any" else ["{}"])
    return {"".join(parts) for parts in itertools.product(*choices)}


def operations_served(app) -> set[tuple[str, str]]:
    return {(template, method.lower()) for rule in app.url_map.iter_rules()
            if rule.endpoint not in UNDOCUMENTED_ENDPOINTS
            and rule.endpoint.split(".")[0] not in UNDOCUMENTED_BLUEPRINTS
            for template in rule_templates(rule.rule) for method in rule.methods - {"HEAD", "OPTIONS"}}


def operations_documented(document: dict) -> set[tuple[str, str]]:
    return {(re.sub(r"\{[^}]*\}", "{}", path), method) for path, item in document["paths"].items()
            for method in item if method in HTTP_METHODS}


@pytest.mark.parametrize("rule, templates", [
    ("/healthz", {"/healthz"}), ("/v2/models/<model>/versions/<version>", {"/v2/models/{}/versions/{}"}),
    ("/v1/models/<segment:name>:<any(predict, classify_image):verb>",
     {"/v1/models/{}:predict", "/v1/models/{}:classify_image"}),
])
def test_rule_templates(rule, templates):
    assert rule_templates(rule) == templates


@pytest.mark.parametrize("metrics_path", ["/monitoring/prometheus/metrics", "/metrics", None])
def test_openapi_contract_is_a_valid_openapi_3_1_document(metrics_path):
    document = contract(metrics_path)
    validate_openapi(document)
    assert document["openapi"].startswith("3.1.") and document["info"]["version"] != "0.0.0"
    assert [p for p in document["paths"] if "metrics" in p] == ([metrics_path] if metrics_path else [])


def test_openapi_contract_describes_every_url_rule_and_nothing_else(client, dataplane):
    """The drift guard: a route added, removed or renamed without the contract (or the other way) fails here."""
    served = operations_served(client.application)
    documented = operations_documented(contract(PROTOCOLS.metrics_path))
    assert served - documented == set(), "routes the contract does not describe"
    assert documented - served == set(), "operations the contract describes that no route serves"
    assert len(served) > 30


def test_openapi_json_is_served(client, dataplane):
    assert ok_json(client.get("/openapi.json")) == contract(PROTOCOLS.metrics_path)


# --- the HTTP helpers in isolation ----------------------------------------------------------------------------

def invalid_message(function, *args) -> str:
    """The message of the INVALID_ARGUMENT (HTTP 400) ServingError that function(*args) must raise."""
    with pytest.raises(ServingError) as info:
        function(*args)
    assert info.value.code is Code.INVALID_ARGUMENT and info.value.code.http_status == 400
    return info.value.message


def test_inflate_all_gzip_members():
    parts = [b'{"a": ', b"[1, 2", b"]}"]
    assert httputil.inflate(b"".join(gzip.compress(p) for p in parts), "gzip", 100) == b"".join(parts)
    many = gzip.compress(b"x") * 5000  # more members than one input chunk holds
    assert httputil.inflate(many, "gzip", 10_000) == b"x" * 5000


@pytest.mark.parametrize("data, encoding, message", [
    (gzip.compress(b"[1]")[:-3], "gzip", "Invalid gzip body: the compressed stream is truncated$"),
    (gzip.compress(b"[1]") + b"junk", "gzip", "Invalid gzip body: "),
    (zlib.compress(b"[1]") + zlib.compress(b"[2]"), "deflate",
     "Invalid deflate body: data after the end of the compressed stream$"),
    (gzip.compress(b"") * (httputil.MAX_GZIP_MEMBERS + 1), "gzip",
     f"Invalid gzip body: more than {httputil.MAX_GZIP_MEMBERS} members$"),
], ids=["truncated", "trailing-garbage", "deflate-two-streams", "too-many-members"])
def test_inflate_rejects(data, encoding, message):
    error = invalid_message(httputil.inflate, data, encoding, 1000)
    assert error == message[:-1] if message.endswith("$") else error.startswith(message)


def test_inflate_limit_is_on_all_members_together():
    with pytest.raises(RequestEntityTooLarge):
        httputil.inflate(gzip.compress(b"x" * 60) * 2, "gzip", 100)
    assert httputil.inflate(gzip.compress(b"x" * 50) * 2, "gzip", 100) == b"x" * 100


@pytest.mark.parametrize("status, retry", [(400, None), (404, None), (429, "1"), (500, None), (503, "1")])
def test_error_response_says_when_to_retry(status, retry):
    response = httputil.error_response(status, "why")
    assert (response.status_code, response.mimetype, response.get_json()) == (status, "application/json",
                                                                               {"error": "why"})
    assert response.headers.get("Retry-After") == retry
