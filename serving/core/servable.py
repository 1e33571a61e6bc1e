"""One loaded model version: its signatures, labels and TensorFlow functions, run and warmed up.

Loading reads everything through the model-format contract (exported_models/model_format.py), so the server reads
exactly what training wrote.
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf
from tensorflow.core.protobuf import error_codes_pb2

from exported_models import model_format
from exported_models.model_format import DEFAULT_SIGNATURE, SignatureInfo
from serving.core import examples
from serving.core.errors import Code, ServingError, invalid, op_error_message
from serving.metrics import Metrics


def _status_error(error: tf.errors.OpError) -> ServingError:
    """TensorFlow's error codes are the status codes, so the code carries over as it is."""
    return ServingError(Code[error_codes_pb2.Code.Name(error.error_code)], op_error_message(error.message) or str(error))


class Servable:
    """One loaded version. `refs` counts requests in flight, so an unload can wait for them to finish."""

    def __init__(self, model: str, version: int, path: str):
        self.model = model
        self.version = version
        self.path = path
        self.signatures = model_format.read_signatures(path)
        self._loaded = tf.saved_model.load(path)
        self._fns = {key: self._loaded.signatures[key] for key in self.signatures if key in self._loaded.signatures}
        self.labels = model_format.version_labels(path)
        self.refs = 0

    def signature(self, name: str) -> tuple[str, SignatureInfo]:
        key = name or DEFAULT_SIGNATURE
        info = self.signatures.get(key)
        if info is None or key not in self._fns:
            raise invalid(f"Serving signature name: \"{key}\" not found in signature def")
        return key, info

    def run(self, signature_name: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Call one signature; TensorFlow's errors become ServingErrors with the same code."""
        fn = self._fns[signature_name]
        try:
            outputs = fn(**{k: tf.constant(v) for k, v in inputs.items()})
        except tf.errors.OpError as error:
            raise _status_error(error) from None
        except (TypeError, ValueError) as error:
            raise invalid(str(error).splitlines()[0]) from None
        return {k: v.numpy() for k, v in outputs.items()}

    def warmup(self, metrics: Metrics) -> int:
        """Replay the version's warmup requests (Predict, Classify, Regress, MultiInference); a failure fails
        the load."""
        count = 0
        for request in model_format.read_warmup(self.path):
            if request.examples is None:
                key, _ = self.signature(request.signature_name)
                self.run(key, request.inputs)
            for method, signature_name in request.tasks:
                key, info = self.signature(signature_name)
                examples.check_signature(method, info)
                self.run(key, {examples.INPUTS: examples.serialized_examples(request.examples)})
            count += 1
        metrics.warmup_requests.inc(count, model_name=self.model, version=str(self.version))
        return count
