"""Classify, Regress and MultiInference on SavedModels exported elsewhere, against TF Serving's documented answers.

The TF1 graph of tests/foreign_models.py is TF Serving's half_plus_two (y = 0.5 x + 2, y2 = 0.5 x + 3), and the
TF2 tf.Module has classify and regress signatures whose method name is "predict", as `tf.saved_model.save` writes
them. One `petal serve` serves both over REST and gRPC, with batching on. The first tests check the tf.Example
conversion in-process against the rules of TF Serving's json_tensor.cc and util.cc.
"""
from __future__ import annotations

import concurrent.futures
import os
import re

import grpc
import numpy as np
import pytest
import requests
import tensorflow as tf
from tensorflow.core.example import example_pb2
from tensorflow_serving.apis import (
    classification_pb2,
    inference_pb2,
    input_pb2,
    prediction_log_pb2,
    prediction_service_pb2_grpc,
    regression_pb2,
)

from exported_models.model_format import WARMUP_FILE
from foreign_models import CLASS_NAMES, example, tf1_half_plus_two, tf2_module
from server_harness import run_server
from serving.core import ServingError, SignatureInfo, TensorInfo, input_from_json
from serving.core.examples import (
    CLASSIFY_METHOD,
    REGRESS_METHOD,
    check_signature,
    classifications,
    regressions,
    serialized_examples,
)
from serving.core.images import check_pixels
from serving.core.servable import Servable
from serving.metrics import Metrics

BATCH_SIZE_METRIC = ":tensorflow:serving:batching_session:processed_batch_size"


# --- the tf.Example conversion, in-process ---------------------------------------------------------------------

def features(example_proto: example_pb2.Example) -> dict[str, tuple[str, list]]:
    return {name: (f.WhichOneof("kind"), list(getattr(f, f.WhichOneof("kind")).value) if f.WhichOneof("kind") else [])
            for name, f in example_proto.features.feature.items()}


def test_json_features_become_the_lists_tf_serving_builds():
    request_input = input_from_json({"examples": [{
        "int": 3, "float": 2.5, "whole_float": 2.0, "text": "héllo", "bytes": b"\x00\xff", "flag": True,
        "ints": [1, -2], "floats": [1.5, 2.0], "empty": [], "big": 1 << 70}]})
    assert request_input.WhichOneof("kind") == "example_list"
    assert features(request_input.example_list.examples[0]) == {
        "int": ("int64_list", [3]), "float": ("float_list", [2.5]), "whole_float": ("float_list", [2.0]),
        "text": ("bytes_list", ["héllo".encode()]), "bytes": ("bytes_list", [b"\x00\xff"]),
        "flag": ("int64_list", [1]), "ints": ("int64_list", [1, -2]), "empty": (None, []),
        "floats": ("float_list", [1.5, 2.0]),
        "big": ("float_list", [float(1 << 70)])}  # past uint64, rapidjson reads a double


def test_context_comes_first_so_an_example_overrides_it():
    request_input = input_from_json({"context": {"x": 1.0, "shared": "c"}, "examples": [{"x": 2.0}, {"y": 3}]})
    assert request_input.WhichOneof("kind") == "example_list_with_context"
    merged = [example_pb2.Example.FromString(data) for data in serialized_examples(request_input)]
    assert [features(e) for e in merged] == [
        {"x": ("float_list", [2.0]), "shared": ("bytes_list", [b"c"])},
        {"x": ("float_list", [1.0]), "shared": ("bytes_list", [b"c"]), "y": ("int64_list", [3])}]


@pytest.mark.parametrize("body, message", [
    ({}, "When method is classify, key 'examples' is expected and was not found"),
    ({"examples": {"x": 1}}, "Expecting 'examples' value to be an list/array"),
    ({"examples": []}, "'examples' value is an empty array"),
    ({"examples": [1]}, "Example must be JSON object but got JSON Number"),
    ({"examples": [{"x": None}]}, "Feature: x has element with unexpected JSON type: Null"),
    ({"examples": [{"x": [[1]]}]}, "Feature: x has element with unexpected JSON type: Array"),
    ({"examples": [{"x": {"a": 1}}]}, "Feature: x has element with unexpected JSON type: Object"),
    ({"examples": [{"x": [1.5, "a"]}]}, "Unexpected element type in feature: x expecting type: float"),
    ({"examples": [{"x": [1, 2.5]}]}, "Unexpected element type in feature: x expecting type: int64"),
    ({"examples": [{"x": [2.5, 1]}]}, "Unexpected element type in feature: x expecting type: float"),
    ({"examples": [{"x": 1 << 63}]}, "Feature: x has uint64_t element. Only int64_t is supported."),
    ({"context": "c", "examples": [{}]}, "Example must be JSON object but got JSON String"),
], ids=["no examples", "examples an object", "no example", "example a number", "null", "nested list", "object",
        "float then string", "int then float", "float then int", "uint64", "context a string"])
def test_json_errors_are_tf_servings(body, message):
    with pytest.raises(ServingError) as error:
        input_from_json(body)
    assert error.value.code == "INVALID_ARGUMENT" and error.value.message.endswith(message)


def test_empty_input_is_refused():
    for request_input in (input_pb2.Input(), input_pb2.Input(example_list=input_pb2.ExampleList())):
        with pytest.raises(ServingError, match=r"^Input is empty\.$"):
            serialized_examples(request_input)


def signature(inputs: dict[str, str], outputs: dict[str, str]) -> SignatureInfo:
    return SignatureInfo({k: TensorInfo(k, v, [-1]) for k, v in inputs.items()},
                         {k: TensorInfo(k, v, [-1]) for k, v in outputs.items()}, "tensorflow/serving/predict")


@pytest.mark.parametrize("method, inputs, outputs, message", [
    (CLASSIFY_METHOD, {"a": "DT_STRING", "b": "DT_STRING"}, {"scores": "DT_FLOAT"}, "Expected one input Tensor."),
    (CLASSIFY_METHOD, {"inputs": "DT_STRING"}, {"a": "DT_FLOAT", "b": "DT_FLOAT", "c": "DT_FLOAT"},
     "Expected one or two output Tensors, found 3"),
    (CLASSIFY_METHOD, {"x": "DT_STRING"}, {"scores": "DT_FLOAT"}, "No classification inputs found in SignatureDef"),
    (CLASSIFY_METHOD, {"inputs": "DT_STRING"}, {"y": "DT_FLOAT"},
     'Expected classification signature outputs to contain at least one of "classes" or "scores"'),
    (REGRESS_METHOD, {"inputs": "DT_STRING"}, {"outputs": "DT_FLOAT", "b": "DT_FLOAT"}, "Expected one output Tensor."),
    (REGRESS_METHOD, {"inputs": "DT_STRING"}, {"y": "DT_FLOAT"}, "No regression outputs found in SignatureDef"),
    ("tensorflow/serving/predict", {"inputs": "DT_STRING"}, {"y": "DT_FLOAT"},
     "Unsupported signature method_name: tensorflow/serving/predict"),
], ids=["two inputs", "three outputs", "no inputs alias", "no classes or scores", "two regress outputs",
        "no outputs alias", "predict task"])
def test_signature_structure_checks(method, inputs, outputs, message):
    with pytest.raises(ServingError) as error:
        check_signature(method, signature(inputs, outputs))
    assert error.value.message.startswith(message)
    assert error.value.code == ("UNIMPLEMENTED" if method.endswith("predict") else "INVALID_ARGUMENT")


def test_results_are_checked_as_tf_serving_checks_them():
    classes = np.array([[b"a", b"b"]], dtype=object)
    assert classifications({"classes": classes}, 1) == [[("a", 0.0), ("b", 0.0)]]
    assert classifications({"scores": np.array([[0.25, 0.75]], np.float32)}, 1) == [[("", 0.25), ("", 0.75)]]
    for outputs, rows, message in [
        ({"scores": np.array([0.5], np.float32)}, 1, "Expected Tensor shape: [batch_size num_classes] but got [1]"),
        ({"scores": np.array([[1]], np.int32)}, 1, "Expected scores Tensor of DT_FLOAT. Got: DT_INT32"),
        ({"classes": np.array([[1.0]], np.float32)}, 1, "Expected classes Tensor of DT_STRING. Got: DT_FLOAT"),
        ({"scores": np.array([[0.5]], np.float32)}, 2, "Expected scores output batch size of 2. Got: 1"),
        ({"classes": classes, "scores": np.array([[0.5]], np.float32)}, 1,
         "Tensors class and score should match in dim_size(1). Got 2 vs. 1")]:
        with pytest.raises(ServingError) as error:
            classifications(outputs, rows)
        assert error.value.message == message
    assert regressions({"outputs": np.array([[1.5], [2.0]], np.float32)}, 2) == [1.5, 2.0]
    for values, rows, message in [
        (np.array([[1.0, 2.0]], np.float32), 1,
         "Expected output Tensor shape to be either [batch_size] or [batch_size, 1] but got [1,2]"),
        (np.array([1.0], np.float32), 2, "Input batch size did not match output batch size: 2 vs. 1"),
        (np.array([1.0]), 1, "Expected output Tensor of DT_FLOAT.  Got: DT_DOUBLE")]:
        with pytest.raises(ServingError) as error:
            regressions({"outputs": values}, rows)
        assert error.value.message == message


# --- a real server: TF1 and TF2 models, REST and gRPC -----------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The TF1 model in a zero-padded version folder and the TF2 module, with a
    50 ms batch window and one batch thread, so concurrent requests merge."""
    root = tmp_path_factory.mktemp("foreign")
    tf1_half_plus_two(str(root / "tf1"), versions=("00000123",))
    tf2_module(str(root / "tf2"))
    config = root / "models.config"
    config.write_text("model_config_list { "
                      f'config {{ name: "half_plus_two" base_path: "{root / "tf1"}" model_platform: "tensorflow" }} '
                      f'config {{ name: "module" base_path: "{root / "tf2"}" model_platform: "tensorflow" }} }}')
    batching = root / "batching.config"
    batching.write_text("max_batch_size { value: 32 } batch_timeout_micros { value: 50000 } "
                        "num_batch_threads { value: 1 }")
    with run_server(f"--model_config_file={config}", "--enable_batching",
                    f"--batching_parameters_file={batching}") as srv:
        yield srv


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.grpc_target) as channel:
        yield prediction_service_pb2_grpc.PredictionServiceStub(channel)


def rest(server, model: str, verb: str, body: dict) -> requests.Response:
    return requests.post(f"{server.rest_url}/v1/models/{model}:{verb}", json=body, timeout=60)


def ok(response: requests.Response) -> dict:
    assert response.status_code == 200, response.text
    return response.json()


def error(response: requests.Response, status: int) -> str:
    assert response.status_code == status, response.text
    return response.json()["error"]


def test_rest_classify_with_scores_only_answers_empty_labels(server):
    body = {"signature_name": "classify_x_to_y", "examples": [{"x": 2.0}, {"x": 5.0}]}
    assert ok(rest(server, "half_plus_two", "classify", body)) == {"results": [[["", 3.0]], [["", 4.5]]]}


def test_rest_classify_with_classes_and_scores(server):
    body = {"signature_name": "classify_x_to_classes", "examples": [{"x": 2.0}, {"x": 3.0}, {"x": 10.0}]}
    negative, positive = CLASS_NAMES
    assert ok(rest(server, "half_plus_two", "classify", body)) == {"results": [
        [[negative, 1.0], [positive, 0.0]], [[negative, 0.5], [positive, 0.5]], [[negative, 0.0], [positive, 1.0]]]}


def test_rest_regress_gives_tf_servings_documented_answer(server):
    """g3doc/api_rest.md: half_plus_three regresses 1.0 and 2.0 to 3.5 and 4.0."""
    body = {"signature_name": "regress_x_to_y2", "examples": [{"x": 1.0}, {"x": 2.0}]}
    assert ok(rest(server, "half_plus_two", "regress", body)) == {"results": [3.5, 4.0]}
    body["signature_name"] = "regress_x_to_y"
    assert ok(rest(server, "half_plus_two", "regress", body)) == {"results": [2.5, 3.0]}


def test_rest_context_is_merged_into_every_example(server):
    """y3 = 0.5 x2 + 3: the first example takes x2 from the context, the second overrides it."""
    body = {"signature_name": "regress_x2_to_y3", "context": {"x": 1.0, "x2": 4.0},
            "examples": [{"x": 2.0}, {"x2": 10.0}]}
    assert ok(rest(server, "half_plus_two", "regress", body)) == {"results": [5.0, 8.0]}


def test_rest_tf2_signatures_with_the_predict_method_classify_and_regress(server):
    examples = [{"x": 1.0}, {"x": 4.0}]
    assert ok(rest(server, "module", "regress", {"signature_name": "regress", "examples": examples})) == {
        "results": [2.5, 4.0]}
    assert ok(rest(server, "module", "classify", {"signature_name": "classify", "examples": examples})) == {
        "results": [[["negative", 1.0], ["positive", 0.0]], [["negative", 0.0], ["positive", 1.0]]]}


@pytest.mark.parametrize("model, verb, body, status, message", [
    ("half_plus_two", "regress", {"examples": [{"x": 1.0}]}, 400,
     "No regression inputs found in SignatureDef: inputs ['x'], outputs ['y'], method_name "
     "'tensorflow/serving/predict'"),
    ("half_plus_two", "regress", {"signature_name": "classify_x_to_classes", "examples": [{"x": 1.0}]}, 400,
     "Expected one output Tensor."),
    ("half_plus_two", "classify", {"signature_name": "nope", "examples": [{"x": 1.0}]}, 400,
     "No signature was found with the name: nope"),
    ("half_plus_two", "classify", {"signature_name": "classify_x_to_y", "examples": []}, 400,
     "JSON Value: {\"signature_name\":\"classify_x_to_y\",\"examples\":[]} 'examples' value is an empty array"),
    ("half_plus_two", "regress", {"signature_name": "regress_x_to_y", "examples": [{"x": 1}]}, 400,
     "Name: <unknown>, Key: x, Index: 0.  Data types don't match. Data type: int64 but expected type: float"),
    ("module", "classify", {"signature_name": "multi", "examples": [{"x": 1.0}]}, 400, "Expected one input Tensor."),
    ("nope", "classify", {"examples": [{"x": 1.0}]}, 404, "Servable not found for request: Latest(nope)"),
], ids=["predict signature", "classify signature for regress", "unknown signature", "no examples",
        "int for a float feature", "two inputs", "unknown model"])
def test_rest_errors(server, model, verb, body, status, message):
    assert error(rest(server, model, verb, body), status) == message


def examples_input(*examples: example_pb2.Example, context: example_pb2.Example | None = None) -> input_pb2.Input:
    if context is None:
        return input_pb2.Input(example_list=input_pb2.ExampleList(examples=examples))
    return input_pb2.Input(example_list_with_context=input_pb2.ExampleListWithContext(
        examples=examples, context=context))


def test_grpc_classify_with_the_stock_stub(stub):
    request = classification_pb2.ClassificationRequest(input=examples_input(example(x=2.0), example(x=3.0)))
    request.model_spec.name = "half_plus_two"
    request.model_spec.signature_name = "classify_x_to_classes"
    response = stub.Classify(request, timeout=60)
    assert response.model_spec.name == "half_plus_two" and response.model_spec.version.value == 123
    assert response.model_spec.signature_name == "classify_x_to_classes"
    assert [[(c.label, c.score) for c in row.classes] for row in response.result.classifications] == [
        [("negative", 1.0), ("positive", 0.0)], [("negative", 0.5), ("positive", 0.5)]]


def test_grpc_regress_with_context(stub):
    request = regression_pb2.RegressionRequest(input=examples_input(example(x=2.0), example(x2=10.0),
                                                                    context=example(x=1.0, x2=4.0)))
    request.model_spec.name = "half_plus_two"
    request.model_spec.signature_name = "regress_x2_to_y3"
    response = stub.Regress(request, timeout=60)
    assert [r.value for r in response.result.regressions] == [5.0, 8.0]
    assert response.model_spec.signature_name == "regress_x2_to_y3"


def multi_request(*tasks: tuple[str, str, str]) -> inference_pb2.MultiInferenceRequest:
    request = inference_pb2.MultiInferenceRequest(input=examples_input(example(x=1.0), example(x=2.0)))
    for model, method, signature_name in tasks:
        task = request.tasks.add(method_name=method)
        task.model_spec.name = model
        task.model_spec.signature_name = signature_name
    return request


def test_grpc_multi_inference_runs_every_task_on_the_same_examples(stub):
    request = multi_request(("half_plus_two", REGRESS_METHOD, "regress_x_to_y"),
                            ("half_plus_two", REGRESS_METHOD, "regress_x_to_y2"),
                            ("half_plus_two", CLASSIFY_METHOD, "classify_x_to_y"))
    response = stub.MultiInference(request, timeout=60)
    assert [r.model_spec.signature_name for r in response.results] == [
        "regress_x_to_y", "regress_x_to_y2", "classify_x_to_y"]
    assert {r.model_spec.version.value for r in response.results} == {123}
    assert [[g.value for g in r.regression_result.regressions] for r in response.results[:2]] == [
        [2.5, 3.0], [3.5, 4.0]]
    assert [[(c.label, c.score) for c in row.classes]
            for row in response.results[2].classification_result.classifications] == [[("", 2.5)], [("", 3.0)]]


@pytest.mark.parametrize("tasks, code, message", [
    ((("half_plus_two", REGRESS_METHOD, "regress_x_to_y"), ("module", REGRESS_METHOD, "regress")),
     grpc.StatusCode.INVALID_ARGUMENT, "All ModelSpecs in a MultiInferenceRequest must access the same model name."),
    ((("half_plus_two", REGRESS_METHOD, "regress_x_to_y"), ("half_plus_two", CLASSIFY_METHOD, "regress_x_to_y")),
     grpc.StatusCode.INVALID_ARGUMENT, "Duplicate evaluation of signature: regress_x_to_y"),
    ((("half_plus_two", REGRESS_METHOD, "regress_x_to_y"), ("", REGRESS_METHOD, "regress_x_to_y2")),
     grpc.StatusCode.INVALID_ARGUMENT, "Found ModelSpec with an empty model name."),
    ((("half_plus_two", REGRESS_METHOD, "nope"),),
     grpc.StatusCode.INVALID_ARGUMENT, "Requested signature not found in model graph: nope"),
    ((("half_plus_two", "tensorflow/serving/predict", "serving_default"),),
     grpc.StatusCode.UNIMPLEMENTED, "Unsupported signature method_name: tensorflow/serving/predict"),
    ((("nope", REGRESS_METHOD, "regress"),), grpc.StatusCode.NOT_FOUND, "Servable not found for request: Latest(nope)"),
], ids=["two models", "one signature twice", "no model name", "unknown signature", "predict task", "unknown model"])
def test_grpc_multi_inference_errors(stub, tasks, code, message):
    with pytest.raises(grpc.RpcError) as info:
        stub.MultiInference(multi_request(*tasks), timeout=60)
    assert (info.value.code(), info.value.details()) == (code, message)


def test_grpc_errors(stub):
    empty = regression_pb2.RegressionRequest()
    empty.model_spec.name = "half_plus_two"
    empty.model_spec.signature_name = "regress_x_to_y"
    with pytest.raises(grpc.RpcError) as info:
        stub.Regress(empty, timeout=60)
    assert (info.value.code(), info.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, "Input is empty.")
    request = classification_pb2.ClassificationRequest(input=examples_input(example(x=1.0)))
    request.model_spec.name = "module"
    request.model_spec.signature_name = "regress"
    with pytest.raises(grpc.RpcError) as info:
        stub.Classify(request, timeout=60)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith('Expected classification signature outputs to contain at least one of')


def batch_sizes(server, model: str) -> tuple[int, int]:
    """How many batches the model ran, and how many of them held one row only."""
    text = requests.get(f"{server.rest_url}/monitoring/prometheus/metrics", timeout=30).text
    labels = f'{{model_name="{model}"'
    total = re.search(rf'^{BATCH_SIZE_METRIC}_count{labels}}} (\S+)$', text, re.M)
    single = re.search(rf'^{BATCH_SIZE_METRIC}_bucket{labels},le="1"}} (\S+)$', text, re.M)
    return (int(float(total.group(1))), int(float(single.group(1)))) if total else (0, 0)


@pytest.mark.parametrize("model, signature_name", [("half_plus_two", "regress_x_to_y"), ("module", "regress")])
def test_concurrent_regressions_merge_into_batches(server, model, signature_name):
    before = batch_sizes(server, model)

    def send(i: int) -> tuple[int, dict]:
        return i, ok(rest(server, model, "regress", {"signature_name": signature_name, "examples": [{"x": float(i)}]}))
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        answers = dict(pool.map(send, range(12)))
    assert answers == {i: {"results": [0.5 * i + 2]} for i in range(12)}, "each request gets its own row back"
    total, single = batch_sizes(server, model)
    assert total - single > before[0] - before[1], "the requests should have run in merged batches"
    assert total - before[0] < 12


# --- warmup records over tf.Examples ------------------------------------------------------------------------------

def write_warmup(version_dir: str, logs: list[prediction_log_pb2.PredictionLog]) -> None:
    os.makedirs(f"{version_dir}/assets.extra", exist_ok=True)
    with tf.io.TFRecordWriter(f"{version_dir}/{WARMUP_FILE}") as writer:
        for log in logs:
            writer.write(log.SerializeToString())


def warmup_logs(regress_signature: str) -> list[prediction_log_pb2.PredictionLog]:
    examples = examples_input(example(x=1.0), example(x=2.0))
    classify = classification_pb2.ClassificationRequest(input=examples)
    classify.model_spec.signature_name = "classify_x_to_classes"
    regress = regression_pb2.RegressionRequest(input=examples)
    regress.model_spec.signature_name = regress_signature
    multi = multi_request(("m", REGRESS_METHOD, "regress_x_to_y"), ("m", CLASSIFY_METHOD, "classify_x_to_y"))
    return [prediction_log_pb2.PredictionLog(classify_log=prediction_log_pb2.ClassifyLog(request=classify)),
            prediction_log_pb2.PredictionLog(regress_log=prediction_log_pb2.RegressLog(request=regress)),
            prediction_log_pb2.PredictionLog(
                multi_inference_log=prediction_log_pb2.MultiInferenceLog(request=multi))]


def test_classify_regress_and_multi_inference_warmup_records_are_replayed(tmp_path):
    version_dir = os.path.join(tf1_half_plus_two(str(tmp_path / "m"), versions=("1",)), "1")
    write_warmup(version_dir, warmup_logs("regress_x_to_y2"))
    metrics = Metrics()
    assert Servable("m", 1, version_dir).warmup(metrics) == 3
    write_warmup(version_dir, warmup_logs("classify_x_to_classes"))  # two outputs: no regression signature
    with pytest.raises(ServingError, match=r"^Expected one output Tensor\.$"):
        Servable("m", 1, version_dir).warmup(metrics)
    write_warmup(version_dir, [prediction_log_pb2.PredictionLog(session_run_log=prediction_log_pb2.SessionRunLog())])
    with pytest.raises(ValueError, match=r"^Unsupported log_type for warmup: session_run_log$"):
        Servable("m", 1, version_dir).warmup(metrics)


def test_serialized_examples_and_text_count_no_pixels():
    """The pixel budget is for images: tf.Examples and text that merely start like a BMP count 0."""
    values = np.concatenate([serialized_examples(examples_input(example(x=1.0), example(image=b"\x89PNG"))),
                             np.array([b"BMW and other text, long enough", b"RIFF....WEBP but no image"], object)])
    assert check_pixels(values, 1).tolist() == [0, 0, 0, 0]
