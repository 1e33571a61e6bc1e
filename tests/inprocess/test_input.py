"""The tf.data input function over real TFRecord shards of real JPEGs."""
from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from training import synth
from training.input import input_fn
from training.models import Untranspose
from training.tfrecords import example

NUM_RECORDS = 23
NUM_SHARDS = 3
SIZE = 24
BATCH = 8


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """23 records over 3 shards; each record's label is its own index, so a pass can be checked for exactness."""
    folder = tmp_path_factory.mktemp("shards")
    writers = [tf.io.TFRecordWriter(str(folder / f"train-{i:05d}-of-{NUM_SHARDS:05d}")) for i in range(NUM_SHARDS)]
    for i in range(NUM_RECORDS):
        jpeg = synth.render(i % len(synth.CLASSES), i, size=(48, 36))
        writers[i % NUM_SHARDS].write(example(jpeg, i, "x", f"{i}.jpg", 36, 48).SerializeToString())
    for writer in writers:
        writer.close()
    return str(folder / "train-*")


def test_training_batches_have_static_shapes_and_scaled_values(shards):
    data = input_fn(shards, training=True, batch_size=BATCH, image_size=SIZE, shuffle_buffer=16)
    image_spec, label_spec = data.element_spec
    assert image_spec.shape == (BATCH, SIZE, SIZE, 3) and image_spec.dtype == tf.float32
    assert label_spec.shape == (BATCH,) and label_spec.dtype == tf.int32
    seen = set()
    for images, labels in data.take(6):  # 48 images from 23 records: training repeats.
        assert images.shape == (BATCH, SIZE, SIZE, 3)
        assert -1.0 <= float(tf.reduce_min(images)) and float(tf.reduce_max(images)) <= 1.0
        assert float(tf.math.reduce_std(images)) > 0.05
        seen.update(labels.numpy().tolist())
    assert seen <= set(range(NUM_RECORDS)) and len(seen) > NUM_RECORDS // 2


def test_eval_visits_every_record_exactly_once(shards):
    data = input_fn(shards, training=False, batch_size=BATCH, image_size=SIZE)
    labels = np.concatenate([batch_labels.numpy() for _, batch_labels, _ in data])
    assert sorted(labels.tolist()) == list(range(NUM_RECORDS))


def test_padded_eval_has_full_static_batches_and_zero_weight_padding(shards):
    data = input_fn(shards, training=False, batch_size=BATCH, image_size=SIZE, pad_eval_batches=True)
    assert data.element_spec[0].shape == (BATCH, SIZE, SIZE, 3) and data.element_spec[2].shape == (BATCH,)
    batches = list(data)
    assert len(batches) == -(-NUM_RECORDS // BATCH)
    labels = np.concatenate([b[1].numpy() for b in batches])
    weights = np.concatenate([b[2].numpy() for b in batches])
    assert weights.sum() == NUM_RECORDS and set(weights.tolist()) == {0.0, 1.0}
    assert sorted(labels[weights == 1.0].tolist()) == list(range(NUM_RECORDS))


def test_eval_is_deterministic_and_training_is_augmented(shards):
    def first_eval_batch() -> tuple[np.ndarray, np.ndarray]:
        data = input_fn(shards, training=False, batch_size=BATCH, image_size=SIZE)
        images, labels, _ = next(iter(data))
        order = np.argsort(labels.numpy())
        return images.numpy()[order], labels.numpy()[order]

    (images_1, labels_1), (images_2, labels_2) = first_eval_batch(), first_eval_batch()
    np.testing.assert_array_equal(labels_1, labels_2)
    np.testing.assert_array_equal(images_1, images_2)
    # Two consecutive batches of one pipeline: the random ops' state moves on, so a record is augmented differently
    # the second time, even where another test has set a global seed (which makes two fresh pipelines identical).
    train = iter(input_fn(shards, training=True, batch_size=NUM_RECORDS, image_size=SIZE, shuffle_buffer=1))
    (images_a, labels_a), (images_b, labels_b) = next(train), next(train)
    by_label_a = {int(label): img for label, img in zip(labels_a.numpy(), images_a.numpy(), strict=False)}
    by_label_b = {int(label): img for label, img in zip(labels_b.numpy(), images_b.numpy(), strict=False)}
    common = sorted(set(by_label_a) & set(by_label_b))
    assert common and all(not np.array_equal(by_label_a[label], by_label_b[label]) for label in common)


def test_transpose_gives_hwcn_and_the_models_untranspose_restores_nhwc(shards):
    plain = input_fn(shards, training=False, batch_size=BATCH, image_size=SIZE)
    hwcn = input_fn(shards, training=False, batch_size=BATCH, image_size=SIZE, transpose=True)
    (images, labels, _), (transposed, labels_t, _) = next(iter(plain)), next(iter(hwcn))
    assert transposed.shape == (SIZE, SIZE, 3, BATCH)
    np.testing.assert_array_equal(labels.numpy(), labels_t.numpy())
    np.testing.assert_array_equal(np.asarray(Untranspose()(transposed)), images.numpy())
