"""The one image preprocessing that training, eval, export and batch prediction all share.

Keeping it in one module is what stops them drifting apart. Eval and serving are deterministic; only
training augments (the original recipe also augmented at eval and serving time, which was a bug).
"""
from __future__ import annotations

import functools

import tensorflow as tf

MAX_BRIGHTNESS_DELTA = 63.0 / 255.0
CONTRAST_RANGE = (0.2, 1.8)
CROP_MARGIN = 10
# The DCT scalings libjpeg decodes at, as tf.io.decode_jpeg's `ratio`: 1/1, 1/2, 1/4 and 1/8 of each side.
JPEG_RATIOS = (1, 2, 4, 8)

FEATURES = {
    "image/encoded": tf.io.FixedLenFeature([], tf.string),
    "image/class/label": tf.io.FixedLenFeature([], tf.int64),
}


def decode_uint8(image_bytes: tf.Tensor) -> tf.Tensor:
    """JPEG, PNG, GIF or BMP bytes to a uint8 [h, w, 3] image.

    Resizing straight from uint8 saves a float conversion of the full-size photo, the largest array in the
    pipeline. Undecodable bytes raise InvalidArgumentError, which the serving layer turns into a 400.
    """
    image = tf.io.decode_image(image_bytes, channels=3, expand_animations=False)
    image.set_shape([None, None, 3])
    return image


def decode_at_least(image_bytes: tf.Tensor, height: int, width: int) -> tf.Tensor:
    """decode_uint8, but a JPEG decodes at the smallest of libjpeg's DCT scalings (JPEG_RATIOS) that is still at
    least height x width, each side rounded up as libjpeg rounds it: a 480x360 photo for a 64x64 model decodes at
    120x90, a 1/16 of the pixels, which saves most of the decode's CPU and memory where the resize after it would
    throw those pixels away. The ratio is read from the JPEG's header per image; other formats decode in full.

    serving/core/images.py charges the memory budget for the same size, for the signatures whose export says that
    they decode this way (exported_models/model_format.py, SCALED_JPEG_FILE).
    """
    def jpeg() -> tf.Tensor:
        size = tf.io.extract_jpeg_shape(image_bytes)[:2]
        smaller = [tf.reduce_all((size + ratio - 1) // ratio >= [height, width]) for ratio in JPEG_RATIOS[1:]]
        return tf.switch_case(tf.add_n([tf.cast(fits, tf.int32) for fits in smaller]),
                              [functools.partial(tf.io.decode_jpeg, image_bytes, channels=3, ratio=ratio)
                               for ratio in JPEG_RATIOS])
    image = tf.cond(tf.io.is_jpeg(image_bytes), jpeg, lambda: decode_uint8(image_bytes))
    image.set_shape([None, None, 3])
    return image


def decode(image_bytes: tf.Tensor) -> tf.Tensor:
    """JPEG, PNG, GIF or BMP bytes to a float32 [h, w, 3] image in [0, 1]."""
    return tf.image.convert_image_dtype(decode_uint8(image_bytes), tf.float32)


def scale(image: tf.Tensor) -> tf.Tensor:
    """[0, 1] to [-1, 1], the range the models are trained on."""
    return (tf.clip_by_value(image, 0.0, 1.0) - 0.5) * 2.0


def preprocess_eval(image_bytes: tf.Tensor, height: int, width: int) -> tf.Tensor:
    """Deterministic: decode (at a JPEG's smallest DCT scaling that still covers the size), resize, scale. Used
    by eval, the exported signature and batch jobs, so that each sees the pixels the others see."""
    image = tf.image.resize(decode_at_least(image_bytes, height, width), [height, width], method="bilinear") / 255.0
    return tf.ensure_shape(scale(image), [height, width, 3])


def preprocess_train(image_bytes: tf.Tensor, height: int, width: int) -> tf.Tensor:
    """The recipe's augmentation: resize to (H+10, W+10), random crop (H, W), flip, brightness and contrast.

    The crop is taken first, as the same relative window of the decoded photo (H/(H+10) of each side at a
    random offset), and that window is resized to (H, W): the same geometry as resizing then cropping, with one
    smaller resize and no copy of the enlarged image, which keeps training close to the decode+resize ceiling.
    """
    image = decode_uint8(image_bytes)
    size = tf.shape(image)[:2]
    window = tf.cast(tf.round(tf.cast(size, tf.float32) * [height / (height + CROP_MARGIN),
                                                            width / (width + CROP_MARGIN)]), tf.int32)
    window = tf.maximum(window, 1)
    offset = tf.random.uniform([2], maxval=tf.int32.max, dtype=tf.int32) % (size - window + 1)
    image = tf.slice(image, tf.concat([offset, [0]], 0), tf.concat([window, [3]], 0))
    image = tf.image.resize(image, [height, width], method="bilinear")
    image = tf.image.random_flip_left_right(image)
    delta = tf.random.uniform([], -MAX_BRIGHTNESS_DELTA, MAX_BRIGHTNESS_DELTA)
    factor = tf.random.uniform([], *CONTRAST_RANGE)
    return tf.ensure_shape(brightness_contrast_scale(image, delta, factor), [height, width, 3])


def brightness_contrast_scale(image: tf.Tensor, delta: tf.Tensor, factor: tf.Tensor) -> tf.Tensor:
    """tf.image.adjust_brightness(delta), then tf.image.adjust_contrast(factor), then `scale`, on a
    [h, w, 3] image in 0..255, as one multiply-add and a clip.

    All three are affine (contrast is (x - mean) * factor + mean per channel), so folding them gives the same
    result with a third of the passes over the image, which keeps the training pipeline close to the
    decode + resize ceiling (benchmarks/input_pipeline.py).
    """
    height, width = tf.shape(image)[0], tf.shape(image)[1]
    mean = tf.reduce_mean(tf.reshape(image, [-1, 3]), axis=0)
    # out = 2 * ((x - mean) * factor / 255 + mean / 255 + delta) - 1, clipped to [-1, 1].
    gain = 2.0 * factor / 255.0
    offset = 2.0 * (mean / 255.0 + delta) - 1.0 - gain * mean
    # Adding a per-channel [3] vector is a slow broadcast on CPU; a whole row of pixels [width * 3] is not.
    rows = tf.reshape(image, [height, width * 3]) * gain + tf.tile(offset, [width])
    return tf.reshape(tf.clip_by_value(rows, -1.0, 1.0), tf.shape(image))


def read_and_preprocess(serialized: tf.Tensor, height: int, width: int, augment: bool) -> tuple[tf.Tensor, tf.Tensor]:
    """A serialized tf.train.Example (see training/tfrecords.py) to (image, label)."""
    example = tf.io.parse_single_example(serialized, FEATURES)
    preprocess = preprocess_train if augment else preprocess_eval
    return preprocess(example["image/encoded"], height, width), tf.cast(example["image/class/label"], tf.int32)
