"""TF Serving's gRPC API called the way its example clients call it, for every test that does: a PredictRequest whose
tensors tf.make_tensor_proto made, and the error an RPC raised. The `channel` and `stub` fixtures
(tests/e2e/conftest.py) are a channel to the module's `server` and PredictionService on it."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import grpc
import pytest
import tensorflow as tf
from tensorflow_serving.apis import predict_pb2

from server_harness import jpeg

MB = 1024 * 1024
# Clients refuse messages over 4 MB by default; the tests send and receive larger ones.
CHANNEL_OPTIONS = [("grpc.max_send_message_length", 64 * MB), ("grpc.max_receive_message_length", 64 * MB)]


def predict_request(model: str = "flowers", signature: str = "", *, jpegs: Sequence[bytes] | None = None,
                    version: int | None = None, version_label: str = "", **inputs: Any) -> predict_pb2.PredictRequest:
    """A Predict of `model` (its `signature`, `version` or `version_label` if given) with each of `inputs` as
    tf.make_tensor_proto makes it; `jpegs` (encoded images) as the image model's `image_bytes` of shape [N]. With
    neither, one JPEG of the tiny model's size."""
    request = predict_pb2.PredictRequest()
    request.model_spec.name = model
    request.model_spec.signature_name = signature
    if version is not None:
        request.model_spec.version.value = version
    if version_label:
        request.model_spec.version_label = version_label
    if jpegs is None and not inputs:
        jpegs = [jpeg()]
    if jpegs is not None:
        request.inputs["image_bytes"].CopyFrom(tf.make_tensor_proto(list(jpegs), dtype=tf.string, shape=[len(jpegs)]))
    for name, value in inputs.items():
        request.inputs[name].CopyFrom(tf.make_tensor_proto(value))
    return request


def rpc_error(call: Callable[..., Any], *args: Any, **kwargs: Any) -> grpc.RpcError:
    """The error `call(*args, **kwargs)` must raise."""
    with pytest.raises(grpc.RpcError) as info:
        call(*args, **kwargs)
    return info.value
