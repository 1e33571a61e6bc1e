"""One set of rules for a model config, wherever it comes from: the flags, --model_config_file (at start and as
the worker re-reads it) and the reload RPC (serving/options/config_files.py `check_model_config`). The reload RPC once
took a model_platform that a config file was refused for; it runs here through the real servicer on an in-process
DataPlane serving the tiny model."""
from __future__ import annotations

import grpc
import pytest
from google.protobuf import text_format
from tensorflow_serving.apis import model_management_pb2
from tensorflow_serving.config import model_server_config_pb2

from server_harness import check_watcher_keeps_running_config, tiny_model_base
from serving.core import Code, ServingError
from serving.options.config_files import check_model_config, read_model_config
from serving.process.flags import parse_args
from serving.protocols.grpc_api.tfserving import ModelService

BAD_PLATFORM = "model_platform 'pytorch' is not supported"


def config(name: str = "flowers", base_path: str | None = None,
           platform: str = "tensorflow") -> model_server_config_pb2.ModelServerConfig:
    result = model_server_config_pb2.ModelServerConfig()
    result.model_config_list.config.add(name=name, base_path=tiny_model_base() if base_path is None else base_path,
                                        model_platform=platform)
    return result


class Aborted(Exception):
    pass


class AbortingContext:
    """What a unary servicer asks of grpc's ServicerContext: abort when it fails, which raises as grpc's does,
    carrying the status code and details that the client would get; and, for the reload's wait, the call's deadline
    (none) and whether it is still on (it is)."""

    def time_remaining(self) -> float | None:
        return None

    def is_active(self) -> bool:
        return True

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)


@pytest.fixture(scope="module")
def dataplane(make_dataplane):
    return make_dataplane(model_base_path=tiny_model_base(), model_name="flowers")


def reload(dataplane, request_config: model_server_config_pb2.ModelServerConfig):
    request = model_management_pb2.ReloadConfigRequest(config=request_config)
    return ModelService(dataplane).HandleReloadConfigRequest(request, AbortingContext())


# --- the rules --------------------------------------------------------------------------------------------------

def test_a_tensorflow_model_list_passes_and_each_broken_rule_is_named(tmp_path):
    check_model_config(config())
    check_model_config(config(platform=""))  # unset: TensorFlow
    for broken, message in ((config(platform="pytorch"), BAD_PLATFORM),
                            (config(name=""), "every config needs a name and a base_path"),
                            (config(base_path=""), "every config needs a name and a base_path"),
                            (model_server_config_pb2.ModelServerConfig(), "only model_config_list is supported")):
        with pytest.raises(ValueError, match=message):
            check_model_config(broken)
    (tmp_path / "root").mkdir()
    with pytest.raises(ValueError, match="outside --model_root"):
        check_model_config(config(), str(tmp_path / "root"))
    check_model_config(config(base_path=str(tmp_path / "root" / "m")), str(tmp_path / "root"))


def test_a_config_file_breaking_a_rule_is_refused_with_its_path(tmp_path):
    path = tmp_path / "models.config"
    path.write_text(text_format.MessageToString(config(platform="pytorch")))
    with pytest.raises(ValueError, match=f"{path}: {BAD_PLATFORM}"):
        read_model_config(str(path))


def test_the_flags_are_checked_by_the_same_rules(tmp_path, capsys):
    path = tmp_path / "models.config"
    path.write_text(text_format.MessageToString(config(platform="pytorch")))
    for argv, message in (([f"--model_config_file={path}"], BAD_PLATFORM),
                          (["--model_name="], "every config needs a name and a base_path")):
        with pytest.raises(SystemExit) as exit_info:
            parse_args(argv)
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err, argv


# --- the reload RPC ---------------------------------------------------------------------------------------------

def test_the_reload_rpc_refuses_a_platform_a_config_file_is_refused_for(dataplane):
    with pytest.raises(Aborted) as refused:
        reload(dataplane, config(platform="pytorch"))
    code, details = refused.value.args
    assert code == grpc.StatusCode.INVALID_ARGUMENT and BAD_PLATFORM in details
    assert dataplane.model_names() == ["flowers"] and dataplane.ready(), "the running config is kept"


def test_the_reload_rpc_refuses_a_model_without_a_base_path_and_takes_a_good_config(dataplane):
    with pytest.raises(Aborted) as refused:
        reload(dataplane, config(base_path=""))
    assert refused.value.args == (grpc.StatusCode.INVALID_ARGUMENT, "every config needs a name and a base_path")
    assert reload(dataplane, config()) == model_management_pb2.ReloadConfigResponse()
    assert dataplane.model_names() == ["flowers"]


def test_the_dataplane_refuses_a_bad_config_as_invalid_argument(dataplane):
    with pytest.raises(ServingError) as refused:
        dataplane.reload_config(config(platform="pytorch"))
    assert refused.value.code == Code.INVALID_ARGUMENT and BAD_PLATFORM in refused.value.message


# --- the watcher ----------------------------------------------------------------------------------------------

def test_the_watcher_keeps_the_running_config_when_the_file_breaks_a_rule(tmp_path, caplog):
    """A worker re-reading --model_config_file: the file now names a PyTorch model, so the watch logs why and the
    models served stay as they were."""
    path = tmp_path / "models.config"
    path.write_text(text_format.MessageToString(config(platform="pytorch")))
    check_watcher_keeps_running_config(path, config(), BAD_PLATFORM, caplog, timeout_s=10)


def test_the_watcher_keeps_the_running_config_when_the_file_labels_a_version_not_available(tmp_path, caplog):
    """The file now labels version 9, which is not AVAILABLE: the watch logs TF Serving's FAILED_PRECONDITION
    (serving/core/version_labels.py) and the labels served stay as they were (none)."""
    labelled = config()
    labelled.model_config_list.config[0].version_labels["stable"] = 9
    path = tmp_path / "models.config"
    path.write_text(text_format.MessageToString(labelled))
    check_watcher_keeps_running_config(
        path, config(), "Request to assign label to version 9 of model flowers, which is not currently available "
        "for inference", caplog, timeout_s=30)


def test_the_watcher_keeps_the_running_config_when_the_file_cannot_be_parsed(tmp_path, caplog):
    """A file cut short (a copy over it caught midway, say) is logged once, not at every look."""
    path = tmp_path / "models.config"
    path.write_text('model_config_list { config { name: "flowers" base_path: ')
    check_watcher_keeps_running_config(path, config(), "Invalid protobuf file", caplog, timeout_s=10)
