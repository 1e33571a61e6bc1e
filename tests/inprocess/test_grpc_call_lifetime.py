"""A gRPC call's stream is freed as the call ends, not at Python's next cyclic garbage collection. grpc core (1.6x
on, `grpc.http.overload_protection`) counts a connection's streams against MAX_CONCURRENT_STREAMS until their
objects are freed, and a call's objects are freed only once Python lets go of grpcio's call: with the gate's
per-call objects in a reference cycle, a fast client's streams piled up between collections and grpc refused the
next one (perf_analyzer: `Received RST_STREAM with error code 7` at concurrency 2). Here the real gRPC server runs
in this process with two streams a connection and the cyclic collector off, so one call left in a cycle refuses
every call after the second."""
from __future__ import annotations

import gc

import grpc
import numpy as np
from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

from load_tests.launcher import free_port
from server_harness import jpeg, tiny_model_base
from serving.process.flags import parse_args
from serving.protocols.codec import tensor_proto
from serving.protocols.grpc_api import server as grpc_server

CALLS = 60


def test_calls_on_one_connection_free_their_streams_without_the_cyclic_collector(make_dataplane, tmp_path):
    dataplane = make_dataplane(model_base_path=tiny_model_base(), model_name="flowers")
    port = free_port()
    options = parse_args([f"--model_base_path={tiny_model_base()}", "--model_name=flowers", f"--port={port}",
                          "--grpc_max_threads=2"])
    server = grpc_server.start(dataplane, options.protocols, options.security, str(tmp_path))
    assert server is not None
    request = predict_pb2.PredictRequest()
    request.model_spec.name = "flowers"
    request.inputs["image_bytes"].CopyFrom(tensor_proto.encode(np.array([jpeg(seed=3)], dtype=object)))
    answered, refused = 0, []
    gc.collect()
    gc.disable()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
            for _ in range(CALLS):
                try:
                    answered += bool(stub.Predict(request, timeout=5).outputs)
                except grpc.RpcError as error:
                    refused.append(f"{error.code()}: {error.details()}")
    finally:
        gc.enable()
        server.stop(0).wait()
    assert (answered, refused[:1]) == (CALLS, [])
