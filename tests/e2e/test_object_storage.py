"""`petal serve` with its models in object storage, against real emulators on loopback (tests/object_stores.py):
moto's S3 (reached once through AWS_ENDPOINT_URL and once through TF Serving's own S3_ENDPOINT, S3_USE_HTTPS and
AWS_REGION), fake-gcs-server through STORAGE_EMULATOR_HOST, and Azurite through a connection string, each set as the
store's own users set it: in the environment, with `--model_base_path` a URL and every other flag its default.

For each store: version 1 serves; a version 2 uploaded while serving is loaded by polling, but only once it is
whole (its saved_model.pb alone never serves, and version 1 answers meanwhile); the store stopped mid-life fails
no request to the loaded version, is said once and shown by a metric, and once back, polling goes on.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time

import pytest
import requests

from load_tests.launcher import running
from object_stores import (
    MotoS3,
    azure_store_fixture,  # noqa: F401 (the fixture azure_store)
    gcs_store_fixture,  # noqa: F401 (the fixture gcs_store)
    s3_store_fixture,  # noqa: F401 (the fixture s3_store)
)
from server_harness import ROOT, jpeg, run_server, tiny_model_base

WAIT_S = 60.0


def classify(server) -> int:
    """The version that classified a photo, over REST."""
    response = requests.post(f"{server.rest_url}/v1/models/flowers:classify_image", data=jpeg(seed=3),
                             headers={"Content-Type": "image/jpeg"}, timeout=10)
    assert response.status_code == 200, response.text
    return response.json()["version"]


def states(server) -> dict[str, str]:
    body = requests.get(f"{server.rest_url}/v1/models/flowers", timeout=10).json()
    return {s["version"]: s["state"] for s in body.get("model_version_status", [])}


def wait_for(predicate, what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def metric(server, name: str) -> str:
    text = requests.get(f"{server.rest_url}/monitoring/prometheus/metrics", timeout=10).text
    found = re.search(rf'^{re.escape(name)}{{model_name="flowers"}} (\S+)$', text, re.MULTILINE)
    return found.group(1) if found else ""


def upload_version(store, url: str, version: int, only: str = "") -> None:
    """The tiny model's version 1 as `version` under `url`, through the store's own SDK (only one file, with
    `only`: an upload under way)."""
    folder = os.path.join(tiny_model_base(), "1")
    if not only:
        store.upload_tree(folder, f"{url}/{version}")
        return
    with open(os.path.join(folder, only), "rb") as f:
        store.put(f"{url}/{version}/{only}", f.read())


def rest_of_version(store, url: str, version: int) -> None:
    folder = os.path.join(tiny_model_base(), "1")
    for root, _, names in os.walk(folder):
        for name in names:
            relative = os.path.relpath(os.path.join(root, name), folder)
            if relative != "saved_model.pb":
                with open(os.path.join(root, name), "rb") as f:
                    store.put(f"{url}/{version}/{relative}", f.read())


class Traffic:
    """Requests to the loaded version, one after another on a thread, while something else happens."""

    def __init__(self, server):
        self.server, self.versions, self.failures = server, [], []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.versions.append(classify(self.server))
            except (AssertionError, requests.RequestException) as error:
                self.failures.append(str(error))

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join(15)


STORES = {
    "s3 through AWS_ENDPOINT_URL": ("s3_store", "env"),
    "s3 through TF Serving's S3_ENDPOINT": ("s3_store", "tf_serving_env"),
    "gcs through STORAGE_EMULATOR_HOST": ("gcs_store", "env"),
    "azure through a connection string": ("azure_store", "env"),
}


@pytest.mark.parametrize("kind", list(STORES))
def test_a_model_in_a_bucket_serves_follows_new_versions_and_outlives_the_store(kind, request, tmp_path):
    fixture, environment = STORES[kind]
    store = request.getfixturevalue(fixture)
    bucket = f"models-{abs(hash(kind)) % 10**6}"
    store.create_bucket(bucket)
    url = store.url(bucket, "flowers")
    upload_version(store, url, 1)
    cache = tmp_path / "cache"
    env = getattr(store, environment)
    with run_server("--model_name=flowers", f"--model_base_path={url}", f"--model_cache_dir={cache}",
                    env=env) as server:
        assert classify(server) == 1 and states(server) == {"1": "AVAILABLE"}

        upload_version(store, url, 2, only="saved_model.pb")
        wait_for(lambda: states(server).get("2") == "END", "the half-uploaded version to fail its load")
        assert classify(server) == 1, "the old version answers while the new one is incomplete"
        rest_of_version(store, url, 2)
        wait_for(lambda: states(server).get("2") == "AVAILABLE", "the whole version 2")
        wait_for(lambda: states(server).get("1") == "END", "version 1 to unload")
        assert classify(server) == 2
        assert sorted(p.name for p in cache.iterdir() if p.is_dir()) == [
            next(p.name for p in cache.iterdir() if p.is_dir() and p.name.startswith("2-"))], \
            "only the loaded version's copy is kept"
        assert metric(server, ":petal:serving:model_source_reachable") == "1"

        with Traffic(server) as traffic:
            store.stop()
            wait_for(lambda: "model versions cannot be listed" in server.log(), "the outage to be noticed")
            assert metric(server, ":petal:serving:model_source_reachable") == "0"
            time.sleep(2)  # polls go on failing: said once
            store.start()
            if isinstance(store, MotoS3):  # moto keeps its buckets in memory: the store comes back restored
                store.create_bucket(bucket)
                upload_version(store, url, 2)
            wait_for(lambda: "model versions listed again" in server.log(), "polling to recover")
        assert traffic.failures == [] and set(traffic.versions) == {2} and len(traffic.versions) > 5
        assert server.log().count("model versions cannot be listed") == 1
        upload_version(store, url, 3)
        wait_for(lambda: states(server).get("3") == "AVAILABLE", "version 3 after the outage")
        assert classify(server) == 3


def test_two_workers_download_each_version_once(s3_store, tmp_path):
    s3_store.create_bucket("workers")
    url = s3_store.url("workers", "flowers")
    upload_version(s3_store, url, 1)
    with run_server("--model_name=flowers", f"--model_base_path={url}", "--workers=2",
                    f"--model_cache_dir={tmp_path / 'cache'}", env=s3_store.env) as server:
        assert classify(server) == 1
    gets = re.findall(r'"GET /workers/flowers/1/saved_model\.pb', s3_store.log())
    assert len(gets) == 1, s3_store.log()[-3000:]


def test_a_model_config_file_in_a_bucket_names_models_in_the_bucket_and_is_polled_there(s3_store, tmp_path):
    s3_store.create_bucket("configs")
    url = s3_store.url("configs", "flowers")
    upload_version(s3_store, url, 1)
    config = s3_store.url("configs", "models.config")

    def publish(*names: str) -> None:
        entries = "".join(f'config {{ name: "{name}" base_path: "{url}" model_platform: "tensorflow" }} '
                          for name in names)
        s3_store.put(config, f"model_config_list {{ {entries}}}".encode())

    publish("flowers")
    with run_server(f"--model_config_file={config}", "--model_config_file_poll_wait_seconds=1",
                    f"--model_cache_dir={tmp_path / 'cache'}", env=s3_store.env) as server:
        assert classify(server) == 1
        publish("flowers", "daisies")
        wait_for(lambda: requests.get(f"{server.rest_url}/v1/models/daisies", timeout=10).status_code == 200,
                 "the model the edited config file adds")


def first_screen(*flags: str, env: dict[str, str], until: str) -> str:
    """What `petal serve` prints until a line holds `until` (it keeps running: a store may come later)."""
    with running(flags, ready=lambda server: until in server.log(), cwd=ROOT,
                 env={"TF_CPP_MIN_LOG_LEVEL": "2", **env}) as server:
        return server.log()


@pytest.mark.parametrize("fixture", ["s3_store", "gcs_store", "azure_store"])
def test_a_missing_bucket_is_one_line_naming_the_url_and_the_server_keeps_trying(fixture, request, tmp_path):
    store = request.getfixturevalue(fixture)
    url = store.url("no-such-bucket", "models/flowers")
    line = not_ready_line(url, store.env, tmp_path)
    assert line == (f"not ready: flowers: Could not find any versions of model flowers: could not list {url}: there "
                    "is no bucket 'no-such-bucket' (or these credentials cannot see it)")


def not_ready_line(url: str, env: dict[str, str], cache, never: str = "") -> str:
    """The line `petal serve` prints for a model it cannot serve; nothing it prints is a traceback or `never`."""
    text = first_screen("--model_name=flowers", f"--model_base_path={url}", f"--model_cache_dir={cache}", env=env,
                        until="not ready:")
    assert "Traceback" not in text and (not never or never not in text)
    loggers = {json.loads(line)["logger"] for line in text.splitlines() if line.startswith("{")}
    assert all(logger.startswith(("serving.", "petal.")) for logger in loggers), loggers  # no client's own chatter
    return next(line for line in text.splitlines() if line.startswith("not ready:"))


@pytest.mark.parametrize("fixture", ["s3_store", "azure_store"])
def test_wrong_credentials_are_one_line_and_never_show_the_secret(fixture, request, tmp_path):
    store = request.getfixturevalue(fixture)
    store.create_bucket("secret")
    url = store.url("secret", "flowers")
    upload_version(store, url, 1)
    wrong_secret = "V3JvbmdLZXlXcm9uZ0tleVdyb25nS2V5V3JvbmdLZXk="
    if isinstance(store, MotoS3):
        store.require_credentials()  # moto checks signatures from now until its next start
        env = {**store.env, "AWS_SECRET_ACCESS_KEY": wrong_secret}
        cause = "permission denied: The request signature we calculated does not match the signature you provided."
    else:
        env = {"AZURE_STORAGE_CONNECTION_STRING": re.sub("AccountKey=[^;]+", f"AccountKey={wrong_secret}",
                                                         store.connection_string)}
        cause = "Server failed to authenticate the request."
    try:
        line = not_ready_line(url, env, tmp_path, never=wrong_secret)
    finally:
        if isinstance(store, MotoS3):
            store.stop()
            store.start()
    assert line.startswith(f"not ready: flowers: Could not find any versions of model flowers: could not list {url}: ")
    assert cause in line


@pytest.mark.parametrize(("url", "client", "extra"), [
    ("s3://bucket/models/flowers", "s3fs", "s3"), ("gs://bucket/models/flowers", "gcsfs", "gcs"),
    ("az://container/models/flowers", "adlfs", "azure")])
def test_a_scheme_whose_extra_is_missing_is_one_line_naming_the_pip_install(url, client, extra):
    code = (f"import sys; sys.modules[{client!r}] = None; import petal; "
            f"sys.exit(petal.main(['serve', '--model_base_path={url}']))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        f"petal serve: {url.split(':')[0]}:// needs {client}, which a plain install leaves out: "
        f"pip install 'petal[{extra}]'")
