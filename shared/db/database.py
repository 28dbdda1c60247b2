"""The one door to the database: stores describe their work, and run it through `Database`.

SQLite (the embedded default, a file under the data directory) and PostgreSQL (a
`postgresql+psycopg://` URL, which lets several replicas of a service share one database) differ
only below this door, in their `Dialect`. Work comes in three forms: a read (`fetch`), a write
transaction of SQLAlchemy code (`write`), and, for the hot paths, a write on the driver's cursor
(`write_on_cursor`) or one statement of the dialect's own SQL (`write_statement`). Every write
publishes the change-feed keys of what it changed (see shared.db.changes).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import Index, Table
from sqlalchemy.engine import Connection, make_url
from sqlalchemy.exc import ArgumentError, IntegrityError, InvalidRequestError
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.sql.base import Executable

from shared.db.changes import Publication, Subscriber
from shared.db.dialect import Dialect, Hearing
from shared.db.migrations import current_revision, upgrade_to_head
from shared.db.postgresql import PostgresqlDialect
from shared.db.sqlite import SqliteDialect
from shared.dependencies import Dependency
from shared.errors import StartupError

# What a database URL may be, as start-up errors say it.
URL_FORMS = "sqlite+aiosqlite:///FILE or postgresql+psycopg://USER:PASSWORD@HOST:PORT/DATABASE"
DEFAULT_DATA_DIR = ".cogment-aux"
# What closing waits for the statement under way on a connection thread.
CLOSE_TIMEOUT_S = 10
# Values bound in one IN list at most (SQLite caps a statement's parameters).
IN_LIST_BATCH = 500

T = TypeVar("T")
D = TypeVar("D")


def in_batches(values: Sequence[T]) -> Iterator[Sequence[T]]:
    """`values` in slices of IN_LIST_BATCH, one statement each."""
    for start in range(0, len(values), IN_LIST_BATCH):
        yield values[start : start + IN_LIST_BATCH]


def default_database_url(data_dir: str | Path, service: str) -> str:
    return f"sqlite+aiosqlite:///{Path(data_dir) / f'{service}.db'}"


class Transaction:
    """One write transaction (see `Database.write`): its connection, and the change-feed keys
    of what it changed."""

    __slots__ = ("_dialect", "changed_keys", "connection")

    def __init__(self, connection: Connection, dialect: Dialect) -> None:
        self.connection = connection
        self._dialect = dialect
        self.changed_keys: list[str] = []

    def execute(self, statement: Executable, parameters: Any = None) -> Any:
        """`connection.execute`: its CursorResult."""
        return self.connection.execute(statement, parameters)

    def changed(self, keys: Iterable[str], *, elsewhere: Iterable[str] = ()) -> None:
        """What this transaction changes: watchers of `keys` look again once it commits; of
        `elsewhere`, only other replicas' (this process updates itself)."""
        keys = list(keys)
        self._dialect.notify(self.connection, [*keys, *elsewhere])
        self.changed_keys.extend(keys)

    def lock(self, lock_id: int) -> None:
        """Hold `lock_id` until this transaction ends, exclusive among replicas."""
        self._dialect.lock(self.connection, lock_id)


class Database:
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
        backend = self.url.get_backend_name()
        try:
            if backend == "sqlite":
                self.dialect: Dialect = SqliteDialect(self.url)
            elif backend == "postgresql":
                self.dialect = PostgresqlDialect(self.url, pool_size)
            else:
                raise StartupError(f"unsupported database URL {self.display_url}: use {URL_FORMS}")
        except (ArgumentError, InvalidRequestError, ImportError) as error:  # e.g. a driver that is not async
            raise StartupError(
                f"cannot use the database URL {self.display_url}: {error}; use {URL_FORMS}"
            ) from None

    @property
    def display_url(self) -> str:
        return self.url.render_as_string(hide_password=True)

    @property
    def engine(self) -> AsyncEngine:
        """SQLAlchemy's engine (migrations, tests)."""
        return self.dialect.engine

    @property
    def shared_between_hosts(self) -> bool:
        """Whether replicas on several hosts may share this database."""
        return self.dialect.shared_between_hosts

    def pick(self, choices: Mapping[str, D]) -> D:
        """The choice made for this database's dialect (`sqlite`, `postgresql`): how a store
        picks its dialect-specific SQL, once, without naming a dialect."""
        return choices[self.dialect.name]

    def publish_to(self, channel: str, subscriber: Subscriber) -> Hearing:
        """From now on, tell `subscriber` of every commit, and other processes through `channel`.
        Returns what hears other processes' commits (start it to hear them)."""
        if self.dialect.publication is not None:
            raise RuntimeError("a database has one change feed: this one has already")
        publication = Publication(channel, subscriber)
        self.dialect.publication = publication
        return self.dialect.hearing(publication)

    def _published(self, keys: Sequence[str]) -> None:
        publication = self.dialect.publication
        if keys and publication is not None:
            publication.subscriber.changed(list(keys))

    async def fetch(
        self, statement: Executable, parameters: Mapping[str, Any] | None = None
    ) -> Sequence[Sequence[Any]]:
        """Every row of one statement, run on its own (no surrounding transaction): the read path.
        Rows are read by position, in the order of the statement's columns; a statement that
        returns no rows (e.g. ANALYZE) gives none."""
        return await self.dialect.fetch(statement, parameters)

    async def write(self, work: Callable[[Transaction], T]) -> T:
        """Run `work` (synchronous SQLAlchemy code) in one write transaction; its result.

        The keys `work` marks as changed (`Transaction.changed`) are told to other replicas
        inside the transaction (they hear of it only if it commits), and to this process's
        subscriber once it has committed, or once its COMMIT failed: a COMMIT whose answer was
        lost with the connection may have committed all the same, and other replicas then hear
        of it, so this one looks again too.
        """
        # The keys of a transaction that reached its COMMIT.
        committing: list[str] = []

        def run(connection: Connection) -> T:
            transaction = Transaction(connection, self.dialect)
            with connection.begin():
                result = work(transaction)
                committing.extend(transaction.changed_keys)
            return result

        return await self.dialect.transaction(run, lambda: self._published(committing))

    async def write_on_cursor(
        self, work: Callable[[Any], T], changed: Sequence[str], *, elsewhere: Sequence[str] = ()
    ) -> T:
        """Run `work` on a cursor of the driver's own connection (the dialect's parameter style),
        in one write transaction that changes `changed` (and `elsewhere`, as `Transaction.changed`);
        its result. For a hot path, where SQLAlchemy's work per statement would cost more than
        the database's."""
        return await self._published_after(
            self.dialect.on_cursor(work, [*changed, *elsewhere]), changed, elsewhere
        )

    async def write_statement(
        self,
        sql: str,
        parameters: Mapping[str, Any],
        changed: Sequence[str],
        *,
        elsewhere: Sequence[str] = (),
    ) -> list[tuple[Any, ...]]:
        """The rows of one statement of the dialect's own SQL, its own write transaction, which
        changes `changed` (and `elsewhere`): one round trip, for a hot path."""
        return await self._published_after(
            self.dialect.statement(sql, parameters, [*changed, *elsewhere]), changed, elsewhere
        )

    async def _published_after(
        self, write: Awaitable[T], changed: Sequence[str], elsewhere: Sequence[str]
    ) -> T:
        """The outcome of `write`, whose keys are published once it is over: also when its caller
        was cancelled meanwhile (the connection's thread goes on, and its COMMIT may land after
        the cancellation), and when it failed, since the outcome may be unknown (the connection
        broke after the COMMIT was sent: other replicas may hear of it, so this process looks again
        too, at everything it wrote)."""
        done = asyncio.ensure_future(write)

        def publish(outcome: asyncio.Future[T]) -> None:
            failed = outcome.cancelled() or outcome.exception() is not None
            self._published([*changed, *elsewhere] if failed else changed)

        done.add_done_callback(publish)
        try:
            return await asyncio.shield(done)
        except self.dialect.integrity_error as error:  # as SQLAlchemy raises it elsewhere
            raise IntegrityError(None, None, error) from error

    def insert(self, table: Table) -> Any:
        """An INSERT of this database's dialect, which offers `on_conflict_do_nothing/update`."""
        return self.dialect.sql.insert(table)

    def conflict_target(self, index: Index) -> dict[str, Any]:
        """The `on_conflict_do_*` arguments naming the unique `index` (partial or not: with its
        predicate as the schema declares it for this dialect)."""
        return {
            "index_elements": list(index.expressions),
            "index_where": index.dialect_options[self.dialect.name]["where"],
        }

    async def probe(self) -> None:
        """Raises if the database cannot be reached (see shared.dependencies)."""
        await self.dialect.probe()

    async def reset_connections(self) -> None:
        """Drop pooled connections (after an outage they are dead: each would fail one call)."""
        await self.dialect.engine.dispose()
        self.dialect.reset()

    def as_dependency(self) -> Dependency:
        return Dependency("database", self.probe, self.reset_connections)

    async def migrate(self) -> None:
        """Bring the schema to the latest revision (safe with several replicas starting at once)."""
        await self.dialect.migrate(upgrade_to_head)

    async def revision(self) -> str | None:
        """The schema's current revision (None: none yet)."""
        async with self.engine.connect() as connection:
            revision: str | None = await connection.run_sync(current_revision)
            return revision

    async def close(self) -> None:
        await self.dialect.settle(CLOSE_TIMEOUT_S)
        await self.dialect.engine.dispose()
        await asyncio.get_running_loop().run_in_executor(None, self.dialect.close, CLOSE_TIMEOUT_S)
