"""The model repository in-process on real SavedModels: policies, labels, failures, retries, warmup, unloading (the
labels file and the version policies on their own are tests/unit/test_labels_and_version_policy.py)."""
import gc
import logging
import os
import shutil
import threading
import time
import weakref

import pytest
from google.protobuf import text_format
from tensorflow_serving.config import model_server_config_pb2

from exported_models.model_format import exported_versions, latest_version
from server_harness import copy_model, tiny_model_base
from serving.core import heap
from serving.core.errors import ServingError
from serving.core.repository import Repository
from serving.metrics import Metrics


def config(base: str, extra: str = "") -> model_server_config_pb2.ModelServerConfig:
    return text_format.Parse(f'model_config_list {{ config {{ name: "flowers" base_path: "{base}" '
                             f'model_platform: "tensorflow" {extra} }} }}',
                             model_server_config_pb2.ModelServerConfig())


def states(repo: Repository) -> dict[int, str]:
    return {s.version: s.state for s in repo.status("flowers")}


def test_discovery_ignores_non_integer_and_incomplete_versions(tmp_path):
    base = str(tmp_path / "m")
    copy_model(base, 3)
    os.makedirs(os.path.join(base, "7"))  # no saved_model.pb yet: still being copied
    os.makedirs(os.path.join(base, "tmp"))
    assert exported_versions(base) == [3]
    assert latest_version(base) == os.path.join(base, "3")
    assert latest_version(os.path.join(base, "3")) == os.path.join(base, "3")
    assert exported_versions(os.path.join(base, "missing")) == []
    with pytest.raises(FileNotFoundError, match="no SavedModel"):
        latest_version(os.path.join(base, "7"))


def test_latest_version_serves_and_warmup_replays(tmp_path):
    base = str(tmp_path / "m")
    copy_model(base, 1)
    copy_model(base, 2)
    metrics = Metrics()
    repo = Repository(config(base), metrics, poll_seconds=0)
    repo.poll_now()
    assert states(repo) == {2: "AVAILABLE"} and repo.ready()
    with repo.serving("flowers") as servable:
        assert servable.version == 2 and servable.labels[0] == "daisy"
    # the exporter wrote 3 single-image requests plus one batch of all three
    assert metrics.warmup_requests.value(model_name="flowers", version="2") == 4
    with pytest.raises(ServingError) as info:
        with repo.serving("flowers", version=1):
            pass
    assert info.value.code == "NOT_FOUND" and "Specific(flowers, 1)" in info.value.message
    with pytest.raises(ServingError) as info:
        repo.status("nope")
    assert info.value.code == "NOT_FOUND"


def test_labels_and_all_policy(tmp_path):
    base = str(tmp_path / "m")
    copy_model(base, 1)
    copy_model(base, 2)
    repo = Repository(config(base, 'model_version_policy { all {} } version_labels { key: "stable" value: 1 } '
                                   'version_labels { key: "canary" value: 2 }'), Metrics(), poll_seconds=0)
    repo.poll_now()
    assert states(repo) == {1: "AVAILABLE", 2: "AVAILABLE"}
    with repo.serving("flowers", label="stable") as servable:
        assert servable.version == 1
    assert repo.status("flowers", label="canary")[0].version == 2
    with pytest.raises(ServingError) as info:
        repo.status("flowers", label="beta")
    assert info.value.code == "INVALID_ARGUMENT" and "Unrecognized servable version label: beta" in info.value.message


def test_broken_version_is_reported_and_the_old_one_keeps_serving(tmp_path):
    base = str(tmp_path / "m")
    copy_model(base, 1)
    repo = Repository(config(base), Metrics(), poll_seconds=0)
    repo.poll_now()
    staging = tmp_path / "broken"
    staging.mkdir()
    (staging / "saved_model.pb").write_bytes(b"this is not a SavedModel")
    os.rename(staging, os.path.join(base, "2"))
    repo.poll_now()
    status = {s.version: s for s in repo.status("flowers")}
    assert status[2].state == "END" and status[2].error_code != "OK" and status[2].error_message
    assert status[1].state == "AVAILABLE" and repo.ready()
    with repo.serving("flowers") as servable:
        assert servable.version == 1


def test_unchanged_broken_version_is_not_reloaded_every_poll(tmp_path, caplog):
    base = str(tmp_path / "m")
    copy_model(base, 1)
    os.makedirs(os.path.join(base, "2"))
    with open(os.path.join(base, "2", "saved_model.pb"), "wb") as f:
        f.write(b"this is not a SavedModel")
    repo = Repository(config(base), Metrics(), poll_seconds=0)
    with caplog.at_level(logging.INFO, logger="serving.core.repository"):
        for _ in range(3):
            repo.poll_now()
    failures = [r for r in caplog.records if r.getMessage() == "version failed to load"]
    assert len(failures) == 1 and states(repo) == {2: "END", 1: "AVAILABLE"}


def test_version_copied_in_non_atomically_becomes_available(tmp_path):
    """`cp -r` shows saved_model.pb before variables/ is complete: the first load fails, and the version is
    retried once its files change rather than staying END until a restart."""
    base = str(tmp_path / "m")
    copy_model(base, 1)
    repo = Repository(config(base), Metrics(), poll_seconds=0)
    repo.poll_now()
    source, target = os.path.join(tiny_model_base(), "1"), os.path.join(base, "2")
    os.makedirs(target)
    shutil.copy2(os.path.join(source, "saved_model.pb"), target)
    repo.poll_now()
    status = {s.version: s for s in repo.status("flowers")}
    assert status[2].state == "END" and status[2].error_code != "OK"
    assert status[1].state == "AVAILABLE"
    for name in sorted(os.listdir(source)):
        if name != "saved_model.pb":
            copy = shutil.copytree if os.path.isdir(os.path.join(source, name)) else shutil.copy2
            copy(os.path.join(source, name), os.path.join(target, name))
    repo.poll_now()
    status = {s.version: s for s in repo.status("flowers")}
    assert status[2].state == "AVAILABLE" and status[2].error_code == "OK" and not status[2].error_message
    assert status[1].state == "END"
    with repo.serving("flowers") as servable:
        assert servable.version == 2 and servable.labels[0] == "daisy"


def test_unload_waits_for_requests_in_flight(tmp_path):
    base = str(tmp_path / "m")
    copy_model(base, 1)
    repo = Repository(config(base), Metrics(), poll_seconds=0)
    repo.poll_now()
    copy_model(base, 2)
    with repo.serving("flowers") as old:
        poller = threading.Thread(target=repo.poll_now)
        poller.start()
        deadline = time.monotonic() + 60
        while states(repo).get(1) != "UNLOADING" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert states(repo) == {1: "UNLOADING", 2: "AVAILABLE"}
        assert old.version == 1 and old.run("serving_default", {"image_bytes": _one_image()})["classid"].shape == (1,)
    poller.join(30)
    assert states(repo) == {1: "END", 2: "AVAILABLE"}


def test_a_stuck_request_holds_an_unload_no_longer_than_the_graceful_timeout(tmp_path):
    """The drain is --graceful_timeout, not a fixed five minutes (DataPlane passes options.graceful_timeout)."""
    base = str(tmp_path / "m")
    copy_model(base, 1)
    repo = Repository(config(base), Metrics(), poll_seconds=0, drain_seconds=0.5)
    repo.poll_now()
    copy_model(base, 2)
    with repo.serving("flowers"):
        started = time.monotonic()
        poller = threading.Thread(target=repo.poll_now)
        poller.start()
        poller.join(20)
        assert not poller.is_alive() and time.monotonic() - started < 20
    assert states(repo) == {1: "END", 2: "AVAILABLE"}


def test_reload_config_unloads_omitted_models(tmp_path):
    base = str(tmp_path / "m")
    copy_model(base, 1)
    repo = Repository(config(base), Metrics(), poll_seconds=0)
    repo.poll_now()
    empty = model_server_config_pb2.ModelServerConfig()
    empty.model_config_list.SetInParent()
    repo.reload_config(empty)
    repo.poll_now()
    assert repo.model_names() == [] and not repo.ready()
    with pytest.raises(ServingError) as info:
        repo.status("flowers")
    assert info.value.code == "NOT_FOUND"


def test_the_heap_is_settled_after_loads_and_unloads_only(tmp_path, monkeypatch):
    settled = []
    settle = heap.settle
    monkeypatch.setattr(heap, "settle", lambda: settled.append(1) or settle())
    base = str(tmp_path / "m")
    copy_model(base, 1)
    repo = Repository(config(base), Metrics(), poll_seconds=0)
    try:
        gc.unfreeze()
        repo.poll_now()
        assert len(settled) == 1
        assert gc.get_freeze_count() > 10_000, "TensorFlow's and the model's objects leave the collector's view"
        with repo.serving("flowers") as servable:
            gone = weakref.ref(servable._loaded)
        del servable
        copy_model(base, 2)
        repo.poll_now()
        assert states(repo) == {1: "END", 2: "AVAILABLE"} and len(settled) == 2
        assert gone() is None, "an unloaded version's objects are released"
        repo.poll_now()
        assert len(settled) == 2, "a pass that changes nothing leaves the heap alone"
    finally:
        gc.unfreeze()


def _one_image():
    import numpy as np

    from server_harness import jpeg
    return np.array([jpeg()], dtype=object)
