"""SavedModels exported the way other people export them, built at test time: never shaped by Petal's code.

- `tf1_half_plus_two`: a TF1 graph (`tf.compat.v1.saved_model.Builder`) like TF Serving's own
  `saved_model_half_plus_two` test model: Predict on `x`, Classify and Regress over serialized `tf.Example`s, an
  asset read by a lookup table that the main op initialises, in zero-padded version folders (`00000123`).
- `tf2_module`: a `tf.Module` saved with `tf.saved_model.save`, several signatures, all with method name predict.
- `keras_export`: a Keras 3 model written by `model.export()`.
- `tflite_beside`: a `model.tflite` converted from the TF2 module, next to its SavedModel, for
  `--prefer_tflite_model`.

Each version `i` of a TF1 model computes y = 0.5 * x + (2 + i), so a test can tell which version answered: the
first version is TF Serving's half_plus_two (2.5, 3.0, 4.5 for 1, 2, 5) and the second half_plus_three.
"""
from __future__ import annotations

import os

import numpy as np
import tensorflow as tf
from tensorflow.core.example import example_pb2
from tensorflow_serving.apis import inference_pb2, input_pb2

CLASS_NAMES = ("negative", "positive")  # the TF1 model's asset: the class of y < 3 and y >= 3


def tf1_half_plus_two(base: str, versions: tuple[str, ...] = ("00000123", "00000124")) -> str:
    """TF1 SavedModels under `base/<version>` (folder names as given); returns `base`."""
    for offset, version in enumerate(versions):
        _tf1_version(os.path.join(base, version), 2.0 + offset)
    return base


def _tf1_version(path: str, intercept: float) -> None:
    v1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default(), v1.Session(graph=graph) as session:
        a = v1.Variable(0.5, name="a")
        b = v1.Variable(intercept, name="b")
        serialized = v1.placeholder(tf.string, name="tf_example")
        features = v1.parse_example(serialized, {
            "x": v1.FixedLenFeature([1], tf.float32),
            "x2": v1.FixedLenFeature([1], tf.float32, default_value=[0.0])})
        x = tf.identity(features["x"], name="x")
        y = tf.add(a * x, b, name="y")
        y2 = tf.add(a * x, 3.0, name="y2")  # half_plus_three on x
        y3 = tf.add(a * features["x2"], 3.0, name="y3")
        vocab = os.path.join(os.path.dirname(path), f".vocab-{os.path.basename(path)}.txt")
        os.makedirs(os.path.dirname(vocab), exist_ok=True)
        with open(vocab, "w") as f:
            f.write("\n".join(CLASS_NAMES) + "\n")
        vocab_tensor = tf.constant(vocab, name="vocab_path")
        v1.add_to_collection(v1.GraphKeys.ASSET_FILEPATHS, vocab_tensor)
        table = v1.lookup.StaticHashTable(
            v1.lookup.TextFileInitializer(vocab_tensor, tf.int64, v1.lookup.TextFileIndex.LINE_NUMBER,
                                          tf.string, v1.lookup.TextFileIndex.WHOLE_LINE), "")
        # Classes and scores per example: [negative, positive] with scores [3 - y, y - 3] clipped to [0, 1].
        positive = tf.clip_by_value(y - 3.0, 0.0, 1.0)
        scores = tf.concat([1.0 - positive, positive], axis=1, name="scores")
        ids = tf.tile(tf.constant([[0, 1]], tf.int64), [tf.shape(y)[0], 1])
        classes = tf.identity(table.lookup(ids), name="classes")
        session.run(v1.global_variables_initializer())
        sig = v1.saved_model.signature_def_utils
        signatures = {
            "serving_default": sig.predict_signature_def({"x": x}, {"y": y}),
            "predict_x_to_y2": sig.predict_signature_def({"x": x}, {"y": y2}),
            "classify_x_to_y": sig.classification_signature_def(serialized, None, y),
            "classify_x_to_classes": sig.classification_signature_def(serialized, classes, scores),
            "regress_x_to_y": sig.regression_signature_def(serialized, y),
            "regress_x_to_y2": sig.regression_signature_def(serialized, y2),
            "regress_x2_to_y3": sig.regression_signature_def(serialized, y3),
        }
        builder = v1.saved_model.Builder(path)
        builder.add_meta_graph_and_variables(
            session, [v1.saved_model.tag_constants.SERVING], signature_def_map=signatures,
            assets_collection=v1.get_collection(v1.GraphKeys.ASSET_FILEPATHS),
            main_op=v1.tables_initializer(), strip_default_attrs=True)
        builder.save()
    os.remove(vocab)


class _Module(tf.Module):
    """y = 0.5 x + 2 in several shapes of signature, as `tf.saved_model.save` users write them."""

    def __init__(self) -> None:
        super().__init__()
        self.a = tf.Variable(0.5)
        self.b = tf.Variable(2.0)

    @tf.function(input_signature=[tf.TensorSpec([None], tf.float32, name="x")])
    def half_plus_two(self, x):
        return {"y": self.a * x + self.b}

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="inputs")])
    def classify(self, inputs):
        x = tf.io.parse_example(inputs, {"x": tf.io.FixedLenFeature([1], tf.float32)})["x"]
        positive = tf.clip_by_value(self.a * x + self.b - 3.0, 0.0, 1.0)
        ids = tf.tile(tf.constant([[b"negative", b"positive"]]), [tf.shape(x)[0], 1])
        return {"classes": ids, "scores": tf.concat([1.0 - positive, positive], axis=1)}

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="inputs")])
    def regress(self, inputs):
        x = tf.io.parse_example(inputs, {"x": tf.io.FixedLenFeature([1], tf.float32)})["x"]
        return {"outputs": self.a * x + self.b}

    @tf.function(input_signature=[tf.TensorSpec([None, 2], tf.int64, name="ids"),
                                  tf.TensorSpec([None], tf.string, name="text")])
    def multi(self, ids, text):
        return {"sum": tf.reduce_sum(ids, axis=1), "length": tf.strings.length(text),
                "echo_bytes": text}


def tf2_module(base: str, version: str = "1") -> str:
    """A `tf.saved_model.save` export at `base/<version>`; returns the version folder."""
    module = _Module()
    path = os.path.join(base, version)
    tf.saved_model.save(module, path, signatures={
        "serving_default": module.half_plus_two.get_concrete_function(),
        "classify": module.classify.get_concrete_function(),
        "regress": module.regress.get_concrete_function(),
        "multi": module.multi.get_concrete_function()})
    return path


def keras_export(base: str, version: str = "1") -> str:
    """A Keras 3 `model.export()` of a small Dense model with fixed weights: y = x . [1, 2, 3] + 0.5."""
    import keras

    inputs = keras.Input(shape=(3,), name="features")
    dense = keras.layers.Dense(1, name="dense")
    model = keras.Model(inputs, dense(inputs))
    dense.set_weights([np.array([[1.0], [2.0], [3.0]], np.float32), np.array([0.5], np.float32)])
    path = os.path.join(base, version)
    model.export(path, format="tf_saved_model", verbose=False)
    return path


def tflite_beside(version_dir: str) -> str:
    """Convert the SavedModel in `version_dir` to `version_dir/model.tflite` (TF Serving's TFLite file name)."""
    converter = tf.lite.TFLiteConverter.from_saved_model(version_dir, signature_keys=["serving_default"])
    path = os.path.join(version_dir, "model.tflite")
    with open(path, "wb") as f:
        f.write(converter.convert())
    return path


def example(**features: float | list[float] | bytes) -> tf.train.Example:
    """A tf.Example of float (or bytes) features."""
    feature = {}
    for name, value in features.items():
        if isinstance(value, bytes):
            feature[name] = tf.train.Feature(bytes_list=tf.train.BytesList(value=[value]))
        else:
            values = value if isinstance(value, list) else [value]
            feature[name] = tf.train.Feature(float_list=tf.train.FloatList(value=values))
    return tf.train.Example(features=tf.train.Features(feature=feature))


def examples_input(*examples: example_pb2.Example, context: example_pb2.Example | None = None) -> input_pb2.Input:
    if context is None:
        return input_pb2.Input(example_list=input_pb2.ExampleList(examples=examples))
    return input_pb2.Input(example_list_with_context=input_pb2.ExampleListWithContext(
        examples=examples, context=context))


def multi_request(*tasks: tuple[str, str, str]) -> inference_pb2.MultiInferenceRequest:
    request = inference_pb2.MultiInferenceRequest(input=examples_input(example(x=1.0), example(x=2.0)))
    for model, method, signature_name in tasks:
        task = request.tasks.add(method_name=method)
        task.model_spec.name = model
        task.model_spec.signature_name = signature_name
    return request
