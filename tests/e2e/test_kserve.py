"""KServe V2 / Open Inference Protocol against a real `petal serve` subprocess, with tritonclient.http as the
real V2 client (binary and base64 BYTES) and plain HTTP for the error paths."""
from __future__ import annotations

import base64
import gzip
import json
import struct

import numpy as np
import pytest
import requests
import tensorflow as tf
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from server_harness import IMAGE_SIZE, tiny_model_base
from training.synth import CLASSES, render

SMALL_JPEG_B64 = base64.b64encode(render("daisy", seed=1, size=(32, 32))).decode()


@pytest.fixture(scope="module")
def model_base() -> str:
    return tiny_model_base()


@pytest.fixture(scope="module")
def triton(tiny_server):
    client = httpclient.InferenceServerClient(tiny_server.rest_url.split("://", 1)[-1])
    yield client
    client.close()


@pytest.fixture(scope="module")
def images() -> list[bytes]:
    return [render(label, seed=11, size=(40, 56)) for label in CLASSES[1:4]]


@pytest.fixture(scope="module")
def local_probabilities(model_base, images) -> np.ndarray:
    signature = tf.saved_model.load(f"{model_base}/1").signatures["serving_default"]
    return signature(image_bytes=tf.constant(images))["probabilities"].numpy()


def bytes_input(images: list[bytes], binary: bool) -> httpclient.InferInput:
    if binary:
        data = np.array(images, dtype=object)
    else:
        data = np.array([base64.b64encode(i).decode() for i in images], dtype=object)
    return httpclient.InferInput("image_bytes", [len(images)], "BYTES").set_data_from_numpy(data, binary_data=binary)


def test_health_and_readiness(triton):
    assert triton.is_server_live()
    assert triton.is_server_ready()
    assert triton.is_model_ready("flowers")
    assert triton.is_model_ready("flowers", "1")
    assert not triton.is_model_ready("flowers", "9")
    assert not triton.is_model_ready("nope")


@pytest.mark.parametrize("path, status, error", [
    ("/v2/models/nope/ready", 404, "Could not find any versions of model nope"),
    ("/v2/models/nope/versions/1/ready", 404, "Could not find any versions of model nope"),
    ("/v2/models/flowers/versions/9/ready", 404, "Could not find version 9 of model flowers"),
    ("/v2/models/flowers/versions/\u00b2/ready", 400, "Malformed request: version '\u00b2' is not an integer")])
def test_model_ready_of_an_unknown_model_or_version_is_a_json_error(tiny_server, path, status, error):
    response = requests.get(tiny_server.rest_url + path, timeout=10)
    assert (response.status_code, response.json()) == (status, {"error": error})


def test_metadata(triton, tiny_server):
    metadata = triton.get_model_metadata("flowers")
    assert metadata["name"] == "flowers" and metadata["versions"] == ["1"]
    # [-1, 1]: one image per row, as Triton derives it from the model configuration (dims [1] reshaped to [])
    assert metadata["inputs"] == [{"name": "image_bytes", "datatype": "BYTES", "shape": [-1, 1]}]
    outputs = {o["name"]: o for o in metadata["outputs"]}
    assert outputs["probabilities"] == {"name": "probabilities", "datatype": "FP32", "shape": [-1, len(CLASSES)]}
    assert outputs["classid"]["datatype"] == "INT64" and outputs["class"]["datatype"] == "BYTES"
    assert triton.get_model_metadata("flowers", "1")["versions"] == ["1"]
    response = requests.get(f"{tiny_server.rest_url}/v2/models/nope", timeout=10)
    assert response.status_code == 404 and "nope" in response.json()["error"]


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "base64"])
def test_infer_bytes(triton, images, local_probabilities, binary):
    outputs = [httpclient.InferRequestedOutput(name, binary_data=binary) for name in ("probabilities", "class")]
    result = triton.infer("flowers", [bytes_input(images, binary)], outputs=outputs, request_id="req-7",
                          parameters=None if binary else {"content_type": "base64"})
    np.testing.assert_allclose(result.as_numpy("probabilities"), local_probabilities, rtol=1e-5, atol=1e-6)
    classes = [c.decode() if isinstance(c, bytes) else c for c in result.as_numpy("class")]
    assert classes == [CLASSES[i] for i in local_probabilities.argmax(axis=1)]
    response = result.get_response()
    assert response["model_name"] == "flowers" and response["model_version"] == "1" and response["id"] == "req-7"


def test_infer_all_outputs_by_default_and_versioned_path(triton, images, local_probabilities):
    result = triton.infer("flowers", [bytes_input(images[:1], True)], model_version="1")
    assert {o["name"] for o in result.get_response()["outputs"]} == {"probabilities", "classid", "class"}
    np.testing.assert_array_equal(result.as_numpy("classid"), local_probabilities[:1].argmax(axis=1))


def test_classification_extension_gives_top_k_with_labels(triton, images, local_probabilities):
    output = httpclient.InferRequestedOutput("probabilities", binary_data=False, class_count=2)
    result = triton.infer("flowers", [bytes_input(images, True)], outputs=[output])
    rows = result.as_numpy("probabilities")
    assert rows.shape == (len(images), 2)
    for row, expected in zip(rows, local_probabilities, strict=False):
        best = np.argsort(-expected)[:2]
        parsed = [(c.decode() if isinstance(c, bytes) else c).split(":") for c in row]
        assert [int(p[1]) for p in parsed] == list(best)
        assert [p[2] for p in parsed] == [CLASSES[i] for i in best]
        np.testing.assert_allclose([float(p[0]) for p in parsed], expected[best], rtol=1e-4)


def test_plain_json_input_level_base64_and_gzip(tiny_server, images, local_probabilities):
    body = {"inputs": [{"name": "image_bytes", "shape": [1], "datatype": "BYTES",
                        "parameters": {"content_type": "base64"}, "data": [base64.b64encode(images[0]).decode()]}],
            "outputs": [{"name": "classid"}]}
    response = requests.post(f"{tiny_server.rest_url}/v2/models/flowers/infer", timeout=30,
                             data=gzip.compress(json.dumps(body).encode()),
                             headers={"Content-Encoding": "gzip", "Content-Type": "application/json"})
    assert response.status_code == 200, response.text
    [output] = response.json()["outputs"]
    assert output == {"name": "classid", "datatype": "INT64", "shape": [1],
                      "data": [int(local_probabilities[0].argmax())]}


def test_predict_images_signature_via_parameters(triton):
    pixels = np.random.default_rng(1).uniform(-1, 1, (2, IMAGE_SIZE, IMAGE_SIZE, 3)).astype(np.float32)
    inp = httpclient.InferInput("images", list(pixels.shape), "FP32").set_data_from_numpy(pixels)
    result = triton.infer("flowers", [inp], parameters={"signature_name": "predict_images"},
                          outputs=[httpclient.InferRequestedOutput("probabilities")])
    np.testing.assert_allclose(result.as_numpy("probabilities").sum(axis=1), 1.0, rtol=1e-5)


def post_infer(server, body: bytes | dict, headers: dict | None = None, model: str = "flowers"):
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    return requests.post(f"{server.rest_url}/v2/models/{model}/infer", data=data, headers=headers or {}, timeout=30)


def bytes_body(data: list[str]) -> dict:
    return {"inputs": [{"name": "image_bytes", "shape": [len(data)], "datatype": "BYTES",
                        "parameters": {"content_type": "base64"}, "data": data}]}


def with_parameters(where: str, value) -> dict:
    """A valid request except for one `parameters` (of the request, its input or its output) set to `value`."""
    body = {**bytes_body([SMALL_JPEG_B64]), "outputs": [{"name": "classid"}]}
    target = {"request": body, "input": body["inputs"][0], "output": body["outputs"][0]}[where]
    target["parameters"] = value
    return body


@pytest.mark.parametrize("body, status, fragment", [
    (b"", 400, "empty"),
    (b"{not json", 400, "JSON"),
    ({"inputs": []}, 400, "inputs"),
    (bytes_body(["!!!not base64"]), 400, "base64"),
    ({"inputs": [{"name": "image_bytes", "shape": [2], "datatype": "BYTES", "data": ["a"]}]}, 400, "shape"),
    ({"inputs": [{"name": "image_bytes", "shape": [1], "datatype": "COMPLEX", "data": [1]}]}, 400, "datatype"),
    (bytes_body([base64.b64encode(b"not an image").decode()]), 400, "image"),
    ({**bytes_body([SMALL_JPEG_B64]), "outputs": [{"name": "nope"}]}, 400, "nope"),
    (with_parameters("request", [1]), 400, "Expected `object`, got `array` - at `$.parameters`"),
    (with_parameters("input", "base64"), 400, "Expected `object`, got `str` - at `$.inputs[0].parameters`"),
    (with_parameters("output", 3), 400, "Expected `object`, got `int` - at `$.outputs[0].parameters`"),
    (with_parameters("request", {"signature_name": ["serving_default"]}), 400,
     "Expected `str`, got `array` - at `$.parameters.signature_name`"),
], ids=["empty", "bad-json", "no-inputs", "bad-base64", "shape-mismatch", "bad-datatype", "bad-image",
        "unknown-output", "request-parameters-list", "input-parameters-string", "output-parameters-number",
        "signature-name-list"])
def test_bad_requests_are_4xx_json(tiny_server, body, status, fragment):
    response = post_infer(tiny_server, body)
    assert response.status_code == status, response.text
    assert fragment in response.json()["error"]


def test_unknown_model_and_version_are_404(tiny_server, images):
    body = bytes_body([base64.b64encode(images[0]).decode()])
    response = post_infer(tiny_server, body, model="nope")
    assert response.status_code == 404 and "nope" in response.json()["error"]
    response = requests.post(f"{tiny_server.rest_url}/v2/models/flowers/versions/9/infer", json=body, timeout=30)
    assert response.status_code == 404
    for version in ("x", "\u00b2"):
        response = requests.post(f"{tiny_server.rest_url}/v2/models/flowers/versions/{version}/infer", json=body,
                                 timeout=30)
        assert response.status_code == 400 and "Malformed request" in response.json()["error"], response.text
    response = requests.get(f"{tiny_server.rest_url}/v2/models/flowers/versions/\u00b2", timeout=30)
    assert response.status_code == 400 and "Malformed request" in response.json()["error"], response.text


def test_truncated_binary_data_is_400(tiny_server, images):
    raw = struct.pack("<I", len(images[0]) + 100) + images[0]
    header = json.dumps({"inputs": [{"name": "image_bytes", "shape": [1], "datatype": "BYTES",
                                     "parameters": {"binary_data_size": len(raw)}}]}).encode()
    response = post_infer(tiny_server, header + raw, {"Inference-Header-Content-Length": str(len(header))})
    assert response.status_code == 400 and "overruns" in response.json()["error"]
    for length in (str(len(header) * 100), "\u00b2", "-1"):
        response = post_infer(tiny_server, header + raw, {"Inference-Header-Content-Length": length})
        assert response.status_code == 400 and "Inference-Header-Content-Length" in response.json()["error"]


@pytest.mark.parametrize("shape", [[10 ** 9], [2]], ids=["past-the-bytes", "past-the-elements"])
def test_binary_bytes_whose_shape_disagrees_with_the_data_is_400(tiny_server, images, shape):
    """A malformed request, as Triton answers it, and not the 413 of a request too large for the memory budget: a
    shape of a billion elements over one element's bytes was charged for a billion objects before it was checked."""
    raw = struct.pack("<I", len(images[0])) + images[0]
    header = json.dumps({"inputs": [{"name": "image_bytes", "shape": shape, "datatype": "BYTES",
                                     "parameters": {"binary_data_size": len(raw)}}]}).encode()
    response = post_infer(tiny_server, header + raw, {"Inference-Header-Content-Length": str(len(header))})
    assert response.status_code == 400, response.text
    assert "Input 'image_bytes'" in response.json()["error"] and str(shape) in response.json()["error"]


def test_tritonclient_raises_on_bad_input(triton):
    bad = httpclient.InferInput("image_bytes", [1], "BYTES").set_data_from_numpy(
        np.array([b"not an image"], dtype=object))
    with pytest.raises(InferenceServerException) as info:
        triton.infer("flowers", [bad])
    assert info.value.status() == "400"
