"""Which signatures batch (serving/core/batchable.py), decided from their declared shapes and a probe batch."""
import numpy as np
import pytest

from exported_models.model_format import SignatureInfo, TensorInfo
from serving.core.batchable import unbatched_reason
from serving.core.errors import invalid


def signature(inputs: dict[str, tuple[str, list[int] | None]], outputs: dict[str, list[int] | None]) -> SignatureInfo:
    return SignatureInfo({k: TensorInfo(f"{k}:0", dtype, shape) for k, (dtype, shape) in inputs.items()},
                         {k: TensorInfo(f"{k}:0", "DT_FLOAT", shape) for k, shape in outputs.items()},
                         "tensorflow/serving/predict")


class Model:
    """Records the probes it is given and answers with `answer(inputs)`."""

    def __init__(self, answer):
        self.answer = answer
        self.probes = []

    def __call__(self, inputs):
        self.probes.append(inputs)
        return self.answer(inputs)


def follows(inputs):
    return {"y": inputs["x"] * 2}


@pytest.mark.parametrize("inputs, outputs, reason", [
    ({"x": ("DT_FLOAT", None)}, {"y": [-1]}, "input x has an unknown rank"),
    ({"x": ("DT_FLOAT", [])}, {"y": [-1]}, "input x is a scalar"),
    ({"x": ("DT_FLOAT", [1])}, {"y": [1]}, "input x fixes dimension 0 to 1"),
    ({"x": ("DT_FLOAT", [-1, 1])}, {"y": []}, "output y is a scalar"),
    ({"x": ("DT_FLOAT", [-1, 1])}, {"y": [4, 2]}, "output y fixes dimension 0 to 4"),
    ({}, {"y": [-1]}, "it has no inputs"),
])
def test_declared_shapes_that_cannot_batch_decide_without_running_the_model(inputs, outputs, reason):
    model = Model(follows)
    assert unbatched_reason(signature(inputs, outputs), model) == reason
    assert model.probes == []


def test_numeric_inputs_are_probed_with_two_rows_of_zeros_and_the_outputs_must_follow():
    info = signature({"x": ("DT_FLOAT", [-1, 3]), "ids": ("DT_INT64", [-1, -1])}, {"y": None})
    model = Model(follows)
    assert unbatched_reason(info, model) is None
    [probe] = model.probes
    assert {k: (v.dtype, v.shape) for k, v in probe.items()} == {"x": (np.float32, (2, 3)), "ids": (np.int64, (2, 1))}
    assert unbatched_reason(info, Model(lambda inputs: {"y": np.float32(1.0)})) == \
        "output y has shape [] for a batch of 2"
    assert unbatched_reason(info, Model(lambda inputs: {"y": np.zeros((1, 3))})) == \
        "output y has shape [1, 3] for a batch of 2"


def test_without_a_probe_the_declared_output_shapes_decide():
    strings = Model(follows)  # an empty string is rarely a valid input: strings are not probed
    assert unbatched_reason(signature({"x": ("DT_STRING", [-1])}, {"y": [-1, 5]}), strings) is None
    assert unbatched_reason(signature({"x": ("DT_STRING", [-1])}, {"y": None}), strings) == \
        "output y has an unknown rank"
    assert strings.probes == []

    def refuses(inputs):
        raise invalid("zeros are no valid input")
    assert unbatched_reason(signature({"x": ("DT_FLOAT", [-1])}, {"y": [-1]}), Model(refuses)) is None
    assert unbatched_reason(signature({"x": ("DT_FLOAT", [-1])}, {"y": None}), Model(refuses)) == \
        "output y has an unknown rank"
