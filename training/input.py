"""The tf.data input function of the recipe, on current APIs.

list_files -> parallel interleave of TFRecordDataset -> shuffle -> parallel map(read_and_preprocess) -> batch
(static shapes) -> optional NHWC->HWCN transpose -> prefetch. Training never waits on a single file or a single
core, and every batch has the same shape, which TPUs and XLA need.
"""
from __future__ import annotations

import tensorflow as tf

from training.preprocessing import read_and_preprocess

AUTOTUNE = tf.data.AUTOTUNE
HWCN = [1, 2, 3, 0]
NHWC = [3, 0, 1, 2]


def input_fn(
    file_pattern: str | list[str],
    training: bool,
    batch_size: int,
    image_size: int,
    transpose: bool = False,
    shuffle_buffer: int = 1024,
    cycle_length: int = 8,
    pad_eval_batches: bool = False,
) -> tf.data.Dataset:
    """Batches of (image, label) for training, or (image, label, weight) for eval.

    Training repeats forever and drops the remainder so every batch is full. Eval visits every record exactly
    once; with `pad_eval_batches` the last batch is padded to full size with weight-0 rows, so that static-shape
    devices see no partial batch and the metrics still count only the real records.
    """
    files = tf.data.Dataset.list_files(file_pattern, shuffle=training)
    if training:
        files = files.repeat()
    records = files.interleave(
        tf.data.TFRecordDataset, cycle_length=cycle_length, num_parallel_calls=AUTOTUNE,
        deterministic=not training)
    if training:
        records = records.shuffle(shuffle_buffer)
    data = records.map(
        lambda r: read_and_preprocess(r, image_size, image_size, augment=training),
        num_parallel_calls=AUTOTUNE, deterministic=not training)
    if training:
        data = data.batch(batch_size, drop_remainder=True)
    else:
        data = data.map(lambda image, label: (image, label, tf.constant(1.0)))
        if pad_eval_batches:
            padding = tf.data.Dataset.from_tensors(
                (tf.zeros([image_size, image_size, 3]), tf.constant(0), tf.constant(0.0))).repeat(batch_size - 1)
            data = data.concatenate(padding)
        data = data.batch(batch_size, drop_remainder=pad_eval_batches)
    if transpose:
        data = data.map(lambda image, *rest: (tf.transpose(image, HWCN), *rest), num_parallel_calls=AUTOTUNE)
    return data.prefetch(AUTOTUNE)

