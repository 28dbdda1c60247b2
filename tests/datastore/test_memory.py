"""Memory bounded by settings, not by what clients do, measured on a real server process's RSS: a
replaying reader that stops reading holds about one read batch (`--read_batch_bytes`); ingestion
streams whose commits stall hold about `--ingestion_bytes`; many streams and readers of huge
samples wait their turn within `--ingestion_bytes` and `--replay_bytes`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import TypeVar

import grpc

from shared.api import (
    common_pb2,
    datalog_pb2,
    datalog_pb2_grpc,
    trial_datastore_pb2_grpc,
    trial_samples_pb2,
    trial_samples_pb2_grpc,
)
from shared.api import trial_datastore_pb2 as ds
from shared.validation import MiB
from tests.fixtures.postgres import PostgresCluster, new_database_name
from tests.helpers.datastore import datalog_inputs, datalog_sample, trial_params
from tests.helpers.services import rss_bytes, start_service

R = TypeVar("R")

SAMPLE_BYTES = 2 * 1024 * 1024
SAMPLES = 150  # 300 MiB stored
READ_BATCH_BYTES = 8 * 1024 * 1024
# Above the batch: gRPC's own buffers (its flow-control window, the message being sent).
MARGIN_BYTES = 64 * 1024 * 1024


async def test_a_reader_that_stops_reading_holds_about_one_batch(tmp_path: Path) -> None:
    args = [
        "--database_url",
        f"sqlite+aiosqlite:///{tmp_path / 'datastore.db'}",
        "--log_level",
        "info",
        "--read_batch_bytes",
        str(READ_BATCH_BYTES),
    ]
    with await asyncio.to_thread(start_service, "services.datastore", args, log_dir=tmp_path) as service:
        async with grpc.aio.insecure_channel(service.address) as channel:
            samples = []
            for tick in range(SAMPLES):
                sample = datalog_sample(tick, common_pb2.ENDED if tick == SAMPLES - 1 else common_pb2.RUNNING)
                sample.observations.observations[0] = bytes([tick % 256]) * SAMPLE_BYTES
                samples.append(sample)
            datalog = datalog_pb2_grpc.DatalogSPStub(channel)
            call = datalog.RunTrialDatalog(
                iter(datalog_inputs(trial_params(), samples)), metadata=(("trial-id", "big"),)
            )
            assert len([ack async for ack in call]) == SAMPLES + 1
            await asyncio.sleep(1.0)
            idle = rss_bytes(service.process.pid)

            stub = trial_datastore_pb2_grpc.TrialDatastoreSPStub(channel)
            reader = stub.RetrieveSamples(ds.RetrieveSamplesRequest(trial_ids=["big"]))
            first = await reader.read()
            assert first.trial_sample.tick_id == 0
            await asyncio.sleep(2.0)  # the client stops reading: the server must not read ahead
            growth = rss_bytes(service.process.pid) - idle
            print(f"datastore: RSS grew {growth / 2**20:.1f} MiB with a paused reader of a 300 MiB trial")
            assert growth < READ_BATCH_BYTES + MARGIN_BYTES, f"RSS grew {growth / 2**20:.0f} MiB"
            # It then reads everything, in order.
            ticks = [first.trial_sample.tick_id]
            while (reply := await reader.read()) is not grpc.aio.EOF:
                ticks.append(reply.trial_sample.tick_id)
            assert ticks == list(range(SAMPLES))


INGESTION_BYTES = 32 * 1024 * 1024
STREAMS = 8
STREAM_SAMPLES = 40  # 80 MiB per stream, 640 MiB in all
UNCOUNTED_BYTES = 128 * 1024 * 1024


async def test_ingestion_in_flight_is_bounded_while_commits_stall(
    faulty_postgres: PostgresCluster, tmp_path: Path
) -> None:
    url = faulty_postgres.create_database(new_database_name())
    args = ["--database_url", url, "--log_level", "info", "--outage_bound", "60", "--ingestion_lease", "90"]
    args += ["--ingestion_bytes", str(INGESTION_BYTES)]
    with await asyncio.to_thread(start_service, "services.datastore", args, log_dir=tmp_path) as service:
        async with grpc.aio.insecure_channel(service.address) as channel:
            datalog = datalog_pb2_grpc.DatalogSPStub(channel)
            await asyncio.sleep(1.0)
            idle = rss_bytes(service.process.pid)

            def samples(stream: int) -> list[datalog_pb2.DatalogSample]:
                made = []
                for tick in range(STREAM_SAMPLES):
                    state = common_pb2.ENDED if tick == STREAM_SAMPLES - 1 else common_pb2.RUNNING
                    sample = datalog_sample(tick, state)
                    sample.observations.observations[0] = bytes([stream, tick]) * (SAMPLE_BYTES // 2)
                    made.append(sample)
                return made

            async def ingest(stream: int) -> int:
                call = datalog.RunTrialDatalog(
                    iter(datalog_inputs(trial_params(), samples(stream))),
                    metadata=(("trial-id", f"t{stream}"),),
                )
                return len([ack async for ack in call])

            # The trials exist before the database stops answering: only the samples wait.
            streams = [asyncio.create_task(ingest(stream)) for stream in range(STREAMS)]
            await asyncio.sleep(1.0)
            faulty_postgres.pause()
            try:
                peak = 0
                deadline = time.monotonic() + 5.0
                while time.monotonic() < deadline:
                    peak = max(peak, rss_bytes(service.process.pid) - idle)
                    await asyncio.sleep(0.1)
            finally:
                faulty_postgres.resume()
            print(
                f"datastore: RSS grew {peak / 2**20:.1f} MiB with {STREAMS} streams of 2 MiB samples stalled"
            )
            # The budget and each stream's message being read, plus what the budget does not
            # cover: gRPC's buffers and the database connection's (libpq keeps a connection's at
            # the largest batch it sent). Unbounded, this load grew it by 780 MiB; 110 MiB now.
            bound = INGESTION_BYTES + STREAMS * SAMPLE_BYTES + UNCOUNTED_BYTES
            assert peak < bound, f"RSS grew {peak / 2**20:.0f} MiB"
            # The streams waited (flow control), they did not fail: every sample is acknowledged.
            assert await asyncio.wait_for(asyncio.gather(*streams), 120) == [STREAM_SAMPLES + 1] * STREAMS


HUGE_SAMPLE_BYTES = 60_000_000
HUGE_STREAMS = 8
HUGE_READERS = 16
# The default budgets (--ingestion_bytes, --replay_bytes).
BUDGET_BYTES = 256 * MiB
# What does not grow with the budgets: memory the allocator keeps for reuse after the first huge
# messages, gRPC's buffers, the database's.
UNBUDGETED_BYTES = 128 * MiB
HUGE_MESSAGES = [("grpc.max_receive_message_length", 100 * MiB), ("grpc.max_send_message_length", 100 * MiB)]


async def test_huge_samples_from_many_streams_and_readers_wait_their_turn(tmp_path: Path) -> None:
    """8 datalog streams each sending a 60 MB sample at once, then 16 readers of them (streams,
    then ranges): the peak stays within twice the budget (unbounded, they took 1,459 and 1,972
    MiB)."""
    args = ["--database_url", f"sqlite+aiosqlite:///{tmp_path / 'datastore.db'}", "--log_level", "info"]
    with await asyncio.to_thread(start_service, "services.datastore", args, log_dir=tmp_path) as service:
        pid = service.process.pid
        async with grpc.aio.insecure_channel(service.address, options=HUGE_MESSAGES) as channel:
            datalog = datalog_pb2_grpc.DatalogSPStub(channel)
            stub = trial_datastore_pb2_grpc.TrialDatastoreSPStub(channel)

            async def ingest(stream: int) -> int:
                sample = datalog_sample(0, common_pb2.ENDED)
                sample.observations.observations[0] = bytes([stream]) * HUGE_SAMPLE_BYTES
                inputs = datalog_inputs(trial_params(), [sample])
                call = datalog.RunTrialDatalog(iter(inputs), metadata=(("trial-id", f"huge{stream}"),))
                return len([ack async for ack in call])

            async def replay(reader: int) -> list[int]:
                request = ds.RetrieveSamplesRequest(trial_ids=[f"huge{reader % HUGE_STREAMS}"])
                replies = stub.RetrieveSamples(request)
                return [max(map(len, reply.trial_sample.payloads)) async for reply in replies]

            await asyncio.sleep(1.0)
            idle = rss_bytes(pid)
            acks, peak = await _with_peak_rss(pid, asyncio.gather(*map(ingest, range(HUGE_STREAMS))))
            _check_growth(peak - idle, f"{HUGE_STREAMS} streams of a 60 MB sample")
            assert acks == [2] * HUGE_STREAMS

            await asyncio.sleep(1.0)
            idle = rss_bytes(pid)
            read, peak = await _with_peak_rss(pid, asyncio.gather(*map(replay, range(HUGE_READERS))))
            _check_growth(peak - idle, f"{HUGE_READERS} readers of a 60 MB sample")
            assert read == [[HUGE_SAMPLE_BYTES]] * HUGE_READERS

            ranges = trial_samples_pb2_grpc.TrialSamplesSPStub(channel)

            async def read_range(reader: int) -> list[int]:
                request = trial_samples_pb2.RetrieveSampleRangeRequest(
                    trial_id=f"huge{reader % HUGE_STREAMS}"
                )
                reply = await ranges.RetrieveSampleRange(request)
                return [max(map(len, sample.payloads)) for sample in reply.samples]

            await asyncio.sleep(1.0)
            idle = rss_bytes(pid)
            read, peak = await _with_peak_rss(pid, asyncio.gather(*map(read_range, range(HUGE_READERS))))
            _check_growth(peak - idle, f"{HUGE_READERS} range readers of a 60 MB sample")
            assert read == [[HUGE_SAMPLE_BYTES]] * HUGE_READERS


def _check_growth(growth: int, load: str) -> None:
    print(f"datastore: RSS grew {growth / MiB:.0f} MiB with {load}")
    assert growth < 2 * BUDGET_BYTES + UNBUDGETED_BYTES, f"RSS grew {growth / MiB:.0f} MiB with {load}"


async def _with_peak_rss(pid: int, work: Awaitable[R]) -> tuple[R, int]:
    """What `work` gives, and the process's peak RSS meanwhile (sampled every 20 ms)."""
    task = asyncio.ensure_future(work)
    peak = 0
    while not task.done():
        peak = max(peak, rss_bytes(pid))
        await asyncio.wait([task], timeout=0.02)
    return task.result(), peak
