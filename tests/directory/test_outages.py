"""The directory through a PostgreSQL outage: registrations and inquiries answer UNAVAILABLE (a
status clients retry on, where a FAILED reply reads as a refusal), readiness NOT_SERVING and
back, and service resumes by itself."""

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
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await register(directory, request(properties={"when": "during"}))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.aio.AioRpcError) as unavailable:
            await inquire(directory, properties={"when": "before"})
        assert unavailable.value.code() == grpc.StatusCode.UNAVAILABLE
        await asyncio.sleep(OUTAGE_S)

        faulty_postgres.resume()
        started = time.monotonic()
        while True:
            try:
                (reply,) = await register(directory, request(properties={"when": "after"}))
                assert reply.status == OK, reply.error_msg
                break
            except grpc.aio.AioRpcError as error:
                assert error.code() == grpc.StatusCode.UNAVAILABLE
                assert time.monotonic() - started < WAIT_S
                await asyncio.sleep(0.02)
        print(f"directory: first registration {time.monotonic() - started:.3f} s after PostgreSQL came back")
        await wait_for_health(directory.channel, SERVING)
        assert await visible_ids(directory, properties={"when": "before"}) == [before]
        assert await visible_ids(directory, properties={"when": "during"}) == []
        assert await visible_ids(directory, properties={"when": "after"}) == [reply.service_id]
