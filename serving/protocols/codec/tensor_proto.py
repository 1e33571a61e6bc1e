"""TF Serving's TensorProtos (gRPC Predict): a client's as numpy arrays, with every size the client declares checked
before anything is allocated, and the outputs back as TensorProtos.

`tf.make_ndarray` believes the shape: a 30-byte PredictRequest that declares DT_STRING [1000000000] and sends no
values, or DT_FLOAT [2147483648, 2147483648], or one string_val for [20000000], makes it allocate and fill the
whole shape (gigabytes, for half a minute). Here a tensor's element count comes from its shape in exact Python
integers, and a request is refused with INVALID_ARGUMENT, before any array exists, unless:

- its dtype is one Petal serves and its shape has a known rank and no negative dimension;
- all its tensors together decode to at most `limit` bytes (--grpc_max_message_bytes: nothing decodes to more
  than the largest message a client may send), a string element counting its reference and its bytes object's
  header, and a string filled from one value that value's bytes once per element;
- `tensor_content` holds exactly count x itemsize bytes, or the dtype's value field holds exactly count values,
  or one value that TensorFlow's fill rule repeats over the shape, for at most FILL_LIMIT elements (TensorFlow
  also fills from fewer values, and from none, which is how the bombs above allocate without sending anything).

Values go in the one field their dtype uses; a tensor with values in two fields is refused rather than guessed at.
No row limit is checked here: the batcher splits a request of more rows than max_batch_size into batches, so the
byte limit is what bounds a request's rows.
"""
from __future__ import annotations

import math
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import tensor_pb2, tensor_shape_pb2, types_pb2

from serving.core import NUMPY_DTYPES, SignatureInfo, invalid
from serving.memory_costs import BODY_BYTES_FACTOR

# The fields of a TensorProto that say what it is rather than hold its values.
DESCRIPTION_FIELDS = frozenset({"dtype", "tensor_shape", "version_number"})
# The repeated field each served dtype's values arrive in (tensorflow/core/framework/tensor.proto).
VALUE_FIELDS = {"DT_FLOAT": "float_val", "DT_DOUBLE": "double_val", "DT_HALF": "half_val", "DT_INT8": "int_val",
                "DT_INT16": "int_val", "DT_INT32": "int_val", "DT_INT64": "int64_val", "DT_UINT8": "int_val",
                "DT_UINT16": "int_val", "DT_UINT32": "uint32_val", "DT_UINT64": "uint64_val", "DT_BOOL": "bool_val",
                "DT_STRING": "string_val"}
# Enough for any tensor a client fills from one value by hand (a 224 x 224 x 3 image is 150528 numbers); a string
# fill stays small because each element is an image the server then inspects.
FILL_LIMIT = {"numbers": 1 << 20, "strings": 4096}
# What numpy and Python hold for each string element besides its bytes: the array's reference and the header of
# the bytes object.
STRING_ELEMENT_BYTES = np.dtype(object).itemsize + sys.getsizeof(b"")
INT64_MAX = (1 << 63) - 1
MAX_DIMS = 64  # numpy's (TensorFlow allows 254)


@dataclass(frozen=True)
class Kind:
    """How one served dtype decodes."""
    name: str
    dtype: np.dtype  # of the decoded array
    field: str  # the repeated field its values arrive in
    wire: np.dtype  # of those values as numpy reads them (half_val carries float16 bit patterns in integers)
    element_bytes: int
    fill_limit: int


def _kinds() -> dict[int, Kind]:
    kinds = {types_pb2.DT_STRING: Kind("DT_STRING", np.dtype(object), "string_val", np.dtype(object),
                                       STRING_ELEMENT_BYTES, FILL_LIMIT["strings"])}
    for name, scalar in NUMPY_DTYPES.items():
        dtype = np.dtype(scalar)
        wire = np.dtype(np.uint16) if name == "DT_HALF" else dtype
        kinds[types_pb2.DataType.Value(name)] = Kind(name, dtype, VALUE_FIELDS[name], wire, dtype.itemsize,
                                                     FILL_LIMIT["numbers"])
    return kinds


KINDS = _kinds()


@dataclass(frozen=True)
class Plan:
    """A tensor whose declared sizes have been checked: what decoding it will allocate, and from what."""
    name: str
    kind: Kind
    shape: tuple[int, ...]
    count: int
    content: bytes | None  # tensor_content, when the values come that way
    values: Any  # the repeated value field otherwise (possibly empty)

    @property
    def nbytes(self) -> int:
        """What the tensor takes once TensorFlow holds it: a string tensor holds a copy of every element's bytes,
        so one string_val filled over the shape costs its length for each element (a 300 KB value filled over
        [4096] is 1.2 GB), while the message carried it once."""
        if self.kind.name == "DT_STRING" and self.content is None and len(self.values) == 1:
            return self.count * (self.kind.element_bytes + len(self.values[0]))
        return self.count * self.kind.element_bytes

    @property
    def filled(self) -> bool:
        """Whether one value is repeated over the shape, so that the message carried a fraction of the tensor."""
        return self.content is None and len(self.values) != self.count


def decode_inputs(protos: Mapping[str, Any], limit: int, charge: Callable[[int], Any] | None = None
                  ) -> dict[str, np.ndarray]:
    """A request's named TensorProtos as arrays; every tensor is checked, and the total against `limit` bytes,
    before the first is decoded. A filled tensor's bytes are charged (`charge`, the call's hold on the memory
    budget, BODY_BYTES_FACTOR a byte as a message's) before it is decoded: its message was charged for a few bytes,
    and 64 calls of 39 bytes each, filling 2^20 numbers over a model that batches, took +754 MiB."""
    plans = [plan(name, proto) for name, proto in protos.items()]
    total = sum(p.nbytes for p in plans)
    if total > limit:
        sizes = ", ".join(f"{p.name!r}: {p.nbytes}" for p in plans)
        raise invalid(f"Tensors would decode to {total} bytes ({sizes}), over the {limit}-byte limit "
                      "(--grpc_max_message_bytes)")
    filled = sum(p.nbytes for p in plans if p.filled)
    if filled and charge is not None:
        charge(filled * BODY_BYTES_FACTOR)
    return {p.name: decode(p) for p in plans}


def plan(name: str, proto: Any) -> Plan:
    """Check one TensorProto's dtype, shape and value count against each other, allocating nothing."""
    kind = KINDS.get(proto.dtype)
    if kind is None:
        served = ", ".join(sorted(k.name for k in KINDS.values()))
        dtype = types_pb2.DataType.Name(proto.dtype) if proto.dtype in types_pb2.DataType.values() else proto.dtype
        raise invalid(f"Input {name!r}: dtype {dtype} is not served (served: {served})")
    if proto.tensor_shape.unknown_rank:
        raise invalid(f"Input {name!r}: a request tensor needs a known shape, not unknown_rank")
    shape = tuple(d.size for d in proto.tensor_shape.dim)
    count = element_count(name, shape, kind.dtype.itemsize)
    fields = {field.name: value for field, value in proto.ListFields() if field.name not in DESCRIPTION_FIELDS}
    content = fields.pop("tensor_content", None)
    if content is not None:
        if fields or kind.name == "DT_STRING":
            raise invalid(f"Input {name!r}: {kind.name} values go in {kind.field}" +
                          (f" or tensor_content, not both ({', '.join(sorted(fields))} too)" if fields else ""))
        if len(content) != count * kind.dtype.itemsize:
            raise invalid(f"Input {name!r}: tensor_content holds {len(content)} bytes; shape {list(shape)} of "
                          f"{kind.name} needs {count * kind.dtype.itemsize} bytes")
        return Plan(name, kind, shape, count, content, ())
    stray = sorted(set(fields) - {kind.field})
    if stray:
        raise invalid(f"Input {name!r}: {kind.name} values go in {kind.field} or tensor_content, not "
                      f"{', '.join(stray)}")
    values = fields.get(kind.field, ())
    if len(values) != count and not (len(values) == 1 and count <= kind.fill_limit):
        raise invalid(f"Input {name!r}: {len(values)} values do not fill shape {list(shape)} ({count} elements; "
                      f"one value fills at most {kind.fill_limit})")
    return Plan(name, kind, shape, count, None, values)


def element_count(name: str, shape: tuple[int, ...] | list[int], itemsize: int) -> int:
    """The elements of a declared shape, exact (numpy's int64 product wraps for huge shapes), refusing one that
    no numpy array can have: a negative dimension, more than MAX_DIMS of them, or more than 2^63 - 1 bytes in its
    non-zero dimensions (numpy refuses that even for an empty array)."""
    if any(d < 0 for d in shape):
        raise invalid(f"Input {name!r}: shape {list(shape)} has a negative dimension")
    if len(shape) > MAX_DIMS:
        raise invalid(f"Input {name!r}: shape has {len(shape)} dimensions, more than {MAX_DIMS}")
    if math.prod(d for d in shape if d) * itemsize > INT64_MAX:
        raise invalid(f"Input {name!r}: shape {list(shape)} is too large for any array")
    return math.prod(shape)


def decode(p: Plan) -> np.ndarray:
    """The array of a checked tensor; strings are an object array of bytes, as the dataplane expects."""
    kind = p.kind
    if p.content is not None:
        return np.frombuffer(p.content, dtype=kind.dtype).reshape(p.shape)
    try:
        values = np.array(list(p.values) if kind.name == "DT_STRING" else p.values, dtype=kind.wire)
    except (OverflowError, ValueError, TypeError) as exc:  # int_val 1000 for DT_INT8, half_val -1
        raise invalid(f"Input {p.name!r}: values are not {kind.name}: {exc}") from None
    if kind.wire != kind.dtype:
        values = values.view(kind.dtype)
    if values.size != p.count:
        return np.full(p.shape, values[0], dtype=kind.dtype)
    return values.reshape(p.shape)



def signature_inputs(protos: Mapping[str, Any], limit: int, charge: Callable[[int], Any] | None = None
                     ) -> Callable[[SignatureInfo], dict[str, np.ndarray]]:
    """A Predict request's tensors as DataPlane.predict's function of the signature, so they are decoded once the
    model is found (TF Serving looks the servable up first), within `limit` bytes (`decode_inputs`). A TensorProto
    carries its dtype, and one that is not the signature's is refused with the text of the Session that TF Serving
    feeds it to (a float64 numpy array sent for a float input, say), never cast as a JSON number is: position i
    counts the signature's inputs in name order, as serving/core/runtimes.py feeds them."""
    def inputs(info: SignatureInfo) -> dict[str, np.ndarray]:
        sent, wanted = sorted(protos), sorted(info.inputs)
        if len(sent) > len(wanted) or (len(sent) < len(wanted) and not info.defaults):
            # predict_util.cc VerifyRequestInputsSize's words, which TF Serving's users know from their logs
            extra = ",".join(n for n in sent if n not in info.inputs)
            missing = ",".join(n for n in wanted if n not in protos)
            raise invalid(f"input size does not match signature: {len(sent)}!={len(wanted)} len({{{','.join(sent)}}})"
                          f" != len({{{','.join(wanted)}}}). Sent extra: {{{extra}}}. Missing but required: "
                          f"{{{missing}}}.")
        arrays = decode_inputs(protos, limit, charge)  # every dtype it leaves is one Petal serves, a Kind
        for i, name in enumerate(sorted(info.inputs)):
            have = KINDS[protos[name].dtype].name if name in protos else info.inputs[name].dtype
            if have != info.inputs[name].dtype:
                raise invalid(f"Expects arg[{i}] to be {_dtype_string(info.inputs[name].dtype)} but "
                              f"{_dtype_string(have)} is provided")
        return arrays
    return inputs


def _dtype_string(name: str) -> str:
    """TensorFlow's DataTypeString: DT_FLOAT is "float", DT_INT64 "int64"."""
    return name.removeprefix("DT_").lower()


# The dtypes whose values `tf.make_tensor_proto` writes as raw `tensor_content` when there is more than one
# (tensor_util.py's _TENSOR_CONTENT_TYPES); the others, and single values, go in their dtype's value field.
CONTENT_DTYPES = frozenset(KINDS[types_pb2.DataType.Value(name)].dtype for name in NUMPY_DTYPES
                           if name not in ("DT_BOOL", "DT_UINT16"))
KIND_OF_DTYPE = {kind.dtype: (enum, kind) for enum, kind in KINDS.items()}


def encode(array: np.ndarray) -> Any:
    """An output as the TensorProto TF Serving answers with, byte for byte the one `tf.make_tensor_proto` makes,
    built here because its generic path costs about 60 Python calls an output (docs/performance.md)."""
    enum, kind = KIND_OF_DTYPE.get(array.dtype, (None, None))
    if kind is None:
        return tf.make_tensor_proto(array)
    shape = tensor_shape_pb2.TensorShapeProto(dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=d)
                                                   for d in array.shape])
    proto = tensor_pb2.TensorProto(dtype=enum, tensor_shape=shape)
    if kind.dtype in CONTENT_DTYPES and array.size > 1:
        proto.tensor_content = array.tobytes()
        return proto
    try:
        getattr(proto, kind.field).extend(array.ravel().view(kind.wire).tolist())
    except TypeError:  # a str among the strings: TensorFlow encodes it as UTF-8
        return tf.make_tensor_proto(array)
    return proto
