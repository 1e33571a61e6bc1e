"""The model repository on real SavedModels through the real loader: load, warmup, replacement and the heap, and a
version copied in non-atomically. Every other transition (policies, labels, failed loads, unloads with requests in
flight, hung loads, config reloads) is tests/unit/test_version_transitions.py, on a fake loader."""
import gc
import os
import shutil
import weakref

from google.protobuf import text_format
from tensorflow_serving.config import model_server_config_pb2

from server_harness import copy_model, tiny_model_base
from serving.core.repository import Repository
from serving.core.runtimes import LoadOptions
from serving.core.servable import Servable, loader
from serving.metrics import Metrics


def config(base: str) -> model_server_config_pb2.ModelServerConfig:
    return text_format.Parse(f'model_config_list {{ config {{ name: "flowers" base_path: "{base}" '
                             'model_platform: "tensorflow" } }', model_server_config_pb2.ModelServerConfig())


def repository(base: str, metrics: Metrics) -> Repository[Servable]:
    return Repository(config(base), loader(LoadOptions(), metrics), metrics, poll_seconds=0)


def states(repo: Repository) -> dict[int, str]:
    return {s.version: s.state for s in repo.status("flowers")}


def test_a_real_version_loads_warms_up_and_replaces_the_last_and_the_heap_settles(tmp_path):
    base = str(tmp_path / "m")
    copy_model(base, 1)
    copy_model(base, 2)
    metrics = Metrics()
    repo = repository(base, metrics)
    try:
        gc.unfreeze()
        repo.poll_now()
        assert states(repo) == {2: "AVAILABLE"} and repo.ready()
        # the exporter wrote 3 single-image requests plus one batch of all three
        assert metrics.warmup_requests.value(model_name="flowers", version="2") == 4
        assert gc.get_freeze_count() > 10_000, "TensorFlow's and the model's objects leave the collector's view"
        with repo.servable_handle("flowers") as servable:
            assert servable.version == 2 and servable.class_names[0] == "daisy"
            gone = weakref.ref(servable)
        del servable
        copy_model(base, 3)
        repo.poll_now()
        assert states(repo) == {3: "AVAILABLE", 2: "END"}
        assert gone() is None, "an unloaded version, and the TensorFlow objects it holds, are released"
    finally:
        gc.unfreeze()


def test_version_copied_in_non_atomically_becomes_available(tmp_path):
    """`cp -r` shows saved_model.pb before variables/ is complete: the first load fails, and the version is
    retried once its files change rather than staying END until a restart."""
    base = str(tmp_path / "m")
    copy_model(base, 1)
    repo = repository(base, Metrics())
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
    with repo.servable_handle("flowers") as servable:
        assert servable.version == 2 and servable.class_names[0] == "daisy"
