"""The dataplane: one `DataPlane` per worker process, shared by every protocol.

This package's namespace is the core's public interface. Protocol adapters import from here, never from the
modules behind it (the repository, batcher, servable), as the import-linter contract in pyproject.toml checks.
"""
from exported_models.model_format import DEFAULT_SIGNATURE, SignatureInfo, TensorInfo
from serving.core.dataplane import IMAGE_INPUT, NUMPY_DTYPES, PROBABILITIES_OUTPUT, DataPlane, Inputs, PredictResult
from serving.core.errors import Code, ServingError, deadline_exceeded, invalid, not_found, unavailable
from serving.core.examples import CLASSIFY_METHOD, REGRESS_METHOD, Result, Task, input_from_json
from serving.core.repository import VersionState, VersionStatus

__all__ = ["CLASSIFY_METHOD", "DEFAULT_SIGNATURE", "IMAGE_INPUT", "NUMPY_DTYPES", "PROBABILITIES_OUTPUT",
           "REGRESS_METHOD", "Code", "DataPlane", "Inputs", "PredictResult", "Result", "ServingError", "SignatureInfo",
           "Task", "TensorInfo", "VersionState", "VersionStatus", "deadline_exceeded", "input_from_json", "invalid",
           "not_found", "unavailable"]
