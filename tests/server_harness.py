"""Start `petal serve` as a real gunicorn subprocess on free loopback ports (load_tests.launcher), for every protocol's
tests.

Also builds the tiny test model once per test process (an untrained "compact" 32 px classifier exported with the
training API), so protocol tests exercise a real SavedModel without paying for training.
"""
from __future__ import annotations

import atexit
import base64
import io
import json
import os
import re
import shutil
import ssl
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING
from urllib.parse import urlparse

import requests

from load_tests import launcher
from load_tests.launcher import Server as Server
from load_tests.launcher import free_port as free_port
from load_tests.launcher import free_ports as free_ports
from load_tests.launcher import get_status as get_status

if TYPE_CHECKING:
    from serving.core import DataPlane

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LABELS = ["daisy", "dandelion", "roses", "sunflowers", "tulips"]
IMAGE_SIZE = 32

# TensorFlow's native start-up lines (glog's `I0000 00:00:… file.cc:123] …`, and absl's note before them), which no
# setting silences in TensorFlow 2.21 (serving/tensorflow_logs.py filters them for `petal` itself).
TF_NATIVE_LOG = re.compile(r"^([IWEF]\d{4} \S+ +\d+ \S+:\d+\] |WARNING: All log messages before absl)")


def user_environment(**overrides: str) -> dict[str, str]:
    """This environment without anything that tells TensorFlow how to log (as a user's shell has it, where the
    tests set TF_CPP_MIN_LOG_LEVEL), with `overrides`."""
    return {**{name: value for name, value in os.environ.items() if not name.startswith("TF_")}, **overrides}


def b64(data: bytes) -> dict:
    """A REST predict instance value: TF Serving's {"b64": ...} for binary strings."""
    return {"b64": base64.b64encode(data).decode()}


def predict_body(seed: int = 0) -> bytes:
    """A TF Serving REST predict of one small JPEG."""
    return json.dumps({"instances": [b64(jpeg(seed=seed))]}).encode()


def rest_address(server: Server) -> tuple[str, int]:
    """The REST port's host and port, for a test that speaks HTTP on its own sockets."""
    url = urlparse(server.rest_url)
    assert url.hostname is not None and url.port is not None, server.rest_url
    return url.hostname, url.port


def memory_held(server: Server) -> dict[str, float]:
    """What the worker's memory budget holds now, by kind (`bodies`, `pixels`), as its metrics export it."""
    text = requests.get(server.rest_url + "/monitoring/prometheus/metrics", timeout=10).text
    return {kind: float(value) for kind, value
            in re.findall(r':petal:serving:memory_budget_held_bytes\{kind="(\w+)"\} (\S+)', text)}


def run_server(*petal_serve_args: str, env: dict[str, str] | None = None, wait_ready: bool = True,
               stop_timeout: float = 60.0, tls_context: ssl.SSLContext | None = None, cwd: str = ROOT,
               wrapper: Sequence[str] = ()) -> AbstractContextManager[Server]:
    """`petal serve ARGS` on free ports (host and ports as load_tests.launcher.start chooses them); yields once /readyz
    is 200 (or /healthz, with wait_ready=False).

    With `tls_context` (for a server given --ssl_config_file) the REST URL is https and the probe uses it.
    TensorFlow's C++ logs stay at warnings whatever this environment says, unless `env` says otherwise. The server
    is this checkout's unless `cwd` names another; `wrapper` is load_tests.launcher.start's.
    """
    probe = launcher.answers("/readyz" if wait_ready else "/healthz", tls_context)
    return launcher.running(petal_serve_args, ready=probe, stop_timeout_s=stop_timeout, tls=tls_context is not None,
                            cwd=cwd, env={"TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})}, wrapper=wrapper)


def access_lines(server: Server, until: Callable[[list[dict]], bool], timeout_s: float = 30.0) -> list[dict]:
    """The server's access-log records once `until` holds for them. A worker's stderr reaches the log through the
    master's relay, after the response has gone, so a line read at once can still be on its way, or half written:
    only whole lines (their newline written) are read."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = (json.loads(line) for line in server.log().splitlines(keepends=True)
                   if line.startswith("{") and line.endswith("\n"))
        lines = [entry for entry in records if entry.get("logger") == "petal.access"]
        if until(lines) or time.monotonic() > deadline:
            return lines
        time.sleep(0.05)


@contextmanager
def in_process_dataplane(loaded: bool = True, **options: object) -> Iterator[DataPlane]:
    """A real DataPlane in this process, its models loaded (no server, no polling): the in-process tests of every
    protocol call it through Flask's test client or a gRPC servicer. With `loaded=False` it is not waited for: for a
    config whose models have no versions on disk, where there is nothing to wait for and no readiness to reach."""
    from serving.core import DataPlane
    from serving.options.config import DataPlaneOptions

    dataplane = DataPlane.create(DataPlaneOptions(model_config=model_config(options), file_system_poll_wait_seconds=0,
                                             **options))
    try:
        if loaded:
            dataplane.wait_loaded()
            assert dataplane.ready(), "the models did not load"
        yield dataplane
    finally:
        dataplane.close()


def model_config(options: dict[str, object]):
    """The models that `model_config_file`, or `model_name` and `model_base_path`, name among `options`, as the
    flags make them (and taken out of `options`)."""
    from serving.options.config import model_config_for
    from serving.options.config_files import read_model_config

    path = options.pop("model_config_file", None)
    if path:
        return read_model_config(str(path))
    flags = (("model_name", "name"), ("model_base_path", "base_path"))
    return model_config_for(**{arg: str(options.pop(flag)) for flag, arg in flags if flag in options})


def jpeg(size: int = IMAGE_SIZE, seed: int = 0, quality: int = 90) -> bytes:
    """A real JPEG with some structure (so different seeds give different predictions)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    pixels = (rng.random((size, size, 3)) * 255).astype("uint8")
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()


_model_base: str | None = None


def tiny_model_base() -> str:
    """A base path holding version 1 of the tiny test model, exported once per process (copy it, don't edit)."""
    global _model_base
    if _model_base is None:
        from training.export import export_saved_model
        from training.models import build_model

        folder = tempfile.mkdtemp(prefix="petal-test-model-")
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        base = os.path.join(folder, "flowers")
        model = build_model("compact", len(LABELS), IMAGE_SIZE)
        export_saved_model(model, base, LABELS, IMAGE_SIZE, version=1,
                           warmup_images=[jpeg(seed=s) for s in range(3)])
        _model_base = base
    return _model_base


def copy_model(dest_base: str, version: int, source_version: int = 1) -> str:
    """Publish a copy of the tiny model as `dest_base/version` in one rename, as an exporter would."""
    os.makedirs(dest_base, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".staging-", dir=dest_base)
    shutil.copytree(os.path.join(tiny_model_base(), str(source_version)), os.path.join(staging, "v"))
    final = os.path.join(dest_base, str(version))
    os.rename(os.path.join(staging, "v"), final)
    os.rmdir(staging)
    return final


@contextmanager
def run_batching_server(root, batching_config: str, *petal_serve_args: str) -> Iterator[Server]:
    """The tiny model as version 1 under `root`, served with a text-format BatchingParameters file."""
    copy_model(os.path.join(root, "flowers"), 1)
    batching = os.path.join(root, "batching.config")
    with open(batching, "w") as f:
        f.write(batching_config)
    with run_server("--model_name=flowers", f"--model_base_path={os.path.join(root, 'flowers')}",
                    f"--batching_parameters_file={batching}",
                    "--port=0", *petal_serve_args) as server:
        yield server


def worker_pid(master: int) -> int:
    """The first gunicorn worker of a `petal serve` master."""
    return int(subprocess.check_output(["pgrep", "-P", str(master)]).split()[0])


def children(pid: int) -> list[int]:
    """A process's children now, with no wait: for a test that acts the moment a worker is forked."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(child) for child in f.read().split()]


def check_watcher_keeps_running_config(config_file, running, refused: str, caplog, timeout_s: float) -> None:
    """A real Worker in this process watching `config_file` (--model_config_file, re-read every 0.05 s) while it
    serves the ModelServerConfig `running`: the file breaks a rule, so the watch logs `refused` within `timeout_s`,
    once however often it looks again; the models served and their labels stay as they were, and the watch thread
    ends once the worker drains."""
    import dataclasses
    import logging
    import threading

    from serving.options.config import ProcessOptions, ServerOptions
    from serving.process.worker import Worker

    def warnings() -> int:
        return sum(refused in str(getattr(r, "fields", {}).get("error")) for r in caplog.records)
    options = ServerOptions(process=ProcessOptions(model_config_file=str(config_file),
                                                   model_config_file_poll_wait_seconds=0.05))
    options = dataclasses.replace(options, dataplane=dataclasses.replace(
        options.dataplane, model_config=running, file_system_poll_wait_seconds=0, tensorflow_thread_nice=0))
    worker = Worker(options)
    with caplog.at_level(logging.WARNING, logger="serving.process.worker"):
        worker.start()
        try:
            deadline = time.monotonic() + timeout_s
            while not warnings() and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.5)  # ten more looks at the file
            assert warnings() == 1, "logged once, however often the watch looks again"
            assert worker.dataplane.model_names() == ["flowers"]
            assert worker.dataplane.version_labels() == {
                model.name: dict(model.version_labels) for model in running.model_config_list.config}
        finally:
            worker.drain()  # the watch ends once the worker drains
            worker.exit()
    watches = [t for t in threading.enumerate() if t.name == "petal-config"]
    for watch in watches:
        watch.join(5)
    assert not any(t.is_alive() for t in watches)
