"""Which signatures of a version the dynamic batcher may merge, decided once, when the version loads.

TF Serving batches nothing unless told to (--enable_batching); Petal batches by default, so a signature that
cannot batch must still answer what TF Serving answers. A signature batches when every input has a known rank of
at least 1 with a free dimension 0, and every output follows the batch along dimension 0. The outputs are tried
on a probe batch of two rows where one can be built (inputs of numbers or booleans: zeros); where it cannot
(strings: an empty one is rarely a valid image or tf.Example) or the model refuses the zeros, their static shapes
decide: a known rank of at least 1 with a free dimension 0. Any other signature runs unbatched, one inference per
request, under the same deadline, memory budget and metrics (serving/core/batching.py).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import types_pb2

from exported_models.model_format import SignatureInfo, TensorInfo

PROBE_ROWS = 2
RunFn = Callable[[dict[str, np.ndarray]], Mapping[str, np.ndarray]]


def unbatched_reason(info: SignatureInfo, run: RunFn) -> str | None:
    """Why the signature cannot batch, or None when it can; `run` calls it on inputs by name."""
    if not info.inputs:
        return "it has no inputs"
    for name, tensor in sorted(info.inputs.items()):
        reason = _not_batched(f"input {name}", tensor.shape)
        if reason:
            return reason
    for name, tensor in sorted(info.outputs.items()):
        if tensor.shape is not None:
            reason = _not_batched(f"output {name}", tensor.shape)
            if reason:
                return reason
    outputs = _probe(info, run)
    if outputs is not None:
        for name, value in sorted(outputs.items()):
            if value.ndim == 0 or value.shape[0] != PROBE_ROWS:
                return f"output {name} has shape {list(value.shape)} for a batch of {PROBE_ROWS}"
        return None
    unknown = sorted(name for name, tensor in info.outputs.items() if tensor.shape is None)
    return f"output {unknown[0]} has an unknown rank" if unknown else None


def _not_batched(what: str, shape: list[int] | None) -> str | None:
    if shape is None:
        return f"{what} has an unknown rank"
    if not shape:
        return f"{what} is a scalar"
    if shape[0] != -1:
        return f"{what} fixes dimension 0 to {shape[0]}"
    return None


def _probe(info: SignatureInfo, run: RunFn) -> Mapping[str, np.ndarray] | None:
    """The outputs for a batch of zeros, or None when no such batch can be built or the model refuses it."""
    inputs = {}
    for name, tensor in info.inputs.items():
        dtype = _numeric_dtype(tensor)
        if dtype is None:
            return None
        inputs[name] = np.zeros([PROBE_ROWS] + [1 if d == -1 else d for d in (tensor.shape or [])[1:]], dtype)
    try:
        return run(inputs)
    except Exception:  # a probe the model cannot run proves nothing, and must not fail the load
        return None


def _numeric_dtype(tensor: TensorInfo) -> np.dtype | None:
    try:
        dtype = tf.as_dtype(types_pb2.DataType.Value(tensor.dtype))
    except (ValueError, TypeError):
        return None
    return np.dtype(dtype.as_numpy_dtype) if dtype.is_numpy_compatible and (dtype.is_bool or dtype.is_floating or
                                                                          dtype.is_integer) else None
