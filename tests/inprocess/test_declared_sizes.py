"""KServe V2 REST requests whose declared sizes (shape, binary_data_size, BYTES length prefixes) are lies: each is a
400 with a JSON error, answered at once, allocating nothing near what it claims; and shapes no numpy array can have
are 400s too, not 500s. In-process (Flask's test client over a real DataPlane on the tiny model).

The gRPC side is tests/unit/test_tensor_proto.py (the decoder) and tests/e2e/test_grpc_fuzz.py (a real server)."""
from __future__ import annotations

import json
import struct
import time
import tracemalloc

import pytest

from server_harness import jpeg, tiny_model_base
from serving.protocols.codec.v2_bytes import frame
from serving.protocols.rest.app import create_app

INFER = "/v2/models/flowers/infer"
HEADER_LENGTH = "Inference-Header-Content-Length"
JPEG = jpeg()


@pytest.fixture(scope="module")
def client(make_dataplane, tmp_path_factory):
    config = tmp_path_factory.mktemp("sizes") / "models.config"
    config.write_text(f'model_config_list {{ config {{ name: "flowers" base_path: "{tiny_model_base()}" '
                      'model_platform: "tensorflow" } }')
    return create_app(make_dataplane(model_config_file=str(config))).test_client()


def binary(spec: dict, tail: bytes) -> dict:
    head = json.dumps({"inputs": [spec]}).encode()
    return {"data": head + tail, "content_type": "application/octet-stream", "headers": {HEADER_LENGTH: str(len(head))}}


def plain(spec: dict) -> dict:
    return {"json": {"inputs": [spec]}}


def strings(shape: list, **fields) -> dict:
    return {"name": "image_bytes", "datatype": "BYTES", "shape": shape, **fields}


LIES = [
    ("a billion BYTES, one sent", plain(strings([1_000_000_000], data=["eA=="])),
     "1 elements do not match shape [1000000000]"),
    ("2^62 FP32 over binary", binary({"name": "images", "datatype": "FP32", "shape": [2 ** 31, 2 ** 31],
                                      "parameters": {"binary_data_size": 4}}, b"\0" * 4),
     "too large for any array"),
    ("2^40 FP32 over binary", binary({"name": "images", "datatype": "FP32", "shape": [2 ** 40],
                                      "parameters": {"binary_data_size": 4}}, b"\0" * 4),
     "4 bytes do not hold shape [1099511627776] of FP32"),
    ("a huge empty shape", plain(strings([2 ** 62, 4, 0], data=[])), "too large for any array"),
    ("a dimension past 2^64", plain(strings([2 ** 70, 0], data=[])), "too large for any array"),
    ("65 dimensions", plain(strings([1] * 65, data=["eA=="])), "shape has 65 dimensions, more than 64"),
    ("a negative dimension", plain(strings([-1], data=["eA=="])), "Expected `int` >= 0 - at `$.inputs[0].shape[0]`"),
    ("binary_data_size past the body", binary(strings([1], parameters={"binary_data_size": 1 << 40}),
                                              frame([JPEG])), f"binary_data_size {1 << 40} exceeds the binary data"),
    ("more BYTES elements than the shape", binary(strings([1], parameters={"binary_data_size": 4000}),
                                                  frame([b""] * 1000)),
     "the binary data holds more than the 1 BYTES elements of its shape"),
    ("a BYTES length prefix past the data", binary(strings([1], parameters={"binary_data_size": 8}),
                                                   struct.pack("<I", 0xFFFFFFFF) + b"abcd"),
     "BYTES element of 4294967295 bytes overruns the binary data"),
]


@pytest.mark.parametrize("request_kwargs, message", [c[1:] for c in LIES], ids=[c[0] for c in LIES])
def test_a_v2_request_whose_sizes_lie_is_refused_at_once(client, request_kwargs, message):
    tracemalloc.start()
    try:
        started = time.perf_counter()
        response = client.post(INFER, **request_kwargs)
        elapsed = time.perf_counter() - started
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert response.status_code == 400, response.get_data(as_text=True)
    assert message in response.get_json()["error"]
    assert elapsed < 0.5, f"{elapsed:.3f} s"
    assert peak < 4 << 20, f"{peak} bytes allocated"


def test_a_v2_request_whose_sizes_agree_still_predicts(client):
    response = client.post(INFER, **binary(strings([2], parameters={"binary_data_size": 2 * (len(JPEG) + 4)}),
                                           frame([JPEG, JPEG])))
    assert response.status_code == 200, response.get_data(as_text=True)
    shapes = {o["name"]: o["shape"] for o in response.get_json()["outputs"]}
    assert shapes["classid"] == [2]
