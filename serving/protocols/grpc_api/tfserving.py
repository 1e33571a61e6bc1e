"""TF Serving's gRPC API (PredictionService, ModelService) over a worker's DataPlane: each servicer moves its
request's messages to a codec (TensorProtos: serving/protocols/codec/tensor_proto.py; tf.Example inputs go to the
DataPlane as they are) and the codec's result to the DataPlane. Errors are TF Serving's codes and texts.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf import wrappers_pb2
from tensorflow.core.framework import tensor_shape_pb2, types_pb2
from tensorflow.core.protobuf import error_codes_pb2, meta_graph_pb2
from tensorflow_serving.apis import (
    classification_pb2,
    get_model_metadata_pb2,
    get_model_status_pb2,
    inference_pb2,
    model_management_pb2,
    model_pb2,
    model_service_pb2_grpc,
    predict_pb2,
    prediction_service_pb2_grpc,
    regression_pb2,
)
from tensorflow_serving.config import model_server_config_pb2

from serving.core import CLASSIFY_METHOD, REGRESS_METHOD, DataPlane, Result, SignatureInfo, Task, invalid
from serving.protocols.codec import tensor_proto
from serving.protocols.grpc_api.common import CALL_HOLD, deadline_of, rpc


def model_spec_fields(spec: model_pb2.ModelSpec) -> dict[str, Any]:
    """The version/label selection of a ModelSpec as DataPlane keyword arguments."""
    if not spec.name:
        raise invalid("ModelSpec has no name specified.")  # server_core.cc ServableRequestFromModelSpec
    return {"model": spec.name,
            "version": spec.version.value if spec.HasField("version") else None,
            "label": spec.version_label or None}


def resolved_spec(name: str, version: int, signature_name: str) -> model_pb2.ModelSpec:
    return model_pb2.ModelSpec(name=name, version=wrappers_pb2.Int64Value(value=version),
                               signature_name=signature_name)


def signature_def(info: SignatureInfo) -> meta_graph_pb2.SignatureDef:
    """DataPlane's SignatureInfo as the SignatureDef proto that GetModelMetadata returns."""
    def tensor_info(t: Any) -> meta_graph_pb2.TensorInfo:
        shape = (tensor_shape_pb2.TensorShapeProto(unknown_rank=True) if t.shape is None else
                 tensor_shape_pb2.TensorShapeProto(dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=d)
                                                        for d in t.shape]))
        return meta_graph_pb2.TensorInfo(name=t.name, dtype=types_pb2.DataType.Value(t.dtype), tensor_shape=shape)

    return meta_graph_pb2.SignatureDef(inputs={k: tensor_info(v) for k, v in info.inputs.items()},
                                       outputs={k: tensor_info(v) for k, v in info.outputs.items()},
                                       method_name=info.method_name, defaults=info.defaults)


def inference_result(model: str, version: int, result: Result) -> inference_pb2.InferenceResult:
    """A Classify or Regress answer as the InferenceResult MultiInference returns (and the others unpack)."""
    answer = inference_pb2.InferenceResult(model_spec=resolved_spec(model, version, result.signature_name))
    if result.classifications is not None:
        for row in result.classifications:
            answer.classification_result.classifications.add().classes.extend(
                classification_pb2.Class(label=label, score=score) for label, score in row)
    else:
        regressions = result.regressions or ()
        answer.regression_result.regressions.extend(regression_pb2.Regression(value=v) for v in regressions)
    return answer


class PredictionService(prediction_service_pb2_grpc.PredictionServiceServicer):
    def __init__(self, dataplane: DataPlane, max_message_bytes: int) -> None:
        self.dataplane = dataplane
        self.max_message_bytes = max_message_bytes

    @rpc
    def Predict(self, request: predict_pb2.PredictRequest, context: grpc.ServicerContext) -> Any:
        hold = CALL_HOLD.get()
        result = self.dataplane.predict(inputs=tensor_proto.signature_inputs(request.inputs, self.max_message_bytes,
                                                                             hold.grow if hold else None),
                                        signature_name=request.model_spec.signature_name,
                                        output_filter=list(request.output_filter) or None,
                                        deadline=deadline_of(context), entrypoint="GRPC",
                                        **model_spec_fields(request.model_spec))
        response = predict_pb2.PredictResponse(
            model_spec=resolved_spec(result.model, result.version, result.signature_name))
        for name, array in result.outputs.items():
            response.outputs[name].CopyFrom(tensor_proto.encode(array))
        return response

    @rpc
    def Classify(self, request: classification_pb2.ClassificationRequest, context: grpc.ServicerContext) -> Any:
        result = self.examples(request.model_spec, [Task(CLASSIFY_METHOD, request.model_spec.signature_name)],
                               request.input, context, "classify")[0]
        return classification_pb2.ClassificationResponse(model_spec=result.model_spec,
                                                         result=result.classification_result)

    @rpc
    def Regress(self, request: regression_pb2.RegressionRequest, context: grpc.ServicerContext) -> Any:
        result = self.examples(request.model_spec, [Task(REGRESS_METHOD, request.model_spec.signature_name)],
                               request.input, context, "regress")[0]
        return regression_pb2.RegressionResponse(model_spec=result.model_spec, result=result.regression_result)

    @rpc
    def MultiInference(self, request: inference_pb2.MultiInferenceRequest, context: grpc.ServicerContext) -> Any:
        """TF Serving's rules: every task on the same model (the first task's version or label), distinct
        signatures."""
        for task in request.tasks:
            if not task.model_spec.name:
                raise invalid("Found ModelSpec with an empty model name.")
            if task.model_spec.name != request.tasks[0].model_spec.name:
                raise invalid("All ModelSpecs in a MultiInferenceRequest must access the same model name.")
        spec = request.tasks[0].model_spec if request.tasks else model_pb2.ModelSpec()
        tasks = [Task(task.method_name, task.model_spec.signature_name) for task in request.tasks]
        return inference_pb2.MultiInferenceResponse(
            results=self.examples(spec, tasks, request.input, context, "multi_inference"))

    def examples(self, spec: model_pb2.ModelSpec, tasks: list[Task], request_input: Any,
                 context: grpc.ServicerContext, api: str) -> list[inference_pb2.InferenceResult]:
        fields = model_spec_fields(spec)
        version, results = self.dataplane.multi_inference(fields["model"], tasks, request_input, fields["version"],
                                                          fields["label"], deadline_of(context), "GRPC", api)
        return [inference_result(fields["model"], version, result) for result in results]

    @rpc
    def GetModelMetadata(self, request: get_model_metadata_pb2.GetModelMetadataRequest,
                         context: grpc.ServicerContext) -> Any:
        """TF Serving's checks and texts; its answer names the model and version, never the signature."""
        if not request.metadata_field:
            raise invalid("GetModelMetadataRequest must specify at least one metadata_field")
        for field in request.metadata_field:
            if field != "signature_def":
                raise invalid(f"Metadata field {field} is not supported")
        spec = model_spec_fields(request.model_spec)
        version, signatures = self.dataplane.signatures(spec["model"], spec["version"], spec["label"], internal=True)
        sig_map = get_model_metadata_pb2.SignatureDefMap(
            signature_def={name: signature_def(info) for name, info in signatures.items()})
        response = get_model_metadata_pb2.GetModelMetadataResponse(
            model_spec=resolved_spec(spec["model"], version, ""))
        response.metadata["signature_def"].Pack(sig_map)
        return response


# How the reload RPC applies a config, as DataPlane.reload_config does: (the config, the call's deadline in
# time.monotonic() seconds or None, whether the call has ended), returning once the new models are AVAILABLE.
ReloadConfig = Callable[[model_server_config_pb2.ModelServerConfig, float | None, Callable[[], bool]], None]


class ModelService(model_service_pb2_grpc.ModelServiceServicer):
    """`reload` applies a reload RPC's config: the worker's (serving/process/worker.py), which passes it on to the other
    workers; by default the DataPlane's own."""

    def __init__(self, dataplane: DataPlane, reload: ReloadConfig | None = None) -> None:
        self.dataplane = dataplane
        self.reload = reload or dataplane.reload_config

    @rpc
    def GetModelStatus(self, request: get_model_status_pb2.GetModelStatusRequest,
                       context: grpc.ServicerContext) -> Any:
        spec = model_spec_fields(request.model_spec)
        response = get_model_status_pb2.GetModelStatusResponse()
        for status in self.dataplane.status(spec["model"], spec["version"], spec["label"]):
            entry = response.model_version_status.add(
                version=status.version, state=get_model_status_pb2.ModelVersionStatus.State.Value(status.state))
            entry.status.error_code = error_codes_pb2.Code.Value(status.error_code or "OK")
            entry.status.error_message = status.error_message
        return response

    @rpc
    def HandleReloadConfigRequest(self, request: model_management_pb2.ReloadConfigRequest,
                                  context: grpc.ServicerContext) -> Any:
        """One worker gets the RPC; `reload` passes the config on to the others. It answers once the models new to
        the config are AVAILABLE in this worker, as TF Serving's does, so that a client may use them at once; the
        wait ends with the call (its deadline, the client cancelling it), never later."""
        self.reload(request.config, deadline_of(context), lambda: not context.is_active())
        return model_management_pb2.ReloadConfigResponse()
