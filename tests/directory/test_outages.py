"""The directory through a PostgreSQL outage: a registration rides it out and is answered once
the database is back (UNAVAILABLE only past `--outage_bound`: a status clients retry on, where a
FAILED reply reads as a refusal), inquiries answer UNAVAILABLE, readiness NOT_SERVING and back,
and service resumes by itself."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from tests.fixtures.postgres import PostgresCluster, new_database_name
from tests.helpers.directory import OK, inquire, register, register_ok, request, visible_ids
from tests.helpers.health import NOT_SERVING, SERVING, health, wait_for_health
from tests.helpers.running import make_directory_factory

OUTAGE_S = 2.0
WAIT_S = 30.0


async def test_postgresql_outage(faulty_postgres: PostgresCluster) -> None:
    url = faulty_postgres.create_database(new_database_name())
    async with make_directory_factory(url)() as directory:
        (before,) = await register_ok(directory, request(properties={"when": "before"}))

        faulty_postgres.pause()
        await wait_for_health(directory.channel, NOT_SERVING)
        assert await health(directory.channel, "liveness") == SERVING
        # Held until the database is back (the outage is shorter than the bound).
        during = asyncio.create_task(register(directory, request(properties={"when": "during"})))
        with pytest.raises(grpc.aio.AioRpcError) as unavailable:
            await inquire(directory, properties={"when": "before"})
        assert unavailable.value.code() == grpc.StatusCode.UNAVAILABLE
        await asyncio.sleep(OUTAGE_S)
        assert not during.done()

        faulty_postgres.resume()
        started = time.monotonic()
        (held,) = await asyncio.wait_for(during, WAIT_S)
        assert held.status == OK, held.error_msg
        print(
            f"directory: the held registration answered {time.monotonic() - started:.3f} s after PostgreSQL"
        )
        (after,) = await register_ok(directory, request(properties={"when": "after"}))
        await wait_for_health(directory.channel, SERVING)
        assert await visible_ids(directory, properties={"when": "before"}) == [before]
        assert await visible_ids(directory, properties={"when": "during"}) == [held.service_id]
        assert await visible_ids(directory, properties={"when": "after"}) == [after]
        assert await directory.service.store.count() == 3
