"""The object-store emulators of tests/object_stores.py work through fsspec as each cloud's users configure it: a tree
written with the store's own SDK is listed and read back by a fresh Python process whose only settings are
environment variables, and each store answers again after a stop and a start on the same port."""
import json
import socket
import subprocess
import sys

import pytest

from object_stores import (
    GCSFS_JSON_API_ONLY,
    Emulator,
    azure_store_fixture,  # noqa: F401 (the fixture azure_store)
    client_environment,
    gcs_store_fixture,  # noqa: F401 (the fixture gcs_store)
    s3_store_fixture,  # noqa: F401 (the fixture s3_store)
)

TREE = {"flowers/1/saved_model.pb": b"graph" * 100, "flowers/1/variables/variables.index": b"index",
        "flowers/1/variables/variables.data-00000-of-00001": b"\0" * 1000, "flowers/1/assets/labels.txt": b"daisy\n"}

# A user's program: the file system from fsspec's registry with the environment's settings, the tree listed in one
# find() and a file read back. TF Serving's S3 variables (S3_ENDPOINT without a scheme, S3_USE_HTTPS, S3_VERIFY_SSL,
# AWS_REGION) mean nothing to botocore, so the "tf_serving" style maps them to s3fs's arguments.
CLIENT = """
import json, os, sys
import fsspec
url, style = sys.argv[1], sys.argv[2]
protocol = url.split("://")[0]
options = {}
if style == "gcs_emulator":
    options = {"token": "anon"}
elif style == "tf_serving":
    https = os.environ.get("S3_USE_HTTPS", "1") not in ("0", "false")
    endpoint = os.environ["S3_ENDPOINT"]
    options = {"endpoint_url": endpoint if "://" in endpoint else ("https://" if https else "http://") + endpoint,
               "client_kwargs": {"region_name": os.environ.get("AWS_REGION"),
                                 "verify": os.environ.get("S3_VERIFY_SSL", "1") not in ("0", "false")}}
fs = fsspec.filesystem(protocol, skip_instance_cache=True, use_listings_cache=False, **options)
found = fs.find(url, detail=True)
first = sorted(found)[0]
print(json.dumps({"sizes": {name: entry["size"] for name, entry in found.items()},
                  "first": first, "content": fs.cat_file(first).hex()}))
"""


def list_as_a_user(url: str, env: dict[str, str], style: str = "env") -> dict:
    """What CLIENT, run with `env` as its only cloud settings, finds under `url` and reads of its first file."""
    done = subprocess.run([sys.executable, "-c", CLIENT, url, style], env=client_environment(env),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def refuses(store: Emulator) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", store.port)) != 0


def check_written_tree_is_read(store: Emulator, bucket: str, tmp_path, env: dict[str, str], style: str = "env"):
    folder = tmp_path / "tree"
    for relative, data in TREE.items():
        (folder / relative).parent.mkdir(parents=True, exist_ok=True)
        (folder / relative).write_bytes(data)
    store.create_bucket(bucket)
    assert sorted(store.upload_tree(folder, store.url(bucket, "models"))) == sorted(f"models/{k}" for k in TREE)
    seen = list_as_a_user(store.url(bucket, "models/flowers"), env, style)
    assert seen["sizes"] == {f"{bucket}/models/{key}": len(data) for key, data in TREE.items()}
    assert bytes.fromhex(seen["content"]) == TREE[seen["first"].split("/", 2)[2]]


def check_restart(store: Emulator) -> None:
    port = store.port
    store.stop()
    try:
        assert refuses(store)
    finally:
        store.start()
    assert store.port == port and store.answers()


def test_s3(s3_store, tmp_path):
    """AWS_ENDPOINT_URL and the keys are all s3fs needs (botocore reads the endpoint from the environment); moto
    forgets every bucket when it stops."""
    check_written_tree_is_read(s3_store, "petal-s3", tmp_path, s3_store.env)
    s3_store.delete(s3_store.url("petal-s3", "models/flowers/1/assets/labels.txt"))
    assert "models/flowers/1/assets/labels.txt" not in s3_store.keys(s3_store.url("petal-s3", "models/"))
    check_restart(s3_store)
    s3_store.create_bucket("petal-s3")
    assert s3_store.keys(s3_store.url("petal-s3")) == []


def test_s3_tf_serving_variables(s3_store, tmp_path):
    """TF Serving's S3 variables reach moto once mapped to s3fs's endpoint_url and client_kwargs."""
    check_written_tree_is_read(s3_store, "petal-s3-tf", tmp_path, s3_store.tf_serving_env, style="tf_serving")


def test_s3_credentials(s3_store):
    """With require_credentials() moto refuses an unknown key, as S3 does; a restart forgets the IAM user."""
    import boto3
    from botocore.exceptions import ClientError

    s3_store.create_bucket("petal-s3-auth")
    key_id, secret = s3_store.require_credentials()
    try:
        assert s3_store.env["AWS_ACCESS_KEY_ID"] == key_id
        s3_store.put(s3_store.url("petal-s3-auth", "k"), b"1")
        stranger = boto3.client("s3", endpoint_url=s3_store.endpoint_url, region_name="us-east-1",
                                aws_access_key_id="AKIAUNKNOWN", aws_secret_access_key=secret)
        with pytest.raises(ClientError, match="InvalidAccessKeyId"):
            stranger.list_objects_v2(Bucket="petal-s3-auth")
    finally:
        s3_store.stop()
        s3_store.start()
    assert s3_store.env["AWS_ACCESS_KEY_ID"] == "testing"


def test_gcs(gcs_store, tmp_path):
    """STORAGE_EMULATOR_HOST and token="anon" reach fake-gcs-server (gcsfs kept off gRPC, which it lacks); its
    objects survive a restart."""
    check_written_tree_is_read(gcs_store, "petal-gcs", tmp_path, {**gcs_store.env, **GCSFS_JSON_API_ONLY},
                               style="gcs_emulator")
    gcs_store.delete(gcs_store.url("petal-gcs", "models/flowers/1/assets/labels.txt"))
    check_restart(gcs_store)
    assert sorted(gcs_store.keys(gcs_store.url("petal-gcs", "models/"))) == sorted(
        f"models/{key}" for key in TREE if not key.endswith("labels.txt"))
    assert gcs_store.delete_prefix(gcs_store.url("petal-gcs", "models/")) and not gcs_store.keys(
        gcs_store.url("petal-gcs"))


def test_azure(azure_store, tmp_path):
    """AZURE_STORAGE_CONNECTION_STRING alone reaches Azurite (adlfs reads it from the environment); its blobs survive
    a restart."""
    check_written_tree_is_read(azure_store, "petal-az", tmp_path, azure_store.env)
    azure_store.delete(azure_store.url("petal-az", "models/flowers/1/assets/labels.txt"))
    check_restart(azure_store)
    assert sorted(azure_store.keys(azure_store.url("petal-az", "models/"))) == sorted(
        f"models/{key}" for key in TREE if not key.endswith("labels.txt"))
