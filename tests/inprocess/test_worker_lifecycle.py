"""A worker's life, owned by serving/process/worker.py's `Worker`: start, the initial load, gRPC once it is over and the
line that says the server is ready, reloads (the RPC, the watched file, a sibling's published config), the drain and the
exit. In this process, on real DataPlanes: the tiny model, or models whose folders hold no version yet (nothing to
load, so they start at once), with the real gRPC server on a loopback port."""
from __future__ import annotations

import dataclasses
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import pytest
from google.protobuf import text_format
from tensorflow_serving.apis import get_model_status_pb2, model_management_pb2, model_service_pb2_grpc
from tensorflow_serving.config import model_server_config_pb2

from server_harness import copy_model, free_port
from serving.core import DataPlane
from serving.options.config import ServerOptions
from serving.options.config_files import read_model_config
from serving.process.flags import parse_args
from serving.process.worker import RELOAD_FILE, Worker

WAIT_S = 30


def models(**base_paths: str) -> model_server_config_pb2.ModelServerConfig:
    config = model_server_config_pb2.ModelServerConfig()
    for name, base_path in base_paths.items():
        config.model_config_list.config.add(name=name, base_path=base_path, model_platform="tensorflow")
    return config


def empty_models(root, *names: str) -> model_server_config_pb2.ModelServerConfig:
    """Models whose folders hold no version yet."""
    for name in names:
        (root / name).mkdir(exist_ok=True)
    return models(**{name: str(root / name) for name in names})


def options(*flags: str, **process: object) -> ServerOptions:
    """`petal serve FLAGS` as one worker in this process gets them (no gRPC unless FLAGS give a port), with what the
    master sets in `process`."""
    parsed = parse_args(["--port=0", "--host=127.0.0.1", "--tensorflow_thread_nice=0", "--enable_model_warmup=false",
                         "--file_system_poll_wait_seconds=0", *flags])
    return dataclasses.replace(parsed, process=dataclasses.replace(parsed.process, **process))


def wait_for(predicate: Callable[[], object], timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def connects(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture
def started() -> Iterator[Callable[[Worker], Worker]]:
    """Start workers; each is drained and exited at the test's end."""
    workers: list[Worker] = []

    def start(worker: Worker) -> Worker:
        workers.append(worker)
        worker.start()
        return worker
    yield start
    for worker in workers:
        worker.drain()
        worker.exit()


# --- the model config: read once, and the watch starts from what the DataPlane started with ---------------------

def test_the_model_config_file_is_read_once_from_the_flags_to_a_started_worker(tmp_path, opened, started):
    path = tmp_path / "models.config"
    path.write_text(text_format.MessageToString(empty_models(tmp_path, "a")))
    worker = started(Worker(options(f"--model_config_file={path}", "--model_config_file_poll_wait_seconds=3600")))
    worker.dataplane.wait_loaded()
    assert opened[str(path)] == 1, "the flags read it; the DataPlane and the watch start from what they read"
    assert worker.dataplane.model_names() == ["a"]


def test_an_edit_that_lands_while_the_dataplane_starts_is_applied(tmp_path, started):
    """The race that was: the DataPlane read the file, then the watch read it again for its baseline, so an edit
    between the two became the baseline and was never applied. The edit here lands right after the DataPlane is
    built, before the watch starts."""
    path = tmp_path / "models.config"
    path.write_text(text_format.MessageToString(empty_models(tmp_path, "a")))
    edited = empty_models(tmp_path, "a", "b")

    def create_then_edit(*args, **kwargs) -> DataPlane:
        dataplane = DataPlane.create(*args, **kwargs)
        path.write_text(text_format.MessageToString(edited))
        return dataplane
    worker = started(Worker(options(f"--model_config_file={path}", "--model_config_file_poll_wait_seconds=0.05"),
                            create_dataplane=create_then_edit))
    wait_for(lambda: worker.dataplane.model_names() == ["a", "b"], timeout=10)


def test_the_watch_applies_a_config_a_sibling_published(tmp_path, started):
    (tmp_path / "a").mkdir()
    worker = started(Worker(options(f"--model_base_path={tmp_path / 'a'}", "--model_name=a",
                                    reload_dir=str(tmp_path))))
    (tmp_path / RELOAD_FILE).write_text(text_format.MessageToString(empty_models(tmp_path, "a", "c")))
    wait_for(lambda: worker.dataplane.model_names() == ["a", "c"], timeout=10)


# --- start, serve, reload, drain, exit ------------------------------------------------------------------------

def test_start_serve_reload_drain_and_exit(tmp_path):
    base, other = copy_model(str(tmp_path / "flowers"), 1), copy_model(str(tmp_path / "other"), 1)
    port = free_port()
    lines: list[str] = []
    stopped_rest: list[bool] = []
    others = set(threading.enumerate())
    worker = Worker(options(f"--model_base_path={os.path.dirname(base)}", "--model_name=flowers", f"--port={port}",
                            "--enable_model_control", "--rest_api_port=8765", runtime_dir=str(tmp_path),
                            reload_dir=str(tmp_path), started_at=time.monotonic()), announce=lines.append)
    try:
        client = worker.start().test_client()
        assert client.get("/healthz").status_code == 200
        worker.dataplane.wait_loaded()
        [polls] = [t for t in threading.enumerate() if t.name == "petal-repository" and t not in others]
        assert not connects(port) and not worker.startup.done, "gRPC opens only once the REST port accepts"

        worker.serve(lambda: stopped_rest.append(True))
        assert worker.dataplane.wait_started(time.monotonic() + WAIT_S)
        assert connects(port) and client.get("/readyz").status_code == 200
        wait_for(lambda: lines)
        assert re.fullmatch(rf"ready: flowers v1 on http://127\.0\.0\.1:8765 and grpc://127\.0\.0\.1:{port} in "
                            r"\d+\.\d s", lines[0]), lines

        both = models(flowers=os.path.dirname(base), other=os.path.dirname(other))
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            model_service_pb2_grpc.ModelServiceStub(channel).HandleReloadConfigRequest(
                model_management_pb2.ReloadConfigRequest(config=both), timeout=WAIT_S)
        assert worker.dataplane.model_names() == ["flowers", "other"]
        assert read_model_config(str(tmp_path / RELOAD_FILE)) == both, "passed on to the other workers"

        worker.drain()
        assert stopped_rest == [True] and client.get("/readyz").status_code == 503
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel, pytest.raises(grpc.RpcError) as refused:
            model_service_pb2_grpc.ModelServiceStub(channel).GetModelStatus(
                get_model_status_pb2.GetModelStatusRequest(model_spec={"name": "flowers"}), timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert not any(t.name == "petal-config" and t.is_alive() for t in threading.enumerate()), \
            "the watch ends with the drain"
    finally:
        worker.drain()
        worker.exit()
    polls.join(WAIT_S)  # a poll pass under way ends first
    assert not polls.is_alive(), "exit stops the DataPlane's threads"


def test_a_model_that_fails_to_load_says_why_in_one_line_then_ready_once_a_version_loads(tmp_path, started):
    base = tmp_path / "flowers"
    (base / "1").mkdir(parents=True)
    (base / "1" / "saved_model.pb").write_bytes(b"not a SavedModel")
    lines: list[str] = []
    worker = started(Worker(options("--model_name=flowers", f"--model_base_path={base}",
                                    "--file_system_poll_wait_seconds=0.2"),
                            announce=lines.append))
    worker.serve()
    wait_for(lambda: lines)
    assert len(lines) == 1 and lines[0].startswith("not ready: flowers v1 Failed to load: "), lines
    assert "\n" not in lines[0]
    copy_model(str(base), 2)
    wait_for(lambda: len(lines) == 2)
    assert lines[1].startswith("ready: flowers v2 on http://127.0.0.1:8501"), lines


def test_of_several_workers_the_last_to_start_says_so_and_only_once(tmp_path, started):
    """Each worker marks itself started in the server's runtime folder; with two, this one (the same process every
    time here) is the last only once a sibling has marked itself, and once one has spoken no other does."""
    lines: list[str] = []

    def worker() -> Worker:
        return started(Worker(options("--model_name=flowers", f"--model_base_path={tmp_path / 'm'}", "--workers=2",
                                      runtime_dir=str(tmp_path)), announce=lines.append))
    (tmp_path / "m").mkdir()
    worker().serve()
    time.sleep(0.5)
    assert lines == [], "its sibling has not started"
    (tmp_path / "started").mkdir(exist_ok=True)
    (tmp_path / "started" / "1").touch()
    worker().serve()
    wait_for(lambda: lines)
    worker().serve()
    time.sleep(0.5)
    assert len(lines) == 1 and lines[0].startswith("not ready: flowers"), lines
