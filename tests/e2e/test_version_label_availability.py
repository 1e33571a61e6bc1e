"""Version labels name only AVAILABLE versions, as TF Serving's do (model_servers/server_core.cc:
ServerCore::ReloadConfig -> UpdateModelVersionLabelMap, before it adds any model): a reload RPC whose config labels
a version that is not AVAILABLE fails FAILED_PRECONDITION in TF Serving's words and changes nothing; a
--model_config_file that labels a version at start, when none is AVAILABLE, stops `petal serve`; with
--allow_version_labels_for_unavailable_models=true a new label may name such a version, an existing one still not.
Real `petal serve` processes, called through TF Serving's stock stubs and REST.
"""
from __future__ import annotations

import shutil
import subprocess
import sys

import grpc
import numpy as np
import pytest
import requests
from google.protobuf import text_format
from tensorflow_serving.apis import model_management_pb2, model_service_pb2_grpc, prediction_service_pb2_grpc
from tensorflow_serving.config import model_server_config_pb2

from exported_models import tf_serving_models
from grpc_calls import predict_request, rpc_error
from server_harness import ROOT, free_ports, run_server

ALLOW = "--allow_version_labels_for_unavailable_models=true"


def not_available(version: int) -> str:
    """ServerCore::UpdateModelVersionLabelMap's FAILED_PRECONDITION for model `m`."""
    return (f"Request to assign label to version {version} of model m, which is not currently available for "
            "inference")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """`m`: TF Serving's half_plus_two as version 1, and no version 2."""
    root = tmp_path_factory.mktemp("labels")
    tf_serving_models.half_plus_two(str(root / "spare"))
    shutil.copytree(root / "spare", root / "m" / "1")
    return root


def config(root, labels: dict[str, int]) -> model_server_config_pb2.ModelServerConfig:
    config = model_server_config_pb2.ModelServerConfig()
    model = config.model_config_list.config.add(name="m", base_path=str(root / "m"), model_platform="tensorflow")
    model.version_labels.update(labels)
    return config


def config_file(root, name: str, labels: dict[str, int]) -> str:
    path = root / name
    path.write_text(text_format.MessageToString(config(root, labels)))
    return str(path)


def reload(server, root, labels: dict[str, int]) -> None:
    """Reload `m` with these labels through TF Serving's ModelService stub, as a client would."""
    with grpc.insecure_channel(server.grpc_target) as channel:
        model_service_pb2_grpc.ModelServiceStub(channel).HandleReloadConfigRequest(
            model_management_pb2.ReloadConfigRequest(config=config(root, labels)), timeout=60)


def by_label(server, label: str) -> tuple[list[float], list[float]]:
    """half_plus_two of 2.0 by `label`, over gRPC (model_spec.version_label) and REST (/labels/LABEL)."""
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
        grpc_y = list(stub.Predict(predict_request("m", version_label=label, x=np.array([2.0], np.float32)),
                                   timeout=30).outputs["y"].float_val)
    response = requests.post(f"{server.rest_url}/v1/models/m/labels/{label}:predict", json={"instances": [2.0]},
                             timeout=30)
    assert response.status_code == 200, response.text
    return grpc_y, response.json()["predictions"]


@pytest.fixture(scope="module")
def server(root):
    with run_server(f"--model_config_file={config_file(root, 'plain.config', {})}", "--enable_model_control",
                    "--file_system_poll_wait_seconds=0.2") as srv:
        yield srv


@pytest.fixture(scope="module")
def allowing_server(root):
    with run_server(f"--model_config_file={config_file(root, 'labelled.config', {'stable': 1})}", ALLOW,
                    "--enable_model_control", "--file_system_poll_wait_seconds=0.2") as srv:
        yield srv


def test_a_reload_labelling_a_version_not_available_fails_and_the_old_label_still_answers(server, root):
    reload(server, root, {"stable": 1})  # version 1 is AVAILABLE
    assert by_label(server, "stable") == ([3.0], [3.0])
    err = rpc_error(reload, server, root, {"stable": 1, "canary": 2})
    assert (err.code(), err.details()) == (grpc.StatusCode.FAILED_PRECONDITION, not_available(2))
    err = rpc_error(reload, server, root, {"stable": 2})
    assert (err.code(), err.details()) == (grpc.StatusCode.FAILED_PRECONDITION, not_available(2))
    assert by_label(server, "stable") == ([3.0], [3.0])
    status = requests.get(f"{server.rest_url}/v1/models/m/labels/stable", timeout=10).json()
    assert [entry["version"] for entry in status["model_version_status"]] == ["1"]
    assert requests.get(f"{server.rest_url}/v1/models/m/labels/canary", timeout=10).status_code == 400


def test_a_config_file_labelling_a_version_at_start_stops_petal_serve(root):
    """No version is AVAILABLE before the first load: TF Serving's server does not start, nor does Petal's."""
    path = config_file(root, "start.config", {"stable": 1})
    grpc_port, rest_port = free_ports(2)
    done = subprocess.run([sys.executable, "-m", "petal", "serve", f"--model_config_file={path}",
                           f"--port={grpc_port}", f"--rest_api_port={rest_port}"],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 2, done.stderr[-3000:]
    assert f"{path}: {not_available(1)}" in done.stderr, done.stderr[-3000:]


def test_with_the_allow_flag_a_new_label_may_name_a_version_not_available_but_no_label_moves_to_one(
        allowing_server, root):
    assert by_label(allowing_server, "stable") == ([3.0], [3.0])  # labelled at start, before version 1 loaded
    reload(allowing_server, root, {"stable": 1, "canary": 2})
    response = requests.get(f"{allowing_server.rest_url}/petal/models", timeout=10).json()
    assert response == {"models": [{"name": "m", "version_labels": {"canary": 2, "stable": 1}}]}
    err = rpc_error(reload, allowing_server, root, {"stable": 2, "canary": 2})
    assert (err.code(), err.details()) == (grpc.StatusCode.FAILED_PRECONDITION, not_available(2))
    assert by_label(allowing_server, "stable") == ([3.0], [3.0])
