"""The hot paths' own connections (`Database.write_on_cursor`, `write_statement`: SQLite's
writer thread, PostgreSQL's direct connection): a failure leaves nothing behind and the next call
works, a lost connection is replaced, and a closed database answers at once instead of leaving its
callers waiting."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import psycopg
import pytest
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError

from shared.db import Database

# Far above what a call takes; reaching it means the call hung.
CALL_LIMIT_S = 30.0


@pytest.fixture
async def sqlite_database(tmp_path: Path) -> AsyncIterator[Database]:
    database = Database(f"sqlite+aiosqlite:///{tmp_path / 'threads.db'}")
    await database.write_on_cursor(lambda cursor: cursor.execute("CREATE TABLE t (v INTEGER UNIQUE)"), [])
    yield database
    await database.close()


def _rows(cursor: sqlite3.Cursor) -> list[int]:
    return [row[0] for row in cursor.execute("SELECT v FROM t ORDER BY v").fetchall()]


async def test_a_failed_sqlite_transaction_leaves_nothing_and_the_next_one_works(
    sqlite_database: Database,
) -> None:
    def insert_twice(cursor: sqlite3.Cursor) -> None:
        cursor.execute("INSERT INTO t VALUES (1)")
        cursor.execute("INSERT INTO t VALUES (1)")  # violates UNIQUE: the first is rolled back too

    with pytest.raises(IntegrityError):
        await asyncio.wait_for(sqlite_database.write_on_cursor(insert_twice, []), CALL_LIMIT_S)
    await sqlite_database.write_on_cursor(lambda cursor: cursor.execute("INSERT INTO t VALUES (2)"), [])
    assert await sqlite_database.write_on_cursor(_rows, []) == [2]


async def test_a_closed_database_fails_calls_at_once(sqlite_database: Database) -> None:
    await sqlite_database.close()
    with pytest.raises(ConnectionError, match="closed"):
        await asyncio.wait_for(sqlite_database.write_on_cursor(_rows, []), CALL_LIMIT_S)


async def test_a_postgresql_connection_that_was_lost_is_replaced(postgres_url: str) -> None:
    database = Database(postgres_url)
    try:
        backend = "SELECT pg_backend_pid()"
        [(first_pid,)] = await database.write_statement(backend, {}, [])
        [(killed,)] = await database.fetch(text("SELECT pg_terminate_backend(:pid)"), {"pid": first_pid})
        assert killed
        with pytest.raises(psycopg.OperationalError):
            await asyncio.wait_for(database.write_statement(backend, {}, []), CALL_LIMIT_S)
        [(second_pid,)] = await asyncio.wait_for(database.write_statement(backend, {}, []), CALL_LIMIT_S)
        assert second_pid != first_pid
        await database.reset_connections()  # after an outage: a new connection for the next call
        [(third_pid,)] = await asyncio.wait_for(database.write_statement(backend, {}, []), CALL_LIMIT_S)
        assert third_pid != second_pid
    finally:
        await database.close()
    with pytest.raises(ConnectionError, match="closed"):
        await asyncio.wait_for(database.write_statement("SELECT 1", {}, []), CALL_LIMIT_S)
