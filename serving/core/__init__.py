"""The dataplane: one `DataPlane` per worker process, shared by every protocol.

This package's namespace is the core's public interface. Protocol adapters import from here, never from the
modules behind it (the repository, batcher, servable), as the import-linter contract in pyproject.toml checks; the
batch job runs a `Servable` on its own, checking rows with the same `coerce` and `check_shape`.
"""
from exported_models.model_format import DEFAULT_SIGNATURE, SignatureInfo, TensorInfo
from serving.core.dataplane import (
    IMAGE_INPUT,
    NUMPY_DTYPES,
    PROBABILITIES_OUTPUT,
    DataPlane,
    Inputs,
    PredictResult,
    check_shape,
    coerce,
)
from serving.core.errors import Code, ServingError, deadline_exceeded, invalid, not_found, unavailable
from serving.core.examples import CLASSIFY_METHOD, REGRESS_METHOD, Result, Task
from serving.core.profiler import MAX_TRACE_S, Profiler, has_events, trace_path
from serving.core.profiler import save as save_trace
from serving.core.repository import VersionState, VersionStatus
from serving.core.servable import Servable
from serving.core.startup import Startup

__all__ = ["CLASSIFY_METHOD", "DEFAULT_SIGNATURE", "IMAGE_INPUT", "MAX_TRACE_S", "NUMPY_DTYPES",
           "PROBABILITIES_OUTPUT", "REGRESS_METHOD", "Code", "DataPlane", "Inputs", "PredictResult", "Profiler",
           "Result", "Servable", "ServingError", "SignatureInfo", "Startup", "Task", "TensorInfo", "VersionState",
           "VersionStatus", "check_shape", "coerce", "deadline_exceeded", "has_events", "invalid", "not_found",
           "save_trace", "trace_path", "unavailable"]
