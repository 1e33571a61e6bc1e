"""One loaded model version: its signatures, class names and model, run and warmed up.

Loading reads everything through the model-format contract (exported_models/model_format.py), so the server reads
exactly what training wrote; serving/core/runtimes.py picks how the version runs (TF2 functions, a TF1 Session, or
TFLite), and this class is the same whichever it is.
"""
from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable

import numpy as np

from exported_models import model_format
from exported_models.model_format import DEFAULT_SIGNATURE, SignatureInfo
from serving.core import cost, examples
from serving.core.batchable import unbatched_reason
from serving.core.errors import ServingError, invalid
from serving.core.runtimes import LoadOptions, load, load_error, tensor_pool
from serving.metrics import Metrics

logger = logging.getLogger(__name__)


class Servable:
    """One loaded version; the repository counts the requests in flight on it, and `loader` below makes it for
    the repository. `class_names` come from exported_models/model_format.py.

    `static_shapes` says whether running checks the signature's shapes itself (TF2 functions do); where it is
    False (a Session, TFLite) only the model's own ops check them, as in TF Serving. `batched` holds the signatures
    the batcher may merge (serving/core/batchable.py), decided at load when batching is on.
    """

    def __init__(self, model: str, version: int, path: str, options: LoadOptions = LoadOptions()):
        self.model = model
        self.version = version
        self.path = path
        self._loaded = load(path, options)
        self.format = self._loaded.format
        self.signatures = self._loaded.signatures
        self.metadata = self._loaded.metadata  # what the metadata APIs list: TF Serving's whole signature_def map
        self.static_shapes = self._loaded.static_shapes
        self.class_names = model_format.class_names(path)
        self.scaled_jpeg_inputs = model_format.scaled_jpeg_inputs(path)  # what the memory budget charges JPEGs at
        self.warmup_records = 0  # replayed by `warmup`
        self.costs: dict[str, cost.BatchCost] = {}  # by signature, measured after warmup (`measure_cost`)
        self._cost_sample: tuple[str, dict[str, np.ndarray]] | None = None  # a warmup predict of a batched signature
        self.batched = self._batched_signatures() if options.batching else frozenset()

    def _batched_signatures(self) -> frozenset[str]:
        unbatched = {key: reason for key, info in sorted(self.signatures.items())
                     if (reason := unbatched_reason(info, functools.partial(self.run, key))) is not None}
        if unbatched:
            logger.warning("signatures that run unbatched, one inference per request",
                           extra={"fields": {"model": self.model, "version": self.version, "signatures": unbatched}})
        return frozenset(self.signatures) - set(unbatched)

    def signature(self, name: str) -> tuple[str, SignatureInfo]:
        key = name or DEFAULT_SIGNATURE
        info = self.signatures.get(key)
        if info is None:
            raise invalid(f"Serving signature name: \"{key}\" not found in signature def")
        return key, info

    def run(self, signature_name: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Call one signature for all its outputs (a Predict's output filter is the DataPlane's); TensorFlow's errors
        become ServingErrors with the same code."""
        return self._loaded.run(signature_name, inputs, list(self.signatures[signature_name].outputs))

    def warmup(self, metrics: Metrics) -> int:
        """Replay the version's warmup requests (Predict, Classify, Regress, MultiInference); a failure fails
        the load. A version with a warmup file is timed and counted in TF Serving's metrics
        (servables/tensorflow/saved_model_warmup_util.cc), labelled with its folder and the warmup's status as
        absl prints it ("OK", or "CODE: message"), so dashboards written for TF Serving see failed warmups."""
        if not model_format.has_warmup(self.path):
            return 0
        start, count, status = time.perf_counter(), 0, "OK"
        try:
            for request in model_format.read_warmup(self.path):
                if request.examples is None:
                    key, _ = self.signature(request.signature_name)
                    self.run(key, request.inputs)
                    if self._cost_sample is None and key in self.batched and all(
                            np.ndim(value) and len(value) for value in request.inputs.values()):
                        self._cost_sample = key, request.inputs
                for method, signature_name in request.tasks:
                    key, info = self.signature(signature_name)
                    examples.check_signature(method, info)
                    self.run(key, {examples.INPUTS: examples.serialized_examples(request.examples)})
                count += 1
        except Exception as error:
            failure = error if isinstance(error, ServingError) else load_error(error)
            status = f"{failure.code.name}: {failure.message}"
            raise
        finally:
            metrics.warmup_latency.observe((time.perf_counter() - start) * 1e6, model_path=self.path, status=status)
            metrics.warmup_records_read.inc(count, model_path=self.path, status=status)
        metrics.warmup_requests.inc(count, model_name=self.model, version=str(self.version))
        self.warmup_records = count
        return count

    def measure_cost(self, largest: int, seconds: float) -> None:
        """Measure the cost per batch size (serving/core/cost.py) of the signature a warmup predict ran in batches,
        on its first image; nothing without one."""
        if self._cost_sample is None:
            return
        key, inputs = self._cost_sample
        measured = self.costs[key] = cost.measure(functools.partial(self.run, key), inputs, largest, seconds,
                                                  tensor_pool)
        logger.info("batch cost", extra={"fields": {"model": self.model, "version": self.version, "signature": key,
                                                    **measured.fields()}})


def loader(options: LoadOptions, metrics: Metrics, warmup: bool = True, largest_batch: int = 0,
           cost_seconds: float = 0.0) -> Callable[[str, int, str], Servable]:
    """The repository's loader (serving/core/repository.py), TF Serving's SavedModelBundle loader: a version is
    loaded with these options and, with --enable_model_warmup, warmed up before the repository serves it, then
    its cost per batch size up to `largest_batch` measured for up to `cost_seconds` (none with either 0). A load
    that fails raises the status the repository reports (`load_error`)."""
    def load(model: str, version: int, path: str) -> Servable:
        try:
            servable = Servable(model, version, path, options)
            if warmup:
                servable.warmup(metrics)
                if largest_batch and cost_seconds > 0:
                    servable.measure_cost(largest_batch, cost_seconds)
        except Exception as error:
            raise load_error(error) from error
        return servable
    return load
