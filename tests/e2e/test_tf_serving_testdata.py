"""TF Serving's documented first examples, run as its docs type them (curl, and TF Serving's gRPC stubs), on TF
Serving's own model files, copied byte for byte into tests/data/tf_serving (its README there says from where):

- its README: `saved_model_half_plus_two_cpu` served as `half_plus_two`, then
  `curl -d '{"instances": [1.0, 2.0, 5.0]}' -X POST http://localhost:8501/v1/models/half_plus_two:predict`,
  which "Returns => { "predictions": [2.5, 3.0, 4.5] }";
- its REST API guide (g3doc/api_rest.md, "Example"): `saved_model_half_plus_three` served under its folder's name,
  the status call, a predict of 1.0, 2.0, 5.0 -> 3.5, 4.0, 5.5 and a regress on `tensorflow/serving/regress` of
  x = 1.0, 2.0 -> 3.5, 4.0. That signature declares its serialized examples `inputs` as DT_FLOAT while its graph
  takes strings; TF Serving feeds them as strings whatever is declared, and so must Petal (a rebuilt look-alike
  with a DT_STRING input hid that Petal refused this very call);
- tensorflow_model_server_test.py's testPredictWithSignatureDefOnTfLite: `saved_model_half_plus_two_tflite_with_sigdef`
  served with --prefer_tflite_model, predicted over gRPC with the test's own request (x = [2.0], shape [1], on a
  model whose tensor is [1, 1]) by the name its stored SignatureDef gives (`x`, not the tensor's `tflite_input`).

Each server is started as the docs' Docker commands start TF Serving, with the model folder given relative to the
working directory, as the Docker image's entrypoint gives `$MODEL_BASE_PATH/$MODEL_NAME`.
"""
from __future__ import annotations

import json
import subprocess

import grpc
import pytest
from tensorflow.core.example import example_pb2, feature_pb2
from tensorflow.core.framework import types_pb2
from tensorflow_serving.apis import input_pb2, predict_pb2, prediction_service_pb2_grpc, regression_pb2

from server_harness import run_server

TESTDATA = "tests/data/tf_serving"  # relative to the checkout, the servers' working directory


def curl(*args: str) -> dict:
    done = subprocess.run(["curl", "-s", "--max-time", "30", *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_tf_servings_readme_example_on_its_half_plus_two_cpu():
    with run_server(f"--model_base_path={TESTDATA}/saved_model_half_plus_two_cpu", "--model_name=half_plus_two") \
            as server:
        assert curl("-d", '{"instances": [1.0, 2.0, 5.0]}', "-X", "POST",
                    f"{server.rest_url}/v1/models/half_plus_two:predict") == {"predictions": [2.5, 3.0, 4.5]}


@pytest.fixture(scope="module")
def half_plus_three():
    with run_server(f"--model_base_path={TESTDATA}/saved_model_half_plus_three",
                    "--model_name=saved_model_half_plus_three") as server:
        yield server


def test_the_rest_guides_example_status_predict_and_regress(half_plus_three):
    model = f"{half_plus_three.rest_url}/v1/models/saved_model_half_plus_three"
    assert curl(model) == {"model_version_status": [
        {"version": "123", "state": "AVAILABLE", "status": {"error_code": "OK", "error_message": ""}}]}
    assert curl("-d", '{"instances": [1.0,2.0,5.0]}', "-X", "POST", f"{model}:predict") == {
        "predictions": [3.5, 4.0, 5.5]}
    assert curl("-d", '{"signature_name": "tensorflow/serving/regress", "examples": [{"x": 1.0}, {"x": 2.0}]}',
                "-X", "POST", f"{model}:regress") == {"results": [3.5, 4.0]}


def test_the_same_regress_over_grpc_with_tf_servings_stubs(half_plus_three):
    request = regression_pb2.RegressionRequest(input=input_pb2.Input(example_list=input_pb2.ExampleList(examples=[
        example_pb2.Example(features=feature_pb2.Features(feature={"x": feature_pb2.Feature(
            float_list=feature_pb2.FloatList(value=[x]))})) for x in (1.0, 2.0)])))
    request.model_spec.name = "saved_model_half_plus_three"
    request.model_spec.signature_name = "tensorflow/serving/regress"
    with grpc.insecure_channel(half_plus_three.grpc_target) as channel:
        response = prediction_service_pb2_grpc.PredictionServiceStub(channel).Regress(request, timeout=30)
    assert [r.value for r in response.result.regressions] == [3.5, 4.0]
    assert (response.model_spec.version.value, response.model_spec.signature_name) == (
        123, "tensorflow/serving/regress")


def test_a_tflite_models_stored_signature_def_names_its_inputs_as_tf_serving_does():
    request = predict_pb2.PredictRequest()  # built as tensorflow_model_server_test_base.py's VerifyPredictRequest
    request.model_spec.name = "default"
    request.model_spec.signature_name = "serving_default"
    request.inputs["x"].dtype = types_pb2.DT_FLOAT
    request.inputs["x"].float_val.append(2.0)
    request.inputs["x"].tensor_shape.dim.add().size = 1
    with run_server(f"--model_base_path={TESTDATA}/saved_model_half_plus_two_tflite_with_sigdef",
                    "--model_name=default", "--prefer_tflite_model=true") as server:
        with grpc.insecure_channel(server.grpc_target) as channel:
            result = prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(request, timeout=30)
        metadata = curl(f"{server.rest_url}/v1/models/default/metadata")
    assert (result.outputs["y"].dtype, list(result.outputs["y"].float_val)) == (types_pb2.DT_FLOAT, [3.0])
    assert (result.model_spec.version.value, result.model_spec.signature_name) == (123, "serving_default")
    signature = metadata["metadata"]["signature_def"]["signature_def"]["serving_default"]
    assert {k: v["name"] for k, v in signature["inputs"].items()} == {"x": "tflite_input:0"}
    assert {k: v["name"] for k, v in signature["outputs"].items()} == {"y": "y:0"}
