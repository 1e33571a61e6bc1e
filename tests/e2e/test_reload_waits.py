"""The reload RPC answers once the models new to its config can serve, as TF Serving's does
(model_servers/server_core.cc: ReloadConfig -> AddModelsViaModelConfigList -> WaitUntilModelsAvailable), so that a
client that reloads and then predicts on the new model at once is answered. One `petal serve` with
--enable_model_control for the module, called through TF Serving's stock stubs; each test lists its own models
beside `base` (the one served from the start), so the tests hold in any order.
"""
from __future__ import annotations

import os
import re
import shutil
import time

import grpc
import numpy as np
import pytest
from google.protobuf import text_format
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tensorflow_serving.apis import (
    get_model_status_pb2,
    model_management_pb2,
    model_service_pb2_grpc,
)
from tensorflow_serving.config import model_server_config_pb2

from exported_models import tf_serving_models
from grpc_calls import predict_request, rpc_error
from server_harness import access_lines, run_server

AVAILABLE = get_model_status_pb2.ModelVersionStatus.State.AVAILABLE
# ServerCore::WaitUntilModelsAvailable's message for one new model whose load failed ("{" + "{" +
# ServableId::DebugString + " due to error: " + the status + "}, " + "}"), with Petal's status of the failure
NOT_AVAILABLE = (r"1 model\(s\) did not become available: \{\{\{name: broken version: 1\} due to error: "
                 r"UNKNOWN: Failed to load: .+\}, \}")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """`base` (served from the start) and `added`: TF Serving's half_plus_two, version 1; `spare`, a copy to
    publish later; `broken`, a version 1 whose saved_model.pb is not one; `late`, `idle` and `never`, no version
    yet."""
    root = tmp_path_factory.mktemp("reload")
    tf_serving_models.half_plus_two(str(root / "spare"))
    for name in ("base", "added"):
        shutil.copytree(root / "spare", root / name / "1")
    (root / "broken" / "1").mkdir(parents=True)
    (root / "broken" / "1" / "saved_model.pb").write_bytes(b"not a SavedModel")
    for name in ("late", "idle", "never"):
        (root / name).mkdir()
    (root / "models.config").write_text(text_format.MessageToString(config(root, "base")))
    return root


def config(root, *names: str) -> model_server_config_pb2.ModelServerConfig:
    config = model_server_config_pb2.ModelServerConfig()
    for name in names:
        config.model_config_list.config.add(name=name, base_path=str(root / name), model_platform="tensorflow")
    return config


@pytest.fixture(scope="module")
def server(root):
    with run_server(f"--model_config_file={root / 'models.config'}", "--enable_model_control",
                    "--file_system_poll_wait_seconds=0.2", "--access_log") as srv:
        yield srv


@pytest.fixture(scope="module")
def reload(channel, root):
    """Reload a config of `base` and `names`, as a client would."""
    stub = model_service_pb2_grpc.ModelServiceStub(channel)

    def call(*names: str, timeout: float | None = 60, future: bool = False, **kwargs):
        request = model_management_pb2.ReloadConfigRequest(config=config(root, "base", *names))
        method = stub.HandleReloadConfigRequest.future if future else stub.HandleReloadConfigRequest
        return method(request, timeout=timeout, **kwargs)
    return call


@pytest.fixture(scope="module")
def predict(stub):
    """half_plus_two of 2.0 on `model` (3.0), through the conftest's PredictionService stub."""
    return lambda model: list(stub.Predict(predict_request(model, x=np.array([2.0], np.float32)),
                                           timeout=30).outputs["y"].float_val)


def states(channel, model: str) -> list[int]:
    """Each version's state, newest first; none while the model has no version."""
    request = get_model_status_pb2.GetModelStatusRequest()
    request.model_spec.name = model
    try:
        response = model_service_pb2_grpc.ModelServiceStub(channel).GetModelStatus(request, timeout=10)
    except grpc.RpcError as error:
        if error.code() != grpc.StatusCode.NOT_FOUND:
            raise
        return []
    return [status.state for status in response.model_version_status]


def test_a_new_model_answers_as_soon_as_the_reload_returns(reload, predict):
    """TF Serving's clients reload and predict at once: no poll, no sleep in between."""
    reload("added")
    assert predict("added") == [3.0]


def test_a_new_model_that_fails_to_load_fails_the_reload_and_the_others_keep_serving(reload, predict):
    err = rpc_error(reload, "broken")
    assert err.code() == grpc.StatusCode.UNKNOWN
    assert re.fullmatch(NOT_AVAILABLE, err.details() or ""), err.details()
    assert predict("base") == [3.0]


def test_the_wait_for_a_model_with_no_version_ends_at_the_clients_deadline(reload, predict, channel, root):
    """TF Serving would wait until a version appears (servable_state_waiter_timeout is infinite); Petal's wait ends
    with the call, and the model loads once a version comes."""
    started = time.monotonic()
    assert rpc_error(reload, "late", timeout=2).code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - started < 10
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="base"), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert predict("base") == [3.0]

    staging = root / "late" / ".staging"
    shutil.copytree(root / "spare", staging)
    os.rename(staging, root / "late" / "1")
    deadline = time.monotonic() + 30
    while states(channel, "late") != [AVAILABLE] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert predict("late") == [3.0]


def test_a_reload_that_lists_no_new_model_answers_at_once(reload):
    """`idle` has no version: only a reload that adds it waits for it (TF Serving's NewModelNamesInSourceConfig);
    listed again, it is not new, and the reload answers without waiting."""
    assert rpc_error(reload, "idle", timeout=1).code() == grpc.StatusCode.DEADLINE_EXCEEDED
    started = time.monotonic()
    reload("idle", timeout=30)
    reload("idle", timeout=30)
    assert time.monotonic() - started < 5


def test_a_reload_without_a_deadline_ends_when_the_client_cancels_it(reload, server):
    """Without a deadline the wait is TF Serving's, until the model settles; the call ending ends it too, so that
    no gRPC thread waits for a client that has gone."""
    call = reload("never", timeout=None, future=True, metadata=(("x-request-id", "cancelled-reload"),))
    time.sleep(1)  # the call reaches its handler, which waits: "never" has no version
    assert not call.done()
    call.cancel()
    lines = access_lines(server, lambda found: any(x.get("request_id") == "cancelled-reload" for x in found),
                         timeout_s=10)
    ended = [x for x in lines if x.get("request_id") == "cancelled-reload"]
    assert ended, "the handler still waits for the cancelled call's model"
    assert ended[0]["latency_ms"] < 5000, ended
