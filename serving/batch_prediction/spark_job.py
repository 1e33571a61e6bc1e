"""`petal batch --engine=spark`: the batch job as a plain Apache Spark job, on `local[N]`, a standalone cluster,
YARN (EMR, Dataproc), Kubernetes or Databricks.

The driver lists the inputs and cuts them into partitions: one per TFRecord or JSON Lines file (its records
stream through one batch at a time), and `--rows_per_partition` paths per partition for image files and file
lists. Each task reads, decodes, batches, predicts and formats its records with serving/batch_prediction/core.py, the
code the Beam job runs, so both engines give the same lines for the same records. The model loads once per executor
Python worker (Spark reuses them across tasks) with TensorFlow's thread pools sized to the task's cores.

A task writes its shard under `_temporary/` and renames it to `prediction.results-<partition>-of-<N>` when it has
finished, so a retried or speculative attempt leaves exactly one copy (attempts of one partition write the same
lines). Errors are few: each task's go to `_temporary/` too, and the driver joins the successful attempts' into
the one errors file. The summary counts come back with each task's result, so a retried task is not counted
twice, and the job fails (exit 1) unless rows in = results + errors and every partition's shard is there.

Paths are opened by TensorFlow's filesystems on the executors: local and mounted paths (NFS, /dbfs), gs:// and
hdfs://.
"""
from __future__ import annotations

import argparse
import logging
import math
import os
import posixpath
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from itertools import chain
from typing import Any

import tensorflow as tf
from pyspark import TaskContext
from pyspark.sql import SparkSession

from serving.batch_prediction import core
from serving.batch_prediction.cli import add_job_flags, check_job_flags, run_and_report
from training import PROGRESS_LOGGER

logger = logging.getLogger(__name__)
progress = logging.getLogger(PROGRESS_LOGGER)  # INFO even when quiet: see petal.configure_logging

TEMPORARY = "_temporary"
PROGRESS_SECONDS = 10.0
# On local[N], every listener stays on loopback: a laptop's job must not open ports to the network.
LOCAL_CONF: dict[str, Any] = {"spark.driver.host": "127.0.0.1", "spark.driver.bindAddress": "127.0.0.1"}


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
    return args


@dataclass(frozen=True)
class PartitionJob:
    """Everything a task needs, shipped to the executors with the partition function."""

    info: core.ModelInfo
    input_format: str
    output_dir: str
    partitions: int
    batch_size: int
    top_k: int
    use_tpu: bool
    tpu: str | None

    def results_path(self, index: int) -> str:
        return posixpath.join(self.output_dir, f"{core.RESULTS_PREFIX}-{index:05d}-of-{self.partitions:05d}")

    def errors_part(self, index: int) -> str:
        return posixpath.join(self.output_dir, TEMPORARY, f"errors-{index:05d}")


def _open(path: str):
    return tf.io.gfile.GFile(path, "rb")


def list_units(pattern: str, input_format: str, rows_per_partition: int) -> tuple[list[Any], int]:
    """The partitions' inputs: lists of image paths, or record files one each; and how many paths were listed."""
    files = sorted(f for f in tf.io.gfile.glob(pattern) if not tf.io.gfile.isdir(f))  # as Beam's MatchFiles
    if not files:
        raise FileNotFoundError(f"--input {pattern} matches no files (format {input_format})")
    if input_format in ("tfrecord", "jsonl"):
        return files, 0
    paths = files
    if input_format == "filelist":
        paths = []
        for list_file in files:
            with tf.io.gfile.GFile(list_file) as f:
                paths += [p for p in (core.file_list_path(list_file, line) for line in f) if p]
    count = math.ceil(len(paths) / rows_per_partition)
    return [paths[i * rows_per_partition:(i + 1) * rows_per_partition] for i in range(count)], len(paths)


def _read(input_format: str, mode: str, unit: Any) -> Iterator[core.Record | core.Failure]:
    if input_format == "tfrecord":
        return core.read_tfrecord_file(unit, mode)
    if input_format == "jsonl":
        return core.read_jsonl_file(unit, _open, mode)
    return (core.read_file(path, _open) for path in unit)


_models: dict[tuple, tuple[core.BatchModel, core.ImageDecoder | core.PayloadDecoder]] = {}


def _task() -> TaskContext:
    """The running task's context, which Spark sets in every task (and these functions run only in tasks)."""
    context = TaskContext.get()
    assert context is not None
    return context


def _model(job: PartitionJob) -> tuple[core.BatchModel, core.ImageDecoder | core.PayloadDecoder]:
    """The model and decoder of this executor Python worker, loaded by its first task and kept for the others.

    TensorFlow's pools can only be sized before its runtime starts, so the first task sizes them to the cores
    Spark gives a task (spark.task.cpus): the executor's other cores run other tasks' workers.
    """
    key = (job.info, job.batch_size, job.use_tpu, job.tpu)
    if key not in _models:
        if not _models:
            cpus = _task().cpus()
            tf.config.threading.set_intra_op_parallelism_threads(cpus)
            tf.config.threading.set_inter_op_parallelism_threads(cpus)
        _models[key] = (core.load_model(job.info, job.batch_size, job.use_tpu, job.tpu), core.make_decoder(job.info))
    return _models[key]


def score_partition(job: PartitionJob, index: int, units: Iterable[Any]) -> Iterator[tuple[int, dict, float,
                                                                                            float]]:
    """One task: its records to a results shard and an errors part, committed by rename once complete.

    Its time is stamped once the model is there, so the job's processing rate leaves the workers' start-up
    and the model's loading out."""
    model, decoder = _model(job)
    started = time.time()
    scorer = core.Scorer(decoder, model, job.info, job.top_k)
    attempt = posixpath.join(job.output_dir, TEMPORARY, f"attempt-{index:05d}-{_task().taskAttemptId()}")
    with tf.io.gfile.GFile(f"{attempt}.results", "w") as results, tf.io.gfile.GFile(f"{attempt}.errors", "w") as errors:
        for out in (results, errors):
            out.write("")  # GFile creates its file on the first write, and an empty shard must exist too
        records = chain.from_iterable(_read(job.input_format, job.info.mode, u) for u in units)
        for is_result, line in scorer.score(records):
            (results if is_result else errors).write(line + "\n")
    tf.io.gfile.rename(f"{attempt}.errors", job.errors_part(index), overwrite=True)
    tf.io.gfile.rename(f"{attempt}.results", job.results_path(index), overwrite=True)
    yield index, asdict(scorer.counts), started, time.time()


def join_errors(job: PartitionJob) -> None:
    """The successful attempts' errors, in partition order, as the one errors file (written, then renamed)."""
    final = posixpath.join(job.output_dir, core.ERRORS_FILE)
    with tf.io.gfile.GFile(f"{final}.tmp", "w") as out:
        for index in range(job.partitions):
            with tf.io.gfile.GFile(job.errors_part(index)) as part:
                out.write(part.read())
    tf.io.gfile.rename(f"{final}.tmp", final, overwrite=True)


def start_session(args: argparse.Namespace) -> SparkSession:
    builder = (SparkSession.builder.appName("petal batch").config("spark.ui.showConsoleProgress", "true")
               .config("spark.executorEnv.TF_CPP_MIN_LOG_LEVEL", os.environ.get("TF_CPP_MIN_LOG_LEVEL", "3")))
    if args.spark_master:
        builder = builder.master(args.spark_master)
        if args.spark_master.startswith("local"):
            builder = builder.config(map=LOCAL_CONF)
            os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # the Python workers' is this one, with Petal
    if args.spark_event_log_dir:
        tf.io.gfile.makedirs(args.spark_event_log_dir)
        builder = builder.config("spark.eventLog.enabled", "true").config("spark.eventLog.dir",
                                                                          args.spark_event_log_dir)
    for setting in args.spark_conf:
        builder = builder.config(*setting.split("=", 1))
    spark = builder.getOrCreate()
    if logging.getLogger().getEffectiveLevel() > logging.INFO:
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
    """Runs the job to completion on `spark` (or a session of its own) and returns the summary."""
    info = core.read_model_info(args.model_dir, args.signature_name, args.method, args.input_format)
    units, paths = list_units(args.input, args.input_format, args.rows_per_partition)
    core.prepare_output_dir(args.output_dir, args.overwrite, tf.io.gfile.glob,
                            lambda old: [tf.io.gfile.remove(p) for p in old])
    temporary = posixpath.join(args.output_dir, TEMPORARY)
    if tf.io.gfile.exists(temporary):
        tf.io.gfile.rmtree(temporary)
    tf.io.gfile.makedirs(temporary)
    job = PartitionJob(info, args.input_format, args.output_dir.rstrip("/"), len(units), args.batch_size,
                       args.top_k, args.use_tpu, args.tpu)
    logger.info("batch job starting", extra={"fields": {
        "engine": "spark", "model": info.path, "input": args.input, "format": args.input_format,
        "output_dir": args.output_dir, "batch_size": args.batch_size, "partitions": job.partitions}})
    own_session = spark is None
    spark = start_session(args) if spark is None else spark
    started = time.monotonic()
    done = threading.Event()
    threading.Thread(target=log_progress, args=(spark, job.partitions, done), daemon=True).start()
    try:
        tasks = (spark.sparkContext.parallelize(units, job.partitions)
                 .mapPartitionsWithIndex(lambda index, part: score_partition(job, index, part)).collect())
    finally:
        done.set()
        if own_session:
            spark.stop()
    seconds = time.monotonic() - started
    join_errors(job)
    tf.io.gfile.rmtree(temporary)
    counts = core.Counts()
    for _, task_counts, _, _ in tasks:
        counts.add(core.Counts(**task_counts))
    shards = sorted(index for index, *_ in tasks)
    missing = [i for i in range(job.partitions) if not tf.io.gfile.exists(job.results_path(i))]
    verified = shards == list(range(job.partitions)) and not missing and (not paths or paths == counts.read)
    processing = max(t[3] for t in tasks) - min(t[2] for t in tasks) if tasks else 0.0
    return core.summary(info, args.output_dir, counts, seconds, processing, verified=verified,
                        engine="spark", partitions=job.partitions)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    return run_and_report(lambda: run(args))
