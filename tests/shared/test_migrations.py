"""The suite's one migration history, from an empty database, on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from typing import Any

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

from shared.db import Database, alembic_config, current_revision
from shared.schema import metadata
from tests.helpers.services import PROJECT_ROOT


def _head() -> str:
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None
    return head


def _schema_differences(connection: Any) -> list[Any]:
    return list(compare_metadata(MigrationContext.configure(connection), metadata))


async def test_migrates_an_empty_database_to_the_declared_schema(database_url: str) -> None:
    database = Database(database_url)
    try:
        await database.migrate()
        await database.migrate()  # idempotent
        async with database.engine.connect() as connection:
            assert await connection.run_sync(current_revision) == _head()
            # The migrations build exactly the tables shared.schema declares.
            assert await connection.run_sync(_schema_differences) == []
    finally:
        await database.close()


async def test_replicas_starting_together_migrate_once(postgres_url: str) -> None:
    databases = [Database(postgres_url) for _ in range(4)]
    try:
        await asyncio.gather(*(database.migrate() for database in databases))
        async with databases[0].engine.connect() as connection:
            assert await connection.run_sync(current_revision) == _head()
    finally:
        for database in databases:
            await database.close()


def test_migrate_command(postgres_url: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "shared.migrate", "--database_url", postgres_url, "--log_format", "json"],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert _head() in result.stderr
