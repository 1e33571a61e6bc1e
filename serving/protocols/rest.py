"""TF Serving's REST API (docs/protocols.md) plus Petal's `:classify_image`, as a Flask blueprint over the core.

TF Serving matches its paths case-insensitively and puts the verb after a colon (`/v1/models/m:predict`). Flask's
routing is case-sensitive, so `normalize_v1_path` lower-cases the fixed words of a /v1 path (never the model
name or label) before routing, and werkzeug's `any` converter matches the known verbs after the colon, so the URL
map itself lists every operation (the OpenAPI contract test reads it). Any other /v1 path gets TF Serving's 400
"Malformed request" rather than a generic 404.
"""
from __future__ import annotations

import base64
import logging
import time
from collections.abc import Callable
from typing import TypeGuard

import flask
import numpy as np
import orjson
from google.protobuf import json_format
from werkzeug.routing import BaseConverter

from serving.config import ProtocolOptions
from serving.core import (
    CLASSIFY_METHOD,
    REGRESS_METHOD,
    DataPlane,
    ServingError,
    SignatureInfo,
    Task,
    input_from_json,
    invalid,
)
from serving.protocols.httputil import (
    ascii_int,
    b64decode,
    json_response,
    parse_json,
    parse_version,
    request_body,
    string_field,
)

logger = logging.getLogger(__name__)

_V1_WORDS = ("models", "versions", "labels", "metadata")
DEFAULT_TOP_K = 5


# --- request bodies -------------------------------------------------------------------------------------------

def json_body(max_bytes: int) -> dict:
    body = parse_json(request_body(max_bytes))
    if not isinstance(body, dict):
        raise invalid("JSON Value is not an object")
    return body


def _b64(value: dict) -> bytes:
    return b64decode(value["b64"], "'b64'")


def _is_b64(value: object) -> TypeGuard[dict]:
    return isinstance(value, dict) and len(value) == 1 and "b64" in value


def decode_b64(value: object) -> object:
    """Replace every {"b64": ...} in a JSON value by its bytes."""
    if isinstance(value, list):
        return [decode_b64(v) for v in value]
    if _is_b64(value):
        return _b64(value)
    if isinstance(value, dict):
        raise invalid("Objects are only allowed as {\"b64\": ...} inside a tensor value")
    return value


def examples_json(body: dict) -> dict:
    """A classify or regress body with each feature's {"b64": ...} values decoded to bytes (any other object stays,
    for the core to refuse as TF Serving does)."""
    def feature(value: object) -> object:
        if isinstance(value, list):
            return [_b64(v) if _is_b64(v) else v for v in value]
        return _b64(value) if _is_b64(value) else value

    def example(value: object) -> object:
        return {k: feature(v) for k, v in value.items()} if isinstance(value, dict) else value
    decoded = dict(body)
    if "context" in body:
        decoded["context"] = example(body["context"])
    if isinstance(body.get("examples"), list):
        decoded["examples"] = [example(e) for e in body["examples"]]
    return decoded


def _named(value: object) -> bool:
    return isinstance(value, dict) and not _is_b64(value)


def check_predict_body(body: dict) -> bool:
    """Whether a predict request is in row ("instances") format rather than columnar ("inputs")."""
    if ("instances" in body) == ("inputs" in body):
        raise invalid("Exactly one of \"instances\" (row format) or \"inputs\" (columnar format) must be present")
    return "instances" in body


def predict_inputs(body: dict, input_names: list[str]) -> dict[str, object]:
    """A predict request's tensors by input name (unnamed values go to the signature's only input)."""
    if "instances" in body:
        rows = body["instances"]
        if not isinstance(rows, list) or not rows:
            raise invalid("\"instances\" must be a non-empty list")
        if all(_named(row) for row in rows):
            keys = set(rows[0])
            if any(set(row) != keys for row in rows):
                raise invalid("Every instance must have the same input names")
            return {k: decode_b64([row[k] for row in rows]) for k in keys}
        if any(_named(row) for row in rows):
            raise invalid("Instances must be all objects keyed by input name, or all plain values")
        if len(input_names) != 1:
            raise invalid(f"The signature has {len(input_names)} inputs {input_names}; each instance must be an "
                          "object keyed by input name")
        return {input_names[0]: decode_b64(rows)}
    columns = body["inputs"]
    if _named(columns):
        return {k: decode_b64(v) for k, v in columns.items()}
    if len(input_names) != 1:
        raise invalid(f"The signature has {len(input_names)} inputs {input_names}; \"inputs\" must be an object "
                      "keyed by input name")
    return {input_names[0]: decode_b64(columns)}


# --- responses ------------------------------------------------------------------------------------------------

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


def float32_json(value: float) -> float:
    """A float32 as the shortest decimal that reads back as the same float32 (0.2, not 0.20000000298023224), as
    TF Serving writes it; NaN and the infinities stay, which the JSON writer spells NaN and Infinity as it does."""
    return float(str(np.float32(value)))


def to_json(name: str, array: np.ndarray) -> list | object:
    """A tensor as nested JSON lists; strings as text, or {"b64"} for `*_bytes` outputs and non-UTF-8 bytes;
    float32 and float16 values as their shortest decimals (float32_json), vectorised."""
    if array.dtype == np.float32 and array.ndim and np.isfinite(array).all():
        # orjson writes a float32 as its shortest decimal too, about 6x faster than formatting through str; it
        # would write NaN and the infinities as null, and a 0-d array as a list, so those take the path below
        return orjson.loads(orjson.dumps(np.ascontiguousarray(array), option=orjson.OPT_SERIALIZE_NUMPY))
    if array.dtype in (np.float32, np.float16):
        return array.astype(str).astype(np.float64).tolist()
    if array.dtype != object:
        return array.tolist()
    convert = _string_leaf(name)

    def walk(value):
        return [walk(v) for v in value] if isinstance(value, list) else convert(value)
    return walk(array.tolist())


def predict_response(outputs: dict[str, np.ndarray], row_format: bool) -> dict:
    """TF Serving's JSON answer: columnar "outputs", or "predictions" rows, which need every output batched alike."""
    columns = {name: to_json(name, array) for name, array in outputs.items()}
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


# --- routing --------------------------------------------------------------------------------------------------

def normalize_v1_path(path: str) -> str:
    """TF Serving's case-insensitive /v1 paths in the one spelling the URL rules use.

    In `/v1/models/{name}[/versions/{N}|/labels/{L}][/metadata|:verb]` the fixed words sit at the even segment
    positions, so those and the verb are lower-cased; the name and label (odd positions) keep their case. A
    trailing slash is dropped, as TF Serving ignores it.
    """
    if path[:4].lower() != "/v1/":
        return path
    parts = path.rstrip("/").split("/")
    for i in range(1, len(parts)):
        if i == 1 or i % 2 == 0:
            parts[i] = parts[i].lower()
    name, colon, verb = parts[-1].partition(":")
    parts[-1] = name + colon + verb.lower()
    return "/".join(parts)


class SegmentConverter(BaseConverter):
    """A model name or label: one path segment, without the colon that starts the verb."""
    regex = "[^/:]+"


def _top_k(default: int) -> int:
    text = flask.request.args.get("top_k")
    if text is None:
        return default
    top_k = ascii_int(text)
    if top_k is None or top_k < 1:
        raise invalid(f"top_k must be a positive integer, got {text!r}")
    return top_k


def malformed() -> ServingError:
    return invalid(f"Malformed request: {flask.request.method} {flask.request.path}")


def create_blueprint(core: DataPlane, options: ProtocolOptions) -> flask.Blueprint:
    """TF Serving's /v1 API bound to `core` (the app registers the converters and the error handlers)."""
    bp = flask.Blueprint("tfserving_v1", __name__, url_prefix="/v1/models")
    timeout = options.rest_api_timeout_in_ms / 1000.0
    spec_rules = {"latest": "/<segment:name>", "version": "/<segment:name>/versions/<segment:version>",
                  "label": "/<segment:name>/labels/<segment:label>"}

    def status(name: str, version: str | None = None, label: str | None = None) -> flask.Response:
        return json_response(status_response(core.status(name, parse_version(version), label)))

    def metadata(name: str, version: str | None = None, label: str | None = None) -> flask.Response:
        resolved, signatures = core.signatures(name, parse_version(version), label)
        return json_response(metadata_response(name, resolved, signatures))

    def predict(name: str, version: int | None, label: str | None, deadline: float) -> flask.Response:
        body = json_body(options.max_request_bytes)
        signature_name = string_field(body, "signature_name")
        row_format = check_predict_body(body)

        def inputs(signature: SignatureInfo) -> dict[str, object]:
            return predict_inputs(body, list(signature.inputs))
        result = core.predict(name, inputs, version, label, signature_name, deadline=deadline)
        return json_response(predict_response(result.outputs, row_format))

    def infer(method: str, name: str, version: int | None, label: str | None, deadline: float) -> flask.Response:
        """TF Serving's :classify and :regress: "examples" (and "context") as tf.Examples, answered as "results"."""
        body = json_body(options.max_request_bytes)
        task = Task(method, string_field(body, "signature_name"))
        request_input = input_from_json(examples_json(body))
        api = "classify" if method == CLASSIFY_METHOD else "regress"
        _, results = core.infer(name, [task], request_input, version, label, deadline, api=api)
        if results[0].classifications is not None:
            return json_response({"results": [[[lbl, float32_json(s)] for lbl, s in row]
                                              for row in results[0].classifications]})
        return json_response({"results": [float32_json(v) for v in results[0].regressions or ()]})

    def classify(name: str, version: int | None, label: str | None, deadline: float) -> flask.Response:
        return infer(CLASSIFY_METHOD, name, version, label, deadline)

    def regress(name: str, version: int | None, label: str | None, deadline: float) -> flask.Response:
        return infer(REGRESS_METHOD, name, version, label, deadline)

    def classify_image(name: str, version: int | None, label: str | None, deadline: float) -> flask.Response:
        request = flask.request
        top_k = _top_k(DEFAULT_TOP_K)
        if request.mimetype == "multipart/form-data":
            upload = request.files.get("image")
            if upload is None:
                raise invalid("The multipart form has no field named 'image'")
            data = upload.read()
        elif request.mimetype.startswith("image/") or request.mimetype == "application/octet-stream":
            data = request_body(options.max_request_bytes)
        else:
            raise invalid("Send the image as the body (Content-Type: image/*) or as the multipart form field "
                          f"'image'; got Content-Type {request.mimetype or 'none'!r}")
        if not data:
            raise invalid("The image is empty")
        resolved, results = core.classify_images(name, [data], version, label, top_k=top_k, deadline=deadline)
        return json_response({"model": name, "version": resolved,
                              "predictions": [{"label": lbl, "score": score} for lbl, score in results[0]]})

    verbs: dict[str, Callable[[str, int | None, str | None, float], flask.Response]] = {
        "predict": predict, "classify": classify, "regress": regress, "classify_image": classify_image}

    def run_verb(name: str, verb: str, version: str | None = None, label: str | None = None) -> flask.Response:
        return verbs[verb](name, parse_version(version), label, time.monotonic() + timeout)

    verb_rule = f":<any({', '.join(verbs)}):verb>"
    for kind, rule in spec_rules.items():
        bp.add_url_rule(rule, f"status_{kind}", status, methods=["GET"])
        bp.add_url_rule(rule + "/metadata", f"metadata_{kind}", metadata, methods=["GET"])
        bp.add_url_rule(rule + verb_rule, f"verb_{kind}", run_verb, methods=["POST"])
    bp.add_url_rule("/<path:anything>", "malformed", _raise_malformed, methods=["GET", "POST", "PUT", "DELETE",
                                                                                   "PATCH"])
    return bp


def _raise_malformed(anything: str) -> flask.Response:
    raise malformed()
