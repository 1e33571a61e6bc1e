"""The web UI in a real headless Chromium: Playwright's Python package driving the system's `chromium` (Debian's;
`.ci/run` installs it, as Playwright's own browser downloads need the internet).

Most tests run against `petal serve` on the default flowers model. The token flow and a 503 need a server side that
this branch does not have (bearer tokens) or cannot provoke on demand (a full queue), so those run the same
blueprint inside a small Flask stub that answers as the real server would. Every page is also checked to load
nothing from anywhere but its own server: the UI must work offline.

Under CI (CI=true) a missing chromium or playwright fails these tests instead of skipping them.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator

import flask
import pytest
from werkzeug.serving import make_server

from server_harness import ROOT, Server, run_server
from serving.protocols.rest import web
from training.synth import CLASSES, render

UPDATE_SCREENSHOT = "PETAL_UPDATE_SCREENSHOT"  # set to 1 to rewrite docs/web-ui.png from this run
SCREENSHOT = os.path.join(ROOT, "docs", "web-ui.png")
MAX_REQUEST_BYTES = 300_000
ROSE = render("roses", seed=3)
TIMEOUT_MS = 20_000


def _missing(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"{reason}; CI must run the browser tests (.ci/run installs chromium)")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def browser():
    """One headless Chromium for the module."""
    chromium = shutil.which("chromium")
    if chromium is None:
        _missing("no `chromium` on PATH (apt-get install chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing("the playwright package is missing (pip install -e '.[test]')")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def server(stub_site) -> Iterator[Server]:
    """`petal serve` on the default model, with a body limit small enough that a test can exceed it, allowing
    pages from the stub's origin to call it."""
    with run_server("--port=0", f"--max_request_bytes={MAX_REQUEST_BYTES}",
                    f"--cors_allowed_origins={stub_site[0]}") as server:
        yield server


def open_page(browser, origin: str, **context_options):
    """A fresh tab (own session storage) that fails the test on a JavaScript error, a Content Security Policy
    violation or a request off `origin`. (Predicates for wait_for_function are written as functions: Playwright
    evals a bare expression in the page, which the pages' policy forbids.)"""
    context = browser.new_context(**context_options)
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    page.petal_errors = []
    page.on("pageerror", lambda error: page.petal_errors.append(f"JavaScript error: {error}"))
    page.on("console", lambda message: page.petal_errors.append(f"CSP: {message.text}")
            if message.type == "error" and "Content Security Policy" in message.text else None)
    page.on("request", lambda request: None if request.url.startswith(origin + "/") or
            request.url.startswith(("data:", "blob:")) else page.petal_errors.append(f"off-origin: {request.url}"))
    return page


@pytest.fixture
def page(browser, server):
    page = open_page(browser, server.rest_url)
    yield page
    page.context.close()
    assert not page.petal_errors


def post(url: str, data: bytes, content_type: str) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=data, headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as error:
        return error.code, json.load(error)


def choose_photo(page, name: str, data: bytes, mime_type: str) -> None:
    page.get_by_label("Drop a photo here, or choose a file").set_input_files(
        files=[{"name": name, "mimeType": mime_type, "buffer": data}])


def open_classify_page(page, url: str) -> None:
    page.goto(url + "/")
    page.wait_for_function("() => document.querySelector('#model').options.length > 0 && "
                           "document.querySelector('#version').options.length > 0")


def bars(page) -> list[tuple[str, str]]:
    page.locator("#predictions li").first.wait_for()
    return [(item.locator(".label").inner_text(), item.locator(".score").inner_text())
            for item in page.locator("#predictions li").all()]


def test_a_real_jpeg_gets_labels_with_scores_latency_and_the_curl_that_does_the_same(page, server, tmp_path):
    open_classify_page(page, server.rest_url)
    assert page.get_by_label("Model").input_value() == "flowers"
    assert page.locator("#token-form").is_hidden()  # no token asked for where none is needed
    choose_photo(page, "rose.jpg", ROSE, "image/jpeg")
    shown = bars(page)
    assert len(shown) == 5 and {label for label, _ in shown} <= set(CLASSES)
    assert all(re.fullmatch(r"\d{1,3}\.\d%", score) for _, score in shown)
    assert re.fullmatch(r"flowers, version 1: answered in \d+ ms", page.locator("#latency").inner_text())

    curl = page.locator("#curl").inner_text()
    assert f"'{server.rest_url}/v1/models/flowers:classify_image?top_k=5'" in curl and "'@rose.jpg'" in curl
    if shutil.which("curl"):  # the command shown gives the answer shown
        (tmp_path / "rose.jpg").write_bytes(ROSE)
        answer = json.loads(subprocess.run(["bash", "-c", curl], cwd=tmp_path, capture_output=True, text=True,
                                           check=True, timeout=30).stdout)
        assert [p["label"] for p in answer["predictions"]] == [label for label, _ in shown]

    page.set_viewport_size({"width": 900, "height": 900})
    page.screenshot(path=SCREENSHOT if os.environ.get(UPDATE_SCREENSHOT) else str(tmp_path / "web-ui.png"),
                    full_page=True)


def headers_of(url: str) -> dict[str, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return dict(response.headers)
    except urllib.error.HTTPError as error:
        return dict(error.headers)


@pytest.mark.parametrize("path, csp", [("/", web.PAGE_CSP), ("/models", web.PAGE_CSP),
                                       ("/ui/classify.js", web.PAGE_CSP), (web.DOCS_URL + "/", web.DOCS_CSP)])
def test_the_pages_are_confined_to_their_server_and_never_framed(server, path, csp):
    """The pages work under these headers: every test here fails on a Content Security Policy violation."""
    headers = headers_of(server.rest_url + path)
    assert headers["Content-Security-Policy"] == csp and "frame-ancestors 'none'" in csp
    assert headers["X-Frame-Options"] == "DENY" and headers["X-Content-Type-Options"] == "nosniff"


@pytest.mark.parametrize("path", ["/v1/models/flowers", "/v1/models/nope", "/healthz"])
def test_api_answers_are_never_sniffed_and_carry_no_page_policy(server, path):
    headers = headers_of(server.rest_url + path)
    assert headers["Content-Type"] == "application/json" and headers["X-Content-Type-Options"] == "nosniff"
    assert "Content-Security-Policy" not in headers and "X-Frame-Options" not in headers


def test_version_and_top_k_pickers_change_the_call(page, server):
    open_classify_page(page, server.rest_url)
    versions = page.locator("#version option").all_inner_texts()
    assert versions == ["latest", "version 1"]
    page.get_by_label("Version").select_option(label="version 1")
    page.get_by_label("Labels to show").fill("2")
    page.get_by_label("Labels to show").press("Enter")  # Enter classifies again, it does not reload the page
    choose_photo(page, "rose.jpg", ROSE, "image/jpeg")
    page.wait_for_function("() => document.querySelectorAll('#predictions li').length === 2")
    assert "/v1/models/flowers/versions/1:classify_image?top_k=2'" in page.locator("#curl").inner_text()


@pytest.mark.parametrize("name, data, mime_type", [
    ("notes.txt", b"these are notes, not a photo", "text/plain"),
    ("huge.jpg", ROSE * (MAX_REQUEST_BYTES // len(ROSE) + 1), "image/jpeg"),
], ids=["not-an-image", "too-large"])
def test_a_server_error_is_shown_as_its_message(page, server, name, data, mime_type):
    content_type = mime_type if mime_type.startswith("image/") else "application/octet-stream"
    status, body = post(f"{server.rest_url}/v1/models/flowers:classify_image?top_k=5", data, content_type)
    assert status in (400, 413) and body["error"]
    open_classify_page(page, server.rest_url)
    choose_photo(page, name, data, mime_type)
    error = page.get_by_role("alert")
    error.wait_for()
    assert error.inner_text() == body["error"]
    assert page.locator("#result").is_hidden()


def test_the_models_page_shows_versions_states_and_signatures(page, server):
    page.goto(server.rest_url + "/models")
    section = page.get_by_role("region", name="flowers")
    section.get_by_role("cell", name="AVAILABLE").wait_for()
    text = section.inner_text()
    assert "Version labels: none" in text
    for word in ("serving_default", "image_bytes", "DT_STRING", "probabilities", "DT_FLOAT", "[?]"):
        assert word in text, word


def test_a_phone_sized_window_scrolls_only_vertically_and_the_keyboard_reaches_the_file_picker(browser, server):
    page = open_page(browser, server.rest_url, viewport={"width": 360, "height": 740}, is_mobile=True)
    try:
        open_classify_page(page, server.rest_url)
        choose_photo(page, "rose.jpg", ROSE, "image/jpeg")
        bars(page)
        assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
        focused = []
        for _ in range(12):
            page.keyboard.press("Tab")
            focused.append(page.evaluate("document.activeElement.id || document.activeElement.textContent"))
        assert focused.index("model") < focused.index("version") < focused.index("top-k") < focused.index("file")
        assert not page.petal_errors
    finally:
        page.context.close()


def test_docs_render_the_servers_openapi_operations(page, server):
    with urllib.request.urlopen(server.rest_url + web.OPENAPI_URL, timeout=10) as response:
        spec = json.load(response)
    # Swagger UI lists an operation once under each of its tags
    operations = sum(max(1, len(operation.get("tags", []))) for item in spec["paths"].values()
                     for method, operation in item.items() if method in HTTP_METHODS)
    page.goto(server.rest_url + web.DOCS_URL)
    page.locator(".opblock").first.wait_for()
    assert page.locator(".opblock").count() == operations


# --- the stub: the web UI's blueprints behind a server that wants a token, then answers 503 -------------------

TOKEN = "s3cret"
BUSY = "The batch queue is full; retry shortly"
HTTP_METHODS = {"get", "put", "post", "delete", "options", "head", "patch", "trace"}
STUB_SPEC = {"openapi": "3.1.0", "info": {"title": "stub", "version": "1"}, "paths": {
    "/v1/models/{name}": {"get": {"summary": "Status", "parameters": [
        {"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}],
        "responses": {"200": {"description": "the versions"}}}},
    "/petal/models": {"get": {"summary": "Models", "responses": {"200": {"description": "the models"}}}}}}
IMAGE_SIGNATURE = {"serving_default": {"method_name": "tensorflow/serving/predict", "inputs": {
    "image_bytes": {"dtype": "DT_STRING", "tensor_shape": {"dim": [{"size": "-1"}]}, "name": "x"}}, "outputs": {
    "probabilities": {"dtype": "DT_FLOAT", "tensor_shape": {"dim": [{"size": "-1"}, {"size": "5"}]}, "name": "y"}}}}


def stub_app(seen: list[str]) -> flask.Flask:
    """What the real server answers, reduced to one model: 401 without the token (as the bearer-token branch
    does), 503 on every classification."""
    app = flask.Flask("stub")
    app.register_blueprint(web.create_blueprint())
    app.register_blueprint(web.create_docs_blueprint())

    @app.before_request
    def check_token():
        if not flask.request.path.startswith(("/v1/", "/petal/")):
            return None
        seen.append(flask.request.headers.get("Authorization", ""))
        if flask.request.headers.get("Authorization") != f"Bearer {TOKEN}":
            return flask.jsonify(error="Missing or invalid bearer token"), 401, {"WWW-Authenticate": "Bearer"}
        return None

    def stub_metadata() -> dict:
        return {"model_spec": {"name": "stub", "signature_name": "", "version": "7"},
                "metadata": {"signature_def": {"signature_def": IMAGE_SIGNATURE}}}

    answers = {
        ("GET", "/elsewhere"): lambda: "<!doctype html><title>another site</title>",
        ("GET", "/openapi.json"): lambda: flask.jsonify(STUB_SPEC),
        ("GET", "/petal/models"): lambda: {"models": [{"name": "stub", "version_labels": {"stable": 7}}]},
        ("GET", "/v1/models/stub/metadata"): stub_metadata,
        ("GET", "/v1/models/stub/versions/7/metadata"): stub_metadata,
        ("GET", "/v1/models/stub"): lambda: {"model_version_status": [
            {"version": "7", "state": "AVAILABLE", "status": {"error_code": "OK", "error_message": ""}}]},
        ("POST", "/v1/models/stub:classify_image"): lambda: (flask.jsonify(error=BUSY), 503, {"Retry-After": "1"}),
    }
    for (method, rule), answer in answers.items():
        app.add_url_rule(rule, rule, answer, methods=[method])
    return app


@pytest.fixture(scope="module")
def stub_site() -> Iterator[tuple[str, list[str]]]:
    seen: list[str] = []
    http = make_server("127.0.0.1", 0, stub_app(seen), threaded=True)
    thread = threading.Thread(target=http.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{http.server_port}", seen
    finally:
        http.shutdown()
        thread.join()


def test_a_401_asks_for_a_token_kept_only_in_session_storage_and_sent_on_every_call(browser, stub_site):
    url, seen = stub_site
    page = open_page(browser, url)
    try:
        page.goto(url + "/")
        form = page.locator("#token-form")
        form.wait_for()
        assert page.get_by_label("API token").evaluate("input => input === document.activeElement")
        assert "Missing or invalid bearer token" in form.inner_text()
        seen.clear()
        page.get_by_label("API token").fill(TOKEN)
        page.get_by_role("button", name="Use token").click()
        assert form.is_hidden()
        page.wait_for_function("() => document.querySelector('#version').options.length === 3")
        assert page.locator("#version option").all_inner_texts() == ["latest", "version 7", "stable (version 7)"]
        choose_photo(page, "rose.jpg", ROSE, "image/jpeg")
        page.get_by_role("alert").wait_for()
        assert page.get_by_role("alert").inner_text() == BUSY  # the 503's own message
        assert 'Authorization: Bearer $PETAL_TOKEN' in page.locator("#curl").inner_text()  # never the token
        assert len(seen) >= 4 and set(seen) == {f"Bearer {TOKEN}"}
        assert page.evaluate("sessionStorage.getItem('petal.token')") == TOKEN
        assert page.evaluate("localStorage.length") == 0 and not page.context.cookies()

        page.get_by_role("link", name="Models").click()  # the token stays for the tab's other pages
        section = page.get_by_role("region", name="stub")
        section.get_by_role("cell", name="AVAILABLE").wait_for()
        assert "Version labels: stable → version 7" in section.inner_text()
        assert page.locator("#token-form").is_hidden()
        assert not page.petal_errors
    finally:
        page.context.close()


def test_docs_render_a_spec_offline(browser, stub_site):
    url, _ = stub_site
    page = open_page(browser, url)
    try:
        page.goto(url + web.DOCS_URL)
        page.locator(".opblock").first.wait_for()
        assert page.locator(".opblock").count() == 2
        assert not page.petal_errors
    finally:
        page.context.close()


CROSS_ORIGIN_CLASSIFY = """async ([url, bytes]) => {
  try {  // the Authorization header makes the browser send a preflight first
    const response = await fetch(url, {method: "POST", body: new Uint8Array(bytes),
                                       headers: {"Content-Type": "image/jpeg", "Authorization": "Bearer x"}});
    return (await response.json()).predictions.length;
  } catch (error) {
    return String(error);
  }
}"""


@pytest.mark.parametrize("host, answer", [("127.0.0.1", 5), ("localhost", "TypeError: Failed to fetch")],
                         ids=["allowed", "refused"])
def test_a_page_on_another_origin_calls_the_api_only_when_allowed(browser, server, stub_site, host, answer):
    """The server allows the stub's origin; the same stub named `localhost` is another origin, not allowed."""
    context = browser.new_context()
    try:
        page = context.new_page()
        page.goto(stub_site[0].replace("127.0.0.1", host) + "/elsewhere")
        url = f"{server.rest_url}/v1/models/flowers:classify_image?top_k=5"
        assert page.evaluate(CROSS_ORIGIN_CLASSIFY, [url, list(ROSE)]) == answer
    finally:
        context.close()


def test_a_server_with_tokens_serves_the_page_which_asks_for_one_and_classifies(browser, tmp_path):
    """The real --auth_token_file path: the page and its assets load without a token, the API answers 401 until
    the page sends the token it asked for, and a classification then works."""
    token = "page-token-0123456789abcdef"
    (tmp_path / "tokens").write_text(f"{token}\n")
    with run_server("--port=0", f"--auth_token_file={tmp_path / 'tokens'}") as secured:
        assert post(secured.rest_url + "/v1/models/flowers:classify_image", ROSE, "image/jpeg")[0] == 401
        page = open_page(browser, secured.rest_url)
        try:
            page.goto(secured.rest_url + "/")
            page.locator("#token-form").wait_for()
            page.get_by_label("API token").fill(token)
            page.get_by_role("button", name="Use token").click()
            page.wait_for_function("() => document.querySelector('#model').options.length > 0")
            choose_photo(page, "rose.jpg", ROSE, "image/jpeg")
            labels = bars(page)
            assert len(labels) == 5 and labels[0][0] == "roses"
            assert page.evaluate("sessionStorage.getItem('petal.token')") == token
            assert page.evaluate("localStorage.length") == 0
            assert not page.petal_errors
        finally:
            page.context.close()
