"""KServe's Python SDK (the `kserve` package), a stock client Petal did not shape, against a real `petal serve` of the
tiny image model and TF Serving's half_plus_two (tests/tf_serving_models.py): its REST client over V2 (server
liveness and readiness, which it reads from the body, model readiness and infer) and V1 (TF Serving's predict),
and its gRPC client's V2 infer, with binary tensors (raw contents) as the SDK sends them."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest
import tensorflow as tf
from kserve import InferenceGRPCClient, InferenceRESTClient, InferInput, InferRequest, RESTConfig

from server_harness import jpeg, run_server, tiny_model_base
from tf_serving_models import half_plus_two

TIMEOUT = 60
IMAGES = [jpeg(seed=s) for s in range(3)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("kserve_sdk")
    half_plus_two(str(root / "half_plus_two" / "00000123"))
    config = root / "models.config"
    config.write_text(f'model_config_list {{ config {{ name: "flowers" base_path: "{tiny_model_base()}" '
                      'model_platform: "tensorflow" } '
                      f'config {{ name: "half_plus_two" base_path: "{root / "half_plus_two"}" '
                      'model_platform: "tensorflow" } }')
    with run_server(f"--model_config_file={config}") as srv:
        yield srv


@pytest.fixture(scope="module")
def local_probabilities() -> np.ndarray:
    signature = tf.saved_model.load(f"{tiny_model_base()}/1").signatures["serving_default"]
    return signature(image_bytes=tf.constant(IMAGES))["probabilities"].numpy()


def rest(protocol: str):
    return lambda: InferenceRESTClient(RESTConfig(protocol=protocol, timeout=TIMEOUT))


def binary_input(name: str, datatype: str, value: np.ndarray) -> InferInput:
    tensor = InferInput(name, list(value.shape), datatype)
    tensor.set_data_from_numpy(value, binary_data=True)
    return tensor


def requests_by_model() -> dict[str, InferRequest]:
    images = binary_input("image_bytes", "BYTES", np.array(IMAGES, dtype=object))
    x = binary_input("x", "FP32", np.array([[1.0], [2.0], [5.0]], np.float32))
    return {"flowers": InferRequest("flowers", [images]), "half_plus_two": InferRequest("half_plus_two", [x])}


async def _with(make_client, call):
    """Call with a client made inside the event loop (the gRPC client's channel needs the running loop)."""
    client = make_client()
    try:
        return await call(client)
    finally:
        await client.close()


def test_v2_server_liveness_and_readiness_read_from_the_body(server):
    async def probes(client: InferenceRESTClient) -> list:
        return [await client.is_server_live(server.rest_url), await client.is_server_ready(server.rest_url),
                await client.is_model_ready(server.rest_url, "flowers"),
                await client.is_model_ready(server.rest_url, "half_plus_two"),
                await client.is_model_ready(server.rest_url, "nope")]
    assert asyncio.run(_with(rest("v2"), probes)) == [True, True, True, True, False]


@pytest.mark.parametrize("transport", ["rest", "grpc"])
def test_v2_infer_on_the_image_model_and_half_plus_two(server, local_probabilities, transport):
    async def infer(client) -> dict:
        answers = {}
        for model, request in requests_by_model().items():
            if transport == "rest":
                response = await client.infer(server.rest_url, request, model_name=model)
            else:
                response = await client.infer(request)
            assert response.model_name == model
            answers[model] = {output.name: output.as_numpy() for output in response.outputs}
        return answers
    client = rest("v2") if transport == "rest" else lambda: InferenceGRPCClient(server.grpc_target, timeout=TIMEOUT)
    answers = asyncio.run(_with(client, infer))
    np.testing.assert_allclose(answers["flowers"]["probabilities"], local_probabilities, rtol=1e-5, atol=1e-6)
    assert answers["half_plus_two"]["y"].tolist() == [[2.5], [3.0], [4.5]]


def test_v1_predict_is_tf_servings_first_readme_example(server):
    """The SDK's V1 protocol is TF Serving's REST predict: docker.md's half_plus_two example."""
    async def predict(client: InferenceRESTClient) -> dict:
        return await client.infer(server.rest_url, {"instances": [1.0, 2.0, 5.0]}, model_name="half_plus_two")
    assert asyncio.run(_with(rest("v1"), predict)) == {"predictions": [2.5, 3.0, 4.5]}
