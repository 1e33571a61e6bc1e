"""A version's `model.tflite` on TensorFlow's TFLite interpreter, for --prefer_tflite_model.

The signatures are the file's own (its signature runners), with the interpreter's tensor names, as TF Serving
reports them. A file without any gets TF Serving's generated one: `serving_default`, a predict signature over
the model's input and output tensors named without their `:0`. Every run resizes the inputs to the request's
shapes. One interpreter serves the version and is not thread-safe, so runs take turns on it; it uses as many
threads as a TF2 model's intra-op pool.
"""
from __future__ import annotations

import threading
import warnings

import numpy as np
import tensorflow as tf

from exported_models.model_format import DEFAULT_SIGNATURE, SignatureInfo, TensorInfo, dtype_name
from serving.core.errors import invalid

PREDICT_METHOD = "tensorflow/serving/predict"


def _tensor_info(details: dict) -> TensorInfo:
    shape = details.get("shape_signature", details["shape"])
    return TensorInfo(name=details["name"], dtype=dtype_name(details["dtype"]), shape=[int(d) for d in shape])


def _legacy_name(tensor_name: str) -> str:
    return tensor_name.split(":", 1)[0]


class TfLiteModel:
    format = "tflite"
    static_shapes = False

    def __init__(self, path: str):
        threads = tf.config.threading.get_intra_op_parallelism_threads() or None
        with warnings.catch_warnings():  # its deprecation notice (for ai_edge_litert) would print on every load
            warnings.filterwarnings("ignore", message=".*tf.lite.Interpreter is deprecated", category=UserWarning)
            self._interpreter = tf.lite.Interpreter(model_path=path, num_threads=threads)
        self._lock = threading.Lock()
        self._runners = {key: self._interpreter.get_signature_runner(key)
                         for key in self._interpreter.get_signature_list()}
        if self._runners:
            self.signatures = {key: SignatureInfo(
                inputs={k: _tensor_info(v) for k, v in runner.get_input_details().items()},
                outputs={k: _tensor_info(v) for k, v in runner.get_output_details().items()},
                method_name=PREDICT_METHOD) for key, runner in self._runners.items()}
        else:
            inputs = {_legacy_name(d["name"]): d for d in self._interpreter.get_input_details()}
            outputs = {_legacy_name(d["name"]): d for d in self._interpreter.get_output_details()}
            self._inputs = {name: d["index"] for name, d in inputs.items()}
            self._outputs = {name: d["index"] for name, d in outputs.items()}
            self.signatures = {DEFAULT_SIGNATURE: SignatureInfo(
                inputs={name: _tensor_info(d) for name, d in inputs.items()},
                outputs={name: _tensor_info(d) for name, d in outputs.items()}, method_name=PREDICT_METHOD)}
        self.metadata = self.signatures

    def run(self, key: str, inputs: dict[str, np.ndarray], output_names: list[str]) -> dict[str, np.ndarray]:
        """TFLite reports bad input (a dtype, a shape its kernels refuse) as ValueError or RuntimeError."""
        try:
            with self._lock:
                outputs = self._runners[key](**inputs) if self._runners else self._run_tensors(inputs)
        except (ValueError, RuntimeError) as error:
            raise invalid(str(error).strip().splitlines()[0]) from None
        return {name: outputs[name] for name in output_names}

    def _run_tensors(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        interpreter = self._interpreter
        for name, value in inputs.items():
            interpreter.resize_tensor_input(self._inputs[name], value.shape, strict=False)
        interpreter.allocate_tensors()
        for name, value in inputs.items():
            interpreter.set_tensor(self._inputs[name], value)
        interpreter.invoke()
        return {name: interpreter.get_tensor(index) for name, index in self._outputs.items()}
