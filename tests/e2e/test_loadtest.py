"""`petal loadtest`: flag parsing, the corpus, the knee and its plot, then real Locust runs against a real
`petal serve` on loopback (the smoke run, an impossible SLO that must fail, the sweep, and the ways a run
fails without a healthy server)."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from PIL import Image

from exported_models.model_format import DEFAULT_MODEL_BASE_PATH
from load_tests import sweep
from load_tests.runner import format_table, free_port, make_corpus, parse_duration, parse_sizes, running_server
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


def petal_loadtest(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run from outside the checkout: the locustfile and SLO file must come from the installed package."""
    return subprocess.run([sys.executable, "-m", "petal", "loadtest", *args], capture_output=True, text=True,
                          cwd=tempfile.gettempdir(), timeout=timeout)


def test_fewer_users_than_endpoints_is_a_usage_error(tmp_path):
    result = petal_loadtest("--users", "2", "--report_dir", str(tmp_path))
    assert result.returncode == 2
    assert "--users 2 is fewer than the 4 endpoints with traffic" in result.stderr


def test_missing_image_folder_is_a_usage_error(tmp_path):
    result = petal_loadtest("--images", str(tmp_path / "nope"), "--report_dir", str(tmp_path))
    assert result.returncode == 2
    assert "nope: not a folder" in result.stderr


def test_bad_slo_file_is_a_usage_error(tmp_path):
    slo = tmp_path / "slo.toml"
    slo.write_text("[endpoints.rest_predict]\np95 = 100\n")
    result = petal_loadtest("--slo", str(slo), "--report_dir", str(tmp_path))
    assert result.returncode == 2
    assert "unknown key(s) p95" in result.stderr


@pytest.fixture(scope="module")
def model_base() -> Path:
    """The shipped default model, which `petal loadtest --start-server` serves."""
    return Path(DEFAULT_MODEL_BASE_PATH)


@pytest.fixture(scope="module")
def server(model_base, tmp_path_factory):
    with running_server(model_base, "flowers", tmp_path_factory.mktemp("server") / "server.log", [], 180) as target:
        yield target


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return make_corpus(tmp_path_factory.mktemp("corpus"), parse_sizes(SMALL_SIZES))


def test_smoke_run_starts_the_server_and_meets_the_shipped_slo(model_base, tmp_path):
    report = tmp_path / "report"
    result = petal_loadtest("--start-server", "--model_base_path", str(model_base), "--users", "4",
                            "--run-time", "6s", "--report_dir", str(report))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "loadtest passed" in result.stdout
    summary = json.loads((report / "summary.json").read_text())
    assert summary["passed"] is True and summary["breaches"] == []
    assert all(summary["endpoints"][name]["requests"] > 0 and summary["endpoints"][name]["failures"] == 0
               for name in ("rest_predict", "rest_classify_image", "grpc_predict", "v2_infer"))
    assert summary["total"]["rps"] > 0 and summary["total"]["p95_ms"] > 0
    for name in ("report.html", "locust_stats.csv", "locust_failures.csv", "locust_stats.json"):
        assert (report / name).stat().st_size > 0, name
    table = result.stdout.splitlines()
    assert table[0].split()[:2] == ["endpoint", "requests"] and table[5].startswith("total")
    assert "corpus" in summary["images"] and len(list((report / "corpus").glob("*.jpg"))) == 20


def test_impossible_slo_fails_naming_each_breach(server, corpus, tmp_path):
    slo = tmp_path / "impossible.toml"
    slo.write_text("[endpoints.rest_classify_image]\np95_ms = 1\n[endpoints.v2_infer]\np95_ms = 1\n"
                   "[total]\nmin_rps = 1000000\n")
    result = petal_loadtest("--host", server.host, "--grpc-host", server.grpc_host, "--images", str(corpus),
                            "--slo", str(slo), "--users", "2", "--run-time", "3s", "--report_dir", str(tmp_path))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "loadtest FAILED: 3 SLO breach(es)" in result.stderr
    assert "rest_classify_image p95 " in result.stderr and "v2_infer p95 " in result.stderr
    assert "> limit 1 ms" in result.stderr
    assert "total throughput" in result.stderr and "< minimum 1e+06 req/s" in result.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["passed"] is False and len(summary["breaches"]) == 3
    assert summary["endpoints"]["v2_infer"]["failures"] == 0  # slow, not broken: only latency breached


def test_sweep_finds_the_knee_and_draws_it(server, corpus, tmp_path):
    result = petal_loadtest("--sweep", "--sweep_users", "1,2,4", "--run-time", "2s", "--weights", "rest_predict=1",
                            "--host", server.host, "--images", str(corpus), "--report_dir", str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((tmp_path / "sweep.png").with_name("summary.json").read_text())
    assert [lvl["users"] for lvl in summary["levels"]] == [1, 2, 4]
    best = max((lvl for lvl in summary["levels"] if lvl["meets_slo"]), key=lambda lvl: lvl["rps"])
    assert summary["knee"]["users"] == best["users"] and summary["knee"]["rps"] > 0
    assert f"knee: {summary['knee']['rps']:.2f} req/s at {best['users']} user(s)" in result.stdout
    with Image.open(tmp_path / "sweep.png") as image:
        assert image.format == "PNG"
    assert all((tmp_path / f"users_{n:03d}" / "report.html").exists() for n in (1, 2, 4))


def test_a_server_that_never_answers_fails(corpus, tmp_path):
    dead = f"127.0.0.1:{free_port()}"
    result = petal_loadtest("--host", f"http://{dead}", "--grpc-host", dead, "--images", str(corpus),
                            "--weights", "grpc_predict=1,v2_infer=1", "--users", "2", "--run-time", "2s",
                            "--report_dir", str(tmp_path))
    assert result.returncode == 1
    assert "every request failed" in result.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["passed"] is False
    grpc_stats = summary["endpoints"]["grpc_predict"]
    assert grpc_stats["requests"] > 0 and grpc_stats["failures"] == grpc_stats["requests"]
    failures = (tmp_path / "locust_failures.csv").read_text()
    assert "GrpcError('UNAVAILABLE: " in failures  # the status code and message, not grpc's repr
    assert "connection failed: ConnectionRefusedError" in failures


def test_a_server_that_does_not_start_fails(model_base, corpus, tmp_path):
    result = petal_loadtest("--start-server", "--model_base_path", str(model_base), "--server_flags=--no_such_flag",
                            "--images", str(corpus), "--run-time", "2s", "--report_dir",
                            str(tmp_path))
    assert result.returncode == 1
    assert "server did not start: `petal serve` exited with code" in result.stderr
    assert "--no_such_flag" in result.stderr  # the server's own complaint, from its log
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["passed"] is False and "server did not start" in summary["error"]
