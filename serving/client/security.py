"""What a secured server asks of its clients, set up once for every client Petal ships: the Python client
(`serving.client`), `petal predict`, `petal loadtest` and its Locust users.

A server started with --auth_token_file wants `Authorization: Bearer TOKEN` on every request (the token is best
passed as $PETAL_TOKEN, which keeps it off the process list); one started with --ssl_config_file wants TLS, verified
against a CA file or the system's CAs, and a client certificate when it sets client_verify. Only the standard
library is imported here (grpc when a channel is asked for), so the load tests read this without TensorFlow.
"""
from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import grpc

TOKEN_ENV = "PETAL_TOKEN"
# gRPC clients refuse messages over 4 MB by default; images, multi-megapixel JPEGs above all, need more.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class Security:
    """A bearer token, and TLS (PEM files) with an optional client certificate; an empty string counts as not
    given. TLS is on when asked for or implied by a CA or certificate file."""

    token: str | None = field(default=None, repr=False)
    tls: bool = False
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None

    @property
    def uses_tls(self) -> bool:
        return self.tls or bool(self.ca_file or self.cert_file)

    def header(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def grpc_metadata(self) -> tuple[tuple[str, str], ...] | None:
        """The header as gRPC metadata (lower-case keys), or None without a token."""
        return tuple((key.lower(), value) for key, value in self.header().items()) or None

    def ssl_context(self) -> ssl.SSLContext:
        """For an https:// URL: the CA file's (else the system's) trust, and the client certificate if given.
        Under Locust's gevent patching `ssl` is gevent's, so the context is one its HTTP client can use."""
        context = ssl.create_default_context(cafile=self.ca_file or None)
        if self.cert_file:
            context.load_cert_chain(self.cert_file, self.key_file or None)
        return context

    def requests_arguments(self) -> dict[str, Any]:
        """`verify` and `cert` for each call of `requests` (not its session: $REQUESTS_CA_BUNDLE would override a
        session's `verify`)."""
        return {"verify": self.ca_file or True,
                "cert": (self.cert_file, self.key_file) if self.cert_file and self.key_file else self.cert_file or None}

    def grpc_channel(self, target: str, max_message_bytes: int = MAX_MESSAGE_BYTES) -> grpc.Channel:
        """A channel to `target`, over TLS if this asks for it, that sends and takes messages of images."""
        import grpc

        options = [("grpc.max_send_message_length", max_message_bytes),
                   ("grpc.max_receive_message_length", max_message_bytes)]
        if not self.uses_tls:
            return grpc.insecure_channel(target, options=options)
        credentials = grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca_file), private_key=_read(self.key_file),
            certificate_chain=_read(self.cert_file))
        return grpc.secure_channel(target, credentials, options=options)


def _read(path: str | None) -> bytes | None:
    if not path:
        return None
    with open(path, "rb") as f:
        return f.read()
