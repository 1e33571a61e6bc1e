"""A hostile client on the gRPC port of one real `petal serve` (the tiny model), as tests/e2e/test_openapi.py is one on
the REST port: three tensor bombs (requests of a few bytes that claim gigabytes) and a V2 message of millions of
short strings, sent as they are; then hypothesis drawing TF Serving's gRPC requests with random dtypes, shapes
(huge, negative, empty, unknown rank, too many dimensions), value counts in the right and wrong fields,
tensor_content lengths, strings (real JPEGs among them) and model specs, and the KServe V2 GRPCInferenceService's
requests with random datatypes (known, unknown, empty), the same shapes, raw_input_contents of random lengths and
counts, typed contents of random counts, BYTES length prefixes that lie, parameters, requested outputs
(classification among them) and model names and versions.

Whatever it draws, the server must answer with a status a client can act on (never INTERNAL or UNKNOWN), within
one second, and its worker must stay within idle + 256 MiB. Bounded for CI (1 to 1.5 minutes on two cores): a fixed
number of examples per RPC, derandomized, no example database, no shrinking, a timeout on every call.

To fuzz another service, add its request strategies and method names to RPCS; the checks are the same.
"""
from __future__ import annotations

import collections
import math
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from tensorflow.core.example import example_pb2, feature_pb2
from tensorflow.core.framework import tensor_pb2, tensor_shape_pb2, types_pb2
from tensorflow_serving.apis import (
    classification_pb2,
    get_model_metadata_pb2,
    get_model_status_pb2,
    inference_pb2,
    input_pb2,
    model_pb2,
    predict_pb2,
    prediction_service_pb2_grpc,
    regression_pb2,
)
from tritonclient.grpc import service_pb2

from load_tests.pixel_flood import reset_peak, status_kb
from server_harness import jpeg, run_server, tiny_model_base, worker_pid
from serving.protocols.codec.v2_bytes import frame

# Every answer must come within ANSWER_WITHIN_S, a speed claim: `make test` runs this module alone (serial), where
# another test's server start-up cannot take the cores it is timed on.
pytestmark = pytest.mark.serial

RSS_HEADROOM_KB = 256 * 1024
ANSWER_WITHIN_S = 1.0
CALL_TIMEOUT_S = 10.0  # longer than ANSWER_WITHIN_S, so a slow answer fails as slow rather than as a deadline
NEVER = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
JPEGS = [jpeg(seed=s) for s in range(2)]


# --- the server -------------------------------------------------------------------------------------------------

@dataclass
class Target:
    channel: grpc.Channel
    pid: int  # the one worker's
    idle_kb: int


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """The tiny model as "flowers" version 1, labelled "stable", so drawn specs reach real versions and labels."""
    config = tmp_path_factory.mktemp("grpc_fuzz") / "models.config"
    config.write_text(f'model_config_list {{ config {{ name: "flowers" base_path: "{tiny_model_base()}" '
                      'model_platform: "tensorflow" version_labels { key: "stable" value: 1 } } }')
    # labels at start name versions not loaded yet: TF Serving needs the flag too
    with run_server(f"--model_config_file={config}", "--allow_version_labels_for_unavailable_models=true",
                    "--workers=1") as server:
        with grpc.insecure_channel(server.grpc_target) as channel:
            pid = worker_pid(server.proc.pid)
            call(channel, "/tensorflow.serving.PredictionService/Predict", predict_pb2.PredictResponse,
                 real_predict())  # the first inference's allocations are part of idle, not of the fuzz
            reset_peak(pid)
            yield Target(channel, pid, status_kb(pid, "VmRSS"))


def call(channel: grpc.Channel, method: str, response_type: Any, request: Any) -> tuple[grpc.StatusCode, float]:
    """One unary call by its full method name; its status and how long the answer took."""
    stub = channel.unary_unary(method, request_serializer=type(request).SerializeToString,
                               response_deserializer=response_type.FromString)
    started = time.perf_counter()
    try:
        stub(request, timeout=CALL_TIMEOUT_S)
        code = grpc.StatusCode.OK
    except grpc.RpcError as error:
        code = error.code()
    return code, time.perf_counter() - started


def check_answer(target: Target, method: str, request: Any, code: grpc.StatusCode, elapsed: float) -> None:
    summary = f"{method} of {request.ByteSize()} bytes"
    assert code not in NEVER, f"{summary} answered {code.name}"
    assert elapsed < ANSWER_WITHIN_S, f"{summary} took {elapsed:.2f} s"
    rss = status_kb(target.pid, "VmRSS")
    assert rss <= target.idle_kb + RSS_HEADROOM_KB, f"after {summary} the worker holds {rss // 1024} MiB " \
                                                    f"(idle {target.idle_kb // 1024} MiB)"


# --- the bombs --------------------------------------------------------------------------------------------------

def predict(tensor: tensor_pb2.TensorProto, name: str = "image_bytes") -> predict_pb2.PredictRequest:
    request = predict_pb2.PredictRequest(model_spec=model_pb2.ModelSpec(name="flowers"))
    request.inputs[name].CopyFrom(tensor)
    return request


def real_predict() -> predict_pb2.PredictRequest:
    return predict(tensor_pb2.TensorProto(dtype=types_pb2.DT_STRING, string_val=JPEGS,
                                          tensor_shape=shape_proto([len(JPEGS)])))


def shape_proto(dims: list[int], unknown_rank: bool = False) -> tensor_shape_pb2.TensorShapeProto:
    return tensor_shape_pb2.TensorShapeProto(dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=d) for d in dims],
                                             unknown_rank=unknown_rank)


BOMBS = {
    "DT_STRING [1000000000], no values": tensor_pb2.TensorProto(dtype=types_pb2.DT_STRING,
                                                                tensor_shape=shape_proto([1_000_000_000])),
    "DT_FLOAT [2^31, 2^31], no values": tensor_pb2.TensorProto(dtype=types_pb2.DT_FLOAT,
                                                               tensor_shape=shape_proto([2 ** 31, 2 ** 31])),
    "one string_val, shape [20000000]": tensor_pb2.TensorProto(dtype=types_pb2.DT_STRING, string_val=[b"x"],
                                                               tensor_shape=shape_proto([20_000_000])),
}


@pytest.mark.parametrize("bomb", list(BOMBS))
def test_a_tensor_bomb_is_invalid_at_once_and_costs_the_worker_nothing(target, bomb):
    stub = prediction_service_pb2_grpc.PredictionServiceStub(target.channel)
    before = status_kb(target.pid, "VmRSS")
    started = time.perf_counter()
    with pytest.raises(grpc.RpcError) as error:
        stub.Predict(predict(BOMBS[bomb]), timeout=CALL_TIMEOUT_S)
    elapsed = time.perf_counter() - started
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, error.value.details()
    assert elapsed < 0.5, f"{elapsed:.3f} s"
    assert abs(status_kb(target.pid, "VmRSS") - before) < 50 * 1024
    served = stub.Predict(real_predict(), timeout=CALL_TIMEOUT_S)  # and the worker still serves
    assert [d.size for d in served.outputs["classid"].tensor_shape.dim] == [len(JPEGS)]


def test_a_v2_message_of_millions_of_short_strings_is_invalid_at_once(target):
    """12 MB of two-byte BYTES elements, too big for hypothesis to draw: two million Python objects, 86 MB, past
    what one message may decode to (--grpc_max_message_bytes, as Predict counts it). Unchecked, it took 3.6 s (and
    60 MB took 27 s and 1 GiB)."""
    count = (12 << 20) // 6
    request = service_pb2.ModelInferRequest(model_name="flowers", raw_input_contents=[frame([b"ab"]) * count])
    request.inputs.add(name="image_bytes", datatype="BYTES", shape=[count])
    code, elapsed = call(target.channel, V2 + "ModelInfer", service_pb2.ModelInferResponse, request)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    check_answer(target, V2 + "ModelInfer", request, code, elapsed)


# --- the generators ---------------------------------------------------------------------------------------------

INT32 = st.integers(-2 ** 31, 2 ** 31 - 1)
INT64 = st.integers(-2 ** 63, 2 ** 63 - 1)
# A dimension: mostly small, sometimes what fills memory (a million, a billion), sometimes past any array.
DIMS = st.one_of(st.integers(0, 4), st.integers(0, 4), st.sampled_from([10 ** 6, 10 ** 9, 2 ** 31, 2 ** 62]),
                 st.integers(-2 ** 63, -1), INT64)
SHAPES = st.one_of(st.lists(DIMS, max_size=6), st.lists(DIMS, max_size=6), st.just([1] * 65))  # past numpy's 64
STRINGS = st.one_of(st.sampled_from(JPEGS), st.binary(max_size=48), st.sampled_from(JPEGS).map(lambda b: b[:100]))
FLOATS = st.floats(allow_nan=True, allow_infinity=True, width=32)
# Every repeated value field of a TensorProto with values it accepts (a client cannot send others).
VALUE_FIELDS: dict[str, st.SearchStrategy] = {
    "float_val": FLOATS, "double_val": st.floats(), "int_val": INT32, "int64_val": INT64, "half_val": INT32,
    "uint32_val": st.integers(0, 2 ** 32 - 1), "uint64_val": st.integers(0, 2 ** 64 - 1), "bool_val": st.booleans(),
    "string_val": STRINGS, "scomplex_val": FLOATS, "dcomplex_val": st.floats(),
}
# Half the draws name what is served (the model, its inputs, DT_STRING), as tests/e2e/test_openapi.py's hooks do, so
# that requests get past the first NOT_FOUND to the checks behind it.
DTYPES = st.one_of(st.just(types_pb2.DT_STRING), st.sampled_from(sorted(types_pb2.DataType.values())),
                   st.integers(0, 400))
NAMES = st.one_of(st.just("flowers"), st.sampled_from(["flowers", "nope", ""]), st.text(max_size=12))
INPUT_NAMES = st.one_of(st.just("image_bytes"), st.sampled_from(["image_bytes", "images"]), st.text(max_size=8))
LABELS = st.one_of(st.just(""), st.sampled_from(["stable", "canary"]), st.text(max_size=8))
SIGNATURES = st.one_of(st.just(""), st.sampled_from(["serving_default", "predict_images", "classify",
                                                   "tensorflow/serving/predict"]), st.text(max_size=12))
OUTPUT_NAMES = st.sampled_from(["probabilities", "classid", "class", "nope"])


def fitting_length(draw: st.DrawFn, dims: list[int]) -> int:
    """A byte length that a small shape holds at 1, 2, 4 or 8 bytes an element; 0 for any other shape."""
    return math.prod(dims) * draw(st.sampled_from([1, 2, 4, 8])) if all(0 <= d <= 4 for d in dims) else 0


@st.composite
def pixels(draw, rows: int) -> np.ndarray:
    """`rows` images of 32x32x3 float32 pixels, a drawn pattern of floats repeated: hypothesis cannot draw 12 KiB
    a row itself (past its entropy limit a draw is dropped, silently under suppress_health_check)."""
    return np.resize(np.array(draw(st.lists(FLOATS, min_size=1, max_size=8)), "<f4"), rows * 32 * 32 * 3)


@st.composite
def tensors(draw) -> tensor_pb2.TensorProto:
    dims = draw(SHAPES)
    proto = tensor_pb2.TensorProto(dtype=draw(DTYPES),
                                   tensor_shape=shape_proto(dims, unknown_rank=draw(st.integers(0, 7)) == 0))
    for field in ("tensor_content", "float8_val"):  # the byte fields: any length, or one that fits a small shape
        if draw(st.integers(0, 3)) == 0:
            fits = fitting_length(draw, dims)
            setattr(proto, field, draw(st.binary(max_size=64) | st.binary(min_size=fits, max_size=fits)))
    for field in draw(st.lists(st.sampled_from(sorted(VALUE_FIELDS)), max_size=2, unique=True)):
        count = draw(st.sampled_from([1, 2, 8, 40]))
        getattr(proto, field).extend(draw(st.lists(VALUE_FIELDS[field], max_size=count)))
    for _ in range(draw(st.integers(0, 7)) // 6):
        draw(st.sampled_from([proto.resource_handle_val, proto.variant_val])).add()
    return proto


@st.composite
def image_tensors(draw) -> tensor_pb2.TensorProto:
    """What serving_default takes: encoded images as strings (mostly real JPEGs), one per row."""
    images = draw(st.lists(st.sampled_from(JPEGS) | STRINGS, max_size=4))
    return tensor_pb2.TensorProto(dtype=types_pb2.DT_STRING, string_val=images, tensor_shape=shape_proto([len(images)]))


@st.composite
def pixel_tensors(draw) -> tensor_pb2.TensorProto:
    """What predict_images takes: float pixels [rows, 32, 32, 3] in tensor_content."""
    rows = draw(st.integers(0, 2))
    return tensor_pb2.TensorProto(dtype=types_pb2.DT_FLOAT, tensor_content=draw(pixels(rows)).tobytes(),
                                  tensor_shape=shape_proto([rows, 32, 32, 3]))


@st.composite
def model_specs(draw) -> model_pb2.ModelSpec:
    spec = model_pb2.ModelSpec(name=draw(NAMES), signature_name=draw(SIGNATURES))
    choice = draw(st.integers(0, 3))
    if choice == 1:
        spec.version.value = draw(st.one_of(st.just(1), INT64))
    elif choice == 2:
        spec.version_label = draw(LABELS)
    return spec


@st.composite
def served_specs(draw, signature_name: str = "") -> model_pb2.ModelSpec:
    """The served model by name, by version 1 or by its label."""
    spec = model_pb2.ModelSpec(name="flowers", signature_name=signature_name)
    choice = draw(st.integers(0, 2))
    if choice == 1:
        spec.version.value = 1
    elif choice == 2:
        spec.version_label = "stable"
    return spec


def specs() -> st.SearchStrategy:
    return served_specs() | model_specs()


@st.composite
def predict_requests(draw) -> predict_pb2.PredictRequest:
    """Half what the served signatures take, a part of it sometimes swapped for a random one; half random."""
    if draw(st.booleans()):
        signature, name, tensor = draw(st.sampled_from([("", "image_bytes", image_tensors()),
                                                        ("serving_default", "image_bytes", image_tensors()),
                                                        ("predict_images", "images", pixel_tensors())]))
        spec = draw(served_specs(signature) | model_specs())
        request = predict_pb2.PredictRequest(model_spec=spec)
        request.inputs[draw(st.just(name) | INPUT_NAMES)].CopyFrom(draw(tensor | tensors()))
    else:
        request = predict_pb2.PredictRequest(model_spec=draw(model_specs()))
        for name in draw(st.lists(INPUT_NAMES, max_size=3, unique=True)):
            request.inputs[name].CopyFrom(draw(tensors() | image_tensors() | pixel_tensors()))
    request.output_filter.extend(draw(st.lists(OUTPUT_NAMES, max_size=2, unique=True)))
    return request


@st.composite
def examples(draw) -> example_pb2.Example:
    features = {}
    for name in draw(st.lists(st.sampled_from(["image_bytes", "x", "label"]) | st.text(max_size=6), max_size=3)):
        kind = draw(st.sampled_from(["bytes", "float", "int64"]))
        if kind == "bytes":
            features[name] = feature_pb2.Feature(bytes_list=feature_pb2.BytesList(
                value=draw(st.lists(STRINGS, max_size=2))))
        elif kind == "float":
            features[name] = feature_pb2.Feature(float_list=feature_pb2.FloatList(
                value=draw(st.lists(FLOATS, max_size=3))))
        else:
            features[name] = feature_pb2.Feature(int64_list=feature_pb2.Int64List(
                value=draw(st.lists(INT64, max_size=3))))
    return example_pb2.Example(features=feature_pb2.Features(feature=features))


@st.composite
def inputs(draw) -> input_pb2.Input:
    kind = draw(st.sampled_from(["none", "list", "context", "images"]))
    if kind == "images":  # what Classify serves: one real JPEG per example, under image_bytes
        images = draw(st.lists(st.sampled_from(JPEGS), min_size=1, max_size=3))
        return input_pb2.Input(example_list=input_pb2.ExampleList(examples=[example_pb2.Example(
            features=feature_pb2.Features(feature={"image_bytes": feature_pb2.Feature(
                bytes_list=feature_pb2.BytesList(value=[image]))})) for image in images]))
    if kind == "list":
        return input_pb2.Input(example_list=input_pb2.ExampleList(examples=draw(st.lists(examples(), max_size=4))))
    if kind == "context":
        return input_pb2.Input(example_list_with_context=input_pb2.ExampleListWithContext(
            examples=draw(st.lists(examples(), max_size=3)), context=draw(examples())))
    return input_pb2.Input()


@st.composite
def classification_requests(draw) -> classification_pb2.ClassificationRequest:
    return classification_pb2.ClassificationRequest(model_spec=draw(specs()), input=draw(inputs()))


@st.composite
def regression_requests(draw) -> regression_pb2.RegressionRequest:
    return regression_pb2.RegressionRequest(model_spec=draw(specs()), input=draw(inputs()))


@st.composite
def multi_inference_requests(draw) -> inference_pb2.MultiInferenceRequest:
    methods = st.sampled_from(["tensorflow/serving/classify", "tensorflow/serving/regress", ""]) | st.text(max_size=8)
    tasks = [inference_pb2.InferenceTask(model_spec=draw(specs()), method_name=draw(methods))
             for _ in range(draw(st.integers(0, 3)))]
    return inference_pb2.MultiInferenceRequest(tasks=tasks, input=draw(inputs()))


@st.composite
def metadata_requests(draw) -> get_model_metadata_pb2.GetModelMetadataRequest:
    fields = draw(st.lists(st.sampled_from(["signature_def"]) | st.text(max_size=8), max_size=2))
    return get_model_metadata_pb2.GetModelMetadataRequest(model_spec=draw(specs()), metadata_field=fields)


@st.composite
def status_requests(draw) -> get_model_status_pb2.GetModelStatusRequest:
    return get_model_status_pb2.GetModelStatusRequest(model_spec=draw(specs()))


# --- the KServe V2 generators -----------------------------------------------------------------------------------

# The Open Inference Protocol's datatypes (BF16 among them, which Petal does not serve), a wrong case, none, random.
V2_DATATYPES = st.one_of(st.just("BYTES"), st.sampled_from(["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8",
                                                            "INT16", "INT32", "INT64", "FP16", "FP32", "FP64",
                                                            "BYTES", "BF16", "fp32", ""]), st.text(max_size=6))
VERSIONS = st.one_of(st.sampled_from(["", "1"]),
                     st.sampled_from(["2", "01", "-1", " 1", "1.0", str(2 ** 63), "9" * 30]), st.text(max_size=6))
# Every InferTensorContents field with values it accepts, and every kind of InferParameter.
CONTENT_FIELDS: dict[str, st.SearchStrategy] = {
    "bool_contents": st.booleans(), "int_contents": INT32, "int64_contents": INT64,
    "uint_contents": st.integers(0, 2 ** 32 - 1), "uint64_contents": st.integers(0, 2 ** 64 - 1),
    "fp32_contents": FLOATS, "fp64_contents": st.floats(), "bytes_contents": STRINGS,
}
PARAMETER_KINDS: dict[str, st.SearchStrategy] = {
    "bool_param": st.booleans(), "int64_param": st.sampled_from([0, 1, 2, 5]) | INT64, "string_param": SIGNATURES,
    "double_param": st.floats(), "uint64_param": st.integers(0, 2 ** 64 - 1),
}
InferRequestedOutputTensor = service_pb2.ModelInferRequest.InferRequestedOutputTensor


@st.composite
def infer_parameters(draw, keys: list[str]) -> dict[str, service_pb2.InferParameter]:
    """A parameters map: the keys Petal or Triton reads, or random ones, each with a value of any kind."""
    parameters = {}
    for key in draw(st.lists(st.sampled_from(keys) | st.text(max_size=8), max_size=3, unique=True)):
        kind = draw(st.sampled_from(sorted(PARAMETER_KINDS)))
        parameters[key] = service_pb2.InferParameter(**{kind: draw(PARAMETER_KINDS[kind])})
    return parameters


@st.composite
def lying_frames(draw, count: int | None) -> bytes:
    """Framed BYTES (`count` elements, else any number) whose lengths sometimes lie (one too many or too few, or
    4 GiB), and whose tail sometimes holds part of another length."""
    items = draw(st.lists(STRINGS, min_size=count or 0, max_size=4 if count is None else count))
    lengths = [draw(st.sampled_from([len(item)] * 3 + [len(item) + 1, max(len(item) - 1, 0), 2 ** 32 - 1]))
               for item in items]
    framed = b"".join(struct.pack("<I", length) + item for length, item in zip(lengths, items, strict=False))
    return framed + (draw(st.binary(min_size=1, max_size=3)) if draw(st.integers(0, 3)) == 0 else b"")


def small_count(dims: list[int]) -> int | None:
    """The element count of a shape small enough to draw that many values for, else None."""
    count = math.prod(dims) if all(0 <= d <= 4 for d in dims) else None
    return count if count is not None and count <= 40 else None


@st.composite
def raw_contents(draw, dims: list[int]) -> bytes:
    """One raw_input_contents entry: any bytes, as many as a small shape holds, or framed BYTES."""
    fits = fitting_length(draw, dims)
    return draw(st.binary(max_size=64) | st.binary(min_size=fits, max_size=fits) | lying_frames(small_count(dims)))


@st.composite
def typed_contents(draw, dims: list[int]) -> service_pb2.InferTensorContents:
    """One or two typed fields, each of a random count or of the count a small shape declares."""
    contents = service_pb2.InferTensorContents()
    count = small_count(dims)
    for field in draw(st.lists(st.sampled_from(sorted(CONTENT_FIELDS)), min_size=1, max_size=2, unique=True)):
        size = draw(st.sampled_from([1, 2, 8, 40] if count is None else [count, count, 1, 40]))
        getattr(contents, field).extend(draw(st.lists(CONTENT_FIELDS[field], min_size=size, max_size=size)))
    return contents


@st.composite
def requested_outputs(draw) -> list[InferRequestedOutputTensor]:
    """Outputs by name (repeated, unknown), sometimes with Triton's classification or binary_data parameters."""
    return [InferRequestedOutputTensor(name=name, parameters=draw(infer_parameters(["classification", "binary_data"])))
            for name in draw(st.lists(OUTPUT_NAMES | st.text(max_size=8), max_size=3))]


@st.composite
def random_infer_requests(draw) -> service_pb2.ModelInferRequest:
    """Any inputs, by raw_input_contents (one per input, or a wrong number of them), typed contents, or both."""
    request = service_pb2.ModelInferRequest(model_name=draw(NAMES), model_version=draw(VERSIONS),
                                            id=draw(st.text(max_size=8)),
                                            parameters=draw(infer_parameters(["signature_name", "priority",
                                                                              "timeout", "binary_data_output"])))
    how = draw(st.sampled_from(["raw", "typed", "both", "miscounted"]))
    for name in draw(st.lists(INPUT_NAMES, max_size=3)):  # a name sometimes twice
        dims = draw(SHAPES)
        tensor = request.inputs.add(name=name, datatype=draw(V2_DATATYPES), shape=dims,
                                    parameters=draw(infer_parameters(["binary_data_size", "content_type"])))
        if how in ("raw", "both"):
            request.raw_input_contents.append(draw(raw_contents(dims)))
        if how == "typed" or how == "both" and draw(st.booleans()):
            tensor.contents.CopyFrom(draw(typed_contents(dims)))
    if how == "miscounted":
        request.raw_input_contents.extend(draw(st.lists(st.binary(max_size=16), min_size=1, max_size=4)))
    request.outputs.extend(draw(requested_outputs()))
    return request


@st.composite
def served_infer_requests(draw) -> service_pb2.ModelInferRequest:
    """What the served signatures take, raw as tritonclient sends it or typed (serving_default's images, shaped
    [n] or [n, 1]; predict_images' pixels), with one part of it sometimes swapped for a random one."""
    swap = draw(st.sampled_from([None, None, None, "version", "name", "datatype", "shape", "data", "outputs"]))
    versions = VERSIONS if swap == "version" else st.sampled_from(["", "1"])
    request = service_pb2.ModelInferRequest(model_name="flowers", model_version=draw(versions))
    if draw(st.booleans()):
        images = draw(st.lists(st.sampled_from(JPEGS), max_size=3))
        name, datatype, dims = "image_bytes", "BYTES", draw(st.sampled_from([[len(images)], [len(images), 1]]))
        raw, typed = frame(images), service_pb2.InferTensorContents(bytes_contents=images)
    else:
        rows = draw(st.integers(0, 2))
        values = draw(pixels(rows))
        name, datatype, dims = "images", "FP32", [rows, 32, 32, 3]
        raw, typed = values.tobytes(), service_pb2.InferTensorContents(fp32_contents=values.tolist())
        request.parameters["signature_name"].string_param = "predict_images"
    tensor = request.inputs.add(name=draw(INPUT_NAMES) if swap == "name" else name,
                                datatype=draw(V2_DATATYPES) if swap == "datatype" else datatype,
                                shape=draw(SHAPES) if swap == "shape" else dims)
    if swap == "data":
        request.raw_input_contents.append(draw(raw_contents(dims)))
    elif draw(st.booleans()):
        request.raw_input_contents.append(raw)
    else:
        tensor.contents.CopyFrom(typed)
    if swap == "outputs":
        request.outputs.extend(draw(requested_outputs()))
    else:
        for output in draw(st.lists(OUTPUT_NAMES, max_size=2, unique=True)):
            classes = draw(st.sampled_from([None, None, 0, 1, 2, 5, 6]))
            parameters = {} if classes is None else {"classification": service_pb2.InferParameter(int64_param=classes)}
            request.outputs.add(name=output, parameters=parameters)
    return request


@st.composite
def model_requests(draw, message: type) -> Any:
    """A V2 request that names a model and a version: the served model half the time."""
    return message(name=draw(st.just("flowers") | NAMES), version=draw(st.sampled_from(["", "1"]) | VERSIONS))


@dataclass(frozen=True)
class Rpc:
    method: str  # the full gRPC method name
    response: Any  # its response message type
    requests: Callable[[], st.SearchStrategy]
    examples: int
    reaches_ok: bool  # whether some drawn requests must succeed (else the generator never gets past the errors)


PREDICTION = "/tensorflow.serving.PredictionService/"
V2 = "/inference.GRPCInferenceService/"
RPCS = [
    Rpc(PREDICTION + "Predict", predict_pb2.PredictResponse, predict_requests, 2000, True),
    Rpc(PREDICTION + "Classify", classification_pb2.ClassificationResponse, classification_requests, 500, True),
    Rpc(PREDICTION + "Regress", regression_pb2.RegressionResponse, regression_requests, 200, False),
    Rpc(PREDICTION + "MultiInference", inference_pb2.MultiInferenceResponse, multi_inference_requests, 200, False),
    Rpc(PREDICTION + "GetModelMetadata", get_model_metadata_pb2.GetModelMetadataResponse, metadata_requests, 200, True),
    Rpc("/tensorflow.serving.ModelService/GetModelStatus", get_model_status_pb2.GetModelStatusResponse,
        status_requests, 200, True),
    Rpc(V2 + "ModelInfer", service_pb2.ModelInferResponse, lambda: served_infer_requests() | random_infer_requests(),
        2000, True),
    Rpc(V2 + "ModelMetadata", service_pb2.ModelMetadataResponse,
        lambda: model_requests(service_pb2.ModelMetadataRequest), 150, True),
    Rpc(V2 + "ModelReady", service_pb2.ModelReadyResponse, lambda: model_requests(service_pb2.ModelReadyRequest),
        150, True),
    Rpc(V2 + "ModelConfig", service_pb2.ModelConfigResponse, lambda: model_requests(service_pb2.ModelConfigRequest),
        150, True),
    Rpc(V2 + "ModelStatistics", service_pb2.ModelStatisticsResponse,
        lambda: model_requests(service_pb2.ModelStatisticsRequest), 150, True),
    # No fields to draw: one example each.
    Rpc(V2 + "ServerMetadata", service_pb2.ServerMetadataResponse, lambda: st.just(service_pb2.ServerMetadataRequest()),
        1, True),
    Rpc(V2 + "ServerLive", service_pb2.ServerLiveResponse, lambda: st.just(service_pb2.ServerLiveRequest()), 1, True),
    Rpc(V2 + "ServerReady", service_pb2.ServerReadyResponse, lambda: st.just(service_pb2.ServerReadyRequest()), 1,
        True),
]


@pytest.mark.parametrize("rpc", RPCS, ids=[r.method.rsplit("/", 1)[1] for r in RPCS])
def test_no_drawn_request_gets_internal_unknown_a_slow_answer_or_the_worker_past_its_budget(target, rpc):
    @settings(max_examples=rpc.examples, deadline=None, derandomize=True, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(request=rpc.requests())
    def fuzz(request):
        code, elapsed = call(target.channel, rpc.method, rpc.response, request)
        codes[code.name] += 1
        check_answer(target, rpc.method, request, code, elapsed)

    codes: collections.Counter = collections.Counter()
    fuzz()
    assert codes["OK"] or not rpc.reaches_ok, f"no drawn request succeeded: {dict(codes)}"
    peak = status_kb(target.pid, "VmHWM")
    assert peak <= target.idle_kb + RSS_HEADROOM_KB, f"the worker peaked at {peak // 1024} MiB " \
                                                     f"(idle {target.idle_kb // 1024} MiB)"
