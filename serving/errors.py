"""One error type for every protocol, carrying a TF/gRPC status code name.

REST, gRPC and KServe V2 all sit on the same core, so the core raises a code name once and each protocol maps it:
REST with `http_status` (TF Serving's table), gRPC with `grpc.StatusCode[code]`.
"""
from __future__ import annotations

import re

_HTTP_STATUS = {
    "OK": 200,
    "INVALID_ARGUMENT": 400,
    "FAILED_PRECONDITION": 400,
    "OUT_OF_RANGE": 400,
    "UNAUTHENTICATED": 401,
    "PERMISSION_DENIED": 403,
    "NOT_FOUND": 404,
    "ALREADY_EXISTS": 409,
    "ABORTED": 409,
    "RESOURCE_EXHAUSTED": 429,
    "CANCELLED": 499,
    "INTERNAL": 500,
    "UNKNOWN": 500,
    "DATA_LOSS": 500,
    "UNIMPLEMENTED": 501,
    "UNAVAILABLE": 503,
    "DEADLINE_EXCEEDED": 504,
}

# Node and op tags TF wraps around a message: {{function_node ...}}, [[{{node ...}}]], [Op:...].
_TF_NOISE = re.compile(r"\{\{[^}]*\}\}\s*|\s*\[\[.*?\]\]|\s*\[Op:.*$", re.S)


class ServingError(Exception):
    """A request failure that a client can act on; `code` is a TF/gRPC status code name such as "NOT_FOUND"."""

    def __init__(self, code: str, message: str):
        if code not in _HTTP_STATUS:
            raise ValueError(f"unknown status code name {code!r}")
        super().__init__(message)
        self.code = code
        self.message = message

    def __repr__(self) -> str:
        return f"ServingError({self.code!r}, {self.message!r})"


def http_status(code: str) -> int:
    """The HTTP status TF Serving's REST API uses for a status code name (500 for names it does not know)."""
    return _HTTP_STATUS.get(code, 500)


def invalid(message: str) -> ServingError:
    return ServingError("INVALID_ARGUMENT", message)


def not_found(message: str) -> ServingError:
    return ServingError("NOT_FOUND", message)


def unavailable(message: str) -> ServingError:
    return ServingError("UNAVAILABLE", message)


def op_error_message(message: str) -> str:
    """The part of a TF error that says what was wrong, without node names, op tags and stack noise."""
    noise = ("Graph execution error", "Detected at node", "<stack traces", "\t", " ")
    lines = [line for line in message.splitlines() if line.strip() and not line.startswith(noise)]
    return _TF_NOISE.sub("", lines[-1] if lines else message).strip()
