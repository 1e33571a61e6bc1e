"""The gRPC gate's two paths, on a real MemoryBudget and a fake method (milliseconds, no server): a call that finds a
receive slot and room for the largest message as it arrives is served as the unary call it is; one that does not
waits for a slot as a stream-unary call; every lease, reservation and hold is given back, also by a call grpcio
drops before its message came. tests/e2e/test_pixel_flood.py floods a real server's gRPC port."""
from __future__ import annotations

import gc
import time

import grpc
import pytest
from google.protobuf.wrappers_pb2 import StringValue

from serving.core.budget import MemoryBudget
from serving.memory_costs import BODY_BYTES_FACTOR
from serving.protocols import auth
from serving.protocols.grpc_api.gate import Gate

LARGEST = 1000  # bytes: the largest message, reserved by each call while it receives
METHOD = "/tensorflow.serving.PredictionService/Predict"


class Aborted(Exception):
    pass


class Context:
    """What the gate asks of grpc's ServicerContext; `end` is the call's end, once its answer is read."""

    def __init__(self) -> None:
        self.status: tuple[grpc.StatusCode, str] | None = None
        self.callbacks: list = []
        self.cancelled = False

    def time_remaining(self) -> float:
        return 10.0

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.status = (code, details)
        raise Aborted(details)

    def add_callback(self, callback) -> bool:
        self.callbacks.append(callback)
        return True

    def cancel(self) -> None:
        self.cancelled = True
        self.end()

    def end(self) -> None:
        for callback in self.callbacks:
            callback()


def method() -> grpc.RpcMethodHandler:
    """A method whose request is bytes: it answers the length it was sent, as a message."""
    return grpc.unary_unary_rpc_method_handler(lambda request, context: StringValue(value=str(len(request))),
                                               request_deserializer=bytes,
                                               response_serializer=StringValue.SerializeToString)


ANSWER = StringValue(value="300").ByteSize() * BODY_BYTES_FACTOR


@pytest.fixture
def budget() -> MemoryBudget:
    return MemoryBudget(100 * LARGEST, 0)


def gate_for(budget: MemoryBudget, receivers: int = 1) -> Gate:
    return Gate(auth.Authenticator((), False), False, budget.hold, receivers, LARGEST, receive_wait=0.05)


def arrive(gate: Gate) -> grpc.RpcMethodHandler:
    details = type("Details", (), {"method": METHOD, "invocation_metadata": ()})()
    return gate.intercept_service(lambda _: method(), details)


def messages(call: grpc.RpcMethodHandler, data: bytes):
    """A stream-unary call's messages as grpcio hands them over: each deserialized only when asked for."""
    yield call.request_deserializer(data)


def test_a_call_with_a_free_slot_is_served_unary_and_gives_everything_back(budget):
    gate = gate_for(budget)
    call = arrive(gate)
    assert call.unary_unary is not None and call.stream_unary is None
    assert budget.held == LARGEST, "the call reserves the largest message before grpcio receives its own"
    received = call.request_deserializer(b"x" * 300)
    assert budget.held == 300 * BODY_BYTES_FACTOR, "the reservation is replaced by what the message holds"
    assert gate.shares.free == 1, "the receive slot is free again once the message is complete"
    context = Context()
    assert call.unary_unary(received, context) == StringValue(value="300")
    assert budget.held == ANSWER, "the answer is held until the client has read it"
    context.end()
    assert budget.held == 0


def test_an_answer_the_client_does_not_read_is_cancelled_in_time_and_given_back(budget):
    """grpcio keeps a unary call's answer until the client's window takes it: three connections of 64 unread calls
    once grew a worker by 2.4 GiB, outside the budget and past any deadline."""
    gate = gate_for(budget)
    call = arrive(gate)
    context = Context()
    call.unary_unary(call.request_deserializer(b"x" * 300), context)
    assert budget.held == ANSWER and not context.cancelled
    deadline = time.monotonic() + 5
    while not context.cancelled and time.monotonic() < deadline:  # --request_body_timeout (0.05 s) + 0 s per 64 KiB
        time.sleep(0.01)
    assert context.cancelled and budget.held == 0


def test_an_answer_the_budget_has_no_room_for_is_refused(budget):
    gate = gate_for(budget)
    call = arrive(gate)
    received = call.request_deserializer(b"x")  # a 1-byte request, answered "1": a larger answer than request
    hog = budget.hold(budget.body_limit - StringValue(value="1").ByteSize() * BODY_BYTES_FACTOR + 1)
    context = Context()
    with pytest.raises(Aborted):
        call.unary_unary(received, context)
    assert context.status[0] == grpc.StatusCode.UNAVAILABLE
    hog.release()
    assert budget.held == 0


def test_a_call_without_a_slot_waits_as_stream_unary_and_is_refused_in_time(budget):
    gate = gate_for(budget)
    first = arrive(gate)  # holds the one slot until its message comes
    second = arrive(gate)
    assert second.stream_unary is not None and second.unary_unary is None
    context = Context()
    with pytest.raises(Aborted):
        second.stream_unary(iter([]), context)
    assert context.status[0] == grpc.StatusCode.UNAVAILABLE and "receive slot" in context.status[1]
    context = Context()
    first.unary_unary(first.request_deserializer(b"x" * 10), context)
    context.end()
    assert budget.held == 0


def test_a_waiting_call_is_served_once_a_slot_frees(budget):
    gate = gate_for(budget)
    first = arrive(gate)
    second = arrive(gate)
    contexts = [Context(), Context()]
    first.unary_unary(first.request_deserializer(b"x" * 10), contexts[0])
    assert second.stream_unary(messages(second, b"y" * 20), contexts[1]) == StringValue(value="20")
    for context in contexts:  # both answers read
        context.end()
    assert budget.held == 0
    assert gate.shares.free == 1


def test_a_call_dropped_before_its_message_gives_its_lease_back(budget):
    gate = gate_for(budget)
    call = arrive(gate)
    assert budget.held == LARGEST
    del call
    gc.collect()
    assert budget.held == 0, "grpcio dropped the call: its reservation must come back"
    assert gate.shares.free == 1, "and so must its receive slot"


def test_a_budget_without_room_for_the_largest_message_makes_a_call_wait(budget):
    gate = gate_for(budget, receivers=4)
    hold = budget.hold(budget.body_limit - LARGEST // 2)  # less than the largest message left
    call = arrive(gate)
    assert call.stream_unary is not None, "no room to reserve: the call must not receive at once"
    context = Context()
    with pytest.raises(Aborted):
        call.stream_unary(messages(call, b"x"), context)
    assert context.status[0] == grpc.StatusCode.UNAVAILABLE and "memory budget" in context.status[1]
    hold.release()
    assert budget.held == 0
