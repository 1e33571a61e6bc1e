"""Predict on a `tf.saved_model.save` model as TF Serving runs it: REST row and columnar forms for each dtype,
`_bytes` outputs as {"b64"}, float32 written as TF Serving writes it, its dtype, batch and output_filter errors,
and signature `defaults` (TF 2.21's SignatureDef field) in the metadata and filling a missing input. The JSON
writing and dtype checks on their own, without a server, are tests/unit/test_predict_json.py.
"""
from __future__ import annotations

import base64
import json

import grpc
import numpy as np
import pytest
import requests
import tensorflow as tf
from tensorflow.core.protobuf import saved_model_pb2
from tensorflow_serving.apis import get_model_metadata_pb2, predict_pb2

from foreign_models import tf2_module
from server_harness import run_server


def add_default(version_dir: str, signature_name: str, name: str, value: np.ndarray) -> None:
    """Give a signature's input a default in saved_model.pb, as TF 2.21's SignatureDef.defaults holds it."""
    path = f"{version_dir}/saved_model.pb"
    saved_model = saved_model_pb2.SavedModel()
    with open(path, "rb") as f:
        saved_model.ParseFromString(f.read())
    saved_model.meta_graphs[0].signature_def[signature_name].defaults[name].CopyFrom(tf.make_tensor_proto(value))
    with open(path, "wb") as f:
        f.write(saved_model.SerializeToString())


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("predict-formats")
    tf2_module(str(root / "module"))
    add_default(tf2_module(str(root / "defaults")), "serving_default", "x", np.array([4.0], np.float32))
    config = root / "models.config"
    config.write_text("model_config_list { "
                      f'config {{ name: "module" base_path: "{root / "module"}" model_platform: "tensorflow" }} '
                      f'config {{ name: "defaults" base_path: "{root / "defaults"}" model_platform: "tensorflow" }} }}')
    with run_server(f"--model_config_file={config}", "--enable_batching") as srv:
        yield srv


def predict(server, body: dict, model: str = "module") -> requests.Response:
    return requests.post(f"{server.rest_url}/v1/models/{model}:predict", json=body, timeout=60)


def ok(response: requests.Response) -> dict:
    assert response.status_code == 200, response.text
    return response.json()


def test_tf_servings_first_rest_example(server):
    """g3doc/api_rest.md: half_plus_two predicts 2.5, 3.0, 4.5 for 1.0, 2.0, 5.0."""
    assert ok(predict(server, {"instances": [1.0, 2.0, 5.0]})) == {"predictions": [2.5, 3.0, 4.5]}
    assert ok(predict(server, {"inputs": [1.0, 2.0, 5.0]})) == {"outputs": [2.5, 3.0, 4.5]}
    assert ok(predict(server, {"inputs": {"x": [1.0, 2.0, 5.0]}})) == {"outputs": [2.5, 3.0, 4.5]}


def test_float32_outputs_read_as_tf_serving_writes_them(server):
    """TF Serving's text for these (util/json_tensor.cc WriteDecimal: six digits, or nine where six do not read
    back as the float32), read as doubles: 2.16666675 is not the shortest decimal's 2.1666667."""
    response = predict(server, {"instances": [0.3333333, 0.1, 17999996.0, 19999996.0, 1e-07, 123.456789]})
    assert response.json() == json.loads('{"predictions": [2.16666675, 2.05, 9e+06, 1e+07, 2.0, 63.7283936]}')
    assert "2.16666675" in response.text and "63.7283936" in response.text


def test_several_inputs_and_outputs_in_row_and_columnar_form(server):
    binary = b"\xff\x00\xfe"
    rows = {"signature_name": "multi", "instances": [
        {"ids": [1, 2], "text": "ab"}, {"ids": [3, -4], "text": {"b64": base64.b64encode(binary).decode()}}]}
    assert ok(predict(server, rows)) == {"predictions": [
        {"sum": 3, "length": 2, "echo_bytes": {"b64": base64.b64encode(b"ab").decode()}},
        {"sum": -1, "length": 3, "echo_bytes": {"b64": base64.b64encode(binary).decode()}}]}
    columns = {"signature_name": "multi", "inputs": {"ids": [[1, 2], [3, -4]], "text": ["ab", "héllo"]}}
    assert ok(predict(server, columns)) == {"outputs": {
        "sum": [3, -1], "length": [2, len("héllo".encode())],
        "echo_bytes": [{"b64": base64.b64encode(s.encode()).decode()} for s in ("ab", "héllo")]}}


@pytest.mark.parametrize("body, message", [
    ({"signature_name": "multi", "inputs": {"ids": [[1.5, 2]], "text": ["a"]}},
     "Input 'ids' expects DT_INT64: got float64 values, not of expected type: int64"),
    ({"signature_name": "multi", "inputs": {"ids": [[True, False]], "text": ["a"]}},
     "Input 'ids' expects DT_INT64: got bool values, not of expected type: int64"),
    ({"instances": [True]}, "Input 'x' expects DT_FLOAT: got bool values, not of expected type: float"),
    ({"signature_name": "multi", "inputs": {"ids": [[1, 2]], "text": [5]}},
     "Input 'text' expects DT_STRING: expected strings, got int"),
    ({"signature_name": "multi", "inputs": {"ids": [1, 2], "text": ["a", "b"]}},
     "Input 'ids' has shape [2] but the signature expects [-1, 2] (-1 is any size)"),
    ({"signature_name": "nope", "instances": [1.0]}, 'Serving signature name: "nope" not found in signature def'),
], ids=["float for int64", "bool for int64", "bool for float", "number for string", "shape", "unknown signature"])
def test_rest_predict_errors(server, body, message):
    response = predict(server, body)
    assert response.status_code == 400 and response.json() == {"error": message}


def test_inputs_that_cannot_batch_together_run_alone_as_tf_serving_runs_them_without_batching(server):
    """Inputs of uneven dimension 0 cannot be one batch; with batching on (Petal's default) the request runs as one
    inference, as every request does in TF Serving's default, rather than failing with its batching session's
    'Batching Run() input tensors must have equal 0th-dimension size'."""
    body = {"signature_name": "multi", "inputs": {"ids": [[1, 2]], "text": ["a", "bc"]}}
    assert ok(predict(server, body)) == {"outputs": {
        "sum": [3], "length": [1, 2], "echo_bytes": [{"b64": base64.b64encode(t).decode()} for t in (b"a", b"bc")]}}


def multi_request(**spec) -> predict_pb2.PredictRequest:
    request = predict_pb2.PredictRequest(output_filter=spec.pop("output_filter", []))
    request.model_spec.name = "module"
    request.model_spec.signature_name = "multi"
    request.inputs["ids"].CopyFrom(tf.make_tensor_proto(np.array([[1, 2], [3, 4]], np.int64)))
    request.inputs["text"].CopyFrom(tf.make_tensor_proto(np.array([b"ab", b"c"], dtype=object)))
    return request


def test_grpc_output_filter_and_its_errors(stub):
    response = stub.Predict(multi_request(output_filter=["sum"]), timeout=60)
    assert list(response.outputs) == ["sum"] and tf.make_ndarray(response.outputs["sum"]).tolist() == [3, 7]
    assert response.model_spec.signature_name == "multi"
    for output_filter, message in [
        (["sum", "nope"], "output tensor alias not found in signature: nope Outputs expected to be in the set "
                          "{echo_bytes,length,sum}."),
        (["sum", "sum"], "duplicate output tensor alias: sum")]:
        with pytest.raises(grpc.RpcError) as info:
            stub.Predict(multi_request(output_filter=output_filter), timeout=60)
        assert (info.value.code(), info.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, message)


def test_grpc_a_tensor_of_another_dtype_is_refused_naming_its_argument(stub):
    """TF Serving's Session check, which counts the signature's inputs in order: `text` is the second."""
    request = multi_request()
    request.inputs["text"].CopyFrom(tf.make_tensor_proto(np.array([1, 2], np.int64)))
    with pytest.raises(grpc.RpcError) as info:
        stub.Predict(request, timeout=60)
    assert (info.value.code(), info.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT,
                                                         "Expects arg[1] to be string but int64 is provided")


def test_metadata_carries_signature_defaults(server, stub):
    metadata = requests.get(f"{server.rest_url}/v1/models/defaults/metadata", timeout=60).json()
    signatures = metadata["metadata"]["signature_def"]["signature_def"]
    default = signatures["serving_default"]["defaults"]["x"]  # protobuf JSON of the TensorProto, field names kept
    assert (default["dtype"], default["tensor_shape"], default["float_val"]) == (
        "DT_FLOAT", {"dim": [{"size": "1", "name": ""}], "unknown_rank": False}, [4.0])
    assert default["string_val"] == [] and default["version_number"] == 0  # fields without presence printed too
    assert {name: sig["defaults"] for name, sig in signatures.items() if name != "serving_default"} == {
        "classify": {}, "regress": {}, "multi": {}, "__saved_model_init_op": {}}
    request = get_model_metadata_pb2.GetModelMetadataRequest(metadata_field=["signature_def"])
    request.model_spec.name = "defaults"
    signature_map = get_model_metadata_pb2.SignatureDefMap()
    assert stub.GetModelMetadata(request, timeout=60).metadata["signature_def"].Unpack(signature_map)
    default = signature_map.signature_def["serving_default"].defaults["x"]
    assert tf.make_ndarray(default).tolist() == [4.0]


def test_a_missing_input_takes_its_default(server):
    assert ok(predict(server, {"inputs": {}}, model="defaults")) == {"outputs": [4.0]}
    assert ok(predict(server, {"inputs": {"x": [0.0]}}, model="defaults")) == {"outputs": [2.0]}
    assert json.loads(predict(server, {"inputs": {}}, model="module").text)["error"] == (
        "Missing named input: x in 'inputs' object.")  # json_tensor.cc's, for an input without a default
