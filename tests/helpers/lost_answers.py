"""Writes whose outcome the service cannot know: the connection broke after the COMMIT was sent.

Each helper patches a database's dialect where writes reach it (`transaction`, behind
`Database.write`, and `statement`, behind `Database.write_statement`) for one write, which fails
as a broken connection does (`psycopg.OperationalError`, UNAVAILABLE to `shared.errors.classify`).
To the service the three cases look alike; only what the database holds afterwards differs.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import psycopg
import pytest

from shared.db import Database

Write = Callable[..., Awaitable[Any]]
# What one write through the dialect does instead: given the dialect's own call and its arguments.
Around = Callable[[Write, tuple[Any, ...]], Awaitable[Any]]


def connection_broke() -> psycopg.OperationalError:
    return psycopg.OperationalError("server closed the connection unexpectedly")


def _around_writes(patch: pytest.MonkeyPatch, database: Database, around: Around) -> None:
    dialect = database.dialect
    for name in ("transaction", "statement"):
        real: Write = getattr(dialect, name)

        async def write(*args: Any, real: Write = real) -> Any:
            return await around(real, args)

        patch.setattr(dialect, name, write)


def lose_an_answer(
    patch: pytest.MonkeyPatch, database: Database, of: Callable[[Any], bool] = lambda _result: True
) -> list[Any]:
    """The next write whose result `of` accepts commits, and its answer is lost. Returns the
    results whose answers were lost (one at most), for the test to check it happened."""
    lost: list[Any] = []

    async def around(real: Write, args: tuple[Any, ...]) -> Any:
        result = await real(*args)
        if not lost and of(result):
            lost.append(result)
            raise connection_broke()
        return result

    _around_writes(patch, database, around)
    return lost


def break_before_commit(
    patch: pytest.MonkeyPatch, database: Database, *, every: bool = False
) -> list[tuple[Any, ...]]:
    """The next write (`every`: every write) fails without reaching the database (nothing
    committed). Returns the arguments of the writes that failed so."""
    broken: list[tuple[Any, ...]] = []

    async def around(real: Write, args: tuple[Any, ...]) -> Any:
        if every or not broken:
            broken.append(args)
            raise connection_broke()
        return await real(*args)

    _around_writes(patch, database, around)
    return broken


def commit_late(patch: pytest.MonkeyPatch, database: Database) -> list[tuple[Any, ...]]:
    """The next write fails at once, and commits only just before the write after it runs (a
    transaction the server finished after the service had given up on it). Returns the
    arguments of the write committed late (one at most)."""
    held: list[tuple[Any, ...]] = []
    late: list[tuple[Any, ...]] = []

    async def around(real: Write, args: tuple[Any, ...]) -> Any:
        if not held:
            held.append(args)
            raise connection_broke()
        if not late:
            late.append(held[0])
            await real(*held[0])
        return await real(*args)

    _around_writes(patch, database, around)
    return late
