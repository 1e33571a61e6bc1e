"""KServe V2 / Open Inference Protocol over REST (docs/protocols.md), with Triton's binary-data and classification
extensions, on the same Flask app and DataPlane as the TF Serving REST API.

A V2 "model" is a DataPlane model's serving signature (serving_default unless the request's
`parameters.signature_name` names another); V2 input and output names are the signature's tensor names.
"""
from __future__ import annotations

import base64
import json
import math
import struct
import time
from typing import Any

import flask
import numpy as np

from serving.config import ProtocolOptions
from serving.core import Code, DataPlane, ServingError, invalid, not_found
from serving.protocols import admission, v2
from serving.protocols.httputil import (
    ascii_int,
    b64decode,
    is_json_int,
    object_field,
    parse_json,
    parse_version,
    request_body,
    string_field,
)
from serving.protocols.tensor_proto import STRING_ELEMENT_BYTES
from serving.protocols.v2 import NUMPY_TYPES

HEADER_LENGTH = "Inference-Header-Content-Length"


# ---- request decoding -------------------------------------------------------------------------------------

def split_body(body: bytes, header_length: str | None) -> tuple[dict[str, Any], bytes]:
    """Separate the JSON header from the binary tail (Triton binary-data extension)."""
    if header_length is None:
        header, tail = body, b""
    else:
        length = ascii_int(header_length)
        if length is None or length > len(body):
            raise invalid(f"{HEADER_LENGTH} {header_length!r} does not fit a {len(body)}-byte body")
        header, tail = body[:length], body[length:]
    request = parse_json(header)
    if not isinstance(request, dict) or not isinstance(request.get("inputs"), list) or not request["inputs"]:
        raise invalid("Inference request needs a non-empty 'inputs' list")
    return request, tail


def decode_length_prefixed(raw: bytes, name: str, count: int) -> list[bytes]:
    """BYTES elements as Triton serializes them: 4-byte little-endian length, then the bytes; never more than the
    `count` the shape declares, so a tail of empty elements cannot become more objects than the request claimed."""
    items: list[bytes] = []
    offset = 0
    while offset < len(raw):
        if len(items) == count:
            raise invalid(f"Input {name!r}: the binary data holds more than the {count} BYTES elements of its shape")
        if offset + 4 > len(raw):
            raise invalid(f"Input {name!r}: truncated BYTES element length")
        (size,) = struct.unpack_from("<I", raw, offset)
        offset += 4
        if offset + size > len(raw):
            raise invalid(f"Input {name!r}: BYTES element of {size} bytes overruns the binary data")
        items.append(raw[offset:offset + size])
        offset += size
    return items


def decode_raw(raw: bytes, name: str, datatype: str, shape: list[int], count: int) -> np.ndarray:
    """One tensor's binary data (Triton's binary extension over REST, raw_input_contents over gRPC) as a flat
    array of the `count` elements its shape declares: little-endian numbers, or length-prefixed BYTES."""
    if datatype == "BYTES":
        # Each element becomes an object many times its 4-byte prefix and few bytes: a REST request's hold on the
        # memory budget grows by that before it is decoded (gRPC bounds the same by its message limit).
        admission.charge(count * STRING_ELEMENT_BYTES)
        return np.array(decode_length_prefixed(raw, name, count), dtype=object)
    dtype = np.dtype(NUMPY_TYPES[datatype]).newbyteorder("<")
    if len(raw) != count * dtype.itemsize:
        raise invalid(f"Input {name!r}: {len(raw)} bytes do not hold shape {shape} of {datatype}")
    return np.frombuffer(raw, dtype=dtype).astype(NUMPY_TYPES[datatype], copy=False)  # a view on little-endian


def flatten(data: Any) -> list[Any]:
    if isinstance(data, list):
        return [x for item in data for x in flatten(item)]
    return [data]


def decode_input(spec: dict[str, Any], tail: bytes, offset: int, base64_default: bool) -> tuple[np.ndarray, int]:
    """One V2 input as a numpy array; returns the new offset into the binary tail."""
    name, shape = spec.get("name"), spec.get("shape")
    datatype: Any = spec.get("datatype")  # a str once declared_count has accepted it
    if not isinstance(name, str) or not isinstance(shape, list) or not all(is_json_int(d) and d >= 0 for d in shape):
        raise invalid(f"Input {name!r} needs a 'name', a 'datatype' and a non-negative integer 'shape'")
    count = v2.declared_count(name, datatype, shape)
    parameters = object_field(spec, "parameters", f"Input {name!r}: ")
    if "binary_data_size" in parameters:
        size = parameters["binary_data_size"]
        if not is_json_int(size) or size < 0 or offset + size > len(tail):
            raise invalid(f"Input {name!r}: binary_data_size {size!r} exceeds the binary data sent")
        raw, offset = tail[offset:offset + size], offset + size
        values: Any = decode_raw(raw, name, datatype, shape, count)
    elif "data" in spec:
        flat = flatten(spec["data"])
        if datatype == "BYTES":
            is_base64 = parameters.get("content_type", "base64" if base64_default else "") == "base64"
            values = np.array([decode_string(v, name, is_base64) for v in flat], dtype=object)
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


def decode_string(value: Any, name: str, is_base64: bool) -> bytes:
    if not isinstance(value, str):
        raise invalid(f"Input {name!r}: BYTES data must be strings")
    if not is_base64:
        return value.encode("utf-8")
    return b64decode(value, f"input {name!r}")


# ---- response encoding ------------------------------------------------------------------------------------

def classification(scores: np.ndarray, count: int, labels: list[str]) -> np.ndarray:
    """Triton's classification extension: per row (all past the first dimension) the top `count` as
    "score:index[:label]" strings, [rows, count]; [count] for one row without a batch dimension. The row's width
    is stated, not left to reshape's -1, which cannot infer it for an empty batch."""
    rows = scores.reshape(len(scores), math.prod(scores.shape[1:])) if scores.ndim > 1 else scores.reshape(1, -1)
    out = []
    for row in rows:
        top = np.argsort(-row, kind="stable")[:count]
        out.append([(f"{row[i]:f}:{i}" + (f":{labels[i]}" if i < len(labels) else "")).encode() for i in top])
    top_count = min(count, rows.shape[1])
    return np.array(out, dtype=object).reshape((len(rows), top_count) if scores.ndim > 1 else (top_count,))


def datatype_of(array: np.ndarray) -> str:
    if array.dtype == object or array.dtype.kind in "SU":
        return "BYTES"
    for name, dtype in NUMPY_TYPES.items():
        if array.dtype == dtype:
            return name
    raise ServingError(Code.INTERNAL, f"Output dtype {array.dtype} has no V2 datatype")


def json_data(array: np.ndarray) -> tuple[list[Any], dict[str, Any]]:
    """Flattened JSON data; BYTES that are not UTF-8 go as base64 and say so."""
    if datatype_of(array) != "BYTES":
        return array.reshape(-1).tolist(), {}
    items = [v if isinstance(v, bytes) else str(v).encode() for v in array.reshape(-1)]
    try:
        return [v.decode("utf-8") for v in items], {}
    except UnicodeDecodeError:
        return [base64.b64encode(v).decode("ascii") for v in items], {"content_type": "base64"}


def binary_data(array: np.ndarray) -> bytes:
    if datatype_of(array) != "BYTES":
        return array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()  # tobytes writes C order
    items = [v if isinstance(v, bytes) else str(v).encode() for v in array.reshape(-1)]
    return b"".join(struct.pack("<I", len(v)) + v for v in items)


def encode_response(header: dict[str, Any], arrays: list[tuple[dict[str, Any], np.ndarray, bool]]) -> flask.Response:
    outputs, tail = [], []
    for entry, array, binary in arrays:
        entry.update(datatype=datatype_of(array), shape=list(array.shape))
        if binary:
            raw = binary_data(array)
            entry.setdefault("parameters", {})["binary_data_size"] = len(raw)
            tail.append(raw)
        else:
            entry["data"], extra = json_data(array)
            if extra:
                entry.setdefault("parameters", {}).update(extra)
        outputs.append(entry)
    body = json.dumps({**header, "outputs": outputs}).encode()
    if not tail:
        return flask.Response(body, mimetype="application/json")
    response = flask.Response(body + b"".join(tail), mimetype="application/octet-stream")
    response.headers[HEADER_LENGTH] = str(len(body))
    return response


# ---- routes -----------------------------------------------------------------------------------------------

def create_blueprint(core: DataPlane, options: ProtocolOptions) -> flask.Blueprint:
    """The V2 routes bound to `core`. Every failure is a JSON {"error"} with the TF code's HTTP status (the app's
    error handlers make it), except health answers: 200 or 503, with the body KServe's clients read (`{"live":
    true}`, `{"ready": ...}`), as Triton's read only the status (docs/protocols.md, 'Endpoints')."""
    bp = flask.Blueprint("kserve_v2", __name__)

    def probe(field: str, ok: bool, **extra: str) -> tuple[dict[str, Any], int]:
        return {**extra, field: ok}, 200 if ok else 503

    @bp.get("/v2")
    def server_metadata() -> Any:
        return {"name": "petal", "version": "1", "extensions": v2.EXTENSIONS}

    @bp.get("/v2/health/live")
    def live() -> tuple[dict[str, Any], int]:
        return probe("live", True)

    @bp.get("/v2/health/ready")
    def ready() -> tuple[dict[str, Any], int]:
        return probe("ready", core.ready())

    @bp.get("/v2/models/<model>/ready")
    @bp.get("/v2/models/<model>/versions/<version>/ready")
    def model_ready(model: str, version: str | None = None) -> tuple[dict[str, Any], int]:
        """An unknown model or version is an error, a 404 with a JSON body as TF Serving answers it, not the probe's
        false, which is for a known version that is not AVAILABLE (loading, say) or a server shutting down."""
        if model not in core.model_names():
            raise not_found(f"Could not find any versions of model {model}")
        number = parse_version(version)
        if number is not None:
            core.status(model, number)  # NOT_FOUND for a version the model does not have
        return probe("ready", core.model_ready(model, number), name=model)

    @bp.get("/v2/models/<model>")
    @bp.get("/v2/models/<model>/versions/<version>")
    def metadata(model: str, version: str | None = None) -> Any:
        return v2.model_metadata(core, model, parse_version(version))

    @bp.post("/v2/models/<model>/infer")
    @bp.post("/v2/models/<model>/versions/<version>/infer")
    def infer(model: str, version: str | None = None) -> flask.Response:
        deadline = time.monotonic() + options.rest_api_timeout_in_ms / 1000.0
        request, tail = split_body(request_body(options.max_request_bytes),
                                   flask.request.headers.get(HEADER_LENGTH))
        parameters = object_field(request, "parameters", "The request's ")
        base64_default = parameters.get("content_type") == "base64"
        inputs, offset = {}, 0
        for spec in request["inputs"]:
            if not isinstance(spec, dict):
                raise invalid("Each input must be an object")
            inputs[spec["name"]], offset = decode_input(spec, tail, offset, base64_default)
        requested = request.get("outputs") or []
        if not isinstance(requested, list) or not all(isinstance(o, dict) and isinstance(o.get("name"), str)
                                                      for o in requested):
            raise invalid("'outputs' must be a list of objects with a 'name'")
        output_parameters = {o["name"]: object_field(o, "parameters", f"Output {o['name']!r}: ") for o in requested}
        result = core.predict(model=model, inputs=v2.with_triton_dims(inputs), version=parse_version(version),
                              signature_name=string_field(parameters, "signature_name"),
                              output_filter=[o["name"] for o in requested] or None, deadline=deadline,
                              entrypoint="REST")
        all_binary = bool(parameters.get("binary_data_output", False))
        arrays = []
        for out in requested or [{"name": name} for name in result.outputs]:
            out_params = output_parameters.get(out["name"], {})
            array = result.outputs[out["name"]]
            count = out_params.get("classification", 0)
            if count:
                if not is_json_int(count) or count < 0 or datatype_of(array) == "BYTES":
                    raise invalid(f"Output {out['name']!r}: classification needs a positive integer on a "
                                  "numeric output")
                array = classification(array, count, result.labels)
            arrays.append(({"name": out["name"]}, array, bool(out_params.get("binary_data", all_binary))))
        header = {"model_name": result.model, "model_version": str(result.version)}
        if "id" in request:
            header["id"] = request["id"]
        return encode_response(header, arrays)

    return bp
