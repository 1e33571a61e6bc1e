"""The classifiers Petal can train, by name, all returning float32 logits.

Every model takes images scaled to [-1, 1] (see training/preprocessing.py) and ends in a float32 dense layer,
so that bf16 mixed precision never leaks into the logits, the loss or the exported probabilities.
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass

import keras
import tensorflow as tf
from keras import layers

from training.input import NHWC

DEFAULT_MODEL = "compact"
CONFIG_FILE = "model_config.json"


class Untranspose(layers.Layer):
    """Undoes input_fn's HWCN transpose inside the model, so the TPU-friendly layout never reaches a conv."""

    def call(self, images):
        return keras.ops.transpose(images, NHWC)


def _cnn(x, num_classes: int, batch_norm: bool):
    """The recipe's flowers CNN, layer for layer."""
    x = layers.Conv2D(10, 5, padding="same", activation="relu", name="conv1")(x)
    x = layers.MaxPooling2D(2, name="pool1")(x)
    x = layers.Conv2D(20, 5, padding="same", activation="relu", name="conv2")(x)
    x = layers.MaxPooling2D(2, name="pool2")(x)
    x = layers.Flatten(name="flatten")(x)
    if batch_norm:
        x = layers.Dense(300, use_bias=False, name="dense1")(x)
        x = layers.BatchNormalization(name="dense1_bn")(x)
        x = layers.Activation("relu", name="dense1_relu")(x)
    else:
        x = layers.Dense(300, activation="relu", name="dense1")(x)
    x = layers.Dropout(0.25, name="dropout")(x)
    return layers.Dense(num_classes, dtype="float32", name="logits")(x)


def _compact(x, num_classes: int, batch_norm: bool):
    """The shipped default: four conv blocks with batch norm and global average pooling, about 100k weights.

    Global pooling keeps the size independent of the image size, and batch norm is always on because it is
    what makes this net converge in a few hundred CPU steps.
    """
    del batch_norm
    for i, filters in enumerate((16, 32, 64, 128), start=1):
        x = layers.Conv2D(filters, 3, padding="same", use_bias=False, name=f"block{i}_conv")(x)
        x = layers.BatchNormalization(name=f"block{i}_bn")(x)
        x = layers.Activation("relu", name=f"block{i}_relu")(x)
        x = layers.MaxPooling2D(2, name=f"block{i}_pool")(x)
    x = layers.GlobalAveragePooling2D(name="gap")(x)
    x = layers.Dropout(0.2, name="dropout")(x)
    return layers.Dense(num_classes, dtype="float32", name="logits")(x)


def _application(factory: Callable[..., keras.Model]):
    """A keras.applications backbone with random weights (nothing is downloaded) and our float32 head."""

    def build(x, num_classes: int, batch_norm: bool):
        del batch_norm
        backbone = factory(include_top=False, weights=None, input_shape=tuple(x.shape[1:]), pooling="avg")
        return layers.Dense(num_classes, dtype="float32", name="logits")(backbone(x))

    return build


_BUILDERS = {
    "cnn": _cnn,
    "compact": _compact,
    "resnet50": _application(keras.applications.ResNet50),
    "mobilenet_v2": _application(keras.applications.MobileNetV2),
    "efficientnet_b0": _application(keras.applications.EfficientNetB0),
}
MODEL_NAMES = tuple(_BUILDERS)


def build_model(name: str, num_classes: int, image_size: int, batch_norm: bool = False) -> keras.Model:
    """Build a model by name: NHWC images in, logits out."""
    if name not in _BUILDERS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODEL_NAMES)}")
    inputs = keras.Input(shape=(image_size, image_size, 3), name="images")
    return keras.Model(inputs, _BUILDERS[name](inputs, num_classes, batch_norm), name=name)


def fed_transposed(model: keras.Model) -> keras.Model:
    """`model` fed HWCN batches as input_fn(transpose=True) makes them. It wraps `model` rather than rebuilding its
    layers behind an Untranspose: a functional model's checkpoint keys its layers by position, which one more layer
    shifted, so a run trained transposed could be neither exported nor resumed untransposed. Checkpoints track
    `model` alone, whichever way it is fed."""
    size = model.input_shape[1]
    inputs = keras.Input(batch_shape=(size, size, 3, None), name="images_hwcn")
    return keras.Model(inputs, model(Untranspose(name="untranspose")(inputs)), name=f"{model.name}_hwcn")


@dataclass(frozen=True)
class ModelConfig:
    """What a checkpoint directory holds weights for; saved beside the checkpoints so `petal export` can rebuild it."""

    name: str
    labels: tuple[str, ...]
    image_size: int
    batch_norm: bool = False

    def build(self) -> keras.Model:
        return build_model(self.name, len(self.labels), self.image_size, self.batch_norm)

    def save(self, directory: str) -> None:
        with tf.io.gfile.GFile(os.path.join(directory, CONFIG_FILE), "w") as f:
            json.dump(asdict(self), f, indent=1)

    @classmethod
    def load(cls, directory: str) -> ModelConfig:
        path = os.path.join(directory, CONFIG_FILE)
        if not tf.io.gfile.exists(path):
            raise FileNotFoundError(f"{path} not found: is {directory} the --output_dir of a `petal train` run?")
        with tf.io.gfile.GFile(path) as f:
            fields = json.load(f)
        return cls(fields["name"], tuple(fields["labels"]), int(fields["image_size"]), bool(fields["batch_norm"]))
