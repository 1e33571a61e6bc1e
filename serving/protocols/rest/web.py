"""The web UI: a page that classifies a photo (`/`), a status page (`/models`) and Swagger UI over
`/openapi.json` (`/docs`).

The pages are static HTML, CSS and JavaScript modules shipped as package data (`static/`) and Swagger UI's
assets come from the flask-swagger-ui wheel, so nothing is built and nothing is fetched from a CDN: the UI works
on a machine without internet access. The pages call the public APIs only (TF Serving's /v1 and Petal's
/petal/models), exactly as any other client would, so they show what a client sees. `--disable_web_ui` leaves
this module's blueprints unregistered.
"""
from __future__ import annotations

from collections.abc import Callable

import flask
from flask_swagger_ui import get_swaggerui_blueprint

ASSETS_URL = "/ui"
DOCS_URL = "/docs"
OPENAPI_URL = "/openapi.json"
# Swagger UI asks validator.swagger.io about the spec unless told not to; offline that is a broken badge.
SWAGGER_CONFIG = {"app_name": "Petal API", "layout": "BaseLayout", "deepLinking": True, "validatorUrl": None}


# The pages and the API docs (serving/protocols/rest/app.py lets them load without a token).
BLUEPRINTS = frozenset({"web_ui", "api_docs"})

# The pages load their own scripts, styles and API answers and nothing else, run no inline script (an injected one
# cannot run), and are never framed (no clickjacking of the token form); `data:` is the empty favicon, `blob:` the
# photo's preview. The forms are submitted by script, never navigated.
PAGE_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
            "connect-src 'self'; form-action 'none'; base-uri 'none'; frame-ancestors 'none'")
# Swagger UI's page starts from an inline script whose text holds the request's URL, so no hash can allow it; its
# sources are confined to this server all the same, and it is never framed.
DOCS_CSP = ("default-src 'self'; script-src 'self' 'unsafe-inline'; style-src 'self' 'unsafe-inline'; "
            "img-src 'self' data:; object-src 'none'; base-uri 'none'; frame-ancestors 'none'")


def _page_headers(csp: str) -> Callable[[flask.Response], flask.Response]:
    """An after_request hook that sends `csp` and denies framing (X-Frame-Options for browsers older than CSP's
    frame-ancestors) on a blueprint's responses; the blueprints serve pages, never the APIs' hot path."""
    headers = {"Content-Security-Policy": csp, "X-Frame-Options": "DENY"}

    def add(response: flask.Response) -> flask.Response:
        response.headers.update(headers)
        return response
    return add


def create_blueprint() -> flask.Blueprint:
    """The two pages and their assets (under /ui/)."""
    bp = flask.Blueprint("web_ui", __name__, static_folder="static", static_url_path=ASSETS_URL)
    bp.after_request(_page_headers(PAGE_CSP))

    @bp.get("/")
    def classify_page() -> flask.Response:
        return bp.send_static_file("index.html")

    @bp.get("/models")
    def models_page() -> flask.Response:
        return bp.send_static_file("models.html")

    return bp


def create_docs_blueprint() -> flask.Blueprint:
    """Swagger UI at /docs/ over the server's own /openapi.json, from assets in the flask-swagger-ui wheel."""
    bp = get_swaggerui_blueprint(DOCS_URL, OPENAPI_URL, config=dict(SWAGGER_CONFIG), blueprint_name="api_docs")
    bp.after_request(_page_headers(DOCS_CSP))
    return bp
