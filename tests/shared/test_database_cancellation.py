"""A read or a write transaction cancelled at any point of its way, or twice (gRPC can cancel a
handler twice: the call, then the server stopping), gives its connection back to the pool: none
is left for the garbage collector, which SQLAlchemy warns of."""

from __future__ import annotations

import asyncio
import gc
import warnings
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from sqlalchemy import text

from shared.db import Database, Transaction

SLOW = {"sqlite": "SELECT count(*) FROM sqlite_master", "postgresql": "SELECT pg_sleep(0.01)"}


def read(database: Database, statement: Any) -> Awaitable[Any]:
    return database.fetch(statement)


def write(database: Database, statement: Any) -> Awaitable[Any]:
    def work(transaction: Transaction) -> None:
        transaction.connection.execute(statement)

    return database.write(work)


@pytest.mark.parametrize("call", [read, write])
async def test_a_call_cancelled_twice_gives_its_connection_back(
    database_url: str, call: Callable[[Database, Any], Awaitable[Any]]
) -> None:
    database = Database(database_url, pool_size=2)
    await database.migrate()
    try:
        statement = text(SLOW[database.engine.dialect.name])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for delay in [0.0, 0.0005, 0.001, 0.002, 0.005, 0.01] * 4:
                task = asyncio.ensure_future(call(database, statement))
                await asyncio.sleep(delay)
                task.cancel()
                await asyncio.sleep(0)
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            await asyncio.sleep(0.2)  # the calls cancelled are over
            gc.collect()
        assert not [str(warning.message) for warning in caught if "non-checked-in" in str(warning.message)]
        assert await database.fetch(text("SELECT 1")) == [(1,)]
    finally:
        await database.close()


@pytest.mark.parametrize("call", [read, write])
async def test_a_call_cancelled_at_any_step_gives_its_connection_back(
    database_url: str, call: Callable[[Database, Any], Awaitable[Any]]
) -> None:
    """Cancelled after each number of event loop steps in turn: on PostgreSQL, a read cancelled
    while SQLAlchemy set up the connection it had just checked out (its autocommit) lost it."""
    database = Database(database_url, pool_size=2)
    await database.migrate()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for steps in range(40):
                task = asyncio.ensure_future(call(database, text("SELECT 1")))
                for _ in range(steps):
                    await asyncio.sleep(0)
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                await asyncio.sleep(0.02)
                gc.collect()  # at once: a connection lost here is found by a later checkout otherwise
            await asyncio.sleep(0.2)  # the calls cancelled are over
            gc.collect()
        assert not [str(warning.message) for warning in caught if "non-checked-in" in str(warning.message)]
        assert database.engine.pool.checkedout() == 0  # type: ignore[attr-defined]
    finally:
        await database.close()


async def test_closing_waits_for_the_reads_given_up_on(database_url: str) -> None:
    """Their tasks still cancel their statements when the caller has gone: closed meanwhile,
    then the event loop ending, they would be destroyed holding their connections."""
    database = Database(database_url, pool_size=2)
    await database.migrate()
    statement = text(
        {"sqlite": SLOW["sqlite"], "postgresql": "SELECT pg_sleep(1)"}[database.engine.dialect.name]
    )
    reads = [asyncio.ensure_future(database.fetch(statement)) for _ in range(2)]
    await asyncio.sleep(0.1)  # under way
    for read in reads:
        read.cancel()
    await asyncio.gather(*reads, return_exceptions=True)
    await database.close()
    assert not [task for task in asyncio.all_tasks() if "_fetch" in repr(task.get_coro())]
