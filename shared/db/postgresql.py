"""PostgreSQL, shared by replicas: a pool for general work, a connection of its own for the hot
paths, and notifications between replicas.

A commit's keys are sent with `pg_notify` inside its transaction: PostgreSQL delivers them to
every listening replica when it commits, never for a rollback. One connection per process
LISTENs on the channel while the process's subscriber is hearing, and only then: every replica's
commits notify every listening replica, which costs each of them CPU for every commit. That
connection is checked every few seconds and re-established after a failure; since notifications
sent while it did not listen are lost, the subscriber is told that anything may have changed
once it listens (again).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import socket
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from typing import Any, TypeVar

import psycopg
from sqlalchemy import text
from sqlalchemy.dialects import postgresql as sqlalchemy_postgresql
from sqlalchemy.engine import URL, Connection
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.sql.base import Executable

from shared.db.changes import Publication
from shared.db.dialect import PUBLISHED, Dialect, Hearing, rows_of
from shared.db.threads import ConnectionThread
from shared.supervision import FailureStreak, cancel_and_wait, uninterrupted

CONNECT_TIMEOUT_S = 5
# Work on a connection of the dialect's own threads that runs longer is interrupted (its connection
# broken: the work fails, and is retried as after an outage). Keepalives and the TCP user timeout
# cannot tell a peer that went silent behind something that still acknowledges what is sent (a
# stuck proxy or pooler); a batch of samples or of registrations takes milliseconds.
STATEMENT_DEADLINE_S = 10.0
# Any constant works: it only has to be the same for every replica running migrations.
MIGRATION_LOCK_ID = 0x636F676D656E74
MAX_RECONNECT_DELAY_S = 0.5
# How long the listening connection may stay silent before it is checked: a connection the network
# dropped without a word would otherwise leave every waiter asleep.
LISTEN_CHECK_PERIOD_S = 5.0

# A volatile subquery of one row joined to the main query, part of the statement and its transaction:
# it runs whenever the statement changed rows (and may when it changed none, or run twice: harmless,
# a notification only says "look again", and PostgreSQL delivers one of identical payloads).
# Every payload of a change, one statement however many there are (see `_notices`).
_NOTIFY_ALL = (
    "SELECT count(pg_notify(%(published_channel)s, payload)) AS sent "
    "FROM json_array_elements_text(%(published_payloads)s::json) AS payload"
)
_PUBLISHED_JOIN = f"CROSS JOIN ({_NOTIFY_ALL}) AS published"
_LOCK = text("SELECT pg_advisory_xact_lock(:id)")

T = TypeVar("T")


def _direct_thread(conninfo: str, name: str) -> ConnectionThread[psycopg.Connection[Any]]:
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

    return ConnectionThread(name, connect, dropped, lambda connection: connection.close(), interrupt=_break)


def _break(connection: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> None:
    """Shut the connection's socket down (from any thread): its wait for the server ends at once."""
    with socket.socket(fileno=os.dup(connection.pgconn.socket)) as duplicate:
        duplicate.shutdown(socket.SHUT_RDWR)


@functools.cache
def _published(sql: str) -> str:
    """`sql` with its notifications joined where it says PUBLISHED."""
    assert PUBLISHED in sql, "a statement that writes says where its changes are published"
    return sql.replace(PUBLISHED, _PUBLISHED_JOIN)


class PostgresqlDialect(Dialect):
    name = "postgresql"
    sql = sqlalchemy_postgresql
    integrity_error = psycopg.IntegrityError
    shared_between_hosts = True

    def __init__(self, url: URL, pool_size: int) -> None:
        # No pre-ping: it costs a round trip per checkout. A connection the server dropped fails
        # one call, and SQLAlchemy then replaces the pool's connections; old ones are recycled.
        self.engine = create_async_engine(
            url,
            pool_size=pool_size,
            max_overflow=pool_size,
            pool_recycle=1800,
            # The most recently used connection first: libpq keeps each connection's buffers at
            # the largest message it carried, so rotating through the pool (FIFO) left a
            # batch-sized buffer in every connection (8 MiB sample batches: +500 MiB).
            pool_use_lifo=True,
            # A host that drops packets must fail a call in seconds, not the OS's minutes.
            connect_args={"connect_timeout": CONNECT_TIMEOUT_S},
        )
        # Single statements (most reads) run outside explicit transactions: each BEGIN and COMMIT
        # is a round trip that a lone SELECT does not need.
        self._autocommit = self.engine.execution_options(isolation_level="AUTOCOMMIT")
        # The URL as psycopg takes it, for the connections made without SQLAlchemy.
        self.conninfo = url.set(drivername="postgresql").render_as_string(hide_password=False)
        # The hot paths: at a small batch per statement, SQLAlchemy's execution and the async
        # driver's waits through the event loop cost more than the statement's round trip.
        self._direct = _direct_thread(self.conninfo, "postgresql-direct")
        self._prober = _direct_thread(self.conninfo, "postgresql-probe")
        # Reads whose callers were cancelled, still giving their connections back (`settle`).
        self._cancelled: set[asyncio.Task[Any]] = set()

    async def fetch(
        self, statement: Executable, parameters: Mapping[str, Any] | None
    ) -> Sequence[Sequence[Any]]:
        return await self._cancelled_once(self._fetch(statement, parameters))

    async def _cancelled_once(self, work: Coroutine[Any, Any, T]) -> T:
        """`work`, which holds a pooled connection, in a task of its own that a cancellation of
        the caller cancels once. A second cancellation (gRPC can cancel a handler twice: the
        call, then the server stopping) interrupted the connection's way back to its pool, which
        SQLAlchemy then dropped with a warning when garbage collected; so did closing while the
        task still cancelled its statement (see `settle`)."""
        task = asyncio.ensure_future(work)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.cancel()
            self._cancelled.add(task)
            task.add_done_callback(self._cancelled.discard)
            task.add_done_callback(_outcome_seen)
            raise

    async def settle(self, timeout_s: float) -> None:
        if self._cancelled:
            await asyncio.wait(set(self._cancelled), timeout=timeout_s)

    async def _fetch(
        self, statement: Executable, parameters: Mapping[str, Any] | None
    ) -> Sequence[Sequence[Any]]:
        connection = self._autocommit.connect()
        try:
            # Checked out uninterrupted: SQLAlchemy (2.1) turns autocommit on after the checkout,
            # an await whose cancellation left the connection out of the pool (dropped, with a
            # warning, when collected). Given back the same way, as `async with` does.
            await uninterrupted(connection.start())
            raw = (await connection.get_raw_connection()).driver_connection
            result = await _within(connection.execute(statement, parameters), raw, STATEMENT_DEADLINE_S)
            return rows_of(result)
        finally:
            if connection.sync_connection is not None:  # checked out
                await uninterrupted(connection.close())

    async def transaction(self, run: Callable[[Connection], T], finished: Callable[[], None]) -> T:
        try:
            async with self.engine.connect() as connection:
                return await connection.run_sync(run)
        finally:
            finished()

    def _notices(self, keys: Sequence[str]) -> dict[str, str] | None:
        """The parameters of _NOTIFY_ALL telling of `keys` (None: nobody to tell, or nothing)."""
        publication = self.publication
        if publication is None or not keys:
            return None
        return {
            "published_channel": publication.channel,
            "published_payloads": json.dumps(publication.payloads(keys)),
        }

    def on_cursor(self, work: Callable[[Any], T], keys: Sequence[str]) -> asyncio.Future[T]:
        notices = self._notices(keys)

        def run(connection: psycopg.Connection[Any]) -> T:
            with connection.transaction(), connection.cursor() as cursor:
                result = work(cursor)
                if notices is not None:
                    cursor.execute(_NOTIFY_ALL, notices)
            return result

        return self._direct.submit(run, STATEMENT_DEADLINE_S)

    def statement(
        self, sql: str, parameters: Mapping[str, Any], keys: Sequence[str]
    ) -> asyncio.Future[list[tuple[Any, ...]]]:
        """The notifications are a join of the statement's main query (a second statement, even
        pipelined, cost the client more than the rest of a small batch's way there)."""
        notices = self._notices(keys)
        if notices is not None:
            statement = _published(sql)
            parameters = {**parameters, **notices}
        else:
            statement = sql.replace(PUBLISHED, "")
        return self._direct.submit(
            lambda connection: connection.execute(statement, parameters).fetchall(), STATEMENT_DEADLINE_S
        )

    def notify(self, connection: Connection, keys: Sequence[str]) -> None:
        notices = self._notices(keys)
        if notices is not None:
            connection.exec_driver_sql(_NOTIFY_ALL, notices)

    def lock(self, connection: Connection, lock_id: int) -> None:
        connection.execute(_LOCK, {"id": lock_id})

    def hearing(self, publication: Publication) -> Hearing:
        return _Listener(self.conninfo, publication)

    async def migrate(self, upgrade: Callable[[Connection], None]) -> None:
        async with self.engine.connect() as connection:
            # Session-level lock, held across alembic's own transactions.
            await connection.execute(text("SELECT pg_advisory_lock(:id)"), {"id": MIGRATION_LOCK_ID})
            await connection.commit()
            try:
                await connection.run_sync(upgrade)
                await connection.commit()
            finally:
                await connection.execute(text("SELECT pg_advisory_unlock(:id)"), {"id": MIGRATION_LOCK_ID})
                await connection.commit()

    async def probe(self) -> object:
        answer = self._prober.submit(lambda connection: connection.execute("SELECT 1").fetchall())
        try:
            return await asyncio.shield(answer)
        except asyncio.CancelledError:  # given up on (timed out): the next probe connects again
            self._prober.interrupt(answer)
            raise

    def reset(self) -> None:
        # Work still under way began during the outage, on a connection that may never answer.
        self._direct.interrupt()
        self._direct.reset()
        self._prober.reset()

    def close(self, timeout_s: float) -> None:
        self._direct.close(timeout_s)
        self._prober.close(timeout_s)


class _Listener(Hearing):
    def __init__(self, conninfo: str, publication: Publication) -> None:
        super().__init__()
        self._conninfo = conninfo
        self._publication = publication
        self._task: asyncio.Task[None] | None = None
        # Set when the subscriber begins hearing: the listener LISTENs only while it hears.
        self._wanted = asyncio.Event()

    def wanted(self) -> None:
        self._wanted.set()

    async def start(self) -> None:
        """Returns once the listening connection is open, or could not be: it is retried in the
        background."""
        self._task = asyncio.get_running_loop().create_task(
            self._listen(), name=f"listen-{self._publication.channel}"
        )
        await self.listening.wait()

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None

    async def _listen(self) -> None:
        streak = FailureStreak("listening for changes", channel=self._publication.channel)
        while True:
            try:
                connect = psycopg.AsyncConnection.connect(
                    self._conninfo, autocommit=True, connect_timeout=CONNECT_TIMEOUT_S
                )
                async with await connect as connection:
                    if streak.failures:
                        streak.succeeded()
                    self.listening.set()
                    await self._follow(connection)
            except (psycopg.Error, OSError, asyncio.TimeoutError) as error:
                self._publication.subscriber.lost()
                # Retried often: until it is back, other replicas' writes reach readers late.
                delay = min(streak.failed(error), MAX_RECONNECT_DELAY_S)
                self.listening.set()  # start-up must not hang on an unreachable database
                await asyncio.sleep(delay)

    async def _follow(self, connection: psycopg.AsyncConnection[Any]) -> None:
        """LISTEN while the subscriber hears, and only then. Listening begins after a watch may
        have read the tables, so the subscriber is told that anything may have changed then (as
        after a lost connection: what was notified meanwhile was missed). The connection is
        checked whenever it stayed silent for LISTEN_CHECK_PERIOD_S."""
        subscriber = self._publication.subscriber
        channel = self._publication.channel
        listening = False
        while True:
            self._wanted.clear()  # before looking: a watch that begins from now on sets it
            if not subscriber.hearing:
                if listening:
                    await _answered(connection, f'UNLISTEN "{channel}"')
                    listening = False
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wanted.wait(), LISTEN_CHECK_PERIOD_S)
                if not subscriber.hearing:
                    await _answered(connection, "SELECT 1")
                    continue
            if not listening:
                await _answered(connection, f'LISTEN "{channel}"')
                listening = True
                subscriber.changed(None)
            silent = True
            async with contextlib.aclosing(
                connection.notifies(timeout=LISTEN_CHECK_PERIOD_S)
            ) as notifications:
                async for notification in notifications:
                    silent = False
                    keys = self._publication.received(notification.payload)
                    if keys is not None:
                        subscriber.changed(keys)
                    if not subscriber.hearing:
                        break
            if silent:
                await _answered(connection, "SELECT 1")


async def _answered(connection: psycopg.AsyncConnection[Any], sql: str) -> None:
    """`sql` on the listening connection, failing if it is not answered within CONNECT_TIMEOUT_S."""
    await _within(connection.execute(sql), connection, CONNECT_TIMEOUT_S)


def _outcome_seen(task: asyncio.Future[Any]) -> None:
    """The caller has gone: its work's failure, if any, interests nobody (no "never retrieved")."""
    if not task.cancelled():
        task.exception()


async def _within(call: Awaitable[T], connection: Any, deadline_s: float) -> T:
    """`call` on the async `connection` (psycopg's), which is broken if `call` is not answered
    within `deadline_s`: the call then fails at once. Not cancelled: psycopg answers a cancellation
    by asking the server to cancel, and waits up to 10 s more, which a silent server never answers,
    while whatever waits for the call waits too."""
    execution = asyncio.ensure_future(call)
    try:
        done, _ = await asyncio.wait({execution}, timeout=deadline_s)
    except asyncio.CancelledError:
        # Over before the connection goes back to its pool, which it would otherwise leave.
        execution.cancel()
        with contextlib.suppress(BaseException):
            await execution
        raise
    if not done:
        _break(connection)
    return await execution
