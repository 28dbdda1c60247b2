"""Model Registry behaviour over real gRPC: on SQLite with the local blob store, and on
PostgreSQL with a real S3 server (SeaweedFS)."""

from __future__ import annotations

import asyncio
import secrets
import time
import types
from collections.abc import AsyncIterator, Callable

import grpc
import pytest
from sqlalchemy import select

import services.model_registry.core as registry_core
from services.model_registry.blobstore import BlobNotFound
from services.model_registry.model import VersionInfo
from services.model_registry.servicer import data_chunk_frame
from shared.api import model_registry_pb2 as mr
from shared.schema import registry_blob_garbage
from tests.helpers.digest import sha256_b64
from tests.helpers.eventually import eventually
from tests.helpers.exposed_metrics import delta, exposed
from tests.helpers.lost_answers import lose_an_answer
from tests.helpers.registry import CHUNK, as_stream, chunks, create_model, create_version, version_data
from tests.helpers.running import RegistryFactory, RunningRegistry

METRICS = "cogment_model_registry_"


@pytest.fixture
async def registry(registry_factory: RegistryFactory) -> AsyncIterator[RunningRegistry]:
    async with registry_factory() as running:
        yield running


async def infos(r: RunningRegistry, model_id: str, numbers: list[int] | None = None, count: int = 0,
                handle: str = "") -> tuple[list[int], str]:  # fmt: skip
    reply = await r.stub.RetrieveVersionInfos(
        mr.RetrieveVersionInfosRequest(
            model_id=model_id, version_numbers=numbers or [], versions_count=count, version_handle=handle
        )
    )
    return [info.version_number for info in reply.version_infos], reply.next_version_handle


async def expect_error(code: grpc.StatusCode, call: object) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await call  # type: ignore[misc]
    assert error.value.code() == code, error.value.details()
    return error.value.details() or ""


async def test_models_are_created_updated_listed_and_deleted(registry: RunningRegistry) -> None:
    for model_id in ("foo", "bar", "baz"):
        await create_model(registry, model_id, owner=model_id)
    await create_model(registry, "foo", owner="someone else")
    reply = await registry.stub.RetrieveModels(mr.RetrieveModelsRequest())
    assert [m.model_id for m in reply.model_infos] == ["bar", "baz", "foo"]
    assert dict(reply.model_infos[2].user_data) == {"owner": "someone else"}
    assert reply.next_model_handle == "3"
    page = await registry.stub.RetrieveModels(mr.RetrieveModelsRequest(models_count=2, model_handle="1"))
    assert [m.model_id for m in page.model_infos] == ["baz", "foo"] and page.next_model_handle == "3"
    chosen = await registry.stub.RetrieveModels(mr.RetrieveModelsRequest(model_ids=["foo", "bar"]))
    assert [m.model_id for m in chosen.model_infos] == ["foo", "bar"]
    await expect_error(
        grpc.StatusCode.NOT_FOUND, registry.stub.RetrieveModels(mr.RetrieveModelsRequest(model_ids=["nope"]))
    )
    await expect_error(
        grpc.StatusCode.INVALID_ARGUMENT,
        registry.stub.RetrieveModels(mr.RetrieveModelsRequest(model_handle="x")),
    )
    await registry.stub.DeleteModel(mr.DeleteModelRequest(model_id="bar"))
    await expect_error(
        grpc.StatusCode.NOT_FOUND, registry.stub.DeleteModel(mr.DeleteModelRequest(model_id="bar"))
    )
    await expect_error(
        grpc.StatusCode.INVALID_ARGUMENT, registry.stub.CreateOrUpdateModel(mr.CreateOrUpdateModelRequest())
    )


async def test_versions_are_numbered_from_one_and_their_data_streams_back(registry: RunningRegistry) -> None:
    await create_model(registry, "m")
    small = b"hello"
    big = secrets.token_bytes(5 * 1024 * 1024 + 17)
    first = await create_version(registry, "m", small, hash_=sha256_b64(small))
    second = await create_version(registry, "m", big, archived=False)
    empty = await create_version(registry, "m", b"")
    assert [first.version_number, second.version_number, empty.version_number] == [1, 2, 3]
    assert (second.data_size, second.data_hash, second.archived) == (len(big), sha256_b64(big), False)
    assert dict(first.user_data) == {"k": "v"} and first.creation_timestamp > 0
    assert b"".join(await version_data(registry, "m", 1)) == small
    big_chunks = await version_data(registry, "m", 2)
    assert b"".join(big_chunks) == big and [len(c) for c in big_chunks[:-1]] == [CHUNK, CHUNK]
    assert await version_data(registry, "m", -1) == [b""]  # one empty chunk for no data
    assert b"".join(await version_data(registry, "m", -3)) == small
    for bad in (0, 4, -4):
        await expect_error(grpc.StatusCode.NOT_FOUND, version_data(registry, "m", bad))
    await expect_error(grpc.StatusCode.NOT_FOUND, version_data(registry, "nope", -1))


async def test_rejected_uploads_leave_no_version(registry: RunningRegistry) -> None:
    await create_model(registry, "m")
    data = secrets.token_bytes(3 * 1024 * 1024)
    cases = [
        (chunks("m", data, size=len(data) + 1), grpc.StatusCode.INVALID_ARGUMENT),
        (chunks("m", data, size=len(data) - 1), grpc.StatusCode.INVALID_ARGUMENT),
        (chunks("m", data, hash_=sha256_b64(b"other")), grpc.StatusCode.INVALID_ARGUMENT),
        (chunks("m", data)[1:], grpc.StatusCode.INVALID_ARGUMENT),  # a body first
        ([], grpc.StatusCode.INVALID_ARGUMENT),  # an empty stream
        (chunks("m", data) + chunks("m", b"x")[:1], grpc.StatusCode.INVALID_ARGUMENT),  # a second header
        (chunks("unknown", data), grpc.StatusCode.NOT_FOUND),
    ]
    for messages, code in cases:
        await expect_error(code, registry.stub.CreateVersion(as_stream(messages)))  # type: ignore[arg-type]
    assert await infos(registry, "m") == ([], "0")
    assert (await create_version(registry, "m", data)).version_number == 1  # no gap


async def test_an_upload_whose_commit_answer_was_lost_makes_one_version(
    registry: RunningRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The database committed the version and its answer was lost with the connection: the
    registry commits again once the database answers, finds the version it made, and the client
    is told of it, the only one; its blob is the version's, never collected as garbage."""
    await create_model(registry, "m")
    data = secrets.token_bytes(CHUNK + 17)
    before = exposed(METRICS)
    with monkeypatch.context() as patch:
        lost = lose_an_answer(
            patch, registry.service.database, of=lambda result: isinstance(result, VersionInfo)
        )
        info = await create_version(registry, "m", data, hash_=sha256_b64(data))
    assert [version.version_number for version in lost] == [1]  # the answer was lost, after the commit
    assert (info.version_number, info.data_hash, info.data_size) == (1, sha256_b64(data), len(data))
    assert await infos(registry, "m") == ([1], "2")
    assert delta(before, exposed(METRICS), METRICS + "versions_created_total", archived="true") == 1

    # Not garbage: the collector leaves it, even once an abandoned upload's blob would go.
    database = registry.service.database
    assert await database.fetch(select(registry_blob_garbage.c.blob_key)) == []
    later = types.SimpleNamespace(
        time_ns=lambda: time.time_ns() + int(2 * registry_core.STALE_UPLOAD_S * 1e9)
    )
    monkeypatch.setattr(registry_core, "time", later)
    assert await registry.service.registry.collect_garbage() == 0
    record = await registry.service.registry.resolve("m", 1)
    assert b"".join([chunk async for chunk in registry.service.blobs.read(record.blob_key, CHUNK)]) == data


async def test_an_early_rejection_reaches_a_client_that_is_still_writing(registry: RunningRegistry) -> None:
    """The server drains what is left of a rejected request stream, so that grpc's asyncio client
    (grpc/grpc#36066), writing chunk by chunk as the command-line client does, gets the real status
    rather than INTERNAL "Internal error from Core"."""
    data = secrets.token_bytes(8 * CHUNK)
    for _ in range(20):
        call = registry.stub.CreateVersion()
        with pytest.raises(grpc.aio.AioRpcError) as rejected:
            for message in chunks("unknown", data):
                await call.write(message)
            await call.done_writing()
            await call
        assert rejected.value.code() == grpc.StatusCode.NOT_FOUND, rejected.value.details()


async def test_a_listing_too_large_for_one_reply_is_cut_with_a_next_handle(registry: RunningRegistry) -> None:
    """Clients refuse replies over 4 MiB (the SDK among them): an unpaged listing is cut to fit,
    and its next handle leads to the rest."""
    big = {"blob": "x" * (900 * 1024)}  # under MAX_USER_DATA_BYTES; six are over 4 MiB
    for index in range(6):
        await create_model(registry, f"m{index}", **big)
    seen: list[str] = []
    handle = ""
    while True:
        reply = await registry.stub.RetrieveModels(mr.RetrieveModelsRequest(model_handle=handle))
        if not reply.model_infos:
            break
        assert 0 < len(reply.model_infos) < 6  # several replies: none over the client's limit
        seen += [info.model_id for info in reply.model_infos]
        handle = reply.next_model_handle
    assert seen == [f"m{index}" for index in range(6)]


async def test_many_version_numbers_are_resolved_at_once(registry: RunningRegistry) -> None:
    await create_model(registry, "m")
    for _ in range(3):
        await create_version(registry, "m", b"data")
    assert await infos(registry, "m", [1, -1, 2, -3] * 2500) == ([1, 3, 2, 1] * 2500, "2")
    with pytest.raises(grpc.aio.AioRpcError) as missing:
        await infos(registry, "m", [1] * 1000 + [-4])
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND
    assert 'no version "-4"' in (missing.value.details() or "")


async def test_version_infos_paging_as_the_reference(registry: RunningRegistry) -> None:
    await create_model(registry, "m")
    for _ in range(10):
        await create_version(registry, "m", b"x")
    assert await infos(registry, "m", count=5) == ([1, 2, 3, 4, 5], "6")
    assert await infos(registry, "m", handle="7") == ([7, 8, 9, 10], "11")
    assert await infos(registry, "m", handle="11") == ([], "11")
    assert await infos(registry, "m", numbers=[1]) == ([1], "2")
    assert await infos(registry, "m", numbers=[-1]) == ([10], "11")
    assert await infos(registry, "m", numbers=[-2, 5]) == ([9, 5], "6")
    await expect_error(grpc.StatusCode.NOT_FOUND, infos(registry, "m", numbers=[28]))
    await expect_error(grpc.StatusCode.NOT_FOUND, infos(registry, "nope"))
    await expect_error(grpc.StatusCode.INVALID_ARGUMENT, infos(registry, "m", handle="-1"))


async def test_transient_versions_are_evicted_least_recently_used_first(
    registry_factory: RegistryFactory,
) -> None:
    async with registry_factory("--cache_max_items", "2") as registry:
        await create_model(registry, "m")
        await create_version(registry, "m", b"archived")
        for i in range(2):
            await create_version(registry, "m", f"transient {i}".encode(), archived=False)
        await version_data(registry, "m", 2)  # v2 is now more recently used than v3
        await create_version(registry, "m", b"transient 2", archived=False)
        assert (await infos(registry, "m"))[0] == [1, 2, 4]
    async with registry_factory("--cache_max_items", "2") as registry:  # both kinds survive a restart
        assert (await infos(registry, "m"))[0] == [1, 2, 4]
        assert b"".join(await version_data(registry, "m", 4)) == b"transient 2"
        assert (await create_version(registry, "m", b"next")).version_number == 5


async def test_concurrent_uploads_get_distinct_consecutive_numbers(registry_factory: RegistryFactory) -> None:
    async with registry_factory() as first, registry_factory() as second:
        await create_model(first, "m")
        uploads = [create_version(r, "m", secrets.token_bytes(1000)) for r in (first, second) * 6]
        numbers = sorted(info.version_number for info in await asyncio.gather(*uploads))
        assert numbers == list(range(1, 13))


async def test_version_update_sends_the_latest_then_each_new_version(
    registry_factory: RegistryFactory,
) -> None:
    async with registry_factory() as first, registry_factory() as second:
        await create_model(first, "m")
        await expect_error(
            grpc.StatusCode.INVALID_ARGUMENT,
            first.stub.VersionUpdate(mr.VersionUpdateRequest(model_id="nope")).read(),
        )
        await create_version(first, "m", b"1")
        await create_version(first, "m", b"2")
        updates = second.stub.VersionUpdate(mr.VersionUpdateRequest(model_id="m"))
        assert (await asyncio.wait_for(updates.read(), 5)).version_info.version_number == 2
        await create_version(first, "m", b"3", archived=False)  # through the other replica
        assert (await asyncio.wait_for(updates.read(), 2)).version_info.version_number == 3
        updates.cancel()


async def test_deleted_models_blobs_are_collected(
    registry: RunningRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(registry_core, "GARBAGE_GRACE_S", 0.0)
    await create_model(registry, "m")
    for _ in range(3):
        await create_version(registry, "m", b"data")
    record = await registry.service.registry.resolve("m", 1)
    await registry.stub.DeleteModel(mr.DeleteModelRequest(model_id="m"))
    await expect_error(grpc.StatusCode.NOT_FOUND, infos(registry, "m"))
    assert await registry.service.registry.collect_garbage() == 3
    with pytest.raises(BlobNotFound):
        _ = [chunk async for chunk in registry.service.blobs.read(record.blob_key, 1024)]
    await create_model(registry, "m")  # a deleted model id can be created again, from version 1
    assert (await create_version(registry, "m", b"again")).version_number == 1


async def test_hot_versions_are_read_once_and_never_stale(registry: RunningRegistry) -> None:
    blobs = registry.service.blobs
    reads = 0
    original_read, original_read_into = blobs.read, blobs.read_into

    def counting_read(key: str, chunk_size: int) -> AsyncIterator[bytes]:
        nonlocal reads
        reads += 1
        return original_read(key, chunk_size)

    async def counting_read_into(
        key: str, buffer: memoryview, arrived: Callable[[int], None], *, chunk_size: int
    ) -> None:
        nonlocal reads
        reads += 1
        await original_read_into(key, buffer, arrived, chunk_size=chunk_size)

    blobs.read = counting_read  # type: ignore[method-assign]
    blobs.read_into = counting_read_into  # type: ignore[method-assign]
    await create_model(registry, "hot")
    data = secrets.token_bytes(3 * 1024 * 1024)
    await create_version(registry, "hot", data)
    downloads = await asyncio.gather(*(version_data(registry, "hot", 1) for _ in range(20)))
    assert all(b"".join(chunks) == data for chunks in downloads)
    assert reads == 1
    # The same model id and number after a deletion is other data: it is read anew.
    await registry.stub.DeleteModel(mr.DeleteModelRequest(model_id="hot"))
    await create_model(registry, "hot")
    await create_version(registry, "hot", b"new data")
    assert b"".join(await version_data(registry, "hot", 1)) == b"new data"
    assert reads == 2


async def test_version_update_streams_of_a_model_share_one_watch(registry: RunningRegistry) -> None:
    await create_model(registry, "w")
    await create_version(registry, "w", b"1")
    streams = [registry.stub.VersionUpdate(mr.VersionUpdateRequest(model_id="w")) for _ in range(10)]
    firsts = await asyncio.wait_for(asyncio.gather(*(stream.read() for stream in streams)), 5)
    assert {reply.version_info.version_number for reply in firsts} == {1}
    assert list(registry.service.registry._watches) == ["w"]
    await create_version(registry, "w", b"2")
    seconds = await asyncio.wait_for(asyncio.gather(*(stream.read() for stream in streams)), 5)
    assert {reply.version_info.version_number for reply in seconds} == {2}
    for stream in streams:
        stream.cancel()
    # The last stream gone, its watch stops.
    await eventually(lambda: registry.service.registry._watches == {}, "the watch to stop", timeout_s=2.5)


@pytest.mark.parametrize("size", [0, 1, 127, 128, 300, 16_383, 16_384, 2 * 1024 * 1024, 4 * 1024 * 1024 - 1])
def test_data_chunk_frames_are_the_protobuf_encoding(size: int) -> None:
    chunk = secrets.token_bytes(size)
    frame = data_chunk_frame(chunk)
    assert frame == mr.RetrieveVersionDataReplyChunk(data_chunk=chunk).SerializeToString()
    assert mr.RetrieveVersionDataReplyChunk.FromString(frame).data_chunk == chunk


async def test_requests_over_a_limit_are_refused_naming_it(registry: RunningRegistry) -> None:
    cases = [
        (registry.stub.DeleteModel(mr.DeleteModelRequest(model_id="m" * (256 * 1024 + 1))), "MAX_ID_BYTES"),
        (
            registry.stub.CreateOrUpdateModel(
                mr.CreateOrUpdateModelRequest(
                    model_info=mr.ModelInfo(model_id="m", user_data={"k": "v" * 1024 * 1024})
                )
            ),
            "MAX_USER_DATA_BYTES",
        ),
        (
            registry.stub.RetrieveVersionInfos(
                mr.RetrieveVersionInfosRequest(model_id="m", version_numbers=[1] * 10_001)
            ),
            "MAX_LISTED_ITEMS",
        ),
        (
            registry.stub.RetrieveModels(mr.RetrieveModelsRequest(model_ids=["m"] * 10_001)),
            "MAX_LISTED_ITEMS",
        ),
    ]
    for call, limit in cases:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await call
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert limit in (refused.value.details() or ""), refused.value.details()
