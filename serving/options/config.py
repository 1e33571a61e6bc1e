"""`petal serve`'s options, in the groups their readers are handed, each frozen once the flags are parsed.

serving/process/flags.py parses the flags into them; the files the flags name (the model config, the batching
parameters, the SSL config, the tokens, the monitoring config) are read there once, through
serving/options/config_files.py, and the options hold what was read, never the path beside it. A value derived later
(the memory budget, the folders `petal serve` makes) is a `dataclasses.replace` copy.
"""
from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from tensorflow_serving.config import model_server_config_pb2

from exported_models import DEFAULT_MODEL_BASE_PATH, DEFAULT_MODEL_NAME
from serving.host.cpus import available_cores

DEFAULT_METRICS_PATH = "/monitoring/prometheus/metrics"
MB = 1024 * 1024
# bytes/s a client must send a body or read an answer at, past --request_body_timeout: each such chunk buys one more
# second (serving/process/gevent_worker.py for REST, serving/protocols/grpc_api/gate.py for gRPC)
MIN_BODY_RATE = 64 * 1024
WORKER_CLASSES = ("gevent", "gthread")


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
        """From a `session_bundle_config_pb2.BatchingParameters`; unset fields keep Petal's defaults.

        `max_batch_size` here is the largest batch Petal runs, and the size it splits a larger request into
        (serving/core/batching.py). With `enable_large_batch_splitting` TF Serving's `max_batch_size` is instead the
        largest request it takes, and `max_execution_batch_size` (default: `max_batch_size`) the largest batch it
        runs, so that is the one kept, under TF Serving's rules for the two; Petal does not refuse a larger request
        (it splits any request larger than a batch), which `large_batch_splitting_note` says at start. Without
        `enable_large_batch_splitting`, `max_execution_batch_size` is ignored, as in TF Serving. `thread_pool_name`
        names nothing in Petal (its batch threads are its own) and is ignored too."""
        values = {}
        for name in ("max_batch_size", "batch_timeout_micros", "max_enqueued_batches", "num_batch_threads"):
            if proto.HasField(name):
                values[name] = getattr(proto, name).value
        values["pad_variable_length_inputs"] = proto.pad_variable_length_inputs
        if proto.allowed_batch_sizes:
            values["allowed_batch_sizes"] = tuple(proto.allowed_batch_sizes)
        if large_batch_splitting(proto):
            largest_input = values.get("max_batch_size", cls.max_batch_size)
            execution = proto.max_execution_batch_size.value if proto.HasField("max_execution_batch_size") \
                else largest_input
            if not 1 <= execution <= largest_input:
                raise ValueError("with enable_large_batch_splitting, max_execution_batch_size must be positive and "
                                 f"at most max_batch_size; got {execution} and max_batch_size {largest_input}")
            sizes = values.get("allowed_batch_sizes")
            if sizes and sizes[-1] != execution:
                raise ValueError("Last entry in allowed_batch_sizes must be equal to max_execution_batch_size; "
                                 f"last entry was {sizes[-1]}; expected {execution}")
            values["max_batch_size"] = execution
        return cls(**values)

    def padded_size(self, rows: int) -> int:
        for size in self.allowed_batch_sizes:
            if size >= rows:
                return size
        return rows


def large_batch_splitting(proto) -> bool:
    """Whether a BatchingParameters turns on TF Serving's `enable_large_batch_splitting` (a BoolValue)."""
    return proto.HasField("enable_large_batch_splitting") and proto.enable_large_batch_splitting.value


def large_batch_splitting_note(proto, options: BatchingOptions) -> str:
    """What Petal does differently with a BatchingParameters' `enable_large_batch_splitting` (`options`, what
    `BatchingOptions.from_proto` made of it), for the warning at start; empty without it."""
    if not large_batch_splitting(proto):
        return ""
    limit = proto.max_batch_size.value if proto.HasField("max_batch_size") else options.max_batch_size
    return (f"enable_large_batch_splitting: batches run at most max_execution_batch_size ({options.max_batch_size}) "
            f"rows and a larger request is split across batches, as in TF Serving; but max_batch_size ({limit}), "
            "TF Serving's limit on a request's rows, is not enforced: Petal splits a larger request too rather "
            "than refuse it with INVALID_ARGUMENT")


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


def token_digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()


def model_config_for(name: str = DEFAULT_MODEL_NAME,
                     base_path: str = DEFAULT_MODEL_BASE_PATH) -> model_server_config_pb2.ModelServerConfig:
    """The one model --model_name and --model_base_path name, as the config a --model_config_file would hold."""
    config = model_server_config_pb2.ModelServerConfig()
    config.model_config_list.config.add(name=name, base_path=base_path, model_platform="tensorflow")
    return config


@dataclass(frozen=True)
class DataPlaneOptions:
    """What one worker's DataPlane serves and how: its models, batching, warmup, how TensorFlow runs them, and the
    image and memory budgets it admits requests against.

    `model_config` is the models served at start, read once (from --model_config_file, or built from --model_name
    and --model_base_path) and checked; the worker's watch on the file starts from this same config. Nothing
    changes it: a reload hands the DataPlane a new one."""
    model_config: model_server_config_pb2.ModelServerConfig = field(default_factory=model_config_for)
    file_system_poll_wait_seconds: float = 1.0
    model_cache_dir: str = ""  # where versions from object stores are downloaded; "": serving/core/source.py's default
    enable_batching: bool = True
    batching: BatchingOptions = field(default_factory=BatchingOptions)
    batching_from_file: bool = False  # --batching_parameters_file: its batch sizes win over the measured ones
    batch_cost_seconds: float = 2.0  # measuring each version's cost per batch size at load (0: not measured)
    enable_model_warmup: bool = True
    # a label new to a model (or kept) may name a version not AVAILABLE yet (serving/core/version_labels.py)
    allow_version_labels_for_unavailable_models: bool = False
    tensorflow_intra_op_parallelism: int = 0
    tensorflow_inter_op_parallelism: int = 0
    tensorflow_thread_nice: int = 10
    tensorflow_thread_spinning: bool = False  # idle TensorFlow pool threads sleep at once (docs/performance.md)
    per_process_gpu_memory_fraction: float = 0.0  # of each GPU's memory; 0: TensorFlow's choice
    max_image_pixels: int = 40_000_000
    max_inflight_pixels: int = 0  # 0: derived from the memory budget; -1: no budget
    memory_budget_bytes: int = 0  # 0: derived from memory (serving/process/memory_budget.py); -1: no budget
    model_root: str = ""
    saved_model_tags: str = "serve"
    prefer_tflite_model: bool = False


@dataclass(frozen=True)
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
    metrics_path: str | None = DEFAULT_METRICS_PATH  # None: --monitoring_config_file turned the exporter off
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
    enable_profiler: bool = True  # TensorFlow's profiler service on the gRPC port, as TF Serving's default


@dataclass(frozen=True)
class SecurityOptions:
    """TLS on both ports (from --ssl_config_file), the bearer tokens and their roles (from --auth_token_file), and
    what may be called without one."""
    tls: TLSOptions | None = None
    tokens: tuple[Token, ...] = ()
    enable_model_control: bool = False
    metrics_require_auth: bool = False


@dataclass(frozen=True)
class ProcessOptions:
    """How `petal serve` runs its workers (gunicorn's settings), the config file each worker watches, and what the
    master sets up for them before they start."""
    workers: int = 1
    worker_class: str = "gevent"
    threads: int = 32
    graceful_timeout: float = 30.0
    # the file each worker re-reads every so many seconds (0: never); what it held at start is the DataPlane's
    # `model_config`
    model_config_file: str = ""
    model_config_file_poll_wait_seconds: float = 0.0
    # set by `petal serve` with --workers > 1: the folder its workers share (serving/process/worker.py)
    reload_dir: str = ""
    runtime_dir: str = ""  # set by `petal serve`: its private folder, where its workers agree who serves the socket
    started_at: float = 0.0  # set by `petal serve`: its time.monotonic() at start, for the line that says it is ready


Group = TypeVar("Group", DataPlaneOptions, ProtocolOptions, SecurityOptions, ProcessOptions)


@dataclass(frozen=True)
class ServerOptions:
    """Every `petal serve` option, in the groups that read them, so each part is handed only its own."""
    dataplane: DataPlaneOptions = field(default_factory=DataPlaneOptions)
    protocols: ProtocolOptions = field(default_factory=ProtocolOptions)
    security: SecurityOptions = field(default_factory=SecurityOptions)
    process: ProcessOptions = field(default_factory=ProcessOptions)
    # tensorflow_model_server flags given that change nothing in Petal, each with what Petal does instead
    ineffective_flags: tuple[tuple[str, str], ...] = ()

    @classmethod
    def from_values(cls, values: Mapping[str, Any], ineffective_flags: tuple[tuple[str, str], ...] = ()
                    ) -> ServerOptions:
        """Each value in the group that has a field of its name; names that are no option's are left out."""
        def group(kind: type[Group]) -> Group:
            return kind(**{f.name: values[f.name] for f in dataclasses.fields(kind) if f.name in values})
        return cls(group(DataPlaneOptions), group(ProtocolOptions), group(SecurityOptions), group(ProcessOptions),
                   ineffective_flags)


def option_defaults() -> dict[str, Any]:
    """Every option's default by name, read off the groups, so the flags hold no second copy of them."""
    defaults = ServerOptions()
    return {f.name: getattr(group, f.name)
            for group in (defaults.dataplane, defaults.protocols, defaults.security, defaults.process)
            for f in dataclasses.fields(group)}


def bind_address(host: str, port: int) -> str:
    """host:port for gunicorn and gRPC alike; an IPv6 literal such as --host=:: needs brackets."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def listening_urls(options: ServerOptions, for_clients: bool = False) -> tuple[str, list[str]]:
    """The REST port's URL and the gRPC ones (`grpc://` or `grpcs://` host:port, `unix:` a socket path), as the
    server binds them, or, `for_clients`, as a client or a browser on this machine reaches them: a wildcard
    address is not one they can open, `localhost` is."""
    protocols, tls = options.protocols, options.security.tls

    def url(scheme: str, port: int) -> str:
        address = bind_address(protocols.host, port)
        host, _, number = address.rpartition(":")
        return f"{scheme}://{'localhost' if for_clients and host in ('0.0.0.0', '[::]') else host}:{number}"
    grpc = [url("grpcs" if tls else "grpc", protocols.port)] if protocols.port else []
    grpc += [f"unix:{protocols.grpc_socket_path}"] if protocols.grpc_socket_path else []
    return url("https" if tls else "http", protocols.rest_api_port), grpc
