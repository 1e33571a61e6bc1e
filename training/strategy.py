"""Pick the tf.distribute strategy for where we run, so the training loop has one code path for every device.

Order: an explicit TPU, then a multi-worker TF_CONFIG, then several GPUs, else the default strategy. This is
what TPUEstimator's RunConfig did implicitly; making it one visible function is what keeps CPU tests honest about
the TPU path.
"""
from __future__ import annotations

import json
import logging
import os

import keras
import tensorflow as tf

log = logging.getLogger(__name__)

MIXED_PRECISION = {"none": "float32", "bf16": "mixed_bfloat16"}


def _tf_config_workers() -> int:
    """How many tasks train in the TF_CONFIG cluster (chief + workers); 0 without a TF_CONFIG."""
    config = json.loads(os.environ.get("TF_CONFIG") or "{}")
    cluster = config.get("cluster", {})
    return len(cluster.get("chief", [])) + len(cluster.get("worker", []))


def resolve_strategy(tpu: str | None = None, use_tpu: bool = False, tpu_zone: str | None = None,
                     project: str | None = None) -> tf.distribute.Strategy:
    """The strategy for this process; `use_tpu` without a name means the TPU attached to this VM."""
    if tpu or use_tpu:
        resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=tpu or "local", zone=tpu_zone,
                                                                      project=project)
        try:
            tf.config.experimental_connect_to_cluster(resolver)
            tf.tpu.experimental.initialize_tpu_system(resolver)
        except tf.errors.OpError as error:  # --use_tpu on a machine without one: no TPU kernels, no TPU device
            raise ValueError(f"no TPU to train on at {tpu or 'this VM (--use_tpu)'}: "
                             f"{error.message.splitlines()[0]}") from None
        strategy: tf.distribute.Strategy = tf.distribute.TPUStrategy(resolver)
    elif _tf_config_workers() > 1:
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
    elif len(tf.config.list_logical_devices("GPU")) > 1:
        strategy = tf.distribute.MirroredStrategy()
    else:
        strategy = tf.distribute.get_strategy()
    log.info("strategy", extra={"fields": {"strategy": type(strategy).__name__,
                                           "replicas": strategy.num_replicas_in_sync}})
    return strategy


def per_replica_batch_size(global_batch_size: int, strategy: tf.distribute.Strategy) -> int:
    """Every replica must get the same, full batch (TPUs need static shapes), so the global batch must divide."""
    replicas = strategy.num_replicas_in_sync
    if global_batch_size <= 0 or global_batch_size % replicas:
        suggested = max(1, global_batch_size // replicas) * replicas
        raise ValueError(f"batch size {global_batch_size} must be a positive multiple of the number of replicas "
                         f"({replicas}, {type(strategy).__name__}); try {suggested}")
    return global_batch_size // replicas


def set_mixed_precision(mode: str) -> None:
    """bf16 compute with float32 variables; the models keep their logits in float32."""
    if mode not in MIXED_PRECISION:
        raise ValueError(f"mixed precision {mode!r} is not one of {', '.join(MIXED_PRECISION)}")
    keras.mixed_precision.set_global_policy(MIXED_PRECISION[mode])


def is_chief(strategy: tf.distribute.Strategy) -> bool:
    """Only the chief writes checkpoints that count, summaries, eval results and exports."""
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None or not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return True
    task_type, task_id = resolver.task_type, resolver.task_id
    if task_type == "chief":
        return True
    has_chief = "chief" in resolver.cluster_spec().as_dict()
    return task_type in (None, "worker") and task_id == 0 and not has_chief
