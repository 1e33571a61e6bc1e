"""The Beam ModelHandler for batch jobs: an exported SavedModel run on fixed-size batches.

Beam's own TFModelHandlerTensor loads through Keras, which under Keras 3 cannot load a plain SavedModel, so
this handler loads with tf.saved_model.load and calls the `predict_images` signature directly (any other
SavedModel: its signature through the server's Servable), through the static padded batches of
serving/batch_prediction/steps.py that the Spark job uses too.
"""
from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from apache_beam.metrics import Metrics
from apache_beam.ml.inference.base import ModelHandler

from serving.batch_prediction.steps import (  # noqa: F401  (read_model_info and StaticBatchClassifier: the job's names)
    BatchModel,
    ModelInfo,
    StaticBatchClassifier,
    load_model,
    predict_batch,
    read_model_info,
    row_bytes,
)
from training import PROGRESS_LOGGER, JsonFormatter

METRICS_NAMESPACE = "petal.batch"
PROGRESS_SECONDS = 10.0
progress_log = logging.getLogger(PROGRESS_LOGGER)  # INFO even when quiet: see petal.configure_logging


def log_progress_to_stderr() -> None:
    """In a worker process of its own (`--direct_running_mode multi_processing`), progress goes as JSON lines to the
    stderr it shares with the job, as the job logs: Beam's logging channel carries it to the job only as an INFO
    line of Beam's own logger, which a quiet job does not show, so such a job showed no progress at all."""
    if progress_log.handlers:  # another copy in this process did it
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    progress_log.addHandler(handler)
    progress_log.setLevel(logging.INFO)
    progress_log.propagate = False


@dataclass
class Progress:
    """Rows predicted by one copy of the handler, logged every PROGRESS_SECONDS. Counted where the model runs
    rather than where rows are written: on the DirectRunner the steps after the model start only once it has seen
    every row, so a job counted there showed nothing until it was over."""
    job_pid: int = field(default_factory=os.getpid)  # a copy run in another process is in a Beam worker of its own
    rows: int = 0
    started: float = -1.0  # set at this copy's first batch, on its worker
    logged: float = -1.0

    def add(self, rows: int) -> None:
        now = time.monotonic()
        if self.started < 0:
            self.started = self.logged = now
            if os.getpid() != self.job_pid:
                log_progress_to_stderr()
        self.rows += rows
        if now - self.logged >= PROGRESS_SECONDS:
            self.logged = now
            progress_log.info("batch progress", extra={"fields": {
                "rows_predicted": self.rows, "images_per_s": round(self.rows / max(now - self.started, 1e-9), 1)}})


class SavedModelHandler(ModelHandler[Any, Any, BatchModel]):
    """RunInference handler: float32 [H, W, 3] images in [-1, 1] in, one prediction dict per image out (any
    other SavedModel: decoded rows in, one REST answer or ServingError per row out).

    One model per machine: Beam shares it between the threads of a worker and, via its multi-process
    proxy, between worker processes where the runner allows (one TPU or GPU cannot be opened by several
    processes anyway).
    """

    def __init__(self, info: ModelInfo, batch_size: int, use_tpu: bool = False, tpu: str | None = None):
        super().__init__(min_batch_size=batch_size, max_batch_size=batch_size, model_copies=1)
        self._info = info
        self._batch_size = batch_size
        self._use_tpu = use_tpu
        self._tpu = tpu
        self.progress = Progress()

    def load_model(self) -> BatchModel:
        return load_model(self._info, self._batch_size, self._use_tpu, self._tpu)

    def run_inference(self, batch: Sequence[Any], model: BatchModel,
                      inference_args: dict[str, Any] | None = None) -> Iterable[Any]:
        predictions = predict_batch(model, batch)
        Metrics.counter(METRICS_NAMESPACE, "batches").inc()
        Metrics.counter(METRICS_NAMESPACE, "padded").inc(self._batch_size - len(batch))
        self.progress.add(len(batch))
        return predictions

    def get_num_bytes(self, batch: Sequence[Any]) -> int:
        return sum(row_bytes(row) for row in batch)

    def get_metrics_namespace(self) -> str:
        return METRICS_NAMESPACE
