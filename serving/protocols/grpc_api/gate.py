"""The gRPC port's gate: `Gate`, a server interceptor through which every call but the probes passes, asking
serving/protocols/auth.py about its token before anything of its message is read, holding its message in the
worker's memory budget, ending a call whose message does not arrive in time, and writing the access log.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc

from serving import threads
from serving.config import MIN_BODY_RATE
from serving.core import ServingError, deadline_exceeded, invalid, unavailable
from serving.memory import BODY_BYTES_FACTOR
from serving.protocols import access_log, auth
from serving.protocols.grpc_api.common import CALL_HOLD, GRPC_STATUS, deadline_of

log = logging.getLogger(__name__)

OPEN_SERVICE = "/grpc.health.v1.Health/"  # probes need no token
OPEN_METHODS = frozenset({"/inference.GRPCInferenceService/ServerLive",  # nor do V2's, as over REST
                          "/inference.GRPCInferenceService/ServerReady"})
CONTROL_METHODS = frozenset({"/tensorflow.serving.ModelService/HandleReloadConfigRequest"})  # need admin
PROFILE_SERVICE = "/tensorflow.ProfilerService/"  # auth.PROFILE: admin's once tokens are asked for
# A call whose message is late ends as one past its deadline does (REST answers 408 Request Timeout).
LATE = grpc.StatusCode.DEADLINE_EXCEEDED
IDLE_WAKE_S = 1.0  # the watchdog's sleep while it watches nothing


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
    largest message. Given back once, by whichever comes first: the deserializer, as the message is complete; the
    `Watchdog`, as the message is late (`late`); the thread that served the call, as it ends; or grpcio dropping a
    call whose message never came (a call cancelled before it sent one).

    An answer grpcio has taken and the client not yet read is held as a lease without a slot (`Gate.sending`)."""
    __slots__ = ("slot", "reservation", "held", "deadline", "end", "late", "watchdog")

    def __init__(self, slot: threading.BoundedSemaphore | None, reservation: Any):
        self.slot, self.reservation = slot, reservation
        self.held = [True]  # popped by whoever gives the lease back: list.pop is atomic, so that happens once
        self.deadline = math.inf  # while watched: when its message is late, and `end` ends the call
        self.end: Callable[[], Any] | None = None
        self.late = False
        self.watchdog: Watchdog | None = None

    def release(self) -> bool:
        """Give the slot and the reservation back unless that is done; True if this call did it."""
        if not self.held:
            return False
        try:
            self.held.pop()
        except IndexError:  # another thread gave it back in between
            return False
        self.end = None
        if self.watchdog is not None:
            self.watchdog.leases.pop(self, None)
        if self.reservation is not None:
            self.reservation.release()
        if self.slot is not None:
            self.slot.release()
        return True

    def __del__(self) -> None:
        self.release()


class Watchdog:
    """One thread that gives back the leases of calls whose message is late, or whose answer is not read in time,
    and ends those calls: past a watched lease's deadline the lease goes back (its slot passes at once to a call
    waiting for one) and its `end` ends the call. The thread sleeps until the earliest deadline, or while nothing
    is watched for IDLE_WAKE_S; it starts with the first lease watched."""

    def __init__(self) -> None:
        self.leases: dict[Lease, None] = {}  # the leases watched; one given back leaves at once
        self.wakeup = threading.Condition(threading.Lock())
        self.wake_at = math.inf
        self.thread: threading.Thread | None = None

    def watch(self, lease: Lease, deadline: float, end: Callable[[], Any] | None) -> None:
        lease.deadline, lease.end, lease.watchdog = deadline, end, self
        with self.wakeup:
            if not lease.held:
                return
            self.leases[lease] = None
            if deadline < self.wake_at:  # sooner than the thread means to wake (never, when idle)
                self.wake_at = deadline
                if self.thread is None:
                    self.thread = threading.Thread(target=self.run, name="grpc-receive-watchdog", daemon=True)
                    self.thread.start()
                self.wakeup.notify()

    def run(self) -> None:
        while True:
            with self.wakeup:
                now = time.monotonic()
                watched = list(self.leases)
                due = [lease for lease in watched if lease.deadline <= now]
                for lease in due:
                    self.leases.pop(lease, None)
                if not due:
                    # idle, it still wakes now and then: a lease watched meanwhile whose deadline is later than
                    # that (every call's answer is) needs no wakeup of its own, which cost a call 10% more CPU
                    self.wake_at = min((lease.deadline for lease in watched), default=now + IDLE_WAKE_S)
                    self.wakeup.wait(self.wake_at - now)
                    continue
            for lease in due:
                end = lease.end
                if lease.release():  # not complete: the message is late
                    lease.late = True
                    if end is not None:
                        try:
                            end()
                        except Exception:
                            log.exception("could not end a gRPC call whose message is late")


class Starter(futures.ThreadPoolExecutor):
    """How the gate learns the call behind its handler, to end it when its message is late: grpcio runs a method on
    the method's own `experimental_thread_pool` when it has one, handing that pool its call event. This pool runs
    nothing itself. A call leased as it arrived (`receive_first`) has its message asked for at once, on grpcio's
    polling thread, and goes to the server's pool only once the message is in: grpcio's own way has a pool thread
    ask for it and sleep until the polling thread hands it over (3 to 7 more thread switches a call, measured in
    docs/performance.md, 'gRPC's message received before a thread takes the call'). Any other call
    (one that waits for a receive slot) goes to the server's pool at once, and asks for its message there. Either
    way the call and the time are noted as its message is asked for, the lease taken as the call arrived is
    watched from then, and once the call is served a lease still held (its message never came) is given back.
    Without the call (a grpcio that no longer hands it over, or whose polling internals `_receiving` does not
    know) a late call's lease still goes back, its message is asked for on the pool thread as before, and a call
    waiting for a slot is cancelled through its context."""

    def __init__(self, gate: Gate, leased: list[Lease], logged: Logged | None,
                 receive_first: bool = False) -> None:  # a pool without threads
        self.gate, self.leased, self.logged, self.receive_first = gate, leased, logged, receive_first
        self.call: Any = None  # grpcio's call (cygrpc.Call), whose cancel() can end it with a status
        self.context: grpc.ServicerContext | None = None  # a waiting call's, once it runs
        self.started = time.monotonic()
        self.late = False

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> futures.Future[Any]:
        pool = self.gate.pool
        assert pool is not None
        if not self.receive_first or _RECEIVE is None or len(args) != 7:
            return pool.submit(self.run, fn, args, kwargs, True)
        self.begin(args)
        served: futures.Future[Any] = futures.Future()
        served.set_running_or_notify_cancel()

        def run(request: Callable[[], Any]) -> None:
            """On the polling thread, as the message is in: the call goes to a pool thread with it."""
            try:
                done = pool.submit(self.run, fn, (*args[:4], request, *args[5:]), kwargs, False)
            except RuntimeError as error:  # the server is stopping: its pool takes nothing more
                served.set_exception(error)
                return
            done.add_done_callback(lambda ran: _settle(served, ran))
        _receiving(args[1], args[2], args[5], run)
        return served

    def begin(self, args: tuple[Any, ...]) -> None:
        """Note the call and the time as its message is asked for, and watch the lease taken as it arrived."""
        self.started = time.monotonic()
        self.call = next((event.call for event in args if hasattr(getattr(event, "call", None), "cancel")), None)
        for lease in self.leased:
            self.gate.watchdog.watch(lease, self.started + self.gate.receive_wait, self.end)

    def run(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], begin: bool) -> Any:
        if begin:
            self.begin(args)
        try:
            return fn(*args, **kwargs)
        finally:
            for lease in self.leased:
                lease.release()
            if self.late and self.logged is not None:
                self.logged.late(self.call, self.started)

    def end(self) -> None:
        """End the call whose message is late, as a call past its deadline ends."""
        self.late = True
        if self.call is not None:
            self.call.cancel(LATE.value[0], self.gate.late_details)
        elif self.context is not None:
            self.context.cancel()


def _settle(served: futures.Future[Any], ran: futures.Future[Any]) -> None:
    """End the future grpcio was given for a call once its pool thread is done: grpcio counts the call against
    --grpc_max_threads' bound (server.max_calls) until then."""
    error = ran.exception()
    if error is None:
        served.set_result(ran.result())
    else:
        served.set_exception(error)


def _grpcio_receiving() -> Any:
    """grpcio's sync server's own pieces for receiving a unary call's message (grpc/_server.py, private), or None
    where they are not what `_receiving` expects."""
    try:
        from grpc import _server
        from grpc._cython import cygrpc

        return (_server._receive_message, _server._abort, _server._RECEIVE_MESSAGE_TOKEN,
                cygrpc.ReceiveMessageOperation, cygrpc.StatusCode.unimplemented, _server._CLOSED, _server._CANCELLED)
    except (ImportError, AttributeError):
        return None


_RECEIVE = _grpcio_receiving()


def _receiving(event: Any, state: Any, deserializer: Callable[[bytes], Any], then: Callable[[Callable[[], Any]], None]
               ) -> None:
    """Ask for a unary call's message as grpcio's pool thread would (grpc/_server.py's `_unary_request`), but from the
    polling thread that holds the call, and call `then` there once it is in, with what grpcio's thread would have
    returned: the request, or None for a call cancelled or closed without one (answered as grpcio answers it)."""
    assert _RECEIVE is not None
    receive_message, abort, token, operation, unimplemented, closed, cancelled = _RECEIVE
    call = event.call
    received = receive_message(state, call, deserializer)

    def request() -> Any:
        with state.condition:
            message, state.request = state.request, None
            if message is None and state.client is closed and not state.statused:
                abort(state, call, unimplemented,
                      f'"{event.call_details.method}" requires exactly one request message.'.encode())
            return message

    def arrived(completion: Any) -> Any:
        finished = received(completion)
        then(request)
        return finished

    with state.condition:
        if state.client is cancelled or state.statused:
            then(lambda: None)
            return
        call.start_server_batch((operation(0),), arrived)
        state.due.add(token)


class Method:
    """A gated method as grpcio calls it, run through its `Starter`."""
    __slots__ = ("behavior", "experimental_thread_pool")

    def __init__(self, behavior: Callable[..., Any], starter: Starter) -> None:
        self.behavior, self.experimental_thread_pool = behavior, starter

    def __call__(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self.behavior(request, context)


class Gate(grpc.ServerInterceptor):
    """Every call but the probes passes auth as it arrives, on its metadata alone: one without a valid token
    (UNAUTHENTICATED) or the role it needs (PERMISSION_DENIED) is answered before anything of its message is
    received or charged. Every unary call's message is charged to the worker's memory budget as grpcio hands it
    over, before it is parsed (BODY_BYTES_FACTOR a byte, as over REST), and held until the call ends: when the
    budget is full the call is answered UNAVAILABLE (as TF Serving answers a full batch queue: a retryable overload,
    not a client's quota) without a parsed copy ever being made. A unary call's message is received as soon as the
    call arrives (`Starter`, on grpcio's polling thread), so at most `receivers` messages are received at a time,
    each under a `Lease`: a receive slot and a reservation of `reserve` bytes (the largest message) of the budget,
    so a call the budget has no room for is refused before its message is read. A call that finds a slot and room as
    it arrives is served as the unary call it is (`grpc.unary_unary_rpc_method_handler`, grpcio's shortest path);
    one that does not is served as a stream-unary call, which receives its message only when asked: it waits for a
    slot and is answered UNAVAILABLE if none frees in time, while the others' streams are held to HTTP/2's initial
    window (BDP probing off, see server.py). Either way a call's message must be complete within `receive_wait`
    seconds (--request_body_timeout, as a REST body's) of its being asked for, waiting for a slot included: past
    that the `Watchdog` gives its lease back, so the slot passes at once to a call waiting for one, and ends the
    call DEADLINE_EXCEEDED (learning the call through `Starter`, given the server's `pool`). A client that sends
    slowly or stalls thus delays the others by at most that. Probes (grpc.health.v1, V2's ServerLive and
    ServerReady) pass untouched: tiny, open to all, and never to be refused by a busy budget. With --access_log,
    every call leaves a line. Only unary calls are gated: TF Serving's services have no others, and V2's one stream
    (ModelStreamInfer), which answers UNIMPLEMENTED, has its token checked alone."""

    def __init__(self, authenticator: auth.Authenticator, log_requests: bool, hold: Callable[[int], Any],
                 receivers: int, reserve: int, receive_wait: float, pool: futures.ThreadPoolExecutor | None = None
                 ) -> None:
        self.authenticator = authenticator
        self.log_requests = log_requests
        self.hold = hold  # the worker's MemoryBudget.hold
        self.receiving = threading.BoundedSemaphore(receivers)
        self.reserve = reserve
        self.receive_wait = receive_wait
        self.late_details = (f"The request message did not arrive in time: it must be complete within "
                             f"--request_body_timeout ({receive_wait:g} s) of the call's start")
        self.pool = pool  # the server's: the gate's calls run there through their Starter
        self.watchdog = Watchdog()
        self.calls = threads.CallCount()  # a lone call runs its graph on its own thread (serving/threads.py)

    def refusal(self, method: str, metadata: dict[str, str]) -> ServingError | None:
        """Why the call's token does not allow it (UNAUTHENTICATED, PERMISSION_DENIED), or None."""
        try:
            self.authenticator.check(metadata.get("authorization"),
                                     auth.ADMIN if method in CONTROL_METHODS else
                                     auth.PROFILE if method.startswith(PROFILE_SERVICE) else auth.PREDICT)
        except ServingError as err:
            return err
        return None

    def intercept_service(self, continuation: Callable[..., Any], details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(details)
        if handler is None or details.method.startswith(OPEN_SERVICE) or details.method in OPEN_METHODS:
            return handler
        metadata = dict(details.invocation_metadata or ())
        if handler.unary_unary is None:  # a stream (V2's ModelStreamInfer): it answers itself, once its token passes
            refusal = self.refusal(details.method, metadata)
            if refusal is None:
                return handler
            return grpc.stream_unary_rpc_method_handler(
                lambda _messages, context: context.abort(GRPC_STATUS[refusal.code], refusal.message),
                response_serializer=handler.response_serializer)
        behavior, parse = handler.unary_unary, handler.request_deserializer
        leased: list[Lease] = []  # the call's lease while its message is received

        def deserialize(data: bytes) -> Received:
            """Runs as the message is complete (on grpcio's polling thread)."""
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
            if received.error is not None:
                context.abort(GRPC_STATUS[received.error.code], received.error.message)
            with received.hold, self.calls:
                call_hold = CALL_HOLD.set(received.hold)
                try:
                    response = behavior(received.request, context)
                finally:
                    CALL_HOLD.reset(call_hold)
            self.sending(response, context)
            return response

        logged = Logged(gated, details.method, metadata) if self.log_requests else None
        call: Callable[[Received, grpc.ServicerContext], Any] = gated if logged is None else logged
        refusal = self.refusal(details.method, metadata)
        if refusal is not None:  # answered without asking for the message: none of it is received
            refused = Received(0, error=refusal)
            return grpc.stream_unary_rpc_method_handler(lambda _messages, context: call(refused, context),
                                                        response_serializer=handler.response_serializer)
        lease = self.lease_now()
        if lease is not None:
            leased.append(lease)
            first = Starter(self, leased, logged, receive_first=True) if self.pool is not None else None
            return grpc.unary_unary_rpc_method_handler(call if first is None else Method(call, first),
                                                       request_deserializer=deserialize,
                                                       response_serializer=handler.response_serializer)
        starter = Starter(self, leased, logged) if self.pool is not None else None

        def queued(messages: Iterator[Received], context: grpc.ServicerContext) -> Any:
            try:
                received = self.receive(messages, context, leased, starter)
            except ServingError as err:
                received = Received(0, error=err)
            return call(received, context)

        return grpc.stream_unary_rpc_method_handler(queued if starter is None else Method(queued, starter),
                                                    request_deserializer=deserialize,
                                                    response_serializer=handler.response_serializer)

    def sending(self, response: Any, context: grpc.ServicerContext) -> None:
        """Hold an answer in the budget until the client has read it, and no longer than a REST answer may take.

        grpcio queues a unary call's answer in its core as the method returns and sends it as the client's HTTP/2
        windows open: a client that opens many calls and reads none kept every answer, unbounded by the budget or
        any deadline (three connections of 64 such calls grew a worker by 2.4 GiB). The answer's bytes are held
        (BODY_BYTES_FACTOR each, its serialized copy and more) until the call ends, so a full budget refuses new
        calls rather than outgrowing memory; one the budget has no room for is refused as a request would be.
        Past --request_body_timeout plus a second for every 64 KiB of it (serving/gevent_worker.py's deadline for
        a REST answer), the watchdog cancels the call, which frees what grpcio queued."""
        size = response.ByteSize()
        try:
            lease = Lease(None, self.hold(size * BODY_BYTES_FACTOR))
        except ServingError as err:
            context.abort(GRPC_STATUS[err.code], err.message)
        if not context.add_callback(lease.release):  # the call has already ended
            lease.release()
            return
        self.watchdog.watch(lease, time.monotonic() + self.receive_wait + size / MIN_BODY_RATE, context.cancel)

    def lease_now(self) -> Lease | None:
        """A lease for a call as it arrives, if a slot is free and the budget has room; None otherwise."""
        if not self.receiving.acquire(blocking=False):
            return None
        try:
            return Lease(self.receiving, self.hold(self.reserve))
        except ServingError:
            self.receiving.release()
            return None

    def receive(self, messages: Iterator[Received], context: grpc.ServicerContext, leased: list[Lease],
                starter: Starter | None) -> Received:
        """The call's one message, received under a lease that waits for a slot: UNAVAILABLE when the budget has
        no room for the message or no slot frees in time, DEADLINE_EXCEEDED when the message is late."""
        started = time.monotonic() if starter is None else starter.started
        late_at = started + self.receive_wait
        remaining = threads.timeout_until(deadline_of(context))
        wait = max(0.0, late_at - time.monotonic())
        if not self.receiving.acquire(timeout=wait if remaining is None else min(remaining, wait)):
            if remaining is not None and remaining <= wait:
                raise deadline_exceeded("Deadline exceeded waiting to receive the request")
            raise unavailable("Every receive slot is busy with other requests' messages; retry shortly")
        lease = Lease(self.receiving, None)
        try:
            if time.monotonic() >= late_at:  # a slot came, but no time to receive in: it passes on
                raise unavailable("Every receive slot is busy with other requests' messages; retry shortly")
            lease.reservation = self.hold(self.reserve)
            leased.append(lease)
            if starter is not None:
                starter.context = context
            self.watchdog.watch(lease, late_at, getattr(context, "cancel", None) if starter is None else starter.end)
            try:
                received = next(messages, None)
            except grpc.RpcError:  # the call was cancelled: by the watchdog, or by its client
                if lease.late:
                    raise deadline_exceeded(self.late_details) from None
                raise
        finally:
            lease.release()
        if received is None:
            raise invalid("A unary method requires exactly one request message")
        return received


class Logged:
    """A call's access-log line, written as it ends; for a call ended before it ran (its message was late), written
    by `late`."""
    __slots__ = ("behavior", "method", "request_id", "written")

    def __init__(self, behavior: Callable[[Received, grpc.ServicerContext], Any], method: str,
                 metadata: dict[str, str]) -> None:
        self.behavior, self.method = behavior, method
        self.request_id = access_log.request_id(metadata.get(access_log.HEADER.lower()))
        self.written = False

    def __call__(self, received: Received, context: grpc.ServicerContext) -> Any:
        started, response = time.perf_counter(), None
        context.send_initial_metadata(((access_log.HEADER.lower(), self.request_id),))
        try:
            response = self.behavior(received, context)
            return response
        finally:
            request = received.request
            spec = getattr(request, "model_spec", None)
            version = spec.version.value if spec is not None and spec.HasField("version") else None
            model = spec.name if spec is not None else getattr(request, "model_name", None)  # V2 names it so
            version = version or (spec.version_label if spec is not None
                                  else getattr(request, "model_version", None))
            self.write(model or None, version or None, (context.code() or grpc.StatusCode.OK).name, received.nbytes,
                       response.ByteSize() if response is not None else 0, context.peer(),
                       time.perf_counter() - started)

    def late(self, call: Any, started: float) -> None:
        """The line of a call the watchdog ended before its message came (`started`: time.monotonic())."""
        if not self.written:
            peer = call.peer() if call is not None else b""
            self.write(None, None, LATE.name, 0, 0, peer.decode(errors="replace") if isinstance(peer, bytes) else peer,
                       time.monotonic() - started)

    def write(self, model: str | None, version: Any, status: str, bytes_in: int, bytes_out: int, remote: str,
              seconds: float) -> None:
        self.written = True
        access_log.write(request_id=self.request_id, protocol="grpc", method="POST", path=self.method, model=model,
                         version=version, status=status, bytes_in=bytes_in, bytes_out=bytes_out, remote=remote,
                         latency_ms=round(1000 * seconds, 3))
