"""`petal predict` without --server: the exported SavedModel in this process, the only part of the client that
loads TensorFlow (a client that sends a REST request need not spend seconds and hundreds of MB on it). Its
importer imports TensorFlow first (serving.tensorflow_logs), as the core it imports loads it."""
from __future__ import annotations

from collections.abc import Sequence

from exported_models.model_format import LABELS_ASSET, latest_version, read_labels
from serving.client import Prediction, from_pairs
from serving.core.errors import op_error_message
from serving.core.images import top_k as top_k_pairs


def predict_in_process(images: Sequence[bytes], model_dir: str, top_k: int) -> list[Prediction | str]:
    """Each image through the SavedModel's serving_default, as a server runs it; an undecodable image gives its
    error message."""
    import tensorflow as tf

    path = latest_version(model_dir)
    labels = read_labels(f"{path}/{LABELS_ASSET}")
    signature = tf.saved_model.load(path).signatures["serving_default"]
    results: list[Prediction | str] = []
    for image in images:
        try:
            probabilities = signature(image_bytes=tf.constant([image]))["probabilities"].numpy()[0]
        except tf.errors.InvalidArgumentError as err:
            results.append(f"INVALID_ARGUMENT: {op_error_message(err.message)}")
            continue
        results.append(from_pairs(top_k_pairs(probabilities[None], labels, top_k)[0], top_k))
    return results
