"""SQLite, the embedded default: one file under the data directory, written by one thread.

Reads run on a reader thread, writes on a writer thread, each with its own connection (WAL lets
them run side by side); see ConnectionThread. Writers take the write lock at BEGIN (`BEGIN
IMMEDIATE`). SQLite has no notifications between processes: this process's commits are published
by the writer, and another process's commits to the same file are noticed by polling the file's
`data_version`.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import create_engine, event
from sqlalchemy.dialects import sqlite as sqlalchemy_sqlite
from sqlalchemy.engine import URL, Connection
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import StaticPool
from sqlalchemy.sql.base import Executable

from shared.db.changes import Publication
from shared.db.dialect import PUBLISHED, Dialect, Hearing, rows_of
from shared.db.threads import ConnectionThread
from shared.errors import StartupError
from shared.supervision import Periodic

SQLITE_BUSY_TIMEOUT_MS = 10_000
# How often this process looks for other processes' commits to a shared file.
SQLITE_POLL_PERIOD_S = 0.5

T = TypeVar("T")


def _on_connect(dbapi_connection: Any, _record: Any) -> None:
    # Let SQLAlchemy's `begin` event emit BEGIN itself, so writes can take the lock up front.
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    # The busy timeout first: switching to WAL waits for other connections' locks.
    cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA synchronous=NORMAL")
    # Some builds (Debian's) overwrite every freed page: deleting a trial then wrote all its
    # samples' bytes again, into the WAL, and on a full disk no deletion could free space. FAST
    # clears deleted content only in pages written anyway.
    cursor.execute("PRAGMA secure_delete=FAST")
    cursor.close()


def _on_begin(connection: Connection) -> None:
    options = connection.get_execution_options()
    if options.get("sqlite_autocommit", False):
        return  # one statement on its own: SQLite makes it atomic, no BEGIN/COMMIT round trips
    # Writers take the write lock at BEGIN: a deferred transaction that reads then writes can
    # fail with "database is locked" without waiting when another writer got there first.
    # On the driver's cursor: through SQLAlchemy's statement machinery, this BEGIN cost more
    # than the transaction it opens (most of the writer thread's time at one sample per commit).
    cursor = connection.connection.dbapi_connection.cursor()  # type: ignore[union-attr]
    try:
        cursor.execute("BEGIN IMMEDIATE" if options.get("sqlite_immediate", False) else "BEGIN")
    finally:
        cursor.close()


def _listened(engine: Any) -> None:
    event.listen(engine, "connect", _on_connect)
    event.listen(engine, "begin", _on_begin)


def _thread(url: URL, name: str, **options: Any) -> ConnectionThread[Connection]:
    """A thread with its own SQLite connection, through SQLAlchemy (`options`: execution options)."""
    engine = create_engine(url.set(drivername="sqlite"), poolclass=StaticPool).execution_options(**options)
    _listened(engine)
    return ConnectionThread(
        name, engine.connect, _reset_after_failure, lambda connection: connection.close(), engine.dispose
    )


def _reset_after_failure(connection: Connection) -> Connection | None:
    """The connection to keep after failed work: rolled back, or None (reconnect) if it is broken."""
    try:
        if connection.in_transaction():
            connection.rollback()
        return connection
    except Exception:
        connection.close()
        return None


_PROBE = "SELECT count(*) FROM sqlite_master"


class SqliteDialect(Dialect):
    name = "sqlite"
    sql = sqlalchemy_sqlite
    integrity_error = sqlite3.IntegrityError
    shared_between_hosts = False

    def __init__(self, url: URL) -> None:
        database = url.database or ""
        if database and database != ":memory:":
            directory = Path(database).parent
            try:
                directory.mkdir(parents=True, exist_ok=True)
            except OSError as error:
                raise StartupError(
                    f"cannot create {directory}, the directory of the database file: {error.strerror}"
                ) from None
        self.url = url
        # It runs migrations only: everything else runs on the two threads.
        self.engine = create_async_engine(url)
        _listened(self.engine.sync_engine)
        self._reader = _thread(url, "sqlite-reader", sqlite_autocommit=True)
        self._writer = _thread(url, "sqlite-writer", sqlite_immediate=True)
        self._prober = _thread(url, "sqlite-probe", sqlite_autocommit=True)

    async def fetch(
        self, statement: Executable, parameters: Mapping[str, Any] | None
    ) -> Sequence[Sequence[Any]]:
        return await self._reader.submit(
            lambda connection: rows_of(connection.execute(statement, parameters))
        )

    async def transaction(self, run: Callable[[Connection], T], finished: Callable[[], None]) -> T:
        # `finished` once the work is over, also when this caller was cancelled meanwhile: the
        # writer thread goes on, and its COMMIT may land after the cancellation.
        done = self._writer.submit(run)
        done.add_done_callback(_retrieved)
        done.add_done_callback(lambda _: finished())
        return await asyncio.shield(done)

    def on_cursor(self, work: Callable[[Any], T], keys: Sequence[str]) -> asyncio.Future[T]:
        """The writer thread's driver cursor, in BEGIN IMMEDIATE ... COMMIT (rolled back if
        anything fails). For the hot paths: at one small transaction per call, SQLAlchemy's
        transaction machinery cost the writer thread more than SQLite's own work."""

        def run(connection: Connection) -> T:
            driver: sqlite3.Connection = connection.connection.dbapi_connection  # type: ignore[assignment]
            cursor = driver.cursor()
            try:
                cursor.execute("BEGIN IMMEDIATE")
                result = work(cursor)
                cursor.execute("COMMIT")
                return result
            except BaseException:
                if driver.in_transaction:  # also when COMMIT itself failed (a full disk)
                    try:
                        driver.rollback()
                    except sqlite3.Error:
                        connection.invalidate()  # the next work connects again
                raise
            finally:
                cursor.close()

        return self._writer.submit(run)

    def statement(
        self, sql: str, parameters: Mapping[str, Any], keys: Sequence[str]
    ) -> asyncio.Future[list[tuple[Any, ...]]]:
        # Nothing to join: other processes notice commits to the file.
        statement = sql.replace(PUBLISHED, "")
        return self.on_cursor(lambda cursor: cursor.execute(statement, parameters).fetchall(), keys)

    def notify(self, connection: Connection, keys: Sequence[str]) -> None:
        """Nothing to send: other processes notice commits to the file (`hear_others`)."""

    def lock(self, connection: Connection, lock_id: int) -> None:
        """Nothing to take: a write transaction (BEGIN IMMEDIATE) holds the file's write lock."""

    def hearing(self, publication: Publication) -> Hearing:
        return _ForeignCommits(self._writer, publication)

    async def migrate(self, upgrade: Callable[[Connection], None]) -> None:
        async with self.engine.connect() as connection:
            await connection.run_sync(upgrade)
            await connection.commit()

    def probe(self) -> asyncio.Future[object]:
        # Reads the file's first page (the schema), as every statement does.
        return self._prober.submit(lambda connection: connection.exec_driver_sql(_PROBE).all())

    def reset(self) -> None:
        """Nothing pooled: the threads' connections recover from their failures themselves."""

    async def settle(self, timeout_s: float) -> None:
        """Nothing to wait for: its work runs on its own threads, which `close` joins."""

    def close(self, timeout_s: float) -> None:
        self._reader.close(timeout_s)
        self._writer.close(timeout_s)
        self._prober.close(timeout_s)


class _ForeignCommits(Hearing):
    """Other processes' commits to the same file, noticed through `PRAGMA data_version` on the
    writer's connection, which counts every other connection's commits but not its own: in this
    process only the writer commits, so a change means another process did. Read on the driver's
    connection directly: through SQLAlchemy it would begin a transaction, which takes the write
    lock on that connection."""

    def __init__(self, writer: ConnectionThread[Connection], publication: Publication) -> None:
        super().__init__()
        self._writer = writer
        self._publication = publication
        self._seen: int | None = None
        self._polling = Periodic(
            f"watching {publication.channel} for other processes' commits", self._look, SQLITE_POLL_PERIOD_S
        )

    async def start(self) -> None:
        self._polling.start()
        self.listening.set()

    async def stop(self) -> None:
        await self._polling.stop()

    def wanted(self) -> None:
        """Nothing to begin: the file is watched all along."""

    async def _look(self) -> None:
        # Looked at even when nobody is hearing: a watch that begins between a commit and the
        # next look must still be woken by it.
        def read(connection: Connection) -> int:
            driver_connection: Any = connection.connection.driver_connection
            return int(driver_connection.execute("PRAGMA data_version").fetchone()[0])

        seen = await self._writer.submit(read)
        if self._seen is not None and seen != self._seen:
            self._publication.subscriber.changed(None)
        self._seen = seen


def _retrieved(future: asyncio.Future[Any]) -> None:
    """Mark the outcome of a future nobody may await any more (its awaiter was cancelled) as
    seen: its failure was reported by whoever awaited it, or was of no interest after a
    cancellation."""
    if not future.cancelled():
        future.exception()
