"""The HTTP app of one worker: TF Serving's /v1 blueprint, KServe V2's, health probes, metrics and the OpenAPI
contract (`openapi`), over one Core.

Errors of every kind become TF Serving's `{"error": ...}` body with the status its table gives (SPEC §1); a /v1
path that no rule matches, or a method a /v1 rule does not take, is TF Serving's 400 "Malformed request".
"""
from __future__ import annotations

import logging

import flask
from werkzeug.exceptions import HTTPException

from serving.core import Core, ServingError
from serving.protocols import kserve, openapi, rest
from serving.protocols.httputil import error_response, json_response

logger = logging.getLogger(__name__)


class NormalizeV1Paths:
    """WSGI middleware: routing sees TF Serving's case-insensitive /v1 paths in one spelling."""

    def __init__(self, app):
        self.app = app

    def __call__(self, environ, start_response):
        environ["PATH_INFO"] = rest.normalize_v1_path(environ.get("PATH_INFO", ""))
        return self.app(environ, start_response)


def create_app(core: Core) -> flask.Flask:
    app = flask.Flask("petal")
    app.config["MAX_CONTENT_LENGTH"] = core.options.max_request_bytes
    app.url_map.converters.update(segment=rest.SegmentConverter)
    app.wsgi_app = NormalizeV1Paths(app.wsgi_app)

    @app.errorhandler(ServingError)
    def serving_error(error: ServingError) -> flask.Response:
        return error_response(error.code.http_status, error.message)

    @app.errorhandler(HTTPException)
    def http_error(error: HTTPException) -> flask.Response:
        if error.code in (404, 405) and flask.request.path.startswith("/v1/"):
            return serving_error(rest.malformed())
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

    if core.options.metrics_path:
        @app.get(core.options.metrics_path)
        def metrics() -> flask.Response:
            return flask.Response(core.metrics.render(), mimetype="text/plain; version=0.0.4")

    app.register_blueprint(rest.create_blueprint(core))
    app.register_blueprint(kserve.create_blueprint(core))
    app.register_blueprint(openapi.create_blueprint(core.options.metrics_path))
    return app
