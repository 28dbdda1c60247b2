"""The console through a real PostgreSQL outage of the datastore (the server paused): its pages
answer 503 saying the datastore is unavailable within the console's call deadline instead of
hanging, the overview shows the datastore as not ready (it answers, its database does not), the
other services' pages keep working, and everything is back once the database is."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from services.console.app import build_app
from services.console.decode import Decoders
from services.console.sources import CALL_TIMEOUT_S, Sources, SourceSettings
from services.console.views import Console
from tests.fixtures.postgres import PostgresCluster, new_database_name
from tests.helpers.console_trials import ended_trial, record, running_suite
from tests.helpers.eventually import eventually

pytestmark = pytest.mark.timeout(120)


async def test_a_datastore_outage_is_a_503_and_the_console_recovers(
    faulty_postgres: PostgresCluster, tmp_path: Path
) -> None:
    url = faulty_postgres.create_database(new_database_name())
    async with running_suite(tmp_path, url, "--outage_bound", "60", "--ingestion_lease", "90") as suite:
        await record(suite.datastore, "before", ended_trial(3))
        sources = Sources(
            SourceSettings(
                f"grpc://{suite.directory.address}",
                suite.endpoint(suite.registry),
                suite.endpoint(suite.datastore),
                "",
                None,
            )
        )
        app = build_app(Console(sources, Decoders()), "")
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://console") as http:
            assert "before" in (await http.get("/trials")).text
            faulty_postgres.pause()
            try:
                # The datastore waits the outage out; the console does not wait longer than its
                # deadline for it (asserted as an outcome: the page is answered, not hung).
                trials = await asyncio.wait_for(http.get("/trials"), 4 * CALL_TIMEOUT_S)
                assert trials.status_code == 503 and "trial datastore is unavailable" in trials.text.lower()
                trial = await asyncio.wait_for(http.get("/trials/before"), 4 * CALL_TIMEOUT_S)
                assert trial.status_code == 503
                overview = await asyncio.wait_for(http.get("/"), 4 * CALL_TIMEOUT_S)
                assert overview.status_code == 200 and overview.text.count('class="up"') == 2
                assert "not ready: its database or blob store is away" in overview.text
                assert (await http.get("/models")).status_code == 200
                assert (await http.get("/directory")).status_code == 200
            finally:
                faulty_postgres.resume()
            trials = await http.get("/trials")
            assert trials.status_code == 200 and "before" in trials.text
            assert (await http.get("/trials/before")).status_code == 200

            # Ready again once the datastore's own check of its database says so.
            async def all_up() -> bool:
                return (await http.get("/")).text.count('class="up"') == 3

            await eventually(all_up, "the datastore ready again", 30, interval_s=0.2)
        await sources.close()
