"""One serving worker process's life, owned by one `Worker`, as TF Serving's ServerCore owns its server's: start,
the initial load, the ports, reloads, the drain and the exit.

gunicorn forks the worker processes; in each, serving/process/server.py's gunicorn hooks and its SIGTERM handler call
the process's `Worker` and nothing else:

- `start` (gunicorn loading the app): TensorFlow's runtime set up (serving/process/tensorflow_runtime.py), the DataPlane
  built on the model config the options hold, its initial load begun in the background, the watches on
  --model_config_file and on what a sibling's reload RPC publishes; it returns the REST app.
- `serve` (gunicorn's post_worker_init): with several workers, the load waited for before the REST port accepts;
  gRPC opened once the load is over (serving/core/startup.py), and the line that says the server is ready.
- `reload`: the reload RPC and the watches apply a config through it, and it returns once the models new to the
  config are AVAILABLE in this worker, as TF Serving's ReloadConfig does; with several workers it is passed on.
- `drain` (SIGTERM): readiness false, gRPC refuses new RPCs and lets running ones finish within
  --graceful_timeout, and the REST port stops accepting while its requests in flight finish.
- `exit` (gunicorn's worker_exit): gRPC stopped, the DataPlane closed.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from google.protobuf import text_format
from gunicorn.arbiter import Arbiter
from tensorflow_serving.config import model_server_config_pb2

from serving.core import Code, DataPlane, ServingError, Startup, VersionState, pooled_bytes
from serving.host.memory import allocate_within_a_budget
from serving.options.config import ServerOptions, listening_urls
from serving.options.config_files import read_model_config
from serving.process.memory_budget import budget_after_load, measures_memory_budget, resolve_memory_budget
from serving.process.tensorflow_runtime import configure_tensorflow
from serving.process.worker_stderr import say
from serving.protocols.grpc_api import server as grpc_server
from serving.protocols.rest.app import create_app

if TYPE_CHECKING:
    import grpc
    from flask import Flask

logger = logging.getLogger(__name__)

RELOAD_FILE = "model_config.pbtxt"
RELOAD_POLL_S = 0.5
STARTED_DIR = "started"  # in the server's runtime folder: a file per worker whose initial load is over
ANNOUNCED_FILE = "announced"  # made by the one worker that says the server is ready
READY_POLL_S = 1.0


def serves_grpc(options: ServerOptions) -> bool:
    return bool(options.protocols.port or options.protocols.grpc_socket_path)


class Worker:
    """One worker process's serving life. `create_dataplane` is DataPlane.create's signature; `announce` takes the
    lines that say the server is ready, or why a model is not."""

    def __init__(self, options: ServerOptions, create_dataplane: Callable[..., DataPlane] = DataPlane.create,
                 announce: Callable[[str], None] = say) -> None:
        self.options = options
        self.startup = Startup(ports=int(serves_grpc(options)))
        self._create_dataplane = create_dataplane
        self._announce = announce
        self._dataplane: DataPlane | None = None
        self._grpc: grpc.Server | None = None
        self._stop_rest: Callable[[], None] = lambda: None
        # set by `drain`; the background threads wait on it (a native wait: under gevent none of them may start an
        # event loop of its own)
        self._stopping = threading.Event()

    @property
    def dataplane(self) -> DataPlane:
        if self._dataplane is None:
            raise RuntimeError("the worker has not started")
        return self._dataplane

    # --- start ----------------------------------------------------------------------------------------------------

    def start(self) -> Flask:
        """Build this process's DataPlane and start loading its models in the background (readiness reports
        progress); it has started once they have loaded and gRPC is open (`serve`). Returns the REST app.

        A derived memory budget is, in a cgroup, measured once the initial load and warmup are over (what the server
        then holds, page cache included, is known only then) and before the worker admits a request; until then the
        budget refuses bodies. Without a cgroup it is the estimate's, known at once (serving/process/server.py logs it).
        """
        options = self.options
        budget, pixels = resolve_memory_budget(options)
        if budget > 0:  # before TensorFlow's threads allocate: the budget counts what is freed as returned
            allocate_within_a_budget()
        configure_tensorflow(options)
        dataplane = dataclasses.replace(options.dataplane, memory_budget_bytes=budget, max_inflight_pixels=pixels)
        measured = (functools.partial(budget_after_load, options, pooled_bytes) if measures_memory_budget(options)
                    else None)
        self._dataplane = self._create_dataplane(dataplane, self.startup,
                                                 drain_seconds=options.process.graceful_timeout,
                                                 budget_after_load=measured)
        self._watch_configs()
        return create_app(self._dataplane, options.protocols, options.security)

    def _watch_configs(self) -> None:
        """Re-read --model_config_file every --model_config_file_poll_wait_seconds, starting from the config the
        DataPlane started with (read once, at start), so that an edit made since is applied at the first look.
        With several workers, a reload RPC reaches one of them, which publishes the config in their shared folder,
        which every worker watches the same way."""
        process = self.options.process
        if process.model_config_file and process.model_config_file_poll_wait_seconds > 0:
            started_with = self.options.dataplane.model_config.SerializeToString(deterministic=True)
            self._watch(process.model_config_file, process.model_config_file_poll_wait_seconds, started_with)
        if process.reload_dir:
            self._watch(os.path.join(process.reload_dir, RELOAD_FILE), RELOAD_POLL_S, b"")

    def _watch(self, path: str, seconds: float, last: bytes) -> None:
        threading.Thread(target=self._watch_config, args=(path, seconds, last), name="petal-config",
                         daemon=True).start()

    # --- serve ----------------------------------------------------------------------------------------------------

    def serve(self, stop_rest: Callable[[], None] = lambda: None) -> None:
        """The REST port is about to accept (`stop_rest` stops it, for `drain`): with several workers sharing it,
        wait for the models first, so that no request waits in a worker still loading while its siblings serve
        (/healthz is up with the first); then open gRPC once the load is over, in the background."""
        self._stop_rest = stop_rest
        if self.options.process.workers > 1:
            self.dataplane.wait_loaded()
        threading.Thread(target=self._open_ports, name="petal-start", daemon=True).start()

    def _open_ports(self) -> None:
        """gRPC bound only once the initial load is over, as TF Serving does: a client that waits for the port and
        then calls finds every configured model loaded. Until it is bound it holds the startup gate, so /readyz is
        not 200 before a gRPC client could connect."""
        dataplane, options = self.dataplane, self.options
        dataplane.wait_loaded()
        if serves_grpc(options):
            try:
                if not self.startup.draining:
                    self._grpc = grpc_server.start(dataplane, options.protocols, options.security,
                                                   options.process.runtime_dir, reload=self.reload)
            except Exception:  # a port in use, say: fail the way a worker that cannot boot does, stopping the server
                logger.exception("gRPC failed to start")
                os._exit(Arbiter.WORKER_BOOT_ERROR)
            finally:
                self.startup.port_opened()
            if self.startup.draining:  # a SIGTERM that came while it bound found no server to stop
                self._stop_grpc()
        logger.info("worker started", extra={"fields": {"pid": os.getpid(), "grpc_port": options.protocols.port}})
        if self._last_to_start():
            self._report_start()

    def _last_to_start(self) -> bool:
        """Whether this worker is the one to say that the server has started: the first whose load is over when
        every worker's is (each marks itself in the server's runtime folder); without that folder, this one."""
        folder = self.options.process.runtime_dir
        if not folder:
            return True
        started = os.path.join(folder, STARTED_DIR)
        os.makedirs(started, exist_ok=True)
        open(os.path.join(started, str(os.getpid())), "w").close()
        if len(os.listdir(started)) < self.options.process.workers:
            return False
        try:
            os.close(os.open(os.path.join(folder, ANNOUNCED_FILE), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return False
        return True

    def _report_start(self) -> None:
        """`ready: flowers v1 on http://localhost:8501 and grpc://localhost:8500 in 4.2 s`, or first a line per model
        that has no version to serve, saying why, and the ready line once one has loaded."""
        dataplane = self.dataplane
        if not dataplane.ready():
            for line in not_ready_lines(dataplane):
                self._announce(line)
            while not dataplane.ready():
                if self._stopping.wait(READY_POLL_S):
                    return
        self._announce(ready_line(dataplane, self.options))

    # --- reload ---------------------------------------------------------------------------------------------------

    def reload(self, config: model_server_config_pb2.ModelServerConfig, deadline: float | None = None,
               ended: Callable[[], bool] = lambda: False, publish: bool = True) -> None:
        """Serve these models from now on, returning once each model new to the config is AVAILABLE in this worker,
        or failing as DataPlane.reload_config says (the reload RPC; INVALID_ARGUMENT for a config that breaks a
        rule). The wait ends at `deadline`, once `ended()` or once the worker drains. `publish` passes the config on
        to the other workers, if any, as soon as it is taken: they load alongside this one, and are not waited
        for."""
        def applied() -> None:
            if publish and self.options.process.reload_dir:
                publish_config(os.path.join(self.options.process.reload_dir, RELOAD_FILE), config)

        self.dataplane.reload_config(config, deadline, lambda: self._stopping.is_set() or ended(), applied)

    def _watch_config(self, path: str, seconds: float, last: bytes) -> None:
        """Re-read a config file; a broken one is logged and the running config kept, and so is a refused one, each
        once. One whose labels name a version not AVAILABLE is tried again at every look, as TF Serving's poll calls
        ReloadConfig each time, so that it is taken once the version is (a sibling worker's, which loads alongside
        the worker that published it, usually is a moment later). A changed one is applied and its new models waited
        for up to one poll interval, so that a model that failed to load is logged in TF Serving's words; one still
        loading then is left to load while the watch goes on. (TF Serving's poll thread waits in ReloadConfig without
        a limit: a new model with no version on disk stops its polling, and its reload RPCs, until one comes.)"""
        logged = ""  # the last problem logged: the same one seen at the next look is not logged again
        while not self._stopping.wait(seconds):
            if not last and not os.path.exists(path):  # a sibling's reload file, which may never come
                continue
            try:
                config = read_model_config(path)
            except Exception as error:
                if str(error) != logged:
                    logger.warning("model config file unreadable; keeping the current one",
                                   extra={"fields": {"path": path, "error": str(error)}})
                logged = str(error)
                continue
            text = config.SerializeToString(deterministic=True)
            if text == last:
                continue
            fields: dict[str, object] = {"path": path}
            try:
                self.reload(config, time.monotonic() + seconds, publish=False)
            except ServingError as error:
                fields["error"] = error.message
                # INVALID_ARGUMENT: check_model_config (a base path outside --model_root, say); FAILED_PRECONDITION:
                # check_version_labels, looked at again next time, when the version may be AVAILABLE
                if error.code in (Code.INVALID_ARGUMENT, Code.FAILED_PRECONDITION):
                    if error.message != logged:
                        logger.warning("model config refused; keeping the current one", extra={"fields": fields})
                    logged = error.message
                    if error.code == Code.INVALID_ARGUMENT:
                        last = text  # refused for good: looked at again once the file changes
                    continue
                elif error.code == Code.UNKNOWN:
                    logger.warning("model config reloaded; a new model did not become available",
                                   extra={"fields": fields})
                else:  # the wait's deadline, or the drain
                    logger.info("model config reloaded; new models still loading", extra={"fields": fields})
            else:
                fields["models"] = self.dataplane.model_names()
                logger.info("model config reloaded", extra={"fields": fields})
            logged, last = "", text

    # --- drain and exit -------------------------------------------------------------------------------------------

    def on_sigterm(self, signum: int, frame: object) -> None:
        """The worker's SIGTERM handler. Under gevent it runs on the event loop, where a blocking call is not
        allowed, so gRPC's stop runs in a greenlet of its own."""
        self.drain(on_event_loop=self.options.process.worker_class == "gevent")

    def drain(self, on_event_loop: bool = False) -> None:
        """Readiness turns false so load balancers stop sending; gRPC refuses new RPCs and lets running ones finish
        within --graceful_timeout; the REST port stops accepting, its requests in flight finish."""
        self.startup.drain()
        self._stopping.set()
        if on_event_loop and self._grpc is not None:
            import gevent
            gevent.spawn(self._stop_grpc)
        else:
            self._stop_grpc()
        self._stop_rest()

    def _stop_grpc(self) -> threading.Event | None:
        """Refuse new RPCs now and let running ones finish within --graceful_timeout; the event is set once gRPC has
        stopped (None: there is no gRPC server)."""
        return None if self._grpc is None else self._grpc.stop(self.options.process.graceful_timeout)

    def exit(self) -> None:
        """The worker process ends (gunicorn's worker_exit, after the REST port's drain): gRPC's drain is waited for
        up to --graceful_timeout, then the DataPlane stops its threads."""
        stopped = self._stop_grpc()
        if stopped is not None:
            stopped.wait(self.options.process.graceful_timeout)
        if self._dataplane is not None:
            self._dataplane.close()


def publish_config(path: str, config: model_server_config_pb2.ModelServerConfig) -> None:
    """Write the config where every worker looks, in one rename, so no worker reads half a file."""
    staging = f"{path}.{os.getpid()}.tmp"
    with open(staging, "w") as f:
        f.write(text_format.MessageToString(config))
    os.replace(staging, path)


def ready_line(dataplane: DataPlane, options: ServerOptions) -> str:
    """Every model with the versions it serves, where, and how long the server took to start."""
    models = ", ".join(f"{name} " + " ".join(f"v{v}" for v in sorted(dataplane.available_versions(name)))
                       for name in dataplane.model_names())
    rest, grpc = listening_urls(options, for_clients=True)
    ports = [rest, *grpc]
    started = options.process.started_at
    took = f" in {time.monotonic() - started:.1f} s" if started else ""
    return f"ready: {models} on {', '.join(ports[:-1])}{' and ' if len(ports) > 1 else ''}{ports[-1]}{took}"


def not_ready_lines(dataplane: DataPlane) -> list[str]:
    """One line per model that has no version to serve: each version that failed to load with why, or that none
    is on disk yet."""
    lines = []
    for name in dataplane.model_names():
        try:
            statuses = dataplane.status(name)
        except ServingError as error:  # configured, but no version on disk yet
            lines.append(f"not ready: {name}: {error.message}")
            continue
        if any(s.state == VersionState.AVAILABLE for s in statuses):
            continue
        failed = [f"v{s.version} {' '.join(s.error_message.split())}" for s in statuses if s.error_message]
        lines.append(f"not ready: {name} {'; '.join(failed) or 'has no version loaded yet'}")
    return lines
