"""gRPC's health service in process, on a real DataPlane serving the tiny model: the Watch stream and shutdown."""
from __future__ import annotations

from grpc_health.v1 import health_pb2

from server_harness import tiny_model_base
from serving.protocols.grpc_api.health import HealthService


class ActiveContext:
    """A Watch stream whose client stays connected."""

    def is_active(self) -> bool:
        return True


def test_health_watch_reports_not_serving_when_shutdown_lands_between_its_reads(make_dataplane, monkeypatch):
    """The race that tests/e2e/test_grpc.py's graceful-shutdown test once lost: SIGTERM set the flag after Watch had
    read SERVING and before it asked whether to end, so the stream closed without the NOT_SERVING a load balancer
    waits for. The shutdown here lands at exactly that point, on a real DataPlane serving the tiny model."""
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    dataplane = make_dataplane(model_base_path=tiny_model_base(), model_name="flowers")
    repository_ready, reads = dataplane.repository.ready, []

    def ready_then_shut_down() -> bool:
        reads.append(repository_ready())
        if len(reads) == 2:
            dataplane.startup.drain()
        return reads[-1]

    monkeypatch.setattr(dataplane.repository, "ready", ready_then_shut_down)
    watch = HealthService(dataplane).Watch(health_pb2.HealthCheckRequest(service=""), ActiveContext())
    assert [response.status for response in watch] == [serving, not_serving]
    assert reads == [True, True]
