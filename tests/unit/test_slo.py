"""SLO file parsing and breach detection, on canned Locust stats in the exact shape of Locust's --json-file."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from load_tests.runner import DEFAULT_SLO
from load_tests.slo import (
    ENDPOINTS,
    TOTAL,
    SLOError,
    check,
    load_slo,
    parse_slo,
    parse_weights,
    percentile,
    read_locust_stats,
)

RUN_START = 1_700_000_000.0

SLO_TEXT = """
[defaults]
max_failure_ratio = 0.01

[endpoints.rest_predict]
weight = 3
p50_ms = 100
p95_ms = 500
p99_ms = 900

[endpoints.grpc_predict]
p95_ms = 300
max_failure_ratio = 0.5
min_rps = 2

[total]
p95_ms = 600
min_rps = 5
"""


def locust_entry(name: str, latencies_ms: list[float], failures: int = 0, seconds: float = 10.0,
                 method: str = "POST") -> dict:
    """One entry as Locust's save_stats_json writes it: latencies rounded into a {ms: count} histogram."""
    histogram: dict[str, int] = {}
    for latency in latencies_ms:
        key = str(int(round(latency)))
        histogram[key] = histogram.get(key, 0) + 1
    return {"name": name, "method": method, "last_request_timestamp": RUN_START + seconds, "start_time": RUN_START,
            "num_requests": len(latencies_ms), "num_none_requests": 0, "num_failures": failures,
            "total_response_time": sum(latencies_ms), "max_response_time": max(latencies_ms, default=0),
            "min_response_time": min(latencies_ms, default=None), "total_content_length": 0,
            "response_times": histogram, "num_reqs_per_sec": {}, "num_fail_per_sec": {}}


def write_stats(tmp_path: Path, *entries: dict) -> Path:
    path = tmp_path / "locust_stats.json"
    path.write_text(json.dumps(list(entries), indent=4))
    return path


def ramp(low: int, high: int) -> list[float]:
    return [float(v) for v in range(low, high + 1)]


def test_shipped_slo_file_parses_and_covers_every_endpoint():
    slo = load_slo(DEFAULT_SLO)
    assert set(slo.endpoints) == set(ENDPOINTS)
    assert all(weight > 0 for weight in slo.weights.values())
    assert all(limits.p95_ms is not None for limits in slo.endpoints.values())
    assert slo.total.max_failure_ratio is not None  # a total of mostly failures is not a met SLO


def test_defaults_are_inherited_and_overridable():
    slo = parse_slo(SLO_TEXT)
    assert slo.weights == {"rest_predict": 3, "grpc_predict": 1}
    assert slo.endpoints["rest_predict"].max_failure_ratio == 0.01
    assert slo.endpoints["grpc_predict"].max_failure_ratio == 0.5
    assert slo.endpoints["rest_predict"].min_rps is None
    assert (slo.total.p95_ms, slo.total.min_rps) == (600, 5)


@pytest.mark.parametrize("text, message", [
    ("[endpoints.rest_predcit]\np95_ms = 1", "unknown endpoint"),
    ("[endpoints.rest_predict]\np59_ms = 1", "unknown key(s) p59_ms"),
    ("[endpoints.rest_predict]\np95_ms = -1", "must be a non-negative number"),
    ("[endpoints.rest_predict]\np95_ms = 'fast'", "must be a non-negative number"),
    ("[endpoints.rest_predict]\nmax_failure_ratio = 2", "between 0 and 1"),
    ("[endpoints.rest_predict]\nweight = 0", "weight 0"),
    ("[endpoints.rest_predict]\nweight = 1.5", "non-negative integer"),
    ("[defaults]\nweight = 2\n[endpoints.rest_predict]", "unknown key(s) weight"),
    ("[totals]\np95_ms = 1\n[endpoints.rest_predict]", "unknown table(s) totals"),
    ("[total]\np95_ms = 1", "needs at least one [endpoints.NAME]"),
    ("[endpoints.rest_predict\n", "not valid TOML"),
    ("total = 5\n[endpoints.rest_predict]", "[total] must be a table"),
    ("[endpoints]\nrest_predict = 5", "[endpoints.rest_predict] must be a table"),
])
def test_bad_slo_files_are_rejected_with_the_reason(text, message):
    with pytest.raises(SLOError, match="slo.toml") as error:
        parse_slo(text, "slo.toml")
    assert message in str(error.value)


def test_missing_slo_file_is_a_clear_error(tmp_path):
    with pytest.raises(SLOError, match="cannot read SLO file"):
        load_slo(tmp_path / "nope.toml")


def test_weights_from_the_command_line():
    assert parse_weights("rest_predict=3, grpc_predict=0,v2_infer=1") == {
        "rest_predict": 3, "grpc_predict": 0, "v2_infer": 1}
    for bad in ("rest=1", "rest_predict=x", "rest_predict", "rest_predict=0"):
        with pytest.raises(SLOError):
            parse_weights(bad)


def test_percentile_is_nearest_rank_over_the_histogram():
    histogram = {int(v): 1 for v in ramp(1, 100)}
    assert [percentile(histogram, p) for p in (0.5, 0.95, 0.99, 1.0)] == [50, 95, 99, 100]
    assert percentile({7: 3}, 0.99) == 7
    assert percentile({}, 0.5) is None


def test_reading_locust_stats_merges_endpoints_into_the_total(tmp_path):
    path = write_stats(tmp_path, locust_entry("rest_predict", ramp(1, 100), failures=2, seconds=10),
                       locust_entry("grpc_predict", ramp(101, 200), seconds=8))
    stats = read_locust_stats(path)
    rest, total = stats["rest_predict"], stats[TOTAL]
    assert (rest.requests, rest.failures, rest.p50_ms, rest.p95_ms, rest.p99_ms) == (100, 2, 50, 95, 99)
    assert rest.failure_ratio == pytest.approx(0.02)
    assert rest.rps == pytest.approx(10.0)  # every endpoint over the whole run, as Locust's Requests/s
    assert (total.requests, total.failures, total.p50_ms, total.p95_ms) == (200, 2, 100, 190)
    assert total.rps == pytest.approx(20.0)


def test_reading_something_else_is_a_clear_error(tmp_path):
    path = tmp_path / "stats.json"
    path.write_text('{"not": "locust"}')
    with pytest.raises(ValueError, match="not Locust's --json-file stats"):
        read_locust_stats(path)


def test_healthy_run_meets_the_slo(tmp_path):
    slo = parse_slo(SLO_TEXT)
    stats = read_locust_stats(write_stats(tmp_path, locust_entry("rest_predict", ramp(40, 140)),
                                          locust_entry("grpc_predict", ramp(20, 120), failures=1)))
    assert check(slo, stats, slo.weights) == []


def test_each_breached_limit_is_named_with_its_numbers(tmp_path):
    slo = parse_slo(SLO_TEXT)
    stats = read_locust_stats(write_stats(
        tmp_path,
        locust_entry("rest_predict", ramp(1, 80) + [800.0] * 20, failures=5),  # p95 800, p99 800, 5% failed
        locust_entry("grpc_predict", ramp(1, 10), failures=6, seconds=10)))  # 1 req/s, 60% failed
    messages = [str(b) for b in check(slo, stats, slo.weights)]
    assert messages == [
        "rest_predict p95 800 ms > limit 500 ms",
        "rest_predict failure ratio 0.050 (5/100) > limit 0.01",
        "grpc_predict failure ratio 0.600 (6/10) > limit 0.5",
        "grpc_predict throughput 1.00 req/s < minimum 2 req/s",
        "total p95 800 ms > limit 600 ms",
    ]


def test_sweep_metrics_ignore_throughput_minimums(tmp_path):
    slo = parse_slo(SLO_TEXT)
    stats = read_locust_stats(write_stats(tmp_path, locust_entry("rest_predict", ramp(1, 10)),
                                          locust_entry("grpc_predict", ramp(1, 10))))
    assert {b.metric for b in check(slo, stats, slo.weights)} == {"min_rps"}
    assert check(slo, stats, slo.weights, ("p95_ms", "max_failure_ratio")) == []


def test_an_endpoint_with_weight_but_no_traffic_is_a_breach(tmp_path):
    slo = parse_slo(SLO_TEXT)
    stats = read_locust_stats(write_stats(tmp_path, locust_entry("rest_predict", ramp(1, 100))))
    messages = [str(b) for b in check(slo, stats, slo.weights)]
    assert "grpc_predict got no requests (weight 1)" in messages
    assert check(slo, stats, {"rest_predict": 1, "grpc_predict": 0}, ("p95_ms",)) == []


def test_a_server_that_failed_every_request_never_passes(tmp_path):
    no_limits = parse_slo("[endpoints.rest_predict]")
    stats = read_locust_stats(write_stats(tmp_path, locust_entry("rest_predict", [1.0] * 50, failures=50)))
    assert [str(b) for b in check(no_limits, stats, no_limits.weights)] == ["every request failed (50/50)"]


def test_a_server_that_never_answered_never_passes(tmp_path):
    no_limits = parse_slo("[endpoints.rest_predict]")
    stats = read_locust_stats(write_stats(tmp_path))
    assert [str(b) for b in check(no_limits, stats, no_limits.weights)] == [
        "no requests completed: the server never answered"]
