"""TF Serving's REST JSON (docs/protocols.md): predict in row ("instances") or columnar ("inputs") form, classify
and regress "examples" with an optional "context", `{"b64": ...}` for bytes, and the answers TF Serving writes.

A body is decoded by msgspec into a typed object (strict_json), then its tensor values are walked once to turn
each `{"b64": ...}` into bytes, and only when the document holds objects besides the ones the body's layout
explains (a body of numbers is handed to numpy as msgspec made it). Which input an unnamed tensor is for depends
on the signature, so a decoded predict body gives its tensors for one (`PredictRequest.tensors`), under the
DataPlane's hold on the version. Examples become the tf.Examples TF Serving builds from them (its json_tensor.cc:
integers and booleans are int64_list, other numbers float_list, strings and {"b64"} bytes_list), with its texts.
Unknown top-level keys are ignored, as TF Serving ignores them.
"""
from __future__ import annotations

import base64
import json
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

import msgspec
import numpy as np
import orjson
from google.protobuf import json_format
from msgspec import UNSET
from tensorflow.core.example import example_pb2, feature_pb2
from tensorflow_serving.apis import input_pb2

from serving.core import Code, Result, ServingError, SignatureInfo, invalid
from serving.protocols.codec import strict_json
from serving.protocols.codec.strict_json import Charge
from serving.protocols.codec.text import b64decode

_INT64 = (-(1 << 63), (1 << 63) - 1)
_UINT64_MAX = (1 << 64) - 1


class _PredictBody(msgspec.Struct):
    """Untyped, so that what is wrong with a field gets TF Serving's text for it (json_tensor.cc), which its clients
    and its own tests match on."""
    signature_name: Any = UNSET
    instances: Any = UNSET
    inputs: Any = UNSET


class _ExamplesBody(msgspec.Struct):
    signature_name: Any = UNSET
    context: Any = UNSET
    examples: Any = UNSET


_PREDICT = msgspec.json.Decoder(_PredictBody)
_EXAMPLES = msgspec.json.Decoder(_ExamplesBody)


# --- {"b64": ...} -------------------------------------------------------------------------------------------------

def _is_b64(value: object) -> TypeGuard[dict]:
    return isinstance(value, dict) and len(value) == 1 and "b64" in value


def _named(value: object) -> TypeGuard[dict]:
    return isinstance(value, dict) and not _is_b64(value)


class _Bytes:
    """Replaces each {"b64": ...} by its bytes, counting them: each is one key of the document (strict_json.
    check_keys). Values nest at most strict_json.MAX_JSON_DEPTH deep, so the recursion is bounded."""
    __slots__ = ("keys",)

    def __init__(self) -> None:
        self.keys = 0

    def _decoded(self, value: dict) -> bytes:
        self.keys += 1
        return b64decode(value["b64"], "'b64'")

    def tensor(self, value: object) -> object:
        if isinstance(value, list):
            return [self.tensor(v) for v in value]
        if _is_b64(value):
            return self._decoded(value)
        if isinstance(value, dict):
            raise invalid("Objects are only allowed as {\"b64\": ...} inside a tensor value")
        return value

    def feature(self, value: object) -> object:
        """A feature's value or values; any other object stays, for example_from_json to refuse as TF Serving
        does."""
        if isinstance(value, list):
            return [self._decoded(v) if _is_b64(v) else v for v in value]
        return self._decoded(value) if _is_b64(value) else value

    def example(self, value: object) -> object:
        return {k: self.feature(v) for k, v in value.items()} if isinstance(value, dict) else value


# --- predict ------------------------------------------------------------------------------------------------------

@dataclass(slots=True)
class PredictRequest:
    """A decoded predict body: the tensors by input name (`named`), or the one tensor of a body that names none."""
    signature_name: str
    row_format: bool
    named: dict[str, object] | None
    unnamed: object = None
    refused: ServingError | None = None  # what the body's keys are refused for, once the model is found

    def tensors(self, signature: SignatureInfo) -> dict[str, object]:
        """The tensors by input name of `signature` (unnamed values go to its only input). A columnar "inputs"
        object gives the signature's names and nothing else, as TF Serving reads one (json_tensor.cc
        FillTensorMapFromInputsMap): a key the signature lacks is passed over, where it was refused, and one it
        needs (without a default) is TF Serving's error."""
        if self.refused is not None:
            raise self.refused
        if self.named is not None:
            if self.row_format or self.named.keys() == signature.inputs.keys():
                return self.named
            for name in signature.inputs:
                if name not in self.named and name not in signature.defaults:
                    raise invalid(f"Missing named input: {name} in 'inputs' object.")
            return {name: value for name, value in self.named.items() if name in signature.inputs}
        names = list(signature.inputs)
        if len(names) != 1:
            raise invalid(f"The signature has {len(names)} inputs {names}; " + (
                "each instance must be an object keyed by input name" if self.row_format else
                "\"inputs\" must be an object keyed by input name"))
        return {names[0]: self.unnamed}


def decode_predict(data: bytes, charge: Charge) -> PredictRequest:
    """A predict body, every {"b64"} decoded; its tensors are checked against a signature by the DataPlane. What is
    wrong with its "instances" or "inputs" is told once the model and signature are found, as TF Serving tells it
    (json_tensor.cc FillPredictRequestFromJson looks them up first): an unknown model is 404 whatever the body."""
    body, document = strict_json.decode(data, _PREDICT, charge)
    signature_name = _signature_name(body.signature_name, document.data)
    try:
        request, keys = _predict_tensors(body, document, signature_name)
    except ServingError as error:
        if error.code != Code.INVALID_ARGUMENT:
            raise
        return PredictRequest(signature_name, False, None, refused=error)
    strict_json.check_keys(document, keys)  # a duplicate key at once: which of the two is read is no error text's
    return request


def _predict_tensors(body: Any, document: strict_json.Document, signature_name: str) -> tuple[PredictRequest, int]:
    if body.instances is UNSET and body.inputs is UNSET:
        raise invalid("Missing 'inputs' or 'instances' key")
    if body.instances is not UNSET and body.inputs is not UNSET:
        raise invalid(f"JSON Value: {strict_json.debug_text(document.data)} Not formatted correctly expecting only "
                      "one of 'inputs' or 'instances' keys to exist ")
    keys = strict_json.present(body)
    if body.instances is not UNSET:
        rows = body.instances
        if not isinstance(rows, list):
            raise invalid(f"JSON Value: {strict_json.debug_text(document.data)} Expecting 'instances' to be an "
                          "list/array")
        if not rows:
            raise invalid(f"JSON Value: {strict_json.debug_text(document.data)} No values in 'instances' array")
        named_rows = sum(map(_named, rows))
        keys += sum(len(row) for row in rows if _named(row))
        # Objects besides the body and its named rows can only be {"b64"} values: without them, nothing to walk.
        walk = _Bytes() if document.objects > 1 + named_rows else None
        request = _rows(rows, named_rows, signature_name, walk)
    else:
        columns = body.inputs
        named = _named(columns)
        keys += len(columns) if named else 0
        walk = _Bytes() if document.objects > 1 + named else None
        tensor = walk.tensor if walk else _as_is
        request = PredictRequest(signature_name, False, {k: tensor(v) for k, v in columns.items()} if named else None,
                                 None if named else tensor(columns))
    return request, keys + (walk.keys if walk else 0)


def _as_is(value: object) -> object:
    return value


def _signature_name(value: object, data: bytes) -> str:
    """The body's signature name, "" (the default) when it has none; anything but a string is TF Serving's error."""
    if value is UNSET:
        return ""
    if not isinstance(value, str):
        raise invalid(f"JSON Value: {strict_json.debug_text(data)} not formatted correctly. 'signature_name' key "
                      "must be a string value.")
    return value


def _rows(rows: list[Any], named_rows: int, signature_name: str, walk: _Bytes | None) -> PredictRequest:
    tensor = walk.tensor if walk else _as_is
    if named_rows == len(rows):
        names = set(rows[0])
        if any(set(row) != names for row in rows):
            raise invalid("Every instance must have the same input names")
        return PredictRequest(signature_name, True, {k: tensor([row[k] for row in rows]) for k in rows[0]})
    if named_rows:
        raise invalid("Instances must be all objects keyed by input name, or all plain values")
    return PredictRequest(signature_name, True, None, tensor(rows))


def instance_tensors(instance: object, signature: SignatureInfo) -> dict[str, object]:
    """One element of an "instances" list, already parsed (a batch job's JSON line), as a batch of one row."""
    named = _named(instance)
    return _rows([instance], int(named), "", _Bytes()).tensors(signature)


# --- classify and regress ----------------------------------------------------------------------------------------

@dataclass(slots=True)
class ExamplesRequest:
    signature_name: str
    input: input_pb2.Input


def decode_examples(data: bytes, charge: Charge) -> ExamplesRequest:
    """A classify or regress body as the gRPC Input TF Serving builds from it."""
    body, document = strict_json.decode(data, _EXAMPLES, charge)
    signature_name = _signature_name(body.signature_name, document.data)
    walk = _Bytes()
    fields: dict[str, Any] = {name: getattr(body, name) for name in body.__struct_fields__
                              if getattr(body, name) is not UNSET}
    keys = len(fields)
    if "context" in fields:
        fields["context"] = walk.example(body.context)
        keys += len(body.context) if isinstance(body.context, dict) else 0
    if isinstance(body.examples, list):
        fields["examples"] = [walk.example(e) for e in body.examples]
        keys += sum(len(e) for e in body.examples if isinstance(e, dict))
    request_input = input_from_json(fields)
    strict_json.check_keys(document, keys + walk.keys)
    return ExamplesRequest(signature_name, request_input)


def example_input(example: object) -> input_pb2.Input:
    """One element of an "examples" list, already parsed (a batch job's JSON line), as an Input of one example."""
    return input_from_json({"examples": [_Bytes().example(example)]})


def _debug(value: object) -> str:
    text = json.dumps(value, separators=(",", ":"), default=lambda v: "<bytes>")
    return text[:strict_json.DEBUG_BYTES]


def _json_type(value: object) -> str:
    if value is None:
        return "Null"
    if isinstance(value, bool):
        return "True" if value else "False"
    names: dict[type, str] = {dict: "Object", list: "Array", str: "String"}
    return names.get(type(value), "Number")


_KIND_NAMES = {"bytes_list": "bytes", "float_list": "float", "int64_list": "int64", None: "UNKNOWN"}


def _add_value(feature: feature_pb2.Feature, name: str, value: object) -> None:
    """One JSON value into a Feature, as TF Serving's AddValueToFeature: a feature holds one kind only."""
    item: bytes | int | float
    if isinstance(value, bytes | str):
        kind, item = "bytes_list", value if isinstance(value, bytes) else value.encode("utf-8")
    elif isinstance(value, bool):
        kind, item = "int64_list", int(value)
    elif isinstance(value, int) and _INT64[0] <= value <= _INT64[1]:
        kind, item = "int64_list", value
    elif isinstance(value, int) and _INT64[1] < value <= _UINT64_MAX:
        raise invalid(f"Feature: {name} has uint64_t element. Only int64_t is supported.")
    elif isinstance(value, int | float):
        kind, item = "float_list", float(value)
    else:
        raise invalid(f"Feature: {name} has element with unexpected JSON type: {_json_type(value)}")
    have = feature.WhichOneof("kind")
    if have not in (None, kind):
        raise invalid(f"Unexpected element type in feature: {name} expecting type: {_KIND_NAMES[have]}")
    getattr(feature, kind).value.append(item)


def example_from_json(value: object) -> example_pb2.Example:
    """A JSON object as a tf.Example; a feature's value is one value or a list of them. Bytes stand for the
    {"b64": ...} values already decoded; any other object is an error."""
    if not isinstance(value, dict):
        raise invalid(f"Example must be JSON object but got JSON {_json_type(value)}")
    example = example_pb2.Example()
    for name, content in value.items():
        feature = feature_pb2.Feature()
        for item in content if isinstance(content, list) else [content]:
            _add_value(feature, name, item)
        example.features.feature[name].CopyFrom(feature)
    return example


def input_from_json(body: dict) -> input_pb2.Input:
    """A classify or regress body's "context" and "examples" (their {"b64"} values as bytes) as the gRPC Input TF
    Serving builds."""
    request_input = input_pb2.Input()
    context = "context" in body
    if context:
        request_input.example_list_with_context.context.CopyFrom(example_from_json(body["context"]))
    examples = body.get("examples")
    if "examples" not in body:
        raise invalid(f"JSON Value: {_debug(body)} When method is classify, key 'examples' is expected and was "
                      "not found")
    if not isinstance(examples, list):
        raise invalid(f"JSON Value: {_debug(body)} Expecting 'examples' value to be an list/array")
    if not examples:
        raise invalid(f"JSON Value: {_debug(body)} 'examples' value is an empty array")
    target = request_input.example_list_with_context if context else request_input.example_list
    target.examples.extend(example_from_json(example) for example in examples)
    return request_input


# --- answers ------------------------------------------------------------------------------------------------------

def _string_leaf(name: str):
    as_b64 = name.endswith("_bytes")

    def convert(value: bytes) -> object:
        if not as_b64:
            try:
                return value.decode("utf-8")
            except UnicodeDecodeError:
                pass
        return {"b64": base64.b64encode(value).decode("ascii")}
    return convert


_FLOAT32 = struct.Struct("f")
_POWERS_OF_TEN = 10.0 ** np.arange(23)  # each an exact double
_FEW_FLOATS = 24  # below this many values, Python's formatting is faster than numpy's passes over them


def _rounded(magnitudes: np.ndarray, exponents: np.ndarray, digits: int) -> tuple[np.ndarray, np.ndarray]:
    """Each magnitude rounded to `digits` significant digits, as the double nearest that decimal, by one product
    or quotient with an exact power of ten, one rounding to an integer and one exact-power division or product
    (each correctly rounded by IEEE arithmetic); and where that is sure to be printf's rounding: the power exact,
    the decimal exponent right, and the scaled value not within reach of a tie, which its own rounding could
    have moved across."""
    shift = (digits - 1) - exponents
    up = shift >= 0
    power = _POWERS_OF_TEN[np.minimum(np.abs(shift), 22)]
    scaled = np.where(up, magnitudes * power, magnitudes / power)
    integer = np.rint(scaled)
    sure = ((np.abs(shift) <= 22) & (scaled >= _POWERS_OF_TEN[digits - 1]) & (scaled < _POWERS_OF_TEN[digits])
            & (np.abs(scaled - np.floor(scaled) - 0.5) > 4 * np.spacing(scaled)))
    return np.where(up, integer / power, integer * power), sure


def _written(value: float) -> float:
    """One float32 (as a Python float) as TF Serving writes it (tf_serving_float32)."""
    six = float(f"{value:.6g}")
    return six if _FLOAT32.unpack(_FLOAT32.pack(six))[0] == value else float(f"{value:.9g}")


def tf_serving_float32(array: np.ndarray) -> np.ndarray:
    """float32 values as the float64s of the decimals TF Serving writes for them (util/json_tensor.cc WriteDecimal):
    the 6-significant-digit decimal when it reads back as the same float32, else the 9-digit one; NaN, the
    infinities and zeros as they are. So an answer read as doubles (Python's json, JavaScript, Java) holds TF
    Serving's very numbers: 0.333333343 for a third, where the shortest decimal, 0.33333334, is another double.

    Vectorised for all but a few values; where the arithmetic cannot vouch for a value (a tie within its rounding
    error, a power of ten past 10**22) that value is formatted as TF Serving formats it. tests/unit/
    test_predict_json.py holds it to that formatting on every float32 exponent."""
    flat = array.ravel()
    if flat.size < _FEW_FLOATS:
        return np.array([v if v == 0 or not math.isfinite(v) else _written(v) for v in flat.tolist()],
                        dtype=np.float64).reshape(array.shape)
    with np.errstate(all="ignore"):
        values = flat.astype(np.float64)
        magnitudes = np.abs(values)
        finite = (magnitudes > 0) & (magnitudes < np.inf)
        exponents = np.floor(np.log10(np.where(finite, magnitudes, 1.0))).astype(np.int64)
        six, sure_six = _rounded(magnitudes, exponents, 6)
        nine, sure_nine = _rounded(magnitudes, exponents, 9)
        same = six.astype(np.float32) == np.abs(flat)
        out = np.where(finite, np.copysign(np.where(same, six, nine), values), values)
    for i in np.flatnonzero(finite & ~(sure_six & (same | sure_nine))).tolist():
        out[i] = _written(float(values[i]))
    return out.reshape(array.shape)


def tf_serving_floats(values: Sequence[float]) -> list[float]:
    """Classify scores or regress values (float32s) as TF Serving writes them (tf_serving_float32)."""
    return tf_serving_float32(np.array(values, dtype=np.float32)).tolist()


def to_json(name: str, array: np.ndarray) -> list | object:
    """A tensor as nested JSON lists; strings as text, or {"b64"} for `*_bytes` outputs and non-UTF-8 bytes;
    float32 values as TF Serving writes them (tf_serving_float32), float16 ones (which TF Serving refuses to
    write) as their shortest decimals."""
    if array.dtype == np.float32:
        return tf_serving_float32(array).tolist()
    if array.dtype == np.float16:
        return array.astype(str).astype(np.float64).tolist()
    if array.dtype != object:
        return array.tolist()
    convert = _string_leaf(name)

    def walk(value):
        return [walk(v) for v in value] if isinstance(value, list) else convert(value)
    return walk(array.tolist())


def predict_response(outputs: dict[str, np.ndarray], row_format: bool) -> dict:
    """TF Serving's JSON answer: columnar "outputs", or "predictions" rows, which need every output batched alike."""
    return _answer(outputs, {name: to_json(name, array) for name, array in outputs.items()}, row_format)


def _answer(outputs: dict[str, np.ndarray], columns: dict[str, Any], row_format: bool) -> dict:
    """The answer's shape around each output's JSON value (`columns`), or its refusal."""
    if not row_format:
        return {"outputs": next(iter(columns.values())) if len(columns) == 1 else columns}
    batch = None
    for name, array in outputs.items():
        if array.ndim == 0:
            raise invalid(f"Tensor name: {name} has no shape information ")
        if batch is not None and array.shape[0] != batch:
            raise invalid(f"Tensor name: {name} has inconsistent batch size: {array.shape[0]} expecting: {batch}")
        batch = array.shape[0]
    if len(columns) == 1:
        return {"predictions": next(iter(columns.values()))}
    names = list(columns)
    return {"predictions": [dict(zip(names, row, strict=False)) for row in zip(*columns.values(), strict=False)]}


_ORJSON_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


def _numpy_column(name: str, array: np.ndarray) -> Any:
    """An output as orjson writes it straight from the array (OPT_SERIALIZE_NUMPY), with the values to_json gives:
    integers and booleans, finite float32 values as TF Serving writes them (tf_serving_float32) and float64 ones
    (each its shortest decimal, which reads back as the same double as TF Serving's 17 digits; orjson spells some
    of them otherwise, 0.0000033 for 3.3e-6, the same number), and strings as to_json makes them. None for what
    only to_json writes as TF Serving does: NaN and the infinities, float16, scalars (orjson writes a 0-d array as
    a list)."""
    if array.ndim == 0:
        return None
    kind = array.dtype.kind
    if kind in "iub":
        return np.ascontiguousarray(array)
    if array.dtype in _ORJSON_FLOATS and np.isfinite(array).all():
        return tf_serving_float32(array) if array.dtype == np.float32 else np.ascontiguousarray(array)
    return to_json(name, array) if kind == "O" else None


def encode_predict(outputs: dict[str, np.ndarray], row_format: bool) -> bytes:
    """The answer's JSON, written by orjson straight from the arrays when it writes them as TF Serving does (nearly
    every answer: about 3 us instead of 29 for an image classifier's), else through Python values."""
    columns = {name: _numpy_column(name, array) for name, array in outputs.items()}
    if not any(column is None for column in columns.values()):
        return orjson.dumps(_answer(outputs, columns, row_format), option=orjson.OPT_SERIALIZE_NUMPY)
    finite = all(np.isfinite(a).all() for a in outputs.values() if a.dtype.kind == "f")
    return strict_json.encode(predict_response(outputs, row_format), finite)


def results_response(result: Result) -> list:
    """One Classify or Regress task's "results": [[label, score], ...] per example, or a value per example."""
    if result.classifications is not None:
        return [[[label, score] for (label, _), score in zip(row, tf_serving_floats([s for _, s in row]),
                                                             strict=True)]
                for row in result.classifications]
    return tf_serving_floats(result.regressions or ())


def encode_results(result: Result) -> bytes:
    scores = [s for row in result.classifications for _, s in row] if result.classifications is not None \
        else result.regressions or ()
    return strict_json.encode({"results": results_response(result)}, all(map(math.isfinite, scores)))


def status_response(statuses) -> dict:
    return {"model_version_status": [
        {"version": str(s.version), "state": s.state,
         "status": {"error_code": s.error_code, "error_message": s.error_message}} for s in statuses]}


def _tensor_info_json(info) -> dict:
    shape = {"dim": [], "unknown_rank": True} if info.shape is None else \
        {"dim": [{"size": str(d), "name": ""} for d in info.shape], "unknown_rank": False}
    return {"dtype": info.dtype, "tensor_shape": shape, "name": info.name}


def metadata_response(name: str, version: int, signatures) -> dict:
    defs = {key: {"inputs": {k: _tensor_info_json(t) for k, t in sig.inputs.items()},
                  "outputs": {k: _tensor_info_json(t) for k, t in sig.outputs.items()},
                  "method_name": sig.method_name,
                  "defaults": {k: json_format.MessageToDict(v, always_print_fields_with_no_presence=True,
                                                            preserving_proto_field_name=True)
                               for k, v in sig.defaults.items()}} for key, sig in signatures.items()}
    return {"model_spec": {"name": name, "signature_name": "", "version": str(version)},
            "metadata": {"signature_def": {"signature_def": defs}}}
