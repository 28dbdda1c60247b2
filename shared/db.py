"""The SQL layer shared by every service: engine creation, transactions and migrations.

SQLite (through aiosqlite) is the embedded default, a file under the data directory; PostgreSQL
(through psycopg 3) is used when a `postgresql+psycopg://` URL is configured, which lets several
replicas of a service share one database.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import sqlite3
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import psycopg
from alembic import command
from alembic.config import Config
from sqlalchemy import Table, create_engine, event, text
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import URL, Connection, CursorResult, make_url
from sqlalchemy.exc import ArgumentError, InvalidRequestError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import StaticPool
from sqlalchemy.sql.base import Executable

from shared.dependencies import Dependency
from shared.errors import StartupError
from shared.logging import get_logger

if TYPE_CHECKING:
    from shared.notify import ChangeFeed

_PROBE = text("SELECT 1")

# What a database URL may be, as start-up errors say it.
URL_FORMS = "sqlite+aiosqlite:///FILE or postgresql+psycopg://USER:PASSWORD@HOST:PORT/DATABASE"
# The alembic history (migrations/), linked into the package so that it ships in the wheel.
MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"
DEFAULT_DATA_DIR = ".cogment-aux"
SQLITE_BUSY_TIMEOUT_MS = 10_000
CONNECT_TIMEOUT_S = 5
# What closing waits for the statement under way on a connection thread.
CLOSE_TIMEOUT_S = 10
# Any constant works: it only has to be the same for every replica running migrations.
MIGRATION_LOCK_ID = 0x636F676D656E74

log = get_logger("shared.db")


# Values bound in one IN list at most (SQLite caps a statement's parameters).
IN_LIST_BATCH = 500


def in_batches(values: Sequence[T]) -> Iterator[Sequence[T]]:
    """`values` in slices of IN_LIST_BATCH, one statement each."""
    for start in range(0, len(values), IN_LIST_BATCH):
        yield values[start : start + IN_LIST_BATCH]


def default_database_url(data_dir: str | Path, service: str) -> str:
    return f"sqlite+aiosqlite:///{Path(data_dir) / f'{service}.db'}"


def _sqlite_on_connect(dbapi_connection: Any, _record: Any) -> None:
    # Let SQLAlchemy's `begin` event emit BEGIN itself, so writes can take the lock up front.
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    # The busy timeout first: switching to WAL waits for other connections' locks.
    cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


def _sqlite_on_begin(connection: Connection) -> None:
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


T = TypeVar("T")
C = TypeVar("C")
_Work = tuple[asyncio.AbstractEventLoop, "asyncio.Future[Any]", Callable[[Any], Any]]


class _ConnectionThread(Generic[C]):
    """Runs work on one thread with its own database connection, for the event loop.

    aiosqlite hops threads once per cursor operation (about ten per query), each hop a round
    trip of the GIL; psycopg's async connections wait for the server in Python, through the
    event loop, several times per statement. This thread instead runs a whole unit of work per
    hop (a statement, or a transaction) on a blocking connection, whose waits release the GIL,
    and runs every unit queued since its last wake-up before handing all their results back
    with one event-loop callback: under load the hand-off is paid per batch.

    `connect` makes the connection (on first use, and again after a failure or a `reset`, never
    at start-up, when a migration may hold the database); `recover` gives the connection to keep
    after failed work (None: connect again); `close` closes it; `finish` runs as the thread
    ends. The thread starts with the first work.
    """

    def __init__(
        self,
        name: str,
        connect: Callable[[], C],
        recover: Callable[[C], C | None],
        close: Callable[[C], None],
        finish: Callable[[], None] | None = None,
    ) -> None:
        self._name = name
        self._connect = connect
        self._recover = recover
        self._close_connection = close
        self._finish = finish
        self._queue: queue.SimpleQueue[_Work | None] = queue.SimpleQueue()
        self._reset = False
        self._closed = False
        # Closing and submitting from different threads: no work is queued behind the end.
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def submit(self, work: Callable[[C], T]) -> asyncio.Future[T]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        with self._lock:
            if self._closed:
                future.set_exception(ConnectionError("the database is closed"))
                return future
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name=self._name, daemon=True)
                self._thread.start()
            self._queue.put((loop, future, work))
        return future

    def reset(self) -> None:
        """Connect again before the next work: after an outage the connection is dead (work in
        flight on it fails by itself, through the connection's timeouts at worst)."""
        self._reset = True

    def close(self, timeout_s: float | None = None) -> None:
        """Blocking: run it off the event loop. Waits for the work under way `timeout_s` at most
        (the thread is a daemon: it does not hold the process)."""
        with self._lock:
            self._closed = True
            thread = self._thread
            self._queue.put(None)
        if thread is not None:
            thread.join(timeout_s)
        elif self._finish is not None:
            self._finish()

    def _serve(self) -> None:
        connection: C | None = None
        try:
            while (first := self._queue.get()) is not None:
                batch = [first]
                stopping = False
                while not self._queue.empty():
                    item = self._queue.get()
                    if item is None:
                        stopping = True
                        break
                    batch.append(item)
                outcomes: dict[asyncio.AbstractEventLoop, list[tuple[Any, Any, BaseException | None]]] = {}
                for loop, future, work in batch:
                    outcome: tuple[Any, Any, BaseException | None]
                    try:
                        if self._reset:
                            self._reset = False
                            self._drop(connection)
                            connection = None
                        connection = connection or self._connect()
                        outcome = (future, work(connection), None)
                    except Exception as error:
                        connection = self._recovered(connection)
                        outcome = (future, None, error)
                    outcomes.setdefault(loop, []).append(outcome)
                for loop, delivered in outcomes.items():
                    with contextlib.suppress(RuntimeError):  # its loop closed meanwhile
                        loop.call_soon_threadsafe(_deliver, delivered)
                if stopping:
                    return
        finally:
            self._drop(connection)
            if self._finish is not None:
                self._finish()

    def _recovered(self, connection: C | None) -> C | None:
        if connection is None:
            return None
        try:
            return self._recover(connection)
        except Exception:  # the thread must go on: connect again
            self._drop(connection)
            return None

    def _drop(self, connection: C | None) -> None:
        if connection is not None:
            with contextlib.suppress(Exception):
                self._close_connection(connection)


def _sqlite_thread(url: URL, name: str, **options: Any) -> _ConnectionThread[Connection]:
    """A thread with its own SQLite connection, through SQLAlchemy (`options`: execution options)."""
    engine = create_engine(url.set(drivername="sqlite"), poolclass=StaticPool).execution_options(**options)
    event.listen(engine, "connect", _sqlite_on_connect)
    event.listen(engine, "begin", _sqlite_on_begin)

    return _ConnectionThread(
        name, engine.connect, _reset_after_failure, lambda connection: connection.close(), engine.dispose
    )


def _postgresql_thread(conninfo: str, name: str) -> _ConnectionThread[psycopg.Connection[Any]]:
    """A thread with its own PostgreSQL connection, each statement its own transaction."""

    def connect() -> psycopg.Connection[Any]:
        # A statement in flight when the server's host went away must fail within seconds, not
        # the OS's minutes: nothing else interrupts it. Keepalives, while it waits for an answer;
        # the user timeout, while what it sent is not acknowledged.
        return psycopg.Connection.connect(
            conninfo,
            autocommit=True,
            connect_timeout=CONNECT_TIMEOUT_S,
            keepalives=1,
            keepalives_idle=5,
            keepalives_interval=2,
            keepalives_count=3,
            tcp_user_timeout=10_000,
        )

    def dropped(connection: psycopg.Connection[Any]) -> psycopg.Connection[Any] | None:
        connection.close()  # a failure may have left it anywhere: connect again
        return None

    return _ConnectionThread(name, connect, dropped, lambda connection: connection.close())


def _reset_after_failure(connection: Connection) -> Connection | None:
    """The connection to keep after failed work: rolled back, or None (reconnect) if it is broken."""
    try:
        if connection.in_transaction():
            connection.rollback()
        return connection
    except Exception:
        connection.close()
        return None


def _rows(result: CursorResult[Any]) -> Sequence[Sequence[Any]]:
    return result.all() if result.returns_rows else []


def _deliver(outcomes: list[tuple[Any, Any, BaseException | None]]) -> None:
    for future, result, error in outcomes:
        if future.cancelled():
            continue
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)


class Transaction:
    """One write transaction (see `Database.write`): its connection, and the change-feed keys
    of what it changed."""

    __slots__ = ("_feed", "changed_keys", "connection")

    def __init__(self, connection: Connection, feed: ChangeFeed | None) -> None:
        self.connection = connection
        self._feed = feed
        self.changed_keys: list[str] = []

    def execute(self, statement: Executable, parameters: Any = None) -> Any:
        """`connection.execute`: its CursorResult."""
        return self.connection.execute(statement, parameters)

    def changed(self, keys: Iterable[str], *, elsewhere: Iterable[str] = ()) -> None:
        """What this transaction changes: watchers of `keys` look again once it commits; of
        `elsewhere`, only other replicas' (this process updates itself)."""
        keys = list(keys)
        if self._feed is not None:
            self._feed.notify(self.connection, [*keys, *elsewhere])
        self.changed_keys.extend(keys)


def _retrieved(future: asyncio.Future[Any]) -> None:
    """Mark the outcome of a future nobody may await any more (its awaiter was cancelled) as
    seen: its failure was reported by whoever awaited it, or was of no interest after a
    cancellation."""
    if not future.cancelled():
        future.exception()


class Database:
    """An async engine plus the transaction helpers every store uses."""

    def __init__(self, url: str, *, pool_size: int = 10) -> None:
        """A StartupError says what is wrong with a URL this cannot use (nothing is connected yet)."""
        unreadable = StartupError(
            f"the database URL cannot be read as {URL_FORMS} (URL-encode a password holding any of "
            "@ : / ? # [ ] % & + = or a space)"
        )
        try:
            self.url = make_url(url)
        except (ArgumentError, ValueError):
            # Not SQLAlchemy's message: it quotes the URL, password included.
            raise unreadable from None
        if "@" in (self.url.host or ""):  # `user:p@ss@host`: the rest of a password, as the host
            raise unreadable
        self.is_sqlite = self.url.get_backend_name() == "sqlite"
        self.is_postgresql = self.url.get_backend_name() == "postgresql"
        if not (self.is_sqlite or self.is_postgresql):
            raise StartupError(f"unsupported database URL {self.display_url}: use {URL_FORMS}")
        kwargs: dict[str, Any] = {}
        if self.is_sqlite:
            database = self.url.database or ""
            if database and database != ":memory:":
                directory = Path(database).parent
                try:
                    directory.mkdir(parents=True, exist_ok=True)
                except OSError as error:
                    raise StartupError(
                        f"cannot create {directory}, the directory of the database file: {error.strerror}"
                    ) from None
        else:
            # No pre-ping: it costs a round trip per checkout. A connection the server dropped fails
            # one call, and SQLAlchemy then replaces the pool's connections; old ones are recycled.
            kwargs.update(
                pool_size=pool_size,
                max_overflow=pool_size,
                pool_recycle=1800,
                # The most recently used connection first: libpq keeps each connection's buffers
                # at the largest message it carried, so rotating through the pool (FIFO) left a
                # batch-sized buffer in every connection (8 MiB sample batches: +500 MiB).
                pool_use_lifo=True,
                # A host that drops packets must fail a call in seconds, not the OS's minutes.
                connect_args={"connect_timeout": CONNECT_TIMEOUT_S},
            )
        try:
            self.engine: AsyncEngine = create_async_engine(self.url, **kwargs)
        except (ArgumentError, InvalidRequestError, ImportError) as error:  # e.g. a driver that is not async
            raise StartupError(
                f"cannot use the database URL {self.display_url}: {error}; use {URL_FORMS}"
            ) from None
        if self.is_sqlite:
            event.listen(self.engine.sync_engine, "connect", _sqlite_on_connect)
            event.listen(self.engine.sync_engine, "begin", _sqlite_on_begin)
        # Single statements (most reads) run outside explicit transactions: each BEGIN and COMMIT
        # is a round trip that a lone SELECT does not need. On SQLite they go to a reader thread
        # (see _ConnectionThread); WAL lets it read alongside the writer.
        self._autocommit = self.engine.execution_options(isolation_level="AUTOCOMMIT")
        self._sqlite_reader: _ConnectionThread[Connection] | None = None
        self._sqlite_writer: _ConnectionThread[Connection] | None = None
        self._direct: _ConnectionThread[psycopg.Connection[Any]] | None = None
        if self.is_postgresql:
            self._direct = _postgresql_thread(self.driver_conninfo, "postgresql-direct")
        if self.is_sqlite:
            self._sqlite_reader = _sqlite_thread(self.url, "sqlite-reader", sqlite_autocommit=True)
            self._sqlite_writer = _sqlite_thread(self.url, "sqlite-writer", sqlite_immediate=True)

    @property
    def display_url(self) -> str:
        return self.url.render_as_string(hide_password=True)

    @property
    def driver_conninfo(self) -> str:
        """PostgreSQL: the URL as psycopg takes it, for connections made without SQLAlchemy."""
        return self.url.set(drivername="postgresql").render_as_string(hide_password=False)

    async def fetch_direct(self, sql: str, parameters: Mapping[str, Any]) -> list[tuple[Any, ...]]:
        """PostgreSQL: the rows of one statement (psycopg's `%(name)s` parameters), its own
        transaction, on a connection of its own thread, for a hot path: at a small batch per
        statement, SQLAlchemy's execution and the async driver's waits through the event loop
        cost more than the statement's round trip."""
        assert self._direct is not None, "PostgreSQL only"
        return await self._direct.submit(lambda connection: connection.execute(sql, parameters).fetchall())

    async def write_direct(self, work: Callable[[sqlite3.Cursor], T]) -> T:
        """SQLite: run `work` on a cursor of the writer thread's driver connection, in one write
        transaction (BEGIN IMMEDIATE ... COMMIT, rolled back if anything fails); its result.
        For a hot path: at one small transaction per call, SQLAlchemy's transaction machinery
        cost the writer thread more than SQLite's own work. Wake the change feed after it."""
        assert self._sqlite_writer is not None, "SQLite only"

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

        return await self._sqlite_writer.submit(run)

    async def fetch(
        self, statement: Executable, parameters: dict[str, Any] | None = None
    ) -> Sequence[Sequence[Any]]:
        """Every row of one statement, run on its own (no surrounding transaction): the read path.
        Rows are read by position, in the order of the statement's columns; a statement that
        returns no rows (e.g. ANALYZE) gives none."""
        if self._sqlite_reader is not None:
            return await self._sqlite_reader.submit(
                lambda connection: _rows(connection.execute(statement, parameters))
            )
        async with self._autocommit.connect() as connection:
            return _rows(await connection.execute(statement, parameters))

    def insert(self, table: Table) -> Any:
        """An INSERT of this database's dialect, which offers `on_conflict_do_nothing/update`."""
        dialect: Any = postgresql if self.is_postgresql else sqlite
        return dialect.insert(table)

    async def write(self, work: Callable[[Transaction], T], feed: ChangeFeed | None = None) -> T:
        """Run `work` (synchronous SQLAlchemy code) in one write transaction; its result.

        The keys `work` marks as changed (`Transaction.changed`) are notified to `feed` inside
        the transaction (other replicas hear of it only if it commits), and this process's
        watchers are woken once it has committed, or once its COMMIT failed: a COMMIT whose
        answer was lost with the connection may have committed all the same, and other replicas
        then hear of it, so this one looks again too. On SQLite the whole transaction runs in one
        hop to the writer thread; on PostgreSQL it runs through the async driver.
        """
        # The keys of a transaction that reached its COMMIT.
        committing: list[str] = []

        def run(connection: Connection) -> T:
            transaction = Transaction(connection, feed)
            with connection.begin():
                result = work(transaction)
                committing.extend(transaction.changed_keys)
            return result

        def wake(_: object = None) -> None:
            if committing and feed is not None:
                feed.wake(committing)

        if self._sqlite_writer is not None:
            # Woken once the work is over, also when this caller was cancelled meanwhile: the
            # writer thread goes on, and its COMMIT may land after the cancellation.
            done = self._sqlite_writer.submit(run)
            done.add_done_callback(_retrieved)
            done.add_done_callback(wake)
            return await asyncio.shield(done)
        try:
            async with self.engine.connect() as connection:
                return await connection.run_sync(run)
        finally:
            wake()

    async def foreign_commits(self) -> int:
        """SQLite: a number that changes whenever another process commits to the file.

        It is `PRAGMA data_version` read on the writer's connection, which counts every other
        connection's commits but not its own; in this process only the writer commits, so a
        change means another process did. Read on the driver's connection directly: through
        SQLAlchemy it would begin a transaction, which takes the write lock on that connection.
        """
        assert self._sqlite_writer is not None, "only SQLite files are shared without notifications"

        def read(connection: Connection) -> int:
            driver_connection: Any = connection.connection.driver_connection
            return int(driver_connection.execute("PRAGMA data_version").fetchone()[0])

        return await self._sqlite_writer.submit(read)

    async def probe(self) -> None:
        """Raises if the database cannot be reached (see shared.dependencies)."""
        await self.fetch(_PROBE)

    async def reset_connections(self) -> None:
        """Drop pooled connections (after an outage they are dead: each would fail one call)."""
        await self.engine.dispose()
        if self._direct is not None:
            self._direct.reset()

    def as_dependency(self) -> Dependency:
        return Dependency("database", self.probe, self.reset_connections)

    async def migrate(self) -> None:
        """Bring the schema to the latest revision (safe with several replicas starting at once)."""
        async with self.engine.connect() as connection:
            if self.is_postgresql:
                # Session-level lock, held across alembic's own transactions.
                await connection.execute(text("SELECT pg_advisory_lock(:id)"), {"id": MIGRATION_LOCK_ID})
                await connection.commit()
            try:
                await connection.run_sync(_upgrade_to_head)
                await connection.commit()
            finally:
                if self.is_postgresql:
                    await connection.execute(
                        text("SELECT pg_advisory_unlock(:id)"), {"id": MIGRATION_LOCK_ID}
                    )
                    await connection.commit()

    async def close(self) -> None:
        await self.engine.dispose()
        for thread in (self._direct, self._sqlite_reader, self._sqlite_writer):
            if thread is not None:
                await asyncio.get_running_loop().run_in_executor(None, thread.close, CLOSE_TIMEOUT_S)


def alembic_config(connection: Connection | None = None) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.attributes["connection"] = connection
    return config


def _upgrade_to_head(connection: Connection) -> None:
    command.upgrade(alembic_config(connection), "head")


def current_revision(connection: Connection) -> str | None:
    from alembic.runtime.migration import MigrationContext

    return MigrationContext.configure(connection).get_current_revision()
