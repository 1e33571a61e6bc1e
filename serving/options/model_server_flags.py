"""tensorflow_model_server's flags that Petal takes without implementing them, and what a value given to one means.

`petal serve` accepts every flag of TF Serving 2.x's model server (tensorflow_serving/model_servers/main.cc).
serving/options/config.py implements those that change what Petal does; this table holds the others. For each, `petal`
lists the values that describe what Petal does anyway: such a value asks for nothing Petal does not do. Any other
value either changes nothing that Petal serves (tuning, hardware set-up, TF Serving's internals: it is accepted
and named in one warning line at start) or asks for something Petal cannot do (`refuse`: start-up fails with a
message naming the flag). docs/flags.md lists every flag.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Unimplemented:
    name: str
    kind: str  # bool, int, float or str: parsed as TF Serving parses it, so a malformed value still fails
    petal: tuple[object, ...]  # values that describe Petal's own behaviour; () when none does
    refuse: bool  # another value asks for something Petal cannot do
    why: str  # what Petal does instead, for the warning or the refusal


UNIMPLEMENTED = (
    Unimplemented("enable_per_model_batching_parameters", "bool", (False,), True,
                  "Petal batches every model with --batching_parameters_file; it does not read a model's "
                  "batching_params.pbtxt"),
    Unimplemented("num_load_threads", "int", (0,), False, "Petal loads versions one at a time on one thread"),
    Unimplemented("num_unload_threads", "int", (0,), False, "Petal unloads versions on its one loading thread"),
    Unimplemented("max_num_load_retries", "int", (), False,
                  "Petal retries a version that failed to load when its files change, not on a timer"),
    Unimplemented("load_retry_interval_micros", "int", (), False,
                  "Petal retries a version that failed to load when its files change, not on a timer"),
    Unimplemented("flush_filesystem_caches", "bool", (False,), False, "Petal does not flush file system caches"),
    Unimplemented("tensorflow_session_config_file", "str", ("",), False,
                  "Petal sets TensorFlow's threads from --tensorflow_intra_op_parallelism and "
                  "--tensorflow_inter_op_parallelism only"),
    Unimplemented("use_alts_credentials", "bool", (False,), True,
                  "Petal has no ALTS credentials; use --ssl_config_file for TLS"),
    Unimplemented("platform_config_file", "str", ("",), True,
                  "Petal serves the tensorflow platform only, configured by its flags"),
    Unimplemented("num_request_iterations_for_warmup", "int", (0, 1), False,
                  "Petal replays each warmup record once"),
    Unimplemented("remove_unused_fields_from_bundle_metagraph", "bool", (), False,
                  "a memory saving inside TF Serving's SavedModel loader"),
    Unimplemented("num_tflite_pools", "int", (), False, "Petal sizes its TFLite interpreters itself"),
    Unimplemented("num_tflite_interpreters_per_pool", "int", (), False, "Petal sizes its TFLite interpreters itself"),
    Unimplemented("enable_signature_method_name_check", "bool", (False,), False,
                  "Petal chooses Classify and Regress signatures by method name and, for TF2 models, by their "
                  "inputs and outputs, as TF Serving does without the check"),
    Unimplemented("xla_cpu_compilation_enabled", "bool", (True,), False,
                  "Petal leaves XLA to TensorFlow: a model saved with jit_compile runs compiled"),
    Unimplemented("xla_gpu_compilation_enabled", "bool", (True,), False,
                  "Petal leaves XLA to TensorFlow: a model saved with jit_compile runs compiled"),
    Unimplemented("thread_pool_factory_config_file", "str", ("",), False,
                  "Petal runs models on its batch threads and TensorFlow's own thread pools"),
    Unimplemented("mixed_precision", "str", ("",), True,
                  "Petal runs a model at the precision it was saved with (no bfloat16 rewrite)"),
    Unimplemented("skip_initialize_tpu", "bool", (True,), False, "Petal does not use TPUs"),
    Unimplemented("enable_grpc_healthcheck_service", "bool", (True,), False,
                  "Petal always serves grpc.health.v1 on its gRPC port"),
    Unimplemented("enable_serialization_as_tensor_content", "bool", (), False,
                  "Petal encodes Predict outputs as tf.make_tensor_proto does; tf.make_ndarray reads either form"),
)
