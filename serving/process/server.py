"""`petal serve`: gunicorn running the Flask app, with gRPC in the same worker processes.

Each worker process is a complete server: it builds one DataPlane (model repository + batcher), serves REST/KServe
from gunicorn's event loop (serving/process/gevent_worker.py; `--worker_class=gthread` keeps the older thread per
connection) and gRPC from its own threads on the shared --port (SO_REUSEPORT), so every protocol batches onto the
same model copy. TensorFlow is only imported in the workers, after the fork.
A worker's life (start, the initial load, gRPC once it is over, reloads, the SIGTERM drain, the exit) is its
`Worker`'s (serving/process/worker.py): gunicorn's hooks and the SIGTERM handler here only call it. As with TF Serving,
gRPC opens only once the initial load is over, and the REST model APIs wait for it too, while the REST port answers
its health probes from the start (serving/core/startup.py). On SIGTERM a worker turns readiness false, stops
accepting, lets requests in flight finish, then exits; the master gives it --graceful_timeout.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import shutil
import signal
import sys
import tempfile
import time
from typing import TYPE_CHECKING

from gunicorn import glogging
from gunicorn import util as gunicorn_util
from gunicorn.app.base import BaseApplication

from exported_models import storage
from serving import metrics
from serving.options.config import ServerOptions, bind_address, listening_urls
from serving.options.config_files import write_key_pair
from serving.process import ports, worker_stderr
from serving.process.flags import parse_args
from serving.process.memory_budget import log_estimated_budget
from serving.protocols.grpc_api import unix_socket

if TYPE_CHECKING:  # TensorFlow comes with the worker, and only the workers import it
    from serving.process.worker import Worker

logger = logging.getLogger(__name__)

WORKER_HEARTBEAT_TIMEOUT_S = 120
STDERR_DRAIN_S = 5.0  # how long the master waits, once its workers are gone, for their last lines to be written
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT)
REFUSAL_HEADROOM = 64  # connections past --max_connections that the gevent worker accepts only to refuse


def _post_worker_init(gunicorn_worker) -> None:
    """The REST port is about to accept: the worker opens gRPC once its models have loaded, and SIGTERM drains
    it."""
    worker: Worker = gunicorn_worker.app.serving_worker
    worker.serve(functools.partial(_stop_accepting, gunicorn_worker))
    signal.signal(signal.SIGTERM, worker.on_sigterm)


def _hold_stop_signals() -> None:
    """Before a fork: a stop signal waits (blocked, in the master and, with the mask, in its child) until the child
    has handlers of its own, so none reaches the child's copy of the master's."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)


def _release_stop_signals() -> None:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def _stop_signals_until_the_worker_takes_them() -> None:
    """In a process the master just forked: a stop signal ends it at once, until gunicorn's worker installs its own
    handlers. Until then the worker holds the master's, which queue the signal in the master's memory (the
    worker's copy of it), so a SIGTERM passed on in those moments was lost: the worker went on to load its models
    and serve until --graceful_timeout ran out and the master killed it. Signals held since before the fork
    (`_hold_stop_signals`) arrive now, at these handlers: one that came between the fork and this call was lost
    too, as a test that stops a worker the moment it is forked found."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, _exit_before_serving)
    _release_stop_signals()


def _exit_before_serving(signum: int, frame: object) -> None:
    os._exit(0)  # nothing is loaded or served yet: nothing to drain


def _stop_accepting(gunicorn_worker) -> None:
    """The REST port's part of a drain: gunicorn's worker stops accepting and lets its requests in flight finish;
    Petal's gevent worker also closes its idle keep-alive connections now, which would otherwise hold the drain for
    --graceful_timeout."""
    gunicorn_worker.handle_exit(signal.SIGTERM, None)
    close_idle = getattr(gunicorn_worker, "close_idle_connections", None)  # gthread's worker has none
    if close_idle is not None:
        close_idle()


def _worker_exit(server, gunicorn_worker) -> None:
    worker: Worker | None = getattr(gunicorn_worker.app, "serving_worker", None)
    if worker is not None:  # None: the worker failed before it started
        worker.exit()


def _json_error_page(sock, status_int: int, reason: str, mesg: str) -> None:
    """gunicorn's answer to a request it cannot parse (a Content-Length that is not a number, headers past their
    limit, a Transfer-Encoding it does not know) in Petal's form, `{"error": ...}`, as every other error on every
    API is, rather than gunicorn's HTML page, and with the `nosniff` the app's answers carry (it may echo the
    client's text). gunicorn writes it through `gunicorn.util.write_error`, for which it has no hook, so `main`
    puts this in its place before the workers are forked."""
    body = json.dumps({"error": mesg or reason}).encode()
    head = (f"HTTP/1.1 {status_int} {reason}\r\nConnection: close\r\nContent-Type: application/json\r\n"
            f"X-Content-Type-Options: nosniff\r\nContent-Length: {len(body)}\r\n\r\n")
    gunicorn_util.write_nonblock(sock, head.encode("latin-1") + body)


def _child_exit(server, worker) -> None:
    """In the master: a dead worker's live gauges (queue depth, loaded versions) leave the shared totals, and the
    rest of what it wrote to stderr is written out."""
    metrics.worker_exited(worker.pid)
    worker_stderr.child_exit(server, worker)


class GunicornLog(glogging.Logger):
    """gunicorn's own messages (a worker killed or timed out, a port in use) as Petal's JSON log lines: they go to
    the root logger, which `petal` set up, instead of through gunicorn's handler in its plain-text format."""

    def setup(self, cfg) -> None:
        super().setup(cfg)
        for handler in [h for h in self.error_log.handlers if getattr(h, "_gunicorn", False)]:
            self.error_log.removeHandler(handler)
        self.error_log.propagate = True


class PetalApplication(BaseApplication):
    """gunicorn configured from tensorflow_model_server-style flags instead of gunicorn's own."""

    def __init__(self, options: ServerOptions, tls_files: tuple[str, str] | None = None):
        self.options = options
        self.tls_files = tls_files
        self.serving_worker: Worker | None = None  # in each worker process, once gunicorn has loaded the app
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
            "pre_fork": worker_stderr.pre_fork,
            "post_fork": worker_stderr.post_fork,
            "post_worker_init": _post_worker_init,
            "worker_exit": _worker_exit,
            "child_exit": _child_exit,
            "loglevel": "warning" if logging.getLogger().level > logging.INFO else "info",
            "logger_class": GunicornLog,
            "accesslog": None,
            "proc_name": "petal-serve",
        }
        if "control_socket_disable" in self.cfg.settings:
            # gunicorn 25.1's control socket, on by default at one path per user ($XDG_RUNTIME_DIR or ~/.gunicorn):
            # a second `petal serve` on the machine finds it taken and says so on its first screen, and any process
            # of the user's could change the worker count or stop the server behind Petal's flags.
            settings["control_socket_disable"] = True
        for key, value in settings.items():
            self.cfg.set(key, value)

    def worker_class(self) -> type | str:
        """gthread by name; for gevent, Petal's worker with this server's limits set on it."""
        if self.options.process.worker_class == "gthread":
            return "gthread"
        from serving.process.gevent_worker import PetalGeventWorker

        o, tls = self.options.protocols, self.options.security.tls
        return type("ConfiguredGeventWorker", (PetalGeventWorker,), {
            "petal_max_connections": o.max_connections, "petal_header_timeout": o.request_header_timeout,
            "petal_body_timeout": o.request_body_timeout, "petal_os_threads": self.options.process.threads,
            "petal_tls": (tls, *self.tls_files) if tls and self.tls_files else None})

    def load(self):
        """In each worker process, after the fork: TensorFlow imported first, its C++ start-up lines filtered
        (serving/tensorflow_logs.py), then the worker started; gunicorn serves the REST app it returns."""
        from serving.tensorflow_logs import import_tensorflow

        import_tensorflow()
        from serving.process.worker import Worker

        self.serving_worker = Worker(self.options)
        return self.serving_worker.start()


def main(argv: list[str]) -> int:
    started = time.monotonic()
    options = parse_args(argv)
    protocols, tls = options.protocols, options.security.tls
    if options.ineffective_flags:
        logger.warning("tensorflow_model_server flags that change nothing in Petal",
                       extra={"fields": {"flags": dict(options.ineffective_flags)}})
    log_estimated_budget(options)
    if options.process.worker_class == "gthread":
        logger.warning("--worker_class=gthread has none of the gevent front end's limits on slow clients: keep it "
                       "off the open internet (docs/security.md, 'Limits')", extra={"fields": {"flags": [
                           "--request_header_timeout", "--request_body_timeout", "--max_connections"]}})
    for model in options.dataplane.model_config.model_config_list.config:
        try:
            storage.require(model.base_path)
        except storage.StorageError as error:
            print(f"petal serve: {error}", file=sys.stderr)
            return 2
        if not storage.is_remote(model.base_path) and not os.path.isdir(storage.local_path(model.base_path)):
            logger.warning("model base path does not exist yet; waiting for versions to appear",
                           extra={"fields": {"model": model.name, "model_base_path": model.base_path}})
    if protocols.grpc_socket_path:
        try:  # here, rather than in a worker once the models have loaded
            unix_socket.check_path(protocols.grpc_socket_path)
        except OSError as error:
            print(f"petal serve: {error}", file=sys.stderr)
            return 2
    taken = ports.taken_ports(protocols)
    claim, claimed_elsewhere = (None, "") if taken else ports.claim_grpc_port(protocols)
    if taken or claimed_elsewhere:
        print("\n".join(f"petal serve: {why}" for why in taken or [claimed_elsewhere]), file=sys.stderr)
        return 2
    print(f"petal serve: {banner(options)}", file=sys.stderr, flush=True)
    # Files only this server reads: the REST port's key pair, and what several workers share (a reload RPC's
    # config, prometheus_client's per-process metrics, which worker serves --grpc_socket_path, which has started).
    # mkdtemp's folder is private (mode 0700).
    runtime = tempfile.mkdtemp(prefix="petal-serve-")
    master = os.getpid()
    try:
        tls_files = write_key_pair(tls, runtime) if tls else None
        shared = runtime if options.process.workers > 1 else ""
        if shared:
            metrics.prepare_multiprocess(os.path.join(runtime, "metrics"))
        options = dataclasses.replace(options, process=dataclasses.replace(
            options.process, runtime_dir=runtime, reload_dir=shared, started_at=started))
        os.register_at_fork(before=_hold_stop_signals, after_in_parent=_release_stop_signals,
                            after_in_child=_stop_signals_until_the_worker_takes_them)
        gunicorn_util.write_error = _json_error_page
        PetalApplication(options, tls_files).run()
    except SystemExit as end:
        if os.getpid() != master:
            _end_worker(end.code)
        raise
    finally:  # the master's alone: a worker ended above
        worker_stderr.drain(STDERR_DRAIN_S)
        if protocols.grpc_socket_path:
            unix_socket.release(protocols.grpc_socket_path, runtime)
        shutil.rmtree(runtime, ignore_errors=True)
        if claim is not None:
            claim.close()
    return 0


def _end_worker(code: object) -> None:
    """A worker's end: gunicorn forks it inside `run()` and ends it with sys.exit, which came out of `run()` in the
    worker too, so the worker ran the master's clean-up: it deleted the server's private folder (the TLS key pair,
    the shared metrics) while the master and the other workers went on, and a new worker made it again readable by
    all. Then the interpreter's finalization ended TensorFlow's threads still running, a model load stopped by
    SIGTERM, say, and the process aborted (`terminate called after throwing an instance of ...`, SIGABRT). gunicorn's
    own end of a worker (its worker_exit hook included) has run by now: the worker's logs are flushed and it exits
    with gunicorn's code."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code if isinstance(code, int) else 0 if code is None else 1)


def banner(options: ServerOptions) -> str:
    """What the server loads and where it listens, said at once; the worker says when it is ready."""
    models = "; ".join(f"{m.name} from {m.base_path}" for m in options.dataplane.model_config.model_config_list.config)
    rest, grpc = listening_urls(options)
    grpc_on = f", gRPC on {' and '.join(grpc)}" if grpc else ""
    web_ui = "" if options.protocols.disable_web_ui else f"; web UI: {listening_urls(options, for_clients=True)[0]}/"
    return f"loading {models or 'no models'}; REST on {rest}{grpc_on}{web_ui}"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
