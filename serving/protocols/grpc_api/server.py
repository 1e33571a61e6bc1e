"""The gRPC server of one worker: TF Serving's services (and, with --enable_profiler, TensorFlow's profiler
service), KServe V2's and grpc.health.v1 as peers behind `Gate`, on
--port and --grpc_socket_path, with TLS from --ssl_config_file.

Every gunicorn worker runs one of these servers on the same port with SO_REUSEPORT, sharing that worker's
DataPlane (its loaded models and its batcher). The kernel spreads connections over the workers, so gRPC scales
with the workers exactly like REST does and no process ever holds a second copy of a model. With
--grpc_socket_path one worker's server also listens on that Unix socket (unix_socket.py), with the same TLS,
tokens and limits.
"""
from __future__ import annotations

import logging
from concurrent import futures

import grpc
from grpc_health.v1 import health_pb2_grpc
from tensorflow_serving.apis import model_service_pb2_grpc, prediction_service_pb2_grpc

from serving import threads
from serving.core import DataPlane
from serving.options.config import ProtocolOptions, SecurityOptions, TLSOptions, bind_address
from serving.protocols import access_log, auth
from serving.protocols.grpc_api import kserve, profiler, unix_socket
from serving.protocols.grpc_api.gate import Gate
from serving.protocols.grpc_api.health import HealthService
from serving.protocols.grpc_api.tfserving import ModelService, PredictionService, ReloadConfig

log = logging.getLogger(__name__)


def parse_channel_arguments(text: str) -> list[tuple[str, int | str]]:
    """Parse tensorflow_model_server's --grpc_channel_arguments ("k=v,k=v"); integers stay integers."""
    options: list[tuple[str, int | str]] = []
    for item in filter(None, (part.strip() for part in (text or "").split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--grpc_channel_arguments: expected key=value, got {item!r}")
        value = value.strip()
        options.append((key.strip(), int(value) if value.lstrip("-").isdigit() else value))
    return options


def receivers(body_limit: int, o: ProtocolOptions) -> int:
    """How many messages a worker receives at once: as many of the largest as half its budget's body share holds
    (at least one), so that receiving leaves the other half to the requests being served; without a budget, one a
    gRPC thread."""
    return max(1, body_limit // (2 * o.grpc_max_message_bytes)) if body_limit > 0 else o.grpc_max_threads


def server_credentials(tls: TLSOptions) -> grpc.ServerCredentials:
    """TF Serving's SSLConfig as gRPC credentials: with client_verify, a client without a certificate signed by
    custom_ca fails the handshake."""
    return grpc.ssl_server_credentials([(tls.server_key.encode(), tls.server_cert.encode())],
                                       root_certificates=tls.custom_ca.encode() or None,
                                       require_client_auth=tls.client_verify)


def waiting(protocols: ProtocolOptions) -> int:
    """How many calls may wait for a receive slot, holding no thread: as many as twice the threads, so a call that
    gets a place waits at most --request_body_timeout for a slot (and its peer shares the places fairly)."""
    return 2 * protocols.grpc_max_threads


def gate(dataplane: DataPlane, protocols: ProtocolOptions, security: SecurityOptions,
         pool: futures.ThreadPoolExecutor | None = None) -> Gate:
    """The interceptor every call of this worker's server passes (`pool`: the server's, through which the gate
    learns each call and its peer, to share the receive slots fairly and end a call whose message is late)."""
    return Gate(auth.Authenticator(security.tokens, security.enable_model_control), protocols.access_log,
                dataplane.memory.hold, receivers(dataplane.memory.body_limit, protocols),
                min(protocols.grpc_max_message_bytes, dataplane.memory.body_limit), protocols.request_body_timeout,
                pool, waiting(protocols))


def channel_options(protocols: ProtocolOptions) -> list[tuple[str, int | str]]:
    """The server's channel arguments. BDP probing is off, so a stream is held to HTTP/2's initial window until its
    message is asked for (gate.py). Each connection may have at most --grpc_max_threads streams open (HTTP/2's
    SETTINGS_MAX_CONCURRENT_STREAMS, which grpc leaves unlimited): no more of one connection's calls can run at
    once, a client queues the rest itself (grpc clients wait for a stream rather than fail), and one connection
    can no longer queue thousands of calls that never send a message ahead of everyone else's. Connections are
    bounded as the REST port's are: at most --max_connections per worker (grpc refuses the next; unbounded, idle
    ones took every file descriptor of the worker, and REST's port with them), closed after --keepalive_timeout
    without a call, and a handshake must finish within --request_header_timeout (grpc's own default: 120 s).
    --grpc_channel_arguments adds to these and overrides them."""
    max_message = protocols.grpc_max_message_bytes
    options: list[tuple[str, int | str]] = [
        ("grpc.so_reuseport", 1), ("grpc.http2.bdp_probe", 0), ("grpc.max_receive_message_length", max_message),
        ("grpc.max_send_message_length", max_message), ("grpc.max_concurrent_streams", protocols.grpc_max_threads),
        ("grpc.max_allowed_incoming_connections", protocols.max_connections),
        ("grpc.max_connection_idle_ms", round(protocols.keepalive_timeout * 1000)),
        ("grpc.server_handshake_timeout_ms", round(protocols.request_header_timeout * 1000))]
    given = parse_channel_arguments(protocols.grpc_channel_arguments)
    keys = {key for key, _ in given}
    return [option for option in options if option[0] not in keys] + given


def max_calls(protocols: ProtocolOptions, receive_slots: int) -> int:
    """The calls a worker takes at once; past it grpc answers RESOURCE_EXHAUSTED at once. Calls whose message has
    not arrived (receiving it, or waiting for a receive slot) hold no thread and are bounded, and shared fairly, by
    the gate (`receive_slots` + `waiting`); the bound leaves as many again as twice the threads to calls whose
    message is in, running or queued for a thread, so that those stalled can never fill it. Unbounded, a few
    connections of message-less calls kept the queue ahead of every other call longer than its deadline."""
    return receive_slots + waiting(protocols) + 2 * protocols.grpc_max_threads


def start(dataplane: DataPlane, protocols: ProtocolOptions, security: SecurityOptions, runtime_dir: str,
          reload: ReloadConfig | None = None) -> grpc.Server | None:
    """Start the gRPC server on --host:--port (shared with sibling workers through SO_REUSEPORT) and on
    --grpc_socket_path if this worker serves it (`runtime_dir`: the server's private folder, where its workers
    decide which); None when it has neither to serve. The reload RPC calls `reload` (the worker's, which passes
    the config on to its siblings; default: the DataPlane's own)."""
    addresses = [bind_address(protocols.host, protocols.port)] if protocols.port else []
    binding = unix_socket.claim(protocols.grpc_socket_path, runtime_dir) if protocols.grpc_socket_path else None
    if binding is not None:
        addresses.append(binding.address)
    if not addresses:
        return None
    max_message = protocols.grpc_max_message_bytes
    if protocols.access_log:
        access_log.enable()
    pool = futures.ThreadPoolExecutor(max_workers=protocols.grpc_max_threads, thread_name_prefix="grpc",
                                      initializer=threads.name_native_thread, initargs=("petal-grpc",))
    gated = gate(dataplane, protocols, security, pool)
    server = grpc.server(pool, options=channel_options(protocols), interceptors=[gated],
                         maximum_concurrent_rpcs=max_calls(protocols, gated.shares.slots))
    prediction_service_pb2_grpc.add_PredictionServiceServicer_to_server(PredictionService(dataplane, max_message),
                                                                       server)
    model_service_pb2_grpc.add_ModelServiceServicer_to_server(ModelService(dataplane, reload), server)
    health_pb2_grpc.add_HealthServicer_to_server(HealthService(dataplane), server)
    kserve.add_to_server(dataplane, server, max_message)
    if protocols.enable_profiler:
        profiler.add_to_server(dataplane, server)
    for address in addresses:
        try:
            bound = (server.add_secure_port(address, server_credentials(security.tls)) if security.tls else
                     server.add_insecure_port(address))
        except RuntimeError as exc:
            raise OSError(f"cannot bind gRPC to {address}: {exc}") from exc
        if not bound:
            raise OSError(f"cannot bind gRPC to {address}")
    server.start()
    if binding is not None:
        binding.publish()
    log.info("gRPC server started", extra={"fields": {"addresses": addresses, "tls": bool(security.tls),
                                                      "max_message_bytes": max_message}})
    return server
