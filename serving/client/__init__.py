"""A small Python client for a Petal server, over REST or gRPC.

    from serving.client import Client
    with Client("localhost:8500", use_grpc=True) as client:
        for p in client.predict([open("rose.jpg", "rb").read()], top_k=3):
            print(p.label, p.score, p.top_k)

Both transports go through TF Serving's Classify, REST's `:classify` (each JPEG as `{"b64"}`) and gRPC's
`Classify`, so both answer alike, with the server's labels (the client needs no label file) and full float32
scores. (REST went through KServe V2 `infer` with Triton's classification extension until 2026-12-03: raw bytes,
but Triton's "score:index:label" strings carry six decimals, so its scores differed from gRPC's.) For a server
started with --auth_token_file pass `token` (sent as `Authorization: Bearer`); with --ssl_config_file pass
`ca_file` (or `tls=True` to trust the system's CAs), and `cert_file`/`key_file` when it asks for client
certificates. Transient failures (HTTP 503, gRPC UNAVAILABLE, a refused connection while a server restarts) are
retried with exponential backoff and full jitter; the caller's mistakes (4xx, or a gRPC code whose HTTP status is
one: serving/status_codes.py) raise RequestError at once. Importing this module imports neither TensorFlow nor
grpc, and a REST client never loads them (an import-linter contract says so); a gRPC client loads both, for TF
Serving's protos (serving/client/grpc_transport.py).
"""
from __future__ import annotations

import base64
import json
import os
import random
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import requests

from serving.client.security import MAX_MESSAGE_BYTES, TOKEN_ENV, Security
from serving.status_codes import Code

__all__ = ["MAX_MESSAGE_BYTES", "TOKEN_ENV", "Client", "PetalError", "Prediction", "RequestError", "Security",
           "ServerError", "from_pairs", "predict", "read_image"]

T = TypeVar("T")
Image = bytes | str | os.PathLike


@dataclass(frozen=True)
class Prediction:
    """One image's answer: the best label and its score, and the top-k (label, score) pairs, best first."""

    label: str
    score: float
    top_k: tuple[tuple[str, float], ...]


class PetalError(Exception):
    """A failed prediction; `code` is a TF status name ("INVALID_ARGUMENT") or "HTTP <status>"."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class RequestError(PetalError):
    """The request was refused (HTTP 4xx, gRPC INVALID_ARGUMENT/NOT_FOUND/...): retrying will not help."""


class ServerError(PetalError):
    """The server failed, stayed unavailable through every retry, or the timeout passed."""


class Retry(Exception):
    """Internal: a transient failure worth another attempt."""

    def __init__(self, error: PetalError) -> None:
        super().__init__(str(error))
        self.error = error


def read_image(image: Image) -> bytes:
    if isinstance(image, bytes):
        return image
    with open(image, "rb") as f:
        return f.read()


def failure(http_status: int, code: str, message: str) -> Exception:
    """A refused or failed request as this client raises it, over either transport: a 4xx is the caller's mistake
    (RequestError); a 503 (gRPC UNAVAILABLE) is worth another attempt (Retry); anything else is a ServerError."""
    if 400 <= http_status < 500:
        return RequestError(code, message)
    if http_status == 503:
        return Retry(ServerError(code, message))
    return ServerError(code, message)


def from_pairs(pairs: Sequence[tuple[str, float]], top_k: int) -> Prediction:
    ranked = tuple(pairs[:top_k])
    if not ranked:
        raise ServerError("INTERNAL", "server returned no classes")
    return Prediction(label=ranked[0][0], score=ranked[0][1], top_k=ranked)


class Client:
    """A connection to one server and model; reuse it, it keeps its HTTP session or gRPC channel open."""

    def __init__(self, server: str = "localhost:8501", *, use_grpc: bool = False, model: str = "flowers",
                 version: int | None = None, timeout: float = 30.0, retries: int = 3, backoff: float = 0.1,
                 max_message_bytes: int = MAX_MESSAGE_BYTES, security: Security = Security()) -> None:
        self.server, self.use_grpc, self.model, self.version = server, use_grpc, model, version
        self.timeout, self.retries, self.backoff = timeout, retries, backoff
        self.metadata = security.grpc_metadata()
        if use_grpc:
            from serving.client.grpc_transport import classify_stub

            self.channel = security.grpc_channel(server, max_message_bytes)
            self.stub = classify_stub(self.channel)
        else:
            self.session = requests.Session()
            self.session.headers.update(security.header())
            self.tls_arguments = security.requests_arguments()
            base = server if "://" in server else f"{'https' if security.uses_tls else 'http'}://{server}"
            path = f"/v1/models/{model}" + (f"/versions/{version}" if version is not None else "")
            self.classify_url = f"{base}{path}:classify"

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        if self.use_grpc:
            self.channel.close()
        else:
            self.session.close()

    def predict(self, images: Sequence[Image], top_k: int = 3) -> list[Prediction]:
        """Classify images (encoded bytes or file paths) in one request; one Prediction per image, in order."""
        if top_k < 1:
            raise ValueError("top_k must be at least 1")
        data = [read_image(image) for image in images]
        if not data:
            return []
        call = self._grpc_predict if self.use_grpc else self._rest_predict
        return self._with_retries(lambda deadline: call(data, top_k, deadline))

    def _with_retries(self, attempt: Callable[[float], T]) -> T:
        deadline = time.monotonic() + self.timeout
        for number in range(self.retries + 1):
            try:
                return attempt(deadline)
            except Retry as retry:
                pause = random.uniform(0, self.backoff * 2 ** number)
                if number == self.retries or time.monotonic() + pause >= deadline:
                    raise retry.error from None
                time.sleep(pause)
        raise AssertionError("unreachable")

    def _grpc_predict(self, data: list[bytes], top_k: int, deadline: float) -> list[Prediction]:
        import grpc

        from serving.client.grpc_transport import classify_request

        request = classify_request(self.model, self.version, data)
        try:
            response = self.stub.Classify(request, timeout=max(deadline - time.monotonic(), 0.001),
                                          metadata=self.metadata)
        except grpc.RpcError as err:
            code = Code[err.code().name]
            raise failure(code.http_status, code.name, err.details() or "") from None
        return [from_pairs([(c.label, c.score) for c in row.classes], top_k)
                for row in response.result.classifications]

    def _rest_predict(self, data: list[bytes], top_k: int, deadline: float) -> list[Prediction]:
        body = json.dumps({"examples": [{"image_bytes": {"b64": base64.b64encode(image).decode()}}
                                        for image in data]})
        try:
            response = self.session.post(
                self.classify_url, data=body, timeout=max(deadline - time.monotonic(), 0.001),
                headers={"Content-Type": "application/json"}, **self.tls_arguments)
        except requests.Timeout as exc:
            raise ServerError("DEADLINE_EXCEEDED", f"no answer from {self.classify_url} in time: {exc}") from None
        except requests.exceptions.SSLError as exc:  # a certificate problem does not go away on a retry
            raise ServerError("UNAVAILABLE", f"TLS with {self.classify_url} failed: {exc}") from None
        except requests.ConnectionError as exc:
            raise Retry(ServerError("UNAVAILABLE", f"cannot connect to {self.classify_url}: {exc}")) from None
        if response.status_code != 200:
            try:
                message = response.json()["error"]
            except (ValueError, KeyError, TypeError):
                message = response.text[:500]
            raise failure(response.status_code, f"HTTP {response.status_code}", message)
        return [from_pairs([(label, as_float32(score)) for label, score in row], top_k)
                for row in response.json()["results"]]


def as_float32(score: float) -> float:
    """A score as gRPC's float32 gives it: TF Serving's JSON writes a float32 in the fewest digits that read back
    as it (0.9999999), which Python reads as the double nearest that decimal, not as the float32's own value
    (0.9999998807907104)."""
    return struct.unpack("f", struct.pack("f", score))[0]


def predict(images: Sequence[Image], server: str = "localhost:8501", *, model: str = "flowers",
            top_k: int = 3, use_grpc: bool = False, timeout: float = 30.0,
            security: Security = Security()) -> list[Prediction]:
    """One-shot convenience: open a Client, classify, close."""
    with Client(server, use_grpc=use_grpc, model=model, timeout=timeout, security=security) as client:
        return client.predict(images, top_k=top_k)
