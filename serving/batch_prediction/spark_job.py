"""`petal batch --engine=spark`: the batch job as a plain Apache Spark job, on `local[N]`, a standalone cluster,
YARN (EMR, Dataproc), Kubernetes or Databricks.

This module is the driver's side. Before it asks Spark for anything it makes every local path absolute, loads the
model and checks its signature, lists the inputs and proves the output folder writable
(serving/batch_prediction/preflight.py), so a job that cannot run stops in seconds with one line and exit status 2.
It then cuts the inputs into partitions: one per TFRecord or JSON Lines file (its records stream through one batch
at a time), and `--rows_per_partition` paths per partition for image files and file lists. Each task
(serving/batch_prediction/spark_tasks.py) reads, decodes, batches, predicts and formats its records with
serving/batch_prediction/steps.py, the code the Beam job runs, so both engines give the same lines for the same
records.

A task writes its shard under `_temporary/` and renames it to `prediction.results-<partition>-of-<N>` when it has
finished, so a retried or speculative attempt leaves exactly one copy (attempts of one partition write the same
lines). Errors are few: each task's go to `_temporary/` too, and the driver joins the successful attempts' into
the one errors file. The summary counts come back with each task's result, so a retried task is not counted
twice, and the job fails (exit 1) unless rows in = results + errors and every partition's shard is there.

Files are read and written through Petal's storage layer (exported_models/storage.py) on the driver and the
executors alike: local and mounted paths (NFS, /dbfs), and object stores (s3://, gs://, az://), whose environment
the executors get as any Spark job's do (spark.executorEnv.*). On a cluster (any master but `local[...]`) a model
in a local folder is shipped with the job as an archive, since an executor on another machine cannot read the
driver's disk; one on a store is downloaded by each executor process (docs/batch.md, 'On a cluster').
"""
from __future__ import annotations

import argparse
import atexit
import functools
import logging
import math
import os
import re
import shutil
import socket
import sys
import tarfile
import tempfile
import threading
import time
import uuid
from typing import Any

from py4j.protocol import Py4JError
from pyspark.errors import PySparkException
from pyspark.sql import SparkSession

from exported_models import storage
from serving.batch_prediction import preflight, steps
from serving.batch_prediction.cli import add_job_flags, check_job_flags, quiet, run_and_report
from serving.batch_prediction.spark_tasks import PartitionJob, score_partition
from serving.batch_prediction.steps import TEMPORARY
from training import PROGRESS_LOGGER

logger = logging.getLogger(__name__)
progress = logging.getLogger(PROGRESS_LOGGER)  # INFO even when quiet: see petal.configure_logging

PROGRESS_SECONDS = 10.0
# On local[N], every listener stays on loopback: a laptop's job must not open ports to the network.
QUIET_LOG4J2 = os.path.join(os.path.dirname(os.path.abspath(__file__)), "spark_log4j2.properties")
LOCAL_CONF: dict[str, Any] = {"spark.driver.host": "127.0.0.1", "spark.driver.bindAddress": "127.0.0.1"}
MASTER_CONNECT_SECONDS = 5.0
# The master URLs SparkContext takes: its local forms, a standalone or Kubernetes master, YARN
MASTER_URL = re.compile(r"local(\[(\d+|\*)(\s*,\s*\d+)?\]|-cluster\[\s*\d+\s*,\s*\d+\s*,\s*\d+\s*\])?"
                        r"|yarn|(spark|k8s)://.+")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="petal batch --engine=spark", description=__doc__.split("\n\n")[0],
        epilog="Under spark-submit, leave --spark_master out: the master, executors and cores are spark-submit's.")
    add_job_flags(parser)
    parser.add_argument("--spark_master", default=None,
                        help="local[N], spark://host:port, yarn, k8s://...; default: spark-submit's, else local[*]")
    parser.add_argument("--rows_per_partition", type=int, default=1000,
                        help="image paths per task (record files are one task each): a retried task redoes "
                             "this many, and each task writes one results shard")
    parser.add_argument("--spark_event_log_dir", default=None,
                        help="turn on Spark's event log into this folder, for the history server")
    parser.add_argument("--spark_conf", action="append", default=[], metavar="KEY=VALUE",
                        help="any Spark setting, repeatable (spark-submit's --conf does the same)")
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_job_flags(parser, args)
    if args.rows_per_partition < 1:
        parser.error("--rows_per_partition must be at least 1")
    if any("=" not in setting for setting in args.spark_conf):
        parser.error("--spark_conf takes KEY=VALUE")
    if args.spark_master is not None and not MASTER_URL.fullmatch(args.spark_master):
        # Spark says so only in a Java stack trace, after a JVM has started
        parser.error(f"--spark_master {args.spark_master!r} is not a Spark master URL: local, local[N], local[*], "
                     "spark://HOST:PORT, yarn or k8s://...")
    preflight.resolve_paths(args, ("spark_event_log_dir",))
    return args


def list_units(pattern: str, input_format: str, rows_per_partition: int) -> tuple[list[Any], int]:
    """The partitions' inputs: lists of image paths, or record files one each; and how many paths were listed."""
    files = preflight.check_inputs(pattern, input_format)
    if input_format in ("tfrecord", "jsonl"):
        return files, 0
    paths = files
    if input_format == "filelist":
        with preflight.on_store("--input", pattern):
            paths = [path for list_file in files for path in steps.read_file_list(list_file)]
    count = math.ceil(len(paths) / rows_per_partition)
    return [paths[i * rows_per_partition:(i + 1) * rows_per_partition] for i in range(count)], len(paths)


def ship_model(spark: SparkSession, info: steps.ModelInfo) -> str | None:
    """On a cluster, the model's version folder as an archive added to the job, which Spark unpacks beside every
    executor (spark_tasks.PartitionJob.executor_info reads it there); None where the executors read the driver's
    paths (`local[...]`) or the model is a URL, which every worker resolves itself.

    Shipping rather than refusing, so that a model exported on this machine runs on any cluster as it is; a URL
    (gs://, hdfs://, or file:///… for a folder every node mounts) opts out of the copy. The archive is not
    compressed (variables hardly compress) and stays until this process exits, since an executor that joins
    later fetches it too."""
    if str(spark.sparkContext.master).startswith("local") or steps.shared_path(info.path):
        return None
    folder = tempfile.mkdtemp(prefix="petal-model-")
    atexit.register(shutil.rmtree, folder, True)
    archive = os.path.join(folder, f"model-{uuid.uuid4().hex}.tar")
    with tarfile.open(archive, "w", dereference=True) as tar:
        tar.add(info.path, arcname=steps.version_name(info.path))
    spark.sparkContext.addArchive(archive)
    logger.info("model shipped with the job", extra={"fields": {
        "model": info.path, "archive": os.path.basename(archive), "bytes": os.path.getsize(archive)}})
    return os.path.basename(archive)


def check_master(master: str | None) -> None:
    """A standalone master (spark://host:port, or an HA list host1:port1,host2:port2) must take a connection: Spark
    itself tries each for a minute and then fails with a stopped SparkContext's Java traceback."""
    if not master or not master.startswith("spark://"):
        return
    reasons = []
    for address in master.removeprefix("spark://").split(","):
        host, _, port = address.rpartition(":")
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=MASTER_CONNECT_SECONDS).close()
            return
        except (OSError, ValueError) as error:
            reasons.append(f"{address}: {error.strerror if isinstance(error, OSError) and error.strerror else error}")
    raise preflight.CannotStart(f"--spark_master {master}: no master answers ({'; '.join(reasons)})")


def start_session(args: argparse.Namespace) -> SparkSession:
    builder = (SparkSession.builder.appName("petal batch").config("spark.ui.showConsoleProgress", "true")
               .config("spark.executorEnv.TF_CPP_MIN_LOG_LEVEL", os.environ.get("TF_CPP_MIN_LOG_LEVEL", "3")))
    if args.spark_master:
        builder = builder.master(args.spark_master)
        if args.spark_master.startswith("local"):
            builder = builder.config(map=LOCAL_CONF)
            os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # the Python workers' is this one, with Petal
    if args.spark_event_log_dir:
        storage.makedirs(args.spark_event_log_dir)
        builder = builder.config("spark.eventLog.enabled", "true").config("spark.eventLog.dir",
                                                                          args.spark_event_log_dir)
    if quiet():  # read as the driver's JVM starts, so before any of its lines
        builder = builder.config("spark.driver.extraJavaOptions", f"-Dlog4j2.configurationFile={QUIET_LOG4J2}")
    for setting in args.spark_conf:
        builder = builder.config(*setting.split("=", 1))
    spark = builder.getOrCreate()
    if quiet():
        spark.sparkContext.setLogLevel("ERROR")
    return spark


def log_progress(spark: SparkSession, partitions: int, done: threading.Event) -> None:
    """Tasks finished so far, now and then, beside Spark's own console bar and UI."""
    tracker = spark.sparkContext.statusTracker()
    started = time.monotonic()
    while not done.wait(PROGRESS_SECONDS):
        stages = [tracker.getStageInfo(s) for s in tracker.getActiveStageIds()]
        finished = sum(s.numCompletedTasks for s in stages if s)
        progress.info("batch progress", extra={"fields": {
            "partitions_done": finished, "partitions": partitions, "seconds": round(time.monotonic() - started)}})


def run(args: argparse.Namespace, spark: SparkSession | None = None) -> dict[str, Any]:
    """Runs the job to completion on `spark` (or a session of its own) and returns the summary; what the driver
    can check (preflight) fails before Spark starts."""
    if spark is None:
        check_master(args.spark_master)
    info = preflight.load_model(args)
    units, paths = list_units(args.input, args.input_format, args.rows_per_partition)
    preflight.check_output_dir(args.output_dir, args.overwrite)
    own_session = spark is None
    spark = start_session(args) if spark is None else spark
    temporary = storage.join(args.output_dir, TEMPORARY)  # once Spark runs: a failed start leaves nothing behind
    storage.makedirs(temporary)
    job = PartitionJob(info, args.input_format, args.output_dir.rstrip("/"), len(units), args.batch_size,
                       args.top_k, args.use_tpu, args.tpu, args.max_image_pixels, ship_model(spark, info))
    logger.info("batch job starting", extra={"fields": {
        "engine": "spark", "model": info.path, "input": args.input, "format": args.input_format,
        "output_dir": args.output_dir, "batch_size": args.batch_size, "partitions": job.partitions,
        "model_archive": job.model_archive}})
    started = time.monotonic()
    done = threading.Event()
    threading.Thread(target=log_progress, args=(spark, job.partitions, done), daemon=True).start()
    try:  # a partial of a function in spark_tasks: unpickling it imports nothing of the driver's
        tasks = (spark.sparkContext.parallelize(units, job.partitions)
                 .mapPartitionsWithIndex(functools.partial(score_partition, job)).collect())
    finally:
        done.set()
        if own_session:
            spark.stop()
    seconds = time.monotonic() - started
    # the successful attempts' errors, in partition order, as the one errors file
    steps.join_files([job.errors_part(index) for index in range(job.partitions)],
                     storage.join(job.output_dir, steps.ERRORS_FILE))
    storage.remove_tree(temporary)
    counts = steps.Counts()
    for _, task_counts, _, _ in tasks:
        counts.add(steps.Counts(**task_counts))
    shards = sorted(index for index, *_ in tasks)
    written = storage.list_files(job.output_dir)
    missing = [i for i in range(job.partitions) if os.path.basename(job.results_path(i)) not in written]
    verified = shards == list(range(job.partitions)) and not missing and (not paths or paths == counts.read)
    processing = max(t[3] for t in tasks) - min(t[2] for t in tasks) if tasks else 0.0
    return steps.summary(info, args.output_dir, counts, seconds, processing, verified=verified,
                         engine="spark", partitions=job.partitions)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        return run_and_report(lambda: run(args), args.output_dir)
    except (Py4JError, PySparkException) as error:  # Spark failed once asked: its first line, not Py4J's traceback
        print(f"petal batch: error: Spark: {preflight.first_line(error)}", file=sys.stderr)
        return 1
