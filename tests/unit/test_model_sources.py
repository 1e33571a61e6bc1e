"""The repository over a source that goes away and comes back, and the source of URLs, in milliseconds.

The store is fsspec's in-memory file system (`memory://`), which the storage layer reaches as it reaches any store
(exported_models/storage.py): one listing per poll, a version downloaded whole into the cache folder before it loads.
The same on real stores' emulators, through `petal serve`, is tests/e2e/test_object_storage.py.
"""
from __future__ import annotations

import logging
import os

import fsspec
import pytest
from google.protobuf import text_format
from tensorflow_serving.config import model_server_config_pb2

from exported_models import storage
from serving.core.errors import Code, ServingError
from serving.core.repository import Repository, VersionState
from serving.core.source import ModelSource
from serving.metrics import Metrics

BASE = "memory://bucket/models/m"


@pytest.fixture
def store():
    """An empty in-memory bucket, emptied again afterwards."""
    fs = fsspec.filesystem("memory")
    fs.store.clear()
    fs.pseudo_dirs[:] = [""]
    yield fs
    fs.store.clear()


def publish(fs, version: int, files: dict[str, bytes] | None = None) -> None:
    for name, data in (files or {"saved_model.pb": b"graph", "variables/variables.index": b"index"}).items():
        fs.pipe_file(f"{BASE}/{version}/{name}", data)


class Loads:
    """A loader that records the folder it was handed, and can be told to fail."""

    def __init__(self):
        self.folders: dict[int, str] = {}
        self.fail: set[int] = set()

    def __call__(self, name: str, version: int, folder: str):
        self.folders[version] = folder
        assert os.path.isfile(os.path.join(folder, "saved_model.pb")), "the version is local and whole"
        if version in self.fail:
            raise ValueError("no variables")
        return type("LoadedVersion", (), {"format": "fake", "warmup_records": 0, "version": version})()


class Unreachable(ModelSource):
    """A store that can be taken away: its listings and downloads fail as a dead endpoint's do."""

    down = False

    def versions(self, base_path: str) -> dict[int, str]:
        if self.down:
            raise storage.StorageError(f"could not list {base_path}: Could not connect to the endpoint URL")
        return super().versions(base_path)


def repository(source: ModelSource, loads: Loads, metrics: Metrics | None = None) -> Repository:
    config = text_format.Parse(f'model_config_list {{ config {{ name: "m" base_path: "{BASE}" }} }}',
                               model_server_config_pb2.ModelServerConfig())
    return Repository(config, loads, metrics or Metrics(), poll_seconds=0, settle_heap=lambda: None, source=source)


def served(repo: Repository) -> int:
    with repo.servable_handle("m") as version:
        return version.version


def test_a_version_is_loaded_from_a_whole_local_copy_and_its_copy_goes_with_its_unload(store, tmp_path):
    publish(store, 1)
    loads = Loads()
    repo = repository(ModelSource(str(tmp_path / "cache")), loads)
    repo.poll_now()
    first = loads.folders[1]
    assert served(repo) == 1 and first.startswith(str(tmp_path / "cache"))
    with open(os.path.join(first, "variables", "variables.index"), "rb") as f:
        assert f.read() == b"index"
    publish(store, 2)
    repo.poll_now()
    assert served(repo) == 2
    assert not os.path.exists(first), "the unloaded version's copy is deleted"
    assert os.path.isdir(loads.folders[2])


def test_a_half_uploaded_version_never_serves_and_loads_once_the_rest_arrives(store, tmp_path):
    publish(store, 1)
    loads = Loads()
    repo = repository(ModelSource(str(tmp_path / "cache")), loads)
    repo.poll_now()
    publish(store, 2, {"saved_model.pb": b"graph"})
    loads.fail.add(2)
    repo.poll_now()
    assert {s.version: s.state for s in repo.status("m")} == {2: VersionState.END, 1: VersionState.AVAILABLE}
    assert served(repo) == 1
    assert not os.path.exists(loads.folders[2]), "a failed version's copy is deleted"
    loads.folders.pop(2)
    repo.poll_now()
    assert 2 not in loads.folders, "unchanged files are not tried again"
    loads.fail.clear()
    publish(store, 2, {"variables/variables.index": b"index"})
    repo.poll_now()
    assert served(repo) == 2


def test_a_store_gone_away_keeps_the_loaded_version_serving_says_so_once_and_recovers(store, tmp_path, caplog):
    publish(store, 1)
    source, metrics = Unreachable(str(tmp_path / "cache")), Metrics()
    repo = repository(source, Loads(), metrics)
    repo.poll_now()
    assert metrics.source_reachable.value(model_name="m") == 1
    source.down = True
    with caplog.at_level(logging.WARNING, logger="serving.core.repository"):
        for _ in range(3):
            repo.poll_now()
            assert served(repo) == 1
        assert [r.getMessage() for r in caplog.records] == [
            "model versions cannot be listed; the loaded versions keep serving"]
        assert metrics.source_reachable.value(model_name="m") == 0
        source.down = False
        publish(store, 2)
        repo.poll_now()
        repo.poll_now()
    assert [r.getMessage() for r in caplog.records][1:] == ["model versions listed again"]
    assert served(repo) == 2 and metrics.source_reachable.value(model_name="m") == 1


def test_a_store_unreachable_from_the_start_names_the_url_and_the_cause(tmp_path):
    source = Unreachable(str(tmp_path / "cache"))
    source.down = True
    repo = repository(source, Loads())
    repo.poll_now()
    with pytest.raises(ServingError) as info:
        repo.status("m")
    assert info.value.code == Code.NOT_FOUND
    assert info.value.message == (f"Could not find any versions of model m: could not list {BASE}: Could not "
                                  "connect to the endpoint URL")


def test_a_download_that_does_not_arrive_whole_is_tried_again_at_the_next_poll(store, tmp_path):
    publish(store, 1)
    source = ModelSource(str(tmp_path / "cache"))
    assert source.versions(BASE) == {1: f"{BASE}/1"}
    store.pipe_file(f"{BASE}/1/variables/variables.index", b"index, longer now")  # changed since the listing
    with pytest.raises(storage.StorageError, match="arrived where the listing said 5"):
        source.fetch(f"{BASE}/1")
    assert [name for name in os.listdir(tmp_path / "cache") if not name.endswith((".lock", ".use"))] == []
    loads = Loads()
    repo = repository(source, loads)
    repo.poll_now()
    assert served(repo) == 1


def test_workers_sharing_the_cache_download_a_version_once_and_the_last_to_let_go_deletes_it(store, tmp_path):
    publish(store, 1)
    cache = str(tmp_path / "cache")
    workers = [ModelSource(cache) for _ in range(3)]
    for worker in workers:
        worker.versions(BASE)
    first = workers[0].fetch(f"{BASE}/1")
    store.rm(f"{BASE}/1", recursive=True)  # a second download would fail now
    assert [worker.fetch(f"{BASE}/1") for worker in workers[1:]] == [first, first]
    for worker in workers[:2]:
        worker.release(f"{BASE}/1")
        assert os.path.isdir(first), "another worker still serves it"
    workers[2].release(f"{BASE}/1")
    assert os.listdir(cache) == []


def test_a_cache_folder_other_users_can_read_is_refused(store, tmp_path):
    publish(store, 1)
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o755)
    cache.chmod(0o755)
    source = ModelSource(str(cache))
    source.versions(BASE)
    with pytest.raises(storage.StorageError, match="mode 0700"):
        source.fetch(f"{BASE}/1")
