"""What KServe V2's two wire formats (JSON with Triton's binary extension over REST, Triton's protos over gRPC) share
about tensors: the datatypes, the declared element count checked before anything is allocated, the binary form
(little-endian numbers; BYTES framed as `v2_bytes` frames them) and Triton's
classification extension.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from serving.core import NUMPY_DTYPES, Code, ServingError, invalid
from serving.protocols.codec import v2_bytes
from serving.protocols.codec.strict_json import Charge, no_charge
from serving.protocols.codec.tensor_proto import STRING_ELEMENT_BYTES, element_count

# TF dtype name <-> V2 datatype <-> numpy dtype (BYTES is an object array of bytes).
DATATYPES = {"DT_BOOL": "BOOL", "DT_UINT8": "UINT8", "DT_UINT16": "UINT16", "DT_UINT32": "UINT32",
             "DT_UINT64": "UINT64", "DT_INT8": "INT8", "DT_INT16": "INT16", "DT_INT32": "INT32",
             "DT_INT64": "INT64", "DT_HALF": "FP16", "DT_FLOAT": "FP32", "DT_DOUBLE": "FP64",
             "DT_STRING": "BYTES"}
NUMPY_TYPES = {DATATYPES[tf_name]: dtype for tf_name, dtype in NUMPY_DTYPES.items()}
_DATATYPE_OF = {np.dtype(dtype): name for name, dtype in NUMPY_TYPES.items()}


def declared_count(name: str, datatype: str, shape: list[int]) -> int:
    """The elements a V2 input's datatype and shape declare, checked before anything is allocated."""
    if datatype != "BYTES" and datatype not in NUMPY_TYPES:
        raise invalid(f"Input {name!r}: unsupported datatype {datatype!r}")
    return element_count(name, shape, np.dtype(NUMPY_TYPES.get(datatype, object)).itemsize)


def decode_raw(raw: bytes | memoryview, name: str, datatype: str, shape: list[int], count: int,
               charge: Charge = no_charge) -> np.ndarray:
    """One tensor's binary data (Triton's binary extension over REST, raw_input_contents over gRPC) as a flat
    array of the `count` elements its shape declares: little-endian numbers, or length-prefixed BYTES.

    A shape that the bytes cannot hold is a malformed request (400, as Triton answers it), found before anything is
    allocated or charged: numbers must be exactly count x itemsize bytes, and BYTES elements at least their 4-byte
    prefix each, so that a shape claiming a billion elements over a few bytes is refused as malformed rather than
    charged to the memory budget (a 413 for a request that is not large). Each BYTES element then becomes an
    object many times its prefix, which `charge` (the request's memory budget) is told before they are made."""
    if datatype == "BYTES":
        check_bytes_hold(raw, name, shape, count)
        charge(count * STRING_ELEMENT_BYTES)
        try:
            return np.array(v2_bytes.unframe(raw, count), dtype=object)
        except v2_bytes.FramingError as error:
            raise invalid(f"Input {name!r}: {error}") from None
    dtype = np.dtype(NUMPY_TYPES[datatype]).newbyteorder("<")
    if len(raw) != count * dtype.itemsize:
        raise invalid(f"Input {name!r}: {len(raw)} bytes do not hold shape {shape} of {datatype}")
    return np.frombuffer(raw, dtype=dtype).astype(NUMPY_TYPES[datatype], copy=False)  # a view on little-endian


def check_bytes_hold(raw: bytes | memoryview, name: str, shape: list[int], count: int) -> None:
    """BYTES elements take at least their 4-byte prefix each: a shape its bytes cannot hold is malformed, whatever
    it would decode to."""
    if count * v2_bytes.PREFIX_BYTES > len(raw):
        raise invalid(f"Input {name!r}: {len(raw)} bytes cannot hold the {count} BYTES elements of shape "
                      f"{shape} (each takes at least {v2_bytes.PREFIX_BYTES})")


def datatype_of(array: np.ndarray) -> str:
    if array.dtype.kind in "OSU":
        return "BYTES"
    name = _DATATYPE_OF.get(array.dtype)
    if name is None:
        raise ServingError(Code.INTERNAL, f"Output dtype {array.dtype} has no V2 datatype")
    return name


def binary_data(array: np.ndarray, datatype: str) -> bytes:
    """`array` (of V2 `datatype`, as datatype_of gives it) in the binary form."""
    if datatype != "BYTES":
        return array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()  # tobytes writes C order
    return v2_bytes.frame(v if isinstance(v, bytes) else str(v).encode() for v in array.reshape(-1))


_CLASSIFIABLE = frozenset({"UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP32", "FP64"})


def classification(scores: np.ndarray, count: int, class_names: list[str], batched: bool = True) -> np.ndarray:
    """Triton's classification extension: per row (all past the first dimension) the top `count` as
    "score:index[:label]" strings, [rows, count]; [count] for one row without a batch dimension, or for a model that
    does not batch (`batched` False: Triton ranks its whole output, http_server.cc). The row's width is stated,
    not left to reshape's -1, which cannot infer it for an empty batch."""
    by_row = batched and scores.ndim > 1
    rows = scores.reshape(len(scores), math.prod(scores.shape[1:])) if by_row else scores.reshape(1, -1)
    out = []
    integers = scores.dtype.kind in "iu"  # Triton writes a score as std::to_string of its type: 3, or 3.000000
    for row in rows:
        top = np.argsort(-row.astype(np.float64) if integers else -row, kind="stable")[:count]
        out.append([((f"{row[i]}" if integers else f"{row[i]:f}") + f":{i}"
                     + (f":{class_names[i]}" if i < len(class_names) else "")).encode() for i in top])
    top_count = min(count, rows.shape[1])
    return np.array(out, dtype=object).reshape((len(rows), top_count) if by_row else (top_count,))


def output(array: np.ndarray, classes: int, class_names: list[str], name: str,
           batched: Callable[[], bool]) -> np.ndarray:
    """An output as answered: with classes > 0, its top classes (Triton's classification extension), which only
    a numeric output has, per row if the model batches (`batched`, asked only then)."""
    if not classes:
        return array
    datatype = datatype_of(array)
    if datatype not in _CLASSIFIABLE:  # Triton's classification.cc ranks these types only
        raise invalid(f"Output {name!r}: class result not available for output due to unsupported type "
                      f"'{datatype}'")
    return classification(array, classes, class_names, batched())
