"""What a Spark task runs in an executor's Python worker: one partition's records to a results shard.

Kept apart from the driver's code (serving/batch_prediction/spark_job.py), so that unpickling a task imports only
what scoring uses: this module, the engine-free steps and TensorFlow (without Keras: see
serving/batch_prediction/__init__.py), never the driver's job, flags or checks, nor the any-model stack an image
job does not run (docs/batch.md, 'Lean workers').

The model loads once per executor Python worker (Spark reuses them across tasks) with TensorFlow's thread pools
sized to the task's cores; a model the driver shipped with the job (spark_job.ship_model) is read from the
executor's own unpacked copy, and one on an object store is downloaded beside it (steps.model_folder). Inputs and
outputs are read and written through Petal's storage layer, so the executors need that store's package and
environment (docs/batch.md, 'Object stores').
"""
from __future__ import annotations

import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, replace
from itertools import chain
from typing import Any

import tensorflow as tf
from pyspark import SparkFiles, TaskContext

from exported_models import storage
from serving.batch_prediction import steps
from serving.batch_prediction.steps import TEMPORARY


@dataclass(frozen=True)
class PartitionJob:
    """Everything a task needs, shipped to the executors with the partition function. `model_archive` names the
    archive of the model folder the driver added to the job, when the executors cannot read the driver's."""

    info: steps.ModelInfo
    input_format: str
    output_dir: str
    partitions: int
    batch_size: int
    top_k: int
    use_tpu: bool
    tpu: str | None
    max_image_pixels: int
    model_archive: str | None = None

    def results_path(self, index: int) -> str:
        return storage.join(self.output_dir, f"{steps.RESULTS_PREFIX}-{index:05d}-of-{self.partitions:05d}")

    def errors_part(self, index: int) -> str:
        return storage.join(self.output_dir, TEMPORARY, f"errors-{index:05d}")

    def executor_info(self) -> steps.ModelInfo:
        """The model as this executor reads it: the shipped copy's `<model>/<version>` folder (see
        spark_job.ship_model for the archive's layout), or the copy of a store's model downloaded into the folder
        where Spark keeps the application's files on this executor, else the path as given."""
        if self.model_archive is None:
            return replace(self.info, path=steps.model_folder(self.info.path, SparkFiles.getRootDirectory()))
        return replace(self.info, path=os.path.join(SparkFiles.get(self.model_archive),
                                                    steps.version_name(self.info.path)))


def _read(input_format: str, mode: str, unit: Any) -> Iterator[steps.Record | steps.Failure]:
    if input_format == "tfrecord":
        return steps.read_tfrecord_file(unit, mode)
    if input_format == "jsonl":
        return steps.read_jsonl_file(unit, mode)
    return (steps.read_file(path) for path in unit)


_models: dict[tuple, tuple[steps.BatchModel, steps.ImageDecoder | steps.PayloadDecoder]] = {}


def _task() -> TaskContext:
    """The running task's context, which Spark sets in every task (and these functions run only in tasks)."""
    context = TaskContext.get()
    assert context is not None
    return context


def _model(job: PartitionJob) -> tuple[steps.BatchModel, steps.ImageDecoder | steps.PayloadDecoder]:
    """The model and decoder of this executor Python worker, loaded by its first task and kept for the others.

    TensorFlow's pools can only be sized before its runtime starts, so the first task sizes them to the cores
    Spark gives a task (spark.task.cpus): the executor's other cores run other tasks' workers.
    """
    key = (job.info, job.model_archive, job.batch_size, job.use_tpu, job.tpu, job.max_image_pixels)
    if key not in _models:
        if not _models:
            cpus = _task().cpus()
            tf.config.threading.set_intra_op_parallelism_threads(cpus)
            tf.config.threading.set_inter_op_parallelism_threads(cpus)
        info = job.executor_info()
        _models[key] = (steps.load_model(info, job.batch_size, job.use_tpu, job.tpu),
                        steps.make_decoder(info, job.max_image_pixels))
    return _models[key]


def score_partition(job: PartitionJob, index: int, units: Iterable[Any]) -> Iterator[tuple[int, dict, float,
                                                                                            float]]:
    """One task: its records to a results shard and an errors part, committed by rename once complete.

    Its time is stamped once the model is there, so the job's processing rate leaves the workers' start-up
    and the model's loading out."""
    model, decoder = _model(job)
    started = time.time()
    scorer = steps.Scorer(decoder, model, job.info, job.top_k)
    attempt = storage.join(job.output_dir, TEMPORARY, f"attempt-{index:05d}-{_task().taskAttemptId()}")
    with storage.open_file(f"{attempt}.results", "wb") as results, storage.open_file(f"{attempt}.errors",
                                                                                       "wb") as errors:
        records = chain.from_iterable(_read(job.input_format, job.info.mode, u) for u in units)
        for is_result, line in scorer.score(records):
            (results if is_result else errors).write(line.encode() + b"\n")
    steps.move(f"{attempt}.errors", job.errors_part(index))
    steps.move(f"{attempt}.results", job.results_path(index))
    yield index, asdict(scorer.counts), started, time.time()
