"""The web UI: a page that classifies a photo (`/`), a status page (`/models`) and Swagger UI over
`/openapi.json` (`/docs`).

The pages are static HTML, CSS and JavaScript modules shipped as package data (`static/`) and Swagger UI's
assets come from the flask-swagger-ui wheel, so nothing is built and nothing is fetched from a CDN: the UI works
on a machine without internet access. The pages call the public APIs only (TF Serving's /v1 and Petal's
/petal/models), exactly as any other client would, so they show what a client sees. `--disable_web_ui` leaves
this module's blueprints unregistered.
"""
from __future__ import annotations

import flask
from flask_swagger_ui import get_swaggerui_blueprint

ASSETS_URL = "/ui"
DOCS_URL = "/docs"
OPENAPI_URL = "/openapi.json"
# Swagger UI asks validator.swagger.io about the spec unless told not to; offline that is a broken badge.
SWAGGER_CONFIG = {"app_name": "Petal API", "layout": "BaseLayout", "deepLinking": True, "validatorUrl": None}


# The pages and the API docs (serving/protocols/rest/app.py lets them load without a token).
BLUEPRINTS = frozenset({"web_ui", "api_docs"})


def create_blueprint() -> flask.Blueprint:
    """The two pages and their assets (under /ui/)."""
    bp = flask.Blueprint("web_ui", __name__, static_folder="static", static_url_path=ASSETS_URL)

    @bp.get("/")
    def classify_page() -> flask.Response:
        return bp.send_static_file("index.html")

    @bp.get("/models")
    def models_page() -> flask.Response:
        return bp.send_static_file("models.html")

    return bp


def create_docs_blueprint() -> flask.Blueprint:
    """Swagger UI at /docs/ over the server's own /openapi.json, from assets in the flask-swagger-ui wheel."""
    return get_swaggerui_blueprint(DOCS_URL, OPENAPI_URL, config=dict(SWAGGER_CONFIG), blueprint_name="api_docs")
