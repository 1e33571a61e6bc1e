"""The storage layer's configuration from the environment, its one-line errors, and what they never show."""
from __future__ import annotations

import collections
import http.server
import subprocess
import sys
import threading

import pytest

from exported_models import storage


@pytest.fixture
def fresh(monkeypatch):
    """Each test's file systems are made from its own environment: a file system is made anew for each."""
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "S3_ENDPOINT", "S3_USE_HTTPS", "S3_VERIFY_SSL",
                 "AWS_REGION", "STORAGE_EMULATOR_HOST"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize(("environment", "client"), [
    ({"S3_ENDPOINT": "minio.local:9000", "S3_USE_HTTPS": "0", "AWS_REGION": "eu-west-1"},
     {"endpoint_url": "http://minio.local:9000", "region_name": "eu-west-1"}),
    ({"S3_ENDPOINT": "s3.example.com", "S3_VERIFY_SSL": "0"},
     {"endpoint_url": "https://s3.example.com", "verify": False}),
    ({"S3_ENDPOINT": "http://minio.local:9000"}, {"endpoint_url": "http://minio.local:9000"}),
    ({"S3_ENDPOINT": "minio.local:9000", "AWS_ENDPOINT_URL": "http://other:9000"}, {}),
    ({}, {}),
], ids=["TF Serving's MinIO setup", "https without verification", "a URL", "AWS_ENDPOINT_URL wins", "AWS alone"])
def test_tf_servings_s3_variables_configure_the_client_as_they_configured_tf_serving(fresh, environment, client):
    for name, value in environment.items():
        fresh.setenv(name, value)
    fs = storage.filesystem("s3://bucket/models")
    assert fs.client_kwargs == client
    assert fs.config_kwargs["connect_timeout"] == storage.CONNECT_TIMEOUT_S


def test_an_emulator_for_gcs_is_reached_without_credentials_or_gcsfs_grpc_probe(fresh):
    fresh.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:4443")
    fresh.delenv("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", raising=False)
    code = ("import os; from exported_models import storage; fs = storage.filesystem('gs://b/m'); "
            "print(os.environ['GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT'], type(fs).__name__, fs.credentials.method)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["false", "GCSFileSystem", "anon"]


def test_a_scheme_whose_extra_is_missing_names_the_pip_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "adlfs", None)  # as if it were not installed
    with pytest.raises(storage.StorageError) as info:
        storage.require("az://container/models/m")
    assert str(info.value) == "az:// needs adlfs, which a plain install leaves out: pip install 'petal[azure]'"
    storage.require("/srv/models/m")  # local paths need nothing
    storage.require("file:///srv/models/m")


def test_credentials_never_reach_a_message(monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY")
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING",
                       "DefaultEndpointsProtocol=http;AccountName=dev;AccountKey=c2VjcmV0a2V5;BlobEndpoint=http://x")
    said = storage.describe(RuntimeError(
        "signature wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY mismatch with key c2VjcmV0a2V5 at "
        "https://a.blob.core.windows.net/c/m?sv=2021&sig=abcDEF%2B123&se=2030 AccountKey=other\nTraceback ..."))
    assert said == ("signature *** mismatch with key *** at "
                    "https://a.blob.core.windows.net/c/m?sv=2021&sig=***&se=2030 AccountKey=***")


@pytest.mark.parametrize(("path", "remote", "joined"), [
    ("s3://b/models/", True, "s3://b/models/1/saved_model.pb"),
    ("file:///srv/models", False, "/srv/models/1/saved_model.pb"),
    ("models", False, "models/1/saved_model.pb"),
])
def test_urls_and_local_paths_are_told_apart_in_one_place(path, remote, joined):
    assert storage.is_remote(path) is remote
    assert storage.join(path, "1", "saved_model.pb") == joined


class _Unavailable(http.server.BaseHTTPRequestHandler):
    """A store that answers every request 503, which every client retries: each request's tries are counted."""
    tries: collections.Counter

    def _refuse(self) -> None:
        self.tries[self.command, self.path] += 1
        self.send_response(503)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_HEAD = do_POST = do_PUT = _refuse

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.parametrize("url", ["s3://bucket/models", "gs://bucket/models", "az://container/models"])
def test_a_store_that_is_away_is_asked_a_bounded_number_of_times(fresh, url):
    """The SDKs' own retries (gcsfs: 6, 1 to 17 s apart; Azure: 10, 15 s and more apart) would keep a poll, and a
    start, waiting for half a minute and more before saying the store is away."""
    handler = type("Handler", (_Unavailable,), {"tries": collections.Counter()})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.server_port}"
    fresh.setenv("AWS_ENDPOINT_URL", endpoint)
    fresh.setenv("AWS_ACCESS_KEY_ID", "key")
    fresh.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    fresh.setenv("STORAGE_EMULATOR_HOST", endpoint)
    fresh.setenv("AZURE_STORAGE_CONNECTION_STRING", "DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;"
                 f"AccountKey=a2V5;BlobEndpoint={endpoint}/devstoreaccount1;")
    try:
        with pytest.raises(storage.StorageError, match="could not list"):
            storage.list_files(url)
    finally:
        server.shutdown()
    assert handler.tries and all(1 < tries <= storage.RETRIES + 1 for tries in handler.tries.values()), \
        handler.tries
