"""KServe V2 / Open Inference Protocol over REST (docs/protocols.md), with Triton's binary-data and classification
extensions and its model-configuration and statistics routes, on the same Flask app and DataPlane as the TF
Serving REST API. The bodies are the V2 JSON codec's (serving/protocols/codec/v2_json.py).

A V2 "model" is a DataPlane model's serving signature (serving_default unless the request's
`parameters.signature_name` names another); V2 input and output names are the signature's tensor names.
"""
from __future__ import annotations

import time
from typing import Any

import flask

from serving.core import DataPlane, not_found
from serving.options.config import ProtocolOptions
from serving.protocols import v2
from serving.protocols.codec import v2_json
from serving.protocols.codec.text import parse_version
from serving.protocols.codec.v2_json import HEADER_LENGTH
from serving.protocols.rest.admission import charge_of
from serving.protocols.rest.httputil import JSON_MIMETYPE, current_request, request_body

HEADER_ENVIRON = "HTTP_" + HEADER_LENGTH.upper().replace("-", "_")  # the header as WSGI names it


def create_blueprint(dataplane: DataPlane, options: ProtocolOptions) -> flask.Blueprint:
    """The V2 routes bound to `dataplane`. Every failure is a JSON {"error"} with the TF code's HTTP status (the app's
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
        return probe("ready", dataplane.ready())

    @bp.get("/v2/models/<model>/ready")
    @bp.get("/v2/models/<model>/versions/<version>/ready")
    def model_ready(model: str, version: str | None = None) -> tuple[dict[str, Any], int]:
        """An unknown model or version is an error, a 404 with a JSON body as TF Serving answers it, not the probe's
        false, which is for a known version that is not AVAILABLE (loading, say) or a server shutting down."""
        if model not in dataplane.model_names():
            raise not_found(f"Could not find any versions of model {model}")
        number = parse_version(version)
        if number is not None:
            dataplane.status(model, number)  # NOT_FOUND for a version the model does not have
        return probe("ready", dataplane.model_ready(model, number), name=model)

    @bp.get("/v2/models/<model>")
    @bp.get("/v2/models/<model>/versions/<version>")
    def metadata(model: str, version: str | None = None) -> Any:
        return v2.model_metadata(dataplane, model, parse_version(version))

    @bp.post("/v2/models/<model>/infer")
    @bp.post("/v2/models/<model>/versions/<version>/infer")
    def infer(model: str, version: str | None = None) -> flask.Response:
        """The model and version are looked up before the body is decoded: a request for one the server does not
        have is a 404, whatever its body."""
        deadline = time.monotonic() + options.rest_api_timeout_in_ms / 1000.0
        number = parse_version(version)
        dataplane.signatures(model, number)
        http = current_request()
        charge = charge_of(http)
        request = v2_json.decode_request(request_body(http, options.max_request_bytes, charge),
                                         http.environ.get(HEADER_ENVIRON), charge)
        result = dataplane.predict(model=model, inputs=v2.with_triton_dims(request.inputs, model), version=number,
                                   signature_name=request.signature_name,
                                   output_filter=[o.name for o in request.outputs] or None, deadline=deadline,
                                   entrypoint="REST")
        body, header_length = v2_json.encode_response(request, result,
                                                      v2.answered_by_a_batching_model(dataplane, result))
        if header_length is None:
            return flask.Response(body, mimetype=JSON_MIMETYPE)
        response = flask.Response(body, mimetype="application/octet-stream")
        response.headers[HEADER_LENGTH] = str(header_length)
        return response

    return bp


def create_extensions_blueprint(dataplane: DataPlane) -> flask.Blueprint:
    """Triton's model-configuration and statistics extensions over REST; errors are the app's JSON {"error"}."""
    bp = flask.Blueprint("triton_extensions", __name__)

    @bp.get("/v2/models/<model>/config")
    @bp.get("/v2/models/<model>/versions/<version>/config")
    def config(model: str, version: str | None = None) -> Any:
        return v2.model_config(dataplane, model, parse_version(version))

    @bp.get("/v2/models/stats")
    @bp.get("/v2/models/<model>/stats")
    @bp.get("/v2/models/<model>/versions/<version>/stats")
    def stats(model: str | None = None, version: str | None = None) -> Any:
        return v2.model_statistics(dataplane, model, parse_version(version))

    return bp
