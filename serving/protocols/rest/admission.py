"""Each HTTP request's hold on its worker's memory budget (serving/core/budget.py), from before its body is read
until it is answered; REST, V2 and `:classify_image` alike.

A body whose Content-Length is declared is charged BODY_BYTES_FACTOR times that before a byte of it is read, and a
chunked one as each piece arrives; either way a body the budget has no room for is answered 503 with Retry-After at
once, and the rest of it is never buffered. The view that decodes the body then charges what the codec learns,
through the request's `charge`: an inflated gzip body, and JSON numbers, which cost far more as Python objects
than the base64 strings the factor is measured on. A body larger than the budget could ever hold is a 413, like
one over --max_request_bytes. The hold is released when the request's context ends, whatever ended it: an answer,
an error, a deadline, a client gone mid-body. The hold lives in the request's WSGI environ, beside its body.
"""
from __future__ import annotations

import flask
from werkzeug.exceptions import RequestEntityTooLarge
from werkzeug.wsgi import get_content_length

from serving.core import Code, DataPlane, ServingError
from serving.memory import BODY_BYTES_FACTOR
from serving.protocols.codec.strict_json import Charge, no_charge

_HOLD = "petal.memory_hold"


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
    """A chunked body's WSGI input that charges each piece read before handing it on."""

    def __init__(self, stream, charge: Charge) -> None:
        self._stream = stream
        self._charge = charge

    def read(self, size: int = -1) -> bytes:
        return self._charged(self._stream.read(size))

    def readline(self, size: int = -1) -> bytes:
        return self._charged(self._stream.readline(size))

    def _charged(self, data: bytes) -> bytes:
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
        if chunked:
            environ["wsgi.input"] = ChargedStream(environ["wsgi.input"], hold.charge)
        elif length:
            hold.charge(length * BODY_BYTES_FACTOR)

    @app.teardown_request
    def release(error: BaseException | None) -> None:
        hold = flask.request.environ.pop(_HOLD, None)
        if hold is not None:
            hold.hold.release()
