"""The files `petal serve`'s flags name, each read into the value the options hold, and the checks they pass.

Each is read once, at start (serving/process/flags.py), so that a bad file fails there with its path; only the model
config is read again, by the worker watching it (serving/process/worker.py), through the same `read_model_config` and
`check_model_config`, which the reload RPC's config passes too.
"""
from __future__ import annotations

import logging
import os
import re
import ssl
import tempfile
from typing import TypeVar

from google.protobuf import message as protobuf_message
from google.protobuf import text_format
from tensorflow_serving.config import model_server_config_pb2

from exported_models import storage
from serving.options.config import (
    DEFAULT_METRICS_PATH,
    BatchingOptions,
    TLSOptions,
    Token,
    large_batch_splitting_note,
    token_digest,
)
from serving.options.protos import BatchingParameters, MonitoringConfig, SSLConfig

logger = logging.getLogger(__name__)

ROLES = ("predict", "admin")  # a token line without a role may predict; `admin` may also control models
MIN_TOKEN_CHARS = 16
# RFC 6750's b64token: what a Bearer header can carry without quoting, so parsing it is never ambiguous.
TOKEN_PATTERN = re.compile(r"[A-Za-z0-9\-._~+/]+=*")

_Message = TypeVar("_Message", bound=protobuf_message.Message)


def _read_text_proto(path: str, message: _Message) -> _Message:
    """A text-format file into `message`; one that does not parse is a ValueError in TF Serving's words (protobuf's
    "Error parsing text-format <type>", which TF Serving's own tests look for, then its "Invalid protobuf file")."""
    text = storage.read_text(path)
    try:
        return text_format.Parse(text, message)
    except text_format.ParseError as error:
        raise ValueError(f"Error parsing text-format {message.DESCRIPTOR.full_name}: {str(error).rstrip('.')}. "
                         f"Invalid protobuf file: '{path}'") from None


def read_model_config(path: str, model_root: str = "") -> model_server_config_pb2.ModelServerConfig:
    """A text-format ModelServerConfig, checked (`check_model_config`); relative base paths are taken relative to
    the working directory."""
    config = _read_text_proto(path, model_server_config_pb2.ModelServerConfig())
    try:
        check_model_config(config, model_root)
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from None
    return config


def check_model_config(config: model_server_config_pb2.ModelServerConfig, model_root: str = "") -> None:
    """The rules every model config meets wherever it comes from (the flags, --model_config_file at start and
    each time it is re-read, the reload RPC): a model_config_list of TensorFlow models, each with a name and a base
    path, each name listed once (TF Serving's ValidateModelConfigList, model_servers/server_core.cc, in its words),
    and with --model_root every base path resolved (symlinks followed) inside it, so that no config points the
    server at the rest of the disk. A relative base path is taken relative to the working directory, where TF
    Serving refuses it (docs/protocols.md, 'Differences from TF Serving'). ValueError names the first rule
    broken."""
    if config.WhichOneof("config") != "model_config_list":
        raise ValueError("only model_config_list is supported")
    names: set[str] = set()
    for model in config.model_config_list.config:
        if model.name in names:
            raise ValueError(f"Illegal to list model {model.name} multiple times in config list")
        names.add(model.name)
        if not model.name or not model.base_path:
            raise ValueError("every config needs a name and a base_path")
        if model.model_platform not in ("", "tensorflow"):
            raise ValueError(f"model_platform {model.model_platform!r} is not supported")
    if not model_root:
        return
    for model in config.model_config_list.config:
        if not _inside(model.base_path, model_root):
            raise ValueError(f"model {model.name!r}: base path {model.base_path!r} is outside --model_root "
                             f"{model_root!r}")


def _inside(path: str, root: str) -> bool:
    """Whether a base path lies inside --model_root: a local one with its symlinks followed, a URL (a root can be
    one too: `s3://models/`) by its segments, none of them `..`."""
    if storage.is_remote(path) or storage.is_remote(root):
        parts, top = path.rstrip("/").split("/"), root.rstrip("/").split("/")
        return ".." not in parts and parts[:len(top)] == top
    real_root = os.path.realpath(storage.local_path(root))
    return os.path.commonpath([real_root, os.path.realpath(storage.local_path(path))]) == real_root


def read_ssl_config(path: str) -> TLSOptions:
    """A text-format SSLConfig; the key and certificate are required, and client_verify needs the CA to verify
    clients against."""
    config = _read_text_proto(path, SSLConfig())
    if not config.server_key.strip() or not config.server_cert.strip():
        raise ValueError(f"{path}: server_key and server_cert (PEM text) are both required")
    if config.client_verify and not config.custom_ca.strip():
        raise ValueError(f"{path}: client_verify needs custom_ca, the PEM of the CA that signs client certificates")
    tls = TLSOptions(config.server_key, config.server_cert, config.custom_ca, config.client_verify)
    try:
        check_key_pair(tls)
    except (OSError, ValueError) as error:  # ssl.SSLError is an OSError
        raise ValueError(f"{path}: {error}") from None
    return tls


def check_key_pair(tls: TLSOptions) -> None:
    """The key, the certificate and the CA load as the REST port will load them (serving/process/gevent_worker.py), so a
    bad one fails here, once, rather than in every worker. Python's ssl loads a key pair only from files: they are
    written to a private folder for the check and removed with it."""
    with tempfile.TemporaryDirectory(prefix="petal-tls-check-") as folder:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(*write_key_pair(tls, folder))
        if tls.custom_ca:
            context.load_verify_locations(cadata=tls.custom_ca)


def write_key_pair(tls: TLSOptions, folder: str) -> tuple[str, str]:
    """The REST port's certificate and key as files (certificate, key), which Python's ssl needs: readable by this
    user alone, in a private folder (mkdtemp's) that its maker removes."""
    paths = []
    for name, text in (("server_cert.pem", tls.server_cert), ("server_key.pem", tls.server_key)):
        path = os.path.join(folder, name)
        with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(text)
        paths.append(path)
    return paths[0], paths[1]


def read_token_file(path: str) -> tuple[Token, ...]:
    """One token per line, optionally followed by a space and a role; blank lines and `#` comments are skipped.
    Errors name the line, never the token."""
    tokens = []
    for number, line in enumerate(storage.read_text(path).splitlines(), 1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        token, _, role = text.partition(" ")
        role = role.strip() or "predict"
        if role not in ROLES:
            raise ValueError(f"{path}:{number}: unknown role {role!r}; roles are {', '.join(ROLES)}")
        if len(token) < MIN_TOKEN_CHARS or not TOKEN_PATTERN.fullmatch(token):
            raise ValueError(f"{path}:{number}: a token needs at least {MIN_TOKEN_CHARS} characters from "
                             "A-Z a-z 0-9 - . _ ~ + / (optionally ending in =)")
        tokens.append(Token(token_digest(token), role))
    if not tokens:
        raise ValueError(f"{path}: no tokens")
    return tuple(tokens)


def read_batching_parameters(path: str) -> BatchingOptions:
    """A text-format BatchingParameters (`BatchingOptions.from_proto`); what Petal does differently with
    `enable_large_batch_splitting` is warned about once, here, at start."""
    proto = _read_text_proto(path, BatchingParameters())
    try:
        options = BatchingOptions.from_proto(proto)
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from None
    note = large_batch_splitting_note(proto, options)
    if note:
        logger.warning("batching parameters: max_batch_size is not enforced with enable_large_batch_splitting",
                       extra={"fields": {"path": path, "detail": note}})
    return options


def read_metrics_path(path: str) -> str | None:
    """The Prometheus path from a MonitoringConfig; None when it disables the exporter."""
    config = _read_text_proto(path, MonitoringConfig())
    if config.HasField("prometheus_config") and not config.prometheus_config.enable:
        return None
    return config.prometheus_config.path or DEFAULT_METRICS_PATH
