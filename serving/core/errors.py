"""One error type for every protocol, carrying a TF status code (the same names and numbers as gRPC's).

REST, gRPC and KServe V2 all sit on the same core, so the core raises a `Code` once and each protocol maps it:
REST with `Code.http_status` (TF Serving's, docs/protocols.md), gRPC with `grpc.StatusCode[code.name]`. Both mappings
are total over the enum, checked when this module and the gRPC adapter are imported, so nothing falls back silently.
"""
from __future__ import annotations

import enum
import re


class Code(enum.StrEnum):
    """TF's error codes (tensorflow/core/protobuf/error_codes.proto), which are gRPC's status codes."""
    OK = "OK"
    CANCELLED = "CANCELLED"
    UNKNOWN = "UNKNOWN"
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    NOT_FOUND = "NOT_FOUND"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    ABORTED = "ABORTED"
    OUT_OF_RANGE = "OUT_OF_RANGE"
    UNIMPLEMENTED = "UNIMPLEMENTED"
    INTERNAL = "INTERNAL"
    UNAVAILABLE = "UNAVAILABLE"
    DATA_LOSS = "DATA_LOSS"
    UNAUTHENTICATED = "UNAUTHENTICATED"

    @property
    def http_status(self) -> int:
        return _HTTP_STATUS[self]


_HTTP_STATUS = {
    Code.OK: 200,
    Code.INVALID_ARGUMENT: 400,
    Code.FAILED_PRECONDITION: 400,
    Code.OUT_OF_RANGE: 400,
    Code.UNAUTHENTICATED: 401,
    Code.PERMISSION_DENIED: 403,
    Code.NOT_FOUND: 404,
    Code.ALREADY_EXISTS: 409,
    Code.ABORTED: 409,
    Code.RESOURCE_EXHAUSTED: 429,
    Code.CANCELLED: 499,
    Code.INTERNAL: 500,
    Code.UNKNOWN: 500,
    Code.DATA_LOSS: 500,
    Code.UNIMPLEMENTED: 501,
    Code.UNAVAILABLE: 503,
    Code.DEADLINE_EXCEEDED: 504,
}
if set(_HTTP_STATUS) != set(Code):
    raise ImportError(f"no HTTP status for {sorted(set(Code) - set(_HTTP_STATUS))}")

# Node and op tags TF wraps around a message: {{function_node ...}}, [[{{node ...}}]], [Op:...].
_TF_NOISE = re.compile(r"\{\{[^}]*\}\}\s*|\s*\[\[.*?\]\]|\s*\[Op:.*$", re.S)


class ServingError(Exception):
    """A request failure that a client can act on."""

    def __init__(self, code: Code, message: str):
        super().__init__(message)
        self.code = Code(code)
        self.message = message

    def __repr__(self) -> str:
        return f"ServingError({self.code!r}, {self.message!r})"


def invalid(message: str) -> ServingError:
    return ServingError(Code.INVALID_ARGUMENT, message)


def not_found(message: str) -> ServingError:
    return ServingError(Code.NOT_FOUND, message)


def unavailable(message: str) -> ServingError:
    return ServingError(Code.UNAVAILABLE, message)


def deadline_exceeded(message: str) -> ServingError:
    return ServingError(Code.DEADLINE_EXCEEDED, message)


def op_error_message(message: str) -> str:
    """The part of a TF error that says what was wrong, without node names, op tags and stack noise."""
    noise = ("Graph execution error", "Detected at node", "<stack traces", "\t", " ")
    lines = [line for line in message.splitlines() if line.strip() and not line.startswith(noise)]
    return _TF_NOISE.sub("", lines[-1] if lines else message).strip()
