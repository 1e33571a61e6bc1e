"""TF Serving's documented answers, from one `petal serve` serving TF Serving's own test models, rebuilt the way its
generator builds them (exported_models/tf_serving_models.py), over REST, gRPC on TCP and gRPC on the Unix socket,
called with TF Serving's stock `tensorflow_serving.apis` stubs.

The server reads a `--model_config_file` of these models, built in a temp folder:
- `half_plus_two`: `saved_model_half_plus_two_2_versions`, the TF1 graph in the zero-padded folders 00000123 and
  00000124 (the same model twice, as TF Serving ships it), both served (`specific` policy), labelled "stable" (123)
  and "canary" (124). Its Predict input x:0 is an identity of the parsed tf.Example, not a placeholder: fed by
  name, it takes any shape the graph's ops take;
- `half_plus_three`: the same graph with b = 3, TF Serving's `saved_model_half_plus_three`;
- `half_plus_two_tf2`: the native TF2 tf.Module, `saved_model_half_plus_two_tf2_cpu`, whose predict input is
  TensorSpec([1]) and whose classify and regress signatures have the predict method;
- `half_plus_two_tflite`: `saved_model_half_plus_two_tflite`, a version folder holding only `model.tflite`. It needs
  `--prefer_tflite_model`, which (in TF Serving's SavedModelBundleFactory as in serving/core/runtimes.py) picks
  TFLite only for a version folder that has a `model.tflite`: the others, which have none, stay on SavedModels;
- `keras_export`: a Keras 3 `model.export()` (y = x . [1, 2, 3] + 0.5, tests/foreign_models.py);
- `half_plus_three_pbtxt`: half_plus_three with its SavedModel as text, `saved_model.pbtxt` and no
  `saved_model.pb`, which TensorFlow's loader reads (cc/saved_model/loader.cc MaybeSavedModelDirectory and
  ReadSavedModel, called by TF Serving's session_bundle_util.cc LoadSessionBundleOrSavedModelBundle);
with `--grpc_socket_path`, `--enable_batching` and `--enable_model_control` (for the reload RPC, which one test
calls and which leaves the server's own config in place at its end).

Expected values come from TF Serving's own documentation and tests (tensorflow/serving, read at commit 9d981c5):
- `model_servers/tensorflow_model_server_test.py` and its test client: Predict of x = [2.0] (DT_FLOAT, shape [1])
  -> y = 3.0 on the TF1, TF2 and TFLite models, 4.0 on half_plus_three; Classify, Regress and MultiInference of
  x = 2.0 -> 3.0; REST {"instances": [2.0, 3.0, 4.0]} -> {"predictions": [3.0, 3.5, 4.0]} and the columnar
  {"inputs": ...}; the harness waits until a Predict of `intentionally_missing_model` has "Servable" in its details;
- `g3doc/api_rest.md`: "Model status API" and "Make REST API calls to ModelServer" (the status body, half_plus_three
  predicting 3.5, 4.0, 5.5 for 1.0, 2.0, 5.0 and regressing 3.5, 4.0 for 1.0, 2.0, and 404
  `{"error": "Servable not found for request: Latest(half)"}`), "Classify and Regress API" (the `results` bodies),
  "Predict API" (row and columnar requests and answers), "Model Metadata API". Its "Response format" for
  classify and regress says `result`, but its example and the code (util/json_tensor.cc kClassifyRegressResponseKey)
  say `results`, which is what TF Serving sends;
- `g3doc/docker.md`: half_plus_two predicts 2.5, 3.0, 4.5 for 1.0, 2.0, 5.0;
- `model_servers/http_rest_api_handler_test.cc` and `servables/tensorflow/testdata/half_plus_two_model_metadata.json`:
  [[1, 2], [3, 4]] -> [[2.5, 3.0], [3.5, 4.0]], regress_x_to_y 80 -> 42, classify_x_to_y 20 -> [["", 12]] and
  10 -> [["", 7]], the status of a version and of a label, and the metadata of every signature;
- `servables/tensorflow/predict_util_test.cc`: Predict on regress_x2_to_y3 of a scalar 2.0 -> 4.0;
- the error texts of `core/manager.h` (ServableRequest::DebugString), `model_servers/server_core.cc` (labels, a
  ModelSpec without a name), `model_servers/get_model_status_impl.cc`, `servables/tensorflow/
  get_model_metadata_impl.cc`, `servables/tensorflow/predict_util.cc` and `model_servers/http_rest_api_handler.cc`
  (unknown signatures), and TensorFlow's Session for a fed tensor of another dtype; over REST, each code's HTTP
  status as `model_servers/http_server.cc`'s ToHTTPStatusCode gives it (serving/status_codes.py, held to the table
  of docs/protocols.md by tests/unit/test_shared_client_helpers.py).
"""
from __future__ import annotations

import base64
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import numpy as np
import pytest
import requests
import tensorflow as tf
from google.protobuf import json_format, text_format
from tensorflow.core.protobuf import saved_model_pb2
from tensorflow_serving.apis import (
    classification_pb2,
    get_model_metadata_pb2,
    get_model_status_pb2,
    inference_pb2,
    input_pb2,
    model_management_pb2,
    model_service_pb2_grpc,
    predict_pb2,
    prediction_service_pb2_grpc,
    regression_pb2,
)
from tensorflow_serving.config import model_server_config_pb2

from exported_models import tf_serving_models
from foreign_models import example, keras_export
from server_harness import run_server
from serving.status_codes import Code

TIMEOUT = 60
TRANSPORTS = ("rest", "grpc_tcp", "grpc_unix")
CLASSIFY = "tensorflow/serving/classify"
REGRESS = "tensorflow/serving/regress"
F32 = np.float32
HPT, H3, TF2, TFLITE, KERAS = ("half_plus_two", "half_plus_three", "half_plus_two_tf2", "half_plus_two_tflite",
                               "keras_export")
PBTXT = "half_plus_three_pbtxt"


# --- the server -------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("compat")
    tf_serving_models.half_plus_two_2_versions(str(root / HPT))
    tf_serving_models.half_plus_three(str(root / H3 / "00000123"))
    tf_serving_models.half_plus_two_tf2(str(root / TF2 / "00000123"))
    tf_serving_models.half_plus_two_tflite(str(root / TFLITE / "00000123"))
    keras_export(str(root / KERAS))
    text_saved_model(tf_serving_models.half_plus_three(str(root / PBTXT / "00000123")))
    others = "".join(f'  config {{ name: "{name}" base_path: "{root / name}" model_platform: "tensorflow" }}\n'
                     for name in (H3, TF2, TFLITE, KERAS, PBTXT))
    config = root / "models.config"
    config.write_text(f"""model_config_list {{
  config {{ name: "{HPT}" base_path: "{root / HPT}" model_platform: "tensorflow"
           model_version_policy {{ specific {{ versions: 123 versions: 124 }} }}
           version_labels {{ key: "stable" value: 123 }} version_labels {{ key: "canary" value: 124 }} }}
{others}}}
""")
    socket_path = str(root / "petal.sock")
    # labels at start name versions not loaded yet: TF Serving needs the flag too
    with run_server(f"--model_config_file={config}", "--allow_version_labels_for_unavailable_models=true",
                    f"--grpc_socket_path={socket_path}", "--enable_batching",
                    "--prefer_tflite_model", "--file_system_poll_wait_seconds=0",
                    "--enable_model_control") as srv:
        srv.socket_path = socket_path
        srv.models_root = root
        yield srv


def text_saved_model(version_dir: str) -> None:
    """Rewrite a version's saved_model.pb as the saved_model.pbtxt holding the same SavedModel proto."""
    binary = os.path.join(version_dir, "saved_model.pb")
    with open(binary, "rb") as f:
        saved_model = saved_model_pb2.SavedModel.FromString(f.read())
    with open(os.path.join(version_dir, "saved_model.pbtxt"), "w") as f:
        f.write(text_format.MessageToString(saved_model))
    os.remove(binary)


@pytest.fixture(scope="module")
def channels(server):
    tcp = grpc.insecure_channel(server.grpc_target)
    unix = grpc.insecure_channel(f"unix:{server.socket_path}")
    yield {"grpc_tcp": tcp, "grpc_unix": unix}
    tcp.close()
    unix.close()


# --- one client per transport, each answering in REST's JSON shapes ---------------------------------------------

@dataclass(frozen=True)
class Spec:
    """Which model, version (or label) and signature a call names; with neither version nor label, the latest."""
    model: str
    version: int | None = None
    label: str | None = None
    signature: str = ""

    def path(self) -> str:
        if self.version is not None:
            return f"{self.model}/versions/{self.version}"
        return f"{self.model}/labels/{self.label}" if self.label else self.model

    def fill(self, spec) -> None:
        """Set a request's ModelSpec to this."""
        spec.name = self.model
        spec.signature_name = self.signature
        if self.version is not None:
            spec.version.value = self.version
        if self.label:
            spec.version_label = self.label


class Refused(Exception):
    """A call answered with an error: `status` is the HTTP status over REST, the gRPC code's name over gRPC."""

    def __init__(self, status: int | str, message: str):
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


def proto_json(message) -> dict:
    """A proto as TF Serving's REST handler prints it (http_rest_api_util.cc: field names kept, every field)."""
    return json_format.MessageToDict(message, preserving_proto_field_name=True,
                                     always_print_fields_with_no_presence=True)


def rest_values(value):
    """REST tensor values as the gRPC side reads them: strings and {"b64"} objects as bytes."""
    if isinstance(value, list):
        return [rest_values(v) for v in value]
    if isinstance(value, dict) and set(value) == {"b64"}:
        return base64.b64decode(value["b64"])
    return value.encode() if isinstance(value, str) else value


def json_values(array: np.ndarray) -> list:
    """A tensor as a REST request writes it: api_rest.md "Encoding binary values" for bytes."""
    if array.dtype == object:
        return np.vectorize(lambda v: {"b64": base64.b64encode(v).decode()}, otypes=[object])(array).tolist()
    return array.tolist()


class RestClient:
    def __init__(self, url: str):
        self.url = f"{url}/v1/models"

    def _answer(self, response: requests.Response) -> dict:
        assert response.headers["Content-Type"].startswith("application/json"), response.text
        if response.status_code != 200:
            assert set(response.json()) == {"error"}, response.text  # api_rest.md: errors are {"error": ...}
            raise Refused(response.status_code, response.json()["error"])
        return response.json()

    def get(self, path: str) -> dict:
        return self._answer(requests.get(f"{self.url}/{path}", timeout=TIMEOUT))

    def post(self, path: str, body: dict) -> dict:
        return self._answer(requests.post(f"{self.url}/{path}", json=body, timeout=TIMEOUT))

    def status(self, spec: Spec) -> dict:
        return self.get(spec.path())

    def metadata(self, spec: Spec) -> dict:
        return self.get(f"{spec.path()}/metadata")

    def predict(self, spec: Spec, inputs: dict[str, np.ndarray], outputs: list[str]) -> dict[str, list]:
        """Columnar form; api_rest.md: one output is answered without its name."""
        body = {"inputs": {k: json_values(v) for k, v in inputs.items()}}
        if spec.signature:
            body["signature_name"] = spec.signature
        answer = self.post(f"{spec.path()}:predict", body)["outputs"]
        named = answer if len(outputs) > 1 else {outputs[0]: answer}
        return {k: rest_values(v) for k, v in named.items()}

    def infer(self, verb: str, spec: Spec, examples: list[dict]) -> list:
        body = {"signature_name": spec.signature, "examples": examples}
        return self.post(f"{spec.path()}:{verb}", body)["results"]

    def classify(self, spec: Spec, examples: list[dict]) -> list:
        return self.infer("classify", spec, examples)

    def regress(self, spec: Spec, examples: list[dict]) -> list:
        return self.infer("regress", spec, examples)


def example_input(examples: list[dict]) -> input_pb2.Input:
    return input_pb2.Input(example_list=input_pb2.ExampleList(
        examples=[example(**e) for e in examples]))


def classes_json(result: classification_pb2.ClassificationResult) -> list:
    """api_rest.md "Classify and Regress API": [[label, score], ...] per example."""
    return [[[c.label, c.score] for c in row.classes] for row in result.classifications]


class GrpcClient:
    def __init__(self, channel: grpc.Channel):
        self.prediction = prediction_service_pb2_grpc.PredictionServiceStub(channel)
        self.model = model_service_pb2_grpc.ModelServiceStub(channel)

    @staticmethod
    def call(method, request):
        try:
            return method(request, timeout=TIMEOUT)
        except grpc.RpcError as error:
            raise Refused(error.code().name, error.details()) from None

    def status(self, spec: Spec) -> dict:
        request = get_model_status_pb2.GetModelStatusRequest()
        spec.fill(request.model_spec)
        return proto_json(self.call(self.model.GetModelStatus, request))

    def metadata(self, spec: Spec) -> dict:
        """GetModelMetadataResponse as TF Serving's REST prints it, with the Any of signature_def unpacked."""
        request = get_model_metadata_pb2.GetModelMetadataRequest(metadata_field=["signature_def"])
        spec.fill(request.model_spec)
        response = self.call(self.prediction.GetModelMetadata, request)
        signatures = get_model_metadata_pb2.SignatureDefMap()
        assert response.metadata["signature_def"].Unpack(signatures)
        return {"model_spec": proto_json(response.model_spec),
                "metadata": {"signature_def": proto_json(signatures)}}

    def predict_response(self, spec: Spec, inputs: dict[str, np.ndarray]) -> predict_pb2.PredictResponse:
        request = predict_pb2.PredictRequest()
        spec.fill(request.model_spec)
        for name, value in inputs.items():
            request.inputs[name].CopyFrom(tf.make_tensor_proto(value))
        return self.call(self.prediction.Predict, request)

    def predict(self, spec: Spec, inputs: dict[str, np.ndarray], outputs: list[str]) -> dict[str, list]:
        response = self.predict_response(spec, inputs)
        return {k: tf.make_ndarray(v).tolist() for k, v in response.outputs.items()}

    def classify_response(self, spec: Spec, examples: list[dict]) -> classification_pb2.ClassificationResponse:
        request = classification_pb2.ClassificationRequest(input=example_input(examples))
        spec.fill(request.model_spec)
        return self.call(self.prediction.Classify, request)

    def regress_response(self, spec: Spec, examples: list[dict]) -> regression_pb2.RegressionResponse:
        request = regression_pb2.RegressionRequest(input=example_input(examples))
        spec.fill(request.model_spec)
        return self.call(self.prediction.Regress, request)

    def classify(self, spec: Spec, examples: list[dict]) -> list:
        return classes_json(self.classify_response(spec, examples).result)

    def regress(self, spec: Spec, examples: list[dict]) -> list:
        return [r.value for r in self.regress_response(spec, examples).result.regressions]


@pytest.fixture(scope="module")
def clients(server, channels) -> dict:
    return {"rest": RestClient(server.rest_url), **{k: GrpcClient(c) for k, c in channels.items()}}


@pytest.fixture(params=TRANSPORTS)
def client(request, clients):
    return clients[request.param]


@pytest.fixture(params=[t for t in TRANSPORTS if t.startswith("grpc")])
def grpc_client(request, clients) -> GrpcClient:
    return clients[request.param]


def refused(client, call, *args) -> tuple[int | str, str]:
    with pytest.raises(Refused) as info:
        call(*args)
    return info.value.status, info.value.message


def expected_status(client, code: str) -> int | str:
    return Code[code].http_status if isinstance(client, RestClient) else code


# --- model status -----------------------------------------------------------------------------------------------

def version_status(*versions: int) -> dict:
    """api_rest.md "Make REST API calls to ModelServer": the status body of available versions."""
    return {"model_version_status": [
        {"version": str(v), "state": "AVAILABLE", "status": {"error_code": "OK", "error_message": ""}}
        for v in versions]}


@pytest.mark.parametrize("spec, versions", [
    (Spec(HPT), (124, 123)),  # newest first: ServableStateMonitor's VersionMap is std::greater
    (Spec(HPT, version=123), (123,)),
    (Spec(HPT, version=124), (124,)),
    # api_rest.md: a label selects its version, as here. (TF Serving's GetModelStatusImpl reads only
    # model_spec.version, so TF Serving itself answers every version for a label, known or not.)
    (Spec(HPT, label="stable"), (123,)),
    (Spec(HPT, label="canary"), (124,)),
    (Spec(H3), (123,)),
    (Spec(TF2), (123,)),
    (Spec(TFLITE), (123,)),
    (Spec(KERAS), (1,)),
], ids=["hpt all", "hpt 123", "hpt 124", "hpt stable", "hpt canary", "h3", "tf2", "tflite", "keras"])
def test_model_status(client, spec, versions):
    assert client.status(spec) == version_status(*versions)


def test_a_version_holding_saved_model_pbtxt_is_served(client):
    """TensorFlow's SavedModel loader, TF Serving's, reads saved_model.pbtxt where there is no saved_model.pb, so
    such a version folder is a version: half_plus_three's answer of tensorflow_model_server_test_client.py."""
    assert client.status(Spec(PBTXT)) == version_status(123)
    assert client.predict(Spec(PBTXT), {"x": np.array([2.0], F32)}, ["y"]) == {"y": [4.0]}


def eventually(holds, timeout_s: float = TIMEOUT) -> None:
    """Wait until `holds()` is true, a refused call counting as false: the reload RPC waits for the models new to
    its config, as TF Serving's does, but not for the unloads of the ones it leaves out. Past the deadline the last
    refusal is raised, or AssertionError."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if holds():
                return
        except Refused:
            if time.monotonic() > deadline:
                raise
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {timeout_s:g} s")
        time.sleep(0.1)


def test_a_model_left_out_of_a_reloaded_config_answers_its_versions_end(server, clients):
    """core/servable_state_monitor.cc keeps every version's last state (ServerCore never calls
    ForgetUnloadedServableStates) and get_model_status_impl.cc answers from it: a model a reload leaves out is no
    longer served, but its status lists its versions END, over REST and gRPC, rather than NOT_FOUND."""
    original = text_format.Parse((server.models_root / "models.config").read_text(),
                                  model_server_config_pb2.ModelServerConfig())
    extended = model_server_config_pb2.ModelServerConfig()
    extended.CopyFrom(original)
    extended.model_config_list.config.add(name="removed", base_path=str(server.models_root / H3),
                                          model_platform="tensorflow")
    reload = clients["grpc_tcp"].model.HandleReloadConfigRequest
    try:
        reload(model_management_pb2.ReloadConfigRequest(config=extended), timeout=TIMEOUT)  # waits for "removed"
        assert clients["rest"].predict(Spec("removed"), {"x": np.array([2.0], F32)}, ["y"]) == {"y": [4.0]}
    finally:
        reload(model_management_pb2.ReloadConfigRequest(config=original), timeout=TIMEOUT)
    end = {"model_version_status": [{"version": "123", "state": "END",
                                     "status": {"error_code": "OK", "error_message": ""}}]}
    for client in clients.values():
        eventually(lambda client=client: client.status(Spec("removed")) == end)
        assert client.status(Spec("removed", version=123)) == end
        assert refused(client, client.predict, Spec("removed"), {"x": np.array([2.0], F32)}, ["y"]) == (
            expected_status(client, "NOT_FOUND"), "Servable not found for request: Latest(removed)")


# --- metadata ---------------------------------------------------------------------------------------------------

def documented_tensor(name: str, dtype: str, dims: list[int]) -> dict:
    return {"dtype": dtype, "tensor_shape": {"dim": [{"size": str(d), "name": ""} for d in dims],
                                             "unknown_rank": False}, "name": name}


def documented_signature(method: str, inputs: dict, outputs: dict) -> dict:
    return {"inputs": {k: documented_tensor(*v) for k, v in inputs.items()},
            "outputs": {k: documented_tensor(*v) for k, v in outputs.items()}, "method_name": method, "defaults": {}}


# half_plus_two_model_metadata.json, TF Serving's expected metadata of saved_model_half_plus_two_cpu, with one
# change: there tf_example has an unknown rank, since the shipped saved_model.pb predates the generator's
# `shape=[None]`, which the rebuilt model follows.
EXAMPLES = ("tf_example:0", "DT_STRING", [-1])
ROWS = [-1, 1]
DOCUMENTED_METADATA = {"signature_def": {"signature_def": {
    "serving_default": documented_signature("tensorflow/serving/predict", {"x": ("x:0", "DT_FLOAT", ROWS)},
                                            {"y": ("y:0", "DT_FLOAT", ROWS)}),
    "classify_x_to_y": documented_signature(CLASSIFY, {"inputs": EXAMPLES}, {"scores": ("y:0", "DT_FLOAT", ROWS)}),
    "regress_x_to_y": documented_signature(REGRESS, {"inputs": EXAMPLES}, {"outputs": ("y:0", "DT_FLOAT", ROWS)}),
    "regress_x_to_y2": documented_signature(REGRESS, {"inputs": EXAMPLES}, {"outputs": ("y2:0", "DT_FLOAT", ROWS)}),
    "regress_x2_to_y3": documented_signature(REGRESS, {"inputs": ("x2:0", "DT_FLOAT", ROWS)},
                                             {"outputs": ("y3:0", "DT_FLOAT", ROWS)}),
}}}


def saved_signatures(version_dir) -> dict:
    """The signature_def map of a version's saved_model.pb, printed as TF Serving prints metadata."""
    saved_model = saved_model_pb2.SavedModel()
    saved_model.ParseFromString((version_dir / "saved_model.pb").read_bytes())
    return proto_json(get_model_metadata_pb2.SignatureDefMap(signature_def=saved_model.meta_graphs[0].signature_def))


@pytest.mark.parametrize("spec, version", [
    (Spec(HPT), 124), (Spec(HPT, version=123), 123), (Spec(HPT, label="stable"), 123),
    (Spec(HPT, label="canary"), 124),
], ids=["latest", "123", "stable", "canary"])
def test_tf1_metadata_is_tf_servings(server, client, spec, version):
    metadata = client.metadata(spec)
    assert metadata == {"model_spec": {"name": HPT, "signature_name": "", "version": str(version)},
                        "metadata": DOCUMENTED_METADATA}
    assert metadata["metadata"]["signature_def"] == saved_signatures(server.models_root / HPT / f"{version:08d}")


# saved_model_half_plus_two_tf2_2_versions_metadata.json's entry for the signature a TF2 SavedModel runs once at
# load, which TF Serving's metadata lists with the callable ones (that file, edited by hand when `defaults` came,
# lacks the empty `defaults` TF Serving's JSON printer gives every signature: http_rest_api_util.cc prints fields
# without presence).
INIT_OP = "__saved_model_init_op"
DOCUMENTED_INIT_OP = {"inputs": {}, "outputs": {INIT_OP: {"dtype": "DT_INVALID", "tensor_shape": {
    "dim": [], "unknown_rank": True}, "name": "NoOp"}}, "method_name": "", "defaults": {}}


@pytest.mark.parametrize("model, folder", [(TF2, "00000123"), (KERAS, "1")])
def test_tf2_metadata_is_the_whole_signature_def_map(server, clients, model, folder):
    """get_model_metadata_impl.cc answers the meta graph's signature_def map as it is, so a TF2 SavedModel's
    `__saved_model_init_op`, which no request can call, is listed too; on every transport."""
    saved = saved_signatures(server.models_root / model / folder)
    assert saved["signature_def"][INIT_OP] == DOCUMENTED_INIT_OP
    for client in clients.values():
        assert client.metadata(Spec(model))["metadata"]["signature_def"] == saved


@pytest.mark.parametrize("model, signatures", [
    (TF2, {"serving_default": {"x": ("DT_FLOAT", [1])}, "regress_x_to_y": {"inputs": ("DT_STRING", [-1])},
           "regress_x_to_y2": {"inputs": ("DT_STRING", [-1])}, "regress_x2_to_y3": {"inputs": ("DT_FLOAT", [1])},
           "classify_x_to_y": {"inputs": ("DT_STRING", [-1])}, "classify_x2_to_y3": {"inputs": ("DT_FLOAT", [1])}}),
    (TFLITE, {"serving_default": {"x": ("DT_FLOAT", [1, 1])}}),  # TF Serving's generated signature: no sigdef
    (KERAS, {"serving_default": {"features": ("DT_FLOAT", [-1, 3])}, "serve": {"features": ("DT_FLOAT", [-1, 3])}}),
])
def test_metadata_of_the_other_formats_is_the_same_on_every_transport(clients, model, signatures):
    answers = {name: c.metadata(Spec(model)) for name, c in clients.items()}
    assert answers["grpc_tcp"] == answers["grpc_unix"] == answers["rest"]
    metadata = answers["rest"]
    version = "1" if model == KERAS else "123"
    assert metadata["model_spec"] == {"name": model, "signature_name": "", "version": version}
    found = metadata["metadata"]["signature_def"]["signature_def"]
    assert {k: {i: (t["dtype"], [int(d["size"]) for d in t["tensor_shape"]["dim"]]) for i, t in s["inputs"].items()}
            for k, s in found.items() if k != INIT_OP} == signatures
    assert {s["method_name"] for k, s in found.items() if k != INIT_OP} == {"tensorflow/serving/predict"}


def metadata_request(*fields: str) -> get_model_metadata_pb2.GetModelMetadataRequest:
    request = get_model_metadata_pb2.GetModelMetadataRequest(metadata_field=fields)
    Spec(TF2, signature="regress_x_to_y").fill(request.model_spec)
    return request


@pytest.mark.parametrize("fields, message", [
    ((), "GetModelMetadataRequest must specify at least one metadata_field"),
    (("signature_def", "nope"), "Metadata field nope is not supported"),
], ids=["none", "unknown"])
def test_grpc_metadata_fields_are_checked_as_get_model_metadata_impl_checks_them(grpc_client, fields, message):
    assert refused(grpc_client, grpc_client.call, grpc_client.prediction.GetModelMetadata,
                   metadata_request(*fields)) == ("INVALID_ARGUMENT", message)


def test_grpc_metadata_names_the_model_and_version_but_no_signature(grpc_client):
    """get_model_metadata_impl.cc sets the answer's name and version only, whatever signature the request named;
    a field named twice is answered once."""
    response = grpc_client.call(grpc_client.prediction.GetModelMetadata,
                                metadata_request("signature_def", "signature_def"))
    assert proto_json(response.model_spec) == {"name": TF2, "signature_name": "", "version": "123"}
    assert list(response.metadata) == ["signature_def"]


# --- predict ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec, inputs, expected", [
    # tensorflow_model_server_test_client.py: x DT_FLOAT of shape [1], 2.0 -> 3.0 (TF1, TF2, TFLite), 4.0 (h3)
    (Spec(HPT), {"x": np.array([2.0], F32)}, {"y": [3.0]}),
    (Spec(TF2), {"x": np.array([2.0], F32)}, {"y": [3.0]}),
    (Spec(TFLITE), {"x": np.array([2.0], F32)}, {"y": [3.0]}),
    (Spec(H3), {"x": np.array([2.0], F32)}, {"y": [4.0]}),
    # docker.md: half_plus_two; api_rest.md "Example": half_plus_three
    (Spec(HPT, version=123), {"x": np.array([1, 2, 5], F32)}, {"y": [2.5, 3.0, 4.5]}),
    (Spec(HPT, label="stable"), {"x": np.array([1, 2, 5], F32)}, {"y": [2.5, 3.0, 4.5]}),
    (Spec(HPT, label="canary"), {"x": np.array([1, 2, 5], F32)}, {"y": [2.5, 3.0, 4.5]}),
    (Spec(H3), {"x": np.array([1, 2, 5], F32)}, {"y": [3.5, 4.0, 5.5]}),
    # http_rest_api_handler_test.cc: [[1, 2], [3, 4]] on the serving_default signature named
    (Spec(HPT, version=123, signature="serving_default"), {"x": np.array([[1, 2], [3, 4]], F32)},
     {"y": [[2.5, 3.0], [3.5, 4.0]]}),
    # predict_util_test.cc: Predict on a regression signature, a scalar x2
    (Spec(HPT, signature="regress_x2_to_y3"), {"inputs": np.array(2.0, F32)}, {"outputs": 4.0}),
    (Spec(TF2, signature="classify_x2_to_y3"), {"inputs": np.array([2.0], F32)}, {"scores": [4.0]}),
    (Spec(KERAS), {"features": np.array([[1, 1, 1], [0, 0, 2]], F32)}, {"output_0": [[6.5], [6.5]]}),
], ids=["hpt client", "tf2 client", "tflite client", "h3 client", "hpt 123", "hpt stable", "hpt canary", "h3",
        "hpt 2x2", "hpt x2 scalar", "tf2 x2", "keras"])
def test_predict(client, spec, inputs, expected):
    assert client.predict(spec, inputs, list(expected)) == expected


@pytest.mark.parametrize("path, body, expected", [
    # api_rest.md "Specifying input tensors in row format" / "Response format", docker.md
    (f"{HPT}/versions/123", {"instances": [1.0, 2.0, 5.0]}, {"predictions": [2.5, 3.0, 4.5]}),
    (H3, {"instances": [1.0, 2.0, 5.0]}, {"predictions": [3.5, 4.0, 5.5]}),
    (f"{HPT}/labels/stable", {"instances": [[1.0, 2.0], [3.0, 4.0]]}, {"predictions": [[2.5, 3.0], [3.5, 4.0]]}),
    # tensorflow_model_server_test.py testPredictREST and testPredictColumnarREST
    (HPT, {"instances": [2.0, 3.0, 4.0]}, {"predictions": [3.0, 3.5, 4.0]}),
    (HPT, {"inputs": [2.0, 3.0, 4.0]}, {"outputs": [3.0, 3.5, 4.0]}),
    (f"{HPT}/versions/124", {"signature_name": "serving_default", "inputs": {"x": [[1.0], [2.0]]}},
     {"outputs": [[2.5], [3.0]]}),
    (TF2, {"instances": [2.0]}, {"predictions": [3.0]}),
    (TF2, {"instances": [{"x": 2.0}]}, {"predictions": [3.0]}),
    (TFLITE, {"inputs": {"x": [1.0, 2.0, 5.0]}}, {"outputs": [2.5, 3.0, 4.5]}),
    (KERAS, {"instances": [[1.0, 0.0, 0.0]]}, {"predictions": [[1.5]]}),
    # json_tensor.cc FillTensorMapFromInputsMap reads only the signature's names from an "inputs" object
    (HPT, {"inputs": {"x": [[1.0], [2.0]], "request_id": "abc"}}, {"outputs": [[2.5], [3.0]]}),
], ids=["row 123", "row h3", "row stable 2x2", "server test row", "server test columnar", "columnar named",
        "tf2 row", "tf2 row objects", "tflite columnar", "keras row", "columnar with a key it lacks"])
def test_rest_predict_row_and_columnar_bodies(clients, path, body, expected):
    assert clients["rest"].post(f"{path}:predict", body) == expected


@pytest.mark.parametrize("spec, version", [
    (Spec(HPT), 124), (Spec(HPT, label="stable"), 123), (Spec(HPT, version=123), 123), (Spec(H3), 123),
    (Spec(TF2), 123), (Spec(TFLITE), 123),
], ids=["latest", "stable", "123", "h3", "tf2", "tflite"])
def test_grpc_predict_names_the_version_and_signature_that_ran(grpc_client, spec, version):
    response = grpc_client.predict_response(spec, {"x": np.array([2.0], F32)})
    assert (response.model_spec.name, response.model_spec.version.value, response.model_spec.signature_name) == (
        spec.model, version, "serving_default")
    assert not response.model_spec.version_label  # TF Serving answers with the number a label stands for


def test_grpc_predict_of_tf_servings_test_client_request(grpc_client):
    """tensorflow_model_server_test_client.py's request as it builds it: dtype, float_val and shape set field by
    field, and an output filter."""
    request = predict_pb2.PredictRequest(output_filter=["y"])
    request.model_spec.name = HPT
    request.inputs["x"].dtype = tf.float32.as_datatype_enum
    request.inputs["x"].float_val.append(2.0)
    request.inputs["x"].tensor_shape.dim.add().size = 1
    response = grpc_client.call(grpc_client.prediction.Predict, request)
    assert response.outputs["y"].dtype == tf.float32.as_datatype_enum
    assert tf.make_ndarray(response.outputs["y"]).tolist() == [3.0]


# http_rest_api_handler_test.cc PredictRequestErrors and RegressionErrors (the "versions/HELLO" paths): its requests
# byte for byte, and the substrings its assertions match in the answer, on its model (half_plus_two)
HANDLER_TEST_ERRORS = [
    (f"{HPT}:predict", b"", "JSON Parse error: The document is empty"),
    (f"{HPT}:predict", b"instances = [1, 2]", "JSON Parse error: Invalid value"),
    (f"{HPT}:predict", b'{ "instances": ["x", "y"] }', "not of expected type: float"),
    (f"{HPT}/labels/nonexistent:predict", b'{ "instances": ["x", "y"] }', "Unrecognized servable version label"),
    (f"{HPT}:predict", b'{ "signature_name": 100 }', "'signature_name' key must be a string value."),
    (f"{HPT}/versions/HELLO:regress", b'{"examples": [{"x": 80.0}]}', "Malformed request"),
    (f"{HPT}/versions/some_label:regress", b'{"examples": [{"x": 80.0}]}', "Malformed request"),
]


@pytest.mark.parametrize("path, body, substring", HANDLER_TEST_ERRORS,
                         ids=["empty", "not JSON", "strings for floats", "unknown label", "signature_name 100",
                              "version HELLO", "version some_label"])
def test_rest_errors_of_tf_servings_handler_test(server, path, body, substring):
    response = requests.post(f"{server.rest_url}/v1/models/{path}", data=body, timeout=TIMEOUT)
    assert response.status_code == 400 and set(response.json()) == {"error"}, response.text
    assert substring in response.json()["error"]


def test_rest_base64_is_read_as_tf_serving_reads_it(clients):
    """absl::Base64Unescape (json_tensor.cc's decoder for {"b64"}) skips whitespace and takes base64 without its
    padding: a tf.Example sent so regresses as the padded one does."""
    padded = base64.b64encode(example(x=80.0).SerializeToString()).decode()
    assert padded.endswith("=")  # or leaving the padding out would test nothing
    for text in (padded, padded.rstrip("="), f"{padded[:8]} \n{padded[8:]}"):
        body = {"signature_name": "regress_x_to_y", "inputs": [{"b64": text}]}
        assert clients["rest"].post(f"{HPT}/versions/123:predict", body) == {"outputs": [[42.0]]}, text


# --- classify and regress ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec, examples, expected", [
    # tensorflow_model_server_test.py _TestClassify (TF1 and TF2): x = 2.0 -> 3.0
    (Spec(HPT, signature="classify_x_to_y"), [{"x": 2.0}], [[["", 3.0]]]),
    (Spec(TF2, signature="classify_x_to_y"), [{"x": 2.0}], [[["", 3.0]]]),
    # http_rest_api_handler_test.cc
    (Spec(HPT, version=123, signature="classify_x_to_y"), [{"x": 20.0}], [[["", 12.0]]]),
    (Spec(HPT, label="stable", signature="classify_x_to_y"), [{"x": 10.0}], [[["", 7.0]]]),
    (Spec(HPT, label="canary", signature="classify_x_to_y"), [{"x": 10.0}, {"x": 20.0}], [[["", 7.0]], [["", 12.0]]]),
    (Spec(H3, signature="classify_x_to_y"), [{"x": 2.0}], [[["", 4.0]]]),
], ids=["hpt", "tf2", "hpt 123", "hpt stable", "hpt canary", "h3"])
def test_classify(client, spec, examples, expected):
    assert client.classify(spec, examples) == expected


@pytest.mark.parametrize("spec, examples, expected", [
    # tensorflow_model_server_test.py _TestRegress (TF1 and TF2): x = 2.0 -> 3.0
    (Spec(HPT, signature="regress_x_to_y"), [{"x": 2.0}], [3.0]),
    (Spec(TF2, signature="regress_x_to_y"), [{"x": 2.0}], [3.0]),
    # api_rest.md "Make REST API calls": half_plus_three regresses 1.0, 2.0 to 3.5, 4.0
    (Spec(H3, signature="regress_x_to_y"), [{"x": 1.0}, {"x": 2.0}], [3.5, 4.0]),
    (Spec(HPT, version=123, signature="regress_x_to_y2"), [{"x": 1.0}, {"x": 2.0}], [3.5, 4.0]),
    (Spec(TF2, signature="regress_x_to_y2"), [{"x": 1.0}, {"x": 2.0}], [3.5, 4.0]),
    # http_rest_api_handler_test.cc: regress_x_to_y 80 -> 42, by version and by label
    (Spec(HPT, version=123, signature="regress_x_to_y"), [{"x": 80.0}], [42.0]),
    (Spec(HPT, label="stable", signature="regress_x_to_y"), [{"x": 80.0}], [42.0]),
], ids=["hpt", "tf2", "h3", "hpt 123 y2", "tf2 y2", "hpt 123", "hpt stable"])
def test_regress(client, spec, examples, expected):
    assert client.regress(spec, examples) == expected


@pytest.mark.parametrize("call, spec", [
    ("classify", Spec(KERAS)), ("regress", Spec(KERAS)), ("regress", Spec(TFLITE)),
    ("regress", Spec(HPT, signature="serving_default")),
], ids=["keras classify", "keras regress", "tflite regress", "hpt predict signature"])
def test_classify_and_regress_refuse_a_signature_that_does_not_fit_alike(clients, call, spec):
    """The Keras, TFLite and predict signatures take a float tensor, not serialized tf.Examples."""
    answers = {name: refused(c, getattr(c, call), spec, [{"x": 1.0}]) for name, c in clients.items()}
    assert answers["rest"] == (400, answers["grpc_tcp"][1])
    assert answers["grpc_tcp"] == answers["grpc_unix"] == ("INVALID_ARGUMENT", answers["rest"][1])
    noun = "classification" if call == "classify" else "regression"
    assert answers["rest"][1].startswith(f"No {noun} inputs found in SignatureDef")


def test_grpc_classify_and_regress_name_the_version_and_signature_that_ran(grpc_client):
    spec = Spec(HPT, label="stable", signature="classify_x_to_y")
    classified = grpc_client.classify_response(spec, [{"x": 1.0}])
    assert (classified.model_spec.version.value, classified.model_spec.signature_name) == (123, "classify_x_to_y")
    regressed = grpc_client.regress_response(Spec(TF2, signature="regress_x_to_y"), [{"x": 1.0}])
    assert (regressed.model_spec.name, regressed.model_spec.version.value,
            regressed.model_spec.signature_name) == (TF2, 123, "regress_x_to_y")


# --- MultiInference (gRPC only: TF Serving's REST API has no multi-inference verb) -------------------------------

@pytest.mark.parametrize("spec, tasks, version", [
    # tensorflow_model_server_test.py _TestMultiInference (TF1 and TF2)
    (Spec(HPT), [(REGRESS, "regress_x_to_y"), (CLASSIFY, "classify_x_to_y")], 124),
    (Spec(TF2), [(REGRESS, "regress_x_to_y"), (CLASSIFY, "classify_x_to_y")], 123),
    (Spec(HPT, label="stable"), [(REGRESS, "regress_x_to_y"), (CLASSIFY, "classify_x_to_y"),
                                 (REGRESS, "regress_x_to_y2")], 123),
], ids=["hpt", "tf2", "hpt stable"])
def test_multi_inference_answers_as_classify_and_regress_do(clients, grpc_client, spec, tasks, version):
    examples = [{"x": 2.0}, {"x": 4.0}]
    request = inference_pb2.MultiInferenceRequest(input=example_input(examples))
    for method, signature in tasks:
        task = request.tasks.add(method_name=method)
        Spec(spec.model, spec.version, spec.label, signature).fill(task.model_spec)
    response = grpc_client.call(grpc_client.prediction.MultiInference, request)
    rest = clients["rest"]
    expected, got = [], []
    for (method, signature), result in zip(tasks, response.results, strict=True):
        task_spec = Spec(spec.model, spec.version, spec.label, signature)
        assert (result.model_spec.name, result.model_spec.version.value, result.model_spec.signature_name) == (
            spec.model, version, signature)
        if method == CLASSIFY:
            expected.append(rest.classify(task_spec, examples))
            got.append(classes_json(result.classification_result))
        else:
            expected.append(rest.regress(task_spec, examples))
            got.append([r.value for r in result.regression_result.regressions])
    assert got == expected
    assert got[0] == [3.0, 4.0]  # y = 0.5 x + 2


# --- errors -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("call, spec, code, message", [
    # api_rest.md "Make REST API calls": POST /v1/models/half:predict
    ("predict", Spec("half"), "NOT_FOUND", "Servable not found for request: Latest(half)"),
    ("predict", Spec(HPT, version=99), "NOT_FOUND",
     "Servable not found for request: Specific(half_plus_two, 99)"),
    ("predict", Spec(HPT, label="nope"), "INVALID_ARGUMENT", "Unrecognized servable version label: nope"),
    ("classify", Spec("half", signature="classify_x_to_y"), "NOT_FOUND",
     "Servable not found for request: Latest(half)"),
    ("classify", Spec(HPT, label="nope", signature="classify_x_to_y"), "INVALID_ARGUMENT",
     "Unrecognized servable version label: nope"),
    ("regress", Spec(HPT, version=125, signature="regress_x_to_y"), "NOT_FOUND",
     "Servable not found for request: Specific(half_plus_two, 125)"),
    ("metadata", Spec("half"), "NOT_FOUND", "Servable not found for request: Latest(half)"),
    ("metadata", Spec(TF2, version=2), "NOT_FOUND", "Servable not found for request: Specific(half_plus_two_tf2, 2)"),
    ("metadata", Spec(HPT, label="nope"), "INVALID_ARGUMENT",
     "Unrecognized servable version label: nope"),
    ("status", Spec("half"), "NOT_FOUND", "Could not find any versions of model half"),
    ("status", Spec(HPT, version=99), "NOT_FOUND", "Could not find version 99 of model half_plus_two"),
], ids=["predict model", "predict version", "predict label", "classify model", "classify label", "regress version",
        "metadata model", "metadata version", "metadata label", "status model", "status version"])
def test_errors_are_tf_servings(client, call, spec, code, message):
    args = {"predict": (spec, {"x": np.array([1.0], F32)}, ["y"]), "classify": (spec, [{"x": 1.0}]),
            "regress": (spec, [{"x": 1.0}]), "metadata": (spec,), "status": (spec,)}[call]
    assert refused(client, getattr(client, call), *args) == (expected_status(client, code), message)


def test_an_unknown_signature_is_refused_as_each_api_of_tf_serving_refuses_it(client):
    """predict_util.cc (gRPC): FAILED_PRECONDITION; http_rest_api_handler.cc GetInfoMap (REST): INVALID_ARGUMENT."""
    status, message = refused(client, client.predict, Spec(HPT, signature="nope"),
                              {"x": np.array([1.0], F32)}, ["y"])
    if isinstance(client, RestClient):
        assert (status, message) == (400, 'Serving signature name: "nope" not found in signature def')
    else:
        assert (status, message) == ("FAILED_PRECONDITION", 'Serving signature key "nope" not found.')


def test_grpc_the_missing_model_tf_servings_harness_waits_on_is_not_found(grpc_client):
    """tensorflow_model_server_test_base.py WaitForServerReady: an empty Predict for a model nobody serves; the
    server is ready once the details say "Servable"."""
    request = predict_pb2.PredictRequest()
    request.model_spec.name = "intentionally_missing_model"
    assert refused(grpc_client, grpc_client.call, grpc_client.prediction.Predict, request) == (
        "NOT_FOUND", "Servable not found for request: Latest(intentionally_missing_model)")


@pytest.mark.parametrize("method", ["Predict", "Classify", "Regress", "MultiInference", "GetModelMetadata"])
def test_grpc_a_request_without_a_model_name_is_refused_as_server_core_refuses_it(grpc_client, method):
    request = {"Predict": predict_pb2.PredictRequest(), "Classify": classification_pb2.ClassificationRequest(),
               "Regress": regression_pb2.RegressionRequest(), "MultiInference": inference_pb2.MultiInferenceRequest(),
               "GetModelMetadata": get_model_metadata_pb2.GetModelMetadataRequest(metadata_field=["signature_def"])}[
        method]
    assert refused(grpc_client, grpc_client.call, getattr(grpc_client.prediction, method), request) == (
        "INVALID_ARGUMENT", "ModelSpec has no name specified.")


@pytest.mark.parametrize("spec, inputs, message", [
    (Spec(HPT), {"x": np.array([1.0])}, "Expects arg[0] to be float but double is provided"),
    (Spec(TF2), {"x": np.array([1], np.int32)}, "Expects arg[0] to be float but int32 is provided"),
    (Spec(KERAS), {"features": np.ones((1, 3))}, "Expects arg[0] to be float but double is provided"),
    (Spec(TFLITE), {"x": np.array([1.0])}, "Expects arg[0] to be float but double is provided"),
], ids=["tf1 double", "tf2 int32", "keras double", "tflite double"])
def test_grpc_tensors_of_another_dtype_are_refused_as_tf_servings_session_refuses_them(grpc_client, spec, inputs,
                                                                                       message):
    """A TensorProto says its dtype, and TF Serving feeds it to the Session as it is, whose check refuses it (its
    best-known error: numpy's default float64 sent for a float input). REST's JSON numbers have no dtype and are
    converted."""
    assert refused(grpc_client, grpc_client.predict, spec, inputs, ["y"]) == ("INVALID_ARGUMENT", message)


def test_grpc_predict_with_inputs_too_many_or_missing_is_refused_in_predict_utils_words(grpc_client):
    """predict_util.cc VerifyRequestInputsSize, a text TF Serving's users grep their logs for."""
    f32 = np.array([2.0], F32)
    assert refused(grpc_client, grpc_client.predict, Spec(HPT), {"x": f32, "extra": f32}, ["y"]) == (
        "INVALID_ARGUMENT", "input size does not match signature: 2!=1 len({extra,x}) != len({x}). Sent extra: "
        "{extra}. Missing but required: {}.")
    assert refused(grpc_client, grpc_client.predict, Spec(HPT), {}, ["y"]) == (
        "INVALID_ARGUMENT", "input size does not match signature: 0!=1 len({}) != len({x}). Sent extra: {}. "
        "Missing but required: {x}.")


# --- batching across transports ---------------------------------------------------------------------------------

def test_concurrent_calls_over_every_transport_each_get_their_own_rows(clients):
    """--enable_batching merges concurrent rows of one signature; every caller must still get only its own."""
    models = [(Spec(HPT, version=123), 2.0), (Spec(HPT, version=124), 2.0), (Spec(H3), 3.0), (Spec(TFLITE), 2.0)]

    def call(i: int) -> bool:
        spec, intercept = models[i % len(models)]
        x = np.arange(1 + i % 3, dtype=F32) + i
        got = clients[TRANSPORTS[i % 3]].predict(spec, {"x": x}, ["y"])
        return got == {"y": (0.5 * x + intercept).tolist()}

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(call, range(48), timeout=TIMEOUT))
    assert all(answers), answers
