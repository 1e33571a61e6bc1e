"""One error type for every protocol, carrying a TF status code (the same names and numbers as gRPC's).

REST, gRPC and KServe V2 all sit on the same DataPlane, so it raises a `Code` once and each protocol maps it:
REST with `Code.http_status` (TF Serving's, docs/protocols.md; the table is serving/status_codes.py, which clients
read too), gRPC with `grpc.StatusCode[code.name]`. Both mappings are total over the enum, checked when that module and
the gRPC adapter are imported, so nothing falls back silently.
"""
from __future__ import annotations

import re

from serving.status_codes import Code

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


def failed_to_load(error: Exception) -> ServingError:
    """A load that failed for a reason of Petal's (not a status TensorFlow gave): UNKNOWN, "Failed to load: ...", with
    a ServingError's message alone and anything else's type and text."""
    message = error.message if isinstance(error, ServingError) else f"{type(error).__name__}: {error}"
    return ServingError(Code.UNKNOWN, f"Failed to load: {message}")


def op_error_message(message: str) -> str:
    """The part of a TF error that says what was wrong, without node names, op tags and stack noise."""
    noise = ("Graph execution error", "Detected at node", "<stack traces", "\t", " ")
    lines = [line for line in message.splitlines() if line.strip() and not line.startswith(noise)]
    return _TF_NOISE.sub("", lines[-1] if lines else message).strip()
