"""The Model Registry's rules, on `ModelRegistry` itself (no gRPC): the service composed with a
real SQLite database and the in-memory blob store, so what the registry leaves in the store is
checked exactly."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import pytest

import services.model_registry.core as registry_core
from services.model_registry.blobstore import MemoryBlobStore
from services.model_registry.core import ModelRegistry
from services.model_registry.model import VersionHeader, VersionInfo
from services.model_registry.service import ModelRegistryService, ModelRegistrySettings
from services.model_registry.store import RegistryStore
from shared.errors import InvalidArgument, NotFound
from tests.helpers.digest import sha256_b64

CHUNK = 5  # small chunks: every upload and read goes through several
UPDATE_TIMEOUT_S = 5.0


@dataclass
class Registry:
    core: ModelRegistry
    store: RegistryStore
    blobs: MemoryBlobStore


@pytest.fixture
async def registry(tmp_path: Path) -> AsyncIterator[Registry]:
    blobs = MemoryBlobStore()
    settings = ModelRegistrySettings.with_defaults(
        data_dir=str(tmp_path), cache_max_items=100, sent_version_chunk_size=CHUNK
    )
    service = ModelRegistryService(settings, blobs=blobs)
    await service.database.migrate()
    await service.feed.start()
    await blobs.start()
    try:
        yield Registry(service.registry, service.store, blobs)
    finally:
        await service.registry.stop()
        await blobs.close()
        await service.feed.stop()
        await service.database.close()


async def chunks_of(data: bytes, size: int = 3) -> AsyncIterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start : start + size]


def header(
    model_id: str,
    data: bytes,
    *,
    archived: bool = False,
    data_size: int | None = None,
    data_hash: str | None = None,
) -> VersionHeader:
    return VersionHeader(
        model_id=model_id,
        archived=archived,
        data_size=len(data) if data_size is None else data_size,
        data_hash=sha256_b64(data) if data_hash is None else data_hash,
        user_data={"about": data.decode(errors="replace")[:20]},
        creation_timestamp=0,
    )


async def create(registry: Registry, model_id: str, data: bytes, *, archived: bool = False) -> VersionInfo:
    return await registry.core.create_version(header(model_id, data, archived=archived), chunks_of(data))


async def data_of(registry: Registry, model_id: str, number: int) -> bytes:
    record = await registry.core.resolve(model_id, number)
    return b"".join([chunk async for chunk in registry.core.version_data(record)])


async def numbers(registry: Registry, model_id: str) -> list[int]:
    infos, _ = await registry.core.retrieve_version_infos(model_id, [], 0, 0)
    return [info.version_number for info in infos]


async def test_numbers_start_at_one_without_gaps(registry: Registry) -> None:
    await registry.core.create_or_update_model("m", {})
    await registry.core.create_or_update_model("other", {})
    datas = [b"first version", b"", b"third, archived"]
    infos = [await create(registry, "m", data, archived=i == 2) for i, data in enumerate(datas)]
    assert [info.version_number for info in infos] == [1, 2, 3]
    assert [(info.data_size, info.data_hash) for info in infos] == [(len(d), sha256_b64(d)) for d in datas]
    assert [info.archived for info in infos] == [False, False, True]
    assert infos[0].creation_timestamp > 0  # none asked for: the time of the upload
    assert (await create(registry, "other", b"x")).version_number == 1  # numbered per model
    for number, data in enumerate(datas, start=1):
        assert await data_of(registry, "m", number) == data
    assert await numbers(registry, "m") == [1, 2, 3]
    assert len(registry.blobs.keys) == 4
    assert registry.blobs.incomplete_uploads == 0


async def test_concurrent_uploads_get_consecutive_numbers(registry: Registry) -> None:
    await registry.core.create_or_update_model("m", {})
    datas = [f"version data #{i}".encode() * (i + 1) for i in range(8)]
    infos = await asyncio.gather(*(create(registry, "m", data) for data in datas))
    assert sorted(info.version_number for info in infos) == list(range(1, 9))
    for info, data in zip(infos, datas, strict=True):
        assert info.data_hash == sha256_b64(data)
        assert await data_of(registry, "m", info.version_number) == data
    assert await numbers(registry, "m") == list(range(1, 9))
    assert len(registry.blobs.keys) == 8


async def test_negative_numbers_count_from_the_latest(registry: Registry) -> None:
    await registry.core.create_or_update_model("m", {})
    for i in range(1, 5):
        await create(registry, "m", f"v{i}".encode())
    for number, expected in [(-1, 4), (-2, 3), (-4, 1), (1, 1), (4, 4)]:
        record = await registry.core.resolve("m", number)
        assert record.info.version_number == expected
        assert await data_of(registry, "m", number) == f"v{expected}".encode()
    for missing in (-5, 0, 5):
        with pytest.raises(NotFound):
            await registry.core.resolve("m", missing)
    with pytest.raises(NotFound):
        await registry.core.resolve("unknown", -1)


async def assert_nothing_stored(registry: Registry, model_id: str) -> None:
    assert await registry.store.latest_number(model_id) == 0
    assert await numbers(registry, model_id) == []
    assert registry.blobs.keys == []
    assert registry.blobs.incomplete_uploads == 0


@pytest.mark.parametrize("declared", [0, 9, 11, 100], ids=["none", "less", "more", "much-more"])
async def test_size_mismatch_is_rejected(registry: Registry, declared: int) -> None:
    await registry.core.create_or_update_model("m", {})
    data = b"0123456789"
    with pytest.raises(InvalidArgument, match="expected"):
        await registry.core.create_version(header("m", data, data_size=declared), chunks_of(data))
    await assert_nothing_stored(registry, "m")
    # The rejected upload took no number.
    assert (await create(registry, "m", data)).version_number == 1


async def test_hash_mismatch_is_rejected(registry: Registry) -> None:
    await registry.core.create_or_update_model("m", {})
    data = b"the data as sent"
    with pytest.raises(InvalidArgument, match="hash"):
        await registry.core.create_version(
            header("m", data, data_hash=sha256_b64(b"other data")), chunks_of(data)
        )
    await assert_nothing_stored(registry, "m")
    assert (await create(registry, "m", data)).version_number == 1


async def test_unknown_model_is_rejected(registry: Registry) -> None:
    with pytest.raises(NotFound):
        await create(registry, "nobody", b"data")
    assert registry.blobs.keys == []
    assert registry.blobs.incomplete_uploads == 0
    with pytest.raises(NotFound):
        await registry.core.retrieve_version_infos("nobody", [], 0, 0)
    with pytest.raises(NotFound):
        await registry.core.delete_model("nobody")
    with pytest.raises(NotFound):
        await anext(registry.core.version_updates("nobody"))


async def test_eviction_of_transient_versions(registry: Registry) -> None:
    registry.core.cache_max_items = 3
    await registry.core.create_or_update_model("m", {})
    archived = await create(registry, "m", b"v1", archived=True)
    for i in range(2, 5):
        await create(registry, "m", f"v{i}".encode())
    # Three transient versions: within the limit (archived ones do not count).
    assert await numbers(registry, "m") == [1, 2, 3, 4]
    # Reading version 2 makes version 3 the least recently used.
    assert await data_of(registry, "m", 2) == b"v2"
    await create(registry, "m", b"v5")
    assert await numbers(registry, "m") == [1, 2, 4, 5]
    await create(registry, "m", b"v6")
    assert await numbers(registry, "m") == [1, 2, 5, 6]
    # Archived versions are never evicted, however old and however many transient ones come.
    for i in range(7, 12):
        await create(registry, "m", f"v{i}".encode())
    assert await numbers(registry, "m") == [1, 9, 10, 11]
    assert (await registry.core.resolve("m", 1)).info == archived
    with pytest.raises(NotFound):
        await registry.core.resolve("m", 2)
    # Evicted versions' blobs stay for the grace period: downloads under way finish.
    assert len(registry.blobs.keys) == 11
    assert await registry.core.collect_garbage() == 0


async def blob_keys_of(registry: Registry, model_id: str) -> list[str]:
    return [
        (await registry.core.resolve(model_id, number)).blob_key
        for number in await numbers(registry, model_id)
    ]


async def test_deleted_model_blobs_are_collected_after_the_grace_period(
    registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    for model_id in ("deleted-first", "deleted-last"):
        await registry.core.create_or_update_model(model_id, {})
        await create(registry, model_id, b"one")
        await create(registry, model_id, b"two", archived=True)
    every_blob = registry.blobs.keys
    first_blobs = await blob_keys_of(registry, "deleted-first")
    await registry.core.delete_model("deleted-first")
    with pytest.raises(NotFound):
        await registry.core.resolve("deleted-first", -1)
    assert await registry.core.collect_garbage() == 0  # within the grace period
    assert registry.blobs.keys == every_blob
    monkeypatch.setattr(registry_core, "GARBAGE_GRACE_S", 0.0)
    await registry.core.delete_model("deleted-last")
    assert await registry.core.collect_garbage() == 2
    assert registry.blobs.keys == sorted(first_blobs)  # still within theirs
    assert await registry.core.collect_garbage() == 0
    # A model made again under the same id starts over at 1.
    await registry.core.create_or_update_model("deleted-last", {})
    assert (await create(registry, "deleted-last", b"again")).version_number == 1


def following(registry: Registry, model_id: str) -> contextlib.aclosing[AsyncGenerator[VersionInfo, None]]:
    # An async generator: closed at the end, its watch stops at once.
    updates = registry.core.version_updates(model_id)
    return contextlib.aclosing(cast(AsyncGenerator[VersionInfo, None], updates))


async def next_update(updates: AsyncIterator[VersionInfo]) -> VersionInfo:
    return await asyncio.wait_for(anext(updates), UPDATE_TIMEOUT_S)


async def test_version_updates(registry: Registry) -> None:
    await registry.core.create_or_update_model("m", {})
    await create(registry, "m", b"v1")
    await create(registry, "m", b"v2")
    async with following(registry, "m") as updates:
        assert (await next_update(updates)).version_number == 2  # the latest, at once
        created = await create(registry, "m", b"v3")
        assert await next_update(updates) == created
        await create(registry, "m", b"v4")
        await create(registry, "m", b"v5", archived=True)
        assert [(await next_update(updates)).version_number for _ in range(2)] == [4, 5]
        waiting = asyncio.ensure_future(next_update(updates))
        await asyncio.sleep(0.1)
        assert not waiting.done()  # nothing new
        await registry.core.delete_model("m")
        with pytest.raises(StopAsyncIteration):  # the stream ends with its model
            await waiting


async def test_version_updates_of_a_model_without_versions(registry: Registry) -> None:
    await registry.core.create_or_update_model("m", {})
    async with following(registry, "m") as updates:
        first = asyncio.ensure_future(next_update(updates))
        await asyncio.sleep(0.1)
        assert not first.done()  # no latest version to send
        created = await create(registry, "m", b"v1")
        assert await first == created
