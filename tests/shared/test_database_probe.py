"""The database's probe (what readiness follows) answers on a connection of its own: it does not
queue behind the calls, so readiness does not flap when every connection is busy."""

from __future__ import annotations

import asyncio

from sqlalchemy import text

from shared.db import Database

# A statement long enough to still run when the probe is made (a second or more), and how many
# make every connection busy: SQLite's one reader thread; every pooled connection and its
# overflow (2 + 2), and more waiting.
SLOW = {
    "sqlite": (
        "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 10000000) "
        "SELECT count(*) FROM c",
        1,
    ),
    "postgresql": ("SELECT pg_sleep(2)", 6),
}


async def test_the_probe_answers_while_every_connection_is_busy(database_url: str) -> None:
    database = Database(database_url, pool_size=2)
    await database.migrate()
    try:
        slow, calls = SLOW[database.engine.dialect.name]
        busy = [asyncio.create_task(database.fetch(text(slow))) for _ in range(calls)]
        await asyncio.sleep(0.2)
        probe = asyncio.create_task(database.probe())
        done, _ = await asyncio.wait([probe, *busy], return_when=asyncio.FIRST_COMPLETED)
        assert done == {probe}, "the probe waited for the calls"
        probe.result()
        await asyncio.gather(*busy)
    finally:
        await database.close()
