"""TF Serving's `BatchingParameters`, `MonitoringConfig` and `SSLConfig` messages.

The tensorflow-serving-api wheel ships none of them (only apis/ and config/model_server_config), yet
`--batching_parameters_file`, `--monitoring_config_file` and `--ssl_config_file` are text protos of exactly these
messages. So, when
the wheel lacks them, they are declared here with TF Serving's package, names and field numbers, and text-format
files written for tensorflow_model_server parse unchanged.
"""
from __future__ import annotations

from typing import TypeAlias

from google.protobuf import (
    descriptor_pb2,
    descriptor_pool,
    message_factory,
    wrappers_pb2,  # noqa: F401  (registers google/protobuf/wrappers.proto in the pool)
)

_F: TypeAlias = descriptor_pb2.FieldDescriptorProto


def _field(name: str, number: int, type_: int, type_name: str = "", repeated: bool = False) -> _F:
    field = _F(name=name, number=number, type=type_, label=_F.LABEL_REPEATED if repeated else _F.LABEL_OPTIONAL)
    if type_name:
        field.type_name = type_name
    return field


def _declare() -> tuple[type, type, type]:
    file = descriptor_pb2.FileDescriptorProto(name="petal/tensorflow_serving_config_extra.proto",
                                              package="tensorflow.serving", syntax="proto3",
                                              dependency=["google/protobuf/wrappers.proto"])
    int64 = (_F.TYPE_MESSAGE, ".google.protobuf.Int64Value")
    file.message_type.add(name="BatchingParameters", field=[
        _field("max_batch_size", 1, *int64),
        _field("batch_timeout_micros", 2, *int64),
        _field("max_enqueued_batches", 3, *int64),
        _field("num_batch_threads", 4, *int64),
        _field("thread_pool_name", 5, _F.TYPE_MESSAGE, ".google.protobuf.StringValue"),
        _field("allowed_batch_sizes", 6, _F.TYPE_INT64, repeated=True),
        _field("pad_variable_length_inputs", 7, _F.TYPE_BOOL),
        _field("enable_large_batch_splitting", 8, _F.TYPE_MESSAGE, ".google.protobuf.BoolValue"),
        _field("max_execution_batch_size", 9, *int64),
    ])  # every field of tensorflow_serving/servables/tensorflow/session_bundle_config.proto's, 1 to 9
    file.message_type.add(name="PrometheusConfig", field=[
        _field("enable", 1, _F.TYPE_BOOL), _field("path", 2, _F.TYPE_STRING)])
    file.message_type.add(name="MonitoringConfig", field=[
        _field("prometheus_config", 1, _F.TYPE_MESSAGE, ".tensorflow.serving.PrometheusConfig")])
    file.message_type.add(name="SSLConfig", field=[  # tensorflow_serving/config/ssl_config.proto
        _field("server_key", 1, _F.TYPE_STRING), _field("server_cert", 2, _F.TYPE_STRING),
        _field("custom_ca", 3, _F.TYPE_STRING), _field("client_verify", 4, _F.TYPE_BOOL)])
    pool = descriptor_pool.Default()
    pool.Add(file)
    return tuple(message_factory.GetMessageClass(pool.FindMessageTypeByName(f"tensorflow.serving.{name}"))
                 for name in ("BatchingParameters", "MonitoringConfig", "SSLConfig"))


try:
    from tensorflow_serving.config.monitoring_config_pb2 import MonitoringConfig
    from tensorflow_serving.config.ssl_config_pb2 import SSLConfig
    from tensorflow_serving.servables.tensorflow.session_bundle_config_pb2 import BatchingParameters
except ImportError:
    BatchingParameters, MonitoringConfig, SSLConfig = _declare()
