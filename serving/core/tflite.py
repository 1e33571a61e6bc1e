"""A version's `model.tflite` on TensorFlow's TFLite interpreter, for --prefer_tflite_model.

The signatures are, as TF Serving's TfLiteSession reads them, the SignatureDefs stored in the file's metadata
(`signature_defs_metadata`, written by TensorFlow Lite's signature_def_utils): their input and output keys are what
a request names (TF Serving's half_plus_two_tflite_with_sigdef: `x` and `y`, over tensors `tflite_input` and `y`),
each bound to the tensor its TensorInfo names, with or without `:0`. Without them, the file's own signature runners,
with the interpreter's tensor names; a file with neither gets TF Serving's generated one: `serving_default`, a
predict signature over the model's input and output tensors named without their `:0`. Every run resizes the inputs
to the request's shapes. One interpreter serves the version and is not thread-safe, so runs take turns on it; it
uses as many threads as a TF2 model's intra-op pool.
"""
from __future__ import annotations

import threading
import warnings

import numpy as np
import tensorflow as tf
from flatbuffers import flexbuffers
from tensorflow.core.protobuf import meta_graph_pb2
from tensorflow.lite.python import schema_py_generated as tflite_schema

from exported_models.model_format import DEFAULT_SIGNATURE, SignatureInfo, TensorInfo, dtype_name, signature_info
from serving.core.errors import invalid

PREDICT_METHOD = "tensorflow/serving/predict"
SIGNATURE_DEFS_METADATA = b"signature_defs_metadata"  # TensorFlow Lite's kSignatureDefsMetadataName


def _tensor_info(details: dict) -> TensorInfo:
    shape = details.get("shape_signature", details["shape"])
    return TensorInfo(name=details["name"], dtype=dtype_name(details["dtype"]), shape=[int(d) for d in shape])


def _legacy_name(tensor_name: str) -> str:
    return tensor_name.split(":", 1)[0]


def stored_signature_defs(model: bytes) -> dict[str, meta_graph_pb2.SignatureDef]:
    """The SignatureDefs in a TFLite file's metadata: a flexbuffer map of key to serialized SignatureDef, in the
    buffer the metadata entry `signature_defs_metadata` points to; {} for a file without it."""
    root = tflite_schema.Model.GetRootAs(model, 0)
    for i in range(root.MetadataLength()):
        entry = root.Metadata(i)
        if entry.Name() == SIGNATURE_DEFS_METADATA:
            stored = flexbuffers.GetRoot(root.Buffers(entry.Buffer()).DataAsNumpy().tobytes()).AsMap
            return {key.AsKey: meta_graph_pb2.SignatureDef.FromString(stored[key.AsKey].AsStringBytes)
                    for key in stored.Keys}
    return {}


def _bound(tensors: dict[str, int], infos: dict[str, TensorInfo], what: str) -> dict[str, int]:
    """Each key's tensor index: the tensor its TensorInfo names, or that name without `:0` (TF Serving's
    FixTfLiteTensorName); a name the model lacks fails the load, as in TF Serving."""
    bound = {}
    for key, info in infos.items():
        name = info.name if info.name in tensors else _legacy_name(info.name)
        if name not in tensors:
            raise ValueError(f"Signature {what} {key} references an unknown tensor: Unknown tensor '{info.name}'.")
        bound[key] = tensors[name]
    return bound


class TfLiteModel:
    format = "tflite"
    static_shapes = False

    def __init__(self, path: str):
        threads = tf.config.threading.get_intra_op_parallelism_threads() or None
        with warnings.catch_warnings():  # its deprecation notice (for ai_edge_litert) would print on every load
            warnings.filterwarnings("ignore", message=".*tf.lite.Interpreter is deprecated", category=UserWarning)
            self._interpreter = tf.lite.Interpreter(model_path=path, num_threads=threads)
        self._lock = threading.Lock()
        with open(path, "rb") as f:
            stored = stored_signature_defs(f.read())
        self._runners = {} if stored else {key: self._interpreter.get_signature_runner(key)
                                           for key in self._interpreter.get_signature_list()}
        self._tensors: dict[str, tuple[dict[str, int], dict[str, int]]] = {}  # key: its inputs' and outputs' indices
        if self._runners:
            self.signatures = {key: SignatureInfo(
                inputs={k: _tensor_info(v) for k, v in runner.get_input_details().items()},
                outputs={k: _tensor_info(v) for k, v in runner.get_output_details().items()},
                method_name=PREDICT_METHOD) for key, runner in self._runners.items()}
            self.metadata = self.signatures
            return
        inputs = {d["name"]: d["index"] for d in self._interpreter.get_input_details()}
        outputs = {d["name"]: d["index"] for d in self._interpreter.get_output_details()}
        if stored:
            self.signatures = {key: signature_info(sig) for key, sig in stored.items()}
        else:
            details = self._interpreter.get_input_details(), self._interpreter.get_output_details()
            self.signatures = {DEFAULT_SIGNATURE: SignatureInfo(
                inputs={_legacy_name(d["name"]): _tensor_info(d) for d in details[0]},
                outputs={_legacy_name(d["name"]): _tensor_info(d) for d in details[1]}, method_name=PREDICT_METHOD)}
        self._tensors = {key: (_bound(inputs, info.inputs, "input"), _bound(outputs, info.outputs, "output"))
                         for key, info in self.signatures.items()}
        self.metadata = self.signatures

    def run(self, key: str, inputs: dict[str, np.ndarray], output_names: list[str]) -> dict[str, np.ndarray]:
        """TFLite reports bad input (a dtype, a shape its kernels refuse) as ValueError or RuntimeError."""
        try:
            with self._lock:
                outputs = self._runners[key](**inputs) if self._runners else self._run_tensors(key, inputs)
        except (ValueError, RuntimeError) as error:
            raise invalid(str(error).strip().splitlines()[0]) from None
        return {name: outputs[name] for name in output_names}

    def _run_tensors(self, key: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        interpreter = self._interpreter
        input_indices, output_indices = self._tensors[key]
        for name, value in inputs.items():
            interpreter.resize_tensor_input(input_indices[name], value.shape, strict=False)
        interpreter.allocate_tensors()
        for name, value in inputs.items():
            interpreter.set_tensor(input_indices[name], value)
        interpreter.invoke()
        return {name: interpreter.get_tensor(index) for name, index in output_indices.items()}
