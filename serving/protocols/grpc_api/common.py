"""What every gRPC servicer shares: ServingError as its gRPC status (the same `Code` enum REST maps to HTTP) and
the call's deadline in the DataPlane's clock.
"""
from __future__ import annotations

import contextvars
import logging
import time
from collections.abc import Callable
from typing import Any

import grpc

from serving import threads
from serving.core import Code, ServingError

log = logging.getLogger(__name__)

# Total over Code (a KeyError here at import, never a silent UNKNOWN at request time): TF's codes are gRPC's.
GRPC_STATUS = {code: grpc.StatusCode[code.name] for code in Code}
# The running call's hold on the memory budget (Gate sets it around the servicer), for what the call costs beyond
# its message: a tensor filled from one value (serving/protocols/codec/tensor_proto.py).
CALL_HOLD: contextvars.ContextVar[Any] = contextvars.ContextVar("petal_grpc_call_hold", default=None)


def deadline_of(context: grpc.ServicerContext) -> float | None:
    """The call's deadline in time.monotonic() seconds; None without one, or with one so far off that it is none
    (a client such as Triton's perf_analyzer sets years)."""
    remaining = context.time_remaining()
    return None if remaining is None or remaining > threads.FAR_DEADLINE_S else time.monotonic() + remaining


def rpc(method: Callable[..., Any]) -> Callable[..., Any]:
    """Turn ServingError into its gRPC status, and anything unexpected into INTERNAL with a log line. (The request
    holds its share of the memory budget from before it was parsed: `Gate`.)"""
    def handler(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return method(self, request, context)
        except ServingError as err:
            context.abort(GRPC_STATUS[err.code], err.message)
        except Exception as exc:
            log.exception("gRPC handler failed", extra={"fields": {"method": method.__name__}})
            context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")
    handler.__name__ = method.__name__
    handler.__doc__ = method.__doc__
    return handler
