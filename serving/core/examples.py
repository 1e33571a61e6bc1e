"""Classify, Regress and MultiInference over serialized tf.Examples, with TF Serving's rules and error texts.

TF Serving feeds such a signature one DT_STRING vector of serialized `tf.Example`s. It picks the signature by its
inputs and outputs, not its method name (as `tensorflow_model_server` does unless
--enable_signature_method_name_check), so a TF2 model whose every signature says "predict" still classifies when
its one input is `inputs` and its outputs are `classes`/`scores` (classify) or `outputs` (regress). With a
context, each example is the context's bytes followed by its own: protobuf merges concatenated messages, so an
example's feature overrides the context's feature of the same name, exactly as TF Serving's
InputToSerializedExampleTensor does. (The REST form's JSON examples become tf.Examples in the TF Serving JSON codec,
serving/protocols/codec/tfserving_json.py.)

No model runs here (numpy and protos), so the dataplane and the warmup replay both use it.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
from tensorflow.core.example import example_pb2
from tensorflow_serving.apis import input_pb2

from exported_models.model_format import DEFAULT_SIGNATURE, SignatureInfo, dtype_name
from serving.core.errors import Code, ServingError, invalid
from serving.memory_costs import EXAMPLE_BYTES

CLASSIFY_METHOD = "tensorflow/serving/classify"
REGRESS_METHOD = "tensorflow/serving/regress"
INPUTS = "inputs"
CLASSES = "classes"
SCORES = "scores"
OUTPUTS = "outputs"


@dataclass(frozen=True)
class Task:
    """One Classify or Regress on a signature (empty: serving_default)."""
    method: str
    signature_name: str = ""

    @property
    def key(self) -> str:
        return self.signature_name or DEFAULT_SIGNATURE


@dataclass
class Result:
    """What one task answered: per example, (label, score) pairs for classify, or one value for regress."""
    method: str
    signature_name: str
    classifications: list[list[tuple[str, float]]] | None = None
    regressions: list[float] | None = None


# --- signatures -----------------------------------------------------------------------------------------------

def _describe(info: SignatureInfo) -> str:
    return f"inputs {sorted(info.inputs)}, outputs {sorted(info.outputs)}, method_name {info.method_name!r}"


def check_signature(method: str, info: SignatureInfo) -> None:
    """TF Serving's checks of a classify or regress signature's structure (PreProcessClassification and
    PreProcessRegression, without --enable_signature_method_name_check); UNIMPLEMENTED for any other method."""
    if method not in (CLASSIFY_METHOD, REGRESS_METHOD):
        raise ServingError(Code.UNIMPLEMENTED, f"Unsupported signature method_name: {method}")
    if len(info.inputs) != 1:
        raise invalid("Expected one input Tensor.")
    if method == CLASSIFY_METHOD:
        if len(info.outputs) not in (1, 2):
            raise invalid(f"Expected one or two output Tensors, found {len(info.outputs)}")
        if INPUTS not in info.inputs:
            raise invalid(f"No classification inputs found in SignatureDef: {_describe(info)}")
        if CLASSES not in info.outputs and SCORES not in info.outputs:
            raise invalid(f"Expected classification signature outputs to contain at least one of \"{CLASSES}\" "
                          f"or \"{SCORES}\". Signature was: {_describe(info)}")
        return
    if len(info.outputs) != 1:
        raise invalid("Expected one output Tensor.")
    if INPUTS not in info.inputs:
        raise invalid(f"No regression inputs found in SignatureDef: {_describe(info)}")
    if OUTPUTS not in info.outputs:
        raise invalid(f"No regression outputs found in SignatureDef: {_describe(info)}")


def fed_as_serialized(info: SignatureInfo) -> SignatureInfo:
    """The signature as its examples are fed: its `inputs` a DT_STRING of serialized tf.Examples, whatever dtype it
    declares. TF Serving feeds that tensor by name as strings and never reads the declared dtype (regressor.cc
    and classifier.cc into util.cc PerformOneShotTensorComputation), and its own saved_model_half_plus_three,
    the model of api_rest.md's example, declares DT_FLOAT for a string placeholder: converted to the declared
    dtype, the example's regress was refused."""
    tensor = info.inputs[INPUTS]
    if tensor.dtype == "DT_STRING":
        return info
    return replace(info, inputs={INPUTS: replace(tensor, dtype="DT_STRING")})


def check_tasks(tasks: list[Task]) -> None:
    """MultiInference's rules on its tasks (one model is checked by the caller): distinct signatures."""
    seen: set[str] = set()
    for task in tasks:
        if task.key in seen:
            raise invalid(f"Duplicate evaluation of signature: {task.key}")
        seen.add(task.key)


# --- inputs ---------------------------------------------------------------------------------------------------

def _examples(request_input: input_pb2.Input) -> tuple[bytes, Sequence[example_pb2.Example]]:
    """The context's bytes and the examples, left in the message: a request of millions of empty examples is
    charged (serialized_examples) before a Python object is made for any."""
    kind = request_input.WhichOneof("kind")
    if kind == "example_list":
        return b"", request_input.example_list.examples
    if kind == "example_list_with_context":
        with_context = request_input.example_list_with_context
        return with_context.context.SerializeToString(), with_context.examples
    return b"", []


def serialized_examples(request_input: input_pb2.Input, charge: Callable[[int], None] | None = None) -> np.ndarray:
    """The DT_STRING vector TF Serving feeds: each example serialized, after the context's bytes if any.

    The context is sent once and copied into every example, so a request of a few hundred KB can ask for gigabytes
    (a 256 KB context and 4000 empty examples: 1 GB). With `charge` (a hold on the worker's memory budget), what
    the vector and the call on it hold is charged before any copy is made, and a request that does not fit is
    refused: every example's bytes twice (the vector's strings, then TensorFlow's copy of them or, for an image
    classifier, the examples parsed again for their images) and EXAMPLE_BYTES of Python objects for each."""
    context, examples = _examples(request_input)
    if not examples:
        raise invalid("Input is empty.")
    if charge is not None:
        charge(2 * (len(examples) * (len(context) + EXAMPLE_BYTES) + request_input.ByteSize()))
    return np.array([context + example.SerializeToString() for example in examples], dtype=object)


# --- results --------------------------------------------------------------------------------------------------

def _shape(array: np.ndarray) -> str:
    return "[" + ",".join(str(d) for d in array.shape) + "]"


def _dtype_name(array: np.ndarray) -> str:
    """TF's name of an output's dtype (DT_DOUBLE, not float64), as TF Serving's messages print it."""
    return "DT_STRING" if array.dtype == object else dtype_name(array.dtype)


def _matrix(array: np.ndarray, what: str, kind: str, rows: int) -> None:
    if array.ndim != 2:
        raise invalid(f"Expected Tensor shape: [batch_size num_classes] but got {_shape(array)}")
    if (array.dtype == object) != (kind == "DT_STRING") or (kind == "DT_FLOAT" and array.dtype != np.float32):
        raise invalid(f"Expected {what} Tensor of {kind}. Got: {_dtype_name(array)}")
    if array.shape[0] != rows:
        raise invalid(f"Expected {what} output batch size of {rows}. Got: {array.shape[0]}")


def classifications(outputs: dict[str, np.ndarray], rows: int) -> list[list[tuple[str, float]]]:
    """Per example, a (label, score) per class: label "" without a classes output, score 0 without scores (TF
    Serving's PostProcessClassificationResult)."""
    classes, scores = outputs.get(CLASSES), outputs.get(SCORES)
    if classes is not None:
        _matrix(classes, "classes", "DT_STRING", rows)
    if scores is not None:
        _matrix(scores, "scores", "DT_FLOAT", rows)
    if classes is not None and scores is not None and classes.shape[1] != scores.shape[1]:
        raise invalid(f"Tensors class and score should match in dim_size(1). Got {classes.shape[1]} vs. "
                      f"{scores.shape[1]}")
    first = classes if classes is not None else scores
    assert first is not None, "check_signature asks for classes or scores"
    count = first.shape[1]
    labels = ([[v.decode("utf-8", "replace") for v in row] for row in classes] if classes is not None
              else [[""] * count] * rows)
    values = scores.tolist() if scores is not None else [[0.0] * count] * rows
    return [list(zip(label_row, score_row, strict=False))
            for label_row, score_row in zip(labels, values, strict=False)]


def regressions(outputs: dict[str, np.ndarray], rows: int) -> list[float]:
    """One value per example from a [batch] or [batch, 1] DT_FLOAT output (PostProcessRegressionResult)."""
    values = outputs[OUTPUTS]
    if not (values.ndim == 1 or (values.ndim == 2 and values.shape[1] == 1)):
        raise invalid(f"Expected output Tensor shape to be either [batch_size] or [batch_size, 1] but got "
                      f"{_shape(values)}")
    if values.shape[0] != rows:
        raise invalid(f"Input batch size did not match output batch size: {rows} vs. {values.shape[0]}")
    if values.dtype != np.float32:
        raise invalid(f"Expected output Tensor of DT_FLOAT.  Got: {_dtype_name(values)}")
    return values.reshape(-1).tolist()


def result(task: Task, outputs: dict[str, np.ndarray], rows: int) -> Result:
    if task.method == CLASSIFY_METHOD:
        return Result(task.method, task.key, classifications=classifications(outputs, rows))
    return Result(task.method, task.key, regressions=regressions(outputs, rows))


def example_images(serialized: np.ndarray, feature: str) -> list[bytes]:
    """The encoded image of each example for an image classifier: its one-value bytes feature `feature`, or its
    only one-value bytes feature. `serialized` is what serialized_examples made, the context already merged in."""
    images = []
    for i, example in enumerate(example_pb2.Example.FromString(data) for data in serialized):
        features = {k: f.bytes_list.value for k, f in example.features.feature.items()
                    if f.WhichOneof("kind") == "bytes_list" and len(f.bytes_list.value) == 1}
        value = features.get(feature) or (next(iter(features.values())) if len(features) == 1 else None)
        if value is None:
            raise invalid(f"Example {i} needs one bytes feature {feature!r} holding the encoded image "
                          "(over REST: {\"b64\": ...})")
        images.append(value[0])
    return images
