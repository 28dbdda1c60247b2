"""Wide inquiries are answered in pages: an inquirer that stops reading holds about one page of
the server's memory, not every match, and other callers are still answered meanwhile. Measured on
a real server process's RSS."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc

from services.directory.model import Endpoint, Registration
from services.directory.store import PAGE_BYTES, DirectoryStore
from shared.api import directory_pb2, directory_pb2_grpc
from shared.db import Database
from shared.digest import sha256_hex
from tests.helpers.directory import ACTOR, GRPC
from tests.helpers.services import rss_bytes, start_service

ENTRIES = 5000
PROPERTY_BYTES = 8 * 1024  # 40 MiB of properties match every inquiry
PAUSED_INQUIRIES = 8
# Above a page per inquiry (as stored, parsed and encoded): gRPC's own buffers.
MARGIN_BYTES = 64 * 1024 * 1024


async def _fill(url: str) -> None:
    database = Database(url)
    await database.migrate()
    store = DirectoryStore(database)
    padding = "x" * PROPERTY_BYTES
    endpoint = Endpoint(GRPC, "127.0.0.1", 1)
    registrations = [
        Registration(endpoint, ACTOR, {"wide": "yes", "n": str(n), "padding": padding}, permanent=True)
        for n in range(ENTRIES)
    ]
    await asyncio.gather(
        *(store.add(registration, sha256_hex(""), n) for n, registration in enumerate(registrations))
    )
    await database.close()


async def test_an_inquirer_that_stops_reading_holds_about_one_page(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'directory.db'}"
    await _fill(url)
    args = ["--database_url", url, "--log_level", "info"]
    with await asyncio.to_thread(start_service, "services.directory", args, log_dir=tmp_path) as service:
        async with grpc.aio.insecure_channel(service.address) as channel:
            stub = directory_pb2_grpc.DirectorySPStub(channel)
            wide = directory_pb2.InquireRequest(
                details=directory_pb2.ServiceDetails(type=ACTOR, properties={"wide": "yes"})
            )
            await asyncio.sleep(1.0)
            idle = rss_bytes(service.process.pid)
            paused = [stub.Inquire(wide) for _ in range(PAUSED_INQUIRIES)]
            firsts = [await call.read() for call in paused]
            assert all(first.data.details.properties["n"] == str(ENTRIES - 1) for first in firsts)
            deadline = time.monotonic() + 3.0
            peak = 0
            while time.monotonic() < deadline:  # the inquirers have stopped reading
                peak = max(peak, rss_bytes(service.process.pid) - idle)
                await asyncio.sleep(0.1)
            print(f"directory: RSS grew {peak / 2**20:.1f} MiB with {PAUSED_INQUIRIES} paused wide inquiries")
            assert peak < PAUSED_INQUIRIES * 3 * PAGE_BYTES + MARGIN_BYTES, f"RSS grew {peak / 2**20:.0f} MiB"

            # Others are answered meanwhile.
            one = firsts[0].data.service_id
            by_id = [reply async for reply in stub.Inquire(directory_pb2.InquireRequest(service_id=one))]
            assert [reply.data.service_id for reply in by_id] == [one]

            # A paused inquiry then reads every match, most recent first.
            numbers = [int(firsts[0].data.details.properties["n"])]
            while (reply := await paused[0].read()) is not grpc.aio.EOF:
                numbers.append(int(reply.data.details.properties["n"]))
            assert numbers == list(reversed(range(ENTRIES)))
            for call in paused[1:]:
                call.cancel()
