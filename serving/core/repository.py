"""The model repository: version discovery, load-before-unload transitions and in-flight tracking.

A background thread polls every model's base path. New aspired versions are loaded and warmed while the old ones
keep serving; only then are versions that are no longer aspired unloaded, after their in-flight requests finish.
A version that fails to load is reported END with its error and the versions below it stay candidates, so a
broken upload never takes a model down. It is retried when its files change: a plain `cp -r` can show
saved_model.pb before variables/ is complete, and must not leave that version dead until a restart.

The repository decides only *when* a version loads and unloads. *How* it loads is the loader it is given, TF
Serving's Loader in small: a function from (model name, version, folder) to the loaded and warmed version, which
raises if it cannot, the status to report as a ServingError (`load_failure`). The DataPlane passes the real one
(serving/core/servable.py `loader`, which alone knows TensorFlow's errors); a fake that succeeds, fails or hangs on
cue tests the transitions in milliseconds. After a pass that loaded or unloaded anything,
`settle_heap` runs (by default serving/core/heap.py's, which keeps GC pauses short with real models loaded).
The rules are TF Serving's: docs/protocols.md, 'Versions'.

A reload waits for the models new to its config as TF Serving's ServerCore::ReloadConfig does
(`wait_available`): every state change is counted, so that the wait looks only at the transitions after the config
was applied, as ServerCore's fresh ServableStateMonitor does.
"""
from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from tensorflow_serving.config import model_server_config_pb2

from serving.core import heap
from serving.core.errors import Code, ServingError, deadline_exceeded, failed_to_load, invalid, not_found, unavailable
from serving.core.policy import aspired_versions
from serving.core.source import ModelSource, Source
from serving.core.version_labels import check_version_labels
from serving.metrics import Metrics
from serving.threads import timeout_until

logger = logging.getLogger(__name__)

# How often a reload's wait looks whether its call has ended (the client cancelled, the server drains): a state
# change wakes it at once, an ending is only polled.
WAIT_SLICE_S = 0.25


class VersionState(enum.StrEnum):
    """TF Serving's ModelVersionStatus.State (get_model_status.proto) less UNKNOWN, which it never reports. Each
    value is the proto's name for it, which is what REST's status JSON says and gRPC's State.Value takes."""
    START = "START"
    LOADING = "LOADING"
    AVAILABLE = "AVAILABLE"
    UNLOADING = "UNLOADING"
    END = "END"


@dataclass
class VersionStatus:
    version: int
    state: VersionState
    error_code: str = "OK"
    error_message: str = ""


class LoadedVersion(Protocol):
    """What the repository reads of a version its loader made (the real one: serving/core/servable.py's `Servable`):
    only what its "version available" log line says of it."""

    @property
    def format(self) -> str: ...

    @property
    def warmup_records(self) -> int: ...


S = TypeVar("S", bound=LoadedVersion)
# The loader: (model name, version, folder) -> the version loaded and warmed up, ready to serve; raises otherwise
# (`load_failure`).
Load = Callable[[str, int, str], S]


def load_failure(error: Exception) -> ServingError:
    """A failed load's status. TF Serving keeps the status its loader returns as it is (core/loader_harness.cc
    `ErrorInternal`) and GetModelStatus reports it: a loader says it by raising a ServingError (the real one,
    serving/core/servable.py's `loader`, keeps a TensorFlow error's code and message). Anything else a loader raises
    is Petal's, UNKNOWN, said as "Failed to load: ..."."""
    return error if isinstance(error, ServingError) else failed_to_load(error)


def not_available_message(failed: dict[str, VersionStatus]) -> str:
    """ServerCore::WaitUntilModelsAvailable's error, `N model(s) did not become available: {{{name: M version: V}
    due to error: CODE: message}, }`: each version in braces, written as ServableId::DebugString writes it (in
    braces too), its error as an absl::Status prints, for a version that has one."""
    listed = ""
    for name, status in failed.items():
        error = "" if status.error_code == "OK" else f" due to error: {status.error_code}: {status.error_message}"
        listed += f"{{{{name: {name} version: {status.version}}}{error}}}, "
    return f"{len(failed)} model(s) did not become available: {{{listed}}}"


@dataclass
class _Version(Generic[S]):
    status: VersionStatus
    servable: S | None = None
    location: str = ""  # where the source found it (a folder, a URL)
    files: tuple = ()  # its source's fingerprint when its load began: a failed version is retried once this changes
    refs: int = 0  # requests in flight on it: an unload waits for them to finish
    changed: int = 0  # the repository's transition count when its status was last set


@dataclass
class _Model(Generic[S]):
    config: model_server_config_pb2.ModelConfig
    versions: dict[int, _Version[S]] = field(default_factory=dict)
    unreachable: str = ""  # why its base path could not be listed at the last poll; "" once it was


@dataclass(frozen=True)
class Reload:
    """A config handed to the repository: the models it lists that the running config did not, which are the ones
    a reload waits for (TF Serving's NewModelNamesInSourceConfig), and the transition count when it was applied."""
    new_models: tuple[str, ...]
    mark: int


class ServableHandle(Generic[S]):
    """A request's hold on the version it runs on, which an unload waits for, as TF Serving's ServableHandle is one:
    what `Repository.servable_handle` returns (a class rather than a generator: it is entered on every request, and a
    generator-based context manager costs six Python calls to this one's two)."""
    __slots__ = ("_repository", "_request", "_entry")

    def __init__(self, repository: Repository[S], name: str, version: int | None, label: str | None) -> None:
        self._repository = repository
        self._request = (name, version, label)
        self._entry: _Version[S] | None = None

    def __enter__(self) -> S:
        repository, (name, version, label) = self._repository, self._request
        version = repository.resolve_version(name, version, label)
        with repository._lock:
            self._entry, servable = repository._find(name, version)
            self._entry.refs += 1
        return servable

    def __exit__(self, *exc_info: object) -> None:
        entry = self._entry
        if entry is not None:
            with self._repository._lock:
                entry.refs -= 1
                if entry.refs == 0:
                    self._repository._lock.notify_all()  # an unload may be waiting for the last request


class Repository(Generic[S]):
    """Every model a worker serves, as versions its loader made. All public methods are thread-safe; loading
    happens on one poll thread, so a load that hangs holds up other loads (as TF Serving's --num_load_threads=0
    does) but never a request, a status or a readiness answer."""

    def __init__(self, config: model_server_config_pb2.ModelServerConfig, load: Load[S], metrics: Metrics,
                 poll_seconds: float = 1.0, on_unload: Callable[[str, int], None] | None = None,
                 drain_seconds: float = 30.0, settle_heap: Callable[[], object] = heap.settle,
                 allow_version_labels_for_unavailable_models: bool = False, source: Source | None = None):
        self._load_version = load
        self._source: Source = source or ModelSource()
        self._allow_unavailable_labels = allow_version_labels_for_unavailable_models
        self._metrics = metrics
        self._drain_seconds = drain_seconds
        self._poll_seconds = poll_seconds
        self._on_unload = on_unload
        self._settle_heap = settle_heap
        self._lock = threading.Condition()
        self._models: dict[str, _Model[S]] = {}
        self._transitions = 0  # every version state set so far (`_transition`)
        self._wake = threading.Event()
        self._stopped = False
        self._first_pass_done = False
        self._changed = False  # a version was loaded or unloaded in this pass
        self._thread: threading.Thread | None = None
        self._set_config(config)

    # --- lifecycle ---------------------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="petal-repository", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()

    def reload_config(self, config: model_server_config_pb2.ModelServerConfig) -> Reload:
        """Load the models listed, unload the ones left out (on the poll thread, after this returns); what to pass
        `wait_available`. The caller has checked the config (serving/options/config_files.py `check_model_config`). Its
        labels are checked here, against the versions AVAILABLE now, as TF Serving's ReloadConfig checks them before
        it adds a model (serving/core/version_labels.py): one refused fails the whole config,
        FAILED_PRECONDITION, and nothing changes, the labels in force included. The first config, given to the
        constructor, is checked at start (serving/process/flags.py), when no version is AVAILABLE."""
        with self._lock:
            available = {name: [v for v, e in model.versions.items() if e.status.state == VersionState.AVAILABLE]
                         for name, model in self._models.items()}
            try:
                check_version_labels(config, available, self.version_labels(), self._allow_unavailable_labels)
            except ValueError as error:
                raise ServingError(Code.FAILED_PRECONDITION, str(error)) from None
            reload = self._set_config(config)
        self._wake.set()
        return reload

    def wait_available(self, reload: Reload, deadline: float | None, ended: Callable[[], bool]) -> None:
        """Return once each model new to the reloaded config has an AVAILABLE version. As TF Serving's
        ServableStateMonitor::WaitUntilServablesReachStateWithTimeout, a model is settled by its first version to
        reach AVAILABLE or END after the reload, and once all are, an END one fails the wait: UNKNOWN, in
        ServerCore::WaitUntilModelsAvailable's words. Unlike TF Serving's (servable_state_waiter_timeout is infinite
        in tensorflow_model_server), the wait never outlives its caller: DEADLINE_EXCEEDED at `deadline`
        (time.monotonic(); None: none), UNAVAILABLE once `ended()` says so (the call was cancelled, the worker
        drains) or the repository stops. A model that a later config left out is no longer waited for."""
        with self._lock:
            while True:
                settled = {name: self._settled(name, reload.mark) for name in reload.new_models}
                waiting = [name for name, (done, _) in settled.items() if not done]
                if not waiting:
                    break
                if self._stopped or ended():
                    raise unavailable(f"Stopped waiting for model(s) {', '.join(waiting)} to become available: the "
                                      "call ended or the server is stopping")
                left = timeout_until(deadline)
                if left is not None and left <= 0:
                    raise deadline_exceeded(f"Deadline exceeded waiting for model(s) {', '.join(waiting)} to become "
                                            "available")
                self._lock.wait(WAIT_SLICE_S if left is None else min(WAIT_SLICE_S, left))
        failed = {name: status for name, (_, status) in sorted(settled.items()) if status is not None}
        if failed:
            raise ServingError(Code.UNKNOWN, not_available_message(failed))

    def _settled(self, name: str, mark: int) -> tuple[bool, VersionStatus | None]:
        """Whether a model a reload waits for is settled, and if so without an AVAILABLE version, the END status
        that settled it (the first version to end after `mark`). The lock is held."""
        model = self._models.get(name)
        if model is None or model.config is None:
            return True, None
        if any(entry.status.state == VersionState.AVAILABLE for entry in model.versions.values()):
            return True, None
        ended = [entry for entry in model.versions.values()
                 if entry.changed > mark and entry.status.state == VersionState.END]
        return (True, min(ended, key=lambda entry: entry.changed).status) if ended else (False, None)

    def wait_first_pass(self) -> None:
        """Block until the startup pass has loaded, warmed or failed every version it aspired to."""
        with self._lock:
            self._lock.wait_for(lambda: self._first_pass_done)

    def poll_now(self) -> None:
        """One synchronous discovery-and-transition pass (the poll thread calls this on every tick)."""
        with self._lock:
            models = list(self._models.items())
        for name, model in models:
            self._reconcile(name, model)
        self._unload_removed()
        if self._changed:
            self._changed = False
            self._settle_heap()
        with self._lock:
            self._first_pass_done = True
            self._lock.notify_all()

    def _loop(self) -> None:
        while not self._stopped:
            try:
                self.poll_now()
            except Exception:  # the poll thread must survive anything a file system throws at it
                logger.exception("repository poll failed")
            if self._poll_seconds > 0:
                self._wake.wait(self._poll_seconds)
            else:
                self._wake.wait()
            self._wake.clear()

    def _set_config(self, config: model_server_config_pb2.ModelServerConfig) -> Reload:
        with self._lock:
            wanted = {m.name: m for m in config.model_config_list.config}
            new = tuple(name for name in wanted if name not in self._models or self._models[name].config is None)
            for name, model_config in wanted.items():
                model = self._models.get(name)
                if model is None:
                    self._models[name] = _Model(config=model_config)
                    continue
                if model.config is None:
                    # Listed again after its removal: a new TF Serving source would try every version afresh, a
                    # failed one included.
                    for entry in model.versions.values():
                        entry.files = ()
                model.config = model_config
            for name, model in self._models.items():
                if name not in wanted:
                    model.config = None
            return Reload(new_models=new, mark=self._transitions)

    # --- transitions -------------------------------------------------------------------------------------------

    def _reconcile(self, name: str, model: _Model[S]) -> None:
        config = model.config
        if config is None:
            return
        with self._lock:
            failed = {v: entry.files for v, entry in model.versions.items() if entry.status.error_code != "OK"}
        try:
            found = self._source.versions(config.base_path)
        except OSError as error:  # the store is away: what is loaded keeps serving, nothing is unloaded
            self._unreachable(name, model, str(error))
            return
        self._unreachable(name, model, "")
        candidates = {v: location for v, location in found.items()
                      if v not in failed or self._source.fingerprint(location) != failed[v]}
        aspired = aspired_versions(config.model_version_policy, list(candidates))
        for version in sorted(aspired, reverse=True):
            with self._lock:
                entry = model.versions.get(version)
                if entry is not None and entry.status.state in (VersionState.LOADING, VersionState.AVAILABLE):
                    continue
            self._load(name, model, version, candidates[version])
        with self._lock:
            if not any(model.versions[v].status.state == VersionState.AVAILABLE
                       for v in aspired if v in model.versions):
                return  # never unload the versions that are serving before a wanted one is AVAILABLE
            retiring = [v for v, e in model.versions.items()
                        if e.status.state == VersionState.AVAILABLE and v not in aspired]
        for version in retiring:
            self._unload(name, model, version)

    def _unreachable(self, name: str, model: _Model[S], why: str) -> None:
        """Note whether a model's base path could be listed: said once when it cannot be, once when it can again,
        and shown by a metric in between."""
        with self._lock:
            was, model.unreachable = model.unreachable, why
        self._metrics.source_reachable.set(0 if why else 1, model_name=name)
        if bool(was) == bool(why):
            return
        if why:
            self._metrics.source_errors.inc(model_name=name)
            logger.warning("model versions cannot be listed; the loaded versions keep serving",
                           extra={"fields": {"model": name, "error": why}})
        else:
            logger.warning("model versions listed again", extra={"fields": {"model": name}})

    def _load(self, name: str, model: _Model[S], version: int, location: str) -> None:
        self._changed = True
        entry: _Version[S] = _Version(VersionStatus(version, VersionState.LOADING), location=location,
                                      files=self._source.fingerprint(location))
        with self._lock:
            retry = model.versions.get(version)
            if retry is not None and retry.status.error_code != "OK":
                logger.info("retrying a failed version whose files changed",
                            extra={"fields": {"model": name, "version": version}})
            model.versions[version] = entry
            self._transition(entry, entry.status)
        started = time.monotonic()
        try:
            folder = self._source.fetch(location)
        except OSError as error:  # the copy did not arrive whole: tried again at the next poll
            entry.files = ()
            self._failed(name, entry, "UNAVAILABLE", str(error), retry)
            return
        try:
            servable = self._load_version(name, version, folder)
        except Exception as error:
            self._source.release(location)
            failure = load_failure(error)
            self._failed(name, entry, failure.code.name, failure.message, retry)
            return
        elapsed = time.monotonic() - started
        self._metrics.load_latency.observe(elapsed * 1e6, model_name=name)
        self._metrics.loaded_versions.set(1, model_name=name, version=str(version))
        with self._lock:
            entry.servable = servable
            self._transition(entry, VersionStatus(version, VersionState.AVAILABLE))
        logger.info("version available", extra={"fields": {"model": name, "version": version, "path": location,
                                                         "format": servable.format,
                                                         "load_seconds": round(elapsed, 3),
                                                         "warmup": servable.warmup_records}})

    def _failed(self, name: str, entry: _Version[S], code: str, message: str, before: _Version[S] | None) -> None:
        """A version that did not load: END with why, logged unless it failed just so the last time."""
        version = entry.status.version
        if before is None or before.status.error_message != message:
            logger.warning("version failed to load", extra={"fields": {"model": name, "version": version,
                                                                     "code": code, "error": message}})
        with self._lock:
            self._transition(entry, VersionStatus(version, VersionState.END, code, message))

    def _unload(self, name: str, model: _Model[S], version: int) -> None:
        """Retire a version once its requests in flight finish, waiting at most --graceful_timeout for them."""
        self._changed = True
        with self._lock:
            entry = model.versions[version]
            self._transition(entry, VersionStatus(version, VersionState.UNLOADING))
            deadline = time.monotonic() + self._drain_seconds
            while entry.refs > 0 and (left := deadline - time.monotonic()) > 0:
                self._lock.wait(left)
            entry.servable = None
            self._transition(entry, VersionStatus(version, VersionState.END))
        self._source.release(entry.location)
        self._metrics.loaded_versions.remove(model_name=name, version=str(version))
        if self._on_unload is not None:
            self._on_unload(name, version)
        logger.info("version unloaded", extra={"fields": {"model": name, "version": version}})

    def _transition(self, entry: _Version[S], status: VersionStatus) -> None:
        """Set a version's state, the lock held: counted, so that a reload tells the transitions after it from the
        ones before, and announced to whoever waits for one."""
        self._transitions += 1
        entry.status, entry.changed = status, self._transitions
        self._lock.notify_all()

    def _unload_removed(self) -> None:
        """Unload the versions of the models a config left out. Their states stay, END from then on: TF Serving's
        ServableStateMonitor never forgets a version's last state (core/servable_state_monitor.cc; ServerCore never
        calls ForgetUnloadedServableStates), so the status of a removed model lists its versions as END rather than
        answering NOT_FOUND."""
        with self._lock:
            removed = [(n, m) for n, m in self._models.items() if m.config is None]
        for name, model in removed:
            for version, entry in list(model.versions.items()):
                if entry.status.state == VersionState.AVAILABLE:
                    self._unload(name, model, version)

    # --- queries -----------------------------------------------------------------------------------------------

    def model_names(self) -> list[str]:
        with self._lock:
            return sorted(n for n, m in self._models.items() if m.config is not None)

    def ready(self) -> bool:
        """Every configured model has an AVAILABLE (hence warmed) version."""
        with self._lock:
            return self._ready_locked()

    def _ready_locked(self) -> bool:
        """Like TF Serving, not ready until the first pass has loaded every version aspired at startup."""
        if not self._first_pass_done:
            return False
        configured = [m for m in self._models.values() if m.config is not None]
        return bool(configured) and all(
            any(e.status.state == VersionState.AVAILABLE for e in m.versions.values()) for m in configured)

    def _model(self, name: str) -> _Model[S]:
        model = self._models.get(name)
        if model is None or model.config is None:
            raise not_found(f"Could not find any versions of model {name}")
        return model

    @staticmethod
    def _no_versions(name: str, model: _Model[S] | None) -> ServingError:
        """TF Serving's NOT_FOUND for a model with no version, and why, when its base path cannot be listed."""
        why = f": {model.unreachable}" if model is not None and model.unreachable else ""
        return not_found(f"Could not find any versions of model {name}{why}")

    def resolve_version(self, name: str, version: int | None = None, label: str | None = None) -> int | None:
        """The version a request names (by number or label); None means the latest AVAILABLE."""
        if label is None:
            return version
        with self._lock:
            labels = self._model(name).config.version_labels
        if label not in labels:
            raise invalid(f"Unrecognized servable version label: {label}")
        return int(labels[label])

    def version_labels(self) -> dict[str, dict[str, int]]:
        """Each configured model's labels ("stable", "canary") and the versions they name, read in one go."""
        with self._lock:
            return {name: {label: int(v) for label, v in sorted(m.config.version_labels.items())}
                    for name, m in sorted(self._models.items()) if m.config is not None}

    def status(self, name: str, version: int | None = None, label: str | None = None) -> list[VersionStatus]:
        """Every version's last state, newest first, or the one named: TF Serving's GetModelStatus reads them from
        its ServableStateMonitor (model_servers/get_model_status_impl.cc), which keeps a removed model's versions,
        END, so they are answered here too."""
        version = self.resolve_version(name, version, label)
        with self._lock:
            model = self._models.get(name)
            versions = model.versions if model is not None else {}
            if version is not None:
                entry = versions.get(version)
                if entry is None:
                    raise not_found(f"Could not find version {version} of model {name}")
                return [entry.status]
            if not versions:
                raise self._no_versions(name, model)
            return [versions[v].status for v in sorted(versions, reverse=True)]

    def servable_handle(self, name: str, version: int | None = None, label: str | None = None) -> ServableHandle[S]:
        """The servable a request runs on, held by a `with` block so that an unload waits for the request to
        finish."""
        return ServableHandle(self, name, version, label)


    def _find(self, name: str, version: int | None) -> tuple[_Version[S], S]:
        model = self._models.get(name)
        if model is not None and model.config is not None:
            available = {v: (e, e.servable) for v, e in model.versions.items()
                         if e.status.state == VersionState.AVAILABLE and e.servable is not None}
            if version is None and available:
                return available[max(available)]
            if version in available:
                return available[version]
            if version is None and any(e.status.state == VersionState.LOADING for e in model.versions.values()):
                raise unavailable(f"Model {name} is loading; retry shortly")
        spec = f"Latest({name})" if version is None else f"Specific({name}, {version})"
        raise not_found(f"Servable not found for request: {spec}")

    def model_ready(self, name: str, version: int | None = None) -> bool:
        with self._lock:
            model = self._models.get(name)
            if model is None or model.config is None:
                return False
            if version is None:
                return any(e.status.state == VersionState.AVAILABLE for e in model.versions.values())
            entry = model.versions.get(version)
            return entry is not None and entry.status.state == VersionState.AVAILABLE
