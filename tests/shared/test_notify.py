"""The change feed (`shared.notify`): wake-ups within a process, across replicas on PostgreSQL,
and after the listening connection was lost."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from shared.db import Database, Transaction
from shared.db.changes import Publication
from shared.db.postgresql import LISTEN_CHECK_PERIOD_S
from shared.db.sqlite import SQLITE_POLL_PERIOD_S
from shared.notify import ChangeFeed
from tests.helpers.eventually import eventually


async def _notify(database: Database, keys: list[str]) -> None:
    await database.write(lambda transaction: transaction.changed(keys))


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite+aiosqlite:///{tmp_path / 'feed.db'}"


@pytest.fixture
async def sqlite_feed(sqlite_url: str) -> AsyncIterator[ChangeFeed]:
    """A started feed on an SQLite file (its database is `feed.database`)."""
    database = Database(sqlite_url)
    feed = ChangeFeed(database, "test")
    await feed.start()
    yield feed
    await feed.stop()
    await database.close()


async def test_local_wake_reaches_only_watches_of_the_key(sqlite_feed: ChangeFeed) -> None:
    feed = sqlite_feed
    with feed.watch(["a"]) as watch_a, feed.watch(["b"]) as watch_b:
        feed.changed(["a"])
        assert await watch_a.wait(2)
        assert not await watch_b.wait(0.05)
        # A change notified before the wait is not lost.
        feed.changed(["b"])
        assert await watch_b.wait(0)


async def test_an_idle_watch_is_not_woken_without_a_change(sqlite_feed: ChangeFeed) -> None:
    feed = sqlite_feed
    with feed.watch(["a"]) as watch_a, feed.watch(["b"]) as watch_b:
        # Not by a timer (a poll period passes several times over)...
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(watch_b.wait(), 4 * SQLITE_POLL_PERIOD_S)
        # ...nor by this process's own commits of other keys.
        await _notify(feed.database, ["a"])
        assert await watch_a.wait(2)
        assert not await watch_b.wait(4 * SQLITE_POLL_PERIOD_S)


async def test_another_processs_commit_to_the_sqlite_file_wakes_every_watch(
    sqlite_feed: ChangeFeed, sqlite_url: str
) -> None:
    other_process = Database(sqlite_url)
    try:
        with sqlite_feed.watch(["a"]) as watch:
            await asyncio.sleep(2 * SQLITE_POLL_PERIOD_S)  # the feed has read the file's state
            assert not await watch.wait(0)
            await other_process.write(lambda transaction: transaction.execute(text("CREATE TABLE t (x)")))
            assert await watch.wait(10 * SQLITE_POLL_PERIOD_S)
    finally:
        await other_process.close()


async def test_notifications_reach_other_replicas_only_once_committed(postgres_url: str) -> None:
    databases = [Database(postgres_url) for _ in range(2)]
    feeds = [ChangeFeed(database, "test") for database in databases]
    try:
        for feed in feeds:
            await feed.start()
        with feeds[1].watch(["trial:1"]) as watch:
            # Woken once when the replica begins to listen (it may have missed a change before).
            assert await watch.wait(5)

            def rolled_back(transaction: Transaction) -> None:
                transaction.changed(["trial:1"])
                raise RuntimeError("roll back")

            with pytest.raises(RuntimeError):
                await databases[0].write(rolled_back)
            assert not await watch.wait(0.3)
            await _notify(databases[0], ["trial:1", "trial:2"])
            assert await watch.wait(2)
    finally:
        for feed, database in zip(feeds, databases, strict=True):
            await feed.stop()
            await database.close()


async def test_a_replica_listens_only_while_it_has_watches(postgres_url: str) -> None:
    """Every listening replica is told of every replica's commits, which costs it CPU each: a
    replica with nothing to wake does not listen."""
    database = Database(postgres_url)
    feed = ChangeFeed(database, "listen_test")

    async def last_queries() -> list[str]:
        """The last statement of each connection to the database but this one."""
        rows = await database.fetch(
            text(
                "SELECT query FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
        )
        return [str(row[0]) for row in rows]

    async def becomes(statement: str, within_s: float) -> bool:
        """Whether some connection's last statement is `statement` within `within_s`."""

        async def seen() -> bool:
            return statement in await last_queries()

        return await eventually(seen, statement, within_s)

    try:
        await feed.start()
        await asyncio.sleep(0.3)
        assert not any("LISTEN" in query for query in await last_queries())
        with feed.watch(["k"]) as watch:
            assert await becomes('LISTEN "listen_test"', 5)
            assert await watch.wait(1)  # woken as listening began
        # Unlistened once the listening connection has had nothing to say for a check period.
        assert await becomes('UNLISTEN "listen_test"', 2 * LISTEN_CHECK_PERIOD_S)
    finally:
        await feed.stop()
        await database.close()


async def test_listening_resumes_after_the_connection_is_lost(postgres_url: str) -> None:
    databases = [Database(postgres_url) for _ in range(2)]
    listener = ChangeFeed(databases[1], "test")
    ChangeFeed(databases[0], "test")  # databases[0] then tells its commits on "test"
    try:
        await listener.start()
        with listener.watch(["k"]) as watch:
            assert await watch.wait(5)  # woken as listening began: the LISTEN is in place
            async with databases[0].engine.begin() as connection:
                terminated = await connection.execute(
                    text(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                        "WHERE query LIKE 'LISTEN%' AND datname = current_database() "
                        "AND pid <> pg_backend_pid()"
                    )
                )
                assert len(terminated.all()) == 1
            # Everyone is woken once listening again: changes meanwhile were not notified.
            assert await watch.wait(5)
            await asyncio.sleep(0.2)
            await _notify(databases[0], ["k"])
            assert await watch.wait(5)
    finally:
        await listener.stop()
        for database in databases:
            await database.close()


def test_payloads_stay_under_postgresqls_limit() -> None:
    publication = Publication("test", ChangeFeed(Database("sqlite+aiosqlite:///unused.db"), "test"))
    keys = [f"trial:{index}" for index in range(3000)]
    payloads = publication.payloads(keys + keys[:10])
    assert len(payloads) > 1 and all(len(payload) < 8000 for payload in payloads)
    # Each ends with the origin: the sender skips its own notifications.
    assert all(payload.split(",")[-1] == publication.origin for payload in payloads)
    assert all(publication.received(payload) is None for payload in payloads)
    assert [key for payload in payloads for key in payload.split(",")[:-1]] == keys


class RecordingFollower:
    def __init__(self) -> None:
        self.heard: list[list[str] | None] = []
        self.lost_count = 0

    def changed(self, keys: list[str] | None) -> None:
        self.heard.append(keys)

    def lost(self) -> None:
        self.lost_count += 1


async def test_followers_hear_each_commit_once_and_others_through_notifications(postgres_url: str) -> None:
    databases = [Database(postgres_url) for _ in range(2)]
    feeds = [ChangeFeed(database, "test") for database in databases]
    followers = [RecordingFollower() for _ in feeds]
    try:
        for feed, follower in zip(feeds, followers, strict=True):
            feed.follow(follower)
            await feed.start()
        for follower in followers:  # listening began: anything may have changed before
            await eventually(lambda follower=follower: follower.heard == [None])
        await _notify(databases[0], ["entry:1", "entry:2"])
        # The other replica hears it through PostgreSQL, the origin mark left out...
        await eventually(lambda: followers[1].heard == [None, ["entry:1", "entry:2"]])
        # ...and the writer once, when it committed, not again when its own notification comes
        # back (the other replica's notification, sent after it, is heard: the writer's was before).
        await _notify(databases[1], ["entry:3"])
        await eventually(lambda: followers[0].heard == [None, ["entry:1", "entry:2"], ["entry:3"]])
        assert followers[0].lost_count == followers[1].lost_count == 0
    finally:
        for feed in feeds:
            await feed.stop()
        for database in databases:
            await database.close()


async def test_a_write_whose_caller_was_cancelled_wakes_watchers_once_it_commits(
    sqlite_feed: ChangeFeed,
) -> None:
    """The SQLite writer thread finishes a transaction whose caller was cancelled meanwhile (a
    client that cancelled its call): this process's watchers are woken when it commits, not at
    the cancellation, before it (they would look too early and never again)."""
    release = threading.Event()

    def slow(transaction: Transaction) -> None:
        transaction.changed(["k"])
        assert release.wait(10)

    await _cancelled_then_committed(sqlite_feed, lambda: sqlite_feed.database.write(slow), release)


async def _cancelled_then_committed(
    feed: ChangeFeed, write: Callable[[], Coroutine[Any, Any, object]], release: threading.Event
) -> None:
    """Cancel `write`'s caller while its work waits for `release` on the writer thread: the
    watchers of "k" must not be woken then, only once it has committed."""
    with feed.watch(["k"]) as watch:
        writing = asyncio.create_task(write())
        await asyncio.sleep(0.1)  # the writer thread is in the transaction
        writing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await writing
        assert not await watch.wait(0.1)
        release.set()
        assert await watch.wait(5)


async def test_a_hot_path_write_whose_caller_was_cancelled_wakes_watchers_once_it_commits(
    sqlite_feed: ChangeFeed,
) -> None:
    """The same for work on the driver's cursor (`write_on_cursor`, the datastore's sample
    batches): the watchers are woken when the writer thread has committed, not at the cancellation."""
    release = threading.Event()

    def slow(cursor: Any) -> None:
        assert release.wait(10)
        cursor.execute("CREATE TABLE hot (x)")

    await _cancelled_then_committed(
        sqlite_feed, lambda: sqlite_feed.database.write_on_cursor(slow, ["k"]), release
    )
    rows = await sqlite_feed.database.fetch(text("SELECT count(*) FROM sqlite_master WHERE name = 'hot'"))
    assert rows[0][0] == 1
