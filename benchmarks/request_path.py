"""The request path's own CPU, in-process, against earlier checkouts: a quieter A/B than benchmarks/serving.py for a
change on the path.

    .venv/bin/python benchmarks/request_path.py [--before ../prev] [--blocks 20] [--requests 150]

Each checkout runs in a process of its own, on its own code (its folder first on the path, its .venv if it has
one). A process loads the shipped flowers model into a real DataPlane, sets up TensorFlow as a worker does, and
serves one 480x360 photo per request through what tests/inprocess/test_request_calls.py counts: REST predict and
V2 binary infer through gunicorn's parser, Petal's gevent worker on a socket pair and the Flask app; gRPC Predict
through the gate and the servicer (grpcio's own threads aside). The model runs on TensorFlow's pool, as under load
(not on the calling thread, as a lone request's does), so the calling thread's CPU is the path's: socket, HTTP,
Flask, codecs, dataplane, its side of the batcher, answer. What other threads spend (a batch thread's part of a
batched call, TensorFlow's pool) is not counted: benchmarks/cpu_budget.py splits a served request's CPU by thread.

All the processes stay up and take turns, a block of requests of one protocol each, so that each block of this
checkout has one of every other measured within a second or two of it: this machine's speed drifts by 20% or more
from minute to minute, which separate runs (or rounds a process each) would measure instead of the change. What
is printed is the median over the blocks of each block's ratio, with the middle half of those ratios.
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL_DIR = os.path.join("exported_models", "flowers")
PROTOCOLS = ("rest", "v2", "grpc")


def serve_requests(tree: str) -> None:
    """In `tree`'s code: serve the blocks of requests that stdin asks for (see the module's docstring)."""
    sys.path.insert(0, tree)
    from serving.tensorflow_logs import import_tensorflow  # the checkout's own; main() sets TF_CPP_MIN_LOG_LEVEL

    import_tensorflow()  # first, without TensorFlow's C++ start-up lines
    import grpc
    import numpy as np
    from gunicorn import glogging
    from tensorflow_serving.apis import predict_pb2

    from serving.core import DataPlane
    from serving.options.config import DataPlaneOptions, model_config_for
    from serving.process.flags import parse_args
    from serving.process.server import PetalApplication
    from serving.process.tensorflow_runtime import configure_tensorflow
    from serving.protocols.codec import tensor_proto
    from serving.protocols.grpc_api import server as grpc_server
    from serving.protocols.grpc_api.tfserving import PredictionService
    from serving.protocols.rest.app import create_app
    from training.synth import render

    photo = render("daisy", seed=0, size=(480, 360))
    options = parse_args([f"--model_base_path={MODEL_DIR}", "--model_name=flowers"])
    configure_tensorflow(options)
    dataplane = DataPlane.create(DataPlaneOptions(model_config=model_config_for("flowers", MODEL_DIR),
                                                  file_system_poll_wait_seconds=0, memory_budget_bytes=1 << 30))
    dataplane.wait_loaded()
    application = PetalApplication(options)
    worker = application.worker_class()(0, os.getpid(), [], application, 30, application.cfg,
                                        glogging.Logger(application.cfg))
    worker.wsgi = create_app(dataplane, options.protocols, options.security)
    worker.start_serving()

    def http(path: str, body: bytes, **headers: str):
        head = "".join(f"{k.replace('_', '-')}: {v}\r\n" for k, v in headers.items())
        request = f"POST {path} HTTP/1.1\r\nHost: petal\r\n{head}Content-Length: {len(body)}\r\n\r\n".encode() + body

        def serve() -> None:
            ours, theirs = socket.socketpair()
            with ours:
                ours.sendall(request)
                ours.shutdown(socket.SHUT_WR)
                worker.handle(theirs, theirs, ("127.0.0.1", 50000))
                answer = b"".join(iter(lambda: ours.recv(1 << 16), b""))
            assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
        return serve

    raw = struct.pack("<I", len(photo)) + photo
    header = json.dumps({"inputs": [{"name": "image_bytes", "shape": [1], "datatype": "BYTES",
                                     "parameters": {"binary_data_size": len(raw)}}]}).encode()
    gate = grpc_server.gate(dataplane, options.protocols, options.security)
    handler = grpc.unary_unary_rpc_method_handler(
        PredictionService(dataplane, options.protocols.grpc_max_message_bytes).Predict,
        predict_pb2.PredictRequest.FromString, predict_pb2.PredictResponse.SerializeToString)
    details = type("Details", (), {"method": "/tensorflow.serving.PredictionService/Predict",
                                   "invocation_metadata": ()})()
    class Context:
        """What the gate and servicer ask of grpc's ServicerContext; the callbacks run as the answer is read."""
        callbacks: list = []

        def time_remaining(self) -> float:
            return 10.0

        def add_callback(self, callback) -> bool:
            self.callbacks.append(callback)
            return True

        def cancel(self) -> None:
            pass

    context = Context()
    predict = predict_pb2.PredictRequest()
    predict.model_spec.name = "flowers"
    predict.inputs["image_bytes"].CopyFrom(tensor_proto.encode(np.array([photo], dtype=object)))
    wire = predict.SerializeToString()

    # one call in flight on another thread throughout: each measured call runs its model on the pool, as REST's do
    holder = threading.Thread(target=gate.calls.__enter__)
    holder.start()
    holder.join()

    def grpc_predict() -> None:
        gated = gate.intercept_service(lambda _: handler, details)
        gated.response_serializer(gated.unary_unary(gated.request_deserializer(wire), context))
        while context.callbacks:  # the call ends: its client has read the answer
            context.callbacks.pop()()

    calls = {"rest": http("/v1/models/flowers:predict",
                          json.dumps({"instances": [{"b64": base64.b64encode(photo).decode()}]}).encode(),
                          Content_Type="application/json"),
             "v2": http("/v2/models/flowers/infer", header + raw, Content_Type="application/octet-stream",
                        Inference_Header_Content_Length=str(len(header))),
             "grpc": grpc_predict}
    for call in calls.values():
        for _ in range(50):  # warm every cache the path fills on first use
            call()
    print("ready", flush=True)
    for line in sys.stdin:  # "protocol requests": run them, answer the calling thread's CPU per request (ms)
        protocol, count = line.split()
        call = calls[protocol]
        started = time.thread_time()
        for _ in range(int(count)):
            call()
        print(1000 * (time.thread_time() - started) / int(count), flush=True)
    dataplane.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", action="append", default=[], help="an earlier checkout; may be repeated")
    parser.add_argument("--blocks", type=int, default=20, help="blocks of each protocol per checkout")
    parser.add_argument("--requests", type=int, default=150, help="requests per block")
    parser.add_argument("--_tree", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._tree:
        serve_requests(args._tree)
        return 0
    from serving_benchmark import bench  # only here: a checkout's process must import that checkout's code alone

    trees = {"this checkout": ROOT, **{os.path.basename(os.path.normpath(t)): os.path.abspath(t) for t in args.before}}
    processes = {name: subprocess.Popen([bench.interpreter(tree), os.path.abspath(__file__), "--_tree", tree],
                                        cwd=tree, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
                 for name, tree in trees.items()}
    try:
        for name, process in processes.items():
            for line in process.stdout:  # past anything a library printed while it loaded
                if line.strip() == "ready":
                    break
            else:
                raise SystemExit(f"{name}'s process ended before it was ready")
        samples = {name: {p: [] for p in PROTOCOLS} for name in trees}
        for block in range(args.blocks):
            for protocol in PROTOCOLS:
                for name in (list(trees) if block % 2 == 0 else list(reversed(trees))):
                    process = processes[name]
                    process.stdin.write(f"{protocol} {args.requests}\n")
                    process.stdin.flush()
                    samples[name][protocol].append(float(process.stdout.readline()))
            print(f"block {block + 1} of {args.blocks} done", file=sys.stderr)
    finally:
        for process in processes.values():
            process.stdin.close()
            process.wait()
    print("| checkout | " + " | ".join(f"{p} ms/request (median, lowest–highest block)" for p in PROTOCOLS) + " |")
    print("|---|" + "---|" * len(PROTOCOLS))
    for name, each in samples.items():
        print(f"| {name} | " + " | ".join(
            f"{statistics.median(each[p]):.3f} ({min(each[p]):.3f}–{max(each[p]):.3f})" for p in PROTOCOLS) + " |")
    for name in list(trees)[1:]:
        print(f"this checkout ÷ {name}, median of the blocks' ratios (middle half): " + ", ".join(
            f"{p} {_ratios(samples['this checkout'][p], samples[name][p])}" for p in PROTOCOLS))
    return 0


def _ratios(this: list[float], other: list[float]) -> str:
    ratios = [a / b for a, b in zip(this, other, strict=True)]
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    return f"{statistics.median(ratios):.3f}x ({quartiles[0]:.3f}–{quartiles[2]:.3f})"


if __name__ == "__main__":
    sys.exit(main())
