"""The core's public interface: the names serving/core/__init__.py lists in `__all__`, imported the first time one
of them is used there (this module imports TensorFlow)."""
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
from serving.core.runtimes import pooled_bytes
from serving.core.servable import Servable
from serving.core.startup import Startup
