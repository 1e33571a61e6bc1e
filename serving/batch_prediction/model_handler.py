"""The Beam ModelHandler for batch jobs: an exported SavedModel run on fixed-size batches.

Beam's own TFModelHandlerTensor loads through Keras, which under Keras 3 cannot load a plain SavedModel, so
this handler loads with tf.saved_model.load and calls the `predict_images` signature directly (any other
SavedModel: its signature through the server's Servable), through the static padded batches of
serving/batch_prediction/steps.py that the Spark job uses too.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
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

METRICS_NAMESPACE = "petal.batch"


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

    def load_model(self) -> BatchModel:
        return load_model(self._info, self._batch_size, self._use_tpu, self._tpu)

    def run_inference(self, batch: Sequence[Any], model: BatchModel,
                      inference_args: dict[str, Any] | None = None) -> Iterable[Any]:
        predictions = predict_batch(model, batch)
        Metrics.counter(METRICS_NAMESPACE, "batches").inc()
        Metrics.counter(METRICS_NAMESPACE, "padded").inc(self._batch_size - len(batch))
        return predictions

    def get_num_bytes(self, batch: Sequence[Any]) -> int:
        return sum(row_bytes(row) for row in batch)

    def get_metrics_namespace(self) -> str:
        return METRICS_NAMESPACE
