"""perf_analyzer (Triton's load generator, which `make install` fetches: load_tests/perf_analyzer.py) drives a real
`petal serve` over KServe V2 HTTP, V2 gRPC and --service-kind=tfserving without an error, and over the V2 kinds reads
the server's queue and compute times from Petal's statistics extension. The float model is TF Serving's TF1
half_plus_two (exported_models/tf_serving_models.py), which --service-kind=tfserving feeds x of shape [1]
(`--shape x:1`) by tensor name. Short runs: a few dozen requests per kind."""
from __future__ import annotations

import math

import pytest

from exported_models.tf_serving_models import half_plus_two
from load_tests import perf_analyzer
from server_harness import jpeg, run_server, tiny_model_base

REQUESTS = 40


@pytest.fixture(scope="module")
def tool():
    try:
        found = perf_analyzer.find()
    except FileNotFoundError as error:  # `make install` fetches it; a bare `pip install` does not
        pytest.skip(str(error))
    if found.missing_libraries():
        pytest.skip(f"perf_analyzer needs {found.missing_libraries()}: apt-get install libb64-0d (.ci/run does)")
    return found


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("perf_analyzer")
    half_plus_two(str(root / perf_analyzer.FLOAT_MODEL / "00000123"))
    (root / "models").write_text(
        f'model_config_list {{ config {{ name: "{perf_analyzer.IMAGE_MODEL}" base_path: "{tiny_model_base()}" '
        f'model_platform: "tensorflow" }} config {{ name: "{perf_analyzer.FLOAT_MODEL}" base_path: '
        f'"{root / perf_analyzer.FLOAT_MODEL}" model_platform: "tensorflow" }} }}')
    models = {perf_analyzer.IMAGE_MODEL: perf_analyzer.image_data([jpeg(seed=s) for s in range(3)], str(root)),
              perf_analyzer.FLOAT_MODEL: None}
    with run_server(f"--model_config_file={root / 'models'}") as server:
        yield server, models


@pytest.mark.parametrize("kind, model", perf_analyzer.runs([perf_analyzer.IMAGE_MODEL, perf_analyzer.FLOAT_MODEL]))
def test_perf_analyzer_runs_against_petal(tool, served, kind, model):
    server, models = served
    result = perf_analyzer.measure(tool, perf_analyzer.arguments(kind, model, server.rest_port, server.grpc_port, 2,
                                                                 REQUESTS, models[model]), timeout=120)
    assert result["rps"] > 0 and 0 < result["p50"] <= result["p99"]
    if kind == "tfserving":  # TF Serving's API has no statistics to read
        assert math.isnan(result["compute"])
    else:
        assert result["compute"] > 0 and result["queue"] >= 0
