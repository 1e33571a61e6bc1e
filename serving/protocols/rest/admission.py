"""Each HTTP request's hold on its worker's memory budget (serving/core/budget.py), from before its body is read
until it is answered; REST, V2 and `:classify_image` alike.

A body whose Content-Length is declared is charged BODY_BYTES_FACTOR times that before a byte of it is read, and a
chunked one as each piece arrives; either way a body the budget has no room for is answered 503 with Retry-After at
once, and the rest of it is never buffered. Parsing then charges what it learns (`charge`): an inflated gzip body,
and JSON numbers, which cost far more as Python objects than the base64 strings the factor is measured on. A body
larger than the budget could ever hold is a 413, like one over --max_request_bytes. The hold is released when the
request's context ends, whatever ended it: an answer, an error, a deadline, a client gone mid-body.
"""
from __future__ import annotations

import flask
from werkzeug.exceptions import RequestEntityTooLarge

from serving.core import Code, DataPlane, ServingError
from serving.memory import BODY_BYTES_FACTOR

_HOLD = "memory_hold"


class ChargedStream:
    """A chunked body's WSGI input that charges each piece read before handing it on."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def read(self, size: int = -1) -> bytes:
        return self._charged(self._stream.read(size))

    def readline(self, size: int = -1) -> bytes:
        return self._charged(self._stream.readline(size))

    def _charged(self, data: bytes) -> bytes:
        charge(len(data) * BODY_BYTES_FACTOR)
        return data


def charge(nbytes: int) -> None:
    """Add `nbytes` to the current request's hold: 503 when the budget has no room now, 413 when it never will.
    Outside a request, or with no budget, nothing."""
    hold = flask.g.get(_HOLD) if flask.has_request_context() else None
    if hold is None:
        return
    try:
        hold.grow(nbytes)
    except ServingError as error:
        if error.code == Code.RESOURCE_EXHAUSTED:
            raise RequestEntityTooLarge(error.message) from None
        raise


def install(app: flask.Flask, core: DataPlane) -> None:
    """Admit every request with a body against `core`'s budget (after authentication, if registered before)."""
    budget = core.memory
    if budget.limit <= 0:
        return

    @app.before_request
    def admit() -> None:
        request = flask.request
        chunked = "chunked" in request.headers.get("Transfer-Encoding", "").lower()
        length = request.content_length
        if not length and not chunked:
            return
        setattr(flask.g, _HOLD, budget.hold(0))
        if chunked:
            request.environ["wsgi.input"] = ChargedStream(request.environ["wsgi.input"])
        elif length:
            charge(length * BODY_BYTES_FACTOR)

    @app.teardown_request
    def release(error: BaseException | None) -> None:
        hold = flask.g.pop(_HOLD, None)
        if hold is not None:
            hold.release()
