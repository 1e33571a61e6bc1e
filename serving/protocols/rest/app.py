"""The HTTP app of one worker: TF Serving's /v1 blueprint (`tfserving`), KServe V2's (`kserve`), health probes,
metrics, the OpenAPI contract (`openapi`) and the web UI (`web`), over one DataPlane.

Errors of every kind become TF Serving's `{"error": ...}` body with the status its table gives; a /v1
path that no rule matches, or a method a /v1 rule does not take, is TF Serving's 400 "Malformed request".
With --auth_token_file every route but the probes (and the metrics, unless --metrics_require_auth) needs a token.
TF Serving's error table: docs/protocols.md, 'Errors'.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import flask
from flask.sessions import NullSession, SessionInterface, SessionMixin
from flask_cors import CORS
from gunicorn.http.errors import ParseException
from werkzeug.exceptions import ClientDisconnected, HTTPException
from werkzeug.routing import MapAdapter

from serving.core import Code, DataPlane, ServingError
from serving.options.config import ProtocolOptions, SecurityOptions
from serving.protocols import access_log, auth
from serving.protocols.codec import strict_json
from serving.protocols.codec.v2_json import HEADER_LENGTH
from serving.protocols.rest import admission, kserve, openapi, tfserving, web
from serving.protocols.rest.httputil import error_response, json_response

logger = logging.getLogger(__name__)
# Routes that orchestrators probe without credentials: liveness and readiness, Petal's and KServe V2's.
PROBE_ENDPOINTS = frozenset({"healthz", "readyz", "kserve_v2.live", "kserve_v2.ready"})
# The model APIs, which wait for the worker's start-up (serving/core/startup.py); V2's per-model readiness is a
# probe and answers at once.
MODEL_API_BLUEPRINTS = frozenset({"tfserving_v1", "kserve_v2"})
NO_WAIT_ENDPOINTS = PROBE_ENDPOINTS | {"kserve_v2.model_ready", "kserve_v2.server_metadata"}
# The web pages, the API docs and the contract they render load without a token: the page is what asks for one.
OPEN_BLUEPRINTS = web.BLUEPRINTS | {"openapi"}

# What a browser page on another origin may send and read: a bearer token and JSON or image bodies (V2's binary
# extension and gzip included) in, the error body's retry and authentication hints out.
CORS_PATHS = (r"/v1/.*", r"/v2/.*", r"/petal/.*")
CORS_REQUEST_HEADERS = ["Authorization", "Content-Type", "Content-Encoding", HEADER_LENGTH]
CORS_RESPONSE_HEADERS = ["WWW-Authenticate", "Retry-After", HEADER_LENGTH]
CORS_PREFLIGHT_CACHE_S = 600
NOSNIFF = ("X-Content-Type-Options", "nosniff")
V1_CATCH_ALL = "tfserving_v1.malformed"  # serving/protocols/rest/tfserving.py's rule for /v1 paths no API has
_NO_SESSION = NullSession()


class NormalizeV1Paths:
    """WSGI middleware: routing sees TF Serving's case-insensitive /v1 paths in one spelling."""

    def __init__(self, app):
        self.app = app

    def __call__(self, environ, start_response):
        environ["PATH_INFO"] = tfserving.normalize_v1_path(environ.get("PATH_INFO", ""))
        return self.app(environ, start_response)


class NoSniff:
    """WSGI middleware: every answer of the app, JSON errors included, says `X-Content-Type-Options: nosniff`, so
    that a browser never runs an answer (a JSON error that echoes a client's text, say) as the HTML or script it
    might sniff in it. One constant header appended to the list werkzeug builds for each response, rather than a
    Flask hook that sets it through the Headers object on the predict path."""

    def __init__(self, app):
        self.app = app

    def __call__(self, environ, start_response):
        def start(status, headers, exc_info=None):
            headers.append(NOSNIFF)
            return start_response(status, headers, exc_info)
        return self.app(environ, start)


class _NoSessions(SessionInterface):
    """No session: Petal keeps no state between requests, so none is opened (Flask's default opens a signed-cookie
    session on every request)."""

    def open_session(self, app: flask.Flask, request: flask.Request) -> NullSession:
        return _NO_SESSION

    def save_session(self, app: flask.Flask, session: SessionMixin, response: flask.Response) -> None:
        pass


class PetalFlask(flask.Flask):
    """Flask without the per-request work of what Petal does not use: sessions, and async views (Flask asks of
    every hook and view, on every request, whether it is a coroutine function); and with OPTIONS answered as an
    HTTP API answers it."""
    session_interface = _NoSessions()

    def ensure_sync(self, func: Callable[..., Any]) -> Callable[..., Any]:
        return func

    def make_default_options_response(self) -> flask.Response:
        """OPTIONS, which no view takes: 204 without a body, the methods the path's views take in `Allow` (RFC 9110
        §9.3.7), for a plain OPTIONS and a CORS preflight alike (flask-cors adds its headers to this answer).
        Flask's default was a 200 typed text/html whose `Allow` had the /v1 catch-all's PUT, DELETE and PATCH; a
        /v1 path that only the catch-all matches gets its 400 Malformed request, as every other method does."""
        adapter = flask.globals.request_ctx.url_adapter
        assert adapter is not None  # routing has matched the request to a rule, or this would not be called
        methods = served_methods(adapter)
        if not methods:
            raise tfserving.malformed()
        response = self.response_class(status=204)
        del response.headers["Content-Type"]
        response.allow.update(methods | {"OPTIONS"})
        return response


def served_methods(adapter: MapAdapter) -> set[str]:
    """The methods the request's path has a view for, OPTIONS aside, the /v1 catch-all's left out."""
    served = set()
    for method in adapter.allowed_methods():
        try:
            endpoint, _ = adapter.match(method=method)
        except HTTPException:
            continue
        if endpoint != V1_CATCH_ALL and method != "OPTIONS":
            served.add(method)
    return served


def allow_origins(app: flask.Flask, origins: tuple[str, ...]) -> None:
    """CORS on the APIs for these origins; without any, no CORS header is ever sent, so only same-origin pages
    (the web UI) can read the answers. A preflight is Flask's automatic OPTIONS answer, which never reaches a view,
    with flask-cors's headers added; it carries no token, so a before_request check must let OPTIONS pass."""
    if not origins:
        return
    CORS(app, resources={path: {} for path in CORS_PATHS}, origins=list(origins), methods=["GET", "POST"],
         allow_headers=CORS_REQUEST_HEADERS, expose_headers=CORS_RESPONSE_HEADERS, max_age=CORS_PREFLIGHT_CACHE_S)

    @app.after_request
    def vary_on_origin(response: flask.Response) -> flask.Response:
        """Answers differ by Origin, so a shared cache must not give one origin's to another; flask-cors leaves
        `Vary: Origin` out when a single origin is allowed."""
        response.vary.add("Origin")
        return response


def create_app(dataplane: DataPlane, protocols: ProtocolOptions | None = None,
               security: SecurityOptions | None = None) -> flask.Flask:
    """The worker's HTTP app over `dataplane`, with the listeners' and the security options (each group's defaults
    when not given)."""
    protocols = protocols or ProtocolOptions()
    security = security or SecurityOptions()
    app = PetalFlask("petal")
    app.config["MAX_CONTENT_LENGTH"] = protocols.max_request_bytes
    app.url_map.converters.update(segment=tfserving.SegmentConverter)
    app.wsgi_app = NoSniff(NormalizeV1Paths(app.wsgi_app))  # type: ignore[method-assign]  # Flask's middleware way

    authenticator = auth.Authenticator(security.tokens, security.enable_model_control)
    open_endpoints = PROBE_ENDPOINTS | ({"metrics"} if not security.metrics_require_auth else set())

    if protocols.access_log:
        access_log.enable()

        @app.before_request
        def start_clock() -> None:
            flask.g.started = time.perf_counter()
            flask.g.request_id = access_log.request_id(flask.request.headers.get(access_log.HEADER))

        @app.after_request
        def log_request(response: flask.Response) -> flask.Response:
            request, view_args = flask.request, flask.request.view_args or {}
            response.headers[access_log.HEADER] = flask.g.request_id
            access_log.write(request_id=flask.g.request_id, protocol="rest", method=request.method,
                             path=request.path, model=view_args.get("name") or view_args.get("model"),
                             version=view_args.get("version") or view_args.get("label"),
                             status=response.status_code, bytes_in=request.content_length or 0,
                             bytes_out=response.calculate_content_length() or 0, remote=request.remote_addr,
                             latency_ms=round(1000 * (time.perf_counter() - flask.g.started), 3))
            return response

    def authenticate() -> None:
        """The pages and their assets load without a token (they then ask for one), and a CORS preflight never
        carries one; everything they call is checked."""
        request = flask.request
        if request.method == "OPTIONS" or request.endpoint in open_endpoints \
                or (request.blueprint or "") in OPEN_BLUEPRINTS:
            return
        authenticator.check(request.headers.get("Authorization"), auth.PREDICT)

    if authenticator.required:  # the tokens are read once, at start
        app.before_request(authenticate)

    @app.before_request
    def wait_for_startup() -> None:
        """As TF Serving's clients expect, a model call made while the initial load runs is answered once it is
        over (or its REST deadline passes), rather than with "loading" or "not found"."""
        if dataplane.startup.done:  # open for good: no request needs looking at
            return
        request = flask.request
        if request.blueprint in MODEL_API_BLUEPRINTS and request.endpoint not in NO_WAIT_ENDPOINTS \
                and request.method != "OPTIONS":  # a CORS preflight asks nothing of a model
            dataplane.wait_started(time.monotonic() + protocols.rest_api_timeout_in_ms / 1000.0)
            # the body is read only now: --request_body_timeout counts from here, not from its head's arrival
            # (the gevent front end's socket; a start-up longer than that timeout answered 408)
            restart = getattr(request.environ.get("gunicorn.socket"), "start_body", None)
            if restart is not None:
                restart()

    admission.install(app, dataplane)

    @app.errorhandler(ServingError)
    def serving_error(error: ServingError) -> flask.Response:
        response = error_response(error.code.http_status, error.message)
        if error.code == Code.UNAUTHENTICATED:
            response.headers["WWW-Authenticate"] = auth.www_authenticate(flask.request.headers.get("Authorization"))
        return response

    @app.errorhandler(HTTPException)
    def http_error(error: HTTPException) -> flask.Response:
        if isinstance(error, ClientDisconnected) and isinstance(error.__context__, HTTPException):
            error = error.__context__  # what a body read raised, as werkzeug's stream turns any OSError into a 400
        if error.code in (404, 405) and flask.request.path.startswith("/v1/"):
            return serving_error(tfserving.malformed())
        if error.code == 404:
            return error_response(404, f"Not found: {flask.request.method} {flask.request.path}")
        return error_response(error.code or 500, error.description or error.name)

    @app.errorhandler(ParseException)
    def malformed_body(error: ParseException) -> flask.Response:
        """gunicorn reads a chunked body as the view asks for it, so a chunk it cannot parse is raised there."""
        return error_response(400, f"Malformed request body: {error}")

    @app.errorhandler(Exception)
    def internal_error(error: Exception) -> flask.Response:
        logger.exception("unhandled error", extra={"fields": {"path": flask.request.path}})
        return error_response(500, f"Internal error: {type(error).__name__}")

    @app.get("/healthz")
    def healthz() -> flask.Response:
        return json_response(strict_json.encode({"status": "live"}))

    @app.get("/readyz")
    def readyz() -> flask.Response:
        if dataplane.ready():
            return json_response(strict_json.encode({"status": "ready", "models": dataplane.model_names()}))
        waiting = [m for m in dataplane.model_names() if not dataplane.model_ready(m)]
        reason = "shutting down" if dataplane.draining() else f"models without an AVAILABLE version: {waiting}"
        return error_response(503, f"Not ready: {reason}")

    @app.get("/petal/models")
    def models() -> flask.Response:
        """The configured models and their version labels: TF Serving has no call that lists either, and the web
        UI's pickers need both."""
        return json_response(strict_json.encode({"models": [{"name": name, "version_labels": labels}
                                                             for name, labels in dataplane.version_labels().items()]}))

    if protocols.metrics_path:
        @app.get(protocols.metrics_path)
        def metrics() -> flask.Response:
            return flask.Response(dataplane.metrics.render(), mimetype="text/plain; version=0.0.4")

    app.register_blueprint(tfserving.create_blueprint(dataplane, protocols))
    app.register_blueprint(kserve.create_blueprint(dataplane, protocols))
    app.register_blueprint(kserve.create_extensions_blueprint(dataplane))
    app.register_blueprint(openapi.create_blueprint(protocols.metrics_path))
    if not protocols.disable_web_ui:
        app.register_blueprint(web.create_blueprint())
        app.register_blueprint(web.create_docs_blueprint())
    allow_origins(app, protocols.cors_allowed_origins)
    return app
