"""The in-memory index answers every inquiry as the store's SQL does, on the same entries."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
import tracemalloc
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.directory.entry_sql import IndexRow
from services.directory.index import PAGE_ENTRIES, EntryIndex, FollowedIndex, lag_seconds
from services.directory.model import (
    COGMENT,
    GRPC,
    UNKNOWN_SERVICE,
    CheckResult,
    CheckTarget,
    Endpoint,
    Entry,
    Inquiry,
    Registration,
)
from services.directory.store import DirectoryStore
from shared.db import Database
from shared.notify import ChangeFeed
from tests.helpers.eventually import eventually

TYPES = [UNKNOWN_SERVICE, 3, 4]  # UNKNOWN_SERVICE in an inquiry: any type
properties = st.dictionaries(st.sampled_from("abc"), st.sampled_from("xy"), max_size=3)
# Each registration: its type, properties, token, whether it is health-checked, and its checks
# (None: never checked; True/False: the outcome of its last check).
registrations = st.lists(
    st.tuples(
        st.sampled_from(TYPES[1:]),
        properties,
        st.sampled_from(["t1", "t2"]),
        st.booleans(),
        st.sampled_from([None, True, False]),
    ),
    max_size=12,
)
inquiries = st.lists(
    st.tuples(st.sampled_from(TYPES), properties, st.sampled_from(["t1", "t2"])), min_size=1, max_size=6
)
examples = itertools.count()


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[DirectoryStore]:
    database = Database(f"sqlite+aiosqlite:///{tmp_path / 'index.db'}")
    await database.migrate()
    yield DirectoryStore(database)
    await database.close()


async def sql_answer(store: DirectoryStore, inquiry: Inquiry, token: str) -> list[int]:
    return [entry.service_id for page in [p async for p in store.find(inquiry, token)] for entry in page]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(registrations, inquiries)
async def test_the_index_answers_as_the_database(
    store: DirectoryStore,
    registrations: list[tuple[int, dict[str, str], str, bool, bool | None]],
    inquiries: list[tuple[int, dict[str, str], str]],
) -> None:
    example = next(examples)  # tokens of their own: earlier examples' entries stay out of sight
    ids = []
    for service_type, props, token, checked, outcome in registrations:
        endpoint = Endpoint(GRPC if checked else COGMENT, "127.0.0.1", 1)
        registration = Registration(endpoint, service_type, props, permanent=False)
        service_id, _, _ = await store.add(registration, f"{example}{token}", time.time_ns())
        ids.append(service_id)
        if checked and outcome is not None:
            target = CheckTarget(service_id, endpoint, service_type, 0, 0)
            await store.record_checks([(target, CheckResult(outcome, 7))], time.time_ns(), 0, 3)
    index = EntryIndex()
    for row in await store.index_rows(ids):
        index.put(row)
    for service_type, props, token in inquiries:
        inquiry = Inquiry(service_type=service_type, properties=props)
        answer = [entry.service_id for entry in index.matches(inquiry, f"{example}{token}")]
        assert answer == await sql_answer(store, inquiry, f"{example}{token}")
    for service_id in ids:  # by id, with its token and another
        for token in ("t1", "t2"):
            inquiry = Inquiry(service_id=service_id)
            answer = [entry.service_id for entry in index.matches(inquiry, f"{example}{token}")]
            assert answer == await sql_answer(store, inquiry, f"{example}{token}")
    for service_id in ids:  # and removed, nothing is left behind
        index.discard(service_id)
    assert not any(
        index.matches(Inquiry(service_type=t), f"{example}{k}") for t in TYPES for k in ("t1", "t2")
    )


async def test_the_followed_index_holds_what_was_written_and_pages_wide_answers(tmp_path: Path) -> None:
    database = Database(f"sqlite+aiosqlite:///{tmp_path / 'index.db'}")
    await database.migrate()
    feed = ChangeFeed(database, "test")
    store = DirectoryStore(database)
    index = FollowedIndex(store, listening=True)
    feed.follow(index)
    index.start()
    try:
        await eventually(lambda: index.current, "the index to load")
        # Permanent entries: the store has the index read them back (unlike new unchecked entries,
        # which Directory.register puts in as written).
        added = [
            await store.add(
                Registration(Endpoint(GRPC, "a", 1), 3, {"wide": "yes", "n": str(n)}, permanent=True),
                "t",
                time.time_ns(),
            )
            for n in range(PAGE_ENTRIES + 5)
        ]
        await index.caught_up()
        assert index.current
        pages = [page async for page in index.find(Inquiry(properties={"wide": "yes"}), "t")]
        assert [len(page) for page in pages] == [PAGE_ENTRIES, 5]
        assert {entry.service_id for page in pages for entry in page} == {sid for sid, _, _ in added}
        await store.remove(added[0][0])
        await index.caught_up()
        assert len(index.index) == PAGE_ENTRIES + 4
    finally:
        await index.stop()
        await database.close()


async def test_the_lag_is_measured_for_each_pass_that_applies_heard_changes(tmp_path: Path) -> None:
    database = Database(f"sqlite+aiosqlite:///{tmp_path / 'index.db'}")
    await database.migrate()
    feed = ChangeFeed(database, "test")
    store = DirectoryStore(database)
    index = FollowedIndex(store, listening=True)
    feed.follow(index)
    index.start()
    try:
        # Loaded first: until then `caught_up` returns at once (inquiries go to the database).
        await eventually(lambda: index.current, "the index to load")
        await index.caught_up()
        before = lag_seconds.count()
        for n in range(3):  # read back by the index, as a change heard of (see above)
            registration = Registration(Endpoint(GRPC, "a", 1), 3, {"n": str(n)}, permanent=True)
            service_id, _, _ = await store.add(registration, "t", time.time_ns())
            await index.caught_up()
            assert service_id in index.index
        assert lag_seconds.count() == before + 3
        await index.caught_up()  # a pass with nothing heard of: no lag
        assert lag_seconds.count() == before + 3
    finally:
        await index.stop()
        await database.close()


def test_an_entry_costs_the_index_about_two_kilobytes() -> None:
    """As the README states: 100,000 entries of SDK-like registrations in about 200 MB."""
    count = 20_000
    tracemalloc.start()
    try:
        index = EntryIndex()
        for n in range(count):
            properties = {  # as read from the database: strings of their own
                "__actor_class": f"class{n % 50}",
                "__implementation": f"implementation-{n}",
                "__registration_source": "sdk",
                "__version": "2.10.1",
                "user": f"u{n % 7}",
            }
            entry = Entry(10**15 + n, Endpoint(GRPC, f"host-{n}.example", 9000), 3, properties, False, n)
            index.put(IndexRow(entry, "".join(["d"] * 64), visible=True))
        per_entry = tracemalloc.get_traced_memory()[0] / count
    finally:
        tracemalloc.stop()
    assert len(index) == count
    assert per_entry < 2_500, per_entry


def test_the_generation_changes_with_what_an_answer_shows_only() -> None:
    index = EntryIndex()
    entry = Entry(7, Endpoint(GRPC, "127.0.0.1", 9000), 3, {"a": "x"}, permanent=False, registered_at=1)
    index.put(IndexRow(entry, "token", visible=True))
    generation = index.generation
    # A health-check result that changes nothing an answer shows: the new record, same generation.
    checked = dataclasses.replace(entry, load=42, last_check_at=5)
    index.put(IndexRow(checked, "token", visible=True))
    assert index.generation == generation
    assert index.matches(Inquiry(service_id=7), "token")[0] is checked
    for changed in (
        IndexRow(checked, "token", visible=False),
        IndexRow(dataclasses.replace(checked, endpoint=Endpoint(GRPC, "127.0.0.1", 9001)), "token", True),
        IndexRow(dataclasses.replace(checked, properties={"a": "y"}), "token", True),
        IndexRow(checked, "other token", True),
    ):
        index.put(changed)
        assert index.generation > generation
        generation = index.generation
    index.discard(7)
    assert index.generation > generation


async def test_an_entry_written_during_the_first_load_is_in_the_loaded_index(tmp_path: Path) -> None:
    """The first load may read the table before a new entry commits, and the new entry's key is
    not told to this replica (Directory.register puts it in as written): the load keeps it."""
    database = Database(f"sqlite+aiosqlite:///{tmp_path / 'index.db'}")
    await database.migrate()
    read, release = asyncio.Event(), asyncio.Event()

    class HeldStore(DirectoryStore):
        async def all_index_rows(self) -> AsyncIterator[list[IndexRow]]:
            async for rows in super().all_index_rows():
                yield rows
            read.set()
            await release.wait()  # the table is read; the load has not finished

    store = HeldStore(database)
    index = FollowedIndex(store, listening=True)
    index.start()
    try:
        await read.wait()
        assert not index.current
        registration = Registration(Endpoint(COGMENT, "127.0.0.1", 1), 3, {}, permanent=False)
        registered_at = time.time_ns()
        service_id, _, _ = await store.add(registration, "t", registered_at)
        entry = Entry(service_id, registration.endpoint, 3, {}, permanent=False, registered_at=registered_at)
        index.put_new(IndexRow(entry, "t", visible=True))
        release.set()
        await eventually(lambda: index.current, "the index to load")
        assert [found.service_id for found in index.index.matches(Inquiry(service_id=service_id), "t")] == [
            service_id
        ]
    finally:
        release.set()
        await index.stop()
        await database.close()
