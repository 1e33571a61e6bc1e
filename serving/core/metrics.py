"""Prometheus metrics with TF Serving's names, plus what a Petal operator also needs.

A small in-process registry rather than a dependency: every metric is per worker process (each worker is a
complete server), the hot path only takes one uncontended lock per update, and the text format is simple.
TF Serving's names have `/` turned into `:` exactly as its own Prometheus exporter does.
"""
from __future__ import annotations

import bisect
import math
import threading
from dataclasses import dataclass, field

# TF Serving's request/runtime latency buckets are exponential in microseconds.
LATENCY_BUCKETS_US = tuple(10.0 * 1.8 ** i for i in range(33))
BATCH_SIZE_BUCKETS = tuple(float(2 ** i) for i in range(13))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(names: tuple[str, ...], values: tuple[str, ...], extra: str = "") -> str:
    parts = [f'{n}="{_escape(str(v))}"' for n, v in zip(names, values)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


@dataclass
class _Metric:
    name: str
    help: str
    labelnames: tuple[str, ...]
    kind: str = "counter"
    _values: dict[tuple[str, ...], float] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _key(self, labels: dict[str, str]) -> tuple[str, ...]:
        return tuple(str(labels.get(n, "")) for n in self.labelnames)

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]
        with self._lock:
            items = sorted(self._values.items())
        lines += [f"{self.name}{_labels(self.labelnames, k)} {_number(v)}" for k, v in items]
        return lines


class Counter(_Metric):
    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, **labels: str) -> float:
        with self._lock:
            return self._values.get(self._key(labels), 0.0)


class Gauge(_Metric):
    def __init__(self, name: str, help: str, labelnames: tuple[str, ...]):
        super().__init__(name, help, labelnames, kind="gauge")

    def set(self, value: float, **labels: str) -> None:
        with self._lock:
            self._values[self._key(labels)] = value

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def remove(self, **labels: str) -> None:
        with self._lock:
            self._values.pop(self._key(labels), None)

    def value(self, **labels: str) -> float:
        with self._lock:
            return self._values.get(self._key(labels), 0.0)


class Histogram(_Metric):
    def __init__(self, name: str, help: str, labelnames: tuple[str, ...], buckets: tuple[float, ...]):
        super().__init__(name, help, labelnames, kind="histogram")
        self.buckets = buckets
        self._series: dict[tuple[str, ...], list[float]] = {}

    def observe(self, value: float, **labels: str) -> None:
        key = self._key(labels)
        index = bisect.bisect_left(self.buckets, value)
        with self._lock:
            series = self._series.get(key)
            if series is None:
                # per-bucket counts, then +Inf count, sum
                series = self._series[key] = [0.0] * (len(self.buckets) + 2)
            series[index] += 1
            series[-1] += value

    def count(self, **labels: str) -> int:
        with self._lock:
            series = self._series.get(self._key(labels))
            return int(sum(series[:-1])) if series else 0

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        with self._lock:
            items = sorted((k, list(v)) for k, v in self._series.items())
        for key, series in items:
            cumulative = 0.0
            for bound, n in zip(self.buckets + (math.inf,), series[:-1]):
                cumulative += n
                le = 'le="' + _number(bound) + '"'
                lines.append(f"{self.name}_bucket{_labels(self.labelnames, key, le)} {_number(cumulative)}")
            lines.append(f"{self.name}_sum{_labels(self.labelnames, key)} {_number(series[-1])}")
            lines.append(f"{self.name}_count{_labels(self.labelnames, key)} {_number(cumulative)}")
        return lines


class Metrics:
    """Every metric a worker exports; protocols and the batcher update them, `/monitoring/...` renders them."""

    def __init__(self) -> None:
        tfs = ":tensorflow:serving:"
        self.request_count = Counter(tfs + "request_count", "The total number of requests.",
                                     ("model_name", "status"))
        self.request_latency = Histogram(tfs + "request_latency", "Distribution of wall time (in microseconds) "
                                         "for Tensorflow Serving request.", ("model_name", "API", "entrypoint"),
                                         LATENCY_BUCKETS_US)
        self.runtime_latency = Histogram(tfs + "runtime_latency", "Distribution of wall time (in microseconds) "
                                         "for Tensorflow Serving runtime.", ("model_name", "API", "runtime"),
                                         LATENCY_BUCKETS_US)
        self.queuing_latency = Histogram(tfs + "batching_session:queuing_latency", "Distribution of wall time "
                                         "spent (in microseconds) in queuing", ("model_name",), LATENCY_BUCKETS_US)
        self.processed_batch_size = Histogram(tfs + "batching_session:processed_batch_size", "Tracks the batch "
                                              "size distribution on processing.", ("model_name",),
                                              BATCH_SIZE_BUCKETS)
        self.padding_size = Histogram(tfs + "batching_session:padding_size", "Tracks the padding size "
                                      "distribution on batches.", ("model_name", "execution_batch_size"),
                                      BATCH_SIZE_BUCKETS)
        self.queue_depth = Gauge(":petal:serving:batch_queue_depth", "Rows waiting in the batch queue.",
                                 ("model_name",))
        self.rejected = Counter(":petal:serving:rejected_requests", "Requests rejected before running, by "
                                "reason.", ("model_name", "reason"))
        self.load_latency = Histogram(":petal:serving:model_load_latency", "Wall time (in microseconds) to load "
                                      "and warm up a model version.", ("model_name",), LATENCY_BUCKETS_US)
        self.loaded_versions = Gauge(":petal:serving:loaded_versions", "1 for each AVAILABLE model version.",
                                     ("model_name", "version"))
        self.warmup_requests = Counter(":petal:serving:warmup_requests", "Warmup records replayed.",
                                       ("model_name", "version"))
        self._all = [self.request_count, self.request_latency, self.runtime_latency, self.queuing_latency,
                     self.processed_batch_size, self.padding_size, self.queue_depth, self.rejected,
                     self.load_latency, self.loaded_versions, self.warmup_requests]

    def render(self) -> str:
        """The Prometheus text exposition format (version 0.0.4)."""
        lines: list[str] = []
        for metric in self._all:
            lines += metric.render()
        return "\n".join(lines) + "\n"
