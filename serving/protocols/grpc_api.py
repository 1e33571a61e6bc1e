"""TF Serving's gRPC API (PredictionService, ModelService) and grpc.health.v1 over a worker's DataPlane.

Every gunicorn worker runs one of these servers on the same port with SO_REUSEPORT, sharing that worker's
DataPlane (its loaded models and its batcher). The kernel spreads connections over the workers, so gRPC scales
with the workers exactly like REST does and no process ever holds a second copy of a model. With
--grpc_socket_path one worker's server also listens on that Unix socket (serving/protocols/unix_socket.py), with
the same TLS, tokens and limits.
`Gate`, a server interceptor, asks serving/protocols/auth.py about every call but the health service's, and
writes the access log; --ssl_config_file puts the port behind TLS.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc
import numpy as np
import tensorflow as tf
from google.protobuf import wrappers_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
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

from serving import threads
from serving.config import ProtocolOptions, SecurityOptions, TLSOptions, bind_address
from serving.core import (
    CLASSIFY_METHOD,
    REGRESS_METHOD,
    Code,
    DataPlane,
    Result,
    ServingError,
    SignatureInfo,
    Task,
    deadline_exceeded,
    invalid,
    unavailable,
)
from serving.memory import BODY_BYTES_FACTOR
from serving.protocols import access_log, auth, tensor_proto, unix_socket

log = logging.getLogger(__name__)

HEALTH_WATCH_PERIOD_S = 0.2
# Total over Code (a KeyError here at import, never a silent UNKNOWN at request time): TF's codes are gRPC's.
GRPC_STATUS = {code: grpc.StatusCode[code.name] for code in Code}
OPEN_SERVICE = "/grpc.health.v1.Health/"  # probes need no token
OPEN_METHODS = frozenset({"/inference.GRPCInferenceService/ServerLive",  # nor do V2's, as over REST
                          "/inference.GRPCInferenceService/ServerReady"})
CONTROL_METHODS = frozenset({"/tensorflow.serving.ModelService/HandleReloadConfigRequest"})  # need admin


def parse_channel_arguments(text: str) -> list[tuple[str, int | str]]:
    """Parse tensorflow_model_server's --grpc_channel_arguments ("k=v,k=v"); integers stay integers."""
    options: list[tuple[str, int | str]] = []
    for item in filter(None, (part.strip() for part in (text or "").split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--grpc_channel_arguments: expected key=value, got {item!r}")
        value = value.strip()
        options.append((key.strip(), int(value) if value.lstrip("-").isdigit() else value))
    return options


def typed_inputs(protos: Any, arrays: dict[str, np.ndarray]) -> Callable[[SignatureInfo], dict[str, np.ndarray]]:
    """Predict's decoded tensors (`arrays`) for a signature. A TensorProto carries its dtype, and one that is not
    the signature's is refused with the text of the Session that TF Serving feeds it to (a float64 numpy array
    sent for a float input, say), never cast as a JSON number is: position i counts the signature's inputs in
    name order, as serving/core/loaders.py feeds them."""
    def inputs(info: SignatureInfo) -> dict[str, np.ndarray]:
        for i, name in enumerate(sorted(info.inputs)):
            # decode_inputs has refused every dtype Petal does not serve, so each one here is a Kind
            have = tensor_proto.KINDS[protos[name].dtype].name if name in protos else info.inputs[name].dtype
            if have != info.inputs[name].dtype:
                raise invalid(f"Expects arg[{i}] to be {_dtype_string(info.inputs[name].dtype)} but "
                              f"{_dtype_string(have)} is provided")
        return arrays
    return inputs


def _dtype_string(name: str) -> str:
    """TensorFlow's DataTypeString: DT_FLOAT is "float", DT_INT64 "int64"."""
    return name.removeprefix("DT_").lower()


def to_tensor_proto(array: np.ndarray) -> Any:
    return tf.make_tensor_proto(array)


def model_spec_fields(spec: model_pb2.ModelSpec) -> dict[str, Any]:
    """The version/label selection of a ModelSpec as DataPlane keyword arguments."""
    if not spec.name:
        raise invalid("ModelSpec has no name specified.")  # server_core.cc ServableRequestFromModelSpec
    return {"model": spec.name,
            "version": spec.version.value if spec.HasField("version") else None,
            "label": spec.version_label or None}


def deadline_of(context: grpc.ServicerContext) -> float | None:
    """The call's deadline in time.monotonic() seconds; None without one, or with one so far off that it is none
    (a client such as Triton's perf_analyzer sets years)."""
    remaining = context.time_remaining()
    return None if remaining is None or remaining > threads.FAR_DEADLINE_S else time.monotonic() + remaining


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


def rpc(method: Callable[..., Any]) -> Callable[..., Any]:
    """Turn ServingError into its gRPC status, and anything unexpected into INTERNAL with a log line. (The request
    holds its share of the memory budget from before it was parsed: `Gate`.)"""
    def handler(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return method(self, request, context)
        except ServingError as err:
            context.abort(GRPC_STATUS[err.code], err.message)
        except Exception as exc:
            log.exception("gRPC handler failed", extra={"fields": {"method": method.__name__}})
            context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")
    handler.__name__ = method.__name__
    handler.__doc__ = method.__doc__
    return handler


class PredictionService(prediction_service_pb2_grpc.PredictionServiceServicer):
    def __init__(self, core: DataPlane, max_message_bytes: int) -> None:
        self.core = core
        self.max_message_bytes = max_message_bytes

    @rpc
    def Predict(self, request: predict_pb2.PredictRequest, context: grpc.ServicerContext) -> Any:
        arrays = tensor_proto.decode_inputs(request.inputs, self.max_message_bytes)
        result = self.core.predict(inputs=typed_inputs(request.inputs, arrays),
                                   signature_name=request.model_spec.signature_name,
                                   output_filter=list(request.output_filter) or None,
                                   deadline=deadline_of(context), entrypoint="GRPC",
                                   **model_spec_fields(request.model_spec))
        response = predict_pb2.PredictResponse(
            model_spec=resolved_spec(result.model, result.version, result.signature_name))
        for name, array in result.outputs.items():
            response.outputs[name].CopyFrom(to_tensor_proto(array))
        return response

    @rpc
    def Classify(self, request: classification_pb2.ClassificationRequest, context: grpc.ServicerContext) -> Any:
        result = self.infer(request.model_spec, [Task(CLASSIFY_METHOD, request.model_spec.signature_name)],
                            request.input, context, "classify")[0]
        return classification_pb2.ClassificationResponse(model_spec=result.model_spec,
                                                         result=result.classification_result)

    @rpc
    def Regress(self, request: regression_pb2.RegressionRequest, context: grpc.ServicerContext) -> Any:
        result = self.infer(request.model_spec, [Task(REGRESS_METHOD, request.model_spec.signature_name)],
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
            results=self.infer(spec, tasks, request.input, context, "multi_inference"))

    def infer(self, spec: model_pb2.ModelSpec, tasks: list[Task], request_input: Any, context: grpc.ServicerContext,
              api: str) -> list[inference_pb2.InferenceResult]:
        fields = model_spec_fields(spec)
        version, results = self.core.infer(fields["model"], tasks, request_input, fields["version"],
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
        version, signatures = self.core.signatures(spec["model"], spec["version"], spec["label"])
        sig_map = get_model_metadata_pb2.SignatureDefMap(
            signature_def={name: signature_def(info) for name, info in signatures.items()})
        response = get_model_metadata_pb2.GetModelMetadataResponse(
            model_spec=resolved_spec(spec["model"], version, ""))
        response.metadata["signature_def"].Pack(sig_map)
        return response


class ModelService(model_service_pb2_grpc.ModelServiceServicer):
    def __init__(self, core: DataPlane) -> None:
        self.core = core

    @rpc
    def GetModelStatus(self, request: get_model_status_pb2.GetModelStatusRequest,
                       context: grpc.ServicerContext) -> Any:
        spec = model_spec_fields(request.model_spec)
        response = get_model_status_pb2.GetModelStatusResponse()
        for status in self.core.status(spec["model"], spec["version"], spec["label"]):
            entry = response.model_version_status.add(
                version=status.version, state=get_model_status_pb2.ModelVersionStatus.State.Value(status.state))
            entry.status.error_code = error_codes_pb2.Code.Value(status.error_code or "OK")
            entry.status.error_message = status.error_message
        return response

    @rpc
    def HandleReloadConfigRequest(self, request: model_management_pb2.ReloadConfigRequest,
                                  context: grpc.ServicerContext) -> Any:
        """One worker gets the RPC; the core passes the config on to the others (serving/worker.py)."""
        self.core.reload_config(request.config)
        return model_management_pb2.ReloadConfigResponse()


class HealthService(health_pb2_grpc.HealthServicer):
    """grpc.health.v1 read live from the DataPlane, so it turns NOT_SERVING the moment shutdown begins.

    Service "" is the whole server; a model name is that model. Watch streams end after reporting
    NOT_SERVING for a shutdown, so that they do not keep the worker alive through its grace period.
    """

    def __init__(self, core: DataPlane) -> None:
        self.core = core

    def serving_status(self, service: str) -> int | None:
        if not service:
            ready = self.core.ready()
        elif service in self.core.model_names():
            ready = self.core.model_ready(service)
        else:
            return None
        return health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING

    def Check(self, request: health_pb2.HealthCheckRequest, context: grpc.ServicerContext) -> Any:
        status = self.serving_status(request.service)
        if status is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"Unknown service: {request.service}")
        return health_pb2.HealthCheckResponse(status=status)

    def Watch(self, request: health_pb2.HealthCheckRequest, context: grpc.ServicerContext) -> Iterator[Any]:
        last = None
        while context.is_active():
            ending = self.core.draining()  # read before the status, so a status read after it is NOT_SERVING
            status = self.serving_status(request.service)
            status = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN if status is None else status
            if status != last:
                last = status
                yield health_pb2.HealthCheckResponse(status=status)
            if ending:
                return  # NOT_SERVING was sent; an open stream must not hold the graceful shutdown up
            time.sleep(HEALTH_WATCH_PERIOD_S)


class Received:
    """A request message as `Gate`'s deserializer leaves it: parsed and holding its share of the memory budget, or
    refused (`error`) unparsed. A call grpcio drops before its handler runs gives its share back with this object."""
    __slots__ = ("request", "hold", "error", "nbytes")

    def __init__(self, nbytes: int, request: Any = None, hold: Any = None, error: ServingError | None = None):
        self.nbytes, self.request, self.hold, self.error = nbytes, request, hold, error

    def __del__(self) -> None:
        if self.hold is not None:
            self.hold.release()


class Gate(grpc.ServerInterceptor):
    """Every unary call's message is charged to the worker's memory budget as grpcio hands it over, before it is
    parsed (BODY_BYTES_FACTOR a byte, as over REST), and held until the call ends: when the budget is full the call
    is answered UNAVAILABLE (as TF Serving answers a full batch queue: a retryable overload, not a client's quota)
    without a parsed copy ever being made. grpcio would receive every call's message at once, each in full, before
    any of them could be refused, so unary calls are served as stream-unary ones, which receive their message only
    when asked: at most `receivers` messages are being received at a time (the others wait, their streams held to
    HTTP/2's initial window with BDP probing off, see `start`), and each receive first reserves `reserve` bytes (the
    largest message) of the budget, so a call the budget has no room for is refused before its message is read. A
    call waits for a slot at most `receive_wait` seconds (--request_body_timeout, as a REST body) and is then
    answered UNAVAILABLE, so a client that sends slowly delays the others by at most that. Probes (grpc.health.v1,
    V2's ServerLive and ServerReady) pass untouched: tiny, open to all, and never to be refused by a busy budget.
    Every other call passes auth (UNAUTHENTICATED, PERMISSION_DENIED); with --access_log, every call leaves a line.
    Only unary calls are gated: TF Serving's services have no others, and V2's one stream (ModelStreamInfer)
    answers UNIMPLEMENTED."""

    def __init__(self, authenticator: auth.Authenticator, log_requests: bool, hold: Callable[[int], Any],
                 receivers: int, reserve: int, receive_wait: float) -> None:
        self.authenticator = authenticator
        self.log_requests = log_requests
        self.hold = hold  # the worker's MemoryBudget.hold
        self.receiving = threading.BoundedSemaphore(receivers)
        self.reserve = reserve
        self.receive_wait = receive_wait

    def intercept_service(self, continuation: Callable[..., Any], details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(details)
        if handler is None or handler.unary_unary is None or details.method.startswith(OPEN_SERVICE) \
                or details.method in OPEN_METHODS:
            return handler
        metadata = dict(details.invocation_metadata or ())
        needs = auth.ADMIN if details.method in CONTROL_METHODS else auth.PREDICT
        behavior, parse = handler.unary_unary, handler.request_deserializer
        reserved: list[Any] = []  # this call's reservation while it receives, replaced by its hold once received

        def deserialize(data: bytes) -> Received:
            """Runs on grpcio's one polling thread, as each message is complete."""
            for reservation in reserved:
                reservation.release()
            try:
                hold = self.hold(len(data) * BODY_BYTES_FACTOR)
            except ServingError as err:
                return Received(len(data), error=err)
            try:
                return Received(len(data), parse(data), hold)
            except Exception as exc:  # bytes that are not the method's message: the client's fault, never INTERNAL
                hold.release()
                return Received(len(data), error=invalid(f"The request is not a valid message for this method: "
                                                         f"{type(exc).__name__}"))
            except BaseException:
                hold.release()
                raise

        def gated(messages: Iterator[Received], context: grpc.ServicerContext) -> Any:
            try:
                received = self.receive(messages, context, reserved)
                self.authenticator.check(metadata.get("authorization"), needs)
                if received.error is not None:
                    raise received.error
            except ServingError as err:
                context.abort(GRPC_STATUS[err.code], err.message)
            with received.hold:
                return behavior(received.request, context)

        call = self.logged(gated, details.method, metadata) if self.log_requests else gated
        return grpc.stream_unary_rpc_method_handler(call, request_deserializer=deserialize,
                                                    response_serializer=handler.response_serializer)

    def receive(self, messages: Iterator[Received], context: grpc.ServicerContext, reserved: list[Any]) -> Received:
        """The call's one message, received while holding one of the `receivers` slots and a reservation (which the
        deserializer gives back before it charges the message; UNAVAILABLE when the budget has no room for it)."""
        remaining = threads.timeout_until(deadline_of(context))
        if not self.receiving.acquire(timeout=self.receive_wait if remaining is None else
                                      min(remaining, self.receive_wait)):
            if remaining is not None and remaining <= self.receive_wait:
                raise deadline_exceeded("Deadline exceeded waiting to receive the request")
            raise unavailable("Every receive slot is busy with other requests' messages; retry shortly")
        try:
            reserved.append(self.hold(self.reserve))
            received = next(messages, None)
        finally:
            for reservation in reserved:
                reservation.release()
            self.receiving.release()
        if received is None:
            raise invalid("A unary method requires exactly one request message")
        return received

    @staticmethod
    def logged(behavior: Callable[..., Any], method: str, metadata: dict[str, str]) -> Callable[..., Any]:
        request_id = access_log.request_id(metadata.get(access_log.HEADER.lower()))

        def call(messages: Iterator[Received], context: grpc.ServicerContext) -> Any:
            started, response, seen = time.perf_counter(), None, []

            def noted() -> Iterator[Received]:
                for message in messages:
                    seen.append(message)
                    yield message
            context.send_initial_metadata(((access_log.HEADER.lower(), request_id),))
            try:
                response = behavior(noted(), context)
                return response
            finally:
                received = seen[0] if seen else Received(0)  # none came: the call failed before its message
                request = received.request
                spec = getattr(request, "model_spec", None)
                version = spec.version.value if spec is not None and spec.HasField("version") else None
                model = spec.name if spec is not None else getattr(request, "model_name", None)  # V2 names it so
                version = version or (spec.version_label if spec is not None
                                      else getattr(request, "model_version", None))
                access_log.write(request_id=request_id, protocol="grpc", method="POST", path=method,
                                 model=model or None, version=version or None,
                                 status=(context.code() or grpc.StatusCode.OK).name, bytes_in=received.nbytes,
                                 bytes_out=response.ByteSize() if response is not None else 0,
                                 remote=context.peer(), latency_ms=round(1000 * (time.perf_counter() - started), 3))
        return call


def receivers(body_limit: int, o: ProtocolOptions) -> int:
    """How many messages a worker receives at once: as many of the largest as half its budget's body share holds
    (at least one), so that receiving leaves the other half to the requests being served; without a budget, one a
    gRPC thread."""
    return max(1, body_limit // (2 * o.grpc_max_message_bytes)) if body_limit > 0 else o.grpc_max_threads


def server_credentials(tls: TLSOptions) -> grpc.ServerCredentials:
    """TF Serving's SSLConfig as gRPC credentials: with client_verify, a client without a certificate signed by
    custom_ca fails the handshake."""
    return grpc.ssl_server_credentials([(tls.server_key.encode(), tls.server_cert.encode())],
                                       root_certificates=tls.custom_ca.encode() or None,
                                       require_client_auth=tls.client_verify)


def start(core: DataPlane, protocols: ProtocolOptions, security: SecurityOptions,
          runtime_dir: str) -> grpc.Server | None:
    """Start the gRPC server on --host:--port (shared with sibling workers through SO_REUSEPORT) and on
    --grpc_socket_path if this worker serves it (`runtime_dir`: the server's private folder, where its workers
    decide which); None when it has neither to serve."""
    addresses = [bind_address(protocols.host, protocols.port)] if protocols.port else []
    binding = unix_socket.claim(protocols.grpc_socket_path, runtime_dir) if protocols.grpc_socket_path else None
    if binding is not None:
        addresses.append(binding.address)
    if not addresses:
        return None
    max_message = protocols.grpc_max_message_bytes
    options: list[tuple[str, int | str]] = [("grpc.so_reuseport", 1), ("grpc.http2.bdp_probe", 0),
                                            ("grpc.max_receive_message_length", max_message),
                                            ("grpc.max_send_message_length", max_message)]
    options += parse_channel_arguments(protocols.grpc_channel_arguments)
    if protocols.access_log:
        access_log.enable()
    gate = Gate(auth.Authenticator(security.tokens, security.enable_model_control), protocols.access_log,
                core.memory.hold, receivers(core.memory.body_limit, protocols),
                min(max_message, core.memory.body_limit), protocols.request_body_timeout)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=protocols.grpc_max_threads, thread_name_prefix="grpc"),
                         options=options, interceptors=[gate])
    prediction_service_pb2_grpc.add_PredictionServiceServicer_to_server(PredictionService(core, max_message), server)
    model_service_pb2_grpc.add_ModelServiceServicer_to_server(ModelService(core), server)
    health_pb2_grpc.add_HealthServicer_to_server(HealthService(core), server)
    from serving.protocols import kserve_grpc  # imported here: it builds on this module's rpc and deadline_of
    kserve_grpc.add_to_server(core, server, max_message)
    for address in addresses:
        try:
            bound = (server.add_secure_port(address, server_credentials(security.tls)) if security.tls else
                     server.add_insecure_port(address))
        except RuntimeError as exc:
            raise OSError(f"cannot bind gRPC to {address}: {exc}") from exc
        if not bound:
            raise OSError(f"cannot bind gRPC to {address}")
    server.start()
    if binding is not None:
        binding.publish()
    log.info("gRPC server started", extra={"fields": {"addresses": addresses, "tls": bool(security.tls),
                                                      "max_message_bytes": max_message}})
    return server
