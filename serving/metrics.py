"""Prometheus metrics with TF Serving's names, plus what a Petal operator also needs.

The values live in `prometheus_client`, so that the numbers are right across gunicorn's worker processes:

- **One registry per `Metrics`.** Each `Metrics()` registers its metrics in its own `CollectorRegistry`, never in
  the global default one, so several instances in one process (unit tests) are independent and never collide on a
  name. In-process, without `PROMETHEUS_MULTIPROC_DIR`, `render()` reads only that registry.
- **Multiprocess mode.** `prepare_multiprocess(directory)`, called by the gunicorn master before it forks, sets
  `PROMETHEUS_MULTIPROC_DIR`; every value a worker then creates is a float in that worker's mmapped file there,
  and `render()` in any worker aggregates the whole directory with `multiprocess.MultiProcessCollector`, so
  `/monitoring/prometheus/metrics` shows the same totals whichever worker answers. Counters and histograms of
  workers that exited still count (a counter never goes down); `worker_exited(pid)`, called by the master when it
  reaps a worker, drops that worker's *live* gauges. In this mode there should be one `Metrics` per process (two
  instances in one process would write the same file entries), which is what the server does: one per worker.
  `.value()` and `.count()` then read the calling process's own share, not the aggregate.
- **TF Serving's names, no `_total`.** `prometheus_client` names a counter's sample `<name>_total` (OpenMetrics)
  and adds `<name>_created` samples; TF Serving's own exporter writes `:tensorflow:serving:request_count{...} 3`
  with `# TYPE ... counter`, and dashboards written for TF Serving query that name. So `render()` does not use
  `generate_latest`: it collects the metric families (from the registry or the multiprocess collector) and writes
  the text format (0.0.4) itself, with each counter sample named after its family, `_created` samples dropped,
  series sorted by label values, and numbers written as TF Serving does (`3`, not `3.0`; `le="10"`).
  TF Serving's names have `/` turned into `:` exactly as its own Prometheus exporter does.
- **Gauges across workers.** `batch_queue_depth` is `livesum`: the rows waiting in all live workers' queues.
  `loaded_versions` is `livemax`: every worker loads the same versions, so a sum would say 2 for one version with
  two workers; `livemax` says 1 while any live worker serves the version and keeps the exposition's labels as they
  are (`liveall` would add a `pid` label to every series and a series per worker). A multiprocess sample cannot be
  deleted from another process's view (`prometheus_client` warns that `remove` is not implemented there), so
  `.remove()` sets the value to 0 and a gauge built with `zero_is_absent=True` (`loaded_versions`, which is only
  ever 1 when present) leaves its 0 series out of the exposition; in-process the child is also really removed.
  `model_source_reachable` is `livemin`: 0 as soon as any live worker could not list a model's base path.
- **Hot path.** Each wrapper caches the `prometheus_client` child per label-value tuple, so an update is one dict
  lookup plus the child's own update; `labels()` (validation, a lock) runs once per new label set.
"""
from __future__ import annotations

import glob
import math
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import prometheus_client
from prometheus_client import values
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead
from prometheus_client.samples import Sample

# TF Serving's request/runtime latency buckets are exponential in microseconds.
LATENCY_BUCKETS_US = tuple(10.0 * 1.8 ** i for i in range(33))
BATCH_SIZE_BUCKETS = tuple(float(2 ** i) for i in range(13))
# TF Serving's request_example_counts: 1, 2, 4, ..., 16384, then +Inf (servables/tensorflow/util.cc).
EXAMPLE_COUNT_BUCKETS = tuple(float(2 ** i) for i in range(15))

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
# How the gauges here combine the worker processes' values (a subset of prometheus_client.Gauge's modes).
MultiprocessMode = Literal["livesum", "livemax", "livemin", "max"]

_value_class_lock = threading.Lock()
# The directory `prometheus_client.values.ValueClass` currently writes to (None: in-process values).
_value_class_dir: str | None = (os.environ.get(MULTIPROC_ENV)
                                if getattr(values.ValueClass, "_multiprocess", False) else None)


def _sync_value_class() -> str | None:
    """Make the values metrics create from now on match `PROMETHEUS_MULTIPROC_DIR`; returns that directory.

    `prometheus_client` picks its value class once, when it is imported; the master may have imported it before
    `prepare_multiprocess` set the variable (and tests unset it again), so switch it here, once per change.
    """
    global _value_class_dir
    directory = os.environ.get(MULTIPROC_ENV) or None
    with _value_class_lock:
        if directory != _value_class_dir:
            values.ValueClass = values.get_value_class()
            _value_class_dir = directory
    return directory


def prepare_multiprocess(directory: str) -> None:
    """Turn on multiprocess metrics; call in the gunicorn master before it forks any worker.

    Creates `directory` if needed, deletes the `*.db` files a previous server left there (only those: the
    directory is never emptied of anything else), sets `PROMETHEUS_MULTIPROC_DIR` so that forked workers inherit
    it, and switches `prometheus_client` to mmapped values. Every `Metrics` created afterwards, in this process or
    a child, writes its values under `directory`, and its `render()` aggregates all of them.
    """
    os.makedirs(directory, exist_ok=True)
    for path in glob.glob(os.path.join(directory, "*.db")):
        os.remove(path)
    os.environ[MULTIPROC_ENV] = directory
    _sync_value_class()


def worker_exited(pid: int) -> None:
    """Forget a dead worker's live gauges (its queue depth, its loaded versions); call in the master on reaping it.

    Its counters and histograms stay in the aggregate, as they should. A no-op outside multiprocess mode, so the
    process layer may call it unconditionally.
    """
    directory = os.environ.get(MULTIPROC_ENV)
    if directory:
        mark_process_dead(pid, directory)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(names: tuple[str, ...], values_: tuple[str, ...], extra: str = "") -> str:
    parts = [f'{n}="{_escape(str(v))}"' for n, v in zip(names, values_, strict=True)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


class _Metric:
    """One `prometheus_client` metric with the keyword-label interface Petal's callers use."""

    kind = ""

    def __init__(self, name: str, help: str, labelnames: tuple[str, ...], metric: Any):
        self.name = name
        self.family = name  # the name prometheus_client collects it under
        self.help = help
        self.labelnames = labelnames
        self._metric = metric
        self._multiprocess = getattr(values.ValueClass, "_multiprocess", False)
        self._children: dict[tuple[Any, ...], Any] = {}

    def _child(self, labels: dict[str, Any]) -> Any:
        key = tuple(map(labels.get, self.labelnames))
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self._metric.labels(*self._normal(key))
        return child

    def series(self, **labels: Any) -> Any:
        """The `prometheus_client` child of one label set, for a caller that updates it on every request: holding
        it spares the label lookup per update (its `inc`, `set` or `observe` is then the only work)."""
        return self._child(labels)

    @staticmethod
    def _normal(key: tuple[Any, ...]) -> tuple[str, ...]:
        return tuple("" if v is None else str(v) for v in key)

    def _key(self, labels: dict[str, str]) -> tuple[str, ...]:
        return tuple(str(labels[n]) for n in self.labelnames)

    def _local(self, sample_name: str, **labels: Any) -> float:
        """This process's value of one sample of one series (0 when there is none)."""
        wanted = dict(zip(self.labelnames, self._normal(tuple(map(labels.get, self.labelnames))), strict=True))
        for family in self._metric.collect():
            for sample in family.samples:
                if sample.name == sample_name and sample.labels == wanted:
                    return sample.value
        return 0.0

    def render(self, samples: list[Sample]) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]
        series = sorted((self._key(s.labels), s.value) for s in samples if self._shown(s))
        lines += [f"{self.name}{_labels(self.labelnames, k)} {_number(v)}" for k, v in series]
        return lines

    def _shown(self, sample: Sample) -> bool:
        return sample.name == self.name


class Counter(_Metric):
    kind = "counter"

    def __init__(self, name: str, help: str, labelnames: tuple[str, ...],
                 registry: prometheus_client.CollectorRegistry):
        super().__init__(name, help, labelnames,
                         prometheus_client.Counter(name, help, labelnames, registry=registry))
        self.family = name.removesuffix("_total")  # prometheus_client strips it (TF Serving's name keeps it)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        self._child(labels).inc(amount)

    def value(self, **labels: str) -> float:
        return self._local(self.family + "_total", **labels)

    def _shown(self, sample: Sample) -> bool:
        return sample.name == self.family + "_total"  # not `_created`; rendered under the name it was given


class Gauge(_Metric):
    kind = "gauge"

    def __init__(self, name: str, help: str, labelnames: tuple[str, ...],
                 registry: prometheus_client.CollectorRegistry, multiprocess_mode: MultiprocessMode,
                 zero_is_absent: bool = False):
        super().__init__(name, help, labelnames, prometheus_client.Gauge(
            name, help, labelnames, registry=registry, multiprocess_mode=multiprocess_mode))
        self.zero_is_absent = zero_is_absent

    def set(self, value: float, **labels: str) -> None:
        self._child(labels).set(value)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        self._child(labels).inc(amount)

    def remove(self, **labels: str) -> None:
        """Drop a series. In multiprocess mode its mmapped value is set to 0, which `zero_is_absent` hides."""
        normal = self._normal(tuple(map(labels.get, self.labelnames)))
        for key in [k for k in self._children if self._normal(k) == normal]:
            self._children.pop(key).set(0)
        if not self._multiprocess:
            self._metric.remove(*normal)

    def value(self, **labels: str) -> float:
        return self._local(self.name, **labels)

    def _shown(self, sample: Sample) -> bool:
        return sample.name == self.name and not (self.zero_is_absent and sample.value == 0)


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name: str, help: str, labelnames: tuple[str, ...], buckets: tuple[float, ...],
                 registry: prometheus_client.CollectorRegistry):
        super().__init__(name, help, labelnames,
                         prometheus_client.Histogram(name, help, labelnames, buckets=buckets, registry=registry))
        self.buckets = buckets

    def observe(self, value: float, **labels: str) -> None:
        self._child(labels).observe(value)

    def count(self, **labels: str) -> int:
        return int(self._local(self.name + "_count", **labels))

    def render(self, samples: list[Sample]) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        series: dict[tuple[str, ...], dict[str, Any]] = {}
        for sample in samples:
            entry = series.setdefault(self._key(sample.labels), {"buckets": [], "sum": 0.0, "count": 0.0})
            if sample.name == self.name + "_bucket":
                entry["buckets"].append((float(sample.labels["le"]), sample.value))
            elif sample.name == self.name + "_sum":
                entry["sum"] = sample.value
            elif sample.name == self.name + "_count":
                entry["count"] = sample.value
        for key in sorted(series):
            entry = series[key]
            for bound, cumulative in sorted(entry["buckets"]):
                le = 'le="' + _number(bound) + '"'
                lines.append(f"{self.name}_bucket{_labels(self.labelnames, key, le)} {_number(cumulative)}")
            lines.append(f"{self.name}_sum{_labels(self.labelnames, key)} {_number(entry['sum'])}")
            lines.append(f"{self.name}_count{_labels(self.labelnames, key)} {_number(entry['count'])}")
        return lines


class Summary(_Metric):
    """A count and a sum (no quantiles): what Triton's statistics report per stage, as `(count, ns)` pairs."""

    kind = "summary"

    def __init__(self, name: str, help: str, labelnames: tuple[str, ...],
                 registry: prometheus_client.CollectorRegistry):
        super().__init__(name, help, labelnames,
                         prometheus_client.Summary(name, help, labelnames, registry=registry))

    def observe(self, value: float, **labels: str) -> None:
        self._child(labels).observe(value)

    def render(self, samples: list[Sample]) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} summary"]
        series = sorted((self._key(s.labels), s.name, s.value) for s in samples
                        if s.name in (self.name + "_sum", self.name + "_count"))
        lines += [f"{name}{_labels(self.labelnames, k)} {_number(v)}" for k, name, v in series]
        return lines


@dataclass
class Stage:
    """How many requests went through a stage, and their total time in it."""
    count: int = 0
    us: float = 0.0


@dataclass
class _VersionSeries:
    """One model version's statistics series (`prometheus_client` children), resolved once."""
    success: Any
    fail: Any
    last_inference: Any
    queue: Any
    compute: Any
    inferences: Any
    executions: dict[int, Any] = field(default_factory=dict)  # by executed (padded) batch size


@dataclass
class VersionStatistics:
    """One model version's totals since the server started, across workers: Triton's ModelStatistics."""
    success: Stage = field(default_factory=Stage)
    fail: Stage = field(default_factory=Stage)
    queue: Stage = field(default_factory=Stage)
    compute: Stage = field(default_factory=Stage)
    inference_count: int = 0
    last_inference_ms: int = 0
    batches: dict[int, Stage] = field(default_factory=dict)  # by executed (padded) batch size


class Metrics:
    """Every metric a worker exports; protocols and the batcher update them, `/monitoring/...` renders them.

    Create it after `prepare_multiprocess` (in the worker) for its values to be aggregated across workers.
    """

    def __init__(self) -> None:
        self._directory = _sync_value_class()
        self.registry = registry = prometheus_client.CollectorRegistry(auto_describe=False)
        tfs = ":tensorflow:serving:"
        self.request_count = Counter(tfs + "request_count", "The total number of requests.",
                                     ("model_name", "status"), registry)
        self.request_latency = Histogram(tfs + "request_latency", "Distribution of wall time (in microseconds) "
                                         "for Tensorflow Serving request.", ("model_name", "API", "entrypoint"),
                                         LATENCY_BUCKETS_US, registry)
        self.runtime_latency = Histogram(tfs + "runtime_latency", "Distribution of wall time (in microseconds) "
                                         "for Tensorflow Serving runtime.", ("model_name", "API", "runtime"),
                                         LATENCY_BUCKETS_US, registry)
        self.queuing_latency = Histogram(tfs + "batching_session:queuing_latency", "Distribution of wall time "
                                         "spent (in microseconds) in queuing", ("model_name",), LATENCY_BUCKETS_US,
                                         registry)
        self.processed_batch_size = Histogram(tfs + "batching_session:processed_batch_size", "Tracks the batch "
                                              "size distribution on processing.", ("model_name",),
                                              BATCH_SIZE_BUCKETS, registry)
        self.padding_size = Histogram(tfs + "batching_session:padding_size", "Tracks the padding size "
                                      "distribution on batches.", ("model_name", "execution_batch_size"),
                                      BATCH_SIZE_BUCKETS, registry)
        self.queue_depth = Gauge(":petal:serving:batch_queue_depth", "Rows waiting in the batch queue.",
                                 ("model_name",), registry, multiprocess_mode="livesum")
        self.rejected = Counter(":petal:serving:rejected_requests", "Requests rejected before running, by "
                                "reason.", ("model_name", "reason"), registry)
        self.memory_held = Gauge(":petal:serving:memory_budget_held_bytes", "Bytes of the workers' memory "
                                 "budgets held by requests in flight, by kind (bodies, pixels).", ("kind",),
                                 registry, multiprocess_mode="livesum")
        self.memory_budget = Gauge(":petal:serving:memory_budget_bytes", "Bytes of the workers' memory budgets, "
                                   "by kind (bodies, pixels); absent until a budget measured after the models' "
                                   "load is known.", ("kind",), registry, multiprocess_mode="livesum")
        self.load_latency = Histogram(":petal:serving:model_load_latency", "Wall time (in microseconds) to load "
                                      "and warm up a model version.", ("model_name",), LATENCY_BUCKETS_US, registry)
        self.loaded_versions = Gauge(":petal:serving:loaded_versions", "1 for each AVAILABLE model version.",
                                     ("model_name", "version"), registry, multiprocess_mode="livemax",
                                     zero_is_absent=True)
        self.source_reachable = Gauge(":petal:serving:model_source_reachable", "1 while a model's base path "
                                      "can be listed, 0 while its store cannot be reached (the loaded versions keep "
                                      "serving).", ("model_name",), registry, multiprocess_mode="livemin")
        self.source_errors = Counter(":petal:serving:model_source_outages", "Times a model's base path could no "
                                     "longer be listed.", ("model_name",), registry)
        self.warmup_requests = Counter(":petal:serving:warmup_requests", "Warmup records replayed.",
                                       ("model_name", "version"), registry)
        self.warmup_latency = Histogram(tfs + "model_warmup_latency", "Distribution of wall time (in "
                                        "microseconds) for warming up the model.", ("model_path", "status"),
                                        LATENCY_BUCKETS_US, registry)
        self.warmup_records_read = Counter(tfs + "model_warmup_records_read", "Total number of warmup records "
                                           "read during model warmup.", ("model_path", "status"), registry)
        self.example_counts = Histogram(tfs + "request_example_counts", "The number of tensorflow.Examples per "
                                        "request.", ("model",), EXAMPLE_COUNT_BUCKETS, registry)
        self.example_count_total = Counter(tfs + "request_example_count_total", "The total number of "
                                           "tensorflow.Examples.", ("model",), registry)
        # Per model version, for Triton's statistics extension (`version_statistics` reads them back).
        version = ("model_name", "version")
        self.version_requests = Summary(":petal:serving:version_request_duration_us", "Wall time (in microseconds) "
                                        "of the requests a model version served, by outcome (success, fail).",
                                        version + ("outcome",), registry)
        self.version_queue = Summary(":petal:serving:version_queue_duration_us", "Wall time (in microseconds) a "
                                     "model version's requests waited in its batch queue.", version, registry)
        self.version_compute = Summary(":petal:serving:version_compute_duration_us", "Wall time (in microseconds) "
                                       "of the model execution each request of a model version was part of.",
                                       version, registry)
        self.version_executions = Summary(":petal:serving:version_execution_duration_us", "Wall time (in "
                                          "microseconds) of a model version's executions, by batch size (padding "
                                          "included).", version + ("batch_size",), registry)
        self.version_inferences = Counter(":petal:serving:version_inferences", "Inferences a model version "
                                          "computed: batched rows (padding excluded), or 1 a request without "
                                          "batching.", version, registry)
        self.version_last_inference = Gauge(":petal:serving:version_last_inference_ms", "When a model version "
                                            "last answered a request (milliseconds since the epoch).", version,
                                            registry, multiprocess_mode="max")
        self._all: list[_Metric] = [
            self.request_count, self.request_latency, self.runtime_latency, self.queuing_latency,
            self.processed_batch_size, self.padding_size, self.queue_depth, self.rejected, self.memory_held,
            self.memory_budget, self.load_latency, self.loaded_versions, self.source_reachable, self.source_errors,
            self.warmup_requests, self.warmup_latency,
            self.warmup_records_read, self.example_counts, self.example_count_total, self.version_requests,
            self.version_queue, self.version_compute, self.version_executions, self.version_inferences,
            self.version_last_inference]
        self._versions: dict[tuple[str, int], _VersionSeries] = {}

    def record_request(self, model: str, version: int, ok: bool, elapsed_us: float) -> None:
        """A request that reached a model version ended (the dataplane calls this for every protocol)."""
        series = self._version_series(model, version)
        (series.success if ok else series.fail).observe(elapsed_us)
        series.last_inference.set(int(time.time() * 1000))

    def record_execution(self, model: str, version: int, queued_us: list[float], rows: int, batch_size: int,
                         elapsed_us: float) -> None:
        """One model execution serving requests that waited `queued_us` each (the batcher calls this)."""
        series = self._version_series(model, version)
        for wait in queued_us:
            series.queue.observe(wait)
            series.compute.observe(elapsed_us)
        series.inferences.inc(rows)
        execution = series.executions.get(batch_size)
        if execution is None:
            execution = series.executions[batch_size] = self.version_executions.series(
                model_name=model, version=str(version), batch_size=str(batch_size))
        execution.observe(elapsed_us)

    def _version_series(self, model: str, version: int) -> _VersionSeries:
        """A version's statistics series, looked up by label once (record_request and record_execution run for
        every request, and six label lookups each cost more than the updates themselves)."""
        series = self._versions.get((model, version))
        if series is None:
            labels = {"model_name": model, "version": str(version)}
            series = self._versions[(model, version)] = _VersionSeries(
                self.version_requests.series(outcome="success", **labels),
                self.version_requests.series(outcome="fail", **labels),
                self.version_last_inference.series(**labels), self.version_queue.series(**labels),
                self.version_compute.series(**labels), self.version_inferences.series(**labels))
        return series

    def version_statistics(self) -> dict[tuple[str, int], VersionStatistics]:
        """Every model version's totals so far, summed over all workers in multiprocess mode."""
        def stage(pick: Any) -> Any:
            def add(entry: VersionStatistics, sample: Sample) -> None:
                target = pick(entry, sample.labels)
                if sample.name.endswith("_count"):
                    target.count += int(sample.value)
                elif sample.name.endswith("_sum"):
                    target.us += sample.value
            return add

        def inferences(entry: VersionStatistics, sample: Sample) -> None:
            if sample.name.endswith("_total"):
                entry.inference_count += int(sample.value)

        def last_inference(entry: VersionStatistics, sample: Sample) -> None:
            entry.last_inference_ms = max(entry.last_inference_ms, int(sample.value))

        readers = {
            self.version_requests.name: stage(lambda e, labels: e.success if labels["outcome"] == "success"
                                              else e.fail),
            self.version_queue.name: stage(lambda e, labels: e.queue),
            self.version_compute.name: stage(lambda e, labels: e.compute),
            self.version_executions.name: stage(lambda e, labels: e.batches.setdefault(int(labels["batch_size"]),
                                                                                       Stage())),
            self.version_inferences.name: inferences,
            self.version_last_inference.name: last_inference}
        stats: dict[tuple[str, int], VersionStatistics] = {}
        for family in self._families():
            read = readers.get(family.name)
            if read is None:
                continue
            for sample in family.samples:
                key = (sample.labels["model_name"], int(sample.labels["version"]))
                read(stats.setdefault(key, VersionStatistics()), sample)
        return stats

    def _families(self) -> Iterable[Any]:
        if self._directory:
            return MultiProcessCollector(None, path=self._directory).collect()
        return self.registry.collect()

    def render(self) -> str:
        """The Prometheus text exposition format (version 0.0.4), across all workers in multiprocess mode."""
        samples: dict[str, list[Sample]] = {}
        for family in self._families():
            samples.setdefault(family.name, []).extend(family.samples)
        lines: list[str] = []
        for metric in self._all:
            lines += metric.render(samples.get(metric.family, []))
        return "\n".join(lines) + "\n"
