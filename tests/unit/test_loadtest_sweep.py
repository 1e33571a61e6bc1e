"""`petal loadtest`'s parts that need no server: flag parsing, the corpus, the sweep's knee and its plot, and the
table (the Locust runs against a real `petal serve` are tests/e2e/test_loadtest.py)."""
from __future__ import annotations

import argparse

import pytest
from PIL import Image

from load_tests import sweep
from load_tests.runner import format_table, make_corpus, parse_duration, parse_sizes
from load_tests.slo import TOTAL, Breach, EndpointStats

SMALL_SIZES = "64x48,320x240"


def level(users: int, rps: float, p95: float, breaches: tuple[str, ...] = ()) -> sweep.Level:
    return sweep.Level(users=users, rps=rps, p50_ms=p95 / 2, p95_ms=p95, p99_ms=p95 * 1.5, failure_ratio=0.0,
                       breaches=breaches)


@pytest.mark.parametrize("text, seconds", [("20", 20), ("20s", 20), ("1m30s", 90), ("2m", 120), ("1h", 3600)])
def test_durations_use_locusts_syntax(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "0s", "abc", "1x", "-5s"])
def test_bad_durations_are_rejected(text):
    with pytest.raises(argparse.ArgumentTypeError):
        parse_duration(text)


def test_image_sizes_and_sweep_levels_are_validated():
    assert parse_sizes("96x96, 2048x1536") == [(96, 96), (2048, 1536)]
    for bad in ("96", "8x8", "96x96,abc", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_sizes(bad)
    assert sweep.parse_levels("1,2,4,8") == [1, 2, 4, 8]
    for bad in ("4,2", "0,1", "1,1", "a", ""):
        with pytest.raises(ValueError, match="--sweep_users"):
            sweep.parse_levels(bad)


def test_corpus_has_every_class_at_every_size_and_is_reused(tmp_path):
    folder = make_corpus(tmp_path / "corpus", parse_sizes(SMALL_SIZES))
    files = sorted(folder.glob("*.jpg"))
    assert len(files) == 10
    assert {Image.open(f).size for f in files} == {(64, 48), (320, 240)}
    stamps = {f: f.stat().st_mtime_ns for f in files}
    make_corpus(folder, parse_sizes(SMALL_SIZES))
    assert {f: f.stat().st_mtime_ns for f in files} == stamps


def test_knee_is_the_highest_throughput_that_meets_the_slo():
    levels = [level(1, 10, 50), level(2, 18, 80), level(4, 25, 150), level(8, 24, 400, ("total p95 400 ms > 300",))]
    assert sweep.find_knee(levels).users == 4
    # Throughput can dip while p95 still holds; the knee is the best throughput, not the last passing level.
    assert sweep.find_knee([level(1, 10, 50), level(2, 18, 80), level(4, 17, 150)]).users == 2
    assert sweep.find_knee([level(1, 10, 500, ("p95",))]) is None


def test_sweep_plot_is_a_png(tmp_path):
    levels = [level(1, 10, 50), level(2, 18, 80), level(4, 25, 350, ("p95",))]
    path = tmp_path / "sweep.png"
    sweep.plot(levels, sweep.find_knee(levels), 300.0, path, "test")
    with Image.open(path) as image:
        assert image.format == "PNG" and image.size[0] > 400


def test_table_marks_breached_rows():
    stats = {"rest_predict": EndpointStats("rest_predict", 100, 0, 10.0, 40, 90, 120),
             "grpc_predict": EndpointStats("grpc_predict", 50, 5, 5.0, 30, 700, 900),
             TOTAL: EndpointStats(TOTAL, 150, 5, 15.0, 35, 650, 880)}
    table = format_table(stats, [Breach("grpc_predict", "p95_ms", "grpc_predict p95 700 ms > limit 500 ms")])
    rows = {line.split()[0]: line.split() for line in table.splitlines()[1:]}
    assert rows["rest_predict"][-1] == "ok" and rows["total"][-1] == "ok"
    assert rows["grpc_predict"] == ["grpc_predict", "50", "10.00", "5.00", "30", "700", "900", "BREACH"]
