"""--access_log: one JSON line per request on stderr, through the JSON log formatter every Petal log uses.

Each line carries the request ID (the client's X-Request-ID when it is sane, else a new one, returned either way),
the protocol, method, path (the gRPC method name for gRPC), model, version, status, bytes in and out, and latency.
Never a body or a header other than the request ID, so no token can reach the log.
"""
from __future__ import annotations

import logging
import re
import uuid

logger = logging.getLogger("petal.access")
HEADER = "X-Request-ID"
_SANE_ID = re.compile(r"[A-Za-z0-9._:/+=@-]{1,128}")


def enable() -> None:
    """The server logs warnings and up by default; access lines are INFO, so this logger is let through."""
    logger.setLevel(logging.INFO)


def request_id(sent: str | None) -> str:
    """The client's ID when it is a short run of plain characters (so it cannot forge log lines), else a new one."""
    return sent if sent and _SANE_ID.fullmatch(sent) else uuid.uuid4().hex


def write(**fields: object) -> None:
    logger.info("request", extra={"fields": fields})
