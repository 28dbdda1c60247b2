"""The SQL layer shared by every service: engine creation, transactions and migrations.

SQLite (through aiosqlite) is the embedded default, a file under the data directory; PostgreSQL
(through psycopg 3) is used when a `postgresql+psycopg://` URL is configured, which lets several
replicas of a service share one database.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import event, text
from sqlalchemy.engine import Connection, make_url
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from shared.logging import get_logger

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"
DEFAULT_DATA_DIR = ".cogment-aux"
SQLITE_BUSY_TIMEOUT_MS = 10_000
# Any constant works: it only has to be the same for every replica running migrations.
MIGRATION_LOCK_ID = 0x636F676D656E74

log = get_logger("shared.db")


def default_database_url(data_dir: str | Path, service: str) -> str:
    return f"sqlite+aiosqlite:///{Path(data_dir) / f'{service}.db'}"


def _sqlite_on_connect(dbapi_connection: Any, _record: Any) -> None:
    # Let SQLAlchemy's `begin` event emit BEGIN itself, so writes can take the lock up front.
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


def _sqlite_on_begin(connection: Connection) -> None:
    # Writers take the write lock at BEGIN: a deferred transaction that reads then writes can
    # fail with "database is locked" without waiting when another writer got there first.
    immediate = connection.get_execution_options().get("sqlite_immediate", False)
    connection.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")


class Database:
    """An async engine plus the transaction helpers every store uses."""

    def __init__(self, url: str, *, pool_size: int = 10) -> None:
        self.url = make_url(url)
        self.is_sqlite = self.url.get_backend_name() == "sqlite"
        self.is_postgresql = self.url.get_backend_name() == "postgresql"
        if not (self.is_sqlite or self.is_postgresql):
            raise ValueError(
                f"unsupported database URL {self.url.render_as_string()!r}: use sqlite or postgresql"
            )
        kwargs: dict[str, Any] = {"pool_pre_ping": self.is_postgresql}
        if self.is_sqlite:
            database = self.url.database or ""
            if database and database != ":memory:":
                Path(database).parent.mkdir(parents=True, exist_ok=True)
        else:
            kwargs.update(pool_size=pool_size, max_overflow=pool_size)
        self.engine: AsyncEngine = create_async_engine(self.url, **kwargs)
        if self.is_sqlite:
            event.listen(self.engine.sync_engine, "connect", _sqlite_on_connect)
            event.listen(self.engine.sync_engine, "begin", _sqlite_on_begin)
        # SQLite has one writer at a time: queueing writers of this process here is cheaper than
        # letting them spin on the busy timeout. Other processes still meet the busy timeout.
        self._write_lock = asyncio.Lock() if self.is_sqlite else None

    @property
    def display_url(self) -> str:
        return self.url.render_as_string(hide_password=True)

    @asynccontextmanager
    async def read(self) -> AsyncIterator[AsyncConnection]:
        async with self.engine.connect() as connection, connection.begin():
            yield connection

    @asynccontextmanager
    async def write(self) -> AsyncIterator[AsyncConnection]:
        if self._write_lock is None:
            async with self.engine.begin() as connection:
                yield connection
            return
        async with self._write_lock, self.engine.connect() as connection:
            connection = await connection.execution_options(sqlite_immediate=True)
            async with connection.begin():
                yield connection

    async def ping(self) -> None:
        async with self.engine.connect() as connection:
            await connection.execute(text("SELECT 1"))

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
