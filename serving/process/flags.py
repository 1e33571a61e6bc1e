"""`petal serve`'s flags (tensorflow_model_server's, plus Petal's own), parsed once into frozen `ServerOptions`.

The files the flags name are read here, once (serving/options/config_files.py), so a bad file fails at start with its
path and the options hold what the file says.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import os
import re
import sys
from typing import Any

from exported_models import DEFAULT_MODEL_BASE_PATH, DEFAULT_MODEL_NAME, storage
from serving.core.version_labels import check_version_labels
from serving.options.config import WORKER_CLASSES, ServerOptions, model_config_for, option_defaults
from serving.options.config_files import (
    check_model_config,
    read_batching_parameters,
    read_metrics_path,
    read_model_config,
    read_ssl_config,
    read_token_file,
)
from serving.options.model_server_flags import UNIMPLEMENTED
from serving.process.memory_budget import resolve_memory_budget

TF_SERVING_MODEL_NAME = "default"  # tensorflow_model_server's --model_name


def parse_bool(text: str) -> bool:
    """TF Serving's boolean flags: `--flag`, `--flag=true`, `--flag=false` (and 1/0)."""
    value = str(text).strip().lower()
    if value in ("true", "1", "yes", "t", "y"):
        return True
    if value in ("false", "0", "no", "f", "n"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


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
    flag("--model_name", help=f"default: {TF_SERVING_MODEL_NAME!r} with --model_base_path (tensorflow_model_server's "
         f"name), else {DEFAULT_MODEL_NAME!r}")
    flag("--model_base_path", help=f"default: Petal's shipped model, {DEFAULT_MODEL_BASE_PATH}")
    flag("--model_config_file", default=d.model_config_file,
         help="text-format ModelServerConfig; overrides --model_name/base_path")
    flag("--model_config_file_poll_wait_seconds", type=float, default=d.model_config_file_poll_wait_seconds,
         help="re-read the config file; 0: never")
    flag("--file_system_poll_wait_seconds", type=float, default=d.file_system_poll_wait_seconds,
         help="poll model base paths for new versions; 0: once at startup")
    flag("--model_cache_dir", default=d.model_cache_dir,
         help="folder the versions of models in object stores (s3://, gs://, az://) are downloaded to, shared by "
         "the workers; default: petal-model-cache-UID in the temporary folder (Petal)")
    flag("--enable_batching", default=d.enable_batching, help="on by default in Petal (off in TF Serving)", **boolean)
    flag("--batching_parameters_file", default="", help="text-format BatchingParameters")
    flag("--batch_cost_seconds", type=float, default=d.batch_cost_seconds,
         help="(Petal) seconds each version's load may spend measuring its CPU and memory per image at each batch "
         "size, from which its batches are sized and their memory budgeted (docs/performance.md); 0: not measured")
    flag("--rest_api_timeout_in_ms", type=int, default=d.rest_api_timeout_in_ms)
    flag("--enable_model_warmup", default=d.enable_model_warmup, **boolean)
    flag("--allow_version_labels_for_unavailable_models", default=d.allow_version_labels_for_unavailable_models,
         help="a model config's new labels may name versions not loaded yet (at start, every version); an existing "
         "label still moves only to an AVAILABLE version", **boolean)
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
    flag("--monitoring_config_file", default="",
         help="text-format MonitoringConfig (prometheus_config)")
    flag("--grpc_max_message_bytes", type=int, default=d.grpc_max_message_bytes, help="(Petal) gRPC message limit")
    flag("--grpc_channel_arguments", default=d.grpc_channel_arguments,
         help="comma-separated key=value gRPC channel arguments")
    flag("--grpc_max_threads", type=int, default=d.grpc_max_threads,
         help="gRPC threads per worker; a worker takes twice as many calls at once, and a connection this many")
    flag("--workers", type=int, default=d.workers, help="(Petal) worker processes, each with its own model copy")
    flag("--worker_class", choices=WORKER_CLASSES, default=d.worker_class,
         help="(Petal) gevent: connections on an event loop, TensorFlow on OS threads; gthread: a thread per "
         "connection (the older front end, kept for comparison)")
    flag("--threads", "--rest_api_num_threads", dest="threads", type=int, default=d.threads,
         help="(Petal) request threads per worker with --worker_class=gthread; OS threads for unbatched runs "
         "with gevent")
    flag("--max_connections", type=int, default=d.max_connections,
         help="(Petal) open connections per worker and port; at it a new REST one closes the longest idle one, or "
         "gets 503 and is closed when every one is in a request; a new gRPC one is refused")
    flag("--keepalive_timeout", type=float, default=d.keepalive_timeout,
         help="(Petal) seconds an idle keep-alive connection, or a gRPC one without a call, stays open (longer "
         "than your load balancer's)")
    flag("--request_header_timeout", type=float, default=d.request_header_timeout,
         help="(Petal, gevent) seconds from a request's first byte to the end of its headers, and for a TLS "
         "handshake (gRPC's too)")
    flag("--request_body_timeout", type=float, default=d.request_body_timeout,
         help="(Petal, gevent) seconds for a request's body, plus one per 64 KiB received; as long for an answer "
         "to be taken; over gRPC for a call's message")
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
    flag("--ssl_config_file", default="", help="text-format SSLConfig (PEM text of server_key, "
         "server_cert, custom_ca; client_verify): TLS on both ports (TF Serving: gRPC only)")
    flag("--auth_token_file", default="", help="(Petal) bearer tokens, one per line, optionally "
         "followed by a space and the role `admin`; without it no token is asked for")
    flag("--enable_model_control", default=d.enable_model_control, help="(Petal) without --auth_token_file, allow "
         "the reload RPC (HandleReloadConfigRequest) to anyone who reaches the gRPC port", **boolean)
    flag("--metrics_require_auth", default=d.metrics_require_auth, help="(Petal) the metrics path needs a token too",
         **boolean)
    flag("--model_root", default=d.model_root, help="(Petal) every model base path (flags, config file, reload RPC) "
         "must resolve inside this folder")
    flag("--enable_profiler", default=d.enable_profiler, help="serve TensorFlow's profiler service on the gRPC port "
         "(tf.profiler.experimental.client.trace, TensorBoard's Capture Profile); with --auth_token_file it needs an "
         "admin token", **boolean)
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


def parse_args(argv: list[str]) -> ServerOptions:
    """Flags to options, reading each file they name once, so a bad file fails at start with its path."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        print(f"TensorFlow ModelServer: petal {importlib.metadata.version('petal')}\n"
              f"TensorFlow Library: {importlib.metadata.version('tensorflow')}")
        sys.exit(0)
    values = dict(vars(args))
    if args.rest_api_port == 0:
        parser.error("--rest_api_port=0: Petal always serves REST (its health probes live there); give it a port")
    if args.rest_api_port == args.port:
        parser.error(f"--rest_api_port={args.port} is --port too: give REST a port of its own (TF Serving would skip "
                     "REST; Petal always serves it, its health probes live there)")
    if args.rest_api_enable_cors_support and not args.cors_allowed_origins:
        values["cors_allowed_origins"] = ("*",)
    parallelism = args.tensorflow_session_parallelism
    intra, inter = args.tensorflow_intra_op_parallelism, args.tensorflow_inter_op_parallelism
    if parallelism > 0 and intra > 0 and inter > 0:
        parser.error("give either --tensorflow_session_parallelism or --tensorflow_intra_op_parallelism and "
                     "--tensorflow_inter_op_parallelism, not all three")
    if parallelism > 0 and not (intra or inter):
        values["tensorflow_intra_op_parallelism"] = values["tensorflow_inter_op_parallelism"] = parallelism
    if args.per_process_gpu_memory_fraction < 0:
        parser.error("--per_process_gpu_memory_fraction must be at least 0")
    try:
        values.update(read_flag_files(args))
    except (OSError, ValueError) as error:
        parser.error(str(error))
    options = ServerOptions.from_values(values, unimplemented_flags(parser, args))
    try:
        resolve_memory_budget(options)  # checked here; each worker derives it (serving/process/worker.py)
    except ValueError as error:
        parser.error(str(error))
    process, protocols = options.process, options.protocols
    if options.security.tls and process.worker_class != "gevent":
        parser.error("--ssl_config_file needs --worker_class=gevent (the REST port's TLS lives in its worker)")
    if min(process.workers, process.threads, protocols.max_connections, protocols.grpc_max_threads) < 1:
        parser.error("--workers, --threads, --max_connections and --grpc_max_threads must be at least 1")
    if min(protocols.keepalive_timeout, protocols.request_header_timeout, protocols.request_body_timeout) <= 0:
        parser.error("--keepalive_timeout, --request_header_timeout and --request_body_timeout must be positive")
    return options


def single_model(name: str | None, base_path: str | None) -> tuple[str, str]:
    """--model_name and --model_base_path as tensorflow_model_server takes them: a base path given without a name
    is the model "default" (main.cc), so a TF Serving client's /v1/models/default finds it; neither given serves
    Petal's shipped flowers model under its own name."""
    if base_path is None:
        return DEFAULT_MODEL_NAME if name is None else name, DEFAULT_MODEL_BASE_PATH
    return TF_SERVING_MODEL_NAME if name is None else name, base_path  # an empty name is refused as TF Serving does


def read_flag_files(args: argparse.Namespace) -> dict[str, Any]:
    """What the files the flags name hold, by the option that holds it: each file read once, here."""
    values: dict[str, Any] = {}
    if args.model_root and not storage.is_remote(args.model_root) and not os.path.isdir(args.model_root):
        raise ValueError(f"--model_root {args.model_root!r} is not a folder")
    if args.model_config_file:
        values["model_config"] = read_model_config(args.model_config_file, args.model_root)
        try:  # no version is AVAILABLE yet: TF Serving checks the first config's labels before it loads anything
            check_version_labels(values["model_config"], {}, {}, args.allow_version_labels_for_unavailable_models)
        except ValueError as error:
            raise ValueError(f"{args.model_config_file}: {error} (at start no version is loaded yet: "
                             "--allow_version_labels_for_unavailable_models=true lets a config label one)") from None
    else:
        values["model_config"] = model_config_for(*single_model(args.model_name, args.model_base_path))
        check_model_config(values["model_config"], args.model_root)
    if args.batching_parameters_file:
        values["batching"] = read_batching_parameters(args.batching_parameters_file)
        values["batching_from_file"] = True
    if args.monitoring_config_file:
        values["metrics_path"] = read_metrics_path(args.monitoring_config_file)
    if args.ssl_config_file:
        values["tls"] = read_ssl_config(args.ssl_config_file)
    if args.auth_token_file:
        values["tokens"] = read_token_file(args.auth_token_file)
    return values


def unimplemented_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    """The flags of serving/options/model_server_flags.py given a value other than Petal's behaviour: those that change
    nothing, with why, for the warning at start; a refused one ends start-up here, naming every one refused."""
    given = [(flag, getattr(args, flag.name)) for flag in UNIMPLEMENTED]
    given = [(flag, str(value).lower() if isinstance(value, bool) else value) for flag, value in given
             if value is not None and value not in flag.petal]
    refused = [f"--{flag.name}={value}: {flag.why}" for flag, value in given if flag.refuse]
    if refused:
        parser.error("; ".join(refused))
    return tuple((f"--{flag.name}={value}", flag.why) for flag, value in given)
