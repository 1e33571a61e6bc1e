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
from typing import TYPE_CHECKING

from gunicorn.app.base import BaseApplication
from gunicorn.arbiter import Arbiter

from serving import metrics
from serving.config import (
    ProtocolOptions,
    ServerOptions,
    TLSOptions,
    bind_address,
    log_estimated_budget,
    parse_args,
)
from serving.protocols.grpc_api import unix_socket

if TYPE_CHECKING:  # TensorFlow comes with the core, and only the workers import it
    import grpc

    from serving.core import DataPlane

logger = logging.getLogger(__name__)

WORKER_HEARTBEAT_TIMEOUT_S = 120
REFUSAL_HEADROOM = 64  # connections past --max_connections that the gevent worker accepts only to refuse


def serves_grpc(protocols: ProtocolOptions) -> bool:
    return bool(protocols.port or protocols.grpc_socket_path)


class GrpcAfterLoad:
    """A worker's gRPC server, bound only once the worker's initial model load is over: a client that waits for
    the port and then calls must find every configured model loaded, as with TF Serving. Until it is bound it
    holds the worker's startup (so /readyz is not 200 before a gRPC client could connect)."""

    def __init__(self, core: DataPlane, options: ServerOptions) -> None:
        self.core = core
        self.options = options
        self.server: grpc.Server | None = None
        threading.Thread(target=self._start, name="petal-grpc-start", daemon=True).start()

    def _start(self) -> None:
        from serving.protocols.grpc_api import server as grpc_server

        self.core.wait_loaded()
        try:
            if not self.core.draining():
                self.server = grpc_server.start(self.core, self.options.protocols, self.options.security,
                                                self.options.process.runtime_dir)
        except Exception:  # a port in use, say: fail the way a worker that cannot boot does, stopping the server
            logger.exception("gRPC failed to start")
            os._exit(Arbiter.WORKER_BOOT_ERROR)
        finally:
            self.core.startup.port_opened()
        if self.core.draining():  # a SIGTERM that came while it bound found no server to stop
            self.stop(self.options.process.graceful_timeout)

    def stop(self, grace: float) -> threading.Event | None:
        """Refuse new RPCs now and let running ones finish within `grace`; the event is set once it has stopped."""
        return None if self.server is None else self.server.stop(grace)


def _post_worker_init(worker) -> None:
    """Start gRPC next to the REST app (once the models have loaded) and hook SIGTERM so readiness drops before
    the drain."""
    from serving import worker as process

    core = process.current()
    options: ServerOptions = worker.app.options  # the PetalApplication's
    if options.process.workers > 1:
        # Workers share the listening sockets, so a worker accepting before its models are loaded would make REST
        # calls wait while its siblings serve. Each loads first; /healthz is up with the first.
        core.wait_loaded()
    grpc_server = GrpcAfterLoad(core, options) if serves_grpc(options.protocols) else None
    worker.petal_grpc = grpc_server
    gunicorn_handler = worker.handle_exit

    def on_sigterm(sig, frame) -> None:
        core.begin_shutdown()
        if grpc_server is not None:
            # under gevent a signal handler runs on the loop, where a blocking call is not allowed, so the stop
            # runs in a greenlet of its own
            if options.process.worker_class == "gevent":
                import gevent
                gevent.spawn(grpc_server.stop, options.process.graceful_timeout)
            else:
                grpc_server.stop(options.process.graceful_timeout)
        gunicorn_handler(sig, frame)

    signal.signal(signal.SIGTERM, on_sigterm)
    logger.info("worker ready to accept", extra={"fields": {"pid": os.getpid(), "grpc_port": options.protocols.port}})


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
        o, process = self.options.protocols, self.options.process
        settings = {
            "bind": [bind_address(o.host, o.rest_api_port)],
            "workers": process.workers,
            "worker_class": self.worker_class(),
            "threads": process.threads,
            "worker_connections": o.max_connections + REFUSAL_HEADROOM,
            "graceful_timeout": max(1, math.ceil(process.graceful_timeout)),
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
        if self.options.process.worker_class == "gthread":
            return "gthread"
        from serving.gevent_worker import PetalGeventWorker

        o, tls = self.options.protocols, self.options.security.tls
        return type("ConfiguredGeventWorker", (PetalGeventWorker,), {
            "petal_max_connections": o.max_connections, "petal_header_timeout": o.request_header_timeout,
            "petal_body_timeout": o.request_body_timeout, "petal_os_threads": self.options.process.threads,
            "petal_tls": (tls, *self.tls_files) if tls and self.tls_files else None})

    def load(self):
        from serving.protocols.rest.app import create_app
        from serving.worker import create_core

        options = self.options
        core = create_core(options, ports_to_open=int(serves_grpc(options.protocols)))
        return create_app(core, options.protocols, options.security)


def main(argv: list[str]) -> int:
    options = parse_args(argv)
    dataplane, protocols, security = options.dataplane, options.protocols, options.security
    if options.ineffective_flags:
        logger.warning("tensorflow_model_server flags that change nothing in Petal",
                       extra={"fields": {"flags": dict(options.ineffective_flags)}})
    log_estimated_budget(options)
    if not dataplane.model_config_file and not os.path.isdir(dataplane.model_base_path):
        logger.warning("model base path does not exist yet; waiting for versions to appear",
                       extra={"fields": {"model_base_path": dataplane.model_base_path}})
    if protocols.grpc_socket_path:
        try:  # here, rather than in a worker once the models have loaded
            unix_socket.check_path(protocols.grpc_socket_path)
        except OSError as error:
            print(f"petal serve: {error}", file=sys.stderr)
            return 2
    models = dataplane.model_config_file or f"{dataplane.model_name} from {dataplane.model_base_path}"
    grpc_on = ([bind_address(protocols.host, protocols.port)] if protocols.port else []) + (
        [f"unix:{protocols.grpc_socket_path}"] if protocols.grpc_socket_path else [])
    grpc = f", gRPC on {' and '.join(grpc_on)}" if grpc_on else ""
    scheme = "https" if security.tls else "http"
    rest = f"{scheme}://{bind_address(protocols.host, protocols.rest_api_port)}"
    # a wildcard address is not one a browser can open; this machine's own name is
    page = rest.replace("0.0.0.0", "localhost").replace("[::]", "localhost")
    web_ui = "" if protocols.disable_web_ui else f"; web UI: open {page}/"
    print(f"petal serve: {models}; REST on {rest}{grpc}; ready when /readyz answers 200{web_ui}",
          file=sys.stderr, flush=True)
    # Files only this server reads: the REST port's key pair, and what several workers share (a reload RPC's
    # config, prometheus_client's per-process metrics, which worker serves --grpc_socket_path). mkdtemp's folder
    # is private (mode 0700).
    runtime = options.process.runtime_dir = tempfile.mkdtemp(prefix="petal-serve-")
    try:
        tls_files = None
        if security.tls:
            from serving.gevent_worker import tls_context

            tls_files = write_key_pair(security.tls, runtime)
            try:
                tls_context(security.tls, *tls_files)  # a bad key or certificate fails here, once, not per worker
            except (OSError, ValueError) as error:
                print(f"petal serve: --ssl_config_file {security.ssl_config_file}: {error}", file=sys.stderr)
                return 2
        if options.process.workers > 1:
            options.process.reload_dir = runtime
            metrics.prepare_multiprocess(os.path.join(runtime, "metrics"))
        PetalApplication(options, tls_files).run()
    finally:
        if protocols.grpc_socket_path:
            unix_socket.release(protocols.grpc_socket_path, runtime)
        shutil.rmtree(runtime, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
