"""Each codec (serving/protocols/codec/) against hypothesis, without a server: whatever a client sends (any byte
string, any JSON value, any V2 header with any binary tail and header length, any TensorProto, any V2 gRPC request)
either decodes, into tensors the DataPlane's own checks (`coerce`) then accept or refuse, or is refused with one
ServingError(INVALID_ARGUMENT). Nothing else may escape: a TypeError here is a 500 there (issue 30's was a V2
`"datatype": {}`). Bounded: a few hundred examples a codec, derandomized, no example database."""
from __future__ import annotations

import json
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from msgspec import UNSET
from tensorflow.core.framework import tensor_pb2, tensor_shape_pb2, types_pb2
from tensorflow_serving.apis import input_pb2
from tritonclient.grpc import service_pb2

from serving.core import Code, PredictResult, ServingError, SignatureInfo, TensorInfo, coerce
from serving.protocols.codec import tensor_proto, tfserving_json, v2_bytes, v2_grpc, v2_json
from serving.protocols.codec.strict_json import no_charge
from serving.protocols.codec.v2_tensors import NUMPY_TYPES

LIMIT = 1 << 20  # what a request may decode to, as --grpc_max_message_bytes bounds it
SETTINGS = settings(max_examples=250, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
# Signatures of one and of two inputs, of a string and of numbers, so unnamed and named tensors both meet both.
SIGNATURES = [SignatureInfo({"x": TensorInfo("x:0", "DT_STRING", [-1])}, {}, "tensorflow/serving/predict"),
              SignatureInfo({"x": TensorInfo("x:0", "DT_FLOAT", [-1, 2]), "y": TensorInfo("y:0", "DT_INT8", None)},
                            {}, "tensorflow/serving/predict")]


def decodes_or_is_invalid(decode: Callable[..., object], *args: object) -> object | None:
    """What decode(*args) returns, or None when it refused with INVALID_ARGUMENT; any other exception fails the
    test."""
    try:
        return decode(*args)
    except ServingError as error:
        assert error.code is Code.INVALID_ARGUMENT, error
        return None


def checked_by_the_dataplane(tensors: dict[str, object], signature: SignatureInfo) -> None:
    """The DataPlane converts every tensor a codec hands it to the signature's dtype (`coerce`), refusing one it
    cannot with INVALID_ARGUMENT too."""
    for name, value in tensors.items():
        info = signature.inputs.get(name)
        if info is not None:
            decodes_or_is_invalid(coerce, name, value, info)


# --- JSON --------------------------------------------------------------------------------------------------------

B64 = st.fixed_dictionaries({"b64": st.sampled_from(["AP8=", "aGk=", "", "_-8=", "AP8"]) | st.text(max_size=8)})
SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8)
VALUES = st.recursive(SCALARS | B64, lambda children: st.lists(children, max_size=4) |
                      st.dictionaries(st.sampled_from(["x", "y", "b64", "a"]) | st.text(max_size=4), children,
                                      max_size=3), max_leaves=16)


def as_json(value: object) -> bytes:
    return json.dumps(value).encode()  # NaN and Infinity as Python writes them, which the codecs refuse


def with_some_of(fields: dict[str, st.SearchStrategy]) -> st.SearchStrategy:
    """Objects holding some of `fields` (and sometimes an unknown key), each drawn from its strategy."""
    return st.fixed_dictionaries({}, optional={**fields, "unknown": VALUES})


def places(value: object, fields: bool) -> list[tuple[list | dict, int | str]]:
    """Every (object, key) of a JSON value at any depth, with `fields`; else every (array, index)."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    found: list[tuple[list | dict, int | str]] = []
    for key, item in items:
        found += ([(value, key)] if isinstance(value, dict) == fields else []) + places(item, fields)
    return found


@st.composite
def one_field_wrong(draw, valid: st.SearchStrategy) -> object:
    """A valid body with one value, at any depth, replaced by any JSON value, or one key left out: every field
    meets every wrong type, which whole random documents almost never reach. Fields are drawn three times as often
    as array elements (of which tensors have many), each field name alike however often it occurs."""
    body = draw(valid)
    fields = draw(st.sampled_from([True, True, True, False]))
    found = places(body, fields) or places(body, not fields) or [({}, "")]
    name = draw(st.sampled_from(sorted({str(key) for _, key in found})))
    container, key = draw(st.sampled_from([place for place in found if str(place[1]) == name]))
    if isinstance(container, dict) and draw(st.integers(0, 3)) == 0:
        container.pop(key, None)
    else:
        container[key] = draw(VALUES)  # type: ignore[index]
    return body


def bodies(valid: st.SearchStrategy) -> st.SearchStrategy:
    """Any byte string or JSON value, a valid body, or (most often) one with a field wrong, as JSON text."""
    wrong = one_field_wrong(valid)
    return st.binary(max_size=64) | st.one_of(VALUES, valid, wrong, wrong, wrong).map(as_json)


PIXELS = st.lists(st.lists(st.floats(-1, 1) | st.integers(-3, 3), min_size=2, max_size=2), min_size=1, max_size=2)
TENSORS = st.lists(B64, min_size=1, max_size=2) | PIXELS


def signed(fields: dict[str, st.SearchStrategy]) -> st.SearchStrategy:
    return st.fixed_dictionaries({"signature_name": st.sampled_from(["", "serving_default"]), **fields})


PREDICT_BODIES = st.one_of(
    signed({"instances": TENSORS}),
    signed({"instances": st.lists(st.fixed_dictionaries({"x": B64 | PIXELS, "y": st.integers()}), min_size=1,
                                  max_size=2)}),
    signed({"inputs": TENSORS | st.fixed_dictionaries({"x": TENSORS, "y": PIXELS})}))
FEATURES = st.dictionaries(st.sampled_from(["image_bytes", "x", "n"]), B64 | st.integers() | st.floats() | st.text() |
                           st.lists(st.integers(), max_size=2), min_size=1, max_size=2)
EXAMPLE_BODIES = st.fixed_dictionaries({"examples": st.lists(FEATURES, min_size=1, max_size=2)},
                                       optional={"context": FEATURES, "signature_name": st.just("classify")})


@SETTINGS
@given(data=bodies(PREDICT_BODIES))
def test_tf_serving_predict_bodies(data):
    request = decodes_or_is_invalid(tfserving_json.decode_predict, data, no_charge)
    if isinstance(request, tfserving_json.PredictRequest):
        assert isinstance(request.signature_name, str) and isinstance(request.row_format, bool)
        for signature in SIGNATURES:
            tensors = decodes_or_is_invalid(request.tensors, signature)
            if tensors is not None:
                checked_by_the_dataplane(tensors, signature)


@SETTINGS
@given(data=bodies(EXAMPLE_BODIES))
def test_tf_serving_classify_and_regress_bodies(data):
    request = decodes_or_is_invalid(tfserving_json.decode_examples, data, no_charge)
    if request is not None:
        assert isinstance(request.signature_name, str) and isinstance(request.input, input_pb2.Input)


def test_each_codec_decodes_a_plain_valid_request():
    """The properties here accept a refusal of anything; a codec that refused everything would pass them. One
    plain request of each kind decodes to the tensor it carries."""
    hi = np.array([b"hi"], dtype=object)
    predict = tfserving_json.decode_predict(b'{"instances": [{"b64": "aGk="}]}', no_charge)
    assert predict.tensors(SIGNATURES[0]) == {"x": [b"hi"]}
    examples = tfserving_json.decode_examples(b'{"examples": [{"x": 1}]}', no_charge)
    assert examples.input.example_list.examples[0].features.feature["x"].int64_list.value == [1]
    infer = v2_json.decode_request(b'{"inputs": [{"name": "x", "shape": [1], "datatype": "BYTES", "data": ["hi"]}]}',
                                   None, no_charge)
    grpc_infer = service_pb2.ModelInferRequest(model_name="m")
    grpc_infer.inputs.add(name="x", datatype="BYTES", shape=[1]).contents.bytes_contents.append(b"hi")
    for tensors in (infer.inputs, tensor_proto.signature_inputs({"x": tensor_proto.encode(hi)}, LIMIT)(SIGNATURES[0]),
                    v2_grpc.request_inputs(grpc_infer, LIMIT)):
        assert list(tensors) == ["x"] and tensors["x"].tolist() == [b"hi"]


@st.composite
def v2_inputs(draw) -> dict:
    """A V2 input whose data fits its shape, or one whose data is in the binary tail."""
    datatype = draw(st.sampled_from(sorted(NUMPY_TYPES) + ["BYTES"]))
    spec = {"name": draw(st.sampled_from(["x", "y"])), "datatype": datatype}
    if draw(st.integers(0, 3)) == 0:
        return {**spec, "shape": [1], "parameters": {"binary_data_size": draw(st.integers(0, 12))}}
    values = st.sampled_from(["AP8=", "aGk="]) if datatype == "BYTES" else st.integers(0, 1)
    data = draw(st.lists(values, min_size=1, max_size=4))
    spec = {**spec, "shape": [len(data)], "data": data}
    return {**spec, "parameters": {"content_type": "base64"}} if datatype == "BYTES" and draw(st.booleans()) else spec


V2_OUTPUTS = st.fixed_dictionaries({"name": st.sampled_from(["x", "z"])}, optional={"parameters": st.fixed_dictionaries(
    {}, optional={"binary_data": st.booleans(), "classification": st.integers(0, 3)})})
V2_HEADERS = st.fixed_dictionaries({"inputs": st.lists(v2_inputs(), min_size=1, max_size=2)}, optional={
    "outputs": st.lists(V2_OUTPUTS, max_size=2), "id": st.text(max_size=3),
    "parameters": st.fixed_dictionaries({}, optional={"content_type": st.just("base64"),
                                                      "binary_data_output": st.booleans(),
                                                      "signature_name": st.just("s")})})
# A binary tail: BYTES elements whose length prefixes may lie, or any bytes.
TAILS = st.lists(st.binary(max_size=6), max_size=3).map(v2_bytes.frame) | st.binary(max_size=24)


@settings(SETTINGS, max_examples=400)
@given(header=bodies(V2_HEADERS), tail=TAILS, choice=st.integers(0, 7), text=st.text(max_size=3))
def test_v2_requests_with_any_header_tail_and_header_length(header, tail, choice, text):
    """The Inference-Header-Content-Length is mostly the header's, sometimes none (a JSON body without a tail), or
    any text."""
    header_length = str(len(header)) if choice < 6 else None if choice == 6 else text
    body = header if header_length is None else header + tail
    request = decodes_or_is_invalid(v2_json.decode_request, body, header_length, no_charge)
    if isinstance(request, v2_json.Infer):
        assert isinstance(request.signature_name, str) and isinstance(request.binary_output, bool)
        assert all(isinstance(o.name, str) and isinstance(o.binary, bool) and isinstance(o.classes, int)
                   and o.classes >= 0 for o in request.outputs)
        assert all(isinstance(a, np.ndarray) for a in request.inputs.values())
        checked_by_the_dataplane(request.inputs, SIGNATURES[1])
        outputs = {"x": np.array([[0.5, 0.25]], np.float32), "z": np.array([b"\xff"], dtype=object)}
        decodes_or_is_invalid(v2_json.encode_response, request, PredictResult("m", 1, "s", outputs, ["a"]),
                              lambda: choice % 2 == 0)  # a batching model or not, for the classification extension


@SETTINGS
@given(data=st.data(), dtype=st.sampled_from([np.float16, np.float32, np.float64]))
def test_v2_json_answers_write_every_float_nan_and_infinities_included(data, dtype):
    """Any float output, NaN, the infinities and values whose sum overflows included, reads back as the same
    numbers: no value is written as null, as msgspec would write a NaN (encode_response's finiteness check)."""
    width = np.finfo(dtype).bits
    array = np.array(data.draw(st.lists(st.floats(width=width), max_size=6)), dtype=dtype)
    body, header_length = v2_json.encode_response(v2_json.Infer({}, "", [], False, UNSET),
                                                  PredictResult("m", 1, "s", {"x": array}, []), lambda: True)
    written = json.loads(body)["outputs"][0]["data"]
    assert header_length is None and all(isinstance(v, int | float) for v in written)
    np.testing.assert_array_equal(np.array(written, dtype=np.float64), array.astype(np.float64))


@SETTINGS
@given(items=st.lists(st.binary(max_size=8), max_size=5), spare=st.integers(0, 2))
def test_bytes_framing_gives_back_what_it_framed_and_never_more_than_declared(items, spare):
    """The one framing (serving/protocols/codec/v2_bytes.py), both ways: what a client frames, the server reads
    back element for element; a count one short of the elements framed is refused, not outgrown."""
    raw = v2_bytes.frame(items)
    assert v2_bytes.unframe(raw, len(items) + spare) == items
    if items:
        with pytest.raises(v2_bytes.FramingError):
            v2_bytes.unframe(raw, len(items) - 1)
        with pytest.raises(v2_bytes.FramingError):
            v2_bytes.unframe(raw[:-1], len(items))  # cut inside the last element or its length


# --- protos ------------------------------------------------------------------------------------------------------

DIMS = st.integers(0, 3) | st.sampled_from([10 ** 9, 2 ** 62]) | st.integers(-2 ** 63, 2 ** 63 - 1)
INT32 = st.integers(-2 ** 31, 2 ** 31 - 1)
VALUE_FIELDS = {"float_val": st.floats(width=32), "double_val": st.floats(), "half_val": INT32, "int_val": INT32,
                "int64_val": st.integers(-2 ** 63, 2 ** 63 - 1), "uint32_val": st.integers(0, 2 ** 32 - 1),
                "uint64_val": st.integers(0, 2 ** 64 - 1), "bool_val": st.booleans(),
                "string_val": st.binary(max_size=4), "scomplex_val": st.floats(width=32)}


@st.composite
def tensor_protos(draw) -> tensor_pb2.TensorProto:
    dims = draw(st.lists(DIMS, max_size=4) | st.just([1] * 65))
    proto = tensor_pb2.TensorProto(
        dtype=draw(st.sampled_from(sorted(types_pb2.DataType.values())) | st.integers(0, 400)),
        tensor_shape=tensor_shape_pb2.TensorShapeProto(dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=d)
                                                            for d in dims], unknown_rank=draw(st.booleans())))
    if draw(st.booleans()):
        proto.tensor_content = draw(st.binary(max_size=48))
    for field in draw(st.lists(st.sampled_from(sorted(VALUE_FIELDS)), max_size=2, unique=True)):
        getattr(proto, field).extend(draw(st.lists(VALUE_FIELDS[field], max_size=6)))
    return proto


@SETTINGS
@given(protos=st.dictionaries(st.sampled_from(["x", "y", "z"]), tensor_protos(), max_size=2))
def test_any_tensor_protos(protos):
    for signature in SIGNATURES:
        tensors = decodes_or_is_invalid(tensor_proto.signature_inputs(protos, LIMIT), signature)
        if tensors is not None:
            checked_by_the_dataplane(tensors, signature)


@st.composite
def infer_requests(draw) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name="m")
    for _ in range(draw(st.integers(0, 2))):
        datatype = draw(st.sampled_from(sorted(NUMPY_TYPES) + ["BYTES"]) | st.text(max_size=5))
        tensor = request.inputs.add(name=draw(st.sampled_from(["x", "y"])), datatype=datatype,
                                    shape=draw(st.lists(DIMS, max_size=3)))
        field = v2_grpc.CONTENTS.get(datatype)
        if field and draw(st.booleans()):
            strategy = st.binary(max_size=4) if datatype == "BYTES" else VALUE_FIELDS[
                {"bool_contents": "bool_val", "fp32_contents": "float_val", "fp64_contents": "double_val",
                 "int64_contents": "int64_val", "uint64_contents": "uint64_val",
                 "uint_contents": "uint32_val"}.get(field, "int_val")]
            getattr(tensor.contents, field).extend(draw(st.lists(strategy, max_size=4)))
    if draw(st.booleans()):
        request.raw_input_contents.extend(draw(st.lists(TAILS, max_size=3)))
    for name in draw(st.lists(st.sampled_from(["x", "z"]), max_size=2)):
        output = request.outputs.add(name=name)
        if draw(st.booleans()):
            output.parameters["classification"].int64_param = draw(st.integers(-2, 3))
    return request


@SETTINGS
@given(request=infer_requests())
def test_any_v2_grpc_requests(request):
    inputs = decodes_or_is_invalid(v2_grpc.request_inputs, request, LIMIT)
    if inputs is not None:
        checked_by_the_dataplane(inputs, SIGNATURES[1])
    outputs = {"x": np.array([[0.5, 0.25]], np.float32), "z": np.array([b"\xff"], dtype=object)}
    decodes_or_is_invalid(v2_grpc.response_outputs, request, PredictResult("m", 1, "s", outputs, ["a"]), lambda: True)
