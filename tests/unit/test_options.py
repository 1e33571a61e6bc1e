"""`petal serve`'s options are parsed once into frozen groups, and each file the flags name is read once, at start,
into the value the options hold, never a path beside it (serving/process/flags.py, serving/options/config_files.py)."""
from __future__ import annotations

import dataclasses

import pytest

from serving.options.config import (
    DataPlaneOptions,
    ProcessOptions,
    ProtocolOptions,
    SecurityOptions,
    ServerOptions,
    listening_urls,
    model_config_for,
    token_digest,
)
from serving.process.flags import parse_args
from tls_certs import make_pki

TOKEN = "a-token-of-at-least-16-chars"
MODEL_CONFIG = 'model_config_list { config { name: "m" base_path: "/models/m" model_platform: "tensorflow" } }'


@pytest.fixture
def flag_files(tmp_path) -> dict[str, str]:
    """A file for every flag that names one, each saying something other than the default."""
    pki = make_pki(tmp_path)
    texts = {"model_config_file": MODEL_CONFIG, "batching_parameters_file": "max_batch_size { value: 8 }",
             "monitoring_config_file": 'prometheus_config { enable: true path: "/custom" }',
             "ssl_config_file": pki.ssl_config(), "auth_token_file": f"{TOKEN} admin\n"}
    paths = {}
    for flag, text in texts.items():
        path = tmp_path / flag
        path.write_text(text)
        paths[flag] = str(path)
    return paths


def test_each_file_the_flags_name_is_read_once_into_what_the_options_hold(flag_files, opened):
    options = parse_args([f"--{flag}={path}" for flag, path in flag_files.items()])
    assert {path: opened[path] for path in flag_files.values()} == dict.fromkeys(flag_files.values(), 1)
    assert options.dataplane.model_config == model_config_for("m", "/models/m")
    assert options.dataplane.batching.max_batch_size == 8
    assert options.protocols.metrics_path == "/custom"
    assert options.security.tls is not None and "BEGIN CERTIFICATE" in options.security.tls.server_cert
    assert [(t.digest, t.role) for t in options.security.tokens] == [(token_digest(TOKEN), "admin")]


def test_the_options_hold_no_file_path_beside_what_was_read_from_it():
    names = {f.name for group in (DataPlaneOptions, ProtocolOptions, SecurityOptions)
             for f in dataclasses.fields(group)}
    assert not names & {"model_config_file", "batching_parameters_file", "monitoring_config_file", "ssl_config_file",
                        "auth_token_file", "model_name", "model_base_path"}
    # the one path kept is the file the worker watches (the DataPlane's model_config is what it held at start)
    assert {f.name for f in dataclasses.fields(ProcessOptions)} >= {"model_config_file",
                                                                     "model_config_file_poll_wait_seconds"}


def test_the_flags_name_one_model_as_a_config_file_would():
    assert parse_args(["--model_name=m", "--model_base_path=/models/m"]).dataplane.model_config == \
        model_config_for("m", "/models/m")


def test_options_are_never_changed_after_parsing_only_replaced():
    options = parse_args(["--rest_api_enable_cors_support", "--tensorflow_session_parallelism=3"])
    for group, name in ((options, "dataplane"), (options.dataplane, "enable_batching"), (options.protocols, "port"),
                        (options.security, "tokens"), (options.process, "workers"),
                        (options.dataplane.batching, "max_batch_size")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(group, name, getattr(group, name))
    # what parsing derives is in the options it returns
    assert options.protocols.cors_allowed_origins == ("*",)
    assert (options.dataplane.tensorflow_intra_op_parallelism, options.dataplane.tensorflow_inter_op_parallelism) == \
        (3, 3)
    derived = dataclasses.replace(options, process=dataclasses.replace(options.process, runtime_dir="/run/petal"))
    assert derived.process.runtime_dir == "/run/petal" and options.process.runtime_dir == ""
    assert ServerOptions().process.runtime_dir == ""


@pytest.mark.parametrize(("flags", "bound", "reached"), [
    ([], ("http://0.0.0.0:8501", ["grpc://0.0.0.0:8500"]), ("http://localhost:8501", ["grpc://localhost:8500"])),
    (["--host=::", "--grpc_socket_path=/run/petal.sock"],
     ("http://[::]:8501", ["grpc://[::]:8500", "unix:/run/petal.sock"]),
     ("http://localhost:8501", ["grpc://localhost:8500", "unix:/run/petal.sock"])),
    (["--host=10.0.0.7", "--port=0"], ("http://10.0.0.7:8501", []), ("http://10.0.0.7:8501", [])),
], ids=["defaults", "IPv6 wildcard and a socket", "one host, no gRPC port"])
def test_the_banner_and_the_ready_line_name_the_ports_alike(flags, bound, reached):
    """One function for both lines: they once drifted apart, gRPC a bare host:port in one and grpc:// in the other."""
    options = parse_args(["--model_base_path=/models/m", *flags])
    assert listening_urls(options) == bound
    assert listening_urls(options, for_clients=True) == reached
