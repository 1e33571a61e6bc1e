"""The serving dataplane: one per worker process, shared by REST, gRPC and KServe V2.

Protocols are thin adapters: they turn their wire format into numpy arrays and call `DataPlane.predict`; the dataplane
resolves the servable, validates the inputs against its signature, and hands them to the one dynamic batcher, so
requests from every protocol batch together on one model copy.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
from tensorflow_serving.apis import input_pb2
from tensorflow_serving.config import model_server_config_pb2

from exported_models.model_format import DEFAULT_SIGNATURE, IMAGE_INPUT, SignatureInfo, TensorInfo
from serving.core import examples, images
from serving.core.batching import Batcher, BatchKey, BatchRequest
from serving.core.budget import MemoryBudget
from serving.core.errors import Code, ServingError, invalid
from serving.core.repository import Repository, VersionState, VersionStatus
from serving.core.runtimes import LoadOptions
from serving.core.servable import Servable, loader
from serving.core.source import ModelSource
from serving.core.startup import Startup
from serving.metrics import Metrics, VersionStatistics
from serving.options.config import DataPlaneOptions, ProcessOptions
from serving.options.config_files import check_model_config

logger = logging.getLogger(__name__)

PROBABILITIES_OUTPUT = "probabilities"
ALL_CLASSES = 1 << 30  # Classify on an image signature answers every class
# Arrays by input name, or a function of the signature that builds them (see DataPlane.predict).
Inputs = dict[str, np.ndarray] | Callable[[SignatureInfo], Mapping[str, object]]

NUMPY_DTYPES = {"DT_FLOAT": np.float32, "DT_DOUBLE": np.float64, "DT_HALF": np.float16, "DT_INT8": np.int8,
                "DT_INT16": np.int16, "DT_INT32": np.int32, "DT_INT64": np.int64, "DT_UINT8": np.uint8,
                "DT_UINT16": np.uint16, "DT_UINT32": np.uint32, "DT_UINT64": np.uint64, "DT_BOOL": np.bool_}


@dataclass
class PredictResult:
    model: str
    version: int
    signature_name: str
    outputs: dict[str, np.ndarray]
    class_names: list[str] = field(default_factory=list)  # of the version that answered


# The value kinds each dtype takes, as TF Serving's JSON does: integers only for integer dtypes, any number for
# floats, true/false only for booleans.
_KINDS_FOR = {"b": "b", "i": "iu", "u": "iu", "f": "iuf"}


def numpy_dtype(dtype: str):
    """The numpy dtype for a TF dtype name; object (of bytes) for DT_STRING."""
    if dtype == "DT_STRING":
        return object
    if dtype not in NUMPY_DTYPES:
        raise invalid(f"Unsupported input dtype {dtype}")
    return NUMPY_DTYPES[dtype]


def coerce(name: str, value, info: TensorInfo, static_shapes: bool = True) -> np.ndarray:
    """An input converted to the signature's dtype and checked against its shape (batch dimension included),
    unless the servable runs its signatures by tensor names (TF1 sessions, TFLite), where only the graph's own
    ops check shapes."""
    try:
        if info.dtype == "DT_STRING":
            array = np.asarray(value, dtype=object)
            if array.size and not all(isinstance(v, bytes) for v in array.flat):
                array = np.vectorize(_to_bytes, otypes=[object])(array)
        else:
            array = np.asarray(value)
            want = np.dtype(numpy_dtype(info.dtype))
            if array.size and array.dtype.kind not in _KINDS_FOR[want.kind]:
                # TF Serving's words for it end "is not of expected type: float" (json_tensor.cc TypeError)
                raise ValueError(f"got {array.dtype.name} values, not of expected type: {info.dtype[3:].lower()}")
            if array.size and want.kind in "iu" and (array.min() < np.iinfo(want).min or
                                                     array.max() > np.iinfo(want).max):
                raise ValueError(f"values out of range of {want.name}")
            # Narrowed to float32 or half, a number past its range is inf, as TF Serving's cast (RapidJSON's
            # GetFloat) makes it, without numpy's overflow warning on the server's stderr.
            narrowing = want.kind == "f" and array.dtype.itemsize > want.itemsize
            with np.errstate(over="ignore") if narrowing else contextlib.nullcontext():
                array = array.astype(want, copy=False)
    except (TypeError, ValueError) as error:
        raise invalid(f"Input {name!r} expects {info.dtype}: {error}") from None
    if static_shapes:
        check_shape(name, array, info)
    return array


def check_shape(name: str, array: np.ndarray, info: TensorInfo) -> None:
    """The signature's declared shape, as a model whose functions enforce it (TF2) would refuse the input."""
    if info.shape is not None and (array.ndim != len(info.shape) or any(
            want not in (-1, have) for want, have in zip(info.shape, array.shape, strict=True))):
        raise invalid(f"Input {name!r} has shape {list(array.shape)} but the signature expects "
                      f"{info.shape} (-1 is any size)")


def _check_output_filter(output_filter: list[str], info: SignatureInfo) -> None:
    """TF Serving's checks: every alias is one of the signature's outputs, and none is asked for twice."""
    for i, alias in enumerate(output_filter):
        if alias not in info.outputs:
            raise invalid(f"output tensor alias not found in signature: {alias} Outputs expected to be in the set "
                          f"{{{','.join(sorted(info.outputs))}}}.")
        if alias in output_filter[:i]:
            raise invalid(f"duplicate output tensor alias: {alias}")


def _image_task(task: examples.Task, info: SignatureInfo) -> bool:
    """Petal's image classifiers keep their image path for Classify."""
    return task.method == examples.CLASSIFY_METHOD and IMAGE_INPUT in info.inputs and \
        PROBABILITIES_OUTPUT in info.outputs


def _to_bytes(value) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8")
    raise TypeError(f"expected strings, got {type(value).__name__}")


class _Observed:
    """TF Serving's request count and latency for one request, whatever its API, and Triton's per-version statistics
    for the version that took it (`version`, set once known). A class rather than a generator: it is entered on every
    request."""
    __slots__ = ("metrics", "model", "api", "entrypoint", "started", "version")

    def __init__(self, metrics: Metrics, model: str, api: str, entrypoint: str) -> None:
        self.metrics, self.model, self.api, self.entrypoint = metrics, model, api, entrypoint
        self.started = time.monotonic()
        self.version: int | None = None

    def __enter__(self) -> _Observed:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, traceback: object) -> None:
        elapsed_us = (time.monotonic() - self.started) * 1e6
        status = error.code.name if isinstance(error, ServingError) else "OK"
        metrics, model = self.metrics, self.model
        metrics.request_count.inc(model_name=model, status=status)
        metrics.request_latency.observe(elapsed_us, model_name=model, API=self.api, entrypoint=self.entrypoint)
        if self.version is not None:
            metrics.record_request(model, self.version, status == "OK", elapsed_us)


@dataclass
class DataPlane:
    """Everything one worker process serves. Methods raise ServingError and are safe to call from any thread."""
    repository: Repository[Servable]
    batcher: Batcher
    # The worker's memory budget: protocols hold a request's body in it from admission to answer, and the batcher
    # the decoded pixels of each TF call.
    memory: MemoryBudget
    metrics: Metrics
    options: DataPlaneOptions = field(default_factory=DataPlaneOptions)
    # Where the worker is in its life: its owner (serving/process/worker.py) opens its ports and drains it.
    startup: Startup = field(default_factory=lambda: Startup(loaded=True))
    # The memory budget's limits once the initial load is over, when they are measured then (serving/process/worker.py):
    # called once, by whoever sees the load end first, before the startup gate opens.
    budget_after_load: Callable[[], tuple[int, int]] | None = None
    _settling: threading.Lock = field(default_factory=threading.Lock, repr=False)

    # --- inference ---------------------------------------------------------------------------------------------

    def predict(self, model: str, inputs: Inputs, version: int | None = None,
                label: str | None = None, signature_name: str = "", output_filter: list[str] | None = None,
                deadline: float | None = None, entrypoint: str = "REST", api: str = "predict") -> PredictResult:
        """Run a signature on batched inputs through the dynamic batcher.

        `inputs` may be a function of the signature, for wire formats whose meaning depends on it (REST's
        unnamed instances): it runs under the same hold on the servable as the inference, so a hot reload in
        between cannot unload the version the inputs were resolved against.
        """
        with _Observed(self.metrics, model, api, entrypoint) as observed, \
                self.repository.servable_handle(model, version, label) as servable:
            observed.version = servable.version
            if entrypoint == "GRPC" and (signature_name or DEFAULT_SIGNATURE) not in servable.signatures:
                raise ServingError(Code.FAILED_PRECONDITION,  # TF Serving's gRPC text; REST's is the servable's
                                   f'Serving signature key "{signature_name or DEFAULT_SIGNATURE}" not found.')
            key, info = servable.signature(signature_name)
            arrays = inputs(info) if callable(inputs) else inputs
            _check_output_filter(output_filter or [], info)
            outputs = self._run_on(servable, key, info, arrays, deadline, api)
            if output_filter:
                outputs = {k: outputs[k] for k in output_filter}
            return PredictResult(servable.model, servable.version, key, outputs, servable.class_names)

    def multi_inference(self, model: str, tasks: list[examples.Task], request_input: input_pb2.Input,
                        version: int | None = None, label: str | None = None, deadline: float | None = None,
                        entrypoint: str = "REST", api: str = "classify") -> tuple[int, list[examples.Result]]:
        """Classify and Regress tasks on one model's tf.Examples (one task for Classify or Regress, several for
        MultiInference), each run on the same serialized examples through the batcher.

        A classify task on an image signature (input `image_bytes`, output `probabilities`) reads each example's
        image instead and answers every class, best first, as `classify_images` does.
        """
        with _Observed(self.metrics, model, api, entrypoint) as observed, \
                self.repository.servable_handle(model, version, label) as servable:
            observed.version = servable.version
            examples.check_tasks(tasks)
            infos = {}
            for task in tasks:
                if task.key not in servable.signatures:
                    raise invalid(f"Requested signature not found in model graph: {task.key}"
                                  if api == "multi_inference" else f"No signature was found with the name: {task.key}")
                infos[task.key] = servable.signature(task.key)[1]
                if not _image_task(task, infos[task.key]):
                    examples.check_signature(task.method, infos[task.key])
            with self.memory.hold(0) as hold:
                serialized = examples.serialized_examples(request_input, hold.grow)
                return servable.version, self._run_tasks(servable, model, tasks, infos, serialized, deadline, api)

    def _run_tasks(self, servable: Servable, model: str, tasks: list[examples.Task], infos: dict[str, SignatureInfo],
                   serialized: np.ndarray, deadline: float | None, api: str) -> list[examples.Result]:
        """The tasks of multi_inference, apart so that its hold on the examples' memory spans every call."""
        results = []
        for task in tasks:
            info = infos[task.key]
            if _image_task(task, info):
                images_bytes = np.array(examples.example_images(serialized, IMAGE_INPUT), dtype=object)
                outputs = self._run_on(servable, task.key, info, {IMAGE_INPUT: images_bytes}, deadline, api)
                rows = images.top_k(outputs[PROBABILITIES_OUTPUT], servable.class_names, ALL_CLASSES)
                results.append(examples.Result(task.method, task.key, classifications=rows))
            else:
                outputs = self._run_on(servable, task.key, examples.fed_as_serialized(info),
                                       {examples.INPUTS: serialized}, deadline, api)
                results.append(examples.result(task, outputs, len(serialized)))
        if api == "multi_inference":  # TF Serving counts the examples of MultiInference alone (multi_inference.cc)
            self.metrics.example_counts.observe(len(serialized), model=model)
            self.metrics.example_count_total.inc(len(serialized), model=model)
        return results

    def classify_images(self, model: str, images_bytes: list[bytes], version: int | None = None,
                        label: str | None = None, signature_name: str = "", top_k: int = 5,
                        deadline: float | None = None,
                        entrypoint: str = "REST") -> tuple[int, list[list[tuple[str, float]]]]:
        """Top-k (label, score) per image, for image models (an `image_bytes` input, `probabilities` output)."""
        def image_inputs(info: SignatureInfo) -> dict[str, np.ndarray]:
            if IMAGE_INPUT not in info.inputs or PROBABILITIES_OUTPUT not in info.outputs:
                raise invalid(f"Signature {signature_name or DEFAULT_SIGNATURE!r} of model {model} is not an image "
                              f"classifier (needs input {IMAGE_INPUT!r} and output {PROBABILITIES_OUTPUT!r})")
            return {IMAGE_INPUT: np.array(images_bytes, dtype=object)}
        result = self.predict(model, image_inputs, version, label, signature_name,
                              output_filter=[PROBABILITIES_OUTPUT], deadline=deadline, entrypoint=entrypoint,
                              api="classify")
        return result.version, images.top_k(result.outputs[PROBABILITIES_OUTPUT], result.class_names, top_k)

    def _run_on(self, servable: Servable, key: str, info: SignatureInfo, inputs: Mapping[str, object],
                deadline: float | None, api: str) -> dict[str, np.ndarray]:
        """Validate the inputs of one signature and run them, batched with other requests when they can be."""
        arrays, batched, pixels = self._validate(info, inputs, servable.static_shapes, key in servable.batched,
                                                 servable.scaled_jpeg_inputs.get(key, {}))
        rows = next(iter(arrays.values())).shape[0] if batched else 1  # unbatched: one row of the whole request
        cost = servable.costs.get(key)
        if cost is not None:  # what a row's activations hold joins what its images decode to
            pixels = pixels + cost.row_pixels
        max_rows = 0 if cost is None or self.options.batching_from_file else cost.max_batch_size
        return self.batcher.run(BatchRequest(BatchKey(servable.model, servable.version, key),
                                             functools.partial(servable.run, key), arrays, rows, pixels, deadline,
                                             api, batched, max_rows))

    def _validate(self, info: SignatureInfo, inputs: Mapping[str, object], static_shapes: bool = True,
                  signature_batches: bool = False, scaled_jpegs: Mapping[str, tuple[int, int]] | None = None,
                  ) -> tuple[dict[str, np.ndarray], bool, np.ndarray]:
        """The inputs as arrays, whether they batch, and the decoded pixels of each row (of the whole request when
        they do not), which the worker's pixel budget counts: a JPEG in an input that the signature decodes scaled
        (`scaled_jpegs`, by input name: model_format.SCALED_JPEG_FILE) at the size it decodes at.

        Inputs batch when their signature does (`signature_batches`, decided at load: serving/core/batchable.py)
        and they share a dimension 0; a request with a scalar, or with inputs of uneven dimension 0, runs alone, as
        TF Serving runs every request without --enable_batching. An input the request leaves out takes the
        signature's default, if it has one."""
        inputs = {**{k: v for k, v in info.default_arrays.items() if k not in inputs}, **inputs}
        missing = sorted(set(info.inputs) - set(inputs))
        extra = sorted(set(inputs) - set(info.inputs))
        if missing or extra:
            raise invalid(f"Input names must be {sorted(info.inputs)}; missing {missing}, unexpected {extra}")
        arrays = {name: coerce(name, inputs[name], info.inputs[name], static_shapes) for name in info.inputs}
        scaled_jpegs = scaled_jpegs or {}
        pixels = [images.check_pixels(array, self.options.max_image_pixels, scaled_jpegs.get(name))
                  for name, array in arrays.items() if info.inputs[name].dtype == "DT_STRING"]
        batched = signature_batches and bool(arrays) and all(a.ndim > 0 for a in arrays.values()) and len(
            {a.shape[0] for a in arrays.values()}) == 1
        if not batched:
            return arrays, False, np.array([sum(int(p.sum()) for p in pixels)])
        if len(pixels) == 1 and pixels[0].ndim == 1:
            return arrays, True, pixels[0]  # one string per row (an image classifier's): already each row's pixels
        rows = next(iter(arrays.values())).shape[0]
        per_row = (p.reshape(rows, math.prod(p.shape[1:])).sum(axis=1) for p in pixels)  # rows may be 0
        return arrays, True, sum(per_row, np.zeros(rows, np.int64))

    # --- model management --------------------------------------------------------------------------------------

    def status(self, model: str, version: int | None = None, label: str | None = None) -> list[VersionStatus]:
        return self.repository.status(model, version, label)

    def signatures(self, model: str, version: int | None = None, label: str | None = None,
                   internal: bool = False) -> tuple[int, dict[str, SignatureInfo]]:
        """The signatures requests can call; with `internal`, the SavedModel's whole signature_def map, which TF
        Serving's metadata lists (a TF2 model's `__saved_model_init_op` too)."""
        with self.repository.servable_handle(model, version, label) as servable:
            return servable.version, servable.metadata if internal else servable.signatures

    def draining(self) -> bool:
        """Whether the worker has begun to drain (`Startup.drain`): readiness is false from then on."""
        return self.startup.draining

    def ready(self) -> bool:
        return not self.draining() and self.startup.done and self.repository.ready()

    def model_ready(self, model: str, version: int | None = None) -> bool:
        return not self.draining() and self.repository.model_ready(model, version)

    def model_names(self) -> list[str]:
        return self.repository.model_names()

    def version_labels(self) -> dict[str, dict[str, int]]:
        """Every configured model with its labels and their versions: no TF Serving API lists either."""
        return self.repository.version_labels()

    def available_versions(self, model: str) -> list[int]:
        """The versions of a model that serve requests now, newest first."""
        return [s.version for s in self.repository.status(model) if s.state == VersionState.AVAILABLE]

    def statistics(self, model: str | None = None,
                   version: int | None = None) -> list[tuple[str, int, VersionStatistics]]:
        """Triton's statistics: each AVAILABLE version of `model` (of every model when None, skipping models with
        none yet), or the one version asked for (NOT_FOUND unless it is AVAILABLE), with its totals so far."""
        if model is None:
            keys = [(name, v) for name in self.model_names() for v in self._available_or_none(name)]
        elif version is None:
            keys = [(model, v) for v in self.available_versions(model)]
        else:
            keys = [(model, self.signatures(model, version)[0])]
        totals = self.metrics.version_statistics()
        return [(name, v, totals.get((name, v)) or VersionStatistics()) for name, v in keys]

    def _available_or_none(self, model: str) -> list[int]:
        try:
            return self.available_versions(model)
        except ServingError:  # configured, but no version on disk yet
            return []

    def wait_loaded(self) -> None:
        """Block until the startup pass has loaded, warmed or failed every version it aspired to, and the memory
        budget is settled."""
        self.repository.wait_first_pass()
        with self._settling:
            measure, self.budget_after_load = self.budget_after_load, None
            if measure is not None:
                try:
                    limits = measure()
                except Exception:  # an unreadable cgroup must not leave the budget refusing every request
                    logger.exception("memory budget not measured; keeping the estimate")
                    limits = self.memory.limit, self.memory.pixel_limit
                self.memory.settle(*limits)
        self.startup.loaded()

    def wait_started(self, deadline: float | None = None) -> bool:
        """Block until the initial load is over and the worker's ports are open (serving/core/startup.py), or
        until the deadline; whether it started."""
        return self.startup.wait(deadline)

    def reload_config(self, config: model_server_config_pb2.ModelServerConfig, deadline: float | None = None,
                      ended: Callable[[], bool] = lambda: False, applied: Callable[[], None] = lambda: None) -> None:
        """Serve these models from now on, and return once each model new to the config has an AVAILABLE version,
        as TF Serving's ServerCore::ReloadConfig does, so that a client can use them as soon as its reload returns
        (UNKNOWN if one fails to load; DEADLINE_EXCEEDED at `deadline`, UNAVAILABLE once `ended()`:
        Repository.wait_available). A config that breaks a rule a config file must keep (`check_model_config`) is
        INVALID_ARGUMENT. `applied` runs once the config is taken, before the wait: the worker passes it on to its
        siblings there, so that they load alongside this one."""
        try:
            check_model_config(config, self.options.model_root)
        except ValueError as error:
            raise invalid(str(error)) from None
        reload = self.repository.reload_config(config)
        applied()
        self.repository.wait_available(reload, deadline, ended)

    def close(self) -> None:
        self.repository.stop()
        self.batcher.close()

    @classmethod
    def create(cls, options: DataPlaneOptions, startup: Startup | None = None,
               drain_seconds: float = ProcessOptions.graceful_timeout,
               budget_after_load: Callable[[], tuple[int, int]] | None = None) -> DataPlane:
        """A DataPlane serving `options.model_config`, its models loading in the background (readiness reports
        progress). It has started once they have loaded and the ports `startup` waits for (none without one) have
        opened. An unloaded version's requests in flight get `drain_seconds` (--graceful_timeout) to finish. With
        `budget_after_load` the memory budget's limits are what it returns once the load is over; until then it
        admits no body."""
        metrics = Metrics()
        memory = MemoryBudget(options.memory_budget_bytes, options.max_inflight_pixels, metrics,
                              pending=budget_after_load is not None)
        batcher = Batcher(options.batching, metrics, enabled=options.enable_batching, budget=memory)
        load_options = LoadOptions.from_flags(options.saved_model_tags, options.prefer_tflite_model,
                                              options.enable_batching)
        repository = Repository(options.model_config,
                                loader(load_options, metrics, warmup=options.enable_model_warmup,
                                       largest_batch=options.batching.max_batch_size if options.enable_batching else 0,
                                       cost_seconds=options.batch_cost_seconds), metrics,
                                options.file_system_poll_wait_seconds, on_unload=batcher.forget,
                                drain_seconds=drain_seconds,
                                allow_version_labels_for_unavailable_models=(
                                    options.allow_version_labels_for_unavailable_models),
                                source=ModelSource(options.model_cache_dir))
        dataplane = cls(repository=repository, batcher=batcher, memory=memory, metrics=metrics, options=options,
                        startup=startup or Startup(), budget_after_load=budget_after_load)
        repository.start()
        threading.Thread(target=dataplane.wait_loaded, name="petal-startup", daemon=True).start()
        return dataplane
