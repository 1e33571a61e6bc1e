"""Latency SLOs for load tests: the SLO file, Locust's final stats, and the check that compares them.

Kept free of Locust imports on purpose: importing Locust monkey-patches the whole process with gevent, so
only the Locust subprocess may do it. Everything here works on the files Locust leaves behind, which is also
what makes the check testable on canned stats.
"""
from __future__ import annotations

import json
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

# Locust request names, one per user in load_tests/locustfile.py; the SLO file's [endpoints.*] tables use them.
ENDPOINTS = ("rest_predict", "rest_classify_image", "grpc_predict", "v2_infer")
TOTAL = "Aggregated"  # Locust's name for all requests together
LIMIT_KEYS = ("p50_ms", "p95_ms", "p99_ms", "max_failure_ratio", "min_rps")
ENDPOINT_KEYS = ("weight", *LIMIT_KEYS)


class SLOError(ValueError):
    """An SLO file that cannot be used; the message names the file and the offending key."""


@dataclass(frozen=True)
class Limits:
    """Limits for one endpoint (or all of them); None means unchecked."""

    p50_ms: float | None = None
    p95_ms: float | None = None
    p99_ms: float | None = None
    max_failure_ratio: float | None = None
    min_rps: float | None = None


@dataclass(frozen=True)
class SLO:
    """A parsed SLO file: per-endpoint traffic weights and limits, plus limits on all traffic together."""

    weights: dict[str, int]
    endpoints: dict[str, Limits]
    total: Limits = field(default_factory=Limits)


@dataclass(frozen=True)
class EndpointStats:
    """One endpoint's (or all traffic's) numbers from a Locust run; latencies in ms, None when nothing completed."""

    name: str
    requests: int
    failures: int
    rps: float
    p50_ms: float | None
    p95_ms: float | None
    p99_ms: float | None

    @property
    def failure_ratio(self) -> float:
        return self.failures / self.requests if self.requests else 0.0


@dataclass(frozen=True)
class Breach:
    """One limit that did not hold, worded so an operator can act on the message alone."""

    endpoint: str
    metric: str
    message: str

    def __str__(self) -> str:
        return self.message


def _number(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise SLOError(f"{where} must be a non-negative number, got {value!r}")
    return float(value)


def _limits(table: object, where: str, allowed: tuple[str, ...]) -> Limits:
    if not isinstance(table, dict):
        raise SLOError(f"{where} must be a table")
    unknown = sorted(set(table) - set(allowed))
    if unknown:
        raise SLOError(f"{where}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(allowed)}")
    values = {key: _number(table[key], f"{where}.{key}") for key in LIMIT_KEYS if key in table}
    if values.get("max_failure_ratio", 0.0) > 1.0:
        raise SLOError(f"{where}.max_failure_ratio must be between 0 and 1, got {values['max_failure_ratio']}")
    return Limits(**values)


def parse_slo(text: str, source: str = "<slo>") -> SLO:
    """Parse SLO TOML (see load_tests/slo.toml). Unknown endpoints and keys are errors, not silently ignored,
    because a misspelt limit that is never checked is worse than no SLO file at all."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SLOError(f"{source}: not valid TOML: {exc}") from exc
    unknown = sorted(set(doc) - {"defaults", "endpoints", "total"})
    if unknown:
        raise SLOError(f"{source}: unknown table(s) {', '.join(unknown)}; allowed: defaults, endpoints, total")
    defaults = doc.get("defaults", {})
    _limits(defaults, f"{source}: [defaults]", LIMIT_KEYS)
    tables = doc.get("endpoints", {})
    if not isinstance(tables, dict) or not tables:
        raise SLOError(f"{source}: needs at least one [endpoints.NAME] table; names: {', '.join(ENDPOINTS)}")
    weights: dict[str, int] = {}
    endpoints: dict[str, Limits] = {}
    for name, table in tables.items():
        where = f"{source}: [endpoints.{name}]"
        if name not in ENDPOINTS:
            raise SLOError(f"{where}: unknown endpoint; known: {', '.join(ENDPOINTS)}")
        endpoints[name] = _limits({**defaults, **table} if isinstance(table, dict) else table, where, ENDPOINT_KEYS)
        weight = table.get("weight", 1)
        if isinstance(weight, bool) or not isinstance(weight, int) or weight < 0:
            raise SLOError(f"{where}.weight must be a non-negative integer, got {weight!r}")
        weights[name] = weight
    if not any(weights.values()):
        raise SLOError(f"{source}: every endpoint has weight 0, so there would be no traffic")
    return SLO(weights=weights, endpoints=endpoints, total=_limits(doc.get("total", {}), f"{source}: [total]",
                                                                   LIMIT_KEYS))


def load_slo(path: str | Path) -> SLO:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise SLOError(f"cannot read SLO file {path}: {exc.strerror}") from exc
    return parse_slo(text, str(path))


def parse_weights(spec: str) -> dict[str, int]:
    """`rest_predict=3,grpc_predict=1` to a dict; the command line's override of the SLO file's weights."""
    weights: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, sep, value = item.partition("=")
        if not sep or name.strip() not in ENDPOINTS or not value.strip().isdigit():
            raise SLOError(f"bad weight {item!r}: expected NAME=INTEGER with NAME one of {', '.join(ENDPOINTS)}")
        weights[name.strip()] = int(value)
    if not any(weights.values()):
        raise SLOError(f"weights {spec!r} give no endpoint a weight above 0")
    return weights


def percentile(histogram: dict[int, int], fraction: float) -> float | None:
    """Nearest-rank percentile of Locust's {rounded ms: count} histogram; None when it is empty."""
    total = sum(histogram.values())
    if not total:
        return None
    rank, seen = max(1, math.ceil(fraction * total)), 0
    for latency in sorted(histogram):
        seen += histogram[latency]
        if seen >= rank:
            return float(latency)
    raise AssertionError("unreachable: the ranks add up to the total")


def _summarise(name: str, entries: list[dict], seconds: float) -> EndpointStats:
    histogram: dict[int, int] = {}
    for entry in entries:
        for latency, count in entry["response_times"].items():
            histogram[int(float(latency))] = histogram.get(int(float(latency)), 0) + int(count)
    requests = sum(int(entry["num_requests"]) for entry in entries)
    return EndpointStats(name=name, requests=requests, failures=sum(int(e["num_failures"]) for e in entries),
                         rps=requests / seconds if seconds > 0 else 0.0, p50_ms=percentile(histogram, 0.50),
                         p95_ms=percentile(histogram, 0.95), p99_ms=percentile(histogram, 0.99))


def read_locust_stats(path: str | Path) -> dict[str, EndpointStats]:
    """Locust's `--json-file` stats keyed by request name, plus all requests under TOTAL.

    The JSON, not the CSV, because Locust writes it once at shutdown with every request counted, while the
    stats CSV is rewritten only every second and misses the run's last second (a third of a 3 s sweep step).
    Throughput divides by the whole run (first request start to last request), as Locust's own Requests/s does.
    """
    try:
        entries = json.loads(Path(path).read_text())
        by_name: dict[str, list[dict]] = {}
        for entry in entries:
            by_name.setdefault(str(entry["name"]), []).append(entry)
        started = min((float(e["start_time"]) for e in entries), default=0.0)
        ended = max((float(e["last_request_timestamp"] or 0.0) for e in entries), default=0.0)
        stats = {name: _summarise(name, group, ended - started) for name, group in by_name.items()}
        stats[TOTAL] = _summarise(TOTAL, entries, ended - started)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{path} is not Locust's --json-file stats: {exc!r}") from exc
    return stats


def _check_limits(name: str, limits: Limits, stats: EndpointStats, metrics: tuple[str, ...]) -> list[Breach]:
    breaches = []
    for metric in ("p50_ms", "p95_ms", "p99_ms"):
        limit, actual = getattr(limits, metric), getattr(stats, metric)
        if metric in metrics and limit is not None and actual is not None and actual > limit:
            breaches.append(Breach(name, metric, f"{name} {metric[:3]} {actual:g} ms > limit {limit:g} ms"))
    if "max_failure_ratio" in metrics and limits.max_failure_ratio is not None \
            and stats.failure_ratio > limits.max_failure_ratio:
        breaches.append(Breach(name, "max_failure_ratio",
                               f"{name} failure ratio {stats.failure_ratio:.3f} ({stats.failures}/{stats.requests})"
                               f" > limit {limits.max_failure_ratio:g}"))
    if "min_rps" in metrics and limits.min_rps is not None and stats.rps < limits.min_rps:
        breaches.append(Breach(name, "min_rps", f"{name} throughput {stats.rps:.2f} req/s < minimum"
                                                f" {limits.min_rps:g} req/s"))
    return breaches


def check(slo: SLO, stats: dict[str, EndpointStats], weights: dict[str, int],
          metrics: tuple[str, ...] = LIMIT_KEYS) -> list[Breach]:
    """Every breached limit of the endpoints that got traffic (weight > 0), then of all traffic together.

    No requests at all, or every request failing, is always a breach whatever the limits say: a server that
    never answered must not pass a load test because its failures were fast. `metrics` narrows the check
    (the sweep ignores min_rps, since throughput is what it measures).
    """
    breaches: list[Breach] = []
    total = stats.get(TOTAL)
    if total is None or total.requests == 0:
        return [Breach(TOTAL, "requests", "no requests completed: the server never answered")]
    if total.failures == total.requests:
        breaches.append(Breach(TOTAL, "failures", f"every request failed ({total.failures}/{total.requests})"))
    for name, weight in weights.items():
        if weight <= 0:
            continue
        endpoint = stats.get(name)
        if endpoint is None or endpoint.requests == 0:
            breaches.append(Breach(name, "requests", f"{name} got no requests (weight {weight})"))
            continue
        if name in slo.endpoints:
            breaches += _check_limits(name, slo.endpoints[name], endpoint, metrics)
    return breaches + _check_limits("total", slo.total, total, metrics)
