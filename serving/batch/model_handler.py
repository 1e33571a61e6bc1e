"""The Beam ModelHandler for batch jobs: an exported Petal SavedModel run on fixed-size batches.

Beam's own TFModelHandlerTensor loads through Keras, which under Keras 3 cannot load a plain SavedModel, so
this handler loads with tf.saved_model.load and calls the `predict_images` signature directly. Images are
decoded on the host (TPUs cannot decode JPEGs), and every batch the model sees has exactly `batch_size` rows:
accelerators compile one program per input shape, so the last partial batch is padded and the padding rows
are dropped again before anything is returned.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf
from apache_beam.metrics import Metrics
from apache_beam.ml.inference.base import ModelHandler

from exported_models.model_format import LABELS_ASSET, latest_version, read_labels, read_signatures

logger = logging.getLogger(__name__)

SIGNATURE = "predict_images"
SIGNATURE_INPUT = "images"
METRICS_NAMESPACE = "petal.batch"
# The numeric outputs come back from the device; class names are looked up on the host, because string
# tensors cannot live on a TPU.
DEVICE_OUTPUTS = ("probabilities", "classid")


@dataclass(frozen=True)
class ModelInfo:
    """What the job needs to know about a model before any worker loads it."""

    path: str
    height: int
    width: int
    labels: tuple[str, ...]


def read_model_info(model_dir: str) -> ModelInfo:
    """Image size from the signature's input spec and labels from the assets, without loading the graph."""
    path = latest_version(model_dir)
    signatures = read_signatures(path)
    if SIGNATURE not in signatures:
        raise ValueError(f"{path} has no {SIGNATURE!r} signature (has {sorted(signatures)}); export it with petal")
    dims = signatures[SIGNATURE].inputs[SIGNATURE_INPUT].shape or []
    if len(dims) != 4 or dims[1] <= 0 or dims[2] <= 0:
        raise ValueError(f"{path}: {SIGNATURE} input must be [batch, H, W, 3] with static H and W, got {dims}")
    labels = tuple(read_labels(f"{path}/{LABELS_ASSET}"))
    return ModelInfo(path=path, height=dims[1], width=dims[2], labels=labels)


def select_strategy(use_tpu: bool, tpu: str | None = None) -> tf.distribute.Strategy:
    """TPUStrategy when asked for, MirroredStrategy over several GPUs (or several logical CPUs, which only exist
    when configured on purpose), else the default strategy.

    Not training's resolve_strategy: a batch job on a Beam worker must not turn a TF_CONFIG it happens to inherit
    into MultiWorkerMirroredStrategy, logical CPU devices must count as replicas, and serving code never imports
    training beyond the shared preprocessing.
    """
    if use_tpu:
        resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=tpu or "local")
        tf.config.experimental_connect_to_cluster(resolver)
        tf.tpu.experimental.initialize_tpu_system(resolver)
        return tf.distribute.TPUStrategy(resolver)
    for kind in ("GPU", "CPU"):
        devices = tf.config.list_logical_devices(kind)
        if len(devices) > 1:
            return tf.distribute.MirroredStrategy([d.name for d in devices])
    return tf.distribute.get_strategy()


class StaticBatchClassifier:
    """`predict_images` compiled for exactly one input shape, [batch_size, H, W, 3], split across replicas.

    A batch of the wrong size is a TF shape error, not a silent recompile, so the static-shape promise is
    enforced rather than hoped for.
    """

    def __init__(self, info: ModelInfo, batch_size: int, use_tpu: bool = False, tpu: str | None = None):
        self.strategy = select_strategy(use_tpu, tpu)
        self.replicas = self.strategy.num_replicas_in_sync
        if batch_size % self.replicas:
            raise ValueError(f"--batch_size {batch_size} is not a multiple of the {self.replicas} replicas")
        self.batch_size = batch_size
        self.labels = np.array(info.labels, dtype=object)
        with self.strategy.scope():
            self._loaded = tf.saved_model.load(info.path)
        signature = self._loaded.signatures[SIGNATURE]
        strategy, replicas = self.strategy, self.replicas

        @tf.function(input_signature=[tf.TensorSpec([batch_size, info.height, info.width, 3], tf.float32)])
        def step(images):
            shards = tf.split(images, replicas)
            per_replica = strategy.experimental_distribute_values_from_function(
                lambda ctx: shards[ctx.replica_id_in_sync_group])
            outputs = strategy.run(
                lambda x: {k: v for k, v in signature(images=x).items() if k in DEVICE_OUTPUTS},
                args=(per_replica,))
            return {k: tf.concat(strategy.experimental_local_results(v), axis=0) for k, v in outputs.items()}

        self._step = step
        logger.info("model loaded", extra={"fields": {
            "model": info.path, "strategy": type(self.strategy).__name__, "replicas": self.replicas,
            "batch_size": batch_size}})

    def predict(self, images: np.ndarray) -> dict[str, np.ndarray]:
        """Up to batch_size images in, as many rows out: zero rows pad the batch and are cut off again."""
        rows = len(images)
        if not 0 < rows <= self.batch_size:
            raise ValueError(f"got {rows} rows for a static batch of {self.batch_size}")
        padded = np.zeros((self.batch_size, *images.shape[1:]), np.float32)
        padded[:rows] = images
        outputs = {k: v.numpy()[:rows] for k, v in self._step(padded).items()}
        outputs["class"] = self.labels[outputs["classid"]]
        return outputs


class SavedModelHandler(ModelHandler[np.ndarray, dict, StaticBatchClassifier]):
    """RunInference handler: float32 [H, W, 3] images in [-1, 1] in, one prediction dict per image out.

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

    def load_model(self) -> StaticBatchClassifier:
        return StaticBatchClassifier(self._info, self._batch_size, self._use_tpu, self._tpu)

    def run_inference(self, batch: Sequence[np.ndarray], model: StaticBatchClassifier,
                      inference_args: dict[str, Any] | None = None) -> Iterable[dict]:
        outputs = model.predict(np.stack(batch))
        Metrics.counter(METRICS_NAMESPACE, "batches").inc()
        Metrics.counter(METRICS_NAMESPACE, "padded").inc(self._batch_size - len(batch))
        return [{k: v[i] for k, v in outputs.items()} for i in range(len(batch))]

    def get_num_bytes(self, batch: Sequence[np.ndarray]) -> int:
        return sum(image.nbytes for image in batch)

    def get_metrics_namespace(self) -> str:
        return METRICS_NAMESPACE
