"""Issue 14, "safe to expose", against real `petal serve` subprocesses: TLS on both ports from TF Serving's
SSLConfig (and mutual TLS), bearer tokens with roles over REST and gRPC, model control off by default,
--model_root, and the access log. Certificates are made at test time (tests/tls_certs.py)."""
from __future__ import annotations

import base64
import json
import os
import socket
import ssl
import subprocess
import sys
import time

import grpc
import pytest
import requests
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tensorflow_serving.apis import (
    model_management_pb2,
    model_service_pb2_grpc,
    prediction_service_pb2_grpc,
)
from tensorflow_serving.config import model_server_config_pb2

from grpc_calls import predict_request, rpc_error
from server_harness import access_lines, copy_model, jpeg, run_server
from serving.client import Client, RequestError, Security, ServerError
from serving.process.flags import parse_args
from tls_certs import make_pki, repr_pem

PREDICT_TOKEN = "predict-token-0123456789abcdef"
ADMIN_TOKEN = "admin-token-0123456789abcdef"
HEADER_TIMEOUT_S = 2
PROBES = ("/healthz", "/readyz", "/v2/health/live", "/v2/health/ready")


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """--model_root: the tiny model inside, and a model outside it reachable by `..` and by a symlink."""
    base = tmp_path_factory.mktemp("security")
    copy_model(str(base / "root" / "flowers"), 1)
    copy_model(str(base / "outside" / "flowers"), 1)
    os.symlink(base / "outside" / "flowers", base / "root" / "link")
    return base / "root"


def write(path, text: str) -> str:
    path.write_text(text)
    return str(path)


@pytest.fixture(scope="module")
def server(pki, root, tmp_path_factory):
    """TLS on both ports, a predict and an admin token, --model_root, --access_log, metrics behind a token."""
    folder = tmp_path_factory.mktemp("secure")
    tokens = write(folder / "tokens", f"# comment\n{PREDICT_TOKEN}\n\n{ADMIN_TOKEN} admin\n")
    ssl_config = write(folder / "ssl", pki.ssl_config())
    with run_server("--model_name=flowers", f"--model_base_path={root / 'flowers'}", f"--ssl_config_file={ssl_config}",
                    f"--auth_token_file={tokens}", f"--model_root={root}", "--access_log", "--metrics_require_auth",
                    f"--request_header_timeout={HEADER_TIMEOUT_S}", tls_context=pki.client_context()) as srv:
        yield srv


@pytest.fixture(scope="module")
def mtls_server(pki, root, tmp_path_factory):
    config = write(tmp_path_factory.mktemp("mtls") / "ssl", pki.ssl_config(client_verify=True))
    with run_server("--model_name=flowers", f"--model_base_path={root / 'flowers'}", f"--ssl_config_file={config}",
                    tls_context=pki.client_context(with_certificate=True)) as srv:
        yield srv


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def predict_body() -> dict:
    return {"instances": [{"b64": base64.b64encode(jpeg()).decode()}]}


def reload_request(*base_paths: str) -> model_management_pb2.ReloadConfigRequest:
    config = model_server_config_pb2.ModelServerConfig()
    for i, path in enumerate(base_paths):
        config.model_config_list.config.add(name="flowers" if i == 0 else f"m{i}", base_path=path,
                                            model_platform="tensorflow")
    return model_management_pb2.ReloadConfigRequest(config=config)


def tls_channel(server, pki, with_certificate: bool = False) -> grpc.Channel:
    credentials = grpc.ssl_channel_credentials(
        root_certificates=pki.ca_cert.read_bytes(),
        private_key=pki.client_key.read_bytes() if with_certificate else None,
        certificate_chain=pki.client_cert.read_bytes() if with_certificate else None)
    return grpc.secure_channel(server.grpc_target, credentials)


# --- REST ------------------------------------------------------------------------------------------------------

def test_https_predict_with_a_token_verifies_against_the_ca(server, pki):
    response = requests.post(f"{server.rest_url}/v1/models/flowers:predict", json=predict_body(),
                             headers=bearer(PREDICT_TOKEN), verify=str(pki.ca_cert), timeout=30)
    assert response.status_code == 200, response.text
    assert len(response.json()["predictions"]) == 1
    with pytest.raises(requests.exceptions.SSLError):  # the system's CAs do not know the test CA
        requests.get(f"{server.rest_url}/healthz", timeout=10)


def test_plain_http_on_the_tls_port_gets_no_answer(server):
    with pytest.raises(requests.ConnectionError):
        requests.get(server.rest_url.replace("https://", "http://") + "/healthz", timeout=10)


@pytest.mark.parametrize("headers, error", [({}, None), (bearer("wrong-token-0123456789abcdef"), "invalid_token"),
                                            ({"Authorization": "Basic dXNlcjpwYXNz"}, "invalid_token")])
def test_rest_without_a_valid_token_is_401_with_a_bearer_challenge(server, pki, headers, error):
    for method, path in (("POST", "/v1/models/flowers:predict"), ("GET", "/v1/models/flowers"),
                         ("GET", "/v2/models/flowers"), ("GET", "/monitoring/prometheus/metrics"),
                         ("GET", "/no/such/path")):
        response = requests.request(method, server.rest_url + path, json=predict_body(), headers=headers,
                                    verify=str(pki.ca_cert), timeout=30)
        assert response.status_code == 401, (path, response.text)
        challenge = response.headers["WWW-Authenticate"]
        assert challenge.startswith("Bearer") and (error in challenge if error else "error=" not in challenge)
        assert "Bearer" in response.json()["error"] or "bearer" in response.json()["error"]


def test_probes_stay_open_and_metrics_take_a_token(server, pki):
    for path in PROBES:
        assert requests.get(server.rest_url + path, verify=str(pki.ca_cert), timeout=10).status_code == 200, path
    metrics = requests.get(f"{server.rest_url}/monitoring/prometheus/metrics", headers=bearer(PREDICT_TOKEN),
                           verify=str(pki.ca_cert), timeout=10)
    assert metrics.status_code == 200 and ":tensorflow:serving" in metrics.text


# --- gRPC ------------------------------------------------------------------------------------------------------

def test_grpc_predict_over_tls_with_the_stock_stub_and_a_token(server, pki):
    with tls_channel(server, pki) as channel:
        stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
        response = stub.Predict(predict_request(), timeout=30, metadata=[("authorization", f"Bearer {PREDICT_TOKEN}")])
        assert response.model_spec.version.value == 1
        assert rpc_error(stub.Predict, predict_request(), timeout=30).code() == grpc.StatusCode.UNAUTHENTICATED
        err = rpc_error(stub.Predict, predict_request(), timeout=30, metadata=[("authorization", "Bearer nope")])
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED and "nope" not in err.details()
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_reload_needs_the_admin_role_and_paths_inside_the_model_root(server, pki, root):
    with tls_channel(server, pki) as channel:
        stub = model_service_pb2_grpc.ModelServiceStub(channel)
        admin = [("authorization", f"Bearer {ADMIN_TOKEN}")]
        err = rpc_error(stub.HandleReloadConfigRequest, reload_request(str(root / "flowers")), timeout=30,
                        metadata=[("authorization", f"Bearer {PREDICT_TOKEN}")])
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "admin" in err.details()
        for escape in (str(root / ".." / "outside" / "flowers"), str(root / "link"), "/etc"):
            err = rpc_error(stub.HandleReloadConfigRequest, reload_request(str(root / "flowers"), escape),
                            timeout=30, metadata=admin)
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "--model_root" in err.details(), escape
        stub.HandleReloadConfigRequest(reload_request(str(root / "flowers")), timeout=30, metadata=admin)


def test_a_default_server_refuses_model_control_and_asks_no_token(tiny_server, root):
    """tiny_server has no flags but the model: no token asked, model control off, no access log."""
    with grpc.insecure_channel(tiny_server.grpc_target) as channel:
        err = rpc_error(model_service_pb2_grpc.ModelServiceStub(channel).HandleReloadConfigRequest,
                        reload_request(str(root / "flowers")), timeout=30)
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "--enable_model_control" in err.details()
        prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(predict_request(), timeout=30)
    response = requests.get(f"{tiny_server.rest_url}/v1/models/flowers", timeout=10)
    assert response.status_code == 200 and "X-Request-ID" not in response.headers
    assert "petal.access" not in tiny_server.log()


# --- mutual TLS ------------------------------------------------------------------------------------------------

def test_mutual_tls_needs_a_client_certificate_on_both_ports(mtls_server, pki):
    url = f"{mtls_server.rest_url}/v1/models/flowers"
    ok = requests.get(url, verify=str(pki.ca_cert), cert=(str(pki.client_cert), str(pki.client_key)), timeout=10)
    assert ok.status_code == 200
    with pytest.raises(requests.ConnectionError):
        requests.get(url, verify=str(pki.ca_cert), timeout=10)
    with tls_channel(mtls_server, pki, with_certificate=True) as channel:
        prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(predict_request(), timeout=30)
    with tls_channel(mtls_server, pki) as channel:
        err = rpc_error(prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict, predict_request(),
                        timeout=10)
        assert err.code() == grpc.StatusCode.UNAVAILABLE


# --- slow clients over TLS -------------------------------------------------------------------------------------

def closed_within(sock: socket.socket, seconds: float) -> float:
    """Seconds until the server closes `sock` (reads EOF or a reset); fails past `seconds`."""
    started = time.monotonic()
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        pass
    except (TimeoutError, ssl.SSLError) as error:
        if "timed out" in str(error):
            pytest.fail(f"connection still open after {seconds}s")
    return time.monotonic() - started


def rest_address(server) -> tuple[str, int]:
    host, port = server.rest_url.split("://")[1].rsplit(":", 1)
    return host, int(port)


def test_a_stalled_tls_handshake_is_cut_off(server):
    with socket.create_connection(rest_address(server), timeout=10) as sock:
        sock.sendall(b"\x16\x03\x01")  # the start of a ClientHello, and then nothing
        assert closed_within(sock, HEADER_TIMEOUT_S + 5) >= HEADER_TIMEOUT_S - 0.5


@pytest.mark.parametrize("port", ["rest", "grpc"])
def test_a_client_hello_sent_a_byte_at_a_time_is_cut_off_at_the_header_deadline(server, port):
    """A deadline on each read let a handshake that sends a byte a second stay open for ever (REST), and grpc's own
    handshake timeout was 120 s."""
    host, number = rest_address(server) if port == "rest" else server.grpc_target.rsplit(":", 1)
    hello = bytes.fromhex("16030100c8010000c40303") + bytes(32)  # a ClientHello's start: record and handshake heads
    with socket.create_connection((host, int(number)), timeout=10) as sock:
        started = time.monotonic()
        with pytest.raises(OSError):  # reset by the server: at the deadline, not before
            for byte in hello:
                sock.sendall(bytes([byte]))
                time.sleep(0.5)
                assert time.monotonic() - started < HEADER_TIMEOUT_S + 5, "still in its handshake past the deadline"
        assert time.monotonic() - started >= HEADER_TIMEOUT_S - 0.5


def test_trickled_headers_inside_tls_are_cut_off(server, pki):
    with socket.create_connection(rest_address(server), timeout=10) as raw:
        with pki.client_context().wrap_socket(raw, server_hostname="127.0.0.1") as sock:
            started = time.monotonic()
            sock.sendall(b"GET /healthz HTTP/1.1\r\n")
            try:
                while time.monotonic() < started + HEADER_TIMEOUT_S + 5:
                    sock.sendall(b"X-Slow: 1\r\n")
                    time.sleep(0.5)
            except OSError:  # closed by the server: at the header deadline, not before
                assert time.monotonic() - started >= HEADER_TIMEOUT_S - 0.5
                return
            pytest.fail("a trickle of headers kept the connection open past the header deadline")


# --- the access log --------------------------------------------------------------------------------------------

def test_access_log_has_one_line_per_request_with_its_id_and_never_a_token(server, pki):
    response = requests.post(f"{server.rest_url}/v1/models/flowers/versions/1:predict", json=predict_body(),
                             headers={**bearer(PREDICT_TOKEN), "X-Request-ID": "client-id-42"},
                             verify=str(pki.ca_cert), timeout=30)
    assert response.headers["X-Request-ID"] == "client-id-42"
    insane = requests.get(f"{server.rest_url}/v1/models/flowers", verify=str(pki.ca_cert), timeout=30,
                          headers={**bearer(PREDICT_TOKEN), "X-Request-ID": "bad id\twith spaces"})
    generated = insane.headers["X-Request-ID"]
    assert generated != "bad id\twith spaces" and len(generated) == 32
    with tls_channel(server, pki) as channel:
        prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(
            predict_request(), timeout=30, metadata=[("authorization", f"Bearer {PREDICT_TOKEN}"),
                                                     ("x-request-id", "grpc-id-7")])
    wanted = {"client-id-42", generated, "grpc-id-7"}
    lines = {entry["request_id"]: entry for entry in access_lines(
        server, lambda lines: wanted <= {entry["request_id"] for entry in lines})}
    rest = lines["client-id-42"]
    assert {k: rest[k] for k in ("protocol", "method", "path", "model", "version", "status")} == {
        "protocol": "rest", "method": "POST", "path": "/v1/models/flowers/versions/1:predict", "model": "flowers",
        "version": "1", "status": 200}
    assert rest["bytes_in"] > 0 and rest["bytes_out"] > 0 and rest["latency_ms"] > 0
    assert lines[generated]["method"] == "GET" and lines[generated]["status"] == 200
    rpc = lines["grpc-id-7"]
    assert (rpc["protocol"], rpc["path"], rpc["model"], rpc["status"]) == (
        "grpc", "/tensorflow.serving.PredictionService/Predict", "flowers", "OK")
    assert rpc["bytes_in"] > 0 and rpc["bytes_out"] > 0
    log = server.log()
    assert PREDICT_TOKEN not in log and ADMIN_TOKEN not in log


# --- the client ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("use_grpc", [False, True], ids=["rest", "grpc"])
def test_client_with_tls_and_a_token(server, pki, use_grpc):
    target = server.grpc_target if use_grpc else server.rest_url.split("://")[1]
    secure = Security(token=PREDICT_TOKEN, ca_file=str(pki.ca_cert))
    with Client(target, use_grpc=use_grpc, security=secure) as client:
        [prediction] = client.predict([jpeg()], top_k=2)
        assert len(prediction.top_k) == 2
    with Client(target, use_grpc=use_grpc, security=Security(token="wrong-token-0123456789", ca_file=str(pki.ca_cert))
                ) as client:
        with pytest.raises(RequestError) as info:
            client.predict([jpeg()])
        assert "UNAUTHENTICATED" in str(info.value) or "401" in str(info.value)


def test_client_without_its_certificate_is_refused_by_mutual_tls(mtls_server, pki):
    target = mtls_server.rest_url.split("://")[1]
    with Client(target, security=Security(ca_file=str(pki.ca_cert)), retries=0) as client:
        with pytest.raises(ServerError):
            client.predict([jpeg()])
    secure = Security(ca_file=str(pki.ca_cert), cert_file=str(pki.client_cert), key_file=str(pki.client_key))
    with Client(target, security=secure) as client:
        assert client.predict([jpeg()])


# --- startup checks (no server) --------------------------------------------------------------------------------

def test_model_paths_outside_the_root_fail_at_startup_naming_the_path(root, tmp_path, capsys):
    config = write(tmp_path / "models.config", 'model_config_list { config { name: "a" base_path: "%s" } }'
                   % (root / ".." / "outside" / "flowers"))
    for flags in ([f"--model_base_path={root / 'link'}"], [f"--model_config_file={config}"],
                  [f"--model_base_path={root}/../outside/flowers"]):
        with pytest.raises(SystemExit):
            parse_args([f"--model_root={root}", *flags])
        assert "outside --model_root" in capsys.readouterr().err
    inside = parse_args([f"--model_root={root}", f"--model_base_path={root / 'flowers'}"]).dataplane
    assert inside.model_root == str(root)


@pytest.mark.parametrize("text, message", [
    ("short\n", "at least 16"), (f"{PREDICT_TOKEN} root\n", "unknown role"), ("# only a comment\n", "no tokens"),
    ('has"quote-0123456789abcdef\n', "at least 16")])
def test_bad_token_files_fail_at_startup_without_echoing_the_token(tmp_path, capsys, text, message):
    with pytest.raises(SystemExit):
        parse_args([f"--auth_token_file={write(tmp_path / 'tokens', text)}"])
    err = capsys.readouterr().err
    assert message in err and PREDICT_TOKEN not in err


def test_bad_ssl_configs_fail_at_startup(tmp_path, pki, capsys):
    for text, message in (('server_cert: "x"', "both required"),
                          (pki.ssl_config().replace("client_verify: false", "client_verify: true")
                           .split("custom_ca")[0] + "client_verify: true", "custom_ca")):
        with pytest.raises(SystemExit):
            parse_args([f"--ssl_config_file={write(tmp_path / 'ssl', text)}"])
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        parse_args([f"--ssl_config_file={write(tmp_path / 'ssl', pki.ssl_config())}", "--worker_class=gthread"])
    assert exit_info.value.code == 2 and "--ssl_config_file needs --worker_class=gevent" in capsys.readouterr().err
    # a key that is not the certificate's fails here, with the file's path, rather than in every worker
    swapped = pki.ssl_config().replace(repr_pem(pki.server_key.read_text()), repr_pem(pki.client_key.read_text()))
    path = write(tmp_path / "swapped", swapped)
    with pytest.raises(SystemExit):
        parse_args([f"--ssl_config_file={path}"])
    err = capsys.readouterr().err
    assert f"{path}:" in err and "mismatch" in err.lower(), err


def test_loadtest_reaches_a_tls_and_token_server_over_rest_and_grpc(server, pki, tmp_path):
    images = tmp_path / "images"
    images.mkdir()
    (images / "a.jpg").write_bytes(jpeg())
    result = subprocess.run(
        [sys.executable, "-m", "petal", "loadtest", "--host", server.rest_url, "--grpc-host", server.grpc_target,
         "--ca_file", str(pki.ca_cert), "--images", str(images), "--weights", "rest_predict=1,grpc_predict=1",
         "--users", "2", "--run-time", "3s", "--report_dir", str(tmp_path / "report")],
        capture_output=True, text=True, timeout=300, check=False, env={**os.environ, "PETAL_TOKEN": PREDICT_TOKEN})
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    for name in ("rest_predict", "grpc_predict"):
        stats = summary["endpoints"][name]
        assert stats["requests"] > 0 and stats["failures"] == 0, (name, result.stderr[-2000:])


def test_the_image_healthcheck_passes_on_a_tls_server(server):
    from deploy_files import read_dockerfile

    program = read_dockerfile().healthcheck[-1].replace(":8501/", f":{rest_address(server)[1]}/")
    assert subprocess.run([sys.executable, "-c", program], timeout=30, check=False).returncode == 0
