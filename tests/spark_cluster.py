"""A standalone Spark cluster on 127.0.0.1 (a master and two workers, from PyPI's pyspark and the system's JVM), which
the `spark_cluster` fixture of tests/e2e/conftest.py starts at most once per test process for the Spark tests of
test_batch_prediction_spark.py and test_batch_object_storage.py. A process that ran both modules started two
before, each of whose starts took 45 s in a loaded CI run (8-11 s on a quiet 2-core machine).

Each worker offers 2 cores and the master gives an application that asks for no core count 2 of them, one on each
worker (spark.deploy.defaultCores; spreading out is the master's default): so the tests' shared application holds
an executor on each worker, and a job submitted beside it, as docs/batch.md types it, still gets one on each too.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pyspark

from batch_jobs import spark_env
from server_harness import free_ports

SPARK_CLASS = os.path.join(os.path.dirname(pyspark.__file__), "bin", "spark-class")
CLUSTER_START_S = 120
WORKERS = 2
WORKER_CORES = 2  # an executor for the shared application and one for a job beside it
APP_CORES = WORKERS  # what an application gets unless it asks otherwise: one core on each worker


@dataclass(frozen=True)
class Cluster:
    url: str
    worker_pids: tuple[int, ...]
    work_dirs: tuple[str, ...]  # each worker's SPARK_WORKER_DIR, where its executors run and unpack shipped archives


def _stop(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=30)


@contextmanager
def running_cluster(folder: Path) -> Iterator[Cluster]:
    """The master and its workers, each with a folder of its own, up once the master lists every worker as ALIVE.
    Every daemon binds to 127.0.0.1 only."""
    port, master_ui, *worker_uis = free_ports(2 + WORKERS)
    env = {**spark_env(), "SPARK_LOG_DIR": str(folder)}
    processes: list[subprocess.Popen] = []
    deadline = time.monotonic() + CLUSTER_START_S

    def start(name: str, *argv: str, env: dict[str, str] = env) -> None:
        with open(folder / f"{name}.log", "wb") as log:
            processes.append(subprocess.Popen([SPARK_CLASS, *argv], env=env, stdout=log, stderr=subprocess.STDOUT))

    def wait(name: str, ready) -> None:
        """Waits until `ready` holds: a worker started before its master has answered waits seconds for its next
        registration attempt."""
        while not ready():
            assert all(p.poll() is None for p in processes), (folder / f"{name}.log").read_text()[-3000:]
            assert time.monotonic() < deadline, f"the Spark {name} was not ready in {CLUSTER_START_S} s"
            time.sleep(0.25)

    try:
        start("master", "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1", "--port", str(port),
              "--webui-port", str(master_ui),
              env={**env, "SPARK_MASTER_OPTS": f"-Dspark.deploy.defaultCores={APP_CORES}"})
        wait("master", lambda: _master_state(master_ui) is not None)
        work_dirs = tuple(str(folder / f"work-{i}") for i in range(WORKERS))
        for i, worker_ui in enumerate(worker_uis):
            start(f"worker-{i}", "org.apache.spark.deploy.worker.Worker", f"spark://127.0.0.1:{port}", "--host",
                  "127.0.0.1", "--cores", str(WORKER_CORES), "--memory", "2g", "--webui-port", str(worker_ui),
                  env={**env, "SPARK_WORKER_DIR": work_dirs[i]})
        wait("workers", lambda: _alive_workers(master_ui) == WORKERS)
        yield Cluster(f"spark://127.0.0.1:{port}", tuple(p.pid for p in processes[1:]), work_dirs)
    finally:
        for process in reversed(processes):
            _stop(process)


def _master_state(master_ui: int) -> dict | None:
    """The master's status page as JSON, or None while it does not answer yet: its web UI can accept connections
    and answer an empty body before the page is mounted (CI of f3e092d failed on that)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{master_ui}/json/", timeout=5) as response:
            return json.load(response)
    except (OSError, ValueError):
        return None


def _alive_workers(master_ui: int) -> int:
    state = _master_state(master_ui)
    return 0 if state is None else sum(w["state"] == "ALIVE" for w in state["workers"])
