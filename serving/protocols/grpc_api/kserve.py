"""KServe V2 / Open Inference Protocol over gRPC (`inference.GRPCInferenceService`), with Triton's
model-configuration and statistics extensions, beside TF Serving's services on the gRPC port.

It is the REST V2 API (kserve.py) in Triton's gRPC messages: the same datatypes, BYTES framing (4-byte
little-endian lengths), classification extension and documents (v2.py), and the same DataPlane.predict, so V2 gRPC
requests batch with every other protocol's and pass the same `Gate` (tokens, access log), TLS and message-size
limit as TF Serving's gRPC API. Tensors come as `raw_input_contents` (as tritonclient sends them) or typed
`contents`; outputs go back as `raw_output_contents`, as Triton answers. The stubs are Triton's own, from
`tritonclient.grpc` (its grpc_service.proto is KServe's plus the extensions); services Petal does not have
(streaming, the model repository, shared memory, trace and log settings) answer UNIMPLEMENTED.
"""
from __future__ import annotations

from typing import Any

import grpc
import numpy as np
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc

from serving.core import DataPlane, invalid, not_found
from serving.protocols import v2
from serving.protocols.grpc_api import deadline_of, rpc
from serving.protocols.httputil import parse_version
from serving.protocols.kserve import binary_data, classification, datatype_of, decode_raw
from serving.protocols.tensor_proto import STRING_ELEMENT_BYTES

SERVICE = "/inference.GRPCInferenceService/"
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
    count x itemsize of them or refuses them); a BYTES element is a reference and a bytes object besides its bytes."""
    if tensor.datatype == "BYTES":
        return count * STRING_ELEMENT_BYTES
    return len(raw) if raw is not None else count * np.dtype(v2.NUMPY_TYPES[tensor.datatype]).itemsize


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
            values = np.array(typed, dtype=object if datatype == "BYTES" else v2.NUMPY_TYPES[datatype])
        except OverflowError as exc:  # INT8 contents of 1000
            raise invalid(f"Input {name!r}: data is not {datatype}: {exc}") from None
    if values.size != count:
        raise invalid(f"Input {name!r}: {values.size} elements do not match shape {shape}")
    return values.reshape(shape)


def request_inputs(request: service_pb2.ModelInferRequest, limit: int) -> dict[str, np.ndarray]:
    """The inputs as arrays, refused before the first is decoded when together they would decode to more than
    `limit` bytes (--grpc_max_message_bytes), as TF Serving's Predict is: a message of millions of short BYTES
    elements decodes to many times its size, and takes seconds doing it."""
    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(request.inputs):
        raise invalid(f"raw_input_contents has {len(raw)} entries for {len(request.inputs)} inputs; it needs one "
                      "per input, in order")
    sent: list[bytes | None] = raw or [None] * len(request.inputs)
    counts = [v2.declared_count(tensor.name, tensor.datatype, list(tensor.shape)) for tensor in request.inputs]
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


class InferenceService(service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self, core: DataPlane, max_message_bytes: int) -> None:
        self.core = core
        self.max_message_bytes = max_message_bytes

    @rpc
    def ServerLive(self, request: Any, context: grpc.ServicerContext) -> Any:
        return service_pb2.ServerLiveResponse(live=True)

    @rpc
    def ServerReady(self, request: Any, context: grpc.ServicerContext) -> Any:
        return service_pb2.ServerReadyResponse(ready=self.core.ready())

    @rpc
    def ModelReady(self, request: service_pb2.ModelReadyRequest, context: grpc.ServicerContext) -> Any:
        """NOT_FOUND for a model the server does not have, as REST's 404."""
        if request.name not in self.core.model_names():
            raise not_found(f"Could not find any versions of model {request.name}")
        return service_pb2.ModelReadyResponse(ready=self.core.model_ready(request.name, version_of(request.version)))

    @rpc
    def ServerMetadata(self, request: Any, context: grpc.ServicerContext) -> Any:
        return service_pb2.ServerMetadataResponse(name="petal", version="1", extensions=v2.EXTENSIONS)

    @rpc
    def ModelMetadata(self, request: service_pb2.ModelMetadataRequest, context: grpc.ServicerContext) -> Any:
        return json_format.ParseDict(v2.model_metadata(self.core, request.name, version_of(request.version)),
                                     service_pb2.ModelMetadataResponse())

    @rpc
    def ModelConfig(self, request: service_pb2.ModelConfigRequest, context: grpc.ServicerContext) -> Any:
        config = v2.model_config(self.core, request.name, version_of(request.version))
        return service_pb2.ModelConfigResponse(config=json_format.ParseDict(config, model_config_pb2.ModelConfig()))

    @rpc
    def ModelStatistics(self, request: service_pb2.ModelStatisticsRequest, context: grpc.ServicerContext) -> Any:
        """An empty name is every model; an empty version every AVAILABLE version."""
        stats = v2.model_statistics(self.core, request.name or None, version_of(request.version))
        return json_format.ParseDict(stats, service_pb2.ModelStatisticsResponse())

    @rpc
    def ModelInfer(self, request: service_pb2.ModelInferRequest, context: grpc.ServicerContext) -> Any:
        if not request.model_name:
            raise invalid("ModelInferRequest needs a model_name")
        signature = request.parameters.get("signature_name")
        requested = [output.name for output in request.outputs]
        inputs = request_inputs(request, self.max_message_bytes)
        result = self.core.predict(model=request.model_name, inputs=v2.with_triton_dims(inputs),
                                   version=version_of(request.model_version),
                                   signature_name=signature.string_param if signature is not None else "",
                                   output_filter=requested or None, deadline=deadline_of(context),
                                   entrypoint="GRPC")
        response = service_pb2.ModelInferResponse(model_name=result.model, model_version=str(result.version),
                                                  id=request.id)
        classes = {o.name: o.parameters["classification"].int64_param for o in request.outputs
                   if "classification" in o.parameters}
        for name in requested or list(result.outputs):
            array = result.outputs[name]
            if name in classes:
                if classes[name] <= 0 or datatype_of(array) == "BYTES":
                    raise invalid(f"Output {name!r}: classification needs a positive integer on a numeric output")
                array = classification(array, classes[name], result.labels)
            response.outputs.add(name=name, datatype=datatype_of(array), shape=list(array.shape))
            response.raw_output_contents.append(binary_data(array))
        return response


def add_to_server(core: DataPlane, server: grpc.Server, max_message_bytes: int) -> None:
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(InferenceService(core, max_message_bytes), server)
