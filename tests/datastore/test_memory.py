"""Memory bounded by settings, not by what clients do: a replaying reader that stops reading holds
about one read batch (`--read_batch_bytes`), measured on a real server process's RSS."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc

from shared.api import common_pb2, datalog_pb2_grpc, trial_datastore_pb2_grpc
from shared.api import trial_datastore_pb2 as ds
from tests.helpers.datastore import datalog_inputs, datalog_sample, trial_params
from tests.helpers.services import rss_bytes, start_service

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
