"""`petal serve` takes every tensorflow_model_server flag: the parser, the warning and refusal rules, the flags page,
and a --model_config_file that does not parse. What is behind a flag is tested where it lives: the Unix socket's
ownership in test_unix_socket.py, the start-up gate in test_startup_gate.py, far deadlines in test_threads.py and
test_dynamic_batcher.py."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from exported_models import DEFAULT_MODEL_BASE_PATH
from server_harness import ROOT
from serving.options.config import option_defaults
from serving.options.model_server_flags import UNIMPLEMENTED
from serving.process.flags import build_parser, parse_args

# Every flag of tensorflow_model_server 2.x, as tensorflow_serving/model_servers/main.cc declares them, each with a
# value of its type that Petal can honour.
TF_SERVING_FLAGS = {
    "port": "8500", "grpc_socket_path": "/tmp/petal-flags-test.sock", "rest_api_port": "8501",
    "rest_api_num_threads": "8", "rest_api_timeout_in_ms": "30000", "rest_api_enable_cors_support": "true",
    "enable_batching": "true", "allow_version_labels_for_unavailable_models": "true",
    "batching_parameters_file": "", "enable_per_model_batching_parameters": "false", "model_config_file": "",
    "model_config_file_poll_wait_seconds": "0", "model_name": "m", "model_base_path": "/models/m",
    "num_load_threads": "0", "num_unload_threads": "0", "max_num_load_retries": "5",
    "load_retry_interval_micros": "60000000", "file_system_poll_wait_seconds": "1", "flush_filesystem_caches": "true",
    "tensorflow_session_parallelism": "0", "tensorflow_session_config_file": "",
    "tensorflow_intra_op_parallelism": "0", "tensorflow_inter_op_parallelism": "0", "use_alts_credentials": "false",
    "ssl_config_file": "", "platform_config_file": "", "per_process_gpu_memory_fraction": "0",
    "saved_model_tags": "serve", "grpc_channel_arguments": "grpc.max_connection_age_ms=2000",
    "grpc_max_threads": "16", "enable_model_warmup": "true", "num_request_iterations_for_warmup": "0",
    "version": "false", "monitoring_config_file": "", "remove_unused_fields_from_bundle_metagraph": "true",
    "prefer_tflite_model": "false", "num_tflite_pools": "4", "num_tflite_interpreters_per_pool": "1",
    "enable_signature_method_name_check": "false", "xla_cpu_compilation_enabled": "false",
    "xla_gpu_compilation_enabled": "false", "enable_profiler": "true", "thread_pool_factory_config_file": "",
    "mixed_precision": "", "skip_initialize_tpu": "false", "enable_grpc_healthcheck_service": "true",
    "enable_serialization_as_tensor_content": "false",
}
REFUSED = {"enable_per_model_batching_parameters": "true", "use_alts_credentials": "true",
           "platform_config_file": "/etc/platform.config", "mixed_precision": "bfloat16", "rest_api_port": "0"}


def parser_flags() -> set[str]:
    return {option[2:] for action in build_parser()._actions for option in action.option_strings
            if option.startswith("--") and option != "--help"}


def table_flags(heading: str) -> list[str]:
    """The flags in the first column of the table under `heading` in docs/flags.md."""
    with open(os.path.join(ROOT, "docs", "flags.md")) as f:
        text = f.read()
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `--([a-z0-9_]+)", section, flags=re.MULTILINE)


def test_every_tensorflow_model_server_flag_parses_and_those_values_warn_about_nothing_else():
    argv = [f"--{name}={value}" for name, value in TF_SERVING_FLAGS.items()]
    options = parse_args(argv)
    protocols = options.protocols
    assert protocols.port == 8500 and protocols.grpc_socket_path == "/tmp/petal-flags-test.sock"
    assert protocols.grpc_max_threads == 16 and options.process.threads == 8
    assert protocols.cors_allowed_origins == ("*",)
    warned = {flag.split("=")[0][2:] for flag, _ in options.ineffective_flags}
    # the values above are TF Serving's defaults or usual ones; these change nothing in Petal, and only these warn
    assert warned == {"flush_filesystem_caches", "max_num_load_retries", "load_retry_interval_micros",
                      "remove_unused_fields_from_bundle_metagraph", "num_tflite_pools",
                      "num_tflite_interpreters_per_pool", "xla_cpu_compilation_enabled", "xla_gpu_compilation_enabled",
                      "skip_initialize_tpu", "enable_serialization_as_tensor_content"}


def test_each_flag_of_the_list_is_in_the_parser_and_on_the_flags_page():
    assert set(TF_SERVING_FLAGS) <= parser_flags()
    assert {f.name for f in UNIMPLEMENTED} <= set(TF_SERVING_FLAGS)
    assert set(TF_SERVING_FLAGS) == set(table_flags("## tensorflow_model_server"))
    petal_own = parser_flags() - set(TF_SERVING_FLAGS)
    assert petal_own == set(table_flags("## Petal's own flags"))


def test_a_flag_that_changes_nothing_is_named_with_why_and_one_with_petals_value_is_silent():
    options = parse_args(["--num_load_threads=4", "--skip_initialize_tpu=false",
                          "--num_request_iterations_for_warmup=1", "--enable_grpc_healthcheck_service=true"])
    assert dict(options.ineffective_flags) == {
        "--num_load_threads=4": "Petal loads versions one at a time on one thread",
        "--skip_initialize_tpu=false": "Petal does not use TPUs"}
    assert parse_args([]).ineffective_flags == ()


@pytest.mark.parametrize("name,value", sorted(REFUSED.items()))
def test_a_flag_asking_for_what_petal_cannot_do_is_refused_by_name(name, value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args([f"--{name}={value}"])
    assert exit_info.value.code == 2
    why = {flag.name: flag.why for flag in UNIMPLEMENTED}.get(name, "Petal always serves REST")  # REST: its own check
    assert f"--{name}={value}: {why}" in capsys.readouterr().err


def test_a_malformed_value_fails_as_it_does_in_tf_serving(capsys):
    for argv in (["--num_load_threads=many"], ["--enable_profiler=perhaps"], ["--no_such_flag=1"]):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert argv[0].split("=")[0][2:] in capsys.readouterr().err


def test_one_port_for_rest_and_grpc_is_refused_at_start(capsys):
    """TF Serving logs an error and skips REST; Petal, which always serves REST, refuses the flags instead of
    failing in its worker once the models have loaded, when gRPC finds the port taken by REST."""
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--port=9000", "--rest_api_port=9000"])
    assert exit_info.value.code == 2
    assert "--rest_api_port=9000 is --port too" in capsys.readouterr().err
    assert parse_args(["--port=9000", "--rest_api_port=9001"]).protocols.port == 9000


def test_session_parallelism_sets_both_pools_unless_one_is_given(capsys):
    both = parse_args(["--tensorflow_session_parallelism=3"]).dataplane
    assert (both.tensorflow_intra_op_parallelism, both.tensorflow_inter_op_parallelism) == (3, 3)
    one = parse_args(["--tensorflow_session_parallelism=3", "--tensorflow_intra_op_parallelism=2"]).dataplane
    assert (one.tensorflow_intra_op_parallelism, one.tensorflow_inter_op_parallelism) == (2, 0)
    with pytest.raises(SystemExit):
        parse_args(["--tensorflow_session_parallelism=3", "--tensorflow_intra_op_parallelism=2",
                    "--tensorflow_inter_op_parallelism=2"])
    assert "not all three" in capsys.readouterr().err


def test_cors_support_means_every_origin_unless_origins_are_named():
    assert parse_args(["--rest_api_enable_cors_support"]).protocols.cors_allowed_origins == ("*",)
    named = parse_args(["--rest_api_enable_cors_support", "--cors_allowed_origins=https://a.example"]).protocols
    assert named.cors_allowed_origins == ("https://a.example",)
    assert parse_args([]).protocols.cors_allowed_origins == ()


def test_version_prints_tf_servings_two_lines_and_exits(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--version"])
    assert exit_info.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("TensorFlow ModelServer: petal ") and lines[1].startswith("TensorFlow Library: 2.")


def test_parser_defaults_are_the_server_options_defaults():
    defaults = option_defaults()
    fields = set(defaults)
    checked = 0
    for action in build_parser()._actions:
        if action.dest in fields:
            assert action.default == defaults[action.dest], action.dest
            checked += 1
    assert checked > 35


@pytest.mark.parametrize("flags, name, base_path", [
    ([], "flowers", DEFAULT_MODEL_BASE_PATH),
    (["--model_base_path=/models/mine"], "default", "/models/mine"),
    (["--model_name=mine", "--model_base_path=/models/mine"], "mine", "/models/mine"),
    (["--model_name=mine"], "mine", DEFAULT_MODEL_BASE_PATH),
], ids=["neither", "base-path-alone", "both", "name-alone"])
def test_a_base_path_without_a_name_is_the_model_tf_serving_calls_default(flags, name, base_path):
    """tensorflow_model_server's --model_name defaults to "default" (main.cc), so a TF Serving client's
    /v1/models/default finds the model; with neither flag Petal serves its own shipped model as flowers."""
    models = parse_args(flags).dataplane.model_config.model_config_list.config
    assert [(m.name, m.base_path) for m in models] == [(name, base_path)]


def test_a_config_file_that_does_not_parse_stops_the_server_with_tf_servings_text(tmp_path):
    """TF Serving's testBadModelConfig starts the server on testdata/bad_model_config.txt and looks for this text on
    stderr."""
    config = tmp_path / "bad_model_config.txt"
    config.write_text("improperly formatted file")
    result = subprocess.run([sys.executable, "-m", "petal", "serve", f"--model_config_file={config}"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "Error parsing text-format tensorflow.serving.ModelServerConfig: 1:1 : " in result.stderr
    assert f"Invalid protobuf file: '{config}'" in result.stderr
