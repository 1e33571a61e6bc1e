"""SavedModels that Petal did not write, served as TF Serving serves them: versions found in zero-padded folders, a
TF1 graph in a Session (its asset and main op included), a tf.Module and a Keras export through their functions,
and a model.tflite through the TFLite interpreter with --prefer_tflite_model. Real `petal serve`, real REST and
gRPC with TF Serving's own stubs, models built by exported_models/tf_serving_models.py (TF Serving's half_plus_two
in its 2-versions layout) and tests/foreign_models.py at test time. Version discovery on its own is
tests/unit/test_version_folders.py, and the Servables loaded in process tests/inprocess/test_foreign_servables.py."""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
import requests
import tensorflow as tf
from tensorflow_serving.apis import (
    get_model_metadata_pb2,
    model_service_pb2_grpc,
    prediction_service_pb2_grpc,
)

import foreign_models
from exported_models import model_format, tf_serving_models
from exported_models.model_format import WarmupRequest
from grpc_calls import predict_request
from server_harness import copy_model, jpeg, run_server, tiny_model_base
from serving.client import cli as predict_cli

TIMEOUT = 60


def test_petal_predict_reads_a_padded_version_folder(tmp_path, capsys):
    padded = tmp_path / "flowers"
    copy_model(str(padded), 1)
    os.rename(padded / "1", padded / "00000042")
    image = tmp_path / "a.jpg"
    image.write_bytes(jpeg(seed=3))
    assert predict_cli.main([str(image), "--model_base_path", str(padded), "--format", "json"]) == 0
    from_padded = capsys.readouterr().out
    assert predict_cli.main([str(image), "--model_base_path", tiny_model_base(), "--format", "json"]) == 0
    assert from_padded == capsys.readouterr().out and '"predictions"' in from_padded


# --- served ---------------------------------------------------------------------------------------------------

def write_warmup(version_dir: str, inputs: dict[str, np.ndarray]) -> None:
    model_format.write_warmup(version_dir, "m", [WarmupRequest("serving_default", inputs)])


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    """Base paths by model name; every model but the Keras one carries a Predict warmup record."""
    root = tmp_path_factory.mktemp("foreign")
    tf1 = tf_serving_models.half_plus_two_2_versions(str(root / "half_plus_two"))
    for version in tf_serving_models.VERSIONS:
        write_warmup(f"{tf1}/{version}", {"x": np.array([[1.0]], np.float32)})
    foreign_models.tf1_classifier(str(root / "classifier" / "1"))
    tf_serving_models.scalar_signatures(str(root / "scalar" / "00000123"))
    tf2 = foreign_models.tf2_module(str(root / "tf2"), "00000003")
    write_warmup(tf2, {"x": np.array([1.0, 2.0], np.float32)})
    foreign_models.tflite_beside(tf2)
    foreign_models.keras_export(str(root / "keras"), "0001")
    return {"half_plus_two": tf1, "classifier": str(root / "classifier"), "scalar": str(root / "scalar"),
            "tf2": str(root / "tf2"), "keras": str(root / "keras")}


def model_config(path, models: dict[str, str]) -> str:
    entries = []
    for name, base in models.items():
        policy = " model_version_policy { all {} }" if name == "half_plus_two" else ""
        entries.append(f'config {{ name: "{name}" base_path: "{base}" model_platform: "tensorflow"{policy} }}')
    path.write_text("model_config_list {\n  " + "\n  ".join(entries) + "\n}\n")
    return str(path)


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    config = model_config(tmp_path_factory.mktemp("config") / "models.pbtxt", models)
    with run_server(f"--model_config_file={config}", "--file_system_poll_wait_seconds=0") as server:
        yield server


@pytest.fixture(scope="module")
def tflite_server(models, tmp_path_factory):
    config = model_config(tmp_path_factory.mktemp("config") / "models.pbtxt",
                          {"tf2": models["tf2"], "half_plus_two": models["half_plus_two"]})
    with run_server(f"--model_config_file={config}", "--file_system_poll_wait_seconds=0",
                    "--prefer_tflite_model") as server:
        yield server


def rest_predict(server, path: str, body: dict) -> requests.Response:
    return requests.post(f"{server.rest_url}/v1/models/{path}:predict", json=body, timeout=TIMEOUT)


def grpc_call(server, method: str, request, service=prediction_service_pb2_grpc.PredictionServiceStub):
    with grpc.insecure_channel(server.grpc_target) as channel:
        return getattr(service(channel), method)(request, timeout=TIMEOUT)


def rest_signatures(server, model: str) -> dict:
    response = requests.get(f"{server.rest_url}/v1/models/{model}/metadata", timeout=TIMEOUT)
    assert response.status_code == 200, response.text
    return response.json()["metadata"]["signature_def"]["signature_def"]


def test_both_padded_versions_load_and_the_latest_serves_by_default(server):
    status = requests.get(f"{server.rest_url}/v1/models/half_plus_two", timeout=TIMEOUT).json()
    assert [(s["version"], s["state"]) for s in status["model_version_status"]] == [("124", "AVAILABLE"),
                                                                                     ("123", "AVAILABLE")]
    latest = rest_predict(server, "half_plus_two", {"instances": [1.0, 2.0, 5.0]})
    assert latest.status_code == 200, latest.text
    assert latest.json() == {"predictions": [2.5, 3.0, 4.5]}
    response = grpc_call(server, "Predict", predict_request("half_plus_two", x=np.array([2.0], np.float32)))
    assert response.model_spec.version.value == 124 and tf.make_ndarray(response.outputs["y"]).tolist() == [3.0]


def test_tf_serving_documented_half_plus_two_answer_on_version_123(server):
    response = rest_predict(server, "half_plus_two/versions/123", {"instances": [1.0, 2.0, 5.0]})
    assert response.status_code == 200, response.text
    assert response.json() == {"predictions": [2.5, 3.0, 4.5]}
    columnar = rest_predict(server, "half_plus_two/versions/123", {"inputs": {"x": [[1.0], [2.0]]}})
    assert columnar.json() == {"outputs": [[2.5], [3.0]]}


@pytest.mark.parametrize("shape", [[1], [3], [3, 1]])
def test_grpc_predict_feeds_the_tf1_tensor_by_name_in_any_shape(server, shape):
    x = np.arange(1, 1 + np.prod(shape), dtype=np.float32).reshape(shape)
    response = grpc_call(server, "Predict", predict_request("half_plus_two", version=123, x=x))
    assert response.model_spec.version.value == 123 and response.model_spec.signature_name == "serving_default"
    np.testing.assert_allclose(tf.make_ndarray(response.outputs["y"]), 0.5 * x + 2)


def test_tf1_bad_input_is_invalid_argument_not_internal(server):
    garbage = np.array([b"not a serialized tf.Example"], dtype=object)
    with pytest.raises(grpc.RpcError) as error:
        grpc_call(server, "Predict", predict_request("classifier", "predict", examples=garbage))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    response = rest_predict(server, "classifier", {"signature_name": "predict",
                                                   "instances": ["not a serialized tf.Example"]})
    assert response.status_code == 400 and "error" in response.json(), response.text


def test_the_main_op_initialised_the_asset_table(server):
    examples = [foreign_models.example(x=x).SerializeToString() for x in (1.0, 2.0, 5.0)]
    response = grpc_call(server, "Predict", predict_request("classifier", "predict",
                                                            examples=np.array(examples, dtype=object)))
    classes = tf.make_ndarray(response.outputs["classes"]).tolist()
    assert classes == [[c.encode() for c in foreign_models.CLASS_NAMES]] * 3
    # 0.5 x + 2 = 2.5, 3.0, 4.5: negative, then at the boundary, then clipped to positive
    np.testing.assert_allclose(tf.make_ndarray(response.outputs["scores"]), [[1, 0], [1, 0], [0, 1]])


def test_grpc_metadata_lists_every_tf1_signature(server):
    request = get_model_metadata_pb2.GetModelMetadataRequest(metadata_field=["signature_def"])
    request.model_spec.name = "half_plus_two"
    response = grpc_call(server, "GetModelMetadata", request)
    signatures = get_model_metadata_pb2.SignatureDefMap()
    response.metadata["signature_def"].Unpack(signatures)
    defs = signatures.signature_def
    assert sorted(defs) == ["classify_x_to_y", "regress_x2_to_y3", "regress_x_to_y", "regress_x_to_y2",
                            "serving_default"]
    assert defs["classify_x_to_y"].method_name == "tensorflow/serving/classify"
    assert defs["serving_default"].inputs["x"].name == "x:0"
    assert response.model_spec.version.value == 124


def test_grpc_model_status_shows_both_versions(server):
    from tensorflow_serving.apis import get_model_status_pb2

    request = get_model_status_pb2.GetModelStatusRequest()
    request.model_spec.name = "half_plus_two"
    response = grpc_call(server, "GetModelStatus", request, model_service_pb2_grpc.ModelServiceStub)
    assert sorted(s.version for s in response.model_version_status) == [123, 124]


def test_tf2_module_over_rest_and_grpc(server):
    response = rest_predict(server, "tf2", {"instances": [1.0, 2.0, 5.0]})
    assert response.status_code == 200, response.text
    assert response.json() == {"predictions": [2.5, 3.0, 4.5]}
    reply = grpc_call(server, "Predict", predict_request("tf2", "serving_default", x=np.array([4.0], np.float32)))
    assert reply.model_spec.version.value == 3
    np.testing.assert_allclose(tf.make_ndarray(reply.outputs["y"]), [4.0])
    multi = grpc_call(server, "Predict", predict_request("tf2", "multi", ids=np.array([[1, 2], [3, 4]]),
                                                         text=np.array([b"abc", b"z"], dtype=object)))
    assert tf.make_ndarray(multi.outputs["sum"]).tolist() == [3, 7]
    assert tf.make_ndarray(multi.outputs["length"]).tolist() == [3, 1]
    assert sorted(rest_signatures(server, "tf2")) == ["__saved_model_init_op", "classify", "multi", "regress",
                                                       "serving_default"]  # metadata lists TF2's init op too


def test_tf2_module_keeps_its_static_shape_check(server):
    response = rest_predict(server, "tf2", {"inputs": {"x": [[1.0], [2.0]]}})
    assert response.status_code == 400, response.text
    assert "shape" in response.json()["error"]


@pytest.mark.parametrize("signature, y", [("", 1.0), ("serving_default", 1.0), ("custom_signature_key", 2.0)])
def test_signatures_whose_outputs_no_batch_can_follow_answer_as_tf_serving_does(server, signature, y):
    """TF Serving's test_tf_saved_model_save_multiple_signatures: x of unknown rank, y a scalar. With batching on
    (Petal's default) such signatures run unbatched, decided at load and logged once; never INTERNAL."""
    response = grpc_call(server, "Predict", predict_request("scalar", signature, x=np.array([2.0], np.float32)))
    assert tf.make_ndarray(response.outputs["y"]).tolist() == y
    assert response.model_spec.signature_name == (signature or "serving_default")
    rest = rest_predict(server, "scalar", {"signature_name": signature, "inputs": {"x": [2.0]}})
    assert (rest.status_code, rest.json()) == (200, {"outputs": y})
    logged = [line for line in server.log().splitlines()
              if "signatures that run unbatched" in line and '"model": "scalar"' in line]
    assert len(logged) == 1 and '"custom_signature_key": "input x has an unknown rank"' in logged[0]


def test_keras_export_over_rest_and_grpc(server):
    response = rest_predict(server, "keras", {"instances": [[1.0, 1.0, 1.0], [0.0, 0.0, 2.0]]})
    assert response.status_code == 200, response.text
    assert response.json() == {"predictions": [[6.5], [6.5]]}
    reply = grpc_call(server, "Predict", predict_request("keras", features=np.array([[1.0, 0.0, 0.0]], np.float32)))
    assert reply.model_spec.version.value == 1
    np.testing.assert_allclose(tf.make_ndarray(reply.outputs["output_0"]), [[1.5]])


def warmed(server) -> dict[tuple[str, str], float]:
    """Warmup records replayed, by (model, version), from the server's Prometheus page."""
    metrics = requests.get(f"{server.rest_url}/monitoring/prometheus/metrics", timeout=TIMEOUT).text
    counts = {}
    for line in metrics.splitlines():
        if line.startswith(":petal:serving:warmup_requests{"):
            labels = dict(part.split("=") for part in line.split("{", 1)[1].split("}")[0].split(","))
            counts[(labels["model_name"].strip('"'), labels["version"].strip('"'))] = float(line.rsplit(" ", 1)[1])
    return counts


def test_warmup_replayed_for_session_and_function_models(server):
    counts = warmed(server)
    assert counts[("half_plus_two", "123")] == counts[("half_plus_two", "124")] == counts[("tf2", "3")] == 1


def test_prefer_tflite_serves_the_interpreter_with_its_signatures(tflite_server):
    signatures = rest_signatures(tflite_server, "tf2")
    assert sorted(signatures) == ["serving_default"]  # the converter kept one; the SavedModel has four
    assert signatures["serving_default"]["inputs"]["x"]["dtype"] == "DT_FLOAT"
    response = rest_predict(tflite_server, "tf2", {"instances": [1.0, 2.0, 5.0]})
    assert response.status_code == 200, response.text
    assert response.json() == {"predictions": [2.5, 3.0, 4.5]}
    for rows in (1, 4):  # the interpreter's inputs follow each request's shape
        x = np.arange(rows, dtype=np.float32)
        reply = grpc_call(tflite_server, "Predict", predict_request("tf2", x=x))
        np.testing.assert_allclose(tf.make_ndarray(reply.outputs["y"]), 0.5 * x + 2)
    # The interpreter, unlike the SavedModel's function (see test_tf2_module_keeps_its_static_shape_check), runs
    # on a shape the signature does not declare: only its ops check shapes, as in TF Serving.
    response = rest_predict(tflite_server, "tf2", {"inputs": {"x": [[1.0], [2.0]]}})
    assert response.status_code == 200, response.text
    assert response.json() == {"outputs": [[2.5], [3.0]]}
    assert warmed(tflite_server)[("tf2", "3")] == 1  # the Predict warmup record ran on the interpreter


def test_prefer_tflite_answers_concurrent_requests_each_with_its_own_rows(tflite_server):
    """One interpreter per version, not thread-safe: concurrent requests of different sizes must not mix."""
    def call(rows: int) -> bool:
        x = np.arange(rows, dtype=np.float32) + rows
        reply = grpc_call(tflite_server, "Predict", predict_request("tf2", x=x))
        return np.allclose(tf.make_ndarray(reply.outputs["y"]), 0.5 * x + 2)

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(call, [1 + i % 7 for i in range(48)], timeout=TIMEOUT))


def test_prefer_tflite_refuses_bad_input_as_invalid_argument(tflite_server):
    with pytest.raises(grpc.RpcError) as error:
        grpc_call(tflite_server, "Predict", predict_request("tf2", x=np.array([b"a"], dtype=object)))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_prefer_tflite_leaves_a_version_without_model_tflite_on_its_savedmodel(tflite_server):
    response = rest_predict(tflite_server, "half_plus_two", {"instances": [1.0, 2.0, 5.0]})
    assert response.json() == {"predictions": [2.5, 3.0, 4.5]}
    assert "classify_x_to_y" in rest_signatures(tflite_server, "half_plus_two")
