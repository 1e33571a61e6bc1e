"""KServe V2's gRPC tensors (Triton's ModelInferRequest and ModelInferResponse, grpc_service.proto): the inputs as
arrays, from `raw_input_contents` (as tritonclient sends them) or the typed `contents`, and the outputs as
`raw_output_contents`, as Triton answers.

The messages are read and filled by field name, so this codec imports neither grpc nor tritonclient's stubs (the
servicer in serving/protocols/grpc_api/kserve.py holds those).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from serving.core import PredictResult, invalid
from serving.protocols.codec.tensor_proto import STRING_ELEMENT_BYTES
from serving.protocols.codec.text import parse_version
from serving.protocols.codec.v2_tensors import (
    NUMPY_TYPES,
    binary_data,
    check_bytes_hold,
    datatype_of,
    declared_count,
    decode_raw,
    output,
)

# The typed InferTensorContents field of each datatype; FP16 has none, it travels raw only.
CONTENTS = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
            "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents",
            "UINT32": "uint_contents", "UINT64": "uint64_contents", "FP32": "fp32_contents",
            "FP64": "fp64_contents", "BYTES": "bytes_contents"}


def version_of(text: str) -> int | None:
    """A V2 model_version: empty means the latest."""
    return parse_version(text or None)


def decoded_bytes(tensor: Any, count: int, raw: bytes | None) -> int:
    """What decoding an input allocates, if it decodes: raw numbers are their bytes (decode_raw takes exactly
    count x itemsize of them or refuses them); a BYTES element is a reference and a bytes object besides its bytes.
    Raw BYTES that cannot hold their shape are refused as such first, not as a size they would never reach."""
    if tensor.datatype == "BYTES":
        if raw is not None:
            check_bytes_hold(raw, tensor.name, list(tensor.shape), count)
        return count * STRING_ELEMENT_BYTES
    return len(raw) if raw is not None else count * np.dtype(NUMPY_TYPES[tensor.datatype]).itemsize


def decode_tensor(tensor: Any, raw: bytes | None, count: int) -> np.ndarray:
    """One input tensor of `count` elements as numpy, from its raw bytes when the request sent
    raw_input_contents. Every size a client states (each BYTES length) is checked against the bytes that came
    before it is trusted."""
    name, datatype, shape = tensor.name, tensor.datatype, list(tensor.shape)
    if raw is not None:
        if tensor.HasField("contents"):
            raise invalid(f"Input {name!r} has both contents and raw_input_contents")
        values = decode_raw(raw, name, datatype, shape, count)
    else:
        if datatype not in CONTENTS:
            raise invalid(f"Input {name!r}: {datatype} travels in raw_input_contents only")
        typed = getattr(tensor.contents, CONTENTS[datatype])
        if len(typed) != count:
            raise invalid(f"Input {name!r}: {len(typed)} elements do not match shape {shape}")
        try:
            values = np.array(typed, dtype=object if datatype == "BYTES" else NUMPY_TYPES[datatype])
        except OverflowError as exc:  # INT8 contents of 1000
            raise invalid(f"Input {name!r}: data is not {datatype}: {exc}") from None
    if values.size != count:
        raise invalid(f"Input {name!r}: {values.size} elements do not match shape {shape}")
    return values.reshape(shape)


def request_inputs(request: Any, limit: int) -> dict[str, np.ndarray]:
    """A ModelInferRequest's inputs as arrays, refused before the first is decoded when together they would decode
    to more than `limit` bytes (--grpc_max_message_bytes), as TF Serving's Predict is: a message of millions of
    short BYTES elements decodes to many times its size, and takes seconds doing it."""
    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(request.inputs):
        raise invalid(f"raw_input_contents has {len(raw)} entries for {len(request.inputs)} inputs; it needs one "
                      "per input, in order")
    sent: list[bytes | None] = raw or [None] * len(request.inputs)
    counts = [declared_count(tensor.name, tensor.datatype, list(tensor.shape)) for tensor in request.inputs]
    total = sum(decoded_bytes(*entry) for entry in zip(request.inputs, counts, sent, strict=False))
    if total > limit:
        raise invalid(f"Inputs would decode to {total} bytes, over the {limit}-byte limit (--grpc_max_message_bytes)")
    inputs = {}
    for tensor, count, data in zip(request.inputs, counts, sent, strict=False):
        if tensor.name in inputs:
            raise invalid(f"Input {tensor.name!r} is given twice")
        inputs[tensor.name] = decode_tensor(tensor, data, count)
    if not inputs:
        raise invalid("Inference request needs at least one input")
    return inputs


@dataclass(slots=True)
class OutputTensor:
    """One output of a ModelInferResponse: its `outputs` entry and its `raw_output_contents`."""
    name: str
    datatype: str
    shape: list[int]
    raw: bytes


def response_outputs(request: Any, result: PredictResult, batched: Callable[[], bool]) -> list[OutputTensor]:
    """The outputs a ModelInferRequest asked for (all of the signature's when it lists none), each top classes
    when its parameters ask for them (`classification`, a positive int64_param; `batched` as v2_tensors.output
    takes it)."""
    classes = {}
    for o in request.outputs:
        if "classification" in o.parameters:
            classes[o.name] = o.parameters["classification"].int64_param
            if classes[o.name] <= 0:
                raise invalid(f"Output {o.name!r}: classification needs a positive integer on a numeric output")
    answered = []
    for name in [o.name for o in request.outputs] or list(result.outputs):
        array = output(result.outputs[name], classes.get(name, 0), result.class_names, name, batched)
        datatype = datatype_of(array)
        answered.append(OutputTensor(name, datatype, list(array.shape), binary_data(array, datatype)))
    return answered
