"""KServe V2 (Open Inference Protocol) over REST: the JSON inference request and answer, with Triton's binary-data
extension (a JSON header of Inference-Header-Content-Length bytes, then each binary tensor's bytes in order) and
its classification extension (docs/protocols.md, 'KServe V2').

The header is decoded by msgspec into the typed request below, so a wrong type, a missing field, an unknown
datatype or a negative dimension is refused with the field's path; every declared size is then checked against
the data or the binary tail before an array is made.
"""
from __future__ import annotations

import base64
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec
import numpy as np
from msgspec import UNSET, Meta, UnsetType

from serving.core import PredictResult, invalid
from serving.protocols.codec import strict_json
from serving.protocols.codec.strict_json import Charge
from serving.protocols.codec.text import ascii_int, b64decode
from serving.protocols.codec.v2_tensors import (
    NUMPY_TYPES,
    binary_data,
    datatype_of,
    declared_count,
    decode_raw,
    output,
)

HEADER_LENGTH = "Inference-Header-Content-Length"
Datatype = Literal["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP16", "FP32",
                   "FP64", "BYTES"]
Count = Annotated[int, Meta(ge=0)]


class InputParameters(msgspec.Struct):
    binary_data_size: Count | UnsetType = UNSET
    content_type: str | UnsetType = UNSET


class InferInput(msgspec.Struct):
    name: str
    shape: list[Count]
    datatype: Datatype
    parameters: InputParameters | UnsetType = UNSET
    data: Any = UNSET


class OutputParameters(msgspec.Struct):
    binary_data: bool | UnsetType = UNSET
    classification: Count | UnsetType = UNSET


class InferOutput(msgspec.Struct):
    name: str
    parameters: OutputParameters | UnsetType = UNSET


class RequestParameters(msgspec.Struct):
    content_type: str | UnsetType = UNSET
    binary_data_output: bool | UnsetType = UNSET
    signature_name: str | UnsetType = UNSET


class InferRequest(msgspec.Struct):
    inputs: Annotated[list[InferInput], Meta(min_length=1)]
    outputs: list[InferOutput] | UnsetType = UNSET
    id: Any = UNSET  # echoed as it came, whatever its JSON type
    parameters: RequestParameters | UnsetType = UNSET


_REQUEST = msgspec.json.Decoder(InferRequest)
_NO_PARAMETERS = RequestParameters()
_NO_INPUT_PARAMETERS = InputParameters()
_NO_OUTPUT_PARAMETERS = OutputParameters()


@dataclass(slots=True)
class Output:
    """A requested output: its name, whether it goes back as binary data, and its top classes (0: the tensor)."""
    name: str
    binary: bool
    classes: int


@dataclass(slots=True)
class Infer:
    """A decoded inference request: the inputs as arrays of their declared shapes, and what it asks back."""
    inputs: dict[str, np.ndarray]
    signature_name: str
    outputs: list[Output]  # empty: every output of the signature
    binary_output: bool  # the default of outputs not listed
    id: Any  # UNSET: none was sent


def _keys(request: InferRequest) -> int:
    """The keys the typed request holds (strict_json.check_keys): those of each object in it."""
    parameters = [request.parameters, *(i.parameters for i in request.inputs),
                  *(o.parameters for o in request.outputs or ())]
    return strict_json.present(request) + sum(map(strict_json.present, request.inputs)) + \
        sum(map(strict_json.present, request.outputs or ())) + \
        sum(strict_json.present(p) for p in parameters if not isinstance(p, UnsetType))


def decode_request(body: bytes, header_length: str | None, charge: Charge) -> Infer:
    """A V2 inference request, its JSON header followed by the binary tail that `header_length` (the
    Inference-Header-Content-Length header) says where to split off, if sent."""
    tail = memoryview(body)  # the binary data is read in place, each BYTES element copied once
    if header_length is None:
        header, tail = body, tail[:0]
    else:
        length = ascii_int(header_length)
        if length is None or length > len(body):
            raise invalid(f"{HEADER_LENGTH} {header_length!r} does not fit a {len(body)}-byte body")
        header, tail = body[:length], tail[length:]
    request, document = strict_json.decode(header, _REQUEST, charge)
    strict_json.check_keys(document, _keys(request))  # before the data is read: an object in it is refused there
    parameters = request.parameters or _NO_PARAMETERS
    base64_default = parameters.content_type == "base64"
    inputs, offset = {}, 0
    for spec in request.inputs:
        if spec.name in inputs:
            raise invalid(f"Input {spec.name!r} is given twice")
        inputs[spec.name], offset = _decode_input(spec, tail, offset, base64_default, charge)
    if offset != len(tail):  # Triton's words (http_server.cc): bytes no input claims are a mistake, not padding
        raise invalid(f"unexpected additional input data: {len(tail) - offset} bytes past the inputs' "
                      "binary_data_size")
    binary_output = parameters.binary_data_output is True
    return Infer(inputs, parameters.signature_name or "", [_output(o, binary_output) for o in request.outputs or ()],
                 binary_output, request.id)


def _output(spec: InferOutput, binary_default: bool) -> Output:
    parameters = spec.parameters or _NO_OUTPUT_PARAMETERS
    binary = binary_default if isinstance(parameters.binary_data, UnsetType) else parameters.binary_data
    return Output(spec.name, binary, parameters.classification or 0)


def _flatten(data: Any) -> list[Any]:
    if isinstance(data, list):
        return [x for item in data for x in _flatten(item)]
    return [data]


def _decode_input(spec: InferInput, tail: memoryview, offset: int, base64_default: bool,
                  charge: Charge) -> tuple[np.ndarray, int]:
    """One input as an array of its shape, and the offset into the binary tail past its data."""
    name, datatype, shape = spec.name, spec.datatype, spec.shape
    count = declared_count(name, datatype, shape)
    parameters = spec.parameters or _NO_INPUT_PARAMETERS
    if not isinstance(parameters.binary_data_size, UnsetType):
        if spec.data is not UNSET:
            raise invalid(f"Input {name!r} must set only one of the following fields: 'data', 'binary_data_size' "
                          "in 'parameters'")
        size = parameters.binary_data_size
        if offset + size > len(tail):
            raise invalid(f"Input {name!r}: binary_data_size {size} exceeds the binary data sent")
        values = decode_raw(tail[offset:offset + size], name, datatype, shape, count, charge)
        offset += size
    elif spec.data is not UNSET:
        flat = _flatten(spec.data)
        if datatype == "BYTES":
            content_type = parameters.content_type
            is_base64 = (base64_default if isinstance(content_type, UnsetType) else content_type == "base64")
            values = np.array([_decode_string(v, name, is_base64) for v in flat], dtype=object)
        else:
            if None in flat:  # numpy would make JSON null a NaN (or a TypeError for integers); REST refuses it too
                raise invalid(f"Input {name!r}: data is not {datatype}: null is not a number")
            try:
                values = np.array(flat, dtype=NUMPY_TYPES[datatype])
            except (TypeError, ValueError, OverflowError) as exc:  # OverflowError: INT8 1000, UINT8 -1
                raise invalid(f"Input {name!r}: data is not {datatype}: {exc}") from None
    else:
        raise invalid(f"Input {name!r} has neither 'data' nor parameters.binary_data_size")
    if values.size != count:
        raise invalid(f"Input {name!r}: {values.size} elements do not match shape {shape}")
    return values.reshape(shape), offset


def _decode_string(value: Any, name: str, is_base64: bool) -> bytes:
    if not isinstance(value, str):
        raise invalid(f"Input {name!r}: BYTES data must be strings")
    if not is_base64:
        return value.encode("utf-8")
    return b64decode(value, f"input {name!r}")


# ---- answers -----------------------------------------------------------------------------------------------------

def _json_data(array: np.ndarray, datatype: str) -> tuple[list[Any], dict[str, Any]]:
    """Flattened JSON data; BYTES that are not UTF-8 go as base64 and say so."""
    if datatype != "BYTES":
        return array.reshape(-1).tolist(), {}
    items = [v if isinstance(v, bytes) else str(v).encode() for v in array.reshape(-1)]
    try:
        return [v.decode("utf-8") for v in items], {}
    except UnicodeDecodeError:
        return [base64.b64encode(v).decode("ascii") for v in items], {"content_type": "base64"}


def encode_response(request: Infer, result: PredictResult, batched: Callable[[], bool]) -> tuple[bytes, int | None]:
    """The answer's bytes, and the length of its JSON header when binary data follows it (None: JSON only);
    `batched`: whether the model batches, for the classification extension (v2_tensors.output)."""
    requested = request.outputs or [Output(name, request.binary_output, 0) for name in result.outputs]
    entries, tail, finite = [], [], True
    for out in requested:
        array = output(result.outputs[out.name], out.classes, result.class_names, out.name, batched)
        datatype = datatype_of(array)
        entry: dict[str, Any] = {"name": out.name, "datatype": datatype, "shape": list(array.shape)}
        if out.binary:
            raw = binary_data(array, datatype)
            entry["parameters"] = {"binary_data_size": len(raw)}
            tail.append(raw)
        else:
            entry["data"], extra = _json_data(array, datatype)
            # the sum of the values is finite only if each is (an overflow, too, takes the standard library's path,
            # which writes finite values as well): for an answer's few values, 1/10 of numpy's isfinite
            finite = finite and (array.dtype.kind != "f" or math.isfinite(sum(entry["data"])))
            if extra:
                entry["parameters"] = extra
        entries.append(entry)
    header: dict[str, Any] = {"model_name": result.model, "model_version": str(result.version)}
    if request.id is not UNSET:
        header["id"] = request.id
    body = strict_json.encode({**header, "outputs": entries}, finite)
    if not tail:
        return body, None
    return body + b"".join(tail), len(body)
