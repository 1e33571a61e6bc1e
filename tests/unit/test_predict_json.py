"""REST Predict's JSON as TF Serving writes and reads it, without a model: float32 written as TF Serving's C++ writes
it (six digits, or nine when six do not read back) with NaN and Infinity, every dtype in row and columnar form, the
batch check of rows, and JSON values that must fit the input's dtype (the same on a real server is
tests/e2e/test_predict_formats.py)."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from serving.core import ServingError, TensorInfo
from serving.core.dataplane import coerce
from serving.protocols.codec.tfserving_json import encode_predict, predict_response


def tf_serving_text(value: float) -> str:
    """util/json_tensor.cc WriteDecimal for a float32, as TF Serving's C++ runs it: absl::StrCat's six significant
    digits, %.9g when those do not read back as the same float32, ".0" after a number with neither "." nor "e"."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "-Infinity" if value < 0 else "Infinity"
    text = f"{value:.6g}"
    if np.float32(text) != np.float32(value):
        text = f"{value:.9g}"
    return text if "." in text or "e" in text else text + ".0"


def test_float32_is_written_as_tf_servings_own_tests_expect_with_nan_and_infinity():
    """json_tensor_test.cc FromJsonSingleFloatTensorSixDigitPrecision and ...NonFinite, and the 9-digit case:
    read as doubles, TF Serving's 0.333333343 for a third is not the shortest decimal's 0.33333334."""
    six_digits = np.array([[9000000, 999999, 0.5], [0.0003, 0.00003, 555557.5]], np.float32)
    assert json.loads(encode_predict({"y": six_digits}, row_format=True)) == json.loads(
        '{"predictions": [[9e+06, 999999.0, 0.5], [0.0003, 3e-05, 555557.5]]}')
    outputs = {"y": np.array([0.1, 2.05, np.nan, np.inf, -np.inf, 3.0, 1 / 3, -0.0], np.float32)}
    assert encode_predict(outputs, row_format=True) == (
        b'{"predictions":[0.1,2.05,NaN,Infinity,-Infinity,3.0,0.333333343,-0.0]}')
    assert encode_predict({"h": np.array([[0.1]], np.float16)}, row_format=False) == b'{"outputs":[[0.1]]}'


@pytest.mark.parametrize("size", [5, 4000])  # Python's formatting for a few values, numpy's arithmetic for more
def test_float32_of_every_exponent_and_layout_reads_back_as_tf_servings_text(size):
    rng = np.random.default_rng(size)
    values = rng.integers(0, 2**32, size, dtype=np.uint64).astype(np.uint32).view(np.float32).copy()
    values[:5] = [0.1, 3.4028235e38, 1e-45, -1 / 3, 0.0]  # the largest float32, the smallest subnormal
    grid = values.reshape(size // 5, 5).T  # not C-contiguous
    got = json.loads(encode_predict({"y": grid}, row_format=False))["outputs"]
    expected = json.loads("[" + ",".join("[" + ",".join(map(tf_serving_text, row.tolist())) + "]" for row in grid)
                          + "]")
    assert np.array_equal(np.array(got), np.array(expected), equal_nan=True)
    assert np.array_equal(np.signbit(np.array(got)), np.signbit(np.array(expected)))
    assert np.array_equal(np.array(predict_response({"y": grid}, row_format=False)["outputs"]), np.array(got),
                          equal_nan=True)  # the Python values, as the batch jobs and the NaN path write them


def test_classify_scores_and_regress_values_are_tf_servings_too():
    from serving.core import Result
    from serving.protocols.codec.tfserving_json import encode_results
    assert encode_results(Result("tensorflow/serving/regress", "", regressions=[1 / 3, 2.5])) == (
        b'{"results":[0.333333343,2.5]}')
    assert encode_results(Result("tensorflow/serving/classify", "", classifications=[[("a", 2 / 3), ("b", 1.0)]])) \
        == b'{"results":[[["a",0.666666687],["b",1.0]]]}'


def test_rows_need_every_output_batched_alike():
    with pytest.raises(ServingError, match=r"^Tensor name: b has inconsistent batch size: 1 expecting: 2$"):
        predict_response({"a": np.zeros(2), "b": np.zeros(1)}, row_format=True)
    with pytest.raises(ServingError, match=r"^Tensor name: a has no shape information $"):
        predict_response({"a": np.float32(1.0)}, row_format=True)
    assert predict_response({"a": np.float32(1.0)}, row_format=False) == {"outputs": 1.0}


def test_every_json_dtype_in_rows_and_columns():
    outputs = {"flag": np.array([True, False]), "small": np.array([1, 255], np.uint8),
               "big": np.array([-(1 << 62), 1 << 62], np.int64), "double": np.array([0.1, 1e300]),
               "text": np.array([b"a", "é".encode()], dtype=object)}
    assert predict_response(outputs, row_format=False) == {"outputs": {
        "flag": [True, False], "small": [1, 255], "big": [-(1 << 62), 1 << 62], "double": [0.1, 1e300],
        "text": ["a", "é"]}}
    assert predict_response(outputs, row_format=True)["predictions"][1] == {
        "flag": False, "small": 255, "big": 1 << 62, "double": 1e300, "text": "é"}


@pytest.mark.parametrize("dtype, value, message", [
    ("DT_BOOL", [1], "Input 'v' expects DT_BOOL: got int64 values, not of expected type: bool"),
    ("DT_INT32", [2.0], "Input 'v' expects DT_INT32: got float64 values, not of expected type: int32"),
    ("DT_UINT8", [256], "Input 'v' expects DT_UINT8: values out of range of uint8"),
    ("DT_INT8", [-129], "Input 'v' expects DT_INT8: values out of range of int8"),
    ("DT_FLOAT", [False], "Input 'v' expects DT_FLOAT: got bool values, not of expected type: float"),
], ids=["int for bool", "float for int32", "past uint8", "below int8", "bool for float"])
def test_json_values_must_fit_the_dtype_as_in_tf_serving(dtype, value, message):
    with pytest.raises(ServingError) as error:
        coerce("v", value, TensorInfo("v", dtype, [-1]))
    assert error.value.message == message


def test_values_that_fit_are_converted():
    assert coerce("v", [True], TensorInfo("v", "DT_BOOL", [-1])).dtype == np.bool_
    assert coerce("v", [1, 2], TensorInfo("v", "DT_FLOAT", [-1])).tolist() == [1.0, 2.0]
    assert coerce("v", [255], TensorInfo("v", "DT_UINT8", [-1])).dtype == np.uint8
    assert coerce("v", [], TensorInfo("v", "DT_INT32", [-1])).shape == (0,)
    assert coerce("v", [[1.0]], TensorInfo("v", "DT_FLOAT", [-1]), static_shapes=False).shape == (1, 1)


@pytest.mark.filterwarnings("error")
def test_a_number_past_float32_is_infinity_without_a_warning():
    """TF Serving takes a DT_FLOAT value with RapidJSON's GetFloat(), a cast: 1e300 is inf there too, and numpy's
    overflow warning would reach the server's stderr outside its structured log."""
    assert coerce("v", [1e300, -1e300, 1.5], TensorInfo("v", "DT_FLOAT", [-1])).tolist() == [
        float("inf"), float("-inf"), 1.5]
    assert coerce("v", [1e300], TensorInfo("v", "DT_HALF", [-1])).tolist() == [float("inf")]


def test_orjson_writes_the_answer_with_the_values_of_the_python_path():
    """encode_predict writes most answers straight from the arrays with orjson: the same JSON values as through
    to_json's Python values, for every dtype it takes, both layouts and floats of every magnitude."""
    rng = np.random.default_rng(1)
    floats = (rng.standard_normal(600) * 10.0 ** rng.integers(-45, 38, 600)).reshape(200, 3)
    outputs = {"p": floats.astype(np.float32), "d": floats, "i": rng.integers(-9, 9, 200).astype(np.int32),
               "u": np.arange(200, dtype=np.uint64) << 57, "b": rng.random(200) > 0.5,
               "class": np.array([f"c{i}".encode() for i in range(200)], dtype=object),
               "image_bytes": np.array([b"\xff\xd8"] * 200, dtype=object)}
    for row_format in (True, False):
        for names in (["p"], ["p", "class"], list(outputs)):
            chosen = {k: outputs[k] for k in names}
            assert json.loads(encode_predict(chosen, row_format)) == predict_response(chosen, row_format)
    assert encode_predict({"p": np.array([[0.2, 3.3e-6]], np.float32), "c": np.array([b"roses"], dtype=object)},
                          row_format=True) == b'{"predictions":[{"p":[0.2,3.3e-6],"c":"roses"}]}'
