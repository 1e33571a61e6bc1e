"""The tf.Example conversion of Classify and Regress, without a model, against the rules of TF Serving's
json_tensor.cc and util.cc: JSON features into the lists TF Serving builds, the context merged first, its errors,
and the signature and result checks (the same calls on real models and a real server are
tests/e2e/test_classify_regress.py)."""
from __future__ import annotations

import numpy as np
import pytest
from tensorflow.core.example import example_pb2
from tensorflow_serving.apis import input_pb2

from serving.core import ServingError, SignatureInfo, TensorInfo
from serving.core.examples import (
    CLASSIFY_METHOD,
    REGRESS_METHOD,
    check_signature,
    classifications,
    regressions,
    serialized_examples,
)
from serving.protocols.codec.tfserving_json import input_from_json


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
