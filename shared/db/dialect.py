"""What each database dialect provides to `Database`: the one place where SQLite and PostgreSQL
differ in how work is run, committed and published."""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

from sqlalchemy.engine import Connection, CursorResult
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.sql.base import Executable

from shared.db.changes import Publication

T = TypeVar("T")

# Where a statement of `Database.write_statement` lets the database publish what it changed, in the
# statement itself: at the end of its main query's FROM list (see each dialect's `statement`).
PUBLISHED = "{published}"


def rows_of(result: CursorResult[Any]) -> Sequence[Sequence[Any]]:
    return result.all() if result.returns_rows else []


class Hearing(ABC):
    """Other processes' commits, told to a publication's subscriber while started."""

    def __init__(self) -> None:
        # Set once other processes' changes are heard (or could not be: retried in the background).
        self.listening = asyncio.Event()

    @abstractmethod
    async def start(self) -> None: ...

    @abstractmethod
    async def stop(self) -> None: ...

    @abstractmethod
    def wanted(self) -> None:
        """The subscriber began hearing (a watch began)."""


class Dialect(ABC):
    name: str
    # SQLAlchemy's dialect module (its INSERT offers on_conflict_do_nothing/update).
    sql: Any
    # Whether replicas on several hosts may share the database.
    shared_between_hosts: bool
    engine: AsyncEngine
    # What the driver raises for a violated constraint.
    integrity_error: type[Exception]
    # Where commits are told (None: nobody subscribed).
    publication: Publication | None = None

    @abstractmethod
    async def fetch(
        self, statement: Executable, parameters: Mapping[str, Any] | None
    ) -> Sequence[Sequence[Any]]:
        """Every row of one statement, run on its own (no surrounding transaction)."""

    @abstractmethod
    async def transaction(self, run: Callable[[Connection], T], finished: Callable[[], None]) -> T:
        """`run` (synchronous SQLAlchemy code) in one write transaction; `finished()` once it is
        over, whatever its outcome."""

    @abstractmethod
    def on_cursor(self, work: Callable[[Any], T], keys: Sequence[str]) -> Awaitable[T]:
        """`work` on a driver cursor in one write transaction, which tells other processes of
        `keys`: its outcome, once the connection's thread has run it (whoever still waits)."""

    @abstractmethod
    def statement(
        self, sql: str, parameters: Mapping[str, Any], keys: Sequence[str]
    ) -> Awaitable[list[tuple[Any, ...]]]:
        """The rows of one statement of this dialect's SQL, its own transaction, which tells other
        processes of `keys` where the statement says PUBLISHED: one round trip to the database."""

    @abstractmethod
    def notify(self, connection: Connection, keys: Sequence[str]) -> None:
        """Tell other processes of `keys` from inside a transaction (they hear it at commit)."""

    @abstractmethod
    def lock(self, connection: Connection, lock_id: int) -> None:
        """Take `lock_id` for the rest of the transaction, exclusive among replicas."""

    @abstractmethod
    def hearing(self, publication: Publication) -> Hearing: ...

    @abstractmethod
    async def migrate(self, upgrade: Callable[[Connection], None]) -> None:
        """Run `upgrade`, safely with several replicas starting at once."""

    @abstractmethod
    def probe(self) -> Awaitable[object]:
        """Fails if the database cannot be reached. On a connection of its own: a probe queued
        behind the calls (a busy pool, the reader thread) would time out under load, and
        readiness would flap while the database is fine."""

    @abstractmethod
    def reset(self) -> None:
        """After an outage: connect again before the next work."""

    @abstractmethod
    async def settle(self, timeout_s: float) -> None:
        """Before closing: wait up to `timeout_s` for work its callers gave up on that still
        holds a pooled connection."""

    @abstractmethod
    def close(self, timeout_s: float) -> None:
        """Blocking: run it off the event loop."""
