"""Triton's classification extension (serving/protocols/codec/v2_tensors.py `classification`), which V2 REST and
gRPC share, on the shapes a model's outputs can have. tests/e2e/test_grpc_fuzz.py found the empty batch: a ModelInfer
of zero images asking for classification of `probabilities` [0, 5] answered INTERNAL (reshape cannot infer a row's width
from no elements)."""
from __future__ import annotations

import numpy as np

from serving.protocols.codec.v2_tensors import classification


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
