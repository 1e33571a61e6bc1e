"""serving/protocols/codec/tensor_proto.py without a server: every tensor TensorFlow's own client builds decodes as
tf.make_ndarray decodes it, and every tensor whose declared sizes are lies (30-byte requests that claim gigabytes
among them) is refused with INVALID_ARGUMENT in microseconds, before anything the size of its claim is allocated."""
from __future__ import annotations

import math
import time
import tracemalloc

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework import tensor_pb2, tensor_shape_pb2, types_pb2

from serving.core import Code, ServingError
from serving.memory_costs import BODY_BYTES_FACTOR
from serving.protocols.codec.tensor_proto import FILL_LIMIT, KINDS, STRING_ELEMENT_BYTES, decode_inputs, encode

LIMIT = 64 << 20  # --grpc_max_message_bytes' default
SERVED = sorted(kind.name for kind in KINDS.values())


def tensor(dtype: str, shape: list[int], unknown_rank: bool = False, **fields) -> tensor_pb2.TensorProto:
    shape_proto = tensor_shape_pb2.TensorShapeProto(dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=d) for d in shape],
                                                    unknown_rank=unknown_rank)
    proto = tensor_pb2.TensorProto(dtype=types_pb2.DataType.Value(dtype), tensor_shape=shape_proto)
    for name, value in fields.items():
        if isinstance(value, bytes):
            setattr(proto, name, value)
        else:
            getattr(proto, name).extend(value)
    return proto


def refused(proto: tensor_pb2.TensorProto, match: str, limit: int = LIMIT) -> None:
    with pytest.raises(ServingError, match=match) as error:
        decode_inputs({"x": proto}, limit)
    assert error.value.code == Code.INVALID_ARGUMENT


def sample(dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    if dtype == "DT_STRING":
        return np.array([b"", b"a", b"\x00\xff" * 3, "é".encode()] * 6, dtype=object)[:math.prod(shape)].reshape(shape)
    numpy_dtype = tf.dtypes.as_dtype(types_pb2.DataType.Value(dtype)).as_numpy_dtype
    if numpy_dtype == np.bool_:
        return (np.arange(math.prod(shape)) % 3 == 0).reshape(shape)
    info = np.finfo(numpy_dtype) if np.issubdtype(numpy_dtype, np.floating) else np.iinfo(numpy_dtype)
    values = np.linspace(max(info.min, -1000), min(info.max, 1000), math.prod(shape))
    return values.astype(numpy_dtype).reshape(shape)


@pytest.mark.parametrize("dtype", SERVED)
@pytest.mark.parametrize("shape", [(), (0,), (3,), (2, 3), (1, 0, 4)])
def test_what_tensorflow_builds_decodes_as_tensorflow_decodes_it(dtype, shape):
    proto = tf.make_tensor_proto(sample(dtype, shape))  # tensor_content for numbers, string_val for strings
    got = decode_inputs({"x": proto}, LIMIT)["x"]
    want = tf.make_ndarray(proto)
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", SERVED)
@pytest.mark.parametrize("shape", [(), (1,), (3,), (2, 3), (1, 0, 4)])
def test_outputs_encode_byte_for_byte_as_tensorflow_encodes_them(dtype, shape):
    array = sample(dtype, shape)
    assert encode(array).SerializeToString() == tf.make_tensor_proto(array).SerializeToString()


@pytest.mark.parametrize("array", [np.arange(24, dtype=np.float32).reshape(4, 6)[::2, ::3],
                                   np.array(["é", b"\xff"], dtype=object)], ids=["strided", "str among bytes"])
def test_strided_outputs_and_text_encode_as_tensorflow_encodes_them(array):
    assert encode(array).SerializeToString() == tf.make_tensor_proto(array).SerializeToString()


@pytest.mark.parametrize("dtype", [d for d in SERVED if d != "DT_STRING"])
def test_values_in_the_dtypes_repeated_field_decode_too(dtype):
    want = sample(dtype, (2, 3))
    kind = next(k for k in KINDS.values() if k.name == dtype)
    values = want.view(np.uint16) if dtype == "DT_HALF" else want
    proto = tensor(dtype, [2, 3], **{kind.field: values.reshape(-1).tolist()})
    got = decode_inputs({"x": proto}, LIMIT)["x"]
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got, tf.make_ndarray(proto))


@pytest.mark.parametrize("dtype, field, value", [("DT_FLOAT", "float_val", [0.5]), ("DT_INT64", "int64_val", [7]),
                                                 ("DT_STRING", "string_val", [b"jpeg"])])
def test_one_value_fills_the_shape_as_tensorflow_fills_it(dtype, field, value):
    proto = tensor(dtype, [2, 5], **{field: value})
    np.testing.assert_array_equal(decode_inputs({"x": proto}, LIMIT)["x"], tf.make_ndarray(proto))


@pytest.mark.parametrize("proto", [
    tensor("DT_STRING", [1_000_000_000]),  # no values at all
    tensor("DT_FLOAT", [2147483648, 2147483648]),
    tensor("DT_STRING", [20_000_000], string_val=[b"x"]),
], ids=["string-no-values", "float-2^62-elements", "one-string-fills-20M"])
def test_a_shape_claimed_without_its_values_is_refused_in_microseconds_allocating_nothing(proto):
    tracemalloc.start()
    try:
        started = time.perf_counter()
        refused(proto, "values do not fill shape|too large for any")
        elapsed = time.perf_counter() - started
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert elapsed < 0.01, f"{elapsed * 1e6:.0f} us"
    assert peak < 64 << 10, f"{peak} bytes allocated"


def test_a_shape_whose_int64_product_wraps_is_still_counted_exactly():
    """2^62 x 4 is 2^64 elements: numpy's int64 product says 0, which would pass as an empty tensor."""
    assert np.prod(np.array([2 ** 62, 4], dtype=np.int64)) == 0
    refused(tensor("DT_FLOAT", [2 ** 62, 4]), "too large for any array")
    refused(tensor("DT_FLOAT", [2 ** 62, 4, 0]), "too large for any array")
    refused(tensor("DT_FLOAT", [2 ** 59, 3], tensor_content=b"\0" * 8), "needs 6917529027641081856 bytes")
    assert decode_inputs({"x": tensor("DT_FLOAT", [2 ** 59, 3, 0])}, LIMIT)["x"].shape == (2 ** 59, 3, 0)


@pytest.mark.parametrize("proto, match", [
    (tensor("DT_FLOAT", [2, -1], float_val=[1.0, 2.0]), "negative dimension"),
    (tensor("DT_FLOAT", [], unknown_rank=True, float_val=[1.0]), "unknown_rank"),
    (tensor("DT_FLOAT", [1] * 65, float_val=[1.0]), "shape has 65 dimensions, more than 64"),
    (tensor_pb2.TensorProto(dtype=types_pb2.DT_COMPLEX64), "dtype DT_COMPLEX64 is not served"),
    (tensor_pb2.TensorProto(dtype=types_pb2.DT_RESOURCE), "dtype DT_RESOURCE is not served"),
    (tensor_pb2.TensorProto(dtype=types_pb2.DT_FLOAT_REF), "dtype DT_FLOAT_REF is not served"),
    (tensor_pb2.TensorProto(dtype=999), "dtype 999 is not served"),
    (tensor("DT_FLOAT", [4], tensor_content=b"\0" * 15), "holds 15 bytes; shape \\[4\\] of DT_FLOAT needs 16 bytes"),
    (tensor("DT_FLOAT", [4], tensor_content=b"\0" * 17), "holds 17 bytes"),
    (tensor("DT_FLOAT", [4], tensor_content=b"\0" * 16, float_val=[1.0]), "not both \\(float_val too\\)"),
    (tensor("DT_STRING", [2], tensor_content=b"ab"), "DT_STRING values go in string_val"),
    (tensor("DT_FLOAT", [2], int_val=[1, 2]), "DT_FLOAT values go in float_val or tensor_content, not int_val"),
    (tensor("DT_INT32", [3], int_val=[1, 2]), "2 values do not fill shape \\[3\\]"),
    (tensor("DT_INT32", [3], int_val=[1, 2, 3, 4]), "4 values do not fill shape \\[3\\]"),
    (tensor("DT_INT32", [3]), "0 values do not fill shape \\[3\\]"),
    (tensor("DT_FLOAT", [FILL_LIMIT["numbers"] + 1], float_val=[1.0]), f"fills at most {FILL_LIMIT['numbers']}"),
    (tensor("DT_STRING", [FILL_LIMIT["strings"] + 1], string_val=[b"a"]), f"fills at most {FILL_LIMIT['strings']}"),
    (tensor("DT_INT8", [2], int_val=[1, 1000]), "values are not DT_INT8"),
    (tensor("DT_UINT8", [1], int_val=[-1]), "values are not DT_UINT8"),
    (tensor("DT_HALF", [1], half_val=[70000]), "values are not DT_HALF"),
])
def test_a_tensor_whose_parts_disagree_is_refused(proto, match):
    refused(proto, match)


def test_the_limit_counts_every_tensor_of_the_request_and_the_string_overhead():
    """Two tensors each under the limit are refused together; a million empty strings are 41 MB of objects."""
    half = tensor("DT_UINT8", [600], tensor_content=b"\0" * 600)
    assert decode_inputs({"a": half}, 1000)["a"].shape == (600,)
    with pytest.raises(ServingError, match="1200 bytes \\('a': 600, 'b': 600\\), over the 1000-byte limit"):
        decode_inputs({"a": half, "b": half}, 1000)
    strings = tensor("DT_STRING", [1000], string_val=[b""] * 1000)
    refused(strings, "over the 40000-byte limit", limit=40_000)
    assert decode_inputs({"x": strings}, 50_000)["x"].shape == (1000,)


def test_one_string_filled_over_the_shape_counts_its_bytes_once_per_element():
    """TensorFlow's string tensor holds a copy of each element: a 300 KB value filled over [4096], a 300 KB
    message, took a worker from 0.6 to 1.8 GB before the first image was even looked at."""
    value = b"\xff" * 300_000
    bomb = tensor("DT_STRING", [4096], string_val=[value])
    refused(bomb, f"would decode to {4096 * (STRING_ELEMENT_BYTES + len(value))} bytes", limit=LIMIT)
    assert decode_inputs({"x": tensor("DT_STRING", [4], string_val=[value])}, LIMIT)["x"].shape == (4,)


def test_a_filled_tensor_is_charged_what_it_decodes_to_and_a_sent_one_nothing_more():
    """Its message carried one value: 64 calls of 39 bytes, each filling 2^20 floats, took +754 MiB uncharged."""
    charged = []
    filled = tensor_pb2.TensorProto(dtype=types_pb2.DT_FLOAT, float_val=[1.0],
                                    tensor_shape=tensor_shape_pb2.TensorShapeProto(dim=[
                                        tensor_shape_pb2.TensorShapeProto.Dim(size=FILL_LIMIT["numbers"])]))
    sent = tf.make_tensor_proto(np.arange(6, dtype=np.float32))
    arrays = decode_inputs({"x": filled, "y": sent}, 1 << 30, charged.append)
    assert charged == [FILL_LIMIT["numbers"] * 4 * BODY_BYTES_FACTOR] and arrays["x"].shape == (FILL_LIMIT["numbers"],)
    charged.clear()
    decode_inputs({"y": sent}, 1 << 30, charged.append)
    assert charged == []
