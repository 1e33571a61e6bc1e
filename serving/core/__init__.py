"""The dataplane: one `DataPlane` per worker process, shared by every protocol.

This package's namespace is the core's public interface (`interface`). Protocol adapters import from here, never
from the modules behind it (the repository, batcher, servable), as the import-linter contract in pyproject.toml
checks; the batch job runs a `Servable` on its own, checking rows with the same `coerce` and `check_shape`.

Its names are looked up in `interface` on first use (PEP 562), since they import TensorFlow and Python runs this file
before any module of the package: so gunicorn's master checks a config's version labels with the repository's own
rule (`version_labels`) without loading TensorFlow.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from serving.core.interface import *  # noqa: F403

__all__ = ["CLASSIFY_METHOD", "DEFAULT_SIGNATURE", "IMAGE_INPUT", "MAX_TRACE_S", "NUMPY_DTYPES",
           "PROBABILITIES_OUTPUT", "REGRESS_METHOD", "Code", "DataPlane", "Inputs", "PredictResult", "Profiler",
           "Result", "Servable", "ServingError", "SignatureInfo", "Startup", "Task", "TensorInfo", "VersionState",
           "VersionStatus", "check_shape", "coerce", "deadline_exceeded", "has_events", "invalid", "not_found",
           "pooled_bytes", "save_trace", "trace_path", "unavailable"]


def __getattr__(name: str) -> Any:
    if name not in __all__:  # a module of the package, say, which the import system then imports
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module("serving.core.interface"), name)
