"""TF Serving's REST API (SPEC §1) plus Petal's image, health and metrics endpoints, as a Flask app over the core.

The /v1 paths are matched by one case-insensitive pattern, the way TF Serving's handler does, so that a
malformed path or verb gets TF Serving's 400 "Malformed request" rather than a generic 404.
"""
from __future__ import annotations

import base64
import logging
import re
import time

import flask
import numpy as np
from werkzeug.exceptions import HTTPException

from serving import kserve
from serving.core import IMAGE_INPUT, Core, SignatureInfo
from serving.errors import ServingError, http_status, invalid
from serving.httputil import (ascii_int, b64decode, error_response, json_response, parse_json,
                              parse_version, request_body, string_field)
from serving.repository import DEFAULT_SIGNATURE

logger = logging.getLogger(__name__)

_V1_PATH = re.compile(
    r"^/v1/models/(?P<name>[^/:]+)(?:/versions/(?P<version>[^/:]+)|/labels/(?P<label>[^/:]+))?"
    r"(?:(?P<metadata>/metadata)|:(?P<verb>[A-Za-z_]+))?/?$", re.IGNORECASE)
DEFAULT_TOP_K = 5


# --- request bodies -------------------------------------------------------------------------------------------

def json_body(max_bytes: int) -> dict:
    body = parse_json(request_body(max_bytes))
    if not isinstance(body, dict):
        raise invalid("JSON Value is not an object")
    return body


def _b64(value: dict) -> bytes:
    return b64decode(value["b64"], "'b64'")


def _is_b64(value: object) -> bool:
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


def to_json(name: str, array: np.ndarray) -> list | object:
    """A tensor as nested JSON lists; strings as text, or {"b64"} for `*_bytes` outputs and non-UTF-8 bytes."""
    if array.dtype != object:
        return array.tolist()
    convert = _string_leaf(name)

    def walk(value):
        return [walk(v) for v in value] if isinstance(value, list) else convert(value)
    return walk(array.tolist())


def predict_response(outputs: dict[str, np.ndarray], row_format: bool) -> dict:
    columns = {name: to_json(name, array) for name, array in outputs.items()}
    if not row_format:
        return {"outputs": next(iter(columns.values())) if len(columns) == 1 else columns}
    if len(columns) == 1:
        return {"predictions": next(iter(columns.values()))}
    names = list(columns)
    return {"predictions": [dict(zip(names, row)) for row in zip(*columns.values())]}


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
                  "method_name": sig.method_name} for key, sig in signatures.items()}
    return {"model_spec": {"name": name, "signature_name": "", "version": str(version)},
            "metadata": {"signature_def": {"signature_def": defs}}}


# --- the app --------------------------------------------------------------------------------------------------

def _top_k(default: int) -> int:
    text = flask.request.args.get("top_k")
    if text is None:
        return default
    top_k = ascii_int(text)
    if top_k is None or top_k < 1:
        raise invalid(f"top_k must be a positive integer, got {text!r}")
    return top_k


def create_app(core: Core) -> flask.Flask:
    """The WSGI app for one worker: TF Serving's /v1 API, KServe V2, health, metrics and classify_image."""
    app = flask.Flask("petal")
    options = core.options
    app.config["MAX_CONTENT_LENGTH"] = options.max_request_bytes
    timeout = options.rest_api_timeout_in_ms / 1000.0

    @app.errorhandler(ServingError)
    def serving_error(error: ServingError) -> flask.Response:
        return error_response(http_status(error.code), error.message)

    @app.errorhandler(HTTPException)
    def http_error(error: HTTPException) -> flask.Response:
        if error.code == 404:
            return error_response(404, f"Not found: {flask.request.method} {flask.request.path}")
        return error_response(error.code or 500, error.description or error.name)

    @app.errorhandler(Exception)
    def internal_error(error: Exception) -> flask.Response:
        logger.exception("unhandled error", extra={"fields": {"path": flask.request.path}})
        return error_response(500, f"Internal error: {type(error).__name__}")

    @app.get("/healthz")
    def healthz() -> flask.Response:
        return json_response({"status": "live"})

    @app.get("/readyz")
    def readyz() -> flask.Response:
        if core.ready():
            return json_response({"status": "ready", "models": core.model_names()})
        waiting = [m for m in core.model_names() if not core.model_ready(m)]
        reason = "shutting down" if core.shutting_down else f"models without an AVAILABLE version: {waiting}"
        return error_response(503, f"Not ready: {reason}")

    if options.metrics_path:
        @app.get(options.metrics_path)
        def metrics() -> flask.Response:
            return flask.Response(core.metrics.render(), mimetype="text/plain; version=0.0.4")

    @app.before_request
    def v1() -> flask.Response | None:
        """Every /v1 path, matched case-insensitively like TF Serving (Flask's routing is case-sensitive)."""
        request = flask.request
        if request.path[:4].lower() != "/v1/":
            return None
        match = _V1_PATH.match(request.path)
        verb = (match.group("verb") or "").lower() if match else ""
        if match is None or (request.method == "GET") == bool(verb) or request.method not in ("GET", "POST") \
                or (match.group("metadata") and request.method != "GET"):
            raise invalid(f"Malformed request: {request.method} {request.path}")
        name, label = match.group("name"), match.group("label")
        version = parse_version(match.group("version"))
        if request.method == "GET":
            if match.group("metadata"):
                resolved, signatures = core.signatures(name, version, label)
                return json_response(metadata_response(name, resolved, signatures))
            return json_response(status_response(core.status(name, version, label)))
        deadline = time.monotonic() + timeout
        if verb == "predict":
            return _predict(name, version, label, deadline)
        if verb == "classify":
            return _classify(name, version, label, deadline)
        if verb == "classify_image":
            return _classify_image(name, version, label, deadline)
        if verb == "regress":
            return _regress(name, version, label)
        raise invalid(f"Malformed request: {request.method} {request.path}")

    def _predict(name: str, version: int | None, label: str | None, deadline: float) -> flask.Response:
        body = json_body(options.max_request_bytes)
        signature_name = string_field(body, "signature_name")
        row_format = check_predict_body(body)

        def inputs(signature: SignatureInfo) -> dict[str, object]:
            return predict_inputs(body, list(signature.inputs))
        result = core.predict(name, inputs, version, label, signature_name, deadline=deadline)
        return json_response(predict_response(result.outputs, row_format))

    def _classify(name: str, version: int | None, label: str | None, deadline: float) -> flask.Response:
        body = json_body(options.max_request_bytes)
        examples, context = body.get("examples"), body.get("context") or {}
        if not isinstance(examples, list) or not examples or not all(isinstance(e, dict) for e in examples) \
                or not isinstance(context, dict):
            raise invalid("\"examples\" must be a non-empty list of objects (and \"context\" an object)")
        images = []
        for example in examples:
            value = {**context, **example}.get(IMAGE_INPUT)
            if isinstance(value, list) and len(value) == 1:
                value = value[0]
            if not _is_b64(value):
                raise invalid(f"Each example needs an {IMAGE_INPUT!r} feature holding {{\"b64\": ...}} image bytes")
            images.append(_b64(value))
        _, results = core.classify_images(name, images, version, label, string_field(body, "signature_name"),
                                          top_k=1 << 30, deadline=deadline)
        return json_response({"results": [[[lbl, score] for lbl, score in row] for row in results]})

    def _regress(name: str, version: int | None, label: str | None) -> flask.Response:
        body = json_body(options.max_request_bytes)
        key = string_field(body, "signature_name") or DEFAULT_SIGNATURE
        _, signatures = core.signatures(name, version, label)
        if key not in signatures:
            raise invalid(f"Serving signature name: \"{key}\" not found in signature def")
        raise invalid(f"Expected regression signature method_name to be tensorflow/serving/regress. Was: "
                      f"{signatures[key].method_name}")

    def _classify_image(name: str, version: int | None, label: str | None, deadline: float) -> flask.Response:
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

    app.register_blueprint(kserve.create_blueprint(core))
    return app
