"""Directory calls over real gRPC, as the directory tests make them: registration requests,
Register / Deregister / Inquire streams with an optional `authentication-token`, and the wire
constants they use."""

from __future__ import annotations

from collections.abc import AsyncIterator

from shared.api import directory_pb2
from tests.helpers.running import RunningDirectory

OK = directory_pb2.RegisterReply.OK
FAILED = directory_pb2.RegisterReply.FAILED
GRPC = directory_pb2.ServiceEndpoint.GRPC
GRPC_SSL = directory_pb2.ServiceEndpoint.GRPC_SSL
COGMENT = directory_pb2.ServiceEndpoint.COGMENT
ACTOR = directory_pb2.ACTOR_SERVICE
ENVIRONMENT = directory_pb2.ENVIRONMENT_SERVICE
OTHER = directory_pb2.OTHER_SERVICE


def request(
    service_type: int = ACTOR,
    properties: dict[str, str] | None = None,
    *,
    host: str = "client",
    port: int = 0,
    protocol: int = COGMENT,
    permanent: bool = False,
) -> directory_pb2.RegisterRequest:
    return directory_pb2.RegisterRequest(
        endpoint=directory_pb2.ServiceEndpoint(protocol=protocol, host=host, port=port),  # type: ignore[arg-type]
        details=directory_pb2.ServiceDetails(type=service_type, properties=properties or {}),  # type: ignore[arg-type]
        permanent=permanent,
    )


def metadata(token: str | None) -> tuple[tuple[str, str], ...] | None:
    return None if token is None else (("authentication-token", token),)


async def _stream(items: list[object]) -> AsyncIterator[object]:
    for item in items:
        yield item


async def register(
    d: RunningDirectory, *requests: directory_pb2.RegisterRequest, token: str | None = None
) -> list[directory_pb2.RegisterReply]:
    return [reply async for reply in d.stub.Register(_stream(list(requests)), metadata=metadata(token))]


async def register_ok(
    d: RunningDirectory, *requests: directory_pb2.RegisterRequest, token: str | None = None
) -> list[int]:
    replies = await register(d, *requests, token=token)
    assert [reply.status for reply in replies] == [OK] * len(requests), replies
    return [reply.service_id for reply in replies]


async def deregister(
    d: RunningDirectory, *pairs: tuple[int, str], token: str | None = None
) -> list[directory_pb2.DeregisterReply]:
    requests = [directory_pb2.DeregisterRequest(service_id=sid, secret=secret) for sid, secret in pairs]
    return [reply async for reply in d.stub.Deregister(_stream(list(requests)), metadata=metadata(token))]


async def inquire(
    d: RunningDirectory,
    *,
    service_id: int | None = None,
    service_type: int = directory_pb2.UNKNOWN_SERVICE,
    properties: dict[str, str] | None = None,
    token: str | None = None,
) -> list[directory_pb2.FullServiceData]:
    if service_id is not None:
        req = directory_pb2.InquireRequest(service_id=service_id)
    else:
        details = directory_pb2.ServiceDetails(type=service_type, properties=properties or {})  # type: ignore[arg-type]
        req = directory_pb2.InquireRequest(details=details)
    return [reply.data async for reply in d.stub.Inquire(req, metadata=metadata(token))]


async def visible_ids(d: RunningDirectory, **kwargs: object) -> list[int]:
    return [data.service_id for data in await inquire(d, **kwargs)]  # type: ignore[arg-type]
