"""The shipped model in exported_models/flowers/1/ loads and classifies freshly drawn synthetic flowers."""
import os

import numpy as np
import pytest
import tensorflow as tf

from exported_models.model_format import DEFAULT_MODEL_BASE_PATH, scaled_jpeg_inputs
from training.synth import CLASSES, render

MODEL = os.path.join(DEFAULT_MODEL_BASE_PATH, "1")
PER_CLASS = 20
FRESH_SEED = 987_654  # the shipped model was trained on seed 1's images; these are new draws


@pytest.fixture(scope="module")
def model():
    return tf.saved_model.load(MODEL)


def test_shipped_model_is_small_and_labelled(model):
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(MODEL) for f in files)
    assert size < 5 * 2**20
    with open(os.path.join(MODEL, "assets", "labels.txt")) as f:
        assert tuple(f.read().splitlines()) == CLASSES
    assert set(model.signatures) == {"serving_default", "predict_images"}
    assert os.path.getsize(os.path.join(MODEL, "assets.extra", "tf_serving_warmup_requests")) > 0
    # its signature decodes a JPEG at the smallest DCT scaling still 64x64, and the server charges it so
    assert scaled_jpeg_inputs(MODEL) == {"serving_default": {"image_bytes": (64, 64)}}


def test_shipped_model_classifies_fresh_synthetic_flowers(model):
    serve = model.signatures["serving_default"]
    labels = np.repeat(np.arange(len(CLASSES)), PER_CLASS)
    images = [render(int(label), FRESH_SEED + i) for i, label in enumerate(labels)]
    predicted = np.concatenate([serve(image_bytes=tf.constant(images[i:i + 25]))["classid"].numpy()
                                for i in range(0, len(images), 25)])
    accuracy = float(np.mean(predicted == labels))
    assert accuracy >= 0.9, f"accuracy {accuracy:.3f} on {len(labels)} fresh images"
    for label in range(len(CLASSES)):
        assert np.mean(predicted[labels == label] == label) >= 0.7, CLASSES[label]
