"""CORS on the APIs (`--cors_allowed_origins`), the web UI's routes and `--disable_web_ui`, and `/petal/models`, in
process: Flask's test client over a DataPlane whose model has no versions yet, since none of this needs a model to run.

A browser decides from these headers alone, so the checks are on the headers: a preflight and an actual request
from an allowed origin get `Access-Control-Allow-Origin` (error answers too, or the page could not read their
message); a refused origin, or any origin when none is configured, gets no CORS header at all.
"""
from __future__ import annotations

import pytest

from serving.options.config import ProtocolOptions
from serving.process.flags import parse_args
from serving.protocols.rest.app import create_app

ALLOWED = "https://dashboard.example"
REFUSED = "https://evil.example"
CLASSIFY = "/v1/models/flowers:classify_image"
INFER = "/v2/models/flowers/infer"


@pytest.fixture(scope="module")
def dataplane_for(make_dataplane, tmp_path_factory):
    """Cores over one config (a model with a label, no versions on disk), one per option set, closed at the end."""
    root = tmp_path_factory.mktemp("web")
    config = root / "models.config"
    config.write_text(f'model_config_list {{ config {{ name: "flowers" base_path: "{root / "flowers"}" '
                      'model_platform: "tensorflow" version_labels { key: "stable" value: 1 } } }')
    return lambda **options: make_dataplane(loaded=False, model_config_file=str(config), **options)


@pytest.fixture(scope="module")
def client(dataplane_for):
    return create_app(dataplane_for(), ProtocolOptions(cors_allowed_origins=(ALLOWED,))).test_client()


def preflight(client, path: str, origin: str):
    return client.options(path, headers={"Origin": origin, "Access-Control-Request-Method": "POST",
                                         "Access-Control-Request-Headers": "authorization, content-type"})


def header_set(response, name: str) -> set[str]:
    return {h.strip().lower() for h in response.headers.get(name, "").split(",") if h.strip()}


@pytest.mark.parametrize("path", [CLASSIFY, INFER, "/v1/models/flowers/versions/1:predict"])
def test_an_allowed_origin_passes_the_preflight_with_a_token_and_a_body(client, path):
    response = preflight(client, path, ALLOWED)
    assert response.status_code == 204 and not response.data
    assert response.headers["Access-Control-Allow-Origin"] == ALLOWED
    assert {"authorization", "content-type"} <= header_set(response, "Access-Control-Allow-Headers")
    assert "POST" in response.headers["Access-Control-Allow-Methods"]
    assert int(response.headers["Access-Control-Max-Age"]) > 0


@pytest.mark.parametrize("path", [CLASSIFY, INFER])
def test_a_refused_origin_gets_no_cors_headers(client, path):
    for response in (preflight(client, path, REFUSED), client.get("/v1/models/flowers", headers={"Origin": REFUSED})):
        assert not [h for h in response.headers if h[0].lower().startswith("access-control-")]


def test_actual_requests_from_an_allowed_origin_can_read_answers_and_errors(client):
    status = client.get("/v1/models/flowers", headers={"Origin": ALLOWED})
    assert status.status_code == 404 and status.get_json()["error"]  # no versions yet: an error the page must read
    assert status.headers["Access-Control-Allow-Origin"] == ALLOWED
    assert {"www-authenticate", "retry-after"} <= header_set(status, "Access-Control-Expose-Headers")
    assert "Origin" in status.headers.get("Vary", "")
    listing = client.get("/petal/models", headers={"Origin": ALLOWED})
    assert listing.headers["Access-Control-Allow-Origin"] == ALLOWED
    ready = client.get("/v2/health/live", headers={"Origin": ALLOWED})
    assert ready.headers["Access-Control-Allow-Origin"] == ALLOWED


def test_no_origin_is_allowed_by_default(dataplane_for):
    client = create_app(dataplane_for()).test_client()
    for response in (preflight(client, CLASSIFY, ALLOWED),
                     client.get("/v1/models/flowers", headers={"Origin": ALLOWED})):
        assert "Access-Control-Allow-Origin" not in response.headers


@pytest.mark.parametrize("path, allow", [(CLASSIFY, "OPTIONS, POST"), (INFER, "OPTIONS, POST"),
                                         ("/v1/models/flowers", "GET, HEAD, OPTIONS"), ("/", "GET, HEAD, OPTIONS")])
def test_options_without_cors_is_204_with_the_methods_the_path_takes(dataplane_for, path, allow):
    """As an HTTP API answers it, with no body typed text/html (Flask's default), and in `Allow` only the methods a
    view takes: not the PUT, DELETE and PATCH that /v1's catch-all answers with 400."""
    client = create_app(dataplane_for()).test_client()
    for response in (client.options(path), preflight(client, path, ALLOWED)):
        assert (response.status_code, response.data, response.content_type) == (204, b"", None)
        assert sorted(response.allow) == allow.split(", ")


@pytest.mark.parametrize("path, status, error", [("/v1/models/flowers/nope", 400, "Malformed request: OPTIONS "),
                                                 ("/nothing", 404, "Not found: OPTIONS ")])
def test_options_on_a_path_no_view_takes_is_the_json_error_of_any_method(dataplane_for, path, status, error):
    response = create_app(dataplane_for()).test_client().options(path)
    assert (response.status_code, response.get_json()) == (status, {"error": error + path})


def test_a_wildcard_allows_any_origin(dataplane_for):
    client = create_app(dataplane_for(), ProtocolOptions(cors_allowed_origins=("*",))).test_client()
    assert preflight(client, INFER, REFUSED).headers["Access-Control-Allow-Origin"] in ("*", REFUSED)


def test_petal_models_lists_the_configured_models_and_their_labels(client):
    response = client.get("/petal/models")
    assert response.status_code == 200
    assert response.get_json() == {"models": [{"name": "flowers", "version_labels": {"stable": 1}}]}


@pytest.mark.parametrize("path, mimetype, text", [
    ("/", "text/html", "Classify a photo"), ("/models", "text/html", "Models"),
    ("/docs/", "text/html", "/openapi.json"), ("/ui/classify.js", "text/javascript", "classify_image"),
    ("/ui/petal.css", "text/css", "--accent"), ("/docs/swagger-ui-bundle.js", "text/javascript", "SwaggerUIBundle"),
])
def test_the_web_ui_is_served_from_package_data(client, path, mimetype, text):
    response = client.get(path)
    assert response.status_code == 200 and response.mimetype == mimetype
    assert text in response.get_data(as_text=True)


def test_disable_web_ui_leaves_the_pages_out_and_the_apis_in(dataplane_for):
    client = create_app(dataplane_for(), ProtocolOptions(disable_web_ui=True)).test_client()
    for path in ("/", "/models", "/docs/", "/ui/classify.js"):
        response = client.get(path)
        assert response.status_code == 404 and response.get_json()["error"], path
    assert client.get("/petal/models").status_code == 200
    assert client.get("/healthz").status_code == 200


def test_the_flags_parse(tmp_path, capsys):
    assert parse_args([]).protocols.cors_allowed_origins == () and parse_args([]).protocols.disable_web_ui is False
    options = parse_args([f"--cors_allowed_origins={ALLOWED}, http://localhost:3000/", "--disable_web_ui"]).protocols
    assert options.cors_allowed_origins == (ALLOWED, "http://localhost:3000") and options.disable_web_ui is True
    assert parse_args(["--disable_web_ui=false"]).protocols.disable_web_ui is False
    for bad in ("dashboard.example", "https://dashboard.example/app", "ftp://x.example"):
        with pytest.raises(SystemExit) as exit_info:
            parse_args([f"--cors_allowed_origins={bad}"])
        assert exit_info.value.code == 2
        assert f"--cors_allowed_origins: not an origin (scheme://host[:port]): {bad!r}" in capsys.readouterr().err
