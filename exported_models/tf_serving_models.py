"""TF Serving's own test models, rebuilt when asked for from the facts of TF Serving's generator
(`tensorflow_serving/servables/tensorflow/testdata/saved_model_half_plus_two.py`), so that Petal is tried on the
models TF Serving's tests and documentation use, not on models shaped to fit Petal. The tests, the benchmarks
(perf_analyzer's float model, the Session callable's cost) and anyone trying Petal the way TF Serving's tutorial
does (`half_plus_two("/tmp/half_plus_two/1")`, then `petal serve --model_base_path=/tmp/half_plus_two`) build
them here.

- `half_plus_two`: the TF1 graph (`saved_model_half_plus_two_cpu`). A `tf_example` string placeholder of shape
  [None] is parsed (`parse_example`, features `x` and `x2`, `x2` defaulting to 0); `x` is an identity of the parsed
  `x`, NOT a placeholder, so a Predict feeds the intermediate tensor `x:0` (static shape [-1, 1]) by name and the
  fed value replaces it whatever its shape. y = a x + b, y2 = a x + c, y3 = a2 x2 + c2 with variables a = 0.5,
  b = 2, c = 3, a2 = 0.5, c2 = 3. An asset `foo.txt` whose name the main op assigns to a variable. Signatures:
  serving_default (predict x -> y), regress_x_to_y, regress_x_to_y2, classify_x_to_y (over `tf_example`) and
  regress_x2_to_y3 (x2 -> y3).
- `half_plus_three`: the same graph with b = 3, as TF Serving's `saved_model_half_plus_three` holds (a 0.5, b 3).
- `half_plus_two_2_versions`: the TF1 model twice, in TF Serving's zero-padded folders 00000123 and 00000124.
- `half_plus_two_tf2`: the native TF2 `tf.Module` (`saved_model_half_plus_two_tf2_cpu`): variables a, b, c and an
  asset, its predict input a `TensorSpec([1])`, so only one x at a time; regress and classify over serialized
  examples, and regress_x2_to_y3 / classify_x2_to_y3 over a float of shape [1]; every signature's method is
  predict, as `tf.saved_model.save` writes them.
- `half_plus_two_tflite`: `saved_model_half_plus_two_tflite`, the TF1 graph's x (ensured to shape [1, 1]) to y
  converted with the TFLite converter from the session: `model.tflite`, no signature def.
- `scalar_signatures`: the two-signature tf.Module of TF Serving's server test, whose outputs are scalars.

TF Serving's answers: predict 2.0 -> 3.0 (its test client), [1, 2, 5] -> [2.5, 3.0, 4.5] (its README); regress
and classify of x = 2 -> 3.0; half_plus_three 2.0 -> 4.0.
"""
from __future__ import annotations

import os
import tempfile

import tensorflow as tf
from tensorflow.python.util import deprecation

VERSIONS = ("00000123", "00000124")
ASSET = "foo.txt"
ASSET_CONTENTS = "asset-file-contents"
PREDICT, REGRESS, CLASSIFY = ("tensorflow/serving/predict", "tensorflow/serving/regress",
                              "tensorflow/serving/classify")


def _features(v1) -> dict:
    return {"x": v1.FixedLenFeature([1], tf.float32),
            "x2": v1.FixedLenFeature([1], tf.float32, default_value=[0.0])}


def _signature(v1, method: str, inputs: dict, outputs: dict):
    info = v1.saved_model.utils.build_tensor_info
    with deprecation.silence():  # TF1's API, which these models are built with on purpose, says it is deprecated
        return v1.saved_model.signature_def_utils.build_signature_def(
            {k: info(t) for k, t in inputs.items()}, {k: info(t) for k, t in outputs.items()}, method)


def _variable(v1, value, name: str, **kwargs):
    """A TF1 reference variable (VariableV2), as TF 1.x graphs hold them, not TF2's resource variables."""
    return v1.Variable(value, name=name, use_resource=False, **kwargs)


def _asset_source(folder: str) -> str:
    path = os.path.join(folder, ASSET)
    with open(path, "w") as f:
        f.write(ASSET_CONTENTS)
    return path


def half_plus_two(path: str, b: float = 2.0, tflite: bool = False) -> str:
    """The TF1 SavedModel at `path` (a version folder); with `tflite`, `path/model.tflite` instead. Returns `path`."""
    v1 = tf.compat.v1
    with tempfile.TemporaryDirectory() as scratch, tf.Graph().as_default() as graph, \
            v1.Session(graph=graph) as session:
        with tf.device("/cpu:0"):
            a_var = _variable(v1, 0.5, "a")
            b_var = _variable(v1, b, "b")
            c_var = _variable(v1, 3.0, "c")
            serialized = v1.placeholder(tf.string, shape=[None], name="tf_example")
            parsed = v1.parse_example(serialized, _features(v1))
            x = (tf.ensure_shape(parsed["x"], (1, 1), name="x") if tflite else tf.identity(parsed["x"], name="x"))
            y = tf.identity(tf.add(tf.multiply(a_var, x), b_var), name="y")
            y2 = tf.identity(tf.add(tf.multiply(a_var, x), c_var), name="y2")
            x2 = tf.identity(parsed["x2"], name="x2")
            a2 = _variable(v1, 0.5, "a2")
            c2 = _variable(v1, 3.0, "c2")
            y3 = tf.identity(tf.add(tf.multiply(a2, x2), c2), name="y3")
        v1.add_to_collection(v1.GraphKeys.ASSET_FILEPATHS, tf.constant(_asset_source(scratch)))
        filename = _variable(v1, ASSET, "filename_tensor", trainable=False, collections=[])
        assign_filename = filename.assign(ASSET)
        session.run(v1.global_variables_initializer())
        if tflite:
            model = v1.lite.TFLiteConverter.from_session(session, [x], [y]).convert()
            os.makedirs(path, exist_ok=True)
            with open(os.path.join(path, "model.tflite"), "wb") as f:
                f.write(model)
            return path
        signatures = {
            "regress_x_to_y": _signature(v1, REGRESS, {"inputs": serialized}, {"outputs": y}),
            "regress_x_to_y2": _signature(v1, REGRESS, {"inputs": serialized}, {"outputs": y2}),
            "regress_x2_to_y3": _signature(v1, REGRESS, {"inputs": x2}, {"outputs": y3}),
            "classify_x_to_y": _signature(v1, CLASSIFY, {"inputs": serialized}, {"scores": y}),
            "serving_default": _signature(v1, PREDICT, {"x": x}, {"y": y}),
        }
        builder = v1.saved_model.Builder(path)
        builder.add_meta_graph_and_variables(
            session, [v1.saved_model.tag_constants.SERVING], signature_def_map=signatures,
            assets_collection=v1.get_collection(v1.GraphKeys.ASSET_FILEPATHS), main_op=tf.group(assign_filename))
        builder.save()
    return path


def half_plus_three(path: str) -> str:
    return half_plus_two(path, b=3.0)


def half_plus_two_2_versions(base: str) -> str:
    """`base/00000123` and `base/00000124`, the same TF1 model twice; returns `base`."""
    for version in VERSIONS:
        half_plus_two(os.path.join(base, version))
    return base


def half_plus_two_tflite(path: str) -> str:
    return half_plus_two(path, tflite=True)


class _HalfPlusTwo(tf.Module):
    """TF Serving's native TF2 half_plus_two."""

    def __init__(self, asset: str) -> None:
        super().__init__()
        self.a = tf.Variable(0.5, name="a")
        self.b = tf.Variable(2.0, name="b")
        self.c = tf.Variable(3.0, name="c")
        self.asset = tf.saved_model.Asset(asset)

    def _line(self, x, intercept):
        return tf.add(tf.multiply(self.a, x), intercept)

    @staticmethod
    def _x(serialized):
        return tf.io.parse_example(serialized, {"x": tf.io.FixedLenFeature([1], tf.float32),
                                                "x2": tf.io.FixedLenFeature([1], tf.float32, default_value=[0.0])})["x"]

    @tf.function(input_signature=[tf.TensorSpec([1], tf.float32)])
    def predict(self, x):
        return {"y": self._line(x, self.b)}

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="inputs")])
    def regress_x_to_y(self, serialized):
        return {"outputs": self._line(self._x(serialized), self.b)}

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="inputs")])
    def regress_x_to_y2(self, serialized):
        return {"outputs": self._line(self._x(serialized), self.c)}

    @tf.function(input_signature=[tf.TensorSpec([1], tf.float32, name="inputs")])
    def regress_x2_to_y3(self, x2):
        return {"outputs": self._line(x2, self.c)}

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="inputs")])
    def classify_x_to_y(self, serialized):
        return {"scores": self._line(self._x(serialized), self.b)}

    @tf.function(input_signature=[tf.TensorSpec([1], tf.float32, name="inputs")])
    def classify_x2_to_y3(self, x2):
        return {"scores": self._line(x2, self.c)}


def half_plus_two_tf2(path: str) -> str:
    """The TF2 SavedModel at `path` (a version folder); returns `path`."""
    with tempfile.TemporaryDirectory() as scratch:
        module = _HalfPlusTwo(_asset_source(scratch))
        signatures = {key: getattr(module, key) for key in (
            "regress_x_to_y", "regress_x_to_y2", "regress_x2_to_y3", "classify_x_to_y", "classify_x2_to_y3")}
        tf.saved_model.save(module, path, signatures={**signatures, "serving_default": module.predict})
    return path


def scalar_signatures(path: str) -> str:
    """tensorflow_model_server_test.py's test_tf_saved_model_save_multiple_signatures: two signatures of an input of
    unknown rank whose output y is a scalar (1.0 for serving_default, 2.0 for custom_signature_key), which no
    batch can follow. Returns `path`."""
    root = tf.train.Checkpoint()
    root.f = tf.function(lambda x: {"y": 1.0}, input_signature=[tf.TensorSpec(None, tf.float32)])
    root.g = tf.function(lambda x: {"y": 2.0}, input_signature=[tf.TensorSpec(None, tf.float32)])
    tf.saved_model.save(root, path, signatures={"serving_default": root.f, "custom_signature_key": root.g})
    return path
