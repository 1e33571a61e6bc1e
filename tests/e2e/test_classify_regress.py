"""Classify, Regress and MultiInference on SavedModels exported elsewhere, against TF Serving's documented answers.

The TF1 graph is TF Serving's half_plus_two as its generator builds it (exported_models/tf_serving_models.py:
y = 0.5 x + 2, y2 = 0.5 x + 3), the TF1 classifier (tests/foreign_models.py) answers class names from an asset, and
the TF2 tf.Module has classify and regress signatures whose method name is "predict", as `tf.saved_model.save` writes
them. One `petal serve` serves the three over REST and gRPC, with batching on. The tf.Example conversion's own checks
are tests/unit/test_tf_example_json.py, and the warmup records tests/inprocess/test_example_requests.py.
"""
from __future__ import annotations

import concurrent.futures
import re

import grpc
import pytest
import requests
from tensorflow_serving.apis import classification_pb2, regression_pb2

from exported_models.tf_serving_models import half_plus_two
from foreign_models import CLASS_NAMES, example, examples_input, multi_request, tf1_classifier, tf2_module
from server_harness import run_server
from serving.core.examples import CLASSIFY_METHOD, REGRESS_METHOD

BATCH_SIZE_METRIC = ":tensorflow:serving:batching_session:processed_batch_size"


# --- a real server: TF1 and TF2 models, REST and gRPC -----------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The TF1 models in zero-padded version folders and the TF2 module, with a 50 ms batch window and one batch
    thread, so concurrent requests merge."""
    root = tmp_path_factory.mktemp("foreign")
    half_plus_two(str(root / "tf1" / "00000123"))
    tf1_classifier(str(root / "classifier" / "00000001"))
    tf2_module(str(root / "tf2"))
    config = root / "models.config"
    config.write_text("model_config_list { "
                      f'config {{ name: "half_plus_two" base_path: "{root / "tf1"}" model_platform: "tensorflow" }} '
                      f'config {{ name: "classifier" base_path: "{root / "classifier"}" '
                      'model_platform: "tensorflow" } '
                      f'config {{ name: "module" base_path: "{root / "tf2"}" model_platform: "tensorflow" }} }}')
    batching = root / "batching.config"
    batching.write_text("max_batch_size { value: 32 } batch_timeout_micros { value: 50000 } "
                        "num_batch_threads { value: 1 }")
    with run_server(f"--model_config_file={config}", "--enable_batching",
                    f"--batching_parameters_file={batching}") as srv:
        yield srv


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
    body = {"examples": [{"x": 2.0}, {"x": 3.0}, {"x": 10.0}]}
    negative, positive = CLASS_NAMES
    assert ok(rest(server, "classifier", "classify", body)) == {"results": [
        [[negative, 1.0], [positive, 0.0]], [[negative, 0.5], [positive, 0.5]], [[negative, 0.0], [positive, 1.0]]]}


def test_rest_regress_gives_tf_servings_documented_answer(server):
    """g3doc/api_rest.md: half_plus_three regresses 1.0 and 2.0 to 3.5 and 4.0."""
    body = {"signature_name": "regress_x_to_y2", "examples": [{"x": 1.0}, {"x": 2.0}]}
    assert ok(rest(server, "half_plus_two", "regress", body)) == {"results": [3.5, 4.0]}
    body["signature_name"] = "regress_x_to_y"
    assert ok(rest(server, "half_plus_two", "regress", body)) == {"results": [2.5, 3.0]}


def test_rest_context_is_merged_into_every_example(server):
    """y = 0.5 x + 2: the first example takes x from the context, the second overrides it."""
    body = {"signature_name": "regress_x_to_y", "context": {"x": 1.0, "x2": 4.0},
            "examples": [{"x2": 10.0}, {"x": 2.0}]}
    assert ok(rest(server, "half_plus_two", "regress", body)) == {"results": [2.5, 3.0]}


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
    ("classifier", "regress", {"examples": [{"x": 1.0}]}, 400, "Expected one output Tensor."),
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


def test_grpc_classify_with_the_stock_stub(stub):
    request = classification_pb2.ClassificationRequest(input=examples_input(example(x=2.0), example(x=3.0)))
    request.model_spec.name = "classifier"
    response = stub.Classify(request, timeout=60)
    assert response.model_spec.name == "classifier" and response.model_spec.version.value == 1
    assert response.model_spec.signature_name == "serving_default"
    assert [[(c.label, c.score) for c in row.classes] for row in response.result.classifications] == [
        [("negative", 1.0), ("positive", 0.0)], [("negative", 0.5), ("positive", 0.5)]]


def test_grpc_regress_with_context(stub):
    request = regression_pb2.RegressionRequest(input=examples_input(example(x2=10.0), example(x=2.0),
                                                                    context=example(x=1.0, x2=4.0)))
    request.model_spec.name = "half_plus_two"
    request.model_spec.signature_name = "regress_x_to_y2"
    response = stub.Regress(request, timeout=60)
    assert [r.value for r in response.result.regressions] == [3.5, 4.0]
    assert response.model_spec.signature_name == "regress_x_to_y2"


def example_counts(server) -> tuple[float, float]:
    """TF Serving's request_example_count_total and request_example_counts' count for half_plus_two (0 before any)."""
    text = requests.get(f"{server.rest_url}/monitoring/prometheus/metrics", timeout=30).text
    found = [re.search(rf'^:tensorflow:serving:{name}{{model="half_plus_two"}} (\S+)$', text, re.M)
             for name in ("request_example_count_total", "request_example_counts_count")]
    return tuple(float(m.group(1)) if m else 0.0 for m in found)  # type: ignore[return-value]


def test_grpc_multi_inference_runs_every_task_on_the_same_examples(server, stub):
    request = multi_request(("half_plus_two", REGRESS_METHOD, "regress_x_to_y"),
                            ("half_plus_two", REGRESS_METHOD, "regress_x_to_y2"),
                            ("half_plus_two", CLASSIFY_METHOD, "classify_x_to_y"))
    examples_before, requests_before = example_counts(server)
    response = stub.MultiInference(request, timeout=60)
    # TF Serving counts a MultiInference's examples once, however many tasks (multi_inference.cc).
    assert example_counts(server) == (examples_before + 2, requests_before + 1)
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
