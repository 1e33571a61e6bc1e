"""Each HTTP request's hold on its worker's memory budget (serving/core/budget.py), from before its body is read
until it is answered; REST, V2 and `:classify_image` alike.

A body is charged BODY_BYTES_FACTOR times each piece read as it arrives, whether its Content-Length is declared or
it is chunked. A declared size is a claim, checked before a byte is read (a 413 when it is more than the budget
could ever hold, like one over --max_request_bytes) but not charged: charged in full up front, it let a client that
declares large bodies and trickles them hold the budget for as long as the body deadline allows, so that every
other request got 503. A piece the budget has no room for is answered 503 with Retry-After at once, and the rest of
the body is never buffered. The view that decodes the body then charges what the codec learns, through the
request's `charge`: an inflated gzip body, and JSON numbers, which cost far more as Python objects than the base64
strings the factor is measured on. The hold is released when the request's context ends, whatever ended it: an
answer, an error, a deadline, a client gone mid-body. The hold lives in the request's WSGI environ, beside its body.
"""
from __future__ import annotations

import flask
from werkzeug.exceptions import RequestEntityTooLarge
from werkzeug.wsgi import get_content_length

from serving.core import Code, DataPlane, ServingError
from serving.memory_costs import BODY_BYTES_FACTOR
from serving.protocols.codec.strict_json import Charge, no_charge
from serving.protocols.rest.httputil import error_response

_HOLD = "petal.memory_hold"
ANSWER_HELD_BYTES = 64 * 1024  # a smaller answer leaves for the socket's send buffer as it is written


class RequestHold:
    """One request's hold, charged as the request learns its cost: 503 when the budget has no room now, 413 when
    it never will."""
    __slots__ = ("hold",)

    def __init__(self, hold) -> None:
        self.hold = hold

    def charge(self, nbytes: int) -> None:
        try:
            self.hold.grow(nbytes)
        except ServingError as error:
            if error.code == Code.RESOURCE_EXHAUSTED:
                raise RequestEntityTooLarge(error.message) from None
            raise


class ChargedStream:
    """A body's WSGI input that charges each piece read before handing it on."""
    __slots__ = ("_stream", "_charge")

    def __init__(self, stream, charge: Charge) -> None:
        self._stream = stream
        self._charge = charge

    def read(self, size: int = -1) -> bytes:
        return self._charged(self._stream.read(size))

    def readline(self, size: int = -1) -> bytes:
        return self._charged(self._stream.readline(size))

    def _charged(self, data: bytes) -> bytes:
        if data:  # a stream read to its end ends with an empty piece: nothing to charge, so no call
            self._charge(len(data) * BODY_BYTES_FACTOR)
        return data


def charge_of(request: flask.Request) -> Charge:
    """What decoding `request`'s body charges to: its hold, or nothing when it has none (no budget, or no body)."""
    hold = request.environ.get(_HOLD)
    return hold.charge if hold is not None else no_charge


def install(app: flask.Flask, dataplane: DataPlane) -> None:
    """Admit every request with a body against `dataplane`'s budget (after authentication, if registered before)."""
    budget = dataplane.memory
    if budget.limit <= 0:
        return

    @app.before_request
    def admit() -> None:
        environ = flask.request.environ
        chunked = "chunked" in environ.get("HTTP_TRANSFER_ENCODING", "").lower()
        length = get_content_length(environ)
        if not length and not chunked:
            return
        hold = environ[_HOLD] = RequestHold(budget.hold(0))
        if length and length * BODY_BYTES_FACTOR > budget.body_limit:
            hold.charge(length * BODY_BYTES_FACTOR)  # the budget's own refusal: 413 (503 while it is measured)
        environ["wsgi.input"] = ChargedStream(environ["wsgi.input"], hold.charge)

    @app.teardown_request
    def release(error: BaseException | None) -> None:
        hold = flask.request.environ.pop(_HOLD, None)
        if hold is not None:
            hold.hold.release()

    @app.after_request
    def hold_answer(response: flask.Response) -> flask.Response:
        """An answer of ANSWER_HELD_BYTES or more holds its bytes until it is written (the response's close): the
        request's hold ends as the view returns, before the front end writes a byte, and a client that does not
        read keeps the answer for --request_body_timeout plus a second per 64 KiB (30 such clients of 8 MB answers
        held +224 MiB outside the budget). One the budget has no room for is a 503, which frees it at once."""
        if response.direct_passthrough or response.is_streamed:  # files, sent from disk
            return response
        size = response.content_length or 0
        if size < ANSWER_HELD_BYTES:
            return response
        try:
            hold = budget.hold(size)
        except ServingError as error:
            return error_response(error.code.http_status, f"The answer ({size} bytes) cannot be held now: "
                                  f"{error.message}")
        response.call_on_close(hold.release)
        return response
