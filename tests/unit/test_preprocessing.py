"""The shared preprocessing: one deterministic path for eval and serving, augmentation only for training."""
from __future__ import annotations

import io

import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

from training import synth
from training.preprocessing import (
    brightness_contrast_scale,
    decode,
    decode_at_least,
    decode_uint8,
    preprocess_eval,
    preprocess_train,
    scale,
)

JPEG = synth.render("sunflowers", 4, size=(64, 48))


def _as(fmt: str) -> bytes:
    buffer = io.BytesIO()
    Image.open(io.BytesIO(JPEG)).save(buffer, format=fmt)
    return buffer.getvalue()


def test_eval_preprocessing_is_deterministic_and_scaled():
    first, second = preprocess_eval(JPEG, 32, 40), preprocess_eval(JPEG, 32, 40)
    assert first.shape == (32, 40, 3) and first.dtype == tf.float32
    np.testing.assert_array_equal(first.numpy(), second.numpy())
    assert float(tf.reduce_min(first)) >= -1.0 and float(tf.reduce_max(first)) <= 1.0
    assert float(tf.reduce_max(first)) - float(tf.reduce_min(first)) > 1.0


def test_training_augmentation_varies_but_keeps_shape_and_range():
    views = [preprocess_train(JPEG, 32, 32).numpy() for _ in range(3)]
    assert all(v.shape == (32, 32, 3) and v.min() >= -1.0 and v.max() <= 1.0 for v in views)
    assert not np.array_equal(views[0], views[1]) and not np.array_equal(views[1], views[2])


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "BMP", "GIF"])
def test_every_format_decodes_to_the_same_rgb_pixels_in_0_1(fmt):
    pixels = np.asarray(Image.open(io.BytesIO(JPEG)), dtype=np.float32) / 255.0
    decoded = decode(JPEG if fmt == "JPEG" else _as(fmt)).numpy()
    assert decoded.shape == (48, 64, 3) and decoded.dtype == np.float32
    # PNG and BMP are lossless; JPEG decoders differ by rounding; GIF quantises to a palette.
    assert np.abs(decoded - pixels).mean() <= {"PNG": 1e-6, "BMP": 1e-6, "JPEG": 0.01, "GIF": 0.05}[fmt]


def photo(width: int, height: int, fmt: str = "JPEG", **options) -> bytes:
    buffer = io.BytesIO()
    synth.render_image("roses", 7, size=(width, height)).save(buffer, format=fmt, **options)
    return buffer.getvalue()


@pytest.mark.parametrize("size, decoded", [
    ((1024, 768), (96, 128)),  # 1/8: 128 x 96 still covers 64 x 64
    ((480, 360), (90, 120)),  # 1/4: at 1/8 the height would be 45
    ((129, 128), (64, 65)),  # 1/2, each side rounded up as libjpeg rounds it
    ((128, 127), (64, 64)),
    ((127, 400), (200, 64)),  # the narrower side decides
    ((40, 30), (30, 40)),  # smaller than the input already: decoded in full
], ids=["1024x768", "480x360", "129x128", "128x127", "127x400", "40x30"])
def test_a_jpeg_decodes_at_the_smallest_dct_scaling_that_still_covers_the_input(size, decoded):
    assert tuple(decode_at_least(photo(*size), 64, 64).shape) == (*decoded, 3)


@pytest.mark.parametrize("fmt", ["PNG", "GIF", "BMP"])
def test_other_formats_decode_in_full(fmt):
    assert tuple(decode_at_least(photo(480, 360, fmt), 64, 64).shape) == (360, 480, 3)


def test_a_jpeg_smaller_than_the_input_gives_what_a_full_decode_gives():
    small = photo(40, 30)
    full = scale(tf.image.resize(decode_uint8(small), [64, 64]) / 255.0)
    np.testing.assert_array_equal(preprocess_eval(small, 64, 64).numpy(), full.numpy())


@pytest.mark.parametrize("data", [b"", b"not an image", JPEG[:20]])
def test_undecodable_bytes_raise_invalid_argument(data):
    with pytest.raises(tf.errors.InvalidArgumentError):
        preprocess_eval(data, 32, 32)


@pytest.mark.parametrize("delta, factor", [(0.0, 1.0), (0.2, 0.3), (-0.24, 1.7), (0.1, 1.8)])
def test_folded_colour_augmentation_equals_brightness_then_contrast_then_scale(delta, factor):
    image = tf.image.resize(tf.io.decode_jpeg(JPEG), [20, 28])  # 0..255, as preprocess_train has it.
    expected = scale(tf.image.adjust_contrast(tf.image.adjust_brightness(image / 255.0, delta), factor))
    folded = brightness_contrast_scale(image, tf.constant(delta), tf.constant(factor))
    assert folded.shape == (20, 28, 3)
    np.testing.assert_allclose(folded.numpy(), expected.numpy(), atol=2e-6)
