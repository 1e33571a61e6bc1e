"""A pixel flood: many large, cheap JPEGs at once, over each protocol, and what the server's memory does under it.

A flat-colour JPEG of 6000 x 6000 pixels is about 0.56 MB on the wire and 108 MB decoded, so a few clients ask a
server for far more memory than they send; the memory budget (docs/security.md) must refuse them in time. Used by
benchmarks/memory.py and by the tests that hold a server to its budget (tests/e2e/test_pixel_flood.py,
tests/e2e/test_manifests.py). The memory figures are the kernel's, read from /proc.
"""
from __future__ import annotations

import base64
import io
import json
import threading
from collections.abc import Callable

from load_tests.launcher import Server
from serving.client.security import Security
from serving.protocols.codec.v2_bytes import frame
from serving.status_codes import Code


def flat_jpeg(side: int, progressive: bool = False) -> bytes:
    """A flat-colour JPEG: about 0.56 MB on the wire at 6000 x 6000, and 3 bytes a pixel once decoded. Progressive,
    about 0.3 MB, and its decoder holds the whole image's DCT coefficients (105 MB) at any scale it decodes at."""
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (side, side), (200, 120, 40)).save(out, format="JPEG", quality=90, progressive=progressive)
    return out.getvalue()


def status_kb(pid: int, field: str) -> int:
    """A figure of /proc/PID/status (VmRSS, VmHWM), in kB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def reset_peak(pid: int) -> None:
    """Start VmHWM again from the current size, so the peak is the flood's and not the model load's."""
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


def flood_requests(protocol: str, server: Server, image: bytes, images: int, clients: int,
                   timeout_s: float) -> list[Callable[[], int]]:
    """One callable per request of a flood, each returning the status it got (a gRPC code as the HTTP status it
    maps to; 0: no answer within `timeout_s`): `clients` requests of `images` JPEGs each, as a REST `:predict` of
    base64 JSON, a V2 `infer` with the images as binary data or a gRPC Predict; or, since `:classify_image` takes
    one image a request, clients x images multipart requests."""
    url = server.rest_url
    if protocol == "rest":
        body = json.dumps({"instances": [{"b64": base64.b64encode(image).decode()}] * images}).encode()
        return [lambda: _post(url + "/v1/models/flowers:predict", timeout_s, data=body,
                              headers={"Content-Type": "application/json"})] * clients
    if protocol == "v2":
        raw = frame([image] * images)
        header = json.dumps({"inputs": [{"name": "image_bytes", "datatype": "BYTES", "shape": [images],
                                         "parameters": {"binary_data_size": len(raw)}}]}).encode()
        return [lambda: _post(url + "/v2/models/flowers/infer", timeout_s, data=header + raw,
                              headers={"Content-Type": "application/octet-stream",
                                       "Inference-Header-Content-Length": str(len(header))})] * clients
    if protocol == "multipart":
        return [lambda: _post(url + "/v1/models/flowers:classify_image", timeout_s,
                              files={"image": ("flat.jpg", image, "image/jpeg")})] * (clients * images)
    return [_grpc_predict(server.grpc_target, image, images, timeout_s)] * clients


def _post(url: str, timeout_s: float, **kwargs) -> int:
    import requests

    try:
        return requests.post(url, timeout=timeout_s, **kwargs).status_code
    except requests.RequestException:
        return 0


def _grpc_predict(target: str, image: bytes, images: int, timeout_s: float) -> Callable[[], int]:
    import grpc
    import tensorflow as tf
    from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

    request = predict_pb2.PredictRequest()
    request.model_spec.name = "flowers"
    request.inputs["image_bytes"].CopyFrom(tf.make_tensor_proto([image] * images, dtype=tf.string))

    def send() -> int:
        with Security().grpc_channel(target, max_message_bytes=256 << 20) as channel:
            try:
                prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(request, timeout=timeout_s)
                return 200
            except grpc.RpcError as error:
                return Code[error.code().name].http_status
    return send


def flood(sends: list[Callable[[], int]]) -> dict[int, int]:
    """Every request at once; how many got each status."""
    statuses: dict[int, int] = {}
    lock = threading.Lock()

    def one(send: Callable[[], int]) -> None:
        status = send()
        with lock:
            statuses[status] = statuses.get(status, 0) + 1
    threads = [threading.Thread(target=one, args=(send,)) for send in sends]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return statuses
