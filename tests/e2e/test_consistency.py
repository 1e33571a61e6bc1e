"""The same images give the same prediction over every way Petal offers: REST :predict, :classify_image,
gRPC Predict, KServe V2 infer, `petal predict` (REST, gRPC, in-process) and the SavedModel
called directly. One preprocessing path, in the graph, makes this hold; this test keeps it holding.

It serves the shipped, trained model (exported_models/flowers), which tells the synthetic classes apart with
confidence, so agreeing on the class and the ranking means something (an untrained model's near-uniform scores
would agree on almost anything)."""
from __future__ import annotations

import base64
import json
import os
import subprocess
import sys

import grpc
import numpy as np
import pytest
import requests
import tensorflow as tf
from tensorflow_serving.apis import prediction_service_pb2_grpc

from exported_models.model_format import DEFAULT_MODEL_BASE_PATH as SHIPPED_MODEL
from grpc_calls import predict_request
from server_harness import b64, run_server
from serving.client import cli as predict_cli
from training.synth import CLASSES, render

TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


@pytest.fixture(scope="module")
def server():
    with run_server(f"--model_base_path={SHIPPED_MODEL}", "--model_name=flowers") as srv:
        yield srv


@pytest.fixture(scope="module")
def image_files(tmp_path_factory) -> list[str]:
    folder = tmp_path_factory.mktemp("images")
    paths = []
    for i, label in enumerate(CLASSES):
        path = folder / f"{label}.jpg"
        path.write_bytes(render(label, seed=40 + i, size=(64, 48)))
        paths.append(str(path))
    return paths


@pytest.fixture(scope="module")
def images(image_files) -> list[bytes]:
    return [open(path, "rb").read() for path in image_files]


@pytest.fixture(scope="module")
def reference(images) -> np.ndarray:
    """The SavedModel's own probabilities; each image (rendered as class i) must be classified as class i."""
    signature = tf.saved_model.load(f"{SHIPPED_MODEL}/1").signatures["serving_default"]
    probabilities = signature(image_bytes=tf.constant(images))["probabilities"].numpy()
    assert list(probabilities.argmax(axis=1)) == list(range(len(CLASSES))), "the shipped model is not trained"
    return probabilities


def ranked(expected: np.ndarray) -> list[str]:
    return [CLASSES[i] for i in np.argsort(-expected, kind="stable")]


def by_label(pairs) -> np.ndarray:
    """Scores reordered into label-id order, so that ranked answers compare with probability vectors."""
    scores = dict(pairs)
    assert sorted(scores) == sorted(CLASSES)
    return np.array([scores[label] for label in CLASSES])


def test_rest_predict(server, images, reference):
    body = {"instances": [b64(i) for i in images]}
    response = requests.post(f"{server.rest_url}/v1/models/flowers:predict", json=body, timeout=30)
    assert response.status_code == 200, response.text
    predictions = response.json()["predictions"]
    np.testing.assert_allclose([p["probabilities"] for p in predictions], reference, **TOLERANCE)
    assert [p["class"] for p in predictions] == [CLASSES[i] for i in reference.argmax(axis=1)]


def test_rest_classify_image(server, images, reference):
    for image, expected in zip(images, reference, strict=False):
        response = requests.post(f"{server.rest_url}/v1/models/flowers:classify_image?top_k={len(CLASSES)}",
                                 data=image, headers={"Content-Type": "image/jpeg"}, timeout=30)
        assert response.status_code == 200, response.text
        pairs = [(p["label"], p["score"]) for p in response.json()["predictions"]]
        np.testing.assert_allclose(by_label(pairs), expected, **TOLERANCE)
        assert [label for label, _ in pairs][:2] == ranked(expected)[:2]


def test_grpc_predict(server, images, reference):
    with grpc.insecure_channel(server.grpc_target) as channel:
        response = prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(
            predict_request(jpegs=images), timeout=30)
    np.testing.assert_allclose(tf.make_ndarray(response.outputs["probabilities"]), reference, **TOLERANCE)


def test_kserve_v2_infer(server, images, reference):
    body = {"inputs": [{"name": "image_bytes", "shape": [len(images)], "datatype": "BYTES",
                        "parameters": {"content_type": "base64"},
                        "data": [base64.b64encode(i).decode() for i in images]}],
            "outputs": [{"name": "probabilities"}]}
    response = requests.post(f"{server.rest_url}/v2/models/flowers/infer", json=body, timeout=30)
    assert response.status_code == 200, response.text
    [output] = response.json()["outputs"]
    np.testing.assert_allclose(np.reshape(output["data"], output["shape"]), reference, **TOLERANCE)


@pytest.mark.parametrize("mode", ["rest", "grpc", "in-process"])
def test_petal_predict(server, image_files, reference, mode, capsys):
    args = [*image_files, "--top_k", str(len(CLASSES)), "--format", "json"]
    if mode == "rest":
        args += ["--server", server.rest_url.removeprefix("http://")]
    elif mode == "grpc":
        args += ["--server", server.grpc_target, "--grpc"]
    else:
        args += ["--model_base_path", SHIPPED_MODEL]
    assert predict_cli.main(args) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["image"] for line in lines] == image_files
    for line, expected in zip(lines, reference, strict=False):
        scores = by_label([(p["label"], p["score"]) for p in line["predictions"]])
        np.testing.assert_allclose(scores, expected, **TOLERANCE)
        assert [p["label"] for p in line["predictions"]][:2] == ranked(expected)[:2]


@pytest.mark.parametrize("mode", ["rest", "grpc"])
def test_petal_predict_against_a_server_is_quiet_and_loads_tensorflow_only_for_grpc(server, image_files, mode):
    """The console command as a user runs it, in its own process: over REST it never loads TensorFlow (seconds and
    hundreds of MB for one HTTP request); over gRPC, TF Serving's protos load it, without its start-up lines."""
    target = server.rest_url.removeprefix("http://") if mode == "rest" else server.grpc_target
    code = ("import sys, petal\n"
            f"status = petal.main(['predict', *{image_files!r}, '--server', {target!r}"
            f"{', ' + repr('--grpc') if mode == 'grpc' else ''}])\n"
            "print('tensorflow' in sys.modules, file=sys.stderr)\n"
            "sys.exit(status)")
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == [str(mode == "grpc")]
    assert {line.split()[0] for line in done.stdout.splitlines()[1:]} == set(image_files)
