"""What the registry's tests send and read over gRPC: models, versions streamed in chunks, their
data and numbers."""

from __future__ import annotations

from collections.abc import AsyncIterator

from shared.api import model_registry_pb2 as mr
from tests.helpers.digest import sha256_b64
from tests.helpers.running import RunningRegistry

# Data bytes per CreateVersion body message.
CHUNK = 2 * 1024 * 1024
# Data bytes per body message of `upload` (smaller: several messages for small test data).
UPLOAD_CHUNK = 256 * 1024
# Seconds an upload or a download may take (through an outage, say).
WAIT_S = 30.0


async def create_model(r: RunningRegistry, model_id: str, **user_data: str) -> None:
    await r.stub.CreateOrUpdateModel(
        mr.CreateOrUpdateModelRequest(model_info=mr.ModelInfo(model_id=model_id, user_data=user_data))
    )


def chunks(
    model_id: str, data: bytes, *, archived: bool = True, size: int | None = None, hash_: str | None = None
) -> list[mr.CreateVersionRequestChunk]:
    info = mr.ModelVersionInfo(
        model_id=model_id,
        archived=archived,
        data_size=len(data) if size is None else size,
        data_hash="" if hash_ is None else hash_,
        user_data={"k": "v"},
    )
    messages = [mr.CreateVersionRequestChunk(header=mr.CreateVersionRequestChunk.Header(version_info=info))]
    messages += [
        mr.CreateVersionRequestChunk(body=mr.CreateVersionRequestChunk.Body(data_chunk=data[i : i + CHUNK]))
        for i in range(0, len(data), CHUNK)
    ]
    return messages


async def as_stream(items: list[mr.CreateVersionRequestChunk]) -> AsyncIterator[mr.CreateVersionRequestChunk]:
    for item in items:
        yield item


async def create_version(
    r: RunningRegistry, model_id: str, data: bytes, **kwargs: object
) -> mr.ModelVersionInfo:
    reply = await r.stub.CreateVersion(as_stream(chunks(model_id, data, **kwargs)))  # type: ignore[arg-type]
    return reply.version_info


async def version_data(r: RunningRegistry, model_id: str, number: int) -> list[bytes]:
    request = mr.RetrieveVersionDataRequest(model_id=model_id, version_number=number)
    return [reply.data_chunk async for reply in r.stub.RetrieveVersionData(request)]


def upload_messages(model_id: str, data: bytes) -> list[mr.CreateVersionRequestChunk]:
    info = mr.ModelVersionInfo(
        model_id=model_id, archived=True, data_size=len(data), data_hash=sha256_b64(data)
    )
    return [mr.CreateVersionRequestChunk(header=mr.CreateVersionRequestChunk.Header(version_info=info))] + [
        mr.CreateVersionRequestChunk(
            body=mr.CreateVersionRequestChunk.Body(data_chunk=data[i : i + UPLOAD_CHUNK])
        )
        for i in range(0, len(data), UPLOAD_CHUNK)
    ]


async def upload(registry: RunningRegistry, model_id: str, data: bytes) -> int:
    async def requests() -> AsyncIterator[mr.CreateVersionRequestChunk]:
        for message in upload_messages(model_id, data):
            yield message

    reply = await registry.stub.CreateVersion(requests(), timeout=WAIT_S)
    return int(reply.version_info.version_number)


async def download(registry: RunningRegistry, model_id: str, number: int) -> bytes:
    request = mr.RetrieveVersionDataRequest(model_id=model_id, version_number=number)
    return b"".join(
        [chunk.data_chunk async for chunk in registry.stub.RetrieveVersionData(request, timeout=WAIT_S)]
    )


async def numbers(registry: RunningRegistry, model_id: str) -> list[int]:
    reply = await registry.stub.RetrieveVersionInfos(mr.RetrieveVersionInfosRequest(model_id=model_id))
    return [info.version_number for info in reply.version_infos]
