"""Triton's classification extension (serving/protocols/codec/v2_tensors.py `classification`), which V2 REST and
gRPC share, on the shapes a model's outputs can have. tests/e2e/test_grpc_fuzz.py found the empty batch: a ModelInfer
of zero images asking for classification of `probabilities` [0, 5] answered INTERNAL (reshape cannot infer a row's width
from no elements)."""
from __future__ import annotations

import numpy as np
import pytest

from serving.core import Code, ServingError
from serving.protocols.codec.v2_tensors import classification, output


def test_an_empty_batch_classifies_to_no_rows():
    assert classification(np.zeros((0, 5), np.float32), 2, ["a", "b"]).shape == (0, 2)
    assert classification(np.zeros((0, 0), np.float32), 2, []).shape == (0, 0)


def test_each_row_gives_its_top_count_with_labels_where_there_are_some():
    top = classification(np.array([[0.1, 0.7, 0.2], [0.5, 0.2, 0.3]], np.float32), 2, ["a", "b"])
    assert top.tolist() == [[b"0.700000:1:b", b"0.200000:2"], [b"0.500000:0:a", b"0.300000:2"]]


def test_a_row_is_everything_past_the_batch_dimension():
    """Scores [2, 3, 4] are two rows of twelve classes, answered [2, count] (reshaping to [2, 3, count], as it
    was, failed for any middle dimension past one)."""
    top = classification(np.arange(24, dtype=np.float32).reshape(2, 3, 4), 2, [])
    assert top.tolist() == [[b"11.000000:11", b"10.000000:10"], [b"23.000000:11", b"22.000000:10"]]


def test_scores_without_a_batch_dimension_are_one_row_of_count():
    assert classification(np.array([0.2, 0.8], np.float32), 5, ["a", "b"]).tolist() == [b"0.800000:1:b",
                                                                                     b"0.200000:0:a"]


def test_a_model_that_does_not_batch_is_ranked_over_its_whole_output():
    """extension_classification.md's own example: a model without batching whose output is [1.1, 3.3, 0.5, 2.4]
    in shape [2, 2] answers ["3.3:1", "2.4:3"] in shape [2], where each row was ranked apart."""
    scores = np.array([[1.1, 3.3], [0.5, 2.4]], np.float32)
    assert classification(scores, 2, [], batched=False).tolist() == [b"3.300000:1", b"2.400000:3"]
    assert classification(scores, 2, []).shape == (2, 2)


def test_integer_scores_are_written_as_integers_as_triton_writes_them():
    """Triton writes a score as std::to_string of the output's type (classification.cc): 3, not 3.000000."""
    top = output(np.array([[3, 1, 7]], np.int32), 2, ["a", "b", "c"], "n", lambda: True)
    assert top.tolist() == [[b"7:2:c", b"3:0:a"]]
    unsigned = output(np.array([[1, 250]], np.uint8), 1, [], "u", lambda: True)
    assert unsigned.tolist() == [[b"250:1"]]


@pytest.mark.parametrize("array, datatype", [
    (np.array([[True, False]]), "BOOL"), (np.array([[0.5, 0.25]], np.float16), "FP16"),
    (np.array([[b"a", b"b"]], dtype=object), "BYTES")], ids=["bool", "fp16", "bytes"])
def test_an_output_triton_cannot_rank_is_a_400_not_a_500(array, datatype):
    """A BOOL output reached numpy's argsort of its negation, a TypeError: 500 and a traceback in the log per
    request. Triton ranks integer and FP32/FP64 outputs only."""
    with pytest.raises(ServingError) as error:
        output(array, 1, [], "b", lambda: True)
    assert error.value.code == Code.INVALID_ARGUMENT
    assert error.value.message == f"Output 'b': class result not available for output due to unsupported type " \
                                  f"'{datatype}'"
