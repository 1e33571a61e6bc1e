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
from serving.core import ServingError, deadline_exceeded, invalid, unavailable
from serving.memory_costs import BODY_BYTES_FACTOR
from serving.options.config import MIN_BODY_RATE
from serving.protocols import access_log, auth
from serving.protocols.grpc_api.common import CALL_HOLD, GRPC_STATUS, deadline_of
from serving.protocols.grpc_api.shares import HOLDING, PARKED, REFUSED, Claim, Shares, peer_of

log = logging.getLogger(__name__)

OPEN_SERVICE = "/grpc.health.v1.Health/"  # probes need no token
OPEN_METHODS = frozenset({"/inference.GRPCInferenceService/ServerLive",  # nor do V2's, as over REST
                          "/inference.GRPCInferenceService/ServerReady"})
CONTROL_METHODS = frozenset({"/tensorflow.serving.ModelService/HandleReloadConfigRequest"})  # need admin
PROFILE_SERVICE = "/tensorflow.ProfilerService/"  # auth.PROFILE: admin's once tokens are asked for
# A call whose message is late ends as one past its deadline does (REST answers 408 Request Timeout).
LATE = grpc.StatusCode.DEADLINE_EXCEEDED
IDLE_WAKE_S = 1.0  # the watchdog's sleep while it watches nothing
BUSY_DETAILS = "Every receive slot is busy with other requests' messages; retry shortly"
REFUSED_DETAILS = ("Every receive slot, and every place in the queue for one, is taken by clients that hold no more "
                   "than this one's connection and address do; retry shortly")
CUT_DETAILS = ("This call's receive slot, or its place in the queue for one, went to a client holding fewer: this "
               "connection or address held more than its share of the worker's while its messages did not arrive")


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
    """What a call holds while its message is received: its claim on a receive slot (serving/protocols/grpc_api/
    shares.py) and a reservation of the budget for the largest message. Given back once, by whichever comes first:
    the deserializer, as the message is complete; the `Watchdog`, as the message is late (`late`); the thread that
    served the call, as it ends; a fairer share taking the slot; or grpcio dropping a call whose message never came
    (a call cancelled before it sent one).

    An answer grpcio has taken and the client not yet read is held as a lease without a slot (`Gate.sending`)."""
    __slots__ = ("slot", "reserved", "held", "deadline", "end", "late", "watchdog")

    def __init__(self, slot: Claim | None, reservation: Any = None):
        self.slot = slot
        self.reserved = [] if reservation is None else [reservation]
        self.held = [True]  # popped by whoever gives the lease back: list.pop is atomic, so that happens once
        self.deadline = math.inf  # while watched: when its message is late, and `end` ends the call
        self.end: Callable[[], Any] | None = None
        self.late = False
        self.watchdog: Watchdog | None = None

    def keep(self, reservation: Any) -> bool:
        """Add the reservation taken once the slot came; False (and it is given back) if the lease went meanwhile."""
        self.reserved.append(reservation)
        if self.held:
            return True
        self._give_reservations()
        return False

    def _give_reservations(self) -> None:
        while True:
            try:
                reservation = self.reserved.pop()  # atomic: each is given back once, by whichever thread pops it
            except IndexError:
                return
            reservation.release()

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
        self._give_reservations()
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
    """How a call of the server's pool starts: grpcio runs a method on the method's own `experimental_thread_pool`
    when it has one, handing that pool its call event, on grpcio's polling thread as the call arrives. This pool
    runs nothing itself: it learns the call and its peer, and claims a receive slot for it in the gate's `Shares`
    (a fair share for every peer address and connection). A call that gets one has its message asked for at once,
    on the polling thread, and goes to the server's pool only once the message is in: grpcio's own way has a pool
    thread ask for it and sleep until the polling thread hands it over (3 to 7 more thread switches a call,
    measured in docs/performance.md, 'gRPC's message received before a thread takes the call'). A call that waits
    for a slot holds no thread meanwhile, and one that finds neither a slot nor room to wait is refused
    RESOURCE_EXHAUSTED at once. Its lease is watched from its arrival: past --request_body_timeout a call still
    waiting is answered UNAVAILABLE, one still receiving DEADLINE_EXCEEDED; a call whose slot a fairer share takes
    is ended RESOURCE_EXHAUSTED. Once the call is served a lease still held (its message never came) is given back.
    With a grpcio whose polling internals `_receiving` does not know, the message is asked for on the pool thread,
    once the call has its slot."""

    def __init__(self, gate: Gate, leased: list[Lease], logged: Logged | None) -> None:  # a pool without threads
        self.gate, self.leased, self.logged = gate, leased, logged
        self.call: Any = None  # grpcio's call (cygrpc.Call), whose cancel() can end it with a status
        self.started = time.monotonic()
        self.ended: grpc.StatusCode | None = None  # how the gate ended the call before it was served
        self.receiving = False
        self.served: futures.Future[Any] = futures.Future()
        self.run_args: tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]] | None = None

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> futures.Future[Any]:
        self.started = time.monotonic()
        self.call = next((event.call for event in args if hasattr(getattr(event, "call", None), "cancel")), None)
        self.run_args = (fn, args, kwargs)
        self.served.set_running_or_notify_cancel()
        peer = self.call.peer() if self.call is not None else b""
        claim = Claim(*peer_of(peer.decode(errors="replace") if isinstance(peer, bytes) else str(peer)),
                      granted=self.granted, cut=self.cut)
        lease = Lease(claim)
        self.leased.append(lease)
        state = self.gate.shares.claim(claim)
        if state == REFUSED:
            lease.release()
            self.stop(grpc.StatusCode.RESOURCE_EXHAUSTED, REFUSED_DETAILS)
            return self.served
        self.gate.watchdog.watch(lease, self.started + self.gate.receive_wait, self.expire)
        if state == HOLDING:
            self.granted()
        return self.served

    def granted(self) -> None:
        """The call has its slot: reserve the budget for its message (UNAVAILABLE when it has no room) and ask for
        the message."""
        lease = self.leased[0]
        if not lease.held:
            return
        try:
            reservation = self.gate.hold(self.gate.reserve)
        except ServingError as err:
            lease.release()
            self.stop(GRPC_STATUS[err.code], err.message)
            return
        if not lease.keep(reservation):
            return
        self.receiving = True
        assert self.run_args is not None
        (fn, args, kwargs), self.run_args = self.run_args, None  # args hold grpcio's handler, which holds this
        if _RECEIVE is None or len(args) != 7:
            self.start(fn, args, kwargs)
        else:
            _receiving(args[1], args[2], args[5], lambda request: self.start(fn, (*args[:4], request, *args[5:]),
                                                                            kwargs))

    def start(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """The call goes to a thread of the server's pool."""
        pool = self.gate.pool
        assert pool is not None
        try:
            done = pool.submit(self.run, fn, args, kwargs)
        except RuntimeError as error:  # the server is stopping: its pool takes nothing more
            _settle(self.served, error=error)
            return
        done.add_done_callback(lambda ran: _settle(self.served, ran))

    def run(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        try:
            return fn(*args, **kwargs)
        finally:
            for lease in self.leased:
                lease.release()
            if self.ended is not None and self.logged is not None:
                self.logged.ended(self.call, self.started, self.ended)

    def expire(self) -> None:
        """Past --request_body_timeout of the call's start (its lease given back already)."""
        if self.receiving:
            self.end(LATE, self.gate.late_details)
        else:
            self.stop(grpc.StatusCode.UNAVAILABLE, BUSY_DETAILS)

    def cut(self) -> None:
        """A fairer share took this call's slot, or its place in the queue for one."""
        self.leased[0].release()
        if self.receiving:
            self.end(grpc.StatusCode.RESOURCE_EXHAUSTED, CUT_DETAILS)
        else:
            self.stop(grpc.StatusCode.RESOURCE_EXHAUSTED, CUT_DETAILS)

    def end(self, code: grpc.StatusCode, details: str) -> None:
        """End a call whose message has been asked for: grpcio then hands its thread no message, and it ends."""
        self.ended = code
        if self.call is not None:
            self.call.cancel(code.value[0], details)

    def stop(self, code: grpc.StatusCode, details: str) -> None:
        """End a call whose message was never asked for: it takes no thread."""
        self.run_args = None
        self.end(code, details)
        if self.logged is not None:
            self.logged.ended(self.call, self.started, code)
        _settle(self.served)


def _settle(served: futures.Future[Any], ran: futures.Future[Any] | None = None,
            error: BaseException | None = None) -> None:
    """End the future grpcio was given for a call (once): grpcio counts the call against its bound
    (server.max_calls) until then."""
    error = ran.exception() if ran is not None else error
    try:
        if error is None:
            served.set_result(ran.result() if ran is not None else None)
        else:
            served.set_exception(error)
    except futures.InvalidStateError:  # ended by the gate already
        pass


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
    call arrives, so at most `receivers` messages are received at a time, each under a `Lease`: a receive slot and a
    reservation of `reserve` bytes (the largest message) of the budget, so a call the budget has no room for is
    refused before its message is read. Given the server's `pool`, every call starts through its `Starter`, which
    learns its peer: the slots, and up to `waiting` places in the queue for one, are shared fairly between peer
    addresses and their connections (shares.py), a call waits for a slot without a thread, and the others' streams
    are held to HTTP/2's initial window meanwhile (BDP probing off, see server.py). Without a pool (in-process
    callers), a call that finds a slot and room as it arrives is served as the unary call it is, and one that does
    not as a stream-unary call, which waits for a slot on its thread. Either way a call's message must be complete
    within `receive_wait` seconds (--request_body_timeout, as a REST body's) of the call's start, waiting for a slot
    included: past that the `Watchdog` gives its lease back, so the slot passes at once to a call waiting for one,
    and ends the call (DEADLINE_EXCEEDED; UNAVAILABLE if it never had a slot). A client that sends slowly or stalls
    thus delays the others by at most that. Probes (grpc.health.v1, V2's ServerLive and
    ServerReady) pass untouched: tiny, open to all, and never to be refused by a busy budget. With --access_log,
    every call leaves a line. Only unary calls are gated: TF Serving's services have no others, and V2's one stream
    (ModelStreamInfer), which answers UNIMPLEMENTED, has its token checked alone."""

    def __init__(self, authenticator: auth.Authenticator, log_requests: bool, hold: Callable[[int], Any],
                 receivers: int, reserve: int, receive_wait: float, pool: futures.ThreadPoolExecutor | None = None,
                 waiting: int = 64) -> None:
        self.authenticator = authenticator
        self.log_requests = log_requests
        self.hold = hold  # the worker's MemoryBudget.hold
        self.shares = Shares(receivers, waiting)
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
        if self.pool is not None:
            return grpc.unary_unary_rpc_method_handler(Method(call, Starter(self, leased, logged)),
                                                       request_deserializer=deserialize,
                                                       response_serializer=handler.response_serializer)
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

    def sending(self, response: Any, context: grpc.ServicerContext) -> None:
        """Hold an answer in the budget until the client has read it, and no longer than a REST answer may take.

        grpcio queues a unary call's answer in its core as the method returns and sends it as the client's HTTP/2
        windows open: a client that opens many calls and reads none kept every answer, unbounded by the budget or
        any deadline (three connections of 64 such calls grew a worker by 2.4 GiB). The answer's bytes are held
        (BODY_BYTES_FACTOR each, its serialized copy and more) until the call ends, so a full budget refuses new
        calls rather than outgrowing memory; one the budget has no room for is refused as a request would be.
        Past --request_body_timeout plus a second for every 64 KiB of it (serving/process/gevent_worker.py's deadline
        for a REST answer), the watchdog cancels the call, which frees what grpcio queued."""
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
        claim = Claim("", "")
        if self.shares.claim(claim, park=False) != HOLDING:
            return None
        try:
            return Lease(claim, self.hold(self.reserve))
        except ServingError:
            claim.release()
            return None

    def receive(self, messages: Iterator[Received], context: grpc.ServicerContext, leased: list[Lease]) -> Received:
        """The call's one message, received under a lease that waits for a slot on this thread: UNAVAILABLE when
        the budget has no room for the message or no slot frees in time, DEADLINE_EXCEEDED when the message is
        late."""
        late_at = time.monotonic() + self.receive_wait
        remaining = threads.timeout_until(deadline_of(context))
        wait = max(0.0, late_at - time.monotonic())
        slot = threading.Event()
        claim = Claim("", "", granted=slot.set, cut=slot.set)
        lease = Lease(claim)
        try:
            limit = wait if remaining is None else min(remaining, wait)
            if self.shares.claim(claim) == PARKED and not slot.wait(limit) and claim.state != HOLDING \
                    and remaining is not None and remaining <= wait:
                raise deadline_exceeded("Deadline exceeded waiting to receive the request")
            if claim.state != HOLDING or time.monotonic() >= late_at:  # no slot, or no time left to receive in
                raise unavailable(BUSY_DETAILS)
            lease.keep(self.hold(self.reserve))
            leased.append(lease)
            self.watchdog.watch(lease, late_at, getattr(context, "cancel", None))
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

    def ended(self, call: Any, started: float, status: grpc.StatusCode) -> None:
        """The line of a call the gate ended before it ran (`started`: time.monotonic())."""
        if not self.written:
            peer = call.peer() if call is not None else b""
            remote = peer.decode(errors="replace") if isinstance(peer, bytes) else peer
            self.write(None, None, status.name, 0, 0, remote, time.monotonic() - started)

    def write(self, model: str | None, version: Any, status: str, bytes_in: int, bytes_out: int, remote: str,
              seconds: float) -> None:
        self.written = True
        access_log.write(request_id=self.request_id, protocol="grpc", method="POST", path=self.method, model=model,
                         version=version, status=status, bytes_in=bytes_in, bytes_out=bytes_out, remote=remote,
                         latency_ms=round(1000 * seconds, 3))
