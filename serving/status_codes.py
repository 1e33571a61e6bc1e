"""TF's status codes (the same names and numbers as gRPC's) and the HTTP status each becomes over REST.

The one table of them: the server raises a `Code` (serving/core/errors.py) and REST answers `Code.http_status` (TF
Serving's mapping, docs/protocols.md), while a client, a load generator or a test reads a gRPC status through the
same table (`Code[rpc_error.code().name].http_status`). It imports nothing, so neither the client nor the load
tests pay for TensorFlow or grpc to read it; the mapping is total over the enum, checked at import, so nothing falls
back silently.
"""
from __future__ import annotations

import enum


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
