"""TF Serving's REST API (docs/protocols.md) plus Petal's `:classify_image`, as a Flask blueprint over the
dataplane; the bodies are the TF Serving JSON codec's (serving/protocols/codec/tfserving_json.py).

TF Serving matches its paths case-insensitively and puts the verb after a colon (`/v1/models/m:predict`). Flask's
routing is case-sensitive, so `normalize_v1_path` lower-cases the fixed words of a /v1 path (never the model
name or label) before routing, and werkzeug's `any` converter matches the known verbs after the colon, so the URL
map itself lists every operation (the OpenAPI contract test reads it). Any other /v1 path gets TF Serving's 400
"Malformed request" rather than a generic 404. As in TF Serving, a body is parsed before the model is looked up,
and its tensors are read for the signature once it is.
"""
from __future__ import annotations

import math
import re
import time
from collections.abc import Callable

import flask
from werkzeug.exceptions import UnsupportedMediaType
from werkzeug.routing import BaseConverter

from serving.core import CLASSIFY_METHOD, REGRESS_METHOD, DataPlane, ServingError, Task, invalid
from serving.options.config import ProtocolOptions
from serving.protocols.codec import strict_json, tfserving_json
from serving.protocols.codec.text import ascii_int
from serving.protocols.rest.admission import charge_of
from serving.protocols.rest.httputil import AS_SENT, content_encoding, current_request, json_response, request_body

DEFAULT_TOP_K = 5


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


# A GET that TF Serving's status path (kModelStatusApiRegex, model_servers/http_rest_api_util.cc) matches with the
# model name left out: `/v1/models`, `/v1/models/versions/3`, `/v1/models/labels/stable/metadata`.
_NAMELESS_GET = re.compile(r"/v1/models(?:/versions/[0-9]+|/labels/[^/:]+)?(?:/metadata)?")
INT64_MAX = 2**63 - 1


def malformed() -> ServingError:
    """TF Serving's 400 for a /v1 path that names no operation; "Missing model name in request." for a status or
    metadata GET without a name (model_servers/http_rest_api_handler.cc)."""
    if flask.request.method == "GET" and _NAMELESS_GET.fullmatch(flask.request.path):
        return invalid("Missing model name in request.")
    return invalid(f"Malformed request: {flask.request.method} {flask.request.path}")


def path_version(text: str | None) -> int | None:
    """The version a /v1 path names. TF Serving's path patterns take only digits there (http_rest_api_util.cc), so
    any other segment is a path it does not have, its "Malformed request"; it reads the digits as an int64
    (absl::SimpleAtoi), so a larger number is its 400 "Failed to convert version" rather than a version not
    found."""
    if text is None:
        return None
    version = ascii_int(text)
    if version is None:
        raise malformed()
    if version > INT64_MAX:
        raise invalid(f"Failed to convert version: {text} to numeric.")
    return version


def create_blueprint(dataplane: DataPlane, options: ProtocolOptions) -> flask.Blueprint:
    """TF Serving's /v1 API bound to `dataplane` (the app registers the converters and the error handlers)."""
    bp = flask.Blueprint("tfserving_v1", __name__, url_prefix="/v1/models")
    timeout = options.rest_api_timeout_in_ms / 1000.0
    spec_rules = {"latest": "/<segment:name>", "version": "/<segment:name>/versions/<segment:version>",
                  "label": "/<segment:name>/labels/<segment:label>"}

    def status(name: str, version: str | None = None, label: str | None = None) -> flask.Response:
        statuses = dataplane.status(name, path_version(version), label)
        return json_response(strict_json.encode(tfserving_json.status_response(statuses)))

    def metadata(name: str, version: str | None = None, label: str | None = None) -> flask.Response:
        resolved, signatures = dataplane.signatures(name, path_version(version), label, internal=True)
        return json_response(strict_json.encode(tfserving_json.metadata_response(name, resolved, signatures)))

    def body() -> tuple[bytes, strict_json.Charge]:
        request = current_request()
        charge = charge_of(request)
        return request_body(request, options.max_request_bytes, charge), charge

    def predict(name: str, version: int | None, label: str | None, deadline: float) -> flask.Response:
        request = tfserving_json.decode_predict(*body())
        result = dataplane.predict(name, request.tensors, version, label, request.signature_name, deadline=deadline)
        return json_response(tfserving_json.encode_predict(result.outputs, request.row_format))

    def examples(method: str, name: str, version: int | None, label: str | None, deadline: float) -> flask.Response:
        """TF Serving's :classify and :regress: "examples" (and "context") as tf.Examples, answered as "results"."""
        request = tfserving_json.decode_examples(*body())
        api = "classify" if method == CLASSIFY_METHOD else "regress"
        _, results = dataplane.multi_inference(name, [Task(method, request.signature_name)], request.input, version,
                                               label, deadline, api=api)
        return json_response(tfserving_json.encode_results(results[0]))

    def classify(name: str, version: int | None, label: str | None, deadline: float) -> flask.Response:
        return examples(CLASSIFY_METHOD, name, version, label, deadline)

    def regress(name: str, version: int | None, label: str | None, deadline: float) -> flask.Response:
        return examples(REGRESS_METHOD, name, version, label, deadline)

    def classify_image(name: str, version: int | None, label: str | None, deadline: float) -> flask.Response:
        request = current_request()
        top_k = _top_k(DEFAULT_TOP_K)
        if request.mimetype == "multipart/form-data":
            if content_encoding(request) not in AS_SENT:
                # werkzeug parses the form from the stream as sent: an encoded one would be read as garbage
                raise UnsupportedMediaType("A multipart form is read as sent: send it without Content-Encoding")
            upload = request.files.get("image")
            if upload is None:
                raise invalid("The multipart form has no field named 'image'")
            data = upload.read()
        elif request.mimetype.startswith("image/") or request.mimetype == "application/octet-stream":
            data = request_body(request, options.max_request_bytes, charge_of(request))
        else:
            raise invalid("Send the image as the body (Content-Type: image/*) or as the multipart form field "
                          f"'image'; got Content-Type {request.mimetype or 'none'!r}")
        if not data:
            raise invalid("The image is empty")
        resolved, results = dataplane.classify_images(name, [data], version, label, top_k=top_k, deadline=deadline)
        answer = {"model": name, "version": resolved,
                  "predictions": [{"label": lbl, "score": score} for lbl, score in results[0]]}
        return json_response(strict_json.encode(answer, all(math.isfinite(score) for _, score in results[0])))

    verbs: dict[str, Callable[[str, int | None, str | None, float], flask.Response]] = {
        "predict": predict, "classify": classify, "regress": regress, "classify_image": classify_image}

    def run_verb(name: str, verb: str, version: str | None = None, label: str | None = None) -> flask.Response:
        return verbs[verb](name, path_version(version), label, time.monotonic() + timeout)

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
