"""What one V2 gRPC ModelInferRequest may decode to (serving/protocols/codec/v2_grpc.py `request_inputs`): at most
the limit (--grpc_max_message_bytes) in all, counted as TF Serving's Predict counts it, before any input is
decoded. Without it, a 60 MB message of two-byte BYTES elements took a worker 27 s and 1 GiB."""
from __future__ import annotations

import numpy as np
import pytest
from tritonclient.grpc import service_pb2

from serving.core import Code, ServingError
from serving.protocols.codec.tensor_proto import STRING_ELEMENT_BYTES
from serving.protocols.codec.v2_bytes import frame
from serving.protocols.codec.v2_grpc import request_inputs


def bytes_request(count: int, raw: bool) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name="m")
    tensor = request.inputs.add(name="x", datatype="BYTES", shape=[count])
    if raw:
        request.raw_input_contents.append(frame([b"ab"] * count))
    else:
        tensor.contents.bytes_contents.extend([b"ab"] * count)
    return request


def refusal(request: service_pb2.ModelInferRequest, limit: int) -> str:
    with pytest.raises(ServingError) as error:
        request_inputs(request, limit)
    assert error.value.code == Code.INVALID_ARGUMENT
    return error.value.message


@pytest.mark.parametrize("raw", [True, False], ids=["raw", "typed"])
def test_bytes_elements_count_their_python_objects_against_the_limit(raw):
    limit = 1000 * STRING_ELEMENT_BYTES
    assert request_inputs(bytes_request(1000, raw), limit)["x"].tolist() == [b"ab"] * 1000
    assert refusal(bytes_request(1001, raw), limit) == (
        f"Inputs would decode to {1001 * STRING_ELEMENT_BYTES} bytes, over the {limit}-byte limit "
        "(--grpc_max_message_bytes)")


def test_the_limit_is_for_all_inputs_together():
    request = service_pb2.ModelInferRequest(model_name="m")
    for name in ("a", "b"):
        request.inputs.add(name=name, datatype="FP32", shape=[250]).contents.fp32_contents.extend([1.0] * 250)
    inputs = request_inputs(request, 2000)
    assert set(inputs) == {"a", "b"} and inputs["a"].dtype == np.float32
    assert "would decode to 2000 bytes" in refusal(request, 1999)


def test_raw_bytes_too_short_for_their_shape_are_malformed_not_large():
    """A shape of a billion BYTES elements over 7 raw bytes is refused for what it is, as REST's binary infer
    refuses it, not as 56 GB it would never decode to."""
    request = service_pb2.ModelInferRequest(model_name="m")
    request.inputs.add(name="x", datatype="BYTES", shape=[1_000_000_000])
    request.raw_input_contents.append(frame([b"abc"]))
    assert refusal(request, 1 << 20) == ("Input 'x': 7 bytes cannot hold the 1000000000 BYTES elements of shape "
                                         "[1000000000] (each takes at least 4)")
