"""SavedModels exported the way other people export them, built at test time: never shaped by Petal's code.
TF Serving's own test models (half_plus_two and its kin) are exported_models/tf_serving_models.py.

- `tf1_classifier`: a TF1 graph (`tf.compat.v1.saved_model.Builder`) of an Estimator-style classifier: serialized
  `tf.Example`s parsed in the graph, class names from an asset read by a lookup table that the main op
  initialises, a classify signature (classes and scores) and a predict one over the same tensors.
- `tf2_module`: a `tf.Module` saved with `tf.saved_model.save`, several signatures, all with method name predict.
- `keras_export`: a Keras 3 model written by `model.export()`.
- `tflite_beside`: a `model.tflite` converted from the TF2 module, next to its SavedModel, for
  `--prefer_tflite_model`.
"""
from __future__ import annotations

import os
import tempfile

import numpy as np
import tensorflow as tf
from tensorflow.core.example import example_pb2
from tensorflow_serving.apis import inference_pb2, input_pb2

CLASS_NAMES = ("negative", "positive")  # the TF1 classifier's asset: the class of 0.5 x + 2 < 3 and >= 3


def tf1_classifier(path: str) -> str:
    """The TF1 SavedModel at `path` (a version folder): for each example's x, scores [1 - p, p] with
    p = clip(0.5 x - 1, 0, 1) and the classes CLASS_NAMES. Returns `path`."""
    v1 = tf.compat.v1
    with tempfile.TemporaryDirectory() as scratch, tf.Graph().as_default() as graph, \
            v1.Session(graph=graph) as session:
        serialized = v1.placeholder(tf.string, shape=[None], name="input_example_tensor")
        x = v1.parse_example(serialized, {"x": v1.FixedLenFeature([1], tf.float32)})["x"]
        vocab = os.path.join(scratch, "classes.txt")
        with open(vocab, "w") as f:
            f.write("\n".join(CLASS_NAMES) + "\n")
        vocab_tensor = tf.constant(vocab, name="vocab_path")
        v1.add_to_collection(v1.GraphKeys.ASSET_FILEPATHS, vocab_tensor)
        table = v1.lookup.StaticHashTable(
            v1.lookup.TextFileInitializer(vocab_tensor, tf.int64, v1.lookup.TextFileIndex.LINE_NUMBER,
                                          tf.string, v1.lookup.TextFileIndex.WHOLE_LINE), "")
        positive = tf.clip_by_value(0.5 * x - 1.0, 0.0, 1.0)
        scores = tf.concat([1.0 - positive, positive], axis=1, name="scores")
        classes = tf.identity(table.lookup(tf.tile(tf.constant([[0, 1]], tf.int64), [tf.shape(x)[0], 1])),
                              name="classes")
        sig = v1.saved_model.signature_def_utils
        builder = v1.saved_model.Builder(path)
        builder.add_meta_graph_and_variables(
            session, [v1.saved_model.tag_constants.SERVING], signature_def_map={
                "serving_default": sig.classification_signature_def(serialized, classes, scores),
                "predict": sig.predict_signature_def({"examples": serialized}, {"classes": classes, "scores": scores})},
            assets_collection=v1.get_collection(v1.GraphKeys.ASSET_FILEPATHS), main_op=v1.tables_initializer())
        builder.save()
    return path


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
