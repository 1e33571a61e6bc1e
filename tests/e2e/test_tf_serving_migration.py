"""What a server moved from tensorflow_model_server meets, checked against TF Serving's source (tensorflow/serving at
9d981c5):

- a --batching_parameters_file with TF Serving's large-batch splitting (servables/tensorflow/
  session_bundle_config.proto, fields 8 and 9; servables/tensorflow/bundle_factory_util.h GetQueueOptions and
  batching/batching_session.cc for its rules) starts, and batches run at most max_execution_batch_size rows;
- a model listed twice in a config is refused in the words of model_servers/server_core.cc ValidateModelConfigList:
  at start (exit 2, one line), by the reload RPC (INVALID_ARGUMENT) and by the watch on --model_config_file (the
  running config kept, with a warning);
- a version that fails to load keeps TensorFlow's code, as TF Serving keeps the loader's status
  (core/loader_harness.cc ErrorInternal) for REST's status and GetModelStatus (model_servers/get_model_status_impl.cc);
- REST's answers for a status GET without a model name and a version past int64 (model_servers/
  http_rest_api_handler.cc, http_rest_api_util.cc ParseModelInfo).

The servers here are real DataPlanes in this process (no gunicorn, no sockets), called through Flask's test client
and the gRPC servicers."""
from __future__ import annotations

import logging
import os
import threading
import time

import grpc
import numpy as np
import pytest
import tensorflow as tf
from google.protobuf import text_format
from tensorflow.core.protobuf import error_codes_pb2
from tensorflow_serving.apis import get_model_status_pb2, model_management_pb2
from tensorflow_serving.config import model_server_config_pb2

from server_harness import check_watcher_keeps_running_config, copy_model, in_process_dataplane
from serving.core.batching import Batcher, BatchKey, BatchRequest
from serving.core.errors import Code, ServingError
from serving.core.repository import VersionState, VersionStatus
from serving.core.runtimes import load_error
from serving.metrics import Metrics
from serving.options.config import BatchingOptions
from serving.options.config_files import check_model_config, read_batching_parameters, read_model_config
from serving.options.protos import BatchingParameters
from serving.process.flags import parse_args
from serving.protocols.grpc_api.tfserving import ModelService
from serving.protocols.rest.app import create_app

SPLITTING = """
max_batch_size { value: 1024 }
batch_timeout_micros { value: 0 }
max_enqueued_batches { value: 100 }
num_batch_threads { value: 2 }
enable_large_batch_splitting { value: true }
max_execution_batch_size { value: 32 }
"""
# Every field of TF Serving's BatchingParameters (session_bundle_config.proto at tensorflow/serving 9d981c5).
EVERY_FIELD = """
max_batch_size { value: 64 }
batch_timeout_micros { value: 1000 }
max_enqueued_batches { value: 8 }
num_batch_threads { value: 4 }
thread_pool_name { value: "batch_threads" }
enable_large_batch_splitting { value: true }
max_execution_batch_size { value: 16 }
allowed_batch_sizes: 8
allowed_batch_sizes: 16
pad_variable_length_inputs: true
"""
DUPLICATE = """model_config_list {
  config { name: "dup" base_path: "/models/a" model_platform: "tensorflow" }
  config { name: "other" base_path: "/models/b" model_platform: "tensorflow" }
  config { name: "dup" base_path: "/models/c" model_platform: "tensorflow" }
}"""
DUPLICATE_MESSAGE = "Illegal to list model dup multiple times in config list"
FLOWERS_TWICE = "Illegal to list model flowers multiple times in config list"


def config(base: str, *names: str, policy: str = "") -> model_server_config_pb2.ModelServerConfig:
    entries = "".join(f'config {{ name: "{name}" base_path: "{base}" model_platform: "tensorflow" {policy} }} '
                      for name in names or ("flowers",))
    return text_format.Parse(f"model_config_list {{ {entries} }}", model_server_config_pb2.ModelServerConfig())


class Aborted(Exception):
    pass


class AbortingContext:
    """What a unary servicer asks of grpc's ServicerContext: abort when it fails, raising as grpc's does; and, for
    the reload's wait, the call's deadline (none) and whether it is still on (it is)."""

    def time_remaining(self) -> float | None:
        return None

    def is_active(self) -> bool:
        return True

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)


def batching_file(tmp_path, text: str) -> str:
    path = tmp_path / "batching.config"
    path.write_text(text)
    return str(path)


def splitting_warnings(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "serving.options.config_files" and "enable_large_batch_splitting" in
            r.getMessage()]


# --- enable_large_batch_splitting --------------------------------------------------------------------------------

def test_the_batching_file_of_tf_servings_large_batch_splitting_starts_with_batches_of_the_execution_size(
        tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="serving.options.config_files"):
        options = parse_args([f"--batching_parameters_file={batching_file(tmp_path, SPLITTING)}"])
    batching = options.dataplane.batching
    assert (batching.max_batch_size, batching.num_batch_threads, batching.max_enqueued_batches) == (32, 2, 100)
    [warning] = splitting_warnings(caplog)
    detail = warning.fields["detail"]  # type: ignore[attr-defined]
    assert "max_execution_batch_size (32)" in detail and "max_batch_size (1024)" in detail
    assert "not enforced" in detail


def test_every_field_of_tf_servings_batching_parameters_parses(tmp_path):
    options = read_batching_parameters(batching_file(tmp_path, EVERY_FIELD))
    assert options == BatchingOptions(max_batch_size=16, batch_timeout_micros=1000, max_enqueued_batches=8,
                                      num_batch_threads=4, allowed_batch_sizes=(8, 16),
                                      pad_variable_length_inputs=True)
    declared = {f.name: f.number for f in BatchingParameters.DESCRIPTOR.fields}
    assert declared == {"max_batch_size": 1, "batch_timeout_micros": 2, "max_enqueued_batches": 3,
                        "num_batch_threads": 4, "thread_pool_name": 5, "allowed_batch_sizes": 6,
                        "pad_variable_length_inputs": 7, "enable_large_batch_splitting": 8,
                        "max_execution_batch_size": 9}


def test_without_splitting_max_execution_batch_size_is_ignored_as_tf_serving_ignores_it(tmp_path, caplog):
    text = "max_batch_size { value: 48 }\nmax_execution_batch_size { value: 8 }\n" \
           "enable_large_batch_splitting { value: false }\n"
    with caplog.at_level(logging.WARNING, logger="serving.options.config_files"):
        assert read_batching_parameters(batching_file(tmp_path, text)).max_batch_size == 48
    assert not splitting_warnings(caplog)


def test_splitting_without_an_execution_size_runs_batches_of_max_batch_size(tmp_path):
    text = "max_batch_size { value: 24 }\nenable_large_batch_splitting { value: true }\n"
    assert read_batching_parameters(batching_file(tmp_path, text)).max_batch_size == 24


@pytest.mark.parametrize(("text", "message"), [
    ("max_batch_size { value: 16 }\nenable_large_batch_splitting { value: true }\n"
     "max_execution_batch_size { value: 32 }\n", "max_execution_batch_size must be positive and at most"),
    ("max_batch_size { value: 64 }\nenable_large_batch_splitting { value: true }\n"
     "max_execution_batch_size { value: 32 }\nallowed_batch_sizes: 16\nallowed_batch_sizes: 64\n",
     "Last entry in allowed_batch_sizes must be equal to max_execution_batch_size; last entry was 64; expected 32"),
], ids=["execution size above max_batch_size", "allowed sizes not ending at the execution size"])
def test_splitting_parameters_tf_serving_refuses_end_start_up_with_their_file(tmp_path, capsys, text, message):
    path = batching_file(tmp_path, text)
    with pytest.raises(SystemExit) as exit_info:
        parse_args([f"--batching_parameters_file={path}"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"{path}: " in err and message in err


def test_a_request_larger_than_the_execution_size_is_split_into_batches_of_at_most_that_size(tmp_path):
    batcher = Batcher(read_batching_parameters(batching_file(tmp_path, SPLITTING)), Metrics())
    sizes: list[int] = []
    lock = threading.Lock()

    def double(inputs):
        with lock:
            sizes.append(len(inputs["x"]))
        return {"y": inputs["x"] * 2}
    try:
        out = batcher.run(BatchRequest(BatchKey("m", 1, "s"), double, {"x": np.arange(100.0)}, 100,
                                       np.zeros(100, np.int64), deadline=time.monotonic() + 30))
    finally:
        batcher.close()
    assert out["y"].tolist() == [2.0 * i for i in range(100)]
    assert sorted(sizes) == [4, 32, 32, 32]


# --- a model listed twice ----------------------------------------------------------------------------------------

def test_a_model_listed_twice_is_refused_in_tf_servings_words():
    config = text_format.Parse(DUPLICATE, model_server_config_pb2.ModelServerConfig())
    with pytest.raises(ValueError, match=f"^{DUPLICATE_MESSAGE}$"):
        check_model_config(config)


def test_a_config_file_listing_a_model_twice_ends_start_up_in_one_line(tmp_path, capsys):
    path = tmp_path / "models.config"
    path.write_text(DUPLICATE)
    with pytest.raises(ValueError, match=f"{path}: {DUPLICATE_MESSAGE}"):
        read_model_config(str(path))
    with pytest.raises(SystemExit) as exit_info:
        parse_args([f"--model_config_file={path}"])
    assert exit_info.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if DUPLICATE_MESSAGE in line]
    assert len(lines) == 1 and str(path) in lines[0]


def test_a_relative_base_path_is_still_accepted(tmp_path, monkeypatch):
    """Petal resolves a relative base_path against the working directory where TF Serving refuses it
    (docs/serving.md, 'Differences from TF Serving')."""
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "models.config"
    path.write_text('model_config_list { config { name: "m" base_path: "models/m" model_platform: "tensorflow" } }')
    assert read_model_config(str(path)).model_config_list.config[0].base_path == "models/m"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """flowers: version 1 good, version 2 with a truncated variables.index (TF's DataLossError when restored)."""
    base = str(tmp_path_factory.mktemp("migration") / "flowers")
    copy_model(base, 1)
    index = os.path.join(copy_model(base, 2), "variables", "variables.index")
    with open(index, "rb") as f:
        head = f.read(10)
    with open(index, "wb") as f:
        f.write(head)
    return base


@pytest.fixture(scope="module")
def dataplane(models, tmp_path_factory):
    path = tmp_path_factory.mktemp("config") / "models.config"
    path.write_text(text_format.MessageToString(config(models, policy="model_version_policy { all {} }")))
    with in_process_dataplane(model_config_file=str(path)) as opened:
        yield opened


@pytest.fixture(scope="module")
def client(dataplane):
    return create_app(dataplane).test_client()


# --- a failed load's status ---------------------------------------------------------------------------------------

def test_a_corrupt_variables_index_is_data_loss_with_tensorflows_message(dataplane):
    status = {s.version: s for s in dataplane.status("flowers")}
    assert status[1] == VersionStatus(1, VersionState.AVAILABLE)
    assert (status[2].state, status[2].error_code) == (VersionState.END, "DATA_LOSS")
    assert status[2].error_message == "file is too short to be an sstable"


def test_rest_status_and_get_model_status_report_the_failed_loads_code(client, dataplane):
    response = client.get("/v1/models/flowers")
    assert response.status_code == 200
    body = {v["version"]: v for v in response.get_json()["model_version_status"]}
    assert body["2"] == {"version": "2", "state": "END", "status": {
        "error_code": "DATA_LOSS", "error_message": "file is too short to be an sstable"}}
    request = get_model_status_pb2.GetModelStatusRequest()
    request.model_spec.name = "flowers"
    request.model_spec.version.value = 2
    answer = ModelService(dataplane).GetModelStatus(request, AbortingContext())
    [version] = answer.model_version_status
    assert version.state == get_model_status_pb2.ModelVersionStatus.END
    assert version.status.error_code == error_codes_pb2.DATA_LOSS


@pytest.mark.parametrize(("error", "code", "message"), [
    (tf.errors.NotFoundError(None, None, "/m/2/saved_model.pb; No such file or directory"), "NOT_FOUND",
     "/m/2/saved_model.pb; No such file or directory"),
    (tf.errors.ResourceExhaustedError(None, None, "OOM when allocating tensor"), "RESOURCE_EXHAUSTED",
     "OOM when allocating tensor"),
    (ValueError("The passed save_path is not a valid checkpoint"), "UNKNOWN",
     "Failed to load: ValueError: The passed save_path is not a valid checkpoint"),
    (ServingError(Code.INVALID_ARGUMENT, "no meta graph with tags ['serve']"), "UNKNOWN",
     "Failed to load: no meta graph with tags ['serve']"),
], ids=["not found", "resource exhausted", "not TensorFlow's", "a ServingError of Petal's says only its message"])
def test_a_tensorflow_error_keeps_its_code_and_anything_else_is_unknown(error, code, message):
    """What the real loader raises for a load that failed, the status the repository reports as it is
    (tests/unit/test_version_transitions.py); the whole path, a corrupt variables.index to DATA_LOSS, is above."""
    failure = load_error(error)
    assert (failure.code.name, failure.message) == (code, message)


# --- REST paths ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["/v1/models", "/v1/models/", "/V1/Models", "/v1/models/versions/3",
                                  "/v1/models/labels/stable/metadata"])
def test_a_status_get_without_a_model_name_is_tf_servings_missing_model_name(client, path):
    response = client.get(path)
    assert (response.status_code, response.get_json()) == (400, {"error": "Missing model name in request."})


def test_a_post_without_a_model_name_is_still_malformed(client):
    response = client.post("/v1/models")
    assert (response.status_code, response.get_json()) == (400, {"error": "Malformed request: POST /v1/models"})


@pytest.mark.parametrize(("method", "path"), [
    ("POST", "/v1/models/flowers/versions/99999999999999999999:predict"),
    ("POST", "/v1/models/flowers/versions/9223372036854775808:classify"),
    ("GET", "/v1/models/flowers/versions/99999999999999999999"),
    ("GET", "/v1/models/flowers/versions/99999999999999999999/metadata"),
])
def test_a_version_past_int64_is_tf_servings_failed_conversion(client, method, path):
    response = client.open(path, method=method, json={"instances": [1]})
    version = path.split("/")[5].split(":")[0]
    assert (response.status_code, response.get_json()) == (
        400, {"error": f"Failed to convert version: {version} to numeric."})


def test_the_largest_int64_version_is_a_version_not_found(client):
    response = client.get("/v1/models/flowers/versions/9223372036854775807")
    assert response.status_code == 404
    assert response.get_json() == {"error": "Could not find version 9223372036854775807 of model flowers"}


# --- a model listed twice: the reload RPC and the watch on the file ---------------------------------------------

def test_the_reload_rpc_refuses_a_model_listed_twice_in_tf_servings_words(dataplane, models):
    request = model_management_pb2.ReloadConfigRequest(config=config(models, "flowers", "other", "flowers"))
    with pytest.raises(Aborted) as refused:
        ModelService(dataplane).HandleReloadConfigRequest(request, AbortingContext())
    assert refused.value.args == (grpc.StatusCode.INVALID_ARGUMENT, FLOWERS_TWICE)
    assert dataplane.model_names() == ["flowers"] and dataplane.ready(), "the running config is kept"


def test_the_watcher_keeps_the_running_config_when_the_file_lists_a_model_twice(tmp_path, caplog):
    base = str(tmp_path / "flowers")
    copy_model(base, 1)
    path = tmp_path / "models.config"
    path.write_text(text_format.MessageToString(config(base, "flowers", "flowers")))
    check_watcher_keeps_running_config(path, config(base), FLOWERS_TWICE, caplog, timeout_s=30)
