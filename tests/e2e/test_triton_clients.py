"""Triton's own clients against a real `petal serve` with TLS and a token: tritonclient.grpc over KServe V2 gRPC
(BYTES images on the tiny model, FP32 on a tf.Module's float input; shared memory off, as Petal has none) and
tritonclient.http, with Triton's model-configuration and statistics extensions over both. Predictions must equal
REST /v1's for the same inputs, and the statistics must grow by exactly what was sent."""
from __future__ import annotations

import base64
import struct
import time

import grpc
import numpy as np
import pytest
import requests
import tensorflow as tf
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tensorflow_serving.apis import prediction_service_pb2_grpc
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from foreign_models import tf2_module
from grpc_calls import predict_request
from server_harness import access_lines, in_process_dataplane, jpeg, run_server, tiny_model_base
from tls_certs import make_pki

TOKEN = "predict-token-0123456789abcdef"
MAX_MESSAGE_BYTES = 4 << 20
BATCHING = ("max_batch_size { value: 8 } batch_timeout_micros { value: 1000 } num_batch_threads { value: 2 } "
            "allowed_batch_sizes: 4 allowed_batch_sizes: 8")


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def server(pki, tmp_path_factory):
    """"flowers" (the tiny image model) and "half" (y = 0.5 x + 2 on x: float32 [None]), batched, behind TLS and a
    token, with the access log on and a 4 MB gRPC message limit; two workers, so the statistics are the sum over
    both workers' metrics files."""
    root = tmp_path_factory.mktemp("triton")
    tf2_module(str(root / "half"))
    (root / "batching").write_text(BATCHING)
    (root / "tokens").write_text(TOKEN + "\n")
    (root / "ssl").write_text(pki.ssl_config())
    (root / "models").write_text(
        f'model_config_list {{ config {{ name: "flowers" base_path: "{tiny_model_base()}" model_platform: '
        f'"tensorflow" }} config {{ name: "half" base_path: "{root / "half"}" model_platform: "tensorflow" }} }}')
    with run_server(f"--model_config_file={root / 'models'}", f"--batching_parameters_file={root / 'batching'}",
                    f"--ssl_config_file={root / 'ssl'}", f"--auth_token_file={root / 'tokens'}", "--access_log",
                    "--workers=2", f"--grpc_max_message_bytes={MAX_MESSAGE_BYTES}",
                    tls_context=pki.client_context()) as srv:
        yield srv


@pytest.fixture(scope="module")
def grpc_client(server, pki):
    client = grpcclient.InferenceServerClient(server.grpc_target, ssl=True, root_certificates=str(pki.ca_cert))
    yield client
    client.close()


@pytest.fixture(scope="module")
def http_client(server, pki):
    client = httpclient.InferenceServerClient(server.rest_url.split("://", 1)[-1], ssl=True,
                                              ssl_context_factory=pki.client_context)
    yield client
    client.close()


@pytest.fixture(scope="module")
def v2_stub(server, pki):
    """The bare generated stub, for requests tritonclient never sends (typed contents, broken framing)."""
    channel = grpc.secure_channel(server.grpc_target, grpc.ssl_channel_credentials(pki.ca_cert.read_bytes()))
    yield service_pb2_grpc.GRPCInferenceServiceStub(channel)
    channel.close()


IMAGES = [jpeg(seed=seed) for seed in (3, 4, 5)]


def bearer() -> dict[str, str]:
    """A fresh dict each call: tritonclient.http writes its own headers into the one it is given."""
    return {"authorization": f"Bearer {TOKEN}"}


def rest_v1(server, pki, model: str, instances: list) -> np.ndarray:
    response = requests.post(f"{server.rest_url}/v1/models/{model}:predict", json={"instances": instances},
                             headers=bearer(), verify=str(pki.ca_cert), timeout=60)
    assert response.status_code == 200, response.text
    predictions = response.json()["predictions"]
    return np.array([p["probabilities"] if isinstance(p, dict) else p for p in predictions])


def image_input(module, images: list[bytes]):
    tensor = module.InferInput("image_bytes", [len(images)], "BYTES")
    tensor.set_data_from_numpy(np.array(images, dtype=object))
    return tensor


def float_input(module, values: list[float]):
    tensor = module.InferInput("x", [len(values)], "FP32")
    tensor.set_data_from_numpy(np.array(values, dtype=np.float32))
    return tensor


def call_error(call, *args) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call(*args, metadata=tuple(bearer().items()))
    return info.value


# --- gRPC data plane -----------------------------------------------------------------------------------------

def test_grpc_health_and_metadata(grpc_client):
    assert grpc_client.is_server_live() and grpc_client.is_server_ready(headers=bearer())
    assert grpc_client.is_model_ready("flowers", headers=bearer())
    assert grpc_client.is_model_ready("flowers", "1", headers=bearer())
    assert not grpc_client.is_model_ready("flowers", "9", headers=bearer())
    server = grpc_client.get_server_metadata(headers=bearer(), as_json=True)
    assert server["name"] == "petal"
    assert {"binary_tensor_data", "classification", "model_configuration", "statistics"} <= set(server["extensions"])
    metadata = grpc_client.get_model_metadata("flowers", headers=bearer(), as_json=True)
    assert metadata["versions"] == ["1"] and metadata["platform"] == "tensorflow_savedmodel"
    assert metadata["inputs"] == [{"name": "image_bytes", "datatype": "BYTES", "shape": ["-1", "1"]}]
    assert {"name": "probabilities", "datatype": "FP32", "shape": ["-1", "5"]} in metadata["outputs"]


def test_grpc_bytes_images_predict_what_rest_v1_does(server, pki, grpc_client):
    result = grpc_client.infer("flowers", [image_input(grpcclient, IMAGES)], headers=bearer())
    assert result.get_response().model_name == "flowers" and result.get_response().model_version == "1"
    expected = rest_v1(server, pki, "flowers", [{"b64": base64.b64encode(i).decode()} for i in IMAGES])
    np.testing.assert_allclose(result.as_numpy("probabilities"), expected, rtol=1e-5, atol=1e-6)


def test_grpc_fp32_on_a_float_input_predicts_what_rest_v1_does(server, pki, grpc_client):
    values = [0.0, 1.0, -4.0, 10.5]
    result = grpc_client.infer("half", [float_input(grpcclient, values)], headers=bearer(), model_version="1")
    np.testing.assert_array_equal(result.as_numpy("y"), np.array(values, np.float32) * 0.5 + 2)
    np.testing.assert_array_equal(result.as_numpy("y"), rest_v1(server, pki, "half", values))


def test_inputs_shaped_as_the_model_config_declares_them(grpc_client, http_client):
    """The configuration says dims [1] reshaped to [] for one value per row, so [rows, 1] is taken as [rows]."""
    tensor = grpcclient.InferInput("x", [2, 1], "FP32").set_data_from_numpy(np.array([[1.0], [3.0]], np.float32))
    np.testing.assert_array_equal(grpc_client.infer("half", [tensor], headers=bearer()).as_numpy("y"), [2.5, 3.5])
    tensor = httpclient.InferInput("x", [2, 1], "FP32").set_data_from_numpy(np.array([[1.0], [3.0]], np.float32))
    np.testing.assert_array_equal(http_client.infer("half", [tensor], headers=bearer()).as_numpy("y"), [2.5, 3.5])
    with pytest.raises(InferenceServerException, match="shape"):
        grpc_client.infer("half", [grpcclient.InferInput("x", [1, 2], "FP32").set_data_from_numpy(
            np.zeros((1, 2), np.float32))], headers=bearer())


def test_grpc_another_signature_with_int64_and_bytes_both_ways(grpc_client):
    """parameters.signature_name picks the signature, as over REST; BYTES outputs come back length-prefixed."""
    ids = grpcclient.InferInput("ids", [2, 2], "INT64").set_data_from_numpy(np.array([[1, 2], [30, 40]], np.int64))
    text = grpcclient.InferInput("text", [2], "BYTES").set_data_from_numpy(np.array([b"abc", b"\xff\x00"], object))
    result = grpc_client.infer("half", [ids, text], headers=bearer(), parameters={"signature_name": "multi"})
    assert result.as_numpy("sum").tolist() == [3, 70]
    assert result.as_numpy("length").tolist() == [3, 2]
    assert result.as_numpy("echo_bytes").tolist() == [b"abc", b"\xff\x00"]


def test_grpc_classification_extension(grpc_client):
    output = grpcclient.InferRequestedOutput("probabilities", class_count=2)
    result = grpc_client.infer("flowers", [image_input(grpcclient, IMAGES[:1])], outputs=[output], headers=bearer())
    probabilities = grpc_client.infer("flowers", [image_input(grpcclient, IMAGES[:1])],
                                      headers=bearer()).as_numpy("probabilities")[0]
    top = result.as_numpy("probabilities")[0]
    assert [int(entry.split(b":")[1]) for entry in top] == list(np.argsort(-probabilities, kind="stable")[:2])
    assert all(len(entry.split(b":")) == 3 for entry in top)  # score:index:label


def test_typed_contents_equal_raw_contents(v2_stub, grpc_client):
    """tritonclient always sends raw bytes; other V2 clients send typed contents."""
    request = service_pb2.ModelInferRequest(model_name="half")
    tensor = request.inputs.add(name="x", datatype="FP32", shape=[3])
    tensor.contents.fp32_contents.extend([1.0, 2.0, 3.0])
    response = v2_stub.ModelInfer(request, metadata=tuple(bearer().items()))
    assert response.outputs[0].name == "y" and list(response.outputs[0].shape) == [3]
    np.testing.assert_array_equal(np.frombuffer(response.raw_output_contents[0], "<f4"), [2.5, 3.0, 3.5])
    images = service_pb2.ModelInferRequest(model_name="flowers")
    images.inputs.add(name="image_bytes", datatype="BYTES", shape=[2]).contents.bytes_contents.extend(IMAGES[:2])
    typed = v2_stub.ModelInfer(images, metadata=tuple(bearer().items()))
    raw = grpc_client.infer("flowers", [image_input(grpcclient, IMAGES[:2])], headers=bearer())
    index = [o.name for o in typed.outputs].index("probabilities")
    np.testing.assert_allclose(np.frombuffer(typed.raw_output_contents[index], "<f4").reshape(2, 5),
                               raw.as_numpy("probabilities"), rtol=1e-5, atol=1e-6)


def raw_request(model: str, name: str, datatype: str, shape: list[int], raw: bytes) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name=model, raw_input_contents=[raw])
    request.inputs.add(name=name, datatype=datatype, shape=shape)
    return request


@pytest.mark.parametrize("request_, code, words", [
    (raw_request("half", "x", "FP32", [3], b"\0" * 8), "INVALID_ARGUMENT", "do not hold shape"),
    (raw_request("half", "x", "FP32", [1 << 40], b"\0" * 8), "INVALID_ARGUMENT", "do not hold shape"),
    (raw_request("flowers", "image_bytes", "BYTES", [1], struct.pack("<I", 1 << 30) + b"abc"),
     "INVALID_ARGUMENT", "overruns"),
    (raw_request("flowers", "image_bytes", "BYTES", [2], struct.pack("<I", 4) + b"abcd"), "INVALID_ARGUMENT",
     "do not match shape"),
    (raw_request("flowers", "image_bytes", "BYTES", [2], struct.pack("<I", 3) + b"abc"), "INVALID_ARGUMENT",
     "7 bytes cannot hold the 2 BYTES elements"),
    (raw_request("half", "x", "FP32", [-1], b""), "INVALID_ARGUMENT", "negative"),
    (raw_request("half", "x", "COMPLEX", [1], b"\0" * 8), "INVALID_ARGUMENT", "unsupported datatype"),
    # Triton refuses another datatype than the model's (core infer_request.cc), where casting lost precision unseen
    (raw_request("half", "x", "FP64", [1], b"\0" * 8), "INVALID_ARGUMENT",
     "inference input 'x' data-type is 'FP64', but model 'half' expects 'FP32'"),
    (raw_request("nope", "x", "FP32", [1], b"\0" * 4), "NOT_FOUND", "nope"),
    (raw_request("half", "wrong", "FP32", [1], b"\0" * 4), "INVALID_ARGUMENT", "Input names"),
    (service_pb2.ModelInferRequest(model_name="half", raw_input_contents=[b"", b""]), "INVALID_ARGUMENT",
     "one per input"),
    (service_pb2.ModelInferRequest(model_name="half"), "INVALID_ARGUMENT", "at least one input"),
])
def test_grpc_bad_requests_get_the_right_code(v2_stub, request_, code, words):
    error = call_error(v2_stub.ModelInfer, request_)
    assert error.code().name == code and words in error.details()


def test_a_message_past_the_grpc_limit_is_refused(v2_stub):
    request = raw_request("flowers", "image_bytes", "BYTES", [1], struct.pack("<I", MAX_MESSAGE_BYTES) +
                          b"\0" * MAX_MESSAGE_BYTES)
    assert call_error(v2_stub.ModelInfer, request).code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_typed_contents_are_checked_against_the_shape(v2_stub):
    request = service_pb2.ModelInferRequest(model_name="half")
    request.inputs.add(name="x", datatype="FP32", shape=[4]).contents.fp32_contents.extend([1.0, 2.0])
    assert "do not match shape" in call_error(v2_stub.ModelInfer, request).details()
    request = service_pb2.ModelInferRequest(model_name="half")
    request.inputs.add(name="x", datatype="FP16", shape=[1])
    assert "raw_input_contents only" in call_error(v2_stub.ModelInfer, request).details()


def test_v2_grpc_needs_the_token_except_the_server_probes(v2_stub, server):
    with pytest.raises(grpc.RpcError) as info:
        v2_stub.ModelInfer(raw_request("half", "x", "FP32", [1], b"\0" * 4))
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    for method in (v2_stub.ModelConfig, v2_stub.ModelStatistics, v2_stub.ModelMetadata):
        with pytest.raises(grpc.RpcError) as info:
            method(service_pb2.ModelConfigRequest(name="half") if method == v2_stub.ModelConfig else
                   service_pb2.ModelStatisticsRequest(name="half") if method == v2_stub.ModelStatistics else
                   service_pb2.ModelMetadataRequest(name="half"))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert v2_stub.ServerLive(service_pb2.ServerLiveRequest()).live
    assert v2_stub.ServerReady(service_pb2.ServerReadyRequest()).ready
    v2_stub.ModelInfer(raw_request("half", "x", "FP32", [1], b"\0" * 4), metadata=tuple(bearer().items()))
    # a call refused for its token is answered before its message is received: its line names no model
    seen = {("OK", "half"), ("UNAUTHENTICATED", None)}

    def infers(lines: list[dict]) -> set[tuple[str, str | None]]:
        return {(line["status"], line.get("model")) for line in lines
                if line.get("path") == "/inference.GRPCInferenceService/ModelInfer"}
    assert infers(access_lines(server, lambda lines: infers(lines) >= seen)) >= seen


def test_unimplemented_extensions_say_so_and_log_nothing(server, v2_stub):
    """grpc logged each such call's NotImplementedError with its traceback, at ERROR."""
    for _ in range(2):
        error = call_error(v2_stub.RepositoryIndex, service_pb2.RepositoryIndexRequest())
        assert (error.code(), error.details()) == (grpc.StatusCode.UNIMPLEMENTED,
                                                   "RepositoryIndex is not served by Petal")
        error = call_error(v2_stub.SystemSharedMemoryStatus, service_pb2.SystemSharedMemoryStatusRequest())
        assert error.code() == grpc.StatusCode.UNIMPLEMENTED
        stream = v2_stub.ModelStreamInfer(iter([service_pb2.ModelInferRequest(model_name="half")]),
                                          metadata=tuple(bearer().items()))  # without: UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as info:
            list(stream)
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "NotImplementedError" not in server.log() and "Exception calling application" not in server.log()


def test_grpc_calls_without_a_deadline_are_served(server, pki):
    """tritonclient and perf_analyzer set no deadline; TF Serving's stub may not either."""
    channel = grpc.secure_channel(server.grpc_target, grpc.ssl_channel_credentials(pki.ca_cert.read_bytes()))
    response = prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(
        predict_request("half", x=np.array([2.0], np.float32)), metadata=tuple(bearer().items()))
    assert tf.make_ndarray(response.outputs["y"]).tolist() == [3.0]
    channel.close()


# --- model configuration -------------------------------------------------------------------------------------

def test_model_config_over_http_and_grpc(server, pki, http_client, grpc_client):
    config = http_client.get_model_config("flowers", headers=bearer())
    assert config["name"] == "flowers" and config["platform"] == "tensorflow_savedmodel"
    assert config["max_batch_size"] == 8
    assert config["input"] == [{"name": "image_bytes", "data_type": "TYPE_STRING", "dims": [1],
                                "reshape": {"shape": []}}]
    assert {"name": "probabilities", "data_type": "TYPE_FP32", "dims": [5]} in config["output"]
    assert config["dynamic_batching"] == {"preferred_batch_size": [4, 8], "max_queue_delay_microseconds": 1000}
    assert http_client.get_model_config("half", "1", headers=bearer())["input"] == [
        {"name": "x", "data_type": "TYPE_FP32", "dims": [1], "reshape": {"shape": []}}]
    over_grpc = grpc_client.get_model_config("flowers", headers=bearer()).config
    assert over_grpc.max_batch_size == 8
    assert over_grpc.input[0].data_type == model_config_pb2.DataType.Value("TYPE_STRING")
    assert {o.name: list(o.dims) for o in over_grpc.output}["probabilities"] == [5]
    assert list(over_grpc.dynamic_batching.preferred_batch_size) == [4, 8]
    assert over_grpc.dynamic_batching.max_queue_delay_microseconds == 1000
    with pytest.raises(InferenceServerException, match="version 9|not found|Servable"):
        http_client.get_model_config("flowers", "9", headers=bearer())
    missing = requests.get(f"{server.rest_url}/v2/models/nope/config", headers=bearer(),
                           verify=str(pki.ca_cert), timeout=10)
    assert missing.status_code == 404 and "error" in missing.json()
    assert requests.get(f"{server.rest_url}/v2/models/flowers/config", verify=str(pki.ca_cert),
                        timeout=10).status_code == 401


# --- statistics ----------------------------------------------------------------------------------------------

def half_stats(client, **kwargs) -> dict:
    (entry,) = client.get_inference_statistics("half", "1", headers=bearer(), **kwargs)["model_stats"]
    return entry


def counts(entry: dict) -> dict[str, int]:
    stats = entry["inference_stats"]
    return {"success": int(stats["success"].get("count", 0)), "fail": int(stats["fail"].get("count", 0)),
            "queue": int(stats["queue"].get("count", 0)), "compute": int(stats["compute_infer"].get("count", 0)),
            "inferences": int(entry.get("inference_count", 0)), "executions": int(entry.get("execution_count", 0))}


def test_statistics_grow_by_what_was_sent(http_client, grpc_client):
    before = half_stats(http_client)
    started_ms = time.time() * 1000
    for _ in range(3):
        grpc_client.infer("half", [float_input(grpcclient, [1.0, 2.0, 3.0, 4.0])], headers=bearer())
    for _ in range(2):
        http_client.infer("half", [float_input(httpclient, [1.0, 2.0, 3.0, 4.0])], headers=bearer())
    with pytest.raises(InferenceServerException):  # reaches version 1, fails there
        http_client.infer("half", [httpclient.InferInput("x", [2, 2], "FP32").set_data_from_numpy(
            np.zeros((2, 2), np.float32))], headers=bearer())
    after = half_stats(http_client)
    grown = {k: counts(after)[k] - counts(before)[k] for k in counts(after)}
    assert grown["success"] == 5 and grown["fail"] == 1
    assert grown["queue"] == grown["compute"] == 5
    assert grown["inferences"] == 20
    assert 1 <= grown["executions"] <= 5  # the batcher may have merged some of them
    assert after["last_inference"] >= started_ms - 1000
    stats = after["inference_stats"]
    assert stats["success"]["ns"] > 0 and stats["compute_infer"]["ns"] > 0
    assert sum(int(b["compute_infer"]["count"]) for b in after["batch_stats"]) == counts(after)["executions"]
    assert {int(b["batch_size"]) for b in after["batch_stats"]} <= {1, 4, 8}
    over_grpc = half_stats(grpc_client, as_json=True)
    assert counts(over_grpc) == counts(after)


def test_statistics_of_every_model_and_the_errors(server, pki, http_client):
    every = http_client.get_inference_statistics(headers=bearer())["model_stats"]
    assert {(entry["name"], entry["version"]) for entry in every} == {("flowers", "1"), ("half", "1")}
    assert [e["version"] for e in http_client.get_inference_statistics("flowers", headers=bearer())["model_stats"]] \
        == ["1"]
    for path, status in (("/v2/models/nope/stats", 404), ("/v2/models/half/versions/9/stats", 404),
                         ("/v2/models/half/versions/x/stats", 400)):
        response = requests.get(server.rest_url + path, headers=bearer(),
                                verify=str(pki.ca_cert), timeout=10)
        assert response.status_code == status and "error" in response.json(), path


# --- the documents a server without batching gives (in-process) ----------------------------------------------

def test_without_batching_the_config_has_whole_shapes_and_metadata_the_signatures(tmp_path):
    """Triton's form for a model it does not batch: max_batch_size 0, no dynamic_batching, dims the whole shape."""
    from serving.protocols.rest.app import create_app

    tf2_module(str(tmp_path / "half"))
    with in_process_dataplane(model_base_path=str(tmp_path / "half"), model_name="half",
                              enable_batching=False) as dataplane:
        client = create_app(dataplane).test_client()
        config = client.get("/v2/models/half/config").get_json()
        assert config["max_batch_size"] == 0 and "dynamic_batching" not in config
        assert config["input"] == [{"name": "x", "data_type": "TYPE_FP32", "dims": [-1]}]
        assert config["output"] == [{"name": "y", "data_type": "TYPE_FP32", "dims": [-1]}]
        assert client.get("/v2/models/half").get_json()["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1]}]
        response = client.post("/v2/models/half/infer", json={"inputs": [
            {"name": "x", "datatype": "FP32", "shape": [2], "data": [2.0, 4.0]}]})
        assert response.get_json()["outputs"][0]["data"] == [3.0, 4.0]
        (entry,) = client.get("/v2/models/half/stats").get_json()["model_stats"]
        assert entry["inference_count"] == 1 and entry["execution_count"] == 1  # an unbatched model's one inference
        assert entry["inference_stats"]["success"]["count"] == 1 and entry["batch_stats"][0]["batch_size"] == 1
