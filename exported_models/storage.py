"""Where models, model configs and batch data are kept: local paths and object stores, behind one set of calls.

Every path a Petal command reads or writes can be a local path, `file://…`, `s3://bucket/…` (AWS and S3-compatible
stores: MinIO, Ceph), `gs://bucket/…` or `az://container/…` (Azure Blob). Local paths stay on the operating
system's own calls; the stores go through fsspec and the implementation each extra installs (`petal[s3]`: s3fs,
`petal[gcs]`: gcsfs, `petal[azure]`: adlfs, `petal[cloud]`: all three), configured the way each cloud's users
already configure its SDK (docs/deploy.md, 'Models in object storage'):

- S3: the AWS SDK's own chain (environment, ~/.aws, instance and workload identity), `AWS_ENDPOINT_URL` for an
  S3-compatible store, and TF Serving's `S3_ENDPOINT`, `S3_USE_HTTPS`, `S3_VERIFY_SSL` and `AWS_REGION`, so that a
  TF Serving deployment moves over unchanged;
- GCS: Google's default credentials, and `STORAGE_EMULATOR_HOST`;
- Azure: `AZURE_STORAGE_CONNECTION_STRING`, or `AZURE_STORAGE_ACCOUNT_NAME` with a key, a SAS token or an identity.

It lives beside the model format because training (`petal export`) and serving both write and read models here,
and neither may import the other. Errors are `StorageError`s of one line that name the URL and the cause, with
every credential the environment holds blotted out: they reach logs, status answers and the web page.
"""
from __future__ import annotations

import functools
import glob as local_glob
import importlib.util
import logging
import os
import re
import shutil
import types
from dataclasses import dataclass
from typing import IO, Any

# scheme: (the module fsspec needs for it, the extra that installs it)
STORES = {"s3": ("s3fs", "s3"), "s3a": ("s3fs", "s3"), "gs": ("gcsfs", "gcs"), "gcs": ("gcsfs", "gcs"),
          "az": ("adlfs", "azure"), "abfs": ("adlfs", "azure"), "abfss": ("adlfs", "azure")}
# An unreachable store answers within this: the SDKs' defaults retry for minutes, while a poll comes every second.
CONNECT_TIMEOUT_S = 5
READ_TIMEOUT_S = 30
RETRIES = 2
# The clients' own loggers: each retry, fallback and traceback of theirs, on every poll of a store that is away.
CLIENT_LOGGERS = ("gcsfs", "s3fs", "adlfs", "fsspec", "aiobotocore", "botocore", "azure")
# The prefixes of the environment variables that configure the stores' clients (their SDKs', TF Serving's, gcsfs's).
STORE_VARIABLES = ("AWS_", "S3_", "GOOGLE_", "GCE_", "GCSFS_", "STORAGE_EMULATOR_HOST", "AZURE_")
# Environment variables whose values never appear in a message (a connection string carries its key too).
SECRET_VARIABLES = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_KEY",
                    "AZURE_STORAGE_SAS_TOKEN", "AZURE_STORAGE_CLIENT_SECRET", "AZURE_CLIENT_SECRET",
                    "AZURE_STORAGE_CONNECTION_STRING", "GOOGLE_APPLICATION_CREDENTIALS_JSON")
# Credentials that an SDK may write into its own messages: a SAS signature, a key in a connection string.
_SECRET_PATTERNS = re.compile(r"((?:sig|AccountKey|SharedAccessSignature|X-Amz-Signature|X-Amz-Credential|"
                              r"X-Amz-Security-Token|access_token|client_secret)=)[^&;\s'\"]+", re.IGNORECASE)


class StorageError(OSError):
    """A store that could not be read or written, in one line that names the URL and never a credential."""


class StorageNotFound(StorageError, FileNotFoundError):
    """A file or bucket the store says is not there: callers that tell a missing file from an outage still can."""


@dataclass(frozen=True)
class Entry:
    """A file as a listing shows it: its size, and a tag that changes when its content does (an ETag, a
    generation, an mtime)."""
    size: int
    tag: str


def scheme(path: str) -> str:
    """`s3` for `s3://b/k`; '' for a local path (`file://` included, which is one)."""
    head, sep, _ = path.partition("://")
    return "" if not sep or head == "file" else head.lower()


def is_remote(path: str) -> bool:
    return scheme(path) != ""


def local_path(path: str) -> str:
    """A local path as the operating system takes it: `file:///srv/m` is `/srv/m`."""
    return path.removeprefix("file://")


def join(base: str, *parts: str) -> str:
    """A child of a path or URL; URLs always take `/`."""
    if not is_remote(base):
        return os.path.join(local_path(base), *parts)
    return "/".join([base.rstrip("/"), *(p.strip("/") for p in parts)])


def redact(text: str) -> str:
    """`text` with every credential the environment holds, and every signature or key written in it, blotted."""
    for name in SECRET_VARIABLES:
        value = os.environ.get(name, "")
        if len(value) >= 4:
            text = text.replace(value, "***")
    for part in os.environ.get("AZURE_STORAGE_CONNECTION_STRING", "").split(";"):
        key, _, value = part.partition("=")
        if key.strip().lower() in ("accountkey", "sharedaccesssignature") and len(value) >= 4:
            text = text.replace(value, "***")
    return _SECRET_PATTERNS.sub(r"\1***", text)


def describe(error: BaseException) -> str:
    """An SDK's error as one line: its first line (the rest is a traceback or a response dump), without secrets."""
    text = " ".join(str(error).split("\n", 1)[0].split()) or type(error).__name__
    if isinstance(error, FileNotFoundError) and not text.startswith(("No such", "The specified")):
        text = f"not found: {text}"
    elif isinstance(error, PermissionError):
        text = f"permission denied: {text}"
    return redact(text)


# --- the file systems ---------------------------------------------------------------------------------------------

def filesystem(path: str) -> Any:
    """The fsspec file system for a URL's scheme, configured from the environment as it is now; StorageError names
    the `pip install` when the scheme's extra is missing. One per process and environment: a server's master reads a
    model config file in a bucket before it forks its workers, and the async clients are not fork-safe; a process
    that changes its credentials or endpoint in `os.environ` gets a file system made from the new ones."""
    require(path)
    return _filesystem(scheme(path) or "file", os.getpid(), _store_environment())


def require(path: str) -> None:
    """StorageError naming the `pip install` to run, when the package a URL's scheme needs is missing."""
    name = scheme(path)
    module, extra = STORES.get(name, ("", ""))
    if module == "gcsfs":
        _prepare_gcs()
    if module and importlib.util.find_spec(module) is None:  # found, not imported: a server's master forks after
        raise StorageError(f"{name}:// needs {module}, which a plain install leaves out: "
                           f"pip install 'petal[{extra}]'")


def _store_environment() -> tuple[tuple[str, str], ...]:
    """The variables the stores' clients read their configuration and credentials from."""
    return tuple(sorted((name, value) for name, value in os.environ.items() if name.startswith(STORE_VARIABLES)))


@functools.lru_cache(maxsize=16)
def _filesystem(name: str, pid: int, environment: tuple[tuple[str, str], ...]) -> Any:
    import fsspec

    module = STORES.get(name, ("", ""))[0]
    if not logging.getLogger().isEnabledFor(logging.INFO):  # quiet unless asked (petal -v): what fails is said
        for client in CLIENT_LOGGERS:                         # once, in one line, by whoever called
            logging.getLogger(client).setLevel(logging.CRITICAL)
    try:
        cls = fsspec.get_filesystem_class(name)
    except (ImportError, ValueError) as error:
        raise StorageError(f"{name}:// is not a file system Petal can read: {describe(error)}") from None
    # Every listing is fresh (a poll must see a new version), and every instance our own.
    options: dict[str, Any] = {"skip_instance_cache": True, "use_listings_cache": False}
    options.update(_s3_options() if module == "s3fs" else _gcs_options() if module == "gcsfs" else {})
    fs = cls(**options)
    if module == "s3fs":
        fs.retries = 1  # s3fs's own retries, around botocore's: 5 of them by default, which only a setattr changes
    elif module == "adlfs":
        _bound_azure_retries(fs)
    elif module == "gcsfs":
        _bound_gcs_retries(fs)
    return fs


def _s3_options() -> dict[str, Any]:
    """botocore reads AWS_ENDPOINT_URL, the keys, the profile and AWS_REGION/AWS_DEFAULT_REGION itself. TF
    Serving's S3 file system took `S3_ENDPOINT` (host[:port], or a URL), `S3_USE_HTTPS` and `S3_VERIFY_SSL`
    (1 or 0) and `AWS_REGION`: they are mapped onto the same client here, unless AWS_ENDPOINT_URL says otherwise."""
    client: dict[str, Any] = {}
    endpoint = os.environ.get("S3_ENDPOINT", "").strip()
    if endpoint and not os.environ.get("AWS_ENDPOINT_URL") and not os.environ.get("AWS_ENDPOINT_URL_S3"):
        https = os.environ.get("S3_USE_HTTPS", "1").strip() not in ("0", "false", "False")
        client["endpoint_url"] = endpoint if "://" in endpoint else f"{'https' if https else 'http'}://{endpoint}"
    if os.environ.get("S3_VERIFY_SSL", "1").strip() in ("0", "false", "False"):
        client["verify"] = False
    if os.environ.get("AWS_REGION"):
        client["region_name"] = os.environ["AWS_REGION"]
    config = {"connect_timeout": CONNECT_TIMEOUT_S, "read_timeout": READ_TIMEOUT_S,
              "retries": {"total_max_attempts": RETRIES + 1, "mode": "standard"}}
    return {"client_kwargs": client, "config_kwargs": config}


def _prepare_gcs() -> None:
    """gcsfs, as it is imported, turns on its experimental zonal and hierarchical-namespace support unless told
    not to, and then first asks each bucket's layout over gRPC: an emulator has no gRPC, and gcsfs waits about a
    minute per bucket before it falls back. A user who points `STORAGE_EMULATOR_HOST` at an emulator has no such
    bucket, so it stays off there unless they set it."""
    if os.environ.get("STORAGE_EMULATOR_HOST"):
        os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")


def _bound_azure_retries(fs: Any) -> None:
    """Azure's storage SDK retries a failed call 10 times, 15 s and more apart, and adlfs passes no setting for it:
    an unreachable store would take minutes to say so. Its client's retry policy is set as the other stores' are:
    RETRIES tries more, about 1.5 s apart."""
    clients = fs.service_client if isinstance(fs.service_client, list) else [fs.service_client]
    for client in clients:
        policy = client._config.retry_policy
        policy.total_retries = policy.connect_retries = policy.read_retries = policy.status_retries = RETRIES
        policy.initial_backoff, policy.increment_base, policy.random_jitter_range = 0.5, 1, 0.5


def _bound_gcs_retries(fs: Any) -> None:
    """gcsfs retries a failed request 6 times, 1 to 17 s apart, a count fixed as its class is defined: an
    unreachable store took about 33 s to say so. This instance's requests take the same retry decorator with the
    other stores' count (through the decorator's `__wrapped__`: may need a look with a gcsfs release)."""
    from gcsfs.retry import retry_request

    request = type(fs)._request
    fs._request = types.MethodType(retry_request(retries=RETRIES + 1)(request.__wrapped__), fs)


def _gcs_options() -> dict[str, Any]:
    """Google's default credentials, except for an emulator, which takes none."""
    options: dict[str, Any] = {"requests_timeout": READ_TIMEOUT_S}
    if os.environ.get("STORAGE_EMULATOR_HOST"):
        options["token"] = "anon"
    return options


# --- reading, listing, writing ------------------------------------------------------------------------------------

def _call(what: str, path: str, function: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        return function(*args, **kwargs)
    except StorageError:
        raise
    except Exception as error:  # every SDK has its own errors: each is one line here
        kind = StorageNotFound if isinstance(error, FileNotFoundError) else StorageError
        raise kind(f"could not {what} {path}: {describe(error)}") from None


def _key(path: str) -> str:
    """A URL as its file system names it, and names what it lists under it (each implementation has its way)."""
    return filesystem(path)._strip_protocol(path) if is_remote(path) else local_path(path)


def list_files(path: str) -> dict[str, Entry]:
    """Every file under a folder or prefix, by its path relative to it, in one listing (one paginated call on a
    store, not one per object); {} where there is none. StorageError if the store cannot be listed."""
    if not is_remote(path):
        return _list_local(local_path(path))
    fs = filesystem(path)
    prefix = _key(path).rstrip("/")
    try:
        found = fs.find(prefix, detail=True)
    except FileNotFoundError:  # some stores' word for a missing bucket, others list nothing: both are told below
        found = {}
    except Exception as error:
        raise StorageError(f"could not list {path}: {describe(error)}") from None
    bucket = prefix.lstrip("/").split("/", 1)[0]
    if not found and not _call("list", path, fs.exists, bucket):
        raise StorageError(f"could not list {path}: there is no bucket {bucket!r} (or these credentials cannot "
                           "see it)")
    files = {}
    for name, info in found.items():
        if info.get("type") == "directory":
            continue
        relative = name[len(prefix):].lstrip("/")
        if relative and not relative.endswith("/"):
            files[relative] = Entry(int(info.get("size") or 0), _tag(info))
    return files


def _tag(info: dict[str, Any]) -> str:
    for key in ("ETag", "etag", "generation", "md5Hash", "LastModified", "last_modified", "updated", "mtime",
                "created"):
        if info.get(key):
            return str(info[key])
    return ""


def _list_local(folder: str) -> dict[str, Entry]:
    files = {}
    for root, _, names in os.walk(folder):
        for name in names:
            full = os.path.join(root, name)
            try:
                stat = os.stat(full)
            except OSError:  # removed while we looked: the next listing sees the difference
                continue
            files[os.path.relpath(full, folder)] = Entry(stat.st_size, str(stat.st_mtime_ns))
    return files






def read_bytes(path: str) -> bytes:
    if not is_remote(path):
        with open(local_path(path), "rb") as f:
            return f.read()
    return _call("read", path, filesystem(path).cat_file, _key(path))


def read_text(path: str) -> str:
    return read_bytes(path).decode()


def open_file(path: str, mode: str = "rb") -> IO[Any]:
    """A file object on any store (writes land when it is closed)."""
    if not is_remote(path):
        return open(local_path(path), mode)
    return _call("open", path, filesystem(path).open, _key(path), mode)


def glob(pattern: str) -> list[str]:
    """The files a pattern matches, sorted, each as a full path or URL as the pattern wrote it."""
    if not is_remote(pattern):
        return sorted(p for p in local_glob.glob(local_path(pattern)) if os.path.isfile(p))
    fs = filesystem(pattern)
    found = _call("list", pattern, fs.glob, _key(pattern), detail=True)
    return sorted(fs.unstrip_protocol(name) for name, info in found.items() if info.get("type") != "directory")


def makedirs(path: str) -> None:
    """A folder; a no-op on a store, where folders are prefixes."""
    if not is_remote(path):
        os.makedirs(local_path(path), exist_ok=True)


def remove_tree(path: str) -> None:
    if not is_remote(path):
        shutil.rmtree(local_path(path), ignore_errors=True)
        return
    fs = filesystem(path)
    if _call("look at", path, fs.exists, _key(path)):
        _call("delete", path, fs.rm, _key(path), recursive=True)


def download(path: str, files: dict[str, Entry], destination: str) -> None:
    """The files of a listing (`list_files(path)`), each fetched into `destination` under its relative path and
    checked against the size the listing gave: a file that changed since (an upload still under way) is a
    StorageError, and the caller tries again after its next listing."""
    fs = filesystem(path)
    base = _key(path).rstrip("/")
    for relative, entry in files.items():
        target = os.path.join(destination, *relative.split("/"))
        os.makedirs(os.path.dirname(target), exist_ok=True)
        _call("download", f"{path.rstrip('/')}/{relative}", fs.get_file, f"{base}/{relative}", target)
        got = os.path.getsize(target)
        if got != entry.size:
            raise StorageError(f"could not download {path.rstrip('/')}/{relative}: {got} bytes arrived where the "
                               f"listing said {entry.size} (is it still being uploaded?)")


def upload_tree(folder: str, path: str) -> None:
    """A local folder's files to a URL prefix (or copied to a local folder), each under its relative path."""
    if not is_remote(path):
        shutil.copytree(folder, local_path(path), dirs_exist_ok=True)
        return
    fs = filesystem(path)
    base = _key(path).rstrip("/")
    for relative in sorted(_list_local(folder)):
        source = os.path.join(folder, relative)
        key = "/".join([base, *relative.split(os.sep)])
        _call("upload", f"{path.rstrip('/')}/{relative}", fs.put_file, source, key)

