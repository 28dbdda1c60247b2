"""The Model Registry's SQL store, each test on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from sqlalchemy import select

from services.model_registry.store import (
    ModelInfo,
    RegistryStore,
    VersionInfo,
    VersionRecord,
    model_key,
)
from shared.db import Database
from shared.schema import registry_blob_garbage, registry_versions

LONG_ID = "m" * 10_000
UNICODE_ID = "modèle/é🙂 \x01"


@pytest.fixture
async def db(database_url: str) -> AsyncIterator[Database]:
    database = Database(database_url)
    await database.migrate()
    try:
        yield database
    finally:
        await database.close()


@pytest.fixture
def store(db: Database) -> RegistryStore:
    return make_store(db)


def make_store(database: Database) -> RegistryStore:
    return RegistryStore(database)


async def _commit(
    store: RegistryStore,
    model_id: str,
    blob_key: str,
    *,
    archived: bool = False,
    now_ns: int = 1,
    user_data: dict[str, str] | None = None,
) -> VersionInfo | None:
    return await store.commit_version(
        model_id,
        blob_key,
        archived=archived,
        data_hash=("hash-" + blob_key)[:64],
        data_size=len(blob_key),
        user_data=user_data or {},
        creation_timestamp=1000,
        now_ns=now_ns,
    )


async def _garbage(db: Database) -> dict[str, int]:
    rows = await db.fetch(select(registry_blob_garbage.c.blob_key, registry_blob_garbage.c.delete_after))
    return {key: after for key, after in rows}


async def _last_used(db: Database, model_id: str, number: int) -> int:
    rows = await db.fetch(
        select(registry_versions.c.last_used_at).where(
            registry_versions.c.model_key == model_key(model_id),
            registry_versions.c.version_number == number,
        )
    )
    return int(rows[0][0])


def test_model_key_is_sha256_hex() -> None:
    assert model_key("foo") == "2c26b46b68ffc68ff99b453c1d30413413422d706483bfa0f98a5e886266e7ae"
    assert len(model_key(LONG_ID)) == 64


async def test_upsert_and_get_models(store: RegistryStore) -> None:
    assert await store.get_models([]) == {}
    assert await store.get_models(["foo"]) == {}
    await store.upsert_model("foo", {"a": "1", "b": "2"}, 10)
    await store.upsert_model(LONG_ID, {}, 11)
    await store.upsert_model(UNICODE_ID, {"clé": "välue🙂"}, 12)
    found = await store.get_models(["foo", LONG_ID, UNICODE_ID, "unknown", "foo"])
    assert found == {
        "foo": ModelInfo("foo", {"a": "1", "b": "2"}),
        LONG_ID: ModelInfo(LONG_ID, {}),
        UNICODE_ID: ModelInfo(UNICODE_ID, {"clé": "välue🙂"}),
    }
    # Replacing user data: no merge, versions untouched.
    assert await _commit(store, "foo", "blob-1") is not None
    await store.upsert_model("foo", {"c": "3"}, 20)
    assert await store.get_models(["foo"]) == {"foo": ModelInfo("foo", {"c": "3"})}
    assert await store.latest_number("foo") == 1
    # Numbering continues after an update.
    version = await _commit(store, "foo", "blob-2")
    assert version is not None and version.version_number == 2


async def test_get_many_models(store: RegistryStore) -> None:
    ids = [f"model-{index}" for index in range(1200)]
    await asyncio.gather(*(store.upsert_model(model_id, {"i": model_id}, 1) for model_id in ids))
    found = await store.get_models([*ids, "missing"])
    assert set(found) == set(ids)
    assert found["model-7"] == ModelInfo("model-7", {"i": "model-7"})


async def test_list_models_order_and_paging(store: RegistryStore) -> None:
    assert await store.list_models(0, None) == []
    ids = ["foo", "bar", "baz", "Zed", "a", "ab", "b", "é", "z~", "🙂", LONG_ID, UNICODE_ID]
    for model_id in ids:
        await store.upsert_model(model_id, {"id": model_id[:10]}, 1)
    expected = sorted(ids)  # code point order
    listed = await store.list_models(0, None)
    assert [model.model_id for model in listed] == expected
    assert listed[0] == ModelInfo(expected[0], {"id": expected[0][:10]})
    pages = [await store.list_models(offset, 5) for offset in range(0, len(ids), 5)]
    assert [len(page) for page in pages] == [5, 5, 2]
    assert [model.model_id for page in pages for model in page] == expected
    assert await store.list_models(len(ids), 5) == []
    assert await store.list_models(100, None) == []
    assert [model.model_id for model in await store.list_models(3, None)] == expected[3:]
    assert await store.list_models(0, 0) == []


async def test_delete_model(db: Database, store: RegistryStore) -> None:
    assert await store.delete_model("foo", 100) is None
    await store.upsert_model("foo", {"a": "1"}, 1)
    await store.upsert_model("bar", {}, 1)
    for index in range(3):
        await store.record_upload(f"foo-{index}", 50)
        assert await _commit(store, "foo", f"foo-{index}") is not None
    assert await _commit(store, "bar", "bar-0") is not None
    assert await _garbage(db) == {}
    assert sorted(await store.delete_model("foo", 100) or []) == ["foo-0", "foo-1", "foo-2"]
    assert await _garbage(db) == {"foo-0": 100, "foo-1": 100, "foo-2": 100}
    assert await store.get_models(["foo"]) == {}
    assert await store.latest_number("foo") is None
    assert await store.get_version("foo", 1) is None
    assert await store.list_versions("foo", 1, None) == []
    assert await store.delete_model("foo", 100) is None
    # The other model is untouched.
    assert await store.latest_number("bar") == 1
    # Re-created: a new model, numbering from 1.
    await store.upsert_model("foo", {}, 2)
    assert await store.latest_number("foo") == 0
    version = await _commit(store, "foo", "foo-again")
    assert version is not None and version.version_number == 1


async def test_commit_and_get_versions(db: Database, store: RegistryStore) -> None:
    assert await store.latest_number("foo") is None
    assert await _commit(store, "foo", "orphan") is None
    await store.upsert_model("foo", {}, 1)
    assert await store.latest_number("foo") == 0
    assert await store.get_version("foo", 1) is None
    await store.record_upload("blob-1", 500)
    await store.record_upload("blob-2", 500)
    first = await store.commit_version(
        "foo",
        "blob-1",
        archived=True,
        data_hash="h1",
        data_size=751,
        user_data={"k": "v", "é": "🙂"},
        creation_timestamp=123,
        now_ns=1000,
    )
    assert first == VersionInfo("foo", 1, 123, True, "h1", 751, {"k": "v", "é": "🙂"})
    # Committed: the blob is no longer garbage; the other upload still is.
    assert await _garbage(db) == {"blob-2": 500}
    second = await _commit(store, "foo", "blob-2")
    third = await _commit(store, "foo", "blob-3", archived=True)
    assert second is not None and third is not None
    assert (second.version_number, third.version_number) == (2, 3)
    assert await _garbage(db) == {}
    assert await store.latest_number("foo") == 3
    assert await store.get_version("foo", 1) == VersionRecord(first, "blob-1")
    record = await store.get_version("foo", 2)
    assert record == VersionRecord(second, "blob-2")
    assert record is not None and record.info.archived is False
    assert await store.get_version("foo", 4) is None
    assert await store.get_version("foo", 0) is None
    assert await store.get_version("bar", 1) is None
    assert await _last_used(db, "foo", 2) == 1


async def test_a_commit_made_again_returns_the_version_it_made(db: Database, store: RegistryStore) -> None:
    """A commit whose answer was lost is made again with the same blob: it finds the version the
    first one made, and changes nothing (no second version, no number taken)."""
    await store.upsert_model("foo", {}, 1)
    await store.record_upload("blob-1", 500)
    first = await _commit(store, "foo", "blob-1", archived=True, user_data={"k": "v"})
    assert first is not None and first.version_number == 1
    again = await _commit(store, "foo", "blob-1", archived=False, now_ns=2, user_data={"other": "data"})
    assert again == first
    assert await store.list_versions("foo", 1, None) == [first]
    assert await _last_used(db, "foo", 1) == 1
    assert await _garbage(db) == {}
    # The next upload takes the next number: none was taken by the commit made again.
    second = await _commit(store, "foo", "blob-2")
    assert second is not None and second.version_number == 2


async def test_list_versions(store: RegistryStore) -> None:
    assert await store.list_versions("foo", 1, None) == []
    await store.upsert_model("foo", {}, 1)
    assert await store.list_versions("foo", 1, None) == []
    for index in range(20):
        assert await _commit(store, "foo", f"blob-{index}", archived=index % 2 == 0) is not None

    async def numbers(first: int, limit: int | None) -> list[int]:
        return [version.version_number for version in await store.list_versions("foo", first, limit)]

    assert await numbers(8, 5) == [8, 9, 10, 11, 12]
    assert await numbers(0, 2) == [1, 2]
    assert await numbers(3, 3) == [3, 4, 5]
    assert await numbers(1, None) == list(range(1, 21))
    assert await numbers(18, 10) == [18, 19, 20]
    assert await numbers(21, None) == []
    assert await numbers(1, 0) == []
    listed = await store.list_versions("foo", 2, 1)
    assert listed == [VersionInfo("foo", 2, 1000, False, "hash-blob-1", 6, {})]
    # Missing numbers (evicted) are skipped.
    await store.evict_transient(5, 0)
    assert await numbers(1, None) == [1, 3, 5, 7, 9, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    assert await numbers(2, 3) == [3, 5, 7]


async def test_concurrent_commits_number_without_gaps(store: RegistryStore) -> None:
    await store.upsert_model("foo", {}, 1)
    await store.upsert_model(UNICODE_ID, {}, 1)
    results = await asyncio.gather(
        *(_commit(store, "foo", f"foo-{index}") for index in range(20)),
        *(_commit(store, UNICODE_ID, f"u-{index}", archived=True) for index in range(5)),
    )
    numbers = sorted(result.version_number for result in results[:20] if result is not None)
    assert numbers == list(range(1, 21))
    assert sorted(result.version_number for result in results[20:] if result is not None) == [1, 2, 3, 4, 5]
    assert await store.latest_number("foo") == 20
    for result in results[:20]:
        assert result is not None
        record = await store.get_version("foo", result.version_number)
        assert record is not None and record.info == result
        assert record.blob_key == "foo-" + result.data_hash.split("-")[-1]


async def test_replicas_commit_without_gaps(postgres_url: str) -> None:
    databases = [Database(postgres_url) for _ in range(2)]
    try:
        await databases[0].migrate()
        stores = [make_store(database) for database in databases]
        await stores[0].upsert_model(LONG_ID, {}, 1)
        results = await asyncio.gather(
            *(_commit(stores[index % 2], LONG_ID, f"blob-{index}") for index in range(40))
        )
        assert sorted(result.version_number for result in results if result is not None) == list(range(1, 41))
        assert await stores[1].latest_number(LONG_ID) == 40
    finally:
        for database in databases:
            await database.close()


async def test_commit_after_delete_leaves_blob_in_garbage(db: Database, store: RegistryStore) -> None:
    await store.upsert_model("foo", {}, 1)
    await store.record_upload("late", 777)
    assert await store.delete_model("foo", 100) == []
    assert await _commit(store, "foo", "late") is None
    assert await _garbage(db) == {"late": 777}
    assert await store.latest_number("foo") is None


async def test_commit_races_delete(db: Database, store: RegistryStore) -> None:
    """Whatever the order, every blob ends up either in a version or in garbage."""
    await store.upsert_model("foo", {}, 1)
    keys = [f"blob-{index}" for index in range(10)]
    for key in keys:
        await store.record_upload(key, 5)
    outcomes = await asyncio.gather(
        *(_commit(store, "foo", key) for key in keys[:5]),
        store.delete_model("foo", 100),
        *(_commit(store, "foo", key) for key in keys[5:]),
    )
    assert outcomes[5] is not None  # deleted (with the versions committed before it)
    assert await store.latest_number("foo") is None
    assert set(await _garbage(db)) == set(keys)


async def test_touch(db: Database, store: RegistryStore) -> None:
    await store.touch("unknown", 1, 100)  # no error
    await store.upsert_model("foo", {}, 1)
    assert await _commit(store, "foo", "t", now_ns=10) is not None
    assert await _commit(store, "foo", "a", archived=True, now_ns=10) is not None
    await store.touch("foo", 1, 50)
    await store.touch("foo", 2, 50)
    await store.touch("foo", 3, 50)  # no such version
    assert await _last_used(db, "foo", 1) == 50
    assert await _last_used(db, "foo", 2) == 10  # archived: never evicted, not tracked
    await store.touch("foo", 1, 40)  # an older instant does not go back
    assert await _last_used(db, "foo", 1) == 50


async def test_evict_transient(db: Database, store: RegistryStore) -> None:
    assert await store.evict_transient(0, 100) == []
    await store.upsert_model("foo", {}, 1)
    await store.upsert_model(UNICODE_ID, {}, 1)
    assert await _commit(store, "foo", "f1", now_ns=10) is not None
    assert await _commit(store, "foo", "f2", archived=True, now_ns=11) is not None
    assert await _commit(store, UNICODE_ID, "u1", now_ns=12) is not None
    assert await _commit(store, "foo", "f3", now_ns=13) is not None
    assert await _commit(store, UNICODE_ID, "u2", archived=True, now_ns=14) is not None
    assert await _commit(store, UNICODE_ID, "u3", now_ns=15) is not None
    # 4 transient versions: f1 (10), u1 (12), f3 (13), u3 (15); archived ones do not count.
    assert await store.evict_transient(4, 100) == []
    await store.touch("foo", 1, 20)  # f1 becomes the most recently used
    assert await store.evict_transient(2, 100) == [(UNICODE_ID, 1, "u1"), ("foo", 3, "f3")]
    assert await _garbage(db) == {"u1": 100, "f3": 100}
    assert await store.get_version(UNICODE_ID, 1) is None
    assert await store.get_version("foo", 3) is None
    assert await store.evict_transient(2, 100) == []
    # Evicting everything transient keeps every archived version.
    assert await store.evict_transient(0, 200) == [(UNICODE_ID, 3, "u3"), ("foo", 1, "f1")]
    assert await _garbage(db) == {"u1": 100, "f3": 100, "u3": 200, "f1": 200}
    assert [v.version_number for v in await store.list_versions("foo", 1, None)] == [2]
    assert [v.version_number for v in await store.list_versions(UNICODE_ID, 1, None)] == [2]
    # Numbers are never reused: latest is the highest existing; the next one continues.
    assert await store.latest_number("foo") == 2
    version = await _commit(store, "foo", "f4")
    assert version is not None and version.version_number == 4


async def test_eviction_ties_go_to_the_oldest_number(store: RegistryStore) -> None:
    await store.upsert_model("foo", {}, 1)
    for index in range(4):
        assert await _commit(store, "foo", f"b{index}", now_ns=5) is not None
    assert await store.evict_transient(1, 0) == [("foo", 1, "b0"), ("foo", 2, "b1"), ("foo", 3, "b2")]


async def test_concurrent_evictions_never_over_evict(database_url: str) -> None:
    databases = [Database(database_url) for _ in range(2)]
    try:
        await databases[0].migrate()
        stores = [make_store(database) for database in databases]
        await stores[0].upsert_model("foo", {}, 1)
        for index in range(30):
            assert await _commit(stores[0], "foo", f"t{index}", archived=index % 3 == 0) is not None
        # 20 transient versions, 10 archived.
        evicted = await asyncio.gather(
            *(stores[index % 2].evict_transient(12 - index, 100) for index in range(6))
        )
        flat = [item for batch in evicted for item in batch]
        assert len(flat) == len(set(flat)) == 20 - 7
        remaining = await stores[1].list_versions("foo", 1, None)
        assert sum(not version.archived for version in remaining) == 7
        assert sum(version.archived for version in remaining) == 10
    finally:
        for database in databases:
            await database.close()


async def test_take_and_return_garbage(db: Database, store: RegistryStore) -> None:
    assert await store.take_garbage(100, 10) == []
    await store.record_upload("a", 10)
    await store.record_upload("b", 20)
    await store.record_upload("c", 30)
    await store.record_upload("a", 99)  # already there: kept as is
    assert await store.take_garbage(9, 10) == []
    assert await store.take_garbage(20, 0) == []
    assert sorted(await store.take_garbage(20, 10)) == ["a", "b"]
    assert await store.take_garbage(20, 10) == []
    assert await _garbage(db) == {"c": 30}
    await store.return_garbage(["a", "c", "a"], 50)
    await store.return_garbage([], 50)
    assert await _garbage(db) == {"a": 50, "c": 30}
    assert await store.take_garbage(40, 10) == ["c"]
    assert await store.take_garbage(100, 1) == ["a"]
    assert await _garbage(db) == {}


async def test_concurrent_takers_take_each_key_once(database_url: str) -> None:
    databases = [Database(database_url) for _ in range(2)]
    try:
        await databases[0].migrate()
        stores = [make_store(database) for database in databases]
        keys = [f"blob/{index:04}" for index in range(300)]
        await stores[0].return_garbage(keys, 1)
        await stores[0].record_upload("future", 1000)

        async def drain(store: RegistryStore) -> list[str]:
            taken: list[str] = []
            while batch := await store.take_garbage(10, 7):
                taken += batch
                await asyncio.sleep(0)
            return taken

        results = await asyncio.gather(*(drain(stores[index % 2]) for index in range(6)))
        flat = [key for taken in results for key in taken]
        assert sorted(flat) == keys
        assert await _garbage(databases[1]) == {"future": 1000}
    finally:
        for database in databases:
            await database.close()


async def test_long_and_unicode_ids(store: RegistryStore) -> None:
    for model_id in (LONG_ID, UNICODE_ID, LONG_ID + "x"):
        await store.upsert_model(model_id, {"id": model_id[-5:]}, 1)
        version = await _commit(store, model_id, "blob:" + model_key(model_id))
        assert version is not None and version.version_number == 1
        record = await store.get_version(model_id, 1)
        assert record is not None and record.info.model_id == model_id
        assert await store.latest_number(model_id) == 1
        assert len(await store.list_versions(model_id, 1, None)) == 1
        await store.touch(model_id, 1, 5)
    evicted = await store.evict_transient(0, 1)
    assert sorted((model_id, number) for model_id, number, _ in evicted) == sorted(
        [(LONG_ID, 1), (UNICODE_ID, 1), (LONG_ID + "x", 1)]
    )
    assert await store.delete_model(LONG_ID, 1) is not None
    assert set(await store.get_models([LONG_ID, UNICODE_ID, LONG_ID + "x"])) == {UNICODE_ID, LONG_ID + "x"}
