"""grpc.health.v1 over a worker's DataPlane, beside TF Serving's and KServe's services on the gRPC port."""
from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from serving.core import DataPlane

HEALTH_WATCH_PERIOD_S = 0.2


class HealthService(health_pb2_grpc.HealthServicer):
    """grpc.health.v1 read live from the DataPlane, so it turns NOT_SERVING the moment shutdown begins.

    Service "" is the whole server; a model name is that model. Watch streams end after reporting
    NOT_SERVING for a shutdown, so that they do not keep the worker alive through its grace period.
    """

    def __init__(self, dataplane: DataPlane) -> None:
        self.dataplane = dataplane

    def serving_status(self, service: str) -> int | None:
        if not service:
            ready = self.dataplane.ready()
        elif service in self.dataplane.model_names():
            ready = self.dataplane.model_ready(service)
        else:
            return None
        return health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING

    def Check(self, request: health_pb2.HealthCheckRequest, context: grpc.ServicerContext) -> Any:
        status = self.serving_status(request.service)
        if status is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"Unknown service: {request.service}")
        return health_pb2.HealthCheckResponse(status=status)

    def Watch(self, request: health_pb2.HealthCheckRequest, context: grpc.ServicerContext) -> Iterator[Any]:
        last = None
        while context.is_active():
            ending = self.dataplane.draining()  # read before the status, so a status read after it is NOT_SERVING
            status = self.serving_status(request.service)
            status = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN if status is None else status
            if status != last:
                last = status
                yield health_pb2.HealthCheckResponse(status=status)
            if ending:
                return  # NOT_SERVING was sent; an open stream must not hold the graceful shutdown up
            time.sleep(HEALTH_WATCH_PERIOD_S)

