"""The one image preprocessing that training, eval, export and batch prediction all share.

Keeping it in one module is what stops them drifting apart. Eval and serving are deterministic; only
training augments (the original recipe also augmented at eval and serving time, which was a bug).
"""
from __future__ import annotations

import tensorflow as tf

MAX_BRIGHTNESS_DELTA = 63.0 / 255.0
CONTRAST_RANGE = (0.2, 1.8)
CROP_MARGIN = 10

FEATURES = {
    "image/encoded": tf.io.FixedLenFeature([], tf.string),
    "image/class/label": tf.io.FixedLenFeature([], tf.int64),
}


def decode(image_bytes: tf.Tensor) -> tf.Tensor:
    """JPEG, PNG, GIF or BMP bytes to a float32 [h, w, 3] image in [0, 1].

    Undecodable bytes raise InvalidArgumentError, which the serving layer turns into a 400.
    """
    image = tf.io.decode_image(image_bytes, channels=3, expand_animations=False)
    image.set_shape([None, None, 3])
    return tf.image.convert_image_dtype(image, tf.float32)


def scale(image: tf.Tensor) -> tf.Tensor:
    """[0, 1] to [-1, 1], the range the models are trained on."""
    return (tf.clip_by_value(image, 0.0, 1.0) - 0.5) * 2.0


def preprocess_eval(image_bytes: tf.Tensor, height: int, width: int) -> tf.Tensor:
    """Deterministic: decode, resize, scale. Used by eval, the exported signature and batch jobs."""
    image = tf.image.resize(decode(image_bytes), [height, width], method="bilinear")
    return tf.ensure_shape(scale(image), [height, width, 3])


def preprocess_train(image_bytes: tf.Tensor, height: int, width: int) -> tf.Tensor:
    """The recipe's augmentation: resize to (H+10, W+10), random crop, flip, brightness and contrast."""
    image = tf.image.resize(decode(image_bytes), [height + CROP_MARGIN, width + CROP_MARGIN], method="bilinear")
    image = tf.image.random_crop(image, [height, width, 3])
    image = tf.image.random_flip_left_right(image)
    image = tf.image.random_brightness(image, MAX_BRIGHTNESS_DELTA)
    image = tf.image.random_contrast(image, *CONTRAST_RANGE)
    return tf.ensure_shape(scale(image), [height, width, 3])


def read_and_preprocess(serialized: tf.Tensor, height: int, width: int, augment: bool) -> tuple[tf.Tensor, tf.Tensor]:
    """A serialized tf.train.Example (see training/tfrecords.py) to (image, label)."""
    example = tf.io.parse_single_example(serialized, FEATURES)
    preprocess = preprocess_train if augment else preprocess_eval
    return preprocess(example["image/encoded"], height, width), tf.cast(example["image/class/label"], tf.int32)
