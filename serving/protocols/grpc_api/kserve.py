"""KServe V2 / Open Inference Protocol over gRPC (`inference.GRPCInferenceService`), with Triton's
model-configuration and statistics extensions, beside TF Serving's services on the gRPC port.

It is the REST V2 API (serving/protocols/rest/kserve.py) in Triton's gRPC messages: the tensors go through the V2
gRPC codec (serving/protocols/codec/v2_grpc.py: the datatypes, BYTES framing and classification extension REST
shares), the documents are v2.py's, and the same DataPlane.predict runs them, so V2 gRPC requests batch with every
other protocol's and pass the same `Gate` (tokens, access log), TLS and message-size limit as TF Serving's gRPC
API. The stubs are Triton's own, from `tritonclient.grpc` (its grpc_service.proto is KServe's plus the
extensions); services Petal does not have (streaming, the model repository, shared memory, trace and log
settings) answer UNIMPLEMENTED.
"""
from __future__ import annotations

from typing import Any

import grpc
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc

from serving.core import DataPlane, SignatureInfo, invalid, not_found
from serving.protocols import v2
from serving.protocols.codec import v2_grpc
from serving.protocols.codec.v2_grpc import version_of
from serving.protocols.grpc_api.common import deadline_of, rpc


class InferenceService(service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self, dataplane: DataPlane, max_message_bytes: int) -> None:
        self.dataplane = dataplane
        self.max_message_bytes = max_message_bytes

    @rpc
    def ServerLive(self, request: Any, context: grpc.ServicerContext) -> Any:
        return service_pb2.ServerLiveResponse(live=True)

    @rpc
    def ServerReady(self, request: Any, context: grpc.ServicerContext) -> Any:
        return service_pb2.ServerReadyResponse(ready=self.dataplane.ready())

    @rpc
    def ModelReady(self, request: service_pb2.ModelReadyRequest, context: grpc.ServicerContext) -> Any:
        """NOT_FOUND for a model the server does not have, as REST's 404."""
        if request.name not in self.dataplane.model_names():
            raise not_found(f"Could not find any versions of model {request.name}")
        ready = self.dataplane.model_ready(request.name, version_of(request.version))
        return service_pb2.ModelReadyResponse(ready=ready)

    @rpc
    def ServerMetadata(self, request: Any, context: grpc.ServicerContext) -> Any:
        return service_pb2.ServerMetadataResponse(name="petal", version="1", extensions=v2.EXTENSIONS)

    @rpc
    def ModelMetadata(self, request: service_pb2.ModelMetadataRequest, context: grpc.ServicerContext) -> Any:
        return json_format.ParseDict(v2.model_metadata(self.dataplane, request.name, version_of(request.version)),
                                     service_pb2.ModelMetadataResponse())

    @rpc
    def ModelConfig(self, request: service_pb2.ModelConfigRequest, context: grpc.ServicerContext) -> Any:
        config = v2.model_config(self.dataplane, request.name, version_of(request.version))
        return service_pb2.ModelConfigResponse(config=json_format.ParseDict(config, model_config_pb2.ModelConfig()))

    @rpc
    def ModelStatistics(self, request: service_pb2.ModelStatisticsRequest, context: grpc.ServicerContext) -> Any:
        """An empty name is every model; an empty version every AVAILABLE version."""
        stats = v2.model_statistics(self.dataplane, request.name or None, version_of(request.version))
        return json_format.ParseDict(stats, service_pb2.ModelStatisticsResponse())

    @rpc
    def ModelInfer(self, request: service_pb2.ModelInferRequest, context: grpc.ServicerContext) -> Any:
        """The inputs are decoded once the model is found (the DataPlane's hold on the version)."""
        if not request.model_name:
            raise invalid("ModelInferRequest needs a model_name")
        signature = request.parameters.get("signature_name")

        def inputs(info: SignatureInfo) -> dict[str, Any]:
            return v2.with_triton_dims(v2_grpc.request_inputs(request, self.max_message_bytes),
                                     request.model_name)(info)
        result = self.dataplane.predict(model=request.model_name, inputs=inputs,
                                        version=version_of(request.model_version),
                                        signature_name=signature.string_param if signature is not None else "",
                                        output_filter=[output.name for output in request.outputs] or None,
                                        deadline=deadline_of(context), entrypoint="GRPC")
        response = service_pb2.ModelInferResponse(model_name=result.model, model_version=str(result.version),
                                                  id=request.id)
        for tensor in v2_grpc.response_outputs(request, result,
                                               v2.answered_by_a_batching_model(self.dataplane, result)):
            response.outputs.add(name=tensor.name, datatype=tensor.datatype, shape=tensor.shape)
            response.raw_output_contents.append(tensor.raw)
        return response


def _unserved(name: str) -> Any:
    """A method of Triton's service that Petal does not have: UNIMPLEMENTED, as the generated servicer answers, but
    without its NotImplementedError, which grpc logged with a traceback on every call, at ERROR, so that any client
    could fill the server's log."""
    def unserved(self: InferenceService, request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{name} is not served by Petal")
    return unserved


for _name in dir(service_pb2_grpc.GRPCInferenceServiceServicer):
    if not _name.startswith("_") and _name not in vars(InferenceService):
        setattr(InferenceService, _name, _unserved(_name))


def add_to_server(dataplane: DataPlane, server: grpc.Server, max_message_bytes: int) -> None:
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(InferenceService(dataplane, max_message_bytes), server)
