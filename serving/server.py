"""`petal serve`: gunicorn running the Flask app, with gRPC in the same worker processes.

Each worker process is a complete server: it builds one DataPlane (model repository + batcher), serves REST/KServe
from gunicorn's event loop (serving/gevent_worker.py; `--worker_class=gthread` keeps the older thread per
connection) and gRPC from its own threads on the shared --port (SO_REUSEPORT), so every protocol batches onto the
same model copy. TensorFlow is only imported in the workers, after the fork.
As with TF Serving, gRPC opens only once the initial load is over, and the REST model APIs wait for it too, while
the REST port answers its health probes from the start (serving/core/startup.py).
On SIGTERM a worker turns readiness false, stops accepting, lets requests in flight finish, then exits; the
master gives it --graceful_timeout.
"""
from __future__ import annotations

import logging
import math
import os
import shutil
import signal
import sys
import tempfile
import threading

from gunicorn.app.base import BaseApplication
from gunicorn.arbiter import Arbiter

from serving.config import ServerOptions, TLSOptions, bind_address, parse_args
from serving import metrics
from serving.protocols import unix_socket

logger = logging.getLogger(__name__)

WORKER_HEARTBEAT_TIMEOUT_S = 120
REFUSAL_HEADROOM = 64  # connections past --max_connections that the gevent worker accepts only to refuse


def serves_grpc(options: ServerOptions) -> bool:
    return bool(options.port or options.grpc_socket_path)


class GrpcAfterLoad:
    """A worker's gRPC server, bound only once the worker's initial model load is over: a client that waits for
    the port and then calls must find every configured model loaded, as with TF Serving. Until it is bound it
    holds the worker's startup (so /readyz is not 200 before a gRPC client could connect)."""

    def __init__(self, core) -> None:
        self.core = core
        self.server = None
        threading.Thread(target=self._start, name="petal-grpc-start", daemon=True).start()

    def _start(self) -> None:
        from serving.protocols import grpc_api

        self.core.wait_loaded()
        try:
            if not self.core.shutting_down:
                self.server = grpc_api.start(self.core)
        except Exception:  # a port in use, say: fail the way a worker that cannot boot does, stopping the server
            logger.exception("gRPC failed to start")
            os._exit(Arbiter.WORKER_BOOT_ERROR)
        finally:
            self.core.startup.port_opened()
        if self.core.shutting_down:  # a SIGTERM that came while it bound found no server to stop
            self.stop(self.core.options.graceful_timeout)

    def stop(self, grace: float) -> threading.Event | None:
        """Refuse new RPCs now and let running ones finish within `grace`; the event is set once it has stopped."""
        return None if self.server is None else self.server.stop(grace)


def _post_worker_init(worker) -> None:
    """Start gRPC next to the REST app (once the models have loaded) and hook SIGTERM so readiness drops before
    the drain."""
    from serving import worker as process

    core = process.current()
    options: ServerOptions = core.options
    if options.workers > 1:
        # Workers share the listening sockets, so a worker accepting before its models are loaded would make REST
        # calls wait while its siblings serve. Each loads first; /healthz is up with the first.
        core.wait_loaded()
    grpc_server = GrpcAfterLoad(core) if serves_grpc(options) else None
    worker.petal_grpc = grpc_server
    gunicorn_handler = worker.handle_exit

    def on_sigterm(sig, frame) -> None:
        core.begin_shutdown()
        if grpc_server is not None:
            # under gevent a signal handler runs on the loop, where a blocking call is not allowed, so the stop
            # runs in a greenlet of its own
            if options.worker_class == "gevent":
                import gevent
                gevent.spawn(grpc_server.stop, options.graceful_timeout)
            else:
                grpc_server.stop(options.graceful_timeout)
        gunicorn_handler(sig, frame)

    signal.signal(signal.SIGTERM, on_sigterm)
    logger.info("worker ready to accept", extra={"fields": {"pid": os.getpid(), "grpc_port": options.port}})


def _worker_exit(server, worker) -> None:
    from serving import worker as process

    grpc_server = getattr(worker, "petal_grpc", None)
    stopped = None if grpc_server is None else grpc_server.stop(worker.cfg.graceful_timeout)
    if stopped is not None:
        stopped.wait(worker.cfg.graceful_timeout)
    try:
        process.current().close()
    except RuntimeError:
        pass


def _child_exit(server, worker) -> None:
    """In the master: a dead worker's live gauges (queue depth, loaded versions) leave the shared totals."""
    metrics.worker_exited(worker.pid)


def write_key_pair(tls: TLSOptions, folder: str) -> tuple[str, str]:
    """The REST port's certificate and key as files, which Python's ssl needs (the workers load them, also when
    gunicorn restarts one): readable by this user alone, in the private folder that `main` removes at exit."""
    paths = []
    for name, text in (("server_cert.pem", tls.server_cert), ("server_key.pem", tls.server_key)):
        path = os.path.join(folder, name)
        with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(text)
        paths.append(path)
    return paths[0], paths[1]


class PetalApplication(BaseApplication):
    """gunicorn configured from tensorflow_model_server-style flags instead of gunicorn's own."""

    def __init__(self, options: ServerOptions, tls_files: tuple[str, str] | None = None):
        self.options = options
        self.tls_files = tls_files
        super().__init__()

    def load_config(self) -> None:
        o = self.options
        settings = {
            "bind": [bind_address(o.host, o.rest_api_port)],
            "workers": o.workers,
            "worker_class": self.worker_class(),
            "threads": o.threads,
            "worker_connections": o.max_connections + REFUSAL_HEADROOM,
            "graceful_timeout": max(1, math.ceil(o.graceful_timeout)),
            "timeout": WORKER_HEARTBEAT_TIMEOUT_S,
            "keepalive": max(1, math.ceil(o.keepalive_timeout)),
            "post_worker_init": _post_worker_init,
            "worker_exit": _worker_exit,
            "child_exit": _child_exit,
            "loglevel": "warning" if logging.getLogger().level > logging.INFO else "info",
            "accesslog": None,
            "proc_name": "petal-serve",
        }
        for key, value in settings.items():
            self.cfg.set(key, value)

    def worker_class(self) -> type | str:
        """gthread by name; for gevent, Petal's worker with this server's limits set on it."""
        if self.options.worker_class == "gthread":
            return "gthread"
        from serving.gevent_worker import PetalGeventWorker

        o = self.options
        return type("ConfiguredGeventWorker", (PetalGeventWorker,), {
            "petal_max_connections": o.max_connections, "petal_header_timeout": o.request_header_timeout,
            "petal_body_timeout": o.request_body_timeout, "petal_os_threads": o.threads,
            "petal_tls": (o.tls, *self.tls_files) if o.tls and self.tls_files else None})

    def load(self):
        from serving.worker import create_core
        from serving.protocols.app import create_app

        return create_app(create_core(self.options, ports_to_open=int(serves_grpc(self.options))))


def main(argv: list[str]) -> int:
    options = parse_args(argv)
    if options.ineffective_flags:
        logger.warning("tensorflow_model_server flags that change nothing in Petal",
                       extra={"fields": {"flags": dict(options.ineffective_flags)}})
    if not options.model_config_file and not os.path.isdir(options.model_base_path):
        logger.warning("model base path does not exist yet; waiting for versions to appear",
                       extra={"fields": {"model_base_path": options.model_base_path}})
    if options.grpc_socket_path:
        try:  # here, rather than in a worker once the models have loaded
            unix_socket.check_free(options.grpc_socket_path)
        except OSError as error:
            print(f"petal serve: {error}", file=sys.stderr)
            return 2
    models = options.model_config_file or f"{options.model_name} from {options.model_base_path}"
    grpc_on = ([bind_address(options.host, options.port)] if options.port else []) + (
        [f"unix:{options.grpc_socket_path}"] if options.grpc_socket_path else [])
    grpc = f", gRPC on {' and '.join(grpc_on)}" if grpc_on else ""
    scheme = "https" if options.tls else "http"
    rest = f"{scheme}://{bind_address(options.host, options.rest_api_port)}"
    # a wildcard address is not one a browser can open; this machine's own name is
    page = rest.replace("0.0.0.0", "localhost").replace("[::]", "localhost")
    web_ui = "" if options.disable_web_ui else f"; web UI: open {page}/"
    print(f"petal serve: {models}; REST on {rest}{grpc}; ready when /readyz answers 200{web_ui}",
          file=sys.stderr, flush=True)
    # Files only this server reads: the REST port's key pair, and what several workers share (a reload RPC's
    # config, prometheus_client's per-process metrics). mkdtemp's folder is private (mode 0700).
    runtime = tempfile.mkdtemp(prefix="petal-serve-")
    try:
        tls_files = None
        if options.tls:
            from serving.gevent_worker import tls_context

            tls_files = write_key_pair(options.tls, runtime)
            try:
                tls_context(options.tls, *tls_files)  # a bad key or certificate fails here, once, not per worker
            except (OSError, ValueError) as error:
                print(f"petal serve: --ssl_config_file {options.ssl_config_file}: {error}", file=sys.stderr)
                return 2
        if options.workers > 1:
            options.reload_dir = runtime
            metrics.prepare_multiprocess(os.path.join(runtime, "metrics"))
        PetalApplication(options, tls_files).run()
    finally:
        shutil.rmtree(runtime, ignore_errors=True)
        if options.grpc_socket_path:
            unix_socket.remove_stale(options.grpc_socket_path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
