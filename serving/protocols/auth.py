"""Bearer tokens and roles, decided in one place for REST and gRPC, so the two protocols cannot disagree.

A request presents `Authorization: Bearer <token>` (an HTTP header, or gRPC call metadata). Without
--auth_token_file nothing is asked for, except that model control stays off unless --enable_model_control says
otherwise: a default install exposes no admin surface. Tokens are compared as SHA-256 digests with
hmac.compare_digest against every configured token, with no early exit, so the time taken says neither how much
of a token matched nor which one did. Tokens are never logged or echoed.
"""
from __future__ import annotations

import hmac
from collections.abc import Sequence

from serving.core import Code, ServingError
from serving.options.config import Token, token_digest

PREDICT, ADMIN, PROFILE = "predict", "admin", "profile"  # what a request needs
SCHEME = "bearer"


class Authenticator:
    """Says whether an Authorization value may do what a request needs (PREDICT or ADMIN)."""

    def __init__(self, tokens: Sequence[Token], enable_model_control: bool) -> None:
        self.tokens = tuple(tokens)
        self.enable_model_control = enable_model_control

    @property
    def required(self) -> bool:
        return bool(self.tokens)

    def check(self, authorization: str | None, needs: str) -> None:
        """Return if allowed; else raise UNAUTHENTICATED (no or bad token) or PERMISSION_DENIED (no such role).
        PROFILE (a trace, which writes files where its client says) is ADMIN's once tokens are asked for, and
        open without them, as TF Serving's --enable_profiler is (which turns it off)."""
        if not self.tokens:
            if needs == ADMIN and not self.enable_model_control:
                raise ServingError(Code.PERMISSION_DENIED, "Model control is off: start the server with "
                                   "--enable_model_control, or with an --auth_token_file holding an admin token")
            return
        role = self.role_of(authorization)
        if needs == ADMIN and role != ADMIN:
            raise ServingError(Code.PERMISSION_DENIED, "Model control needs a token with the admin role")
        if needs == PROFILE and role != ADMIN:
            raise ServingError(Code.PERMISSION_DENIED, "Profiling needs a token with the admin role")

    def role_of(self, authorization: str | None) -> str:
        scheme, _, token = (authorization or "").strip().partition(" ")
        token = token.strip()
        if scheme.lower() != SCHEME or not token:
            raise ServingError(Code.UNAUTHENTICATED, "Missing bearer token: send 'Authorization: Bearer <token>'")
        digest = token_digest(token)
        role = ""
        for known in self.tokens:  # every token, always: no early exit
            if hmac.compare_digest(known.digest, digest):
                role = known.role
        if not role:
            raise ServingError(Code.UNAUTHENTICATED, "Invalid bearer token")
        return role


def www_authenticate(authorization: str | None) -> str:
    """RFC 6750's challenge for a 401: `invalid_token` when a token was sent, none when it was missing."""
    return 'Bearer realm="petal"' + (', error="invalid_token"' if authorization else "")
