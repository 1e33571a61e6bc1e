"""`petal serve` flags (tensorflow_model_server's, plus Petal's own) and the text-proto files they name."""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.metadata
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from google.protobuf import message as protobuf_message
from google.protobuf import text_format
from tensorflow_serving.config import model_server_config_pb2

from exported_models import DEFAULT_MODEL_BASE_PATH, DEFAULT_MODEL_NAME
from serving.cpus import CGROUP_ROOT, available_cores
from serving.memory import (
    BODY_BYTES_FACTOR,
    BYTES_PER_PIXEL,
    Footprint,
    available_memory,
    cgroup_memory,
    default_memory_budget,
    default_pixel_share,
    estimated_footprint,
    footprint_after_load,
    log_budget,
)
from serving.model_server_flags import UNIMPLEMENTED
from serving.protos import BatchingParameters, MonitoringConfig, SSLConfig

DEFAULT_METRICS_PATH = "/monitoring/prometheus/metrics"
MB = 1024 * 1024
WORKER_CLASSES = ("gevent", "gthread")
ROLES = ("predict", "admin")  # a token line without a role may predict; `admin` may also control models
MIN_TOKEN_CHARS = 16
# RFC 6750's b64token: what a Bearer header can carry without quoting, so parsing it is never ambiguous.
TOKEN_PATTERN = re.compile(r"[A-Za-z0-9\-._~+/]+=*")


@dataclass(frozen=True)
class BatchingOptions:
    """TF Serving's BatchingParameters. Defaults follow its CPU advice: one thread per core, no timeout, and a
    queue of `num_batch_threads` batches for online serving."""
    max_batch_size: int = 64
    batch_timeout_micros: int = 0
    max_enqueued_batches: int = max(2, available_cores())
    num_batch_threads: int = max(2, available_cores())
    allowed_batch_sizes: tuple[int, ...] = ()
    pad_variable_length_inputs: bool = False

    def __post_init__(self) -> None:
        if self.max_batch_size < 1 or self.num_batch_threads < 1 or self.max_enqueued_batches < 1:
            raise ValueError("max_batch_size, num_batch_threads and max_enqueued_batches must be positive")
        if self.batch_timeout_micros < 0:
            raise ValueError("batch_timeout_micros must not be negative")
        sizes = list(self.allowed_batch_sizes)
        if sizes and (sizes != sorted(set(sizes)) or sizes[0] < 1 or sizes[-1] != self.max_batch_size):
            raise ValueError("allowed_batch_sizes must be increasing and end with max_batch_size, got "
                             f"{sizes} for max_batch_size {self.max_batch_size}")

    @classmethod
    def from_proto(cls, proto) -> BatchingOptions:
        """From a `session_bundle_config_pb2.BatchingParameters`; unset fields keep Petal's defaults."""
        values = {}
        for name in ("max_batch_size", "batch_timeout_micros", "max_enqueued_batches", "num_batch_threads"):
            if proto.HasField(name):
                values[name] = getattr(proto, name).value
        values["pad_variable_length_inputs"] = proto.pad_variable_length_inputs
        if proto.allowed_batch_sizes:
            values["allowed_batch_sizes"] = tuple(proto.allowed_batch_sizes)
        return cls(**values)

    def padded_size(self, rows: int) -> int:
        for size in self.allowed_batch_sizes:
            if size >= rows:
                return size
        return rows


@dataclass(frozen=True)
class TLSOptions:
    """TF Serving's SSLConfig, as PEM text. Applied to both ports; `client_verify` asks every client for a
    certificate signed by `custom_ca` (mutual TLS)."""
    server_key: str = field(repr=False)
    server_cert: str
    custom_ca: str = ""
    client_verify: bool = False


@dataclass(frozen=True)
class Token:
    """One line of --auth_token_file. The token is kept only as its SHA-256, so that comparing it takes the same
    time whatever the length of the token presented (serving/protocols/auth.py)."""
    digest: bytes = field(repr=False)
    role: str


@dataclass
class DataPlaneOptions:
    """What one worker's DataPlane serves and how: its models and their config file, batching, warmup, how
    TensorFlow runs them, and the image and memory budgets it admits requests against."""
    model_name: str = DEFAULT_MODEL_NAME
    model_base_path: str = DEFAULT_MODEL_BASE_PATH
    model_config_file: str = ""
    model_config_file_poll_wait_seconds: float = 0.0
    file_system_poll_wait_seconds: float = 1.0
    enable_batching: bool = True
    batching_parameters_file: str = ""
    batching: BatchingOptions = field(default_factory=BatchingOptions)
    enable_model_warmup: bool = True
    tensorflow_intra_op_parallelism: int = 0
    tensorflow_inter_op_parallelism: int = 0
    tensorflow_thread_nice: int = 10
    tensorflow_thread_spinning: bool = False  # idle TensorFlow pool threads sleep at once (docs/performance.md)
    per_process_gpu_memory_fraction: float = 0.0  # of each GPU's memory; 0: TensorFlow's choice
    max_image_pixels: int = 40_000_000
    max_inflight_pixels: int = 0  # 0: derived from the memory budget; -1: no budget
    memory_budget_bytes: int = 0  # 0: derived from memory (serving/memory.py); -1: no budget
    model_root: str = ""
    saved_model_tags: str = "serve"
    prefer_tflite_model: bool = False

    def model_server_config(self) -> model_server_config_pb2.ModelServerConfig:
        """The models to serve, from --model_config_file or --model_name/--model_base_path, checked
        (`check_model_config`)."""
        if self.model_config_file:
            return read_model_config(self.model_config_file, self.model_root)
        config = model_server_config_pb2.ModelServerConfig()
        model = config.model_config_list.config.add()
        model.name, model.base_path, model.model_platform = self.model_name, self.model_base_path, "tensorflow"
        check_model_config(config, self.model_root)
        return config


@dataclass
class ProtocolOptions:
    """What the listeners and the protocol adapters read: ports and address, gRPC's threads, message size and
    channel arguments, connection limits and timeouts, the REST deadline and body limit, CORS, the web UI, the
    metrics path and the access log."""
    port: int = 8500
    grpc_socket_path: str = ""  # gRPC on this Unix socket too (serving/protocols/grpc_api/unix_socket.py)
    grpc_max_threads: int = 64  # enough that requests can wait in the batcher together: a batch forms only from them
    rest_api_port: int = 8501
    host: str = "0.0.0.0"
    rest_api_timeout_in_ms: int = 30000
    monitoring_config_file: str = ""
    metrics_path: str | None = DEFAULT_METRICS_PATH
    grpc_max_message_bytes: int = 64 * MB
    grpc_channel_arguments: str = ""
    max_connections: int = 1000
    keepalive_timeout: float = 75.0
    request_header_timeout: float = 10.0
    request_body_timeout: float = 10.0
    max_request_bytes: int = 32 * MB
    cors_allowed_origins: tuple[str, ...] = ()  # none: browsers allow same-origin calls only
    disable_web_ui: bool = False
    access_log: bool = False


@dataclass
class SecurityOptions:
    """TLS on both ports, the bearer tokens and their roles, and what may be called without one."""
    ssl_config_file: str = ""
    tls: TLSOptions | None = None
    auth_token_file: str = ""
    tokens: tuple[Token, ...] = ()
    enable_model_control: bool = False
    metrics_require_auth: bool = False


@dataclass
class ProcessOptions:
    """How `petal serve` runs its workers (gunicorn's settings)."""
    workers: int = 1
    worker_class: str = "gevent"
    threads: int = 32
    graceful_timeout: float = 30.0
    reload_dir: str = ""  # set by `petal serve` with --workers > 1: the folder its workers share (serving/worker.py)
    runtime_dir: str = ""  # set by `petal serve`: its private folder, where its workers agree who serves the socket


Group = TypeVar("Group", DataPlaneOptions, ProtocolOptions, SecurityOptions, ProcessOptions)


@dataclass
class ServerOptions:
    """Every `petal serve` option, in the groups that read them, so each part is handed only its own."""
    dataplane: DataPlaneOptions = field(default_factory=DataPlaneOptions)
    protocols: ProtocolOptions = field(default_factory=ProtocolOptions)
    security: SecurityOptions = field(default_factory=SecurityOptions)
    process: ProcessOptions = field(default_factory=ProcessOptions)
    # tensorflow_model_server flags given that change nothing in Petal, each with what Petal does instead
    ineffective_flags: tuple[tuple[str, str], ...] = ()

    @classmethod
    def from_values(cls, values: Mapping[str, Any]) -> ServerOptions:
        """Each value in the group that has a field of its name; names that are no option's are left out."""
        def group(kind: type[Group]) -> Group:
            return kind(**{f.name: values[f.name] for f in dataclasses.fields(kind) if f.name in values})
        return cls(group(DataPlaneOptions), group(ProtocolOptions), group(SecurityOptions), group(ProcessOptions))


def option_defaults() -> dict[str, Any]:
    """Every option's default by name, read off the groups, so the flags hold no second copy of them."""
    defaults = ServerOptions()
    return {f.name: getattr(group, f.name)
            for group in (defaults.dataplane, defaults.protocols, defaults.security, defaults.process)
            for f in dataclasses.fields(group)}


def bind_address(host: str, port: int) -> str:
    """host:port for gunicorn and gRPC alike; an IPv6 literal such as --host=:: needs brackets."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def parse_bool(text: str) -> bool:
    """TF Serving's boolean flags: `--flag`, `--flag=true`, `--flag=false` (and 1/0)."""
    value = str(text).strip().lower()
    if value in ("true", "1", "yes", "t", "y"):
        return True
    if value in ("false", "0", "no", "f", "n"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


_Message = TypeVar("_Message", bound=protobuf_message.Message)


def _read_text_proto(path: str, message: _Message) -> _Message:
    """A text-format file into `message`; one that does not parse is a ValueError in TF Serving's words (protobuf's
    "Error parsing text-format <type>", which TF Serving's own tests look for, then its "Invalid protobuf file")."""
    with open(path) as f:
        text = f.read()
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
    path, and with --model_root every base path resolved (symlinks followed) inside it, so that no config points
    the server at the rest of the disk. ValueError names the first rule broken."""
    if config.WhichOneof("config") != "model_config_list":
        raise ValueError("only model_config_list is supported")
    for model in config.model_config_list.config:
        if not model.name or not model.base_path:
            raise ValueError("every config needs a name and a base_path")
        if model.model_platform not in ("", "tensorflow"):
            raise ValueError(f"model_platform {model.model_platform!r} is not supported")
    if not model_root:
        return
    real_root = os.path.realpath(model_root)
    for model in config.model_config_list.config:
        real = os.path.realpath(model.base_path)
        if os.path.commonpath([real_root, real]) != real_root:
            raise ValueError(f"model {model.name!r}: base path {model.base_path!r} is outside --model_root "
                             f"{model_root!r}")


def read_ssl_config(path: str) -> TLSOptions:
    """A text-format SSLConfig; the key and certificate are required, and client_verify needs the CA to verify
    clients against."""
    config = _read_text_proto(path, SSLConfig())
    if not config.server_key.strip() or not config.server_cert.strip():
        raise ValueError(f"{path}: server_key and server_cert (PEM text) are both required")
    if config.client_verify and not config.custom_ca.strip():
        raise ValueError(f"{path}: client_verify needs custom_ca, the PEM of the CA that signs client certificates")
    return TLSOptions(config.server_key, config.server_cert, config.custom_ca, config.client_verify)


def token_digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()


def read_token_file(path: str) -> tuple[Token, ...]:
    """One token per line, optionally followed by a space and a role; blank lines and `#` comments are skipped.
    Errors name the line, never the token."""
    tokens = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
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
    return BatchingOptions.from_proto(_read_text_proto(path, BatchingParameters()))


def read_metrics_path(path: str) -> str | None:
    """The Prometheus path from a MonitoringConfig; None when it disables the exporter."""
    config = _read_text_proto(path, MonitoringConfig())
    if config.HasField("prometheus_config") and not config.prometheus_config.enable:
        return None
    return config.prometheus_config.path or DEFAULT_METRICS_PATH


def parse_origins(text: str) -> tuple[str, ...]:
    """`--cors_allowed_origins=https://a.example,https://b.example` (or `*`): origins exactly as browsers send
    them, scheme and host and any port, without a path, so a typo fails at startup instead of silently refusing."""
    origins = tuple(o.strip().rstrip("/") for o in text.split(",") if o.strip())
    for origin in origins:
        if origin != "*" and not re.fullmatch(r"https?://[^/\s]+", origin):
            raise argparse.ArgumentTypeError(f"not an origin (scheme://host[:port]): {origin!r}")
    return origins


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="petal serve", description="Serve SavedModels over TF Serving's REST and gRPC APIs and KServe V2. "
        "Takes tensorflow_model_server's flags; booleans accept --flag=true/false.")
    flag = parser.add_argument
    boolean: dict[str, Any] = {"type": parse_bool, "nargs": "?", "const": True, "metavar": "true|false"}
    d = argparse.Namespace(**option_defaults())
    flag("--port", type=int, default=d.port, help="gRPC port; 0 turns gRPC off")
    flag("--grpc_socket_path", default=d.grpc_socket_path,
         help="also serve gRPC on this Unix socket file (with --workers > 1, one worker serves it)")
    flag("--rest_api_port", type=int, default=d.rest_api_port, help="REST (and KServe V2) port")
    flag("--host", default=d.host, help="address both ports bind to (Petal)")
    flag("--model_name", default=d.model_name)
    flag("--model_base_path", default=d.model_base_path)
    flag("--model_config_file", default=d.model_config_file,
         help="text-format ModelServerConfig; overrides --model_name/base_path")
    flag("--model_config_file_poll_wait_seconds", type=float, default=d.model_config_file_poll_wait_seconds,
         help="re-read the config file; 0: never")
    flag("--file_system_poll_wait_seconds", type=float, default=d.file_system_poll_wait_seconds,
         help="poll model base paths for new versions; 0: once at startup")
    flag("--enable_batching", default=d.enable_batching, help="on by default in Petal (off in TF Serving)", **boolean)
    flag("--batching_parameters_file", default=d.batching_parameters_file, help="text-format BatchingParameters")
    flag("--rest_api_timeout_in_ms", type=int, default=d.rest_api_timeout_in_ms)
    flag("--enable_model_warmup", default=d.enable_model_warmup, **boolean)
    flag("--tensorflow_intra_op_parallelism", type=int, default=d.tensorflow_intra_op_parallelism,
         help="0: the cores split between the model's callers (workers x batch threads)")
    flag("--tensorflow_inter_op_parallelism", type=int, default=d.tensorflow_inter_op_parallelism, help="0: the cores")
    flag("--tensorflow_thread_nice", type=int, default=d.tensorflow_thread_nice, choices=range(20), metavar="0-19",
         help="(Petal) how much lower TensorFlow's compute threads run than the threads that read and answer "
         "requests (Linux nice); 0: the same")
    flag("--tensorflow_thread_spinning", default=d.tensorflow_thread_spinning, help="(Petal) TensorFlow's idle pool "
         "threads spin-wait for the next op before they sleep, as TensorFlow's default does; false: they sleep at "
         "once (ConfigProto.experimental.disable_thread_spinning)", **boolean)
    flag("--per_process_gpu_memory_fraction", type=float, default=d.per_process_gpu_memory_fraction,
         help="the share of each GPU's memory every worker takes; 0: TensorFlow's choice (with --workers > 1, "
         "memory growth)")
    flag("--tensorflow_session_parallelism", type=int, default=0,
         help="both of the two above, where neither is given")
    flag("--monitoring_config_file", default=d.monitoring_config_file,
         help="text-format MonitoringConfig (prometheus_config)")
    flag("--grpc_max_message_bytes", type=int, default=d.grpc_max_message_bytes, help="(Petal) gRPC message limit")
    flag("--grpc_channel_arguments", default=d.grpc_channel_arguments,
         help="comma-separated key=value gRPC channel arguments")
    flag("--grpc_max_threads", type=int, default=d.grpc_max_threads, help="gRPC threads per worker")
    flag("--workers", type=int, default=d.workers, help="(Petal) worker processes, each with its own model copy")
    flag("--worker_class", choices=WORKER_CLASSES, default=d.worker_class,
         help="(Petal) gevent: connections on an event loop, TensorFlow on OS threads; gthread: a thread per "
         "connection (the older front end, kept for comparison)")
    flag("--threads", "--rest_api_num_threads", dest="threads", type=int, default=d.threads,
         help="(Petal) request threads per worker with --worker_class=gthread; OS threads for unbatched runs "
         "with gevent")
    flag("--max_connections", type=int, default=d.max_connections,
         help="(Petal, gevent) open connections per worker; past it a new one gets 503 and is closed")
    flag("--keepalive_timeout", type=float, default=d.keepalive_timeout,
         help="(Petal) seconds an idle keep-alive connection stays open (longer than your load balancer's)")
    flag("--request_header_timeout", type=float, default=d.request_header_timeout,
         help="(Petal, gevent) seconds from a request's first byte to the end of its headers")
    flag("--request_body_timeout", type=float, default=d.request_body_timeout,
         help="(Petal, gevent) seconds for a request's body, plus one per 64 KiB received")
    flag("--max_request_bytes", type=int, default=d.max_request_bytes, help="(Petal) larger bodies get 413")
    flag("--max_image_pixels", type=int, default=d.max_image_pixels,
         help="(Petal) larger images get 400 before they are decoded")
    flag("--max_inflight_pixels", type=int, default=d.max_inflight_pixels,
         help="(Petal) decoded image pixels a worker holds at once, the share of --memory_budget_bytes kept for "
         "decoding (4 bytes a pixel); more waits in the batch queue (503 when full). 0: half the memory budget, "
         "at least one --max_image_pixels image; -1: no budget at all")
    flag("--memory_budget_bytes", type=int, default=d.memory_budget_bytes,
         help="(Petal) memory a worker holds for the requests in flight: their bodies as read, parsed and decoded, "
         "and the images being decoded; a request past it gets 503 with Retry-After at once. 0: the cgroup's "
         "memory limit less 15%% headroom and what the server holds once its models have loaded (page cache "
         "included), over the workers; without a cgroup limit, physical memory less 15%% and the idle server's "
         "estimated size; -1: no budget")
    flag("--graceful_timeout", type=float, default=d.graceful_timeout,
         help="(Petal) on SIGTERM, how long requests in flight get to finish")
    flag("--rest_api_enable_cors_support", default=False, help="CORS for every origin, as "
         "--cors_allowed_origins=*; --cors_allowed_origins, when given, takes precedence", **boolean)
    flag("--cors_allowed_origins", type=parse_origins, default=d.cors_allowed_origins, metavar="ORIGINS",
         help="(Petal) comma-separated origins whose pages may call the REST and V2 APIs (CORS), or *; "
         "default: none, same-origin only")
    flag("--disable_web_ui", default=d.disable_web_ui, help="(Petal) no web pages at /, /models and /docs; "
         "the APIs stay", **boolean)
    flag("--ssl_config_file", default=d.ssl_config_file, help="text-format SSLConfig (PEM text of server_key, "
         "server_cert, custom_ca; client_verify): TLS on both ports (TF Serving: gRPC only)")
    flag("--auth_token_file", default=d.auth_token_file, help="(Petal) bearer tokens, one per line, optionally "
         "followed by a space and the role `admin`; without it no token is asked for")
    flag("--enable_model_control", default=d.enable_model_control, help="(Petal) without --auth_token_file, allow "
         "the reload RPC (HandleReloadConfigRequest) to anyone who reaches the gRPC port", **boolean)
    flag("--metrics_require_auth", default=d.metrics_require_auth, help="(Petal) the metrics path needs a token too",
         **boolean)
    flag("--model_root", default=d.model_root, help="(Petal) every model base path (flags, config file, reload RPC) "
         "must resolve inside this folder")
    flag("--access_log", default=d.access_log, help="(Petal) one JSON line per request on stderr", **boolean)
    flag("--version", default=False, help="print the version and exit", **boolean)
    compatible = parser.add_argument_group("tensorflow_model_server flags Petal takes without implementing them",
                                           "a value other than Petal's own behaviour is refused or warned about "
                                           "(docs/flags.md)")
    kinds: dict[str, dict[str, Any]] = {"bool": boolean, "int": {"type": int}, "float": {"type": float}, "str": {}}
    for unimplemented in UNIMPLEMENTED:
        compatible.add_argument(f"--{unimplemented.name}", default=None, help=unimplemented.why,
                                **kinds[unimplemented.kind])
    flag("--saved_model_tags", default=d.saved_model_tags, help="comma-separated tags of the MetaGraph to load")
    flag("--prefer_tflite_model", default=d.prefer_tflite_model, help="serve a version's model.tflite when it has one",
         **boolean)
    return parser


def resolve_memory_budget(options: ServerOptions, footprint: Footprint | None = None) -> tuple[int, int]:
    """Each worker's memory budget and its pixel share, (bytes, pixels): as the flags give them, else derived
    (serving/memory.py) from `footprint` (default: estimated from this machine's memory limit); (-1, -1) when
    either flag turns the budget off. ValueError for flags that contradict each other."""
    d = options.dataplane
    if d.memory_budget_bytes < 0 or d.max_inflight_pixels < 0:
        return -1, -1
    if 0 < d.max_inflight_pixels < d.max_image_pixels:
        raise ValueError("--max_inflight_pixels must be at least --max_image_pixels, or one allowed image could "
                         "never run")
    budget = d.memory_budget_bytes
    if budget == 0:
        pixels = max(d.max_inflight_pixels, d.max_image_pixels)
        floor = pixels * BYTES_PER_PIXEL + options.protocols.max_request_bytes * BODY_BYTES_FACTOR
        workers = options.process.workers
        budget = default_memory_budget(footprint or estimated_footprint(available_memory(), workers), workers, floor)
    pixels = d.max_inflight_pixels or default_pixel_share(budget, d.max_image_pixels)
    if pixels * BYTES_PER_PIXEL >= budget:
        raise ValueError(f"--memory_budget_bytes ({budget}) must be larger than the decoded pixels it keeps "
                         f"(--max_inflight_pixels {pixels}, {BYTES_PER_PIXEL} bytes each), to leave room for "
                         "request bodies")
    return budget, pixels


def measures_memory_budget(options: ServerOptions, cgroup_root: str = CGROUP_ROOT) -> bool:
    """Whether the budget is derived from what the server's cgroup holds once its models have loaded (see
    `budget_after_load`): when it is derived at all, and there is a cgroup limit to read."""
    d = options.dataplane
    if d.memory_budget_bytes != 0 or d.max_inflight_pixels < 0:
        return False
    cgroup = cgroup_memory(cgroup_root)
    return cgroup is not None and cgroup.limit is not None


def log_estimated_budget(options: ServerOptions) -> None:
    """The master's line at start for a budget derived where there is no cgroup limit to measure (a measured one is
    logged by the worker that measured it, `budget_after_load`)."""
    d, workers = options.dataplane, options.process.workers
    if d.memory_budget_bytes == 0 and d.max_inflight_pixels >= 0 and not measures_memory_budget(options):
        footprint = estimated_footprint(available_memory(), workers)
        log_budget(footprint, workers, *resolve_memory_budget(options, footprint))


def budget_after_load(options: ServerOptions, cgroup_root: str = CGROUP_ROOT) -> tuple[int, int]:
    """The budget and pixel share from the cgroup's reading once every worker has loaded and warmed up its models
    (a worker calls it then, before it admits a request); logged by the worker that read it. Without a cgroup limit
    to read, the estimate's."""
    workers = options.process.workers
    measured = footprint_after_load(workers, options.process.reload_dir, cgroup_root)
    footprint = estimated_footprint(available_memory(cgroup_root), workers) if measured is None else measured[0]
    budget, pixels = resolve_memory_budget(options, footprint)
    if measured is None or measured[1]:
        log_budget(footprint, workers, budget, pixels)
    return budget, pixels


def parse_args(argv: list[str]) -> ServerOptions:
    """Flags to options, reading the files they name, so a bad file fails at startup with its path."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        print(f"TensorFlow ModelServer: petal {importlib.metadata.version('petal')}\n"
              f"TensorFlow Library: {importlib.metadata.version('tensorflow')}")
        sys.exit(0)
    options = ServerOptions.from_values(vars(args))
    d, protocols, security = options.dataplane, options.protocols, options.security
    options.ineffective_flags = unimplemented_flags(parser, args)
    if args.rest_api_port == 0:
        parser.error("--rest_api_port=0: Petal always serves REST (its health probes live there); give it a port")
    if args.rest_api_enable_cors_support and not protocols.cors_allowed_origins:
        protocols.cors_allowed_origins = ("*",)
    parallelism = args.tensorflow_session_parallelism
    if parallelism > 0 and d.tensorflow_intra_op_parallelism > 0 and d.tensorflow_inter_op_parallelism > 0:
        parser.error("give either --tensorflow_session_parallelism or --tensorflow_intra_op_parallelism and "
                     "--tensorflow_inter_op_parallelism, not all three")
    if d.per_process_gpu_memory_fraction < 0:
        parser.error("--per_process_gpu_memory_fraction must be at least 0")
    if parallelism > 0 and not (d.tensorflow_intra_op_parallelism or d.tensorflow_inter_op_parallelism):
        d.tensorflow_intra_op_parallelism = d.tensorflow_inter_op_parallelism = parallelism
    try:
        if args.batching_parameters_file:
            d.batching = read_batching_parameters(args.batching_parameters_file)
        if args.monitoring_config_file:
            protocols.metrics_path = read_metrics_path(args.monitoring_config_file)
        if args.ssl_config_file:
            security.tls = read_ssl_config(args.ssl_config_file)
        if args.auth_token_file:
            security.tokens = read_token_file(args.auth_token_file)
        if args.model_root and not os.path.isdir(args.model_root):
            raise ValueError(f"--model_root {args.model_root!r} is not a folder")
        d.model_server_config()  # read and checked here, so that a bad config fails at start with its path
    except (OSError, ValueError) as error:
        parser.error(str(error))
    try:
        resolve_memory_budget(options)  # checked here; each worker derives it (serving/worker.py)
    except ValueError as error:
        parser.error(str(error))
    process = options.process
    if security.tls and process.worker_class != "gevent":
        parser.error("--ssl_config_file needs --worker_class=gevent (the REST port's TLS lives in its worker)")
    if min(process.workers, process.threads, protocols.max_connections, protocols.grpc_max_threads) < 1:
        parser.error("--workers, --threads, --max_connections and --grpc_max_threads must be at least 1")
    if min(protocols.keepalive_timeout, protocols.request_header_timeout, protocols.request_body_timeout) <= 0:
        parser.error("--keepalive_timeout, --request_header_timeout and --request_body_timeout must be positive")
    return options


def unimplemented_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    """The flags of serving/model_server_flags.py given a value other than Petal's behaviour: those that change
    nothing, with why, for the warning at start; a refused one ends start-up here, naming every one refused."""
    given = [(flag, getattr(args, flag.name)) for flag in UNIMPLEMENTED]
    given = [(flag, str(value).lower() if isinstance(value, bool) else value) for flag, value in given
             if value is not None and value not in flag.petal]
    refused = [f"--{flag.name}={value}: {flag.why}" for flag, value in given if flag.refuse]
    if refused:
        parser.error("; ".join(refused))
    return tuple((f"--{flag.name}={value}", flag.why) for flag, value in given)
