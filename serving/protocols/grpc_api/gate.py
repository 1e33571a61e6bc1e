"""The gRPC port's gate: `Gate`, a server interceptor through which every call but the probes passes, holding its
message in the worker's memory budget, asking serving/protocols/auth.py about its token and writing the access log.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from serving import threads
from serving.core import ServingError, deadline_exceeded, invalid, unavailable
from serving.memory import BODY_BYTES_FACTOR
from serving.protocols import access_log, auth
from serving.protocols.grpc_api.common import GRPC_STATUS, deadline_of

OPEN_SERVICE = "/grpc.health.v1.Health/"  # probes need no token
OPEN_METHODS = frozenset({"/inference.GRPCInferenceService/ServerLive",  # nor do V2's, as over REST
                          "/inference.GRPCInferenceService/ServerReady"})
CONTROL_METHODS = frozenset({"/tensorflow.serving.ModelService/HandleReloadConfigRequest"})  # need admin


class Received:
    """A request message as `Gate`'s deserializer leaves it: parsed and holding its share of the memory budget, or
    refused (`error`) unparsed. A call grpcio drops before its handler runs gives its share back with this object."""
    __slots__ = ("request", "hold", "error", "nbytes")

    def __init__(self, nbytes: int, request: Any = None, hold: Any = None, error: ServingError | None = None):
        self.nbytes, self.request, self.hold, self.error = nbytes, request, hold, error

    def __del__(self) -> None:
        if self.hold is not None:
            self.hold.release()


class Lease:
    """What a call holds while its message is received: a receive slot and a reservation of the budget for the
    largest message. Given back once, by whichever comes first: the deserializer, as the message is complete, or
    grpcio dropping a call whose message never came (a call cancelled before it sent one)."""
    __slots__ = ("slot", "reservation")

    def __init__(self, slot: threading.BoundedSemaphore, reservation: Any):
        self.slot: threading.BoundedSemaphore | None = slot
        self.reservation = reservation

    def release(self) -> None:
        reservation, slot, self.reservation, self.slot = self.reservation, self.slot, None, None
        if reservation is not None:
            reservation.release()
        if slot is not None:
            slot.release()

    __del__ = release


class Gate(grpc.ServerInterceptor):
    """Every unary call's message is charged to the worker's memory budget as grpcio hands it over, before it is
    parsed (BODY_BYTES_FACTOR a byte, as over REST), and held until the call ends: when the budget is full the call
    is answered UNAVAILABLE (as TF Serving answers a full batch queue: a retryable overload, not a client's quota)
    without a parsed copy ever being made. grpcio receives a unary call's message as soon as a thread takes the
    call, so at most `receivers` messages are received at a time, each under a `Lease`: a receive slot and a
    reservation of `reserve` bytes (the largest message) of the budget, so a call the budget has no room for is
    refused before its message is read. A call that finds a slot and room as it arrives is served as the unary
    call it is (`grpc.unary_unary_rpc_method_handler`, grpcio's shortest path); one that does not is served as a
    stream-unary call, which receives its message only when asked: it waits for a slot at most `receive_wait`
    seconds (--request_body_timeout, as a REST body) and is then answered UNAVAILABLE, so a client that sends
    slowly delays the others by at most that, while the others' streams are held to HTTP/2's initial window (BDP
    probing off, see server.py). Probes (grpc.health.v1, V2's ServerLive and ServerReady) pass untouched: tiny,
    open to all, and never to be refused by a busy budget. Every other call passes auth (UNAUTHENTICATED,
    PERMISSION_DENIED); with --access_log, every call leaves a line. Only unary calls are gated: TF Serving's
    services have no others, and V2's one stream (ModelStreamInfer) answers UNIMPLEMENTED."""

    def __init__(self, authenticator: auth.Authenticator, log_requests: bool, hold: Callable[[int], Any],
                 receivers: int, reserve: int, receive_wait: float) -> None:
        self.authenticator = authenticator
        self.log_requests = log_requests
        self.hold = hold  # the worker's MemoryBudget.hold
        self.receiving = threading.BoundedSemaphore(receivers)
        self.reserve = reserve
        self.receive_wait = receive_wait
        self.calls = threads.CallCount()  # a lone call runs its graph on its own thread (serving/threads.py)

    def intercept_service(self, continuation: Callable[..., Any], details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(details)
        if handler is None or handler.unary_unary is None or details.method.startswith(OPEN_SERVICE) \
                or details.method in OPEN_METHODS:
            return handler
        metadata = dict(details.invocation_metadata or ())
        needs = auth.ADMIN if details.method in CONTROL_METHODS else auth.PREDICT
        behavior, parse = handler.unary_unary, handler.request_deserializer
        leased: list[Lease] = []  # the call's lease while its message is received

        def deserialize(data: bytes) -> Received:
            """Runs as the message is complete (on grpcio's polling thread for a stream-unary call)."""
            for lease in leased:
                lease.release()
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

        def gated(received: Received, context: grpc.ServicerContext) -> Any:
            try:
                self.authenticator.check(metadata.get("authorization"), needs)
                if received.error is not None:
                    raise received.error
            except ServingError as err:
                context.abort(GRPC_STATUS[err.code], err.message)
            with received.hold, self.calls:
                return behavior(received.request, context)

        call = self.logged(gated, details.method, metadata) if self.log_requests else gated
        lease = self.lease_now()
        if lease is not None:
            leased.append(lease)
            return grpc.unary_unary_rpc_method_handler(call, request_deserializer=deserialize,
                                                       response_serializer=handler.response_serializer)

        def queued(messages: Iterator[Received], context: grpc.ServicerContext) -> Any:
            try:
                received = self.receive(messages, context, leased)
            except ServingError as err:
                received = Received(0, error=err)
            return call(received, context)

        return grpc.stream_unary_rpc_method_handler(queued, request_deserializer=deserialize,
                                                    response_serializer=handler.response_serializer)

    def lease_now(self) -> Lease | None:
        """A lease for a call as it arrives, if a slot is free and the budget has room; None otherwise."""
        if not self.receiving.acquire(blocking=False):
            return None
        try:
            return Lease(self.receiving, self.hold(self.reserve))
        except ServingError:
            self.receiving.release()
            return None

    def receive(self, messages: Iterator[Received], context: grpc.ServicerContext, leased: list[Lease]) -> Received:
        """The call's one message, received under a lease that waits for a slot (UNAVAILABLE when the budget has
        no room for the message, or no slot frees in time)."""
        remaining = threads.timeout_until(deadline_of(context))
        if not self.receiving.acquire(timeout=self.receive_wait if remaining is None else
                                      min(remaining, self.receive_wait)):
            if remaining is not None and remaining <= self.receive_wait:
                raise deadline_exceeded("Deadline exceeded waiting to receive the request")
            raise unavailable("Every receive slot is busy with other requests' messages; retry shortly")
        lease = Lease(self.receiving, None)
        try:
            lease.reservation = self.hold(self.reserve)
            leased.append(lease)
            received = next(messages, None)
        finally:
            lease.release()
        if received is None:
            raise invalid("A unary method requires exactly one request message")
        return received

    @staticmethod
    def logged(behavior: Callable[..., Any], method: str, metadata: dict[str, str]) -> Callable[..., Any]:
        request_id = access_log.request_id(metadata.get(access_log.HEADER.lower()))

        def call(received: Received, context: grpc.ServicerContext) -> Any:
            started, response = time.perf_counter(), None
            context.send_initial_metadata(((access_log.HEADER.lower(), request_id),))
            try:
                response = behavior(received, context)
                return response
            finally:
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
