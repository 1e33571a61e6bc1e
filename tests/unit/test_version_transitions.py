"""The repository's version transitions in milliseconds, on a loader that succeeds, fails and hangs on cue.

The repository is the real one and so is its file-system source: a version is a folder holding an empty
saved_model.pb, which is all the source looks for. Only the loader is a fake, through the seam the DataPlane
passes the real one through (serving/core/servable.py `loader`). The same transitions on real SavedModels, and
over the wire, are tests/e2e/test_repository.py, test_rest_lifecycle.py and test_grpc.py's config reload.
"""
from __future__ import annotations

import shutil
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from google.protobuf import text_format
from tensorflow_serving.config import model_server_config_pb2

from serving.core.errors import Code, ServingError
from serving.core.repository import Repository, VersionState, VersionStatus
from serving.metrics import Metrics

AVAILABLE, LOADING, UNLOADING, END = (VersionState.AVAILABLE, VersionState.LOADING, VersionState.UNLOADING,
                                      VersionState.END)
WAIT = 5.0  # the longest any step may take before the test fails; each takes milliseconds


@dataclass
class FakeVersion:
    """A loaded version as the fake loader makes it: what the repository reads of one, and who it is."""
    model: str
    version: int
    format: str = "fake"
    warmup_records: int = 0


@dataclass
class Gate:
    """Holds a load until released: `entered` says the load has begun."""
    entered: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)


class Models:
    """A base folder of models, a loader that fails and hangs on cue, and the repository over both.

    `events` is the order things happened in: "loaded m 2" when a load returns (the real loader has warmed the
    version up by then), "unloaded m 1" when the repository has let a version go, "settled" after a pass that
    changed anything.
    """

    def __init__(self, base: Path):
        self.base = base
        self.events: list[str] = []
        self.failures: dict[tuple[str, int], Exception] = {}
        self.gates: dict[tuple[str, int], Gate] = {}
        self.metrics = Metrics()

    def publish(self, model: str, *versions: int) -> None:
        for version in versions:
            folder = self.base / model / str(version)
            folder.mkdir(parents=True)
            (folder / "saved_model.pb").write_bytes(b"")

    def fail(self, model: str, version: int, error: Exception) -> None:
        self.failures[(model, version)] = error

    def hang(self, model: str, version: int) -> Gate:
        gate = self.gates[(model, version)] = Gate()
        return gate

    def load(self, model: str, version: int, path: str) -> FakeVersion:
        assert path == str(self.base / model / str(version))
        gate = self.gates.pop((model, version), None)
        if gate is not None:
            gate.entered.set()
            assert gate.release.wait(WAIT), "a hung load was never released"
        error = self.failures.get((model, version))
        if error is not None:
            self.events.append(f"failed {model} {version}")
            raise error
        self.events.append(f"loaded {model} {version}")
        return FakeVersion(model, version)

    def unloaded(self, model: str, version: int) -> None:
        self.events.append(f"unloaded {model} {version}")

    def settled(self) -> None:
        self.events.append("settled")

    def config(self, **models: str) -> model_server_config_pb2.ModelServerConfig:
        """Each keyword a model under the base folder, its value the rest of its ModelConfig in text format."""
        entries = "".join(f'config {{ name: "{name}" base_path: "{self.base / name}" model_platform: "tensorflow" '
                          f'{extra} }} ' for name, extra in models.items())
        return text_format.Parse(f"model_config_list {{ {entries} }}", model_server_config_pb2.ModelServerConfig())

    def repository(self, drain_seconds: float = WAIT, poll_seconds: float = 0, allow_unavailable_labels: bool = False,
                   **models: str) -> Repository:
        return Repository(self.config(**models), self.load, self.metrics, poll_seconds=poll_seconds,
                          on_unload=self.unloaded, drain_seconds=drain_seconds, settle_heap=self.settled,
                          allow_version_labels_for_unavailable_models=allow_unavailable_labels)


@pytest.fixture
def models(tmp_path) -> Models:
    return Models(tmp_path)


def states(repo: Repository, model: str = "m") -> dict[int, VersionState]:
    return {s.version: s.state for s in repo.status(model)}


def served(repo: Repository, model: str = "m", **spec) -> int:
    with repo.servable_handle(model, **spec) as version:
        return version.version


def refusal(call, *args, **kwargs) -> tuple[Code, str]:
    with pytest.raises(ServingError) as info:
        call(*args, **kwargs)
    return info.value.code, info.value.message


def not_served(repo: Repository, model: str = "m", **spec) -> tuple[Code, str]:
    return refusal(lambda: served(repo, model, **spec))


def wait_until(predicate) -> None:
    deadline = time.monotonic() + WAIT
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def in_background(call) -> threading.Thread:
    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    return thread


# --- version policies -------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("policy", "loaded"), [
    ("", [3]),
    ("model_version_policy { latest { num_versions: 2 } }", [3, 2]),
    ("model_version_policy { all {} }", [3, 2, 1]),
    ("model_version_policy { specific { versions: 1 versions: 3 versions: 5 } }", [3, 1]),
], ids=["latest by default", "latest 2", "all", "specific, one of them missing"])
def test_a_policy_loads_its_versions_newest_first_and_no_other(models, policy, loaded):
    models.publish("m", 1, 2, 3)
    repo = models.repository(m=policy)
    repo.poll_now()
    assert models.events == [f"loaded m {v}" for v in loaded] + ["settled"]
    assert states(repo) == dict.fromkeys(loaded, AVAILABLE) and repo.ready()
    assert served(repo) == max(loaded)
    for version in {1, 2, 3} - set(loaded):
        assert not_served(repo, version=version) == (
            Code.NOT_FOUND, f"Servable not found for request: Specific(m, {version})")


def test_latest_n_follows_new_versions_and_unloads_the_oldest(models):
    models.publish("m", 1, 2)
    repo = models.repository(m="model_version_policy { latest { num_versions: 2 } }")
    repo.poll_now()
    models.publish("m", 3)
    repo.poll_now()
    assert states(repo) == {3: AVAILABLE, 2: AVAILABLE, 1: END}
    assert models.events[-3:] == ["loaded m 3", "unloaded m 1", "settled"]


def test_a_new_policy_in_a_reloaded_config_loads_and_unloads_accordingly(models):
    models.publish("m", 1, 2, 3)
    repo = models.repository(m="model_version_policy { all {} }")
    repo.poll_now()
    repo.reload_config(models.config(m="model_version_policy { specific { versions: 1 } }"))
    repo.poll_now()
    assert states(repo) == {3: END, 2: END, 1: AVAILABLE}
    repo.reload_config(models.config(m=""))
    repo.poll_now()
    assert states(repo) == {3: AVAILABLE, 2: END, 1: END}
    assert models.events.count("loaded m 3") == 2, "an unloaded version loads again when it is aspired again"


# --- labels -----------------------------------------------------------------------------------------------------

def test_labels_name_their_versions_for_requests_and_status(models):
    models.publish("m", 1, 2)
    repo = models.repository(m='model_version_policy { all {} } version_labels { key: "stable" value: 1 } '
                               'version_labels { key: "canary" value: 2 }')
    repo.poll_now()
    assert served(repo, label="stable") == 1 and served(repo, label="canary") == 2 and served(repo) == 2
    assert repo.status("m", label="canary") == [VersionStatus(2, AVAILABLE)]
    assert repo.version_labels() == {"m": {"canary": 2, "stable": 1}}
    unknown = (Code.INVALID_ARGUMENT, "Unrecognized servable version label: beta")
    assert not_served(repo, label="beta") == unknown and refusal(repo.status, "m", label="beta") == unknown


def test_a_label_may_name_a_version_not_loaded_and_serves_it_once_it_is(models):
    """With --allow_version_labels_for_unavailable_models=true (the first config's labels are checked at start,
    serving/process/flags.py): the label is accepted, a request by it is NOT_FOUND like a request for that version
    number, until the version loads."""
    models.publish("m", 1)
    repo = models.repository(allow_unavailable_labels=True,
                             m='model_version_policy { all {} } version_labels { key: "canary" value: 2 }')
    repo.poll_now()
    assert not_served(repo, label="canary") == (Code.NOT_FOUND, "Servable not found for request: Specific(m, 2)")
    assert refusal(repo.status, "m", label="canary") == (Code.NOT_FOUND, "Could not find version 2 of model m")
    assert served(repo) == 1
    models.publish("m", 2)
    repo.poll_now()
    assert served(repo, label="canary") == 2


def test_a_label_on_a_version_the_policy_does_not_serve_is_not_found(models):
    models.publish("m", 1, 2)
    repo = models.repository(m='version_labels { key: "stable" value: 1 }')
    repo.poll_now()
    assert not_served(repo, label="stable") == (Code.NOT_FOUND, "Servable not found for request: Specific(m, 1)")


def not_available(version: int, model: str = "m") -> tuple[Code, str]:
    """ServerCore::UpdateModelVersionLabelMap's refusal of a label on a version that is not AVAILABLE."""
    return (Code.FAILED_PRECONDITION,
            f"Request to assign label to version {version} of model {model}, which is not currently available for "
            "inference")


def test_a_reload_labelling_a_version_not_available_is_refused_and_changes_nothing(models):
    """TF Serving checks labels against the versions AVAILABLE when the config arrives, before it adds anything:
    version 2 is on disk, and the refused config would load it, but it is not AVAILABLE yet."""
    models.publish("m", 1, 2)
    repo = models.repository(m='model_version_policy { specific { versions: 1 } } '
                               'version_labels { key: "stable" value: 1 }')
    repo.poll_now()
    for labels, version in (('version_labels { key: "stable" value: 1 } version_labels { key: "canary" value: 2 }', 2),
                            ('version_labels { key: "stable" value: 2 }', 2),  # moved to a version not loaded yet
                            ('version_labels { key: "stable" value: 9 }', 9)):  # to one not on disk
        assert refusal(repo.reload_config, models.config(m=f"model_version_policy {{ all {{}} }} {labels}")) == \
            not_available(version)
    repo.poll_now()
    assert repo.version_labels() == {"m": {"stable": 1}} and served(repo, label="stable") == 1
    assert states(repo) == {1: AVAILABLE}, "the refused config's policy was not taken either"
    assert not_served(repo, label="canary") == (Code.INVALID_ARGUMENT, "Unrecognized servable version label: canary")


def test_a_label_moves_to_a_version_once_it_is_available(models):
    models.publish("m", 1, 2)
    repo = models.repository(m='model_version_policy { specific { versions: 1 } } '
                               'version_labels { key: "stable" value: 1 }')
    repo.poll_now()
    repo.reload_config(models.config(m='model_version_policy { all {} } version_labels { key: "stable" value: 1 }'))
    repo.poll_now()
    repo.reload_config(models.config(m='model_version_policy { all {} } version_labels { key: "stable" value: 2 } '
                                       'version_labels { key: "canary" value: 1 }'))
    assert served(repo, label="stable") == 2 and served(repo, label="canary") == 1
    assert repo.status("m", label="stable") == [VersionStatus(2, AVAILABLE)]
    assert repo.version_labels() == {"m": {"canary": 1, "stable": 2}}


def test_the_allow_flag_lets_a_new_or_kept_label_name_a_version_not_available_but_moves_none_to_one(models):
    """--allow_version_labels_for_unavailable_models=true, as ServerCore's allow_version_labels_for_unavailable_
    models: an existing label never moves to a version that cannot answer its requests yet."""
    models.publish("m", 1)
    repo = models.repository(allow_unavailable_labels=True,
                             m='model_version_policy { all {} } version_labels { key: "stable" value: 1 }')
    repo.poll_now()
    moved = 'version_labels { key: "stable" value: 2 }'
    assert refusal(repo.reload_config, models.config(m=f"model_version_policy {{ all {{}} }} {moved}")) == \
        not_available(2)
    assert repo.version_labels() == {"m": {"stable": 1}}
    repo.reload_config(models.config(m='model_version_policy { all {} } version_labels { key: "stable" value: 1 } '
                                       'version_labels { key: "canary" value: 2 }'))
    assert repo.version_labels() == {"m": {"canary": 2, "stable": 1}} and served(repo, label="stable") == 1
    assert not_served(repo, label="canary") == (Code.NOT_FOUND, "Servable not found for request: Specific(m, 2)")
    models.publish("m", 2)
    repo.poll_now()
    assert served(repo, label="canary") == 2


# --- failed loads -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("error", "code", "message"), [
    (ValueError("variables/ is incomplete"), "UNKNOWN", "Failed to load: ValueError: variables/ is incomplete"),
    (ServingError(Code.DATA_LOSS, "file is too short to be an sstable"), "DATA_LOSS",
     "file is too short to be an sstable"),
], ids=["any error", "a ServingError is the loader's status, kept as it is"])
def test_a_failed_version_is_end_with_its_error_and_the_previous_one_keeps_serving(models, error, code, message):
    models.publish("m", 1)
    repo = models.repository(m="")
    repo.poll_now()
    models.fail("m", 2, error)
    models.publish("m", 2)
    repo.poll_now()
    assert repo.status("m") == [VersionStatus(2, END, code, message), VersionStatus(1, AVAILABLE)]
    assert repo.ready() and served(repo) == 1
    assert models.events == ["loaded m 1", "settled", "failed m 2", "settled"]


def test_a_failed_version_is_retried_only_once_its_files_change(models):
    """`cp -r` shows saved_model.pb before variables/ is complete: the version must load once the copy ends."""
    models.publish("m", 1)
    repo = models.repository(m="")
    repo.poll_now()
    models.fail("m", 2, ValueError("variables/ is incomplete"))
    models.publish("m", 2)
    for _ in range(3):
        repo.poll_now()
    assert models.events.count("failed m 2") == 1, "an unchanged broken version is not loaded again every poll"
    del models.failures[("m", 2)]
    (models.base / "m" / "2" / "variables").mkdir()
    (models.base / "m" / "2" / "variables" / "variables.index").write_bytes(b"the rest of the copy")
    repo.poll_now()
    assert repo.status("m") == [VersionStatus(2, AVAILABLE), VersionStatus(1, END)]
    assert models.events[-3:] == ["loaded m 2", "unloaded m 1", "settled"]


def test_a_model_whose_only_version_fails_is_not_ready_and_not_found(models):
    models.publish("m", 1)
    models.fail("m", 1, ValueError("not a SavedModel"))
    repo = models.repository(m="")
    repo.poll_now()
    assert not repo.ready() and not repo.model_ready("m")
    assert not_served(repo) == (Code.NOT_FOUND, "Servable not found for request: Latest(m)")


# --- warm, then unload ------------------------------------------------------------------------------------------

def test_a_new_version_serves_once_loaded_and_warmed_and_only_then_the_old_one_unloads(models):
    models.publish("m", 1)
    repo = models.repository(m="")
    repo.poll_now()
    gate = models.hang("m", 2)
    models.publish("m", 2)
    poller = in_background(repo.poll_now)
    assert gate.entered.wait(WAIT)
    assert states(repo) == {2: LOADING, 1: AVAILABLE} and repo.ready()
    assert served(repo) == 1, "requests keep going to the old version while the new one loads"
    assert not_served(repo, version=2) == (Code.NOT_FOUND, "Servable not found for request: Specific(m, 2)")
    gate.release.set()
    poller.join(WAIT)
    assert states(repo) == {2: AVAILABLE, 1: END} and served(repo) == 2
    assert models.events == ["loaded m 1", "settled", "loaded m 2", "unloaded m 1", "settled"]


def test_the_only_loaded_version_is_never_unloaded(models):
    models.publish("m", 1)
    repo = models.repository(m="")
    repo.poll_now()
    shutil.rmtree(models.base / "m" / "1")
    repo.poll_now()
    assert states(repo) == {1: AVAILABLE} and served(repo) == 1, "its folder is gone, but nothing replaces it"
    repo.reload_config(models.config(m="model_version_policy { specific { versions: 9 } }"))
    repo.poll_now()
    assert states(repo) == {1: AVAILABLE} and served(repo) == 1, "the policy names a version that is not there"
    assert "unloaded m 1" not in models.events


# --- unloading with requests in flight --------------------------------------------------------------------------

def test_an_unload_waits_for_the_requests_in_flight_on_the_old_version(models):
    models.publish("m", 1)
    repo = models.repository(m="")
    repo.poll_now()
    models.publish("m", 2)
    with repo.servable_handle("m") as held:
        poller = in_background(repo.poll_now)
        wait_until(lambda: states(repo).get(1) == UNLOADING)
        assert states(repo) == {2: AVAILABLE, 1: UNLOADING} and served(repo) == 2, "new requests go to 2"
        poller.join(0.05)
        assert poller.is_alive() and "unloaded m 1" not in models.events
        assert held.version == 1
    poller.join(WAIT)
    assert not poller.is_alive() and states(repo) == {2: AVAILABLE, 1: END}
    assert models.events[-2:] == ["unloaded m 1", "settled"]


def test_a_stuck_request_holds_an_unload_no_longer_than_drain_seconds(models):
    """The drain is --graceful_timeout (the DataPlane passes it as drain_seconds), not forever."""
    models.publish("m", 1)
    repo = models.repository(m="", drain_seconds=0.1)
    repo.poll_now()
    models.publish("m", 2)
    with repo.servable_handle("m"):
        started = time.monotonic()
        repo.poll_now()
        assert 0.1 <= time.monotonic() - started < WAIT
        assert states(repo) == {2: AVAILABLE, 1: END} and "unloaded m 1" in models.events
    assert served(repo) == 2, "the stuck request's release after the unload harms nothing"


def test_an_unloaded_version_is_let_go(models):
    models.publish("m", 1)
    repo = models.repository(m="")
    repo.poll_now()
    with repo.servable_handle("m") as version:
        gone = weakref.ref(version)
    del version
    models.publish("m", 2)
    repo.poll_now()
    assert gone() is None, "the repository holds no reference to a version it unloaded"
    assert models.metrics.loaded_versions.value(model_name="m", version="1") == 0
    assert models.metrics.loaded_versions.value(model_name="m", version="2") == 1


# --- a hung load ------------------------------------------------------------------------------------------------

def test_a_hung_load_blocks_no_request_status_or_config_change(models):
    models.publish("a", 1)
    models.publish("b", 1)
    repo = models.repository(a="", b="")
    repo.poll_now()
    gate = models.hang("a", 2)
    models.publish("a", 2)
    poller = in_background(repo.poll_now)
    assert gate.entered.wait(WAIT)
    started = time.monotonic()
    assert served(repo, "a") == 1 and served(repo, "b") == 1 and served(repo, "b", version=1) == 1
    assert states(repo, "a") == {2: LOADING, 1: AVAILABLE} and states(repo, "b") == {1: AVAILABLE}
    assert repo.ready() and repo.model_ready("b") and not repo.model_ready("a", 2)
    assert repo.model_names() == ["a", "b"] and repo.version_labels() == {"a": {}, "b": {}}
    repo.reload_config(models.config(a="", b="", c=""))
    assert repo.model_names() == ["a", "b", "c"]
    assert time.monotonic() - started < 1, "a call waited for the hung load"
    gate.release.set()
    poller.join(WAIT)
    assert states(repo, "a") == {2: AVAILABLE, 1: END}


def test_a_model_whose_first_load_hangs_is_loading_and_unavailable(models):
    models.publish("m", 1)
    gate = models.hang("m", 1)
    repo = models.repository(m="")
    repo.start()
    try:
        assert gate.entered.wait(WAIT)
        assert not repo.ready() and states(repo) == {1: LOADING}
        assert not_served(repo) == (Code.UNAVAILABLE, "Model m is loading; retry shortly")
        gate.release.set()
        repo.wait_first_pass()
        assert repo.ready() and served(repo) == 1
    finally:
        repo.stop()


# --- config reloads ---------------------------------------------------------------------------------------------

def test_a_reloaded_config_without_a_model_unloads_it_and_keeps_its_versions_end(models):
    """TF Serving's ServableStateMonitor keeps every version's last state: a removed model is no longer served or
    named, but its status lists its versions as END (get_model_status_impl.cc reads the monitor)."""
    models.publish("a", 1)
    models.publish("b", 1)
    repo = models.repository(a="", b="")
    repo.poll_now()
    repo.reload_config(models.config(a=""))
    assert repo.model_names() == ["a"], "a removed model is gone from the names at once"
    assert not_served(repo, "b") == (Code.NOT_FOUND, "Servable not found for request: Latest(b)")
    repo.poll_now()
    assert models.events[-2:] == ["unloaded b 1", "settled"]
    assert repo.status("b") == [VersionStatus(1, END)]
    assert repo.status("b", 1) == [VersionStatus(1, END)]
    assert refusal(repo.status, "b", 2) == (Code.NOT_FOUND, "Could not find version 2 of model b")
    assert repo.ready() and served(repo, "a") == 1
    models.publish("b", 2)
    repo.reload_config(models.config(a="", b=""))
    repo.poll_now()
    assert states(repo, "b") == {2: AVAILABLE, 1: END}, "a model added again keeps its old versions' states"
    empty = model_server_config_pb2.ModelServerConfig()
    empty.model_config_list.SetInParent()
    repo.reload_config(empty)
    repo.poll_now()
    assert repo.model_names() == [] and not repo.ready()


def test_a_removed_models_failed_version_is_tried_again_when_the_model_is_listed_again(models):
    """A model listed again gets a new source in TF Serving, which aspires every version on disk afresh."""
    models.publish("m", 1)
    models.fail("m", 1, ValueError("not yet"))
    repo = models.repository(m="")
    repo.poll_now()
    repo.reload_config(models.config())
    repo.poll_now()
    del models.failures[("m", 1)]
    repo.reload_config(models.config(m=""))
    repo.poll_now()
    assert models.events.count("failed m 1") == 1 and states(repo) == {1: AVAILABLE}


def test_the_poll_thread_applies_a_reloaded_config_at_once(models):
    """With --file_system_poll_wait_seconds=0 the thread polls once, yet a reload still wakes it."""
    models.publish("a", 1)
    models.publish("b", 1)
    repo = models.repository(a="")
    repo.start()
    try:
        repo.wait_first_pass()
        repo.reload_config(models.config(a="", b=""))
        wait_until(lambda: repo.model_ready("b"))
    finally:
        repo.stop()


# --- the heap ---------------------------------------------------------------------------------------------------

def test_the_heap_is_settled_after_a_pass_that_loaded_or_unloaded_and_only_then(models):
    models.publish("m", 1)
    repo = models.repository(m="")
    repo.poll_now()
    repo.poll_now()
    assert models.events == ["loaded m 1", "settled"], "a pass that changes nothing leaves the heap alone"
    models.publish("m", 2)
    repo.poll_now()
    repo.poll_now()
    assert models.events == ["loaded m 1", "settled", "loaded m 2", "unloaded m 1", "settled"]


# --- a reload's wait (TF Serving's ServerCore::WaitUntilModelsAvailable) -----------------------------------------

def test_a_reload_waits_for_its_new_models_only(models):
    """The wait returns once the new model is AVAILABLE, and not before: the poll thread loads it meanwhile. A model
    the running config already lists is not waited for, even while it has no version."""
    models.publish("a", 1)
    repo = models.repository(a="")
    repo.poll_now()
    gate = models.hang("b", 1)
    models.publish("b", 1)
    reload = repo.reload_config(models.config(a="", b=""))
    assert reload.new_models == ("b",)
    loading = in_background(repo.poll_now)
    assert gate.entered.wait(WAIT)
    waiter = in_background(lambda: repo.wait_available(reload, time.monotonic() + WAIT, lambda: False))
    waiter.join(0.05)
    assert waiter.is_alive(), "returned while b was still loading"
    gate.release.set()
    waiter.join(WAIT)
    loading.join(WAIT)
    assert not waiter.is_alive() and states(repo, "b") == {1: AVAILABLE}
    again = repo.reload_config(models.config(a="", b="", c=""))
    assert again.new_models == ("c",)
    assert refusal(repo.wait_available, again, time.monotonic() + 0.05, lambda: False) == (
        Code.DEADLINE_EXCEEDED, "Deadline exceeded waiting for model(s) c to become available")
    repo.wait_available(repo.reload_config(models.config(a="", b="")), time.monotonic(), lambda: False)


def test_a_new_model_that_fails_to_load_fails_the_reload_in_tf_servings_words(models):
    models.publish("a", 1)
    models.publish("b", 1)
    models.fail("b", 1, ValueError("no graph"))
    repo = models.repository(a="")
    repo.poll_now()
    reload = repo.reload_config(models.config(a="", b=""))
    repo.poll_now()
    code, message = refusal(repo.wait_available, reload, time.monotonic() + WAIT, lambda: False)
    assert code == Code.UNKNOWN
    assert message.startswith("1 model(s) did not become available: {{{name: b version: 1} due to error: UNKNOWN: ")
    assert message.endswith("}, }")


def test_a_model_listed_again_is_settled_by_its_new_load_not_its_old_end(models):
    """ServerCore waits on a fresh ServableStateMonitor: a removed model's version END from before the reload does
    not fail the reload that lists it again; its reload waits for the version to load again."""
    models.publish("a", 1)
    models.publish("b", 1)
    repo = models.repository(a="", b="")
    repo.poll_now()
    repo.reload_config(models.config(a=""))
    repo.poll_now()
    assert states(repo, "b") == {1: END}
    reload = repo.reload_config(models.config(a="", b=""))
    assert reload.new_models == ("b",)
    assert refusal(repo.wait_available, reload, time.monotonic() + 0.05, lambda: False)[0] == Code.DEADLINE_EXCEEDED
    repo.poll_now()
    repo.wait_available(reload, time.monotonic() + WAIT, lambda: False)
    assert states(repo, "b") == {1: AVAILABLE}


def test_a_reload_stops_waiting_when_its_call_ends(models):
    models.publish("a", 1)
    repo = models.repository(a="")
    repo.poll_now()
    reload = repo.reload_config(models.config(a="", b=""))  # b has no version: it would wait forever
    ended = threading.Event()
    threading.Timer(0.05, ended.set).start()
    assert refusal(repo.wait_available, reload, None, ended.is_set) == (
        Code.UNAVAILABLE, "Stopped waiting for model(s) b to become available: the call ended or the server is "
        "stopping")
