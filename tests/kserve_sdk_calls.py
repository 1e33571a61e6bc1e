"""KServe's Python SDK driven from a process of its own: `python tests/kserve_sdk_calls.py REST_URL GRPC_TARGET`
prints one JSON object, each call's answer or its error by name (tests/e2e/test_kserve_sdk.py reads it).

Why a process: the SDK's generated V2 protos and Triton's (tritonclient, which Petal serves V2 gRPC with and other
tests import) both register `inference.*` messages in protobuf's default pool, so the second import in one process
fails with "duplicate symbol". A real user's client runs apart from the server's code in any case.
"""
from __future__ import annotations

import asyncio
import json
import sys
from typing import TYPE_CHECKING

import numpy as np

from server_harness import jpeg

if TYPE_CHECKING:  # imported in main() only, so a test process can take IMAGES without the SDK's protos
    from kserve import InferenceRESTClient, InferInput, InferRequest

TIMEOUT = 60
IMAGES = [jpeg(seed=s) for s in range(3)]


def binary_input(name: str, datatype: str, value: np.ndarray) -> InferInput:
    from kserve import InferInput

    tensor = InferInput(name, list(value.shape), datatype)
    tensor.set_data_from_numpy(value, binary_data=True)
    return tensor


def requests_by_model() -> dict[str, InferRequest]:
    from kserve import InferRequest

    images = binary_input("image_bytes", "BYTES", np.array(IMAGES, dtype=object))
    x = binary_input("x", "FP32", np.array([[1.0], [2.0], [5.0]], np.float32))
    return {"flowers": InferRequest("flowers", [images]), "half_plus_two": InferRequest("half_plus_two", [x])}


async def probes(client: InferenceRESTClient, url: str) -> list:
    return [await client.is_server_live(url), await client.is_server_ready(url),
            await client.is_model_ready(url, "flowers"), await client.is_model_ready(url, "half_plus_two"),
            await client.is_model_ready(url, "nope")]


async def infer(client, url: str | None) -> dict:
    answers = {}
    for model, request in requests_by_model().items():
        response = await (client.infer(url, request, model_name=model) if url else client.infer(request))
        answers[model] = {"model_name": response.model_name,
                          **{output.name: output.as_numpy().tolist() for output in response.outputs}}
    return answers


async def v1_predict(client: InferenceRESTClient, url: str) -> dict:
    return await client.infer(url, {"instances": [1.0, 2.0, 5.0]}, model_name="half_plus_two")


async def main(url: str, target: str) -> dict:
    """Each client is made inside the event loop (the gRPC client's channel needs the running loop)."""
    from kserve import InferenceGRPCClient, InferenceRESTClient, RESTConfig

    calls = {
        "probes": (lambda: InferenceRESTClient(RESTConfig(protocol="v2", timeout=TIMEOUT)), probes, url),
        "infer_rest": (lambda: InferenceRESTClient(RESTConfig(protocol="v2", timeout=TIMEOUT)), infer, url),
        "infer_grpc": (lambda: InferenceGRPCClient(target, timeout=TIMEOUT), infer, None),
        "v1_predict": (lambda: InferenceRESTClient(RESTConfig(protocol="v1", timeout=TIMEOUT)), v1_predict, url),
    }
    results = {}
    for name, (make_client, call, where) in calls.items():
        client = make_client()
        try:
            results[name] = {"answer": await call(client, where)}
        except Exception as error:  # reported by name, so each test shows its own call's failure
            results[name] = {"error": f"{type(error).__name__}: {error}"}
        finally:
            await client.close()
    return results


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1], sys.argv[2])), default=bytes.decode))  # BYTES outputs as text
