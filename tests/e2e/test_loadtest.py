"""`petal loadtest`: real Locust runs against a real `petal serve` on loopback (the smoke run, an impossible SLO that
must fail, the sweep, and the ways a run fails without a healthy server), and its usage errors (flag parsing, the
corpus, the knee and its plot are tests/unit/test_loadtest_sweep.py)."""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from PIL import Image

from exported_models.model_format import DEFAULT_MODEL_BASE_PATH
from load_tests.launcher import free_port
from load_tests.runner import make_corpus, parse_sizes, running_server


def petal_loadtest(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run from outside the checkout: the locustfile and SLO file must come from the installed package."""
    return subprocess.run([sys.executable, "-m", "petal", "loadtest", *args], capture_output=True, text=True,
                          cwd=tempfile.gettempdir(), timeout=timeout)


def test_fewer_users_than_endpoints_is_a_usage_error(tmp_path):
    result = petal_loadtest("--users", "2", "--report_dir", str(tmp_path))
    assert result.returncode == 2
    assert "--users 2 is fewer than the 4 endpoints with traffic" in result.stderr


def test_a_host_without_its_scheme_is_a_usage_error(tmp_path):
    """Locust ran, every REST request failed, and the total row said its SLO was met."""
    result = petal_loadtest("--host", "127.0.0.1:8501", "--report_dir", str(tmp_path))
    assert result.returncode == 2
    assert "--host 127.0.0.1:8501: the REST base URL, with its scheme (http://127.0.0.1:8501)" in result.stderr


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
    return make_corpus(tmp_path_factory.mktemp("corpus"), parse_sizes("64x48,320x240"))


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
