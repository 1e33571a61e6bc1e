"""KServe's Python SDK (the `kserve` package), a stock client Petal did not shape, against a real `petal serve` of the
tiny image model and TF Serving's half_plus_two (exported_models/tf_serving_models.py): its REST client over V2 (server
liveness and readiness, which it reads from the body, model readiness and infer) and V1 (TF Serving's predict),
and its gRPC client's V2 infer, with binary tensors (raw contents) as the SDK sends them. The SDK runs in a process
of its own (tests/kserve_sdk_calls.py says why)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from exported_models.tf_serving_models import half_plus_two
from kserve_sdk_calls import IMAGES
from server_harness import ROOT, run_server, tiny_model_base

CALLS = os.path.join(ROOT, "tests", "kserve_sdk_calls.py")


@pytest.fixture(scope="module")
def answers(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("kserve_sdk")
    half_plus_two(str(root / "half_plus_two" / "00000123"))
    config = root / "models.config"
    config.write_text(f'model_config_list {{ config {{ name: "flowers" base_path: "{tiny_model_base()}" '
                      'model_platform: "tensorflow" } '
                      f'config {{ name: "half_plus_two" base_path: "{root / "half_plus_two"}" '
                      'model_platform: "tensorflow" } }')
    with run_server(f"--model_config_file={config}") as srv:
        done = subprocess.run([sys.executable, CALLS, srv.rest_url, srv.grpc_target], capture_output=True,
                              text=True, timeout=180, env={**os.environ, "PYTHONPATH": os.path.join(ROOT, "tests")})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def answer(answers: dict, call: str):
    assert "error" not in answers[call], answers[call]["error"]
    return answers[call]["answer"]


@pytest.fixture(scope="module")
def local_probabilities() -> np.ndarray:
    signature = tf.saved_model.load(f"{tiny_model_base()}/1").signatures["serving_default"]
    return signature(image_bytes=tf.constant(IMAGES))["probabilities"].numpy()


def test_v2_server_liveness_and_readiness_read_from_the_body(answers):
    assert answer(answers, "probes") == [True, True, True, True, False]


@pytest.mark.parametrize("transport", ["rest", "grpc"])
def test_v2_infer_on_the_image_model_and_half_plus_two(answers, local_probabilities, transport):
    got = answer(answers, f"infer_{transport}")
    assert got["flowers"]["model_name"] == "flowers" and got["half_plus_two"]["model_name"] == "half_plus_two"
    np.testing.assert_allclose(got["flowers"]["probabilities"], local_probabilities, rtol=1e-5, atol=1e-6)
    assert got["half_plus_two"]["y"] == [[2.5], [3.0], [4.5]]


def test_v1_predict_is_tf_servings_first_readme_example(answers):
    """The SDK's V1 protocol is TF Serving's REST predict: docker.md's half_plus_two example."""
    assert answer(answers, "v1_predict") == {"predictions": [2.5, 3.0, 4.5]}
