"""A server's memory under a pixel flood, over each protocol: large flat-colour JPEGs, cheap on the wire and huge
once decoded.

    .venv/bin/python benchmarks/memory.py [--clients 8] [--images 32] [--side 6000] \
        [--protocols rest,v2,multipart,grpc] [--petal_args "--memory_budget_bytes=268435456"]

Each of `--clients` clients sends one request of `--images` JPEGs of side x side pixels at once (a 6000 x 6000 flat
colour is 0.56 MB on the wire and 108 MB decoded): a REST `:predict` of base64 JSON (about 23 MB for 32), a V2
`infer` with the images as binary data, a gRPC Predict, or, since `:classify_image` takes one image a request,
clients x images multipart `:classify_image` requests at once. The figures are the server's whole process group
(the gunicorn master and its worker): resident memory idle, its peak during the flood (the sum of each process's
kernel high-water mark, VmHWM, reset before the flood; writing to clear_refs needs the processes' owner) and 5 s
after; and how the requests were answered (HTTP statuses; gRPC codes as the HTTP status they map to). Every
protocol gets a fresh server, started with `--petal_args` (default: none, the derived budget).

The script uses only what tests/server_harness.py has had since the pixel budget came, so the same file measures
an older checkout (copy it there and run it with that checkout's PYTHONPATH).
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import requests

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, ROOT)
MB = 1024 * 1024
PROTOCOLS = ("rest", "v2", "multipart", "grpc")
GRPC_TO_HTTP = {"OK": 200, "INVALID_ARGUMENT": 400, "NOT_FOUND": 404, "RESOURCE_EXHAUSTED": 429,
                "UNAVAILABLE": 503, "DEADLINE_EXCEEDED": 504}
TIMEOUT_S = 600


def process_group(master: int) -> list[int]:
    """The server's processes: the master and its workers."""
    children = subprocess.run(["pgrep", "-P", str(master)], capture_output=True, text=True).stdout.split()
    return [master, *map(int, children)]


def senders(protocol: str, server, image: bytes, images: int, clients: int) -> list[Callable[[], int]]:
    """One callable per concurrent request, each returning the status it got (0: no answer)."""
    url = server.rest_url
    if protocol == "rest":
        body = json.dumps({"instances": [{"b64": base64.b64encode(image).decode()}] * images}).encode()
        return [lambda: post(url + "/v1/models/flowers:predict", data=body,
                             headers={"Content-Type": "application/json"})] * clients
    if protocol == "v2":
        raw = (struct.pack("<I", len(image)) + image) * images
        header = json.dumps({"inputs": [{"name": "image_bytes", "datatype": "BYTES", "shape": [images],
                                         "parameters": {"binary_data_size": len(raw)}}]}).encode()
        return [lambda: post(url + "/v2/models/flowers/infer", data=header + raw,
                             headers={"Content-Type": "application/octet-stream",
                                      "Inference-Header-Content-Length": str(len(header))})] * clients
    if protocol == "multipart":
        return [lambda: post(url + "/v1/models/flowers:classify_image",
                             files={"image": ("flat.jpg", image, "image/jpeg")})] * (clients * images)
    return [grpc_sender(server.grpc_target, image, images)] * clients


def post(url: str, **kwargs) -> int:
    try:
        return requests.post(url, timeout=TIMEOUT_S, **kwargs).status_code
    except requests.RequestException:
        return 0


def grpc_sender(target: str, image: bytes, images: int) -> Callable[[], int]:
    import grpc
    import tensorflow as tf
    from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

    request = predict_pb2.PredictRequest()
    request.model_spec.name = "flowers"
    request.inputs["image_bytes"].CopyFrom(tf.make_tensor_proto([image] * images, dtype=tf.string))
    options = [("grpc.max_send_message_length", 256 * MB), ("grpc.max_receive_message_length", 256 * MB)]

    def send() -> int:
        with grpc.insecure_channel(target, options=options) as channel:
            try:
                prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(request, timeout=TIMEOUT_S)
                return 200
            except grpc.RpcError as error:
                return GRPC_TO_HTTP.get(error.code().name, 0)
    return send


def flood(sends: list[Callable[[], int]]) -> dict[int, int]:
    """Every request at once; the statuses, counted."""
    statuses: dict[int, int] = {}
    lock = threading.Lock()

    def one(send: Callable[[], int]) -> None:
        code = send()
        with lock:
            statuses[code] = statuses.get(code, 0) + 1
    threads = [threading.Thread(target=one, args=(send,)) for send in sends]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return statuses


def measure(protocol: str, extra: list[str], image: bytes, images: int, clients: int) -> dict:
    """One flood against a fresh server; sizes in bytes."""
    from server_harness import reset_peak, run_server, status_kb, tiny_model_base

    with run_server(f"--model_base_path={tiny_model_base()}", *extra) as server:
        pids = process_group(server.proc.pid)
        for pid in pids:
            reset_peak(pid)
        idle = sum(status_kb(pid, "VmRSS") for pid in pids) * 1024
        started = time.monotonic()
        statuses = flood(senders(protocol, server, image, images, clients))
        elapsed = time.monotonic() - started
        peak = sum(status_kb(pid, "VmHWM") for pid in pids) * 1024
        time.sleep(5)
        after = sum(status_kb(pid, "VmRSS") for pid in pids) * 1024
    return {"protocol": protocol, "idle": idle, "peak": peak, "after": after, "seconds": elapsed,
            "statuses": statuses}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients")
    parser.add_argument("--images", type=int, default=32, help="images per request")
    parser.add_argument("--side", type=int, default=6000, help="pixels per side (under --max_image_pixels)")
    parser.add_argument("--protocols", default=",".join(PROTOCOLS), help="comma-separated: " + ", ".join(PROTOCOLS))
    parser.add_argument("--petal_args", default="", help="flags for every server")
    args = parser.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from server_harness import flat_jpeg

    image = flat_jpeg(args.side)
    print(f"{args.clients} clients x {args.images} x {args.side}x{args.side} JPEGs ({len(image) / MB:.2f} MB each "
          f"on the wire, {args.side * args.side * 3 / MB:.0f} MB decoded); petal serve {args.petal_args}\n")
    print("| protocol | idle RSS MB | peak RSS MB | peak - idle | RSS 5 s after MB | seconds | statuses |")
    print("|---|---|---|---|---|---|---|")
    for protocol in args.protocols.split(","):
        r = measure(protocol, args.petal_args.split(), image, args.images, args.clients)
        print(f"| {protocol} | {r['idle'] / MB:.0f} | {r['peak'] / MB:.0f} | {(r['peak'] - r['idle']) / MB:+.0f} | "
              f"{r['after'] / MB:.0f} | {r['seconds']:.1f} | {json.dumps(r['statuses'], sort_keys=True)} |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
