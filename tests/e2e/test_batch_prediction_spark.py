"""`petal batch --engine=spark` on a real standalone Spark cluster (a master and two workers on 127.0.0.1, started
at most once per test process by tests/spark_cluster.py) and on `local[1]`.

Every input record comes out once, as a result or an error; the answers are the Beam job's on the same records;
a job started elsewhere with relative paths runs on both workers with the model shipped to them; a TFRecord file
cut short is one error line; a job that cannot start says so in one line, with exit status 2; and a task whose
executor Python worker is killed with SIGKILL is retried with no record lost or doubled. The executors run with a
`keras` on their path that fails when imported, so every job here also proves that they never import Keras.
"""
from __future__ import annotations

import base64
import glob
import gzip
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pyspark
import pytest

from batch_jobs import (
    assert_cut_tails_are_one_error_each,
    assert_each_fails_fast_in_one_line,
    assert_nothing_lost,
    failing_jobs,
    read_output,
    spark_env,
    write_cut_tfrecords,
    write_jsonl_input,
    write_tfrecord_input,
)
from load_tests.pixel_flood import flat_jpeg
from server_harness import ROOT, TF_NATIVE_LOG, tiny_model_base
from serving.batch_prediction import job as beam_job
from serving.batch_prediction import preflight, spark_job
from spark_cluster import CLUSTER_START_S, WORKERS, Cluster
from training import synth

GOOD = 30
GONE = "gone.jpg"  # a link to a deleted photo
CORRUPT = {"corrupt.jpg": "Invalid JPEG data", "empty.jpg": "Input is empty",
           "notes.jpg": "Unknown image file format",
           "bomb.jpg": "Image too large: 49000000 pixels exceeds the limit of 40000000 (--max_image_pixels)"}


@pytest.fixture(scope="session")
def spark(spark_cluster, tmp_path_factory):
    """This process as the driver of one application on the cluster, shared by the tests that run jobs in it."""
    os.environ.update(SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=sys.executable)
    session = (pyspark.sql.SparkSession.builder.master(spark_cluster.url).appName("petal-tests")
               .config(map={**spark_job.LOCAL_CONF, "spark.ui.enabled": "false", "spark.executor.memory": "1g",
                            "spark.executorEnv.PYTHONPATH": spark_env()["PYTHONPATH"],
                            "spark.executorEnv.TF_CPP_MIN_LOG_LEVEL": "3"})
               .getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    tracker, deadline = session.sparkContext.statusTracker(), time.monotonic() + CLUSTER_START_S
    while len(tracker.getExecutorInfos()) < WORKERS + 1:  # the driver is listed too
        assert time.monotonic() < deadline, "the workers' executors did not register"
        time.sleep(0.25)
    yield session
    session.stop()


@pytest.fixture(scope="session")
def model_dir() -> str:
    return tiny_model_base()


@pytest.fixture(scope="session")
def images(tmp_path_factory) -> dict[str, bytes]:
    """GOOD JPEGs and four files that must become error lines, by path: the last a real JPEG of 49 Mpx, over the
    default --max_image_pixels."""
    folder = tmp_path_factory.mktemp("spark-images")
    jpeg = synth.render("daisy", 0, min_size=40, max_size=64)
    files = {f"flower{i:03d}.jpg": synth.render(i % 5, i, min_size=40, max_size=64) for i in range(GOOD)}
    files.update({"corrupt.jpg": jpeg[:20] + bytes(len(jpeg) - 20), "empty.jpg": b"",
                  "notes.jpg": b"this is a text file, not an image\n", "bomb.jpg": flat_jpeg(7000)})
    for name, data in files.items():
        (folder / name).write_bytes(data)
    (folder / GONE).symlink_to(folder / "deleted.jpg")  # a record NOT_FOUND on both engines (Beam lost it)
    (folder / "album.jpg").mkdir()  # a folder, which neither engine takes for an image
    return {str(folder / name): data for name, data in files.items()}


def listed(images: dict[str, bytes]) -> list[str]:
    """The keys a job on the images' folder gives: each file's, and the link's to a deleted photo."""
    return [*images, os.path.join(os.path.dirname(next(iter(images))), GONE)]


def _good(images: dict[str, bytes]) -> list[str]:
    return sorted(p for p in images if os.path.basename(p) not in CORRUPT)


def write_input(kind: str, folder, images: dict[str, bytes]) -> tuple[str, list[str], dict[str, str]]:
    """An input pattern of `kind` in two or more files, with corrupt records mixed in, the keys it must give and,
    for TFRecords, the byte offsets their cut tails' errors must name (write_cut_tfrecords)."""
    good = _good(images)
    if kind == "images":
        return os.path.join(os.path.dirname(good[0]), "*"), listed(images), {}
    if kind == "tfrecord":
        keys = write_tfrecord_input(str(folder / "a.tfrecord"), images, good[:15])
        pattern, more, cuts = write_cut_tfrecords(folder, images, good[15:24])
        return pattern, keys + more, cuts
    corrupt = next(p for p in images if p.endswith("corrupt.jpg"))
    keys = write_jsonl_input(str(folder / "a.jsonl"), images, good[:20] + [corrupt])
    (folder / "b.jsonl.gz").write_bytes(gzip.compress("".join(json.dumps({"key": p, "image_bytes": {
        "b64": base64.b64encode(images[p]).decode()}}) + "\n" for p in good[20:]).encode()))  # Beam's crashed on it
    return str(folder / "*.jsonl*"), keys + good[20:], {}


def beam_lines(model_dir: str, pattern: str, output: str, capsys) -> tuple[list[dict], list[dict]]:
    assert beam_job.main(["--model_dir", model_dir, "--input", pattern, "--output_dir", output, "--batch_size",
                          "4", "--top_k", "2", "--runner", "FnApiRunner"]) == 0
    capsys.readouterr()
    return read_output(output)


def assert_same_answers(spark_rows: list[dict], beam_rows: list[dict]) -> None:
    spark_by_key = {row["key"]: row for row in spark_rows}
    beam_by_key = {row["key"]: row for row in beam_rows}
    assert spark_by_key.keys() == beam_by_key.keys()
    for key, row in spark_by_key.items():
        expected = beam_by_key[key]
        if "error" in row:
            assert row == expected
            continue
        # The same numbers up to float rounding: the two engines batch the records differently, and on a CPU
        # without oneDNN's kernels (AVX-512) a batch's composition moves a score in its 8th digit.
        np.testing.assert_allclose(row["prediction"].pop("probabilities"),
                                   expected["prediction"].pop("probabilities"), atol=1e-6)
        scores = [[entry.pop("score") for entry in r["prediction"]["top_k"]] for r in (row, expected)]
        np.testing.assert_allclose(*scores, atol=1e-6)
        assert row == expected


def spark_args(model_dir: str, pattern: str, output: str, *extra: str) -> list[str]:
    return ["--engine=spark", "--model_dir", model_dir, "--input", pattern, "--output_dir", output,
            "--batch_size", "4", "--top_k", "2", "--rows_per_partition", "8", *extra]


def assert_committed(output: str, summary: dict) -> None:
    """One shard per partition under its final name, and no attempt's leftovers."""
    assert sorted(os.listdir(output)) == sorted(
        [f"prediction.results-{i:05d}-of-{summary['partitions']:05d}" for i in range(summary["partitions"])]
        + ["prediction.errors_stats-00000-of-00001"])


@pytest.mark.parametrize("kind", ["images", "tfrecord", "jsonl"])
def test_the_cluster_gives_every_record_once_with_the_beam_jobs_answers(kind, spark, model_dir, images, tmp_path,
                                                                       capsys):
    (tmp_path / "in").mkdir()
    pattern, keys, cuts = write_input(kind, tmp_path / "in", images)
    output = str(tmp_path / "spark")
    summary = spark_job.run(spark_job.parse_args(spark_args(model_dir, pattern, output)), spark)
    assert summary["complete"] and summary["partitions"] >= 2
    assert summary["rows_in"] == summary["results"] + summary["errors"] == len(keys)
    assert summary["batches"] * 4 == summary["results"] + summary["padding_rows"]
    results, errors = read_output(output)
    assert_nothing_lost(results, errors, keys)
    assert_committed(output, summary)
    beam_results, beam_errors = beam_lines(model_dir, pattern, str(tmp_path / "beam"), capsys)
    assert_same_answers(results + errors, beam_results + beam_errors)
    assert len(errors) >= 2 and {e["error"]["status"] for e in errors} <= {"INVALID_ARGUMENT", "DATA_LOSS", "NOT_FOUND"}
    assert (kind == "images") == any(e["error"]["status"] == "NOT_FOUND" for e in errors)
    if kind == "images":
        messages = {os.path.basename(e["key"]): e["error"]["message"] for e in errors}
        assert all(text in messages[name] for name, text in CORRUPT.items()), messages
    assert_cut_tails_are_one_error_each(errors, cuts)


def shipped_copies(cluster: Cluster) -> dict[str, set[str]]:
    """The model copies each worker's executors unpacked from the archives jobs shipped, by worker."""
    return {folder: set(glob.glob(os.path.join(folder, "*", "*", "model-*.tar", "*", "*", "saved_model.pb")))
            for folder in cluster.work_dirs}


def test_relative_paths_from_another_folder_run_on_both_workers_with_the_model_shipped(
        spark, spark_cluster, model_dir, images, tmp_path, monkeypatch):
    """The driver's working directory is neither worker's; the model and inputs are named relative to it."""
    driver = tmp_path / "driver"
    (driver / "photos").mkdir(parents=True)
    shutil.copytree(model_dir, driver / "models" / "flowers")
    for path, data in images.items():
        (driver / "photos" / os.path.basename(path)).write_bytes(data)
    before = shipped_copies(spark_cluster)
    monkeypatch.chdir(driver)
    summary = spark_job.run(spark_job.parse_args(spark_args("models/flowers", "photos/*", "out")), spark)
    assert summary["complete"] and summary["partitions"] >= WORKERS
    assert summary["rows_in"] == summary["results"] + summary["errors"] == len(images)
    assert summary["model"] == str(driver / "models" / "flowers" / "1")
    results, errors = read_output(str(driver / "out"))
    assert_nothing_lost(results, errors, [str(driver / "photos" / os.path.basename(p)) for p in images])
    new = {folder: copies - before[folder] for folder, copies in shipped_copies(spark_cluster).items()}
    assert all(len(copies) == 1 for copies in new.values()), new  # so each worker's executor ran tasks


def event_log(folder: str) -> list[dict]:
    """The one application's events, from Spark's rolling event log (a folder of `events_<n>_<app>` files),
    written uncompressed for the test."""
    (app,) = os.listdir(folder)
    parts = sorted(glob.glob(os.path.join(folder, app, "events_*")),
                   key=lambda p: int(os.path.basename(p).split("_")[1]))
    return [json.loads(line) for part in parts for line in open(part)]


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def python_workers_under(ancestors: tuple[int, ...]) -> set[int]:
    """PySpark's Python workers below the processes: the children their daemons fork for tasks."""
    workers = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or "pyspark.daemon" not in _cmdline(int(entry)):
            continue
        pid = parent = int(entry)
        if "pyspark.daemon" not in _cmdline(_parent(pid)):
            continue  # the daemon itself
        while parent > 1 and parent not in ancestors:
            parent = _parent(parent)
        if parent in ancestors:
            workers.add(pid)
    return workers


def _loaded_tensorflow(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/maps") as f:
            return "libtensorflow_framework" in f.read()
    except OSError:
        return False


def kill_first_new_worker(ancestors: tuple[int, ...], before: set[int], stop: threading.Event,
                          killed: list[int]) -> None:
    """SIGKILLs the first Python worker forked after `before` once it has begun to import TensorFlow: it is then
    running its task's code, and importing the rest of TensorFlow and loading the model take it seconds more, so
    the kill lands inside a running task (a kill during the worker's handshake could be hidden by Spark
    restarting its daemon)."""
    while not stop.is_set():
        started = [pid for pid in python_workers_under(ancestors) - before if _loaded_tensorflow(pid)]
        if started:
            os.kill(started[0], signal.SIGKILL)
            killed.append(started[0])
            return
        time.sleep(0.02)


def test_a_task_whose_python_worker_is_killed_is_retried_with_no_record_lost_or_doubled(
        spark, spark_cluster, model_dir, images, tmp_path):
    idle = python_workers_under(spark_cluster.worker_pids)
    for pid in idle:  # so that the job's first task forks a fresh worker, which the killer can catch cold
        os.kill(pid, signal.SIGKILL)
    output = str(tmp_path / "out")
    args = spark_job.parse_args(spark_args(model_dir, os.path.join(os.path.dirname(next(iter(images))), "*"),
                                           output))
    stop, killed = threading.Event(), []
    killer = threading.Thread(target=kill_first_new_worker, args=(spark_cluster.worker_pids, idle, stop, killed))
    killer.start()
    context = spark.sparkContext
    context.setJobGroup("killed-worker", "a Python worker is killed during the first task")
    try:
        summary = spark_job.run(args, spark)
    finally:
        stop.set()
        killer.join()
        context.setLocalProperty("spark.jobGroup.id", None)
    assert killed, "no Python worker was started for the job"
    tracker = context.statusTracker()
    stages = [s for job in tracker.getJobIdsForGroup("killed-worker") for s in tracker.getJobInfo(job).stageIds]
    assert sum(tracker.getStageInfo(s).numFailedTasks for s in stages) >= 1, "no task failed: the kill missed"
    assert summary["complete"] and summary["rows_in"] == len(listed(images)) == summary["results"] + summary["errors"]
    results, errors = read_output(output)
    assert_nothing_lost(results, errors, listed(images))
    assert_committed(output, summary)


def test_local_1_runs_from_the_cli_with_an_event_log(model_dir, images, tmp_path):
    (tmp_path / "in").mkdir()
    pattern, keys, _ = write_input("jsonl", tmp_path / "in", images)
    output, events = str(tmp_path / "out"), str(tmp_path / "events")
    env = {k: v for k, v in spark_env().items() if k != "PYSPARK_PYTHON"}  # local[N] finds its own Python
    done = subprocess.run([sys.executable, "-m", "petal", "batch", *spark_args(
        model_dir, pattern, output, "--spark_master", "local[1]", "--spark_event_log_dir", events,
        "--spark_conf", "spark.eventLog.compress=false")],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    # the executor's TensorFlow start-up lines, twice, until it imported TensorFlow as the driver does
    assert not [line for line in done.stderr.splitlines() if TF_NATIVE_LOG.match(line)
                or "All log messages before absl::InitializeLog()" in line], done.stderr
    # the driver JVM's own start-up lines under Spark's default log4j profile (its name, "Setting default log level
    # to WARN", warnings about the host name and native Hadoop libraries)
    assert not re.search(r"log4j|Setting default log level| WARN ", done.stderr), done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert (summary["engine"], summary["rows_in"], summary["complete"]) == ("spark", len(keys), True)
    results, errors = read_output(output)
    assert_nothing_lost(results, errors, keys)
    assert_committed(output, summary)
    names = [e["Event"] for e in event_log(events)]
    assert names.count("SparkListenerTaskEnd") == summary["partitions"] and names[-1] == "SparkListenerApplicationEnd"


def test_bad_flags_and_a_used_output_dir_stop_before_spark_starts(model_dir, images, tmp_path, capsys):
    with pytest.raises(SystemExit):
        spark_job.parse_args(spark_args(model_dir, "x", "o", "--rows_per_partition", "0"))
    assert "--rows_per_partition must be at least 1" in capsys.readouterr().err
    for master in ("bogus", "local[x]", "spark://"):  # Spark said so in a Java stack trace, after starting a JVM
        with pytest.raises(SystemExit):
            spark_job.parse_args(spark_args(model_dir, "x", "o", "--spark_master", master))
        assert f"--spark_master {master!r} is not a Spark master URL" in capsys.readouterr().err
    for master in ("local", "local[2]", "local[*]", "local[4,2]", "spark://127.0.0.1:7077,localhost:7077", "yarn",
                   "k8s://https://127.0.0.1:6443"):
        assert spark_job.parse_args(spark_args(model_dir, "x", "o", "--spark_master", master)).spark_master == master
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "prediction.results-00000-of-00001").write_text("{}\n")
    assert spark_job.main(spark_args(model_dir, next(iter(images)), str(tmp_path / "used"))) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert os.listdir(tmp_path / "used") == ["prediction.results-00000-of-00001"]


def test_a_job_that_cannot_start_exits_2_in_seconds_with_one_line_before_the_cluster_is_asked(
        spark_cluster, model_dir, images, tmp_path, capfd):
    """Each failure the driver can see ends the job before any task, with no Spark traceback, in seconds where
    failing every task on the cluster (a model without its variables, before) took tens of them."""
    pattern = os.path.join(os.path.dirname(next(iter(images))), "*")
    jobs = failing_jobs(tmp_path, model_dir, pattern, "--engine=spark", "--spark_master", spark_cluster.url)
    with socket.socket() as closed:  # bound, never listening: a connection to it is refused
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
        jobs["no master answers"] = ["--model_dir", model_dir, "--input", pattern, "--output_dir",
                                     str(tmp_path / "out"), "--engine=spark", "--spark_master",
                                     f"spark://127.0.0.1:{port},localhost:{port}"]
        assert_each_fails_fast_in_one_line(jobs, capfd)
    assert not (tmp_path / "out").exists()


def test_a_master_that_answers_passes_the_check_in_any_spelling():
    """Any one address of an HA list that takes a connection will do, IPv6 in brackets too; a list none of whose
    addresses answers is refused naming each."""
    with socket.create_server(("127.0.0.1", 0)) as v4, socket.create_server(("::1", 0), family=socket.AF_INET6) as v6:
        up4, up6 = v4.getsockname()[1], v6.getsockname()[1]
        with socket.socket() as closed:
            closed.bind(("127.0.0.1", 0))
            down = closed.getsockname()[1]
            for master in (f"spark://127.0.0.1:{up4}", f"spark://127.0.0.1:{down},localhost:{up4}",
                           f"spark://[::1]:{up6}", "local[2]", None):
                spark_job.check_master(master)
            with pytest.raises(preflight.CannotStart, match=f"127.0.0.1:{down}: Connection refused; nohost: "):
                spark_job.check_master(f"spark://127.0.0.1:{down},nohost")


def test_spark_failing_once_asked_is_one_line_and_exit_1(model_dir, images, tmp_path):
    """What Spark raises once it is asked (here its JVM does not start: a heap too small) ends the job in one
    line, exit 1, not Py4J's or PySpark's traceback, and leaves the output folder as empty as it found it."""
    done = subprocess.run([sys.executable, "-m", "petal", "batch", *spark_args(
        model_dir, os.path.join(os.path.dirname(next(iter(images))), "*"), str(tmp_path / "out"),
        "--spark_master", "local[1]", "--spark_conf", "spark.driver.memory=1k")],
        capture_output=True, text=True, cwd=ROOT, env=spark_env(), timeout=120)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.splitlines()[-1] == ("petal batch: error: Spark: [JAVA_GATEWAY_EXITED] Java gateway process "
                                            "exited before sending its port number."), done.stderr[-3000:]
    assert os.listdir(tmp_path / "out") == []  # so that the same command runs once the cause is mended


def test_the_keras_tripwire_on_the_executors_fires(spark):
    """The other jobs here pass only if no executor imports Keras: this proves an import would fail them."""

    def import_keras(_):
        try:
            __import__("keras")
        except RuntimeError as error:
            return str(error)
        return "keras imported"

    assert spark.sparkContext.parallelize([0], 1).map(import_keras).collect() == [
        "keras was imported in a batch worker"]
