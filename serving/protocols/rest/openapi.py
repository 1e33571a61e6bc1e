"""`GET /openapi.json`: the OpenAPI 3.1 contract of the REST port, for client generators, gateways and fuzzers.

The contract is the hand-written `openapi.json` beside this module, not derived from the routes: what clients may
rely on is decided by a person, and tests/inprocess/test_http_inprocess.py fails when it and the app's URL rules
drift apart (and tests/e2e/test_openapi.py fuzzes a real server against it). Only what depends on the running
server is filled in here: the package version and the metrics path, which --monitoring_config_file moves or
removes.
"""
from __future__ import annotations

import copy
import json
from functools import cache
from importlib import metadata, resources

import flask

from serving.options.config import DEFAULT_METRICS_PATH
from serving.protocols.codec import strict_json
from serving.protocols.rest.httputil import JSON_MIMETYPE

CONTRACT_PATH = "/openapi.json"


@cache
def _written() -> dict:
    """The contract as the file has it, parsed once per process."""
    return json.loads(resources.files(__package__).joinpath("openapi.json").read_text(encoding="utf-8"))


def server_version() -> str:
    try:
        return metadata.version("petal")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "0+unknown"


def contract(metrics_path: str | None) -> dict:
    """The contract of a server whose Prometheus metrics are at `metrics_path` (None: not served)."""
    document = copy.deepcopy(_written())
    document["info"]["version"] = server_version()
    paths = document["paths"]
    metrics = paths.pop(DEFAULT_METRICS_PATH)
    if metrics_path:
        paths[metrics_path] = metrics
    return document


def create_blueprint(metrics_path: str | None) -> flask.Blueprint:
    """The route serving the contract, rendered once: it cannot change while the server runs."""
    bp = flask.Blueprint("openapi", __name__)
    body = strict_json.encode(contract(metrics_path))

    @bp.get(CONTRACT_PATH)
    def openapi() -> flask.Response:
        return flask.Response(body, mimetype=JSON_MIMETYPE)

    return bp
