"""The grpc.health.v1 status of a service, as Kubernetes' probes see it."""

from __future__ import annotations

import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.helpers.eventually import eventually

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
WAIT_S = 20.0


async def health(channel: grpc.aio.Channel, service: str = "") -> int:
    request = health_pb2.HealthCheckRequest(service=service)
    reply = await health_pb2_grpc.HealthStub(channel).Check(request, timeout=5)
    return int(reply.status)


async def wait_for_health(channel: grpc.aio.Channel, status: int, service: str = "") -> float:
    """Seconds until `service` reports `status` (at most WAIT_S)."""
    started = time.monotonic()

    async def reached() -> bool:
        return await health(channel, service) == status

    await eventually(reached, f"health {status}", WAIT_S)
    return time.monotonic() - started
