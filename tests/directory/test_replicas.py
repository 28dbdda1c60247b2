"""Several directory replicas on one PostgreSQL database serve one directory."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import psycopg
import pytest
from sqlalchemy import text

from services.directory.model import CHECK_LEASE_NS, Endpoint, Registration
from services.directory.service import STATISTICS_MIN_ENTRIES
from services.directory.store import DirectoryStore
from shared.api import directory_pb2
from shared.db import Database
from tests.helpers.directory import ACTOR, GRPC, OK, deregister, register, register_ok, request, visible_ids
from tests.helpers.eventually import eventually
from tests.helpers.fake_services import FakeCogmentService
from tests.helpers.running import RunningDirectory, make_directory_factory

# How long a change made through one replica may take to reach another's index, at most, here
# (it takes milliseconds: bench/directory.py measures it).
PROPAGATION_LIMIT_S = 5.0


async def eventually_visible(d: RunningDirectory, expected: list[int], **kwargs: object) -> None:
    """Inquire until the answer is `expected` (another replica's change propagates)."""

    async def answered() -> bool:
        return await visible_ids(d, **kwargs) == expected

    await eventually(answered, f"{expected} to be served", PROPAGATION_LIMIT_S, interval_s=0.01)


async def test_an_entry_registered_through_one_replica_is_served_by_another(postgres_url: str) -> None:
    factory = make_directory_factory(postgres_url)
    async with factory() as first, factory() as second:
        (reply,) = await register(first, request(ACTOR, {"shared": "yes"}), token="tok")
        # Read-your-writes on the replica that took it; the others hear of it in milliseconds.
        assert await visible_ids(first, properties={"shared": "yes"}, token="tok") == [reply.service_id]
        await eventually_visible(second, [reply.service_id], properties={"shared": "yes"}, token="tok")
        # The secret is derived from a key both replicas share through the database.
        (removed,) = await deregister(second, (reply.service_id, reply.secret), token="tok")
        assert removed.status == OK
        assert await visible_ids(second, properties={"shared": "yes"}, token="tok") == []
        await eventually_visible(first, [], properties={"shared": "yes"}, token="tok")


async def test_a_failing_health_check_hides_the_entry_on_every_replica(postgres_url: str) -> None:
    factory = make_directory_factory(postgres_url)
    service = await FakeCogmentService("ServiceActorSP").start()
    stopped = False
    try:
        async with factory("--health_check_interval", "0.3") as first, factory() as second:
            (sid,) = await register_ok(
                first, request(ACTOR, protocol=GRPC, host="127.0.0.1", port=service.port)
            )
            await eventually_visible(second, [sid], service_type=ACTOR)
            await service.stop()
            stopped = True
            # Whichever replica checks it, both stop handing it out.
            await eventually_visible(first, [], service_type=ACTOR)
            await eventually_visible(second, [], service_type=ACTOR)
    finally:
        if not stopped:
            await service.stop()


async def test_a_replica_that_stops_hearing_changes_answers_from_the_database(
    postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    factory = make_directory_factory(postgres_url)
    async with factory() as first, factory() as second:
        await eventually_current(second)
        # The listening connections break, and cannot be made again for now.
        reconnecting = asyncio.Event()
        real_connect = psycopg.AsyncConnection.connect

        async def refused(*args: Any, **kwargs: Any) -> Any:
            if not reconnecting.is_set():
                raise psycopg.OperationalError("refused by the test")
            return await real_connect(*args, **kwargs)

        monkeypatch.setattr(psycopg.AsyncConnection, "connect", refused)
        terminate = "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE query LIKE 'LISTEN%'"
        await first.service.database.fetch(text(terminate))
        await eventually(
            lambda: not second.service.index.current, "the index to notice", PROPAGATION_LIMIT_S, 0.01
        )
        # A change the second replica is not told of: it sees it at once all the same.
        (sid,) = await register_ok(first, request(ACTOR, {"while": "deaf"}))
        assert await visible_ids(second, properties={"while": "deaf"}) == [sid]
        # Listening again, it reloads and answers from memory again, current.
        reconnecting.set()
        await eventually_current(second)
        assert await visible_ids(second, properties={"while": "deaf"}) == [sid]
        (reply,) = await register(first, request(ACTOR, {"while": "hearing"}))
        await eventually_visible(second, [reply.service_id], properties={"while": "hearing"})


async def eventually_current(d: RunningDirectory) -> None:
    await eventually(lambda: d.service.index.current, "the index to be current", PROPAGATION_LIMIT_S, 0.01)


async def test_concurrent_permanent_registrations_through_replicas_make_one_entry(postgres_url: str) -> None:
    factory = make_directory_factory(postgres_url)
    async with factory() as first, factory() as second:
        same = request(ACTOR, {"perm": "1"}, permanent=True)
        batches = await asyncio.gather(*(register(d, same, same) for d in (first, second, first, second)))
        ids = {reply.service_id for batch in batches for reply in batch}
        assert len(ids) == 1
        assert len(await visible_ids(second, properties={"perm": "1"})) == 1


async def test_health_checks_are_shared_out_not_repeated(postgres_url: str) -> None:
    factory = make_directory_factory(postgres_url)
    interval = 0.5
    service = await FakeCogmentService("ServiceActorSP").start()
    try:
        async with (
            factory("--health_check_interval", str(interval)) as first,
            factory("--health_check_interval", str(interval)) as second,
        ):
            await register_ok(first, request(ACTOR, protocol=GRPC, host="127.0.0.1", port=service.port))
            started = time.monotonic()
            await asyncio.sleep(3.0)
            elapsed = time.monotonic() - started
            assert await visible_ids(second, service_type=ACTOR)
        checks = service.status_calls
        # One check per interval (plus the first one), whichever replica does it; two replicas
        # each checking would double that.
        assert 2 <= checks <= elapsed / interval + 2, checks
    finally:
        await service.stop()


async def test_claims_of_a_crashed_checker_are_taken_over(database_url: str) -> None:
    database = Database(database_url)
    try:
        await database.migrate()
        store = DirectoryStore(database)
        registration = Registration(Endpoint(GRPC, "127.0.0.1", 1), ACTOR, {}, permanent=False)
        # A new entry is its registering replica's to check first: nobody else claims it...
        await store.add(registration, "digest", time.time_ns())
        assert await store.claim_due_checks(time.time_ns(), 300_000_000, 10) == []
        # ...unless that claim expired (the replica died before checking).
        service_id, _, _ = await store.add(registration, "digest", time.time_ns() - CHECK_LEASE_NS - 1)
        lease = 300_000_000
        (claimed,) = await store.claim_due_checks(time.time_ns(), lease, 10)
        assert claimed.service_id == service_id
        # Claimed by a checker that then died: nobody else takes it during the lease...
        assert await store.claim_due_checks(time.time_ns(), lease, 10) == []
        await asyncio.sleep(lease / 1e9 + 0.05)
        # ...and another one does once the lease expired.
        assert [t.service_id for t in await store.claim_due_checks(time.time_ns(), lease, 10)] == [service_id]
    finally:
        await database.close()


async def analyzed_rows(database: Database) -> float:
    """The entries PostgreSQL's statistics count (-1: never analyzed)."""
    query = "SELECT reltuples FROM pg_class WHERE relname = 'directory_services'"
    return float((await database.fetch(text(query)))[0][0])


async def test_a_nearly_empty_directory_is_not_analyzed(postgres_url: str) -> None:
    """Statistics of a nearly empty table make PostgreSQL plan the properties' foreign-key checks
    as sequential scans, kept per connection until the next ANALYZE: the directory leaves them
    alone below STATISTICS_MIN_ENTRIES, and refreshes them once there are more."""
    async with make_directory_factory(postgres_url)() as directory:
        database = directory.service.database

        async def analyzes() -> int:  # ANALYZE statements, not autovacuum's
            query = "SELECT analyze_count FROM pg_stat_user_tables WHERE relname = 'directory_services'"
            return int((await database.fetch(text(query)))[0][0])

        await register_ok(
            directory, *(request(ACTOR, {"n": str(i)}) for i in range(STATISTICS_MIN_ENTRIES - 1))
        )
        await directory.service._maintain()
        assert await analyzes() == 0
        await register_ok(directory, request(ACTOR, {"n": "last"}))
        await directory.service._maintain()  # or the periodic one, at the same time
        assert await analyzes() >= 1


async def test_planner_statistics_follow_a_burst_of_registrations(postgres_url: str) -> None:
    """Inquiry plans on PostgreSQL need statistics; the directory refreshes them itself after a
    burst instead of waiting for autovacuum."""
    async with make_directory_factory(postgres_url)() as directory:
        await register_ok(directory, *(request(ACTOR, {"n": str(i)}) for i in range(300)))
        database = directory.service.database

        async def analyzed() -> bool:
            return await analyzed_rows(database) >= 300

        await eventually(analyzed, "the statistics to be refreshed", timeout_s=15, interval_s=0.5)


async def served_here_after_its_lost_answer(
    directory: RunningDirectory,
    registration: directory_pb2.RegisterRequest,
    lose: Callable[[pytest.MonkeyPatch], list[object]],
) -> None:
    """Register while `lose` makes the database's answer to the commit get lost, once: the
    directory reads back what the write did, and the client is answered OK with the entry that
    was committed, the only one, served by this replica from memory as every other replica
    serves it (rather than after its next reload); its secret deregisters it."""
    with pytest.MonkeyPatch.context() as patch:
        lost = lose(patch)
        (reply,) = await register(directory, registration)
    assert lost, "no answer was lost"
    assert reply.status == OK, reply.error_msg
    properties = dict(registration.details.properties)
    assert await visible_ids(directory, properties=properties) == [reply.service_id]
    assert directory.service.index.current  # answered from memory, not from the database
    assert await directory.service.store.count() == 1
    (removed,) = await deregister(directory, (reply.service_id, reply.secret))
    assert removed.status == OK


async def test_a_registration_committed_before_its_answer_was_lost_is_served_here_too(
    postgres_url: str,
) -> None:
    """PostgreSQL: new entries are written by one statement, whose answer is lost after the
    commit (the connection broke)."""
    async with make_directory_factory(postgres_url)() as directory:
        database = directory.service.database
        written = database.dialect.statement
        lost: list[object] = []

        async def lost_after_commit(
            sql: str, parameters: Mapping[str, Any], keys: Sequence[str]
        ) -> list[tuple[Any, ...]]:
            rows = await written(sql, parameters, keys)
            if lost:
                return rows
            lost.append(rows)
            raise psycopg.OperationalError("server closed the connection unexpectedly")

        def lose(patch: pytest.MonkeyPatch) -> list[object]:
            patch.setattr(database.dialect, "statement", lost_after_commit)
            return lost

        await served_here_after_its_lost_answer(directory, request(properties={"answer": "lost"}), lose)


async def test_a_permanent_registration_whose_commit_answer_was_lost_is_served_here_too(
    postgres_url: str,
) -> None:
    """PostgreSQL: permanent entries are written in a transaction, whose COMMIT succeeds but its
    answer is lost (`Database.write` wakes this process's watchers of a failed COMMIT)."""
    async with make_directory_factory(postgres_url)() as directory:
        dialect = directory.service.database.engine.sync_engine.dialect
        commit = dialect.do_commit
        lost: list[object] = []

        def lost_after_commit(dbapi_connection: Any) -> None:
            commit(dbapi_connection)
            if not lost:
                lost.append(dbapi_connection)
                raise psycopg.OperationalError("server closed the connection unexpectedly")

        def lose(patch: pytest.MonkeyPatch) -> list[object]:
            patch.setattr(dialect, "do_commit", lost_after_commit)
            return lost

        await served_here_after_its_lost_answer(
            directory, request(properties={"answer": "lost"}, permanent=True), lose
        )
