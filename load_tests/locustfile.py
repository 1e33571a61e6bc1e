r"""Locust users for a Petal (or TF Serving) deployment: REST :predict, REST :classify_image, gRPC Predict and
KServe V2 infer, each a closed loop with no think time, so `--users` is the concurrency.

Run it through `petal loadtest` (which adds the SLO check, reports and the sweep), or directly:

    locust -f load_tests/locustfile.py --headless -u 4 -t 30s --host http://127.0.0.1:8501 \
        --images DIR --grpc-host 127.0.0.1:8500 --weights rest_predict=1,grpc_predict=1

Request bodies are built once per image at start-up, so the load generator spends its CPU on sending, not on
base64 and JSON, and the numbers measure the server. A secured server: `--token` (or $PETAL_TOKEN) for
--auth_token_file, `--ca-file` (and `--cert-file`/`--key-file` for client_verify) for --ssl_config_file; the REST
host is then an https:// URL.
"""
from __future__ import annotations

import base64
import json
import random
import time
from pathlib import Path

# Locust first: importing it monkey-patches the process with gevent, which grpc's gevent support requires.
from locust import FastHttpUser, User, constant, events, task

# isort: split
import gevent
import grpc
import grpc.experimental.gevent as grpc_gevent

from load_tests.slo import ENDPOINTS, SLOError, parse_weights
from serving.client.security import TOKEN_ENV, Security

grpc_gevent.init_gevent()  # without this a blocking gRPC call stalls every other simulated user

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".gif", ".bmp"}


def load_images(folder: str) -> list[bytes]:
    paths = sorted(p for p in Path(folder).rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
    if not paths:
        raise SystemExit(f"--images {folder}: no image files ({', '.join(sorted(IMAGE_SUFFIXES))}) found")
    return [p.read_bytes() for p in paths]


@events.init_command_line_parser.add_listener
def add_arguments(parser) -> None:
    group = parser.add_argument_group("Petal")
    group.add_argument("--images", default="", help="folder of images to send (searched recursively)")
    group.add_argument("--model-name", default="flowers", help="model name in the request paths")
    group.add_argument("--grpc-host", default="127.0.0.1:8500", help="host:port of the gRPC endpoint")
    group.add_argument("--weights", default="", help=f"NAME=N,... with NAME in {', '.join(ENDPOINTS)};"
                                                     " endpoints left out get no traffic (default: all, weight 1)")
    group.add_argument("--request-timeout", type=float, default=60.0, help="seconds before a request fails")
    group.add_argument("--token", env_var=TOKEN_ENV, default="", help=f"bearer token (default: ${TOKEN_ENV})")
    group.add_argument("--ca-file", default="", help="TLS: the CA (PEM) to verify the server with")
    group.add_argument("--cert-file", default="", help="TLS: client certificate (PEM) for mutual TLS")
    group.add_argument("--key-file", default="", help="TLS: its private key (PEM)")


def security(options) -> Security:
    """What the server asks of its clients, from the Petal flags."""
    return Security(options.token, ca_file=options.ca_file, cert_file=options.cert_file, key_file=options.key_file)


@events.init.add_listener
def on_init(environment, **_kwargs) -> None:
    """Apply --weights (dropping weight-0 users) and the timeout, and build every request body before the
    clock starts."""
    options = environment.parsed_options
    if options is None:  # used as a library: the caller configures the classes
        return
    try:
        weights = parse_weights(options.weights) if options.weights else dict.fromkeys(ENDPOINTS, 1)
    except SLOError as exc:
        raise SystemExit(str(exc)) from exc
    for user_class in environment.user_classes:
        user_class.weight = weights.get(user_class.endpoint, 0)
        user_class.network_timeout = user_class.connection_timeout = options.request_timeout
    environment.user_classes[:] = [c for c in environment.user_classes if c.weight > 0]
    if not environment.user_classes:
        raise SystemExit(f"--weights {options.weights!r} selects none of this file's users")
    if not options.images:
        raise SystemExit("--images DIR is required (petal loadtest makes a synthetic corpus for you)")
    images = load_images(options.images)
    for user_class in environment.user_classes:
        user_class.prepare(images, options)
    # Locust arms --run-time with gevent.spawn_later, timed from the event loop's cached clock; after this
    # blocking set-up that clock is seconds stale and the run would end early by as much.
    gevent.get_hub().loop.update_now()


def _error_message(body: bytes) -> str:
    """The server's {"error": ...} message, or the start of whatever else it sent."""
    try:
        return str(json.loads(body)["error"])
    except (ValueError, KeyError, TypeError):
        return body[:200].decode("utf-8", "replace")


class _RestUser(FastHttpUser):
    """Shared by the HTTP users: one JSON or raw body per image, a check on the answer's shape."""

    abstract = True
    wait_time = constant(0)
    endpoint = ""
    content_type = "application/json"
    path = ""
    bodies: list[bytes] = []

    @staticmethod
    def encode(image: bytes) -> bytes:
        raise NotImplementedError

    @staticmethod
    def valid(answer: dict) -> bool:
        raise NotImplementedError

    @classmethod
    def route(cls, model_name: str) -> str:
        raise NotImplementedError

    headers: dict[str, str] = {}

    @classmethod
    def prepare(cls, images: list[bytes], options) -> None:
        cls.path = cls.route(options.model_name)
        cls.bodies = [cls.encode(image) for image in images]
        secured = security(options)
        cls.headers = {"Content-Type": cls.content_type, **secured.header()}
        if secured.uses_tls:
            cls.insecure, cls.ssl_context_factory = False, staticmethod(secured.ssl_context)

    @task
    def send(self) -> None:
        body = random.choice(self.bodies)
        with self.client.post(self.path, data=body, headers=self.headers,
                              name=self.endpoint, catch_response=True) as response:
            if not response.status_code:  # no HTTP answer at all: refused, reset or timed out
                response.failure(f"connection failed: {response.error!r}")
                return
            if response.status_code != 200:
                response.failure(f"HTTP {response.status_code}: {_error_message(response.content or b'')}")
                return
            try:
                ok = self.valid(json.loads(response.content))
            except (ValueError, TypeError, KeyError, IndexError):
                ok = False
            if not ok:
                response.failure(f"unexpected answer: {(response.content or b'')[:200]!r}")


class RestPredictUser(_RestUser):
    """TF Serving's row format with the JPEG as {"b64": ...}: what most REST clients send."""

    endpoint = "rest_predict"

    @classmethod
    def route(cls, model_name: str) -> str:
        return f"/v1/models/{model_name}:predict"

    @staticmethod
    def encode(image: bytes) -> bytes:
        return json.dumps({"instances": [{"b64": base64.b64encode(image).decode()}]}).encode()

    @staticmethod
    def valid(answer: dict) -> bool:
        return len(answer["predictions"]) == 1


class RestClassifyImageUser(_RestUser):
    """Petal's raw-bytes route: no base64 or JSON on the way in."""

    endpoint = "rest_classify_image"
    content_type = "image/jpeg"

    @classmethod
    def route(cls, model_name: str) -> str:
        return f"/v1/models/{model_name}:classify_image"

    @staticmethod
    def encode(image: bytes) -> bytes:
        return image

    @staticmethod
    def valid(answer: dict) -> bool:
        return len(answer["predictions"]) >= 1 and "label" in answer["predictions"][0]


class V2InferUser(_RestUser):
    """KServe V2 / Open Inference Protocol with the JPEG as a base64 BYTES element."""

    endpoint = "v2_infer"

    @classmethod
    def route(cls, model_name: str) -> str:
        return f"/v2/models/{model_name}/infer"

    @staticmethod
    def encode(image: bytes) -> bytes:
        return json.dumps({"inputs": [{"name": "image_bytes", "shape": [1], "datatype": "BYTES",
                                       "parameters": {"content_type": "base64"},
                                       "data": [base64.b64encode(image).decode()]}]}).encode()

    @staticmethod
    def valid(answer: dict) -> bool:
        return bool(answer["outputs"])


class GrpcError(Exception):
    """A failed RPC as Locust shows it: status code and the server's message, not grpc's repr."""


class GrpcPredictUser(User):
    """TF Serving's PredictionService.Predict; fires Locust's request event with the real time and error."""

    wait_time = constant(0)
    endpoint = "grpc_predict"
    requests: list = []

    @classmethod
    def prepare(cls, images: list[bytes], options) -> None:
        """The protos pull in TensorFlow, a multi-second import that runs here, before the clock starts, and
        only when this user has traffic."""
        import tensorflow as tf
        from tensorflow_serving.apis import predict_pb2

        cls.requests = []
        for image in images:
            request = predict_pb2.PredictRequest()
            request.model_spec.name = options.model_name
            request.inputs["image_bytes"].CopyFrom(tf.make_tensor_proto([image], dtype=tf.string))
            cls.requests.append(request)

    def on_start(self) -> None:
        from tensorflow_serving.apis import prediction_service_pb2_grpc  # imported already by prepare()

        options = self.environment.parsed_options
        secured = security(options)
        self.timeout = options.request_timeout
        self.metadata = secured.grpc_metadata()
        self.channel = secured.grpc_channel(options.grpc_host)
        self.stub = prediction_service_pb2_grpc.PredictionServiceStub(self.channel)

    def on_stop(self) -> None:
        self.channel.close()

    @task
    def predict(self) -> None:
        request = random.choice(self.requests)
        started = time.perf_counter()
        length, error = 0, None
        try:
            response = self.stub.Predict(request, timeout=self.timeout, metadata=self.metadata)
            length = response.ByteSize()
            if "probabilities" not in response.outputs:
                error = GrpcError(f"unexpected answer: outputs {sorted(response.outputs)}")
        except grpc.RpcError as exc:
            error = GrpcError(f"{exc.code().name}: {exc.details()}")
        self.environment.events.request.fire(
            request_type="grpc", name=self.endpoint, response_time=(time.perf_counter() - started) * 1000.0,
            response_length=length, exception=error, context={})
