"""TensorFlow's profiler service (tensorflow.ProfilerService) on the gRPC port, as TF Serving serves it with
--enable_profiler: `tf.profiler.experimental.client.trace` and TensorBoard's profile plugin (Capture Profile) call
its Profile method with the gRPC address, and the worker that takes the call traces its own TensorFlow for the
duration asked, saving the trace into the client's log folder (docs/protocols.md, "Profiling").

The call passes the gate like any other: its token (with --auth_token_file, the admin role: a trace writes files
where the client says), the memory budget (the trace is charged to it before it is answered), the deadline (a call
cancelled or past its deadline ends its trace and answers nothing), TLS. Terminate ends a running trace early, as
TensorFlow's; Monitor and the continuous-profiling methods are not served (UNIMPLEMENTED; TensorFlow's own server
answers Monitor so too).

The wheels ship none of the service's messages, so those the two methods need are declared here with TensorFlow's
field numbers (tsl/profiler/protobuf/profiler_service.proto), over TensorFlow's own ProfileOptions; fields left out
are kept as unknown fields and ignored, as `tool_options` and `max_events` are by TensorFlow's server.
"""
from __future__ import annotations

import threading
import time
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from tensorflow.tsl.profiler.protobuf import profiler_options_pb2

from serving.core import DataPlane, Profiler, has_events, save_trace, trace_path
from serving.protocols.grpc_api.common import CALL_HOLD, rpc

SERVICE = "tensorflow.ProfilerService"
METHODS = frozenset({f"/{SERVICE}/Profile", f"/{SERVICE}/Terminate"})
POLL_S = 0.25  # how often a trace looks whether the worker drains


def _declare() -> tuple[Any, Any, Any, Any]:
    field = descriptor_pb2.FieldDescriptorProto
    file = descriptor_pb2.FileDescriptorProto(name="petal/profiler_service.proto", package="petal.profiler",
                                              syntax="proto3", dependency=[profiler_options_pb2.DESCRIPTOR.name])

    def add(message: str, *fields: tuple[str, int, int, str]) -> None:
        declared = file.message_type.add(name=message)
        for name, number, kind, type_name in fields:
            added = declared.field.add(name=name, number=number, type=kind, label=field.LABEL_OPTIONAL)
            if type_name:
                added.type_name = type_name

    add("ProfileRequest", ("duration_ms", 1, field.TYPE_UINT64, ""),
        ("opts", 4, field.TYPE_MESSAGE, ".tensorflow.ProfileOptions"), ("repository_root", 5, field.TYPE_STRING, ""),
        ("session_id", 6, field.TYPE_STRING, ""), ("host_name", 7, field.TYPE_STRING, ""),
        ("emit_xspace", 9, field.TYPE_BOOL, ""))
    add("ProfileResponse", ("empty_trace", 7, field.TYPE_BOOL, ""),
        ("xspace", 8, field.TYPE_BYTES, ""))  # an XSpace message on the wire: its bytes are the same
    add("TerminateRequest", ("session_id", 1, field.TYPE_STRING, ""))
    add("TerminateResponse")
    pool = descriptor_pool.Default()
    pool.Add(file)
    return tuple(message_factory.GetMessageClass(pool.FindMessageTypeByName(f"petal.profiler.{name}"))
                 for name in ("ProfileRequest", "ProfileResponse", "TerminateRequest", "TerminateResponse"))


ProfileRequest, ProfileResponse, TerminateRequest, TerminateResponse = _declare()


class ProfilerService:
    """The worker's Profile and Terminate methods over its `Profiler`."""

    def __init__(self, dataplane: DataPlane) -> None:
        self.dataplane = dataplane
        self.profiler = Profiler()
        self.stops: dict[str, threading.Event] = {}  # the running trace's session id: what ends it

    @rpc
    def Profile(self, request: Any, context: grpc.ServicerContext) -> Any:
        duration_ms = request.opts.duration_ms or request.duration_ms  # TensorFlow's server reads the options'
        stop = threading.Event()
        context.add_callback(stop.set)  # the call ended: cancelled, or past its deadline

        def wait(seconds: float) -> None:
            """While the trace runs (so only the running trace's id is Terminate's to end)."""
            ends = time.monotonic() + seconds
            self.stops[request.session_id] = stop
            try:
                while not self.dataplane.draining() and time.monotonic() < ends:
                    if stop.wait(min(POLL_S, max(0.0, ends - time.monotonic()))):
                        return
            finally:
                self.stops.pop(request.session_id, None)

        path = None if request.emit_xspace else trace_path(request.repository_root, request.session_id,
                                                           request.host_name)
        xspace = self.profiler.trace(duration_ms / 1000, wait)
        if not context.is_active():
            context.abort(grpc.StatusCode.CANCELLED, "The call ended before its trace did")
        hold = CALL_HOLD.get()
        if hold is not None:
            hold.grow(len(xspace))
        response = ProfileResponse(empty_trace=not has_events(xspace))
        if path is None:
            response.xspace = xspace
        else:
            save_trace(xspace, path)
        return response

    @rpc
    def Terminate(self, request: Any, context: grpc.ServicerContext) -> Any:
        stop = self.stops.get(request.session_id)
        if stop is not None:
            stop.set()
        return TerminateResponse()


def add_to_server(dataplane: DataPlane, server: grpc.Server) -> None:
    service = ProfilerService(dataplane)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
        "Profile": grpc.unary_unary_rpc_method_handler(service.Profile,
                                                       request_deserializer=ProfileRequest.FromString,
                                                       response_serializer=ProfileResponse.SerializeToString),
        "Terminate": grpc.unary_unary_rpc_method_handler(service.Terminate,
                                                         request_deserializer=TerminateRequest.FromString,
                                                         response_serializer=TerminateResponse.SerializeToString),
    }),))
