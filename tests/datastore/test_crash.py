"""A kill -9 during ingestion loses no acknowledged sample, on SQLite (a file) and on PostgreSQL.

The datastore runs as users run it (`python -m services.datastore`). Several orchestrator-like
clients each stream one trial through DatalogSP: the parameters, then samples with distinct tick
ids, as fast as the acknowledgements allow (at most IN_FLIGHT unacknowledged), counting the acks
(the first one is for the parameters). Once every trial has MIN_ACKED samples acknowledged, the
server gets SIGKILL, with samples in flight. Restarted on the same database:
* each trial holds every acknowledged sample exactly once, in order, with no gap: its stored
  samples are ticks 0, 1, 2... (some unacknowledged ones may be there too, but only as the same
  continuation), as its `samples_count` says, and each is the sample that was sent;
* an interrupted trial takes a new ingestion stream with the same trial id (as an orchestrator
  retrying would): a reader started before it gets the old samples then the new ones, and ends
  when that stream ends, whether with an ENDED sample or by closing without one.

On SQLite, the restarted process knows at once that the killed one is gone (its lock file is free:
services/datastore/lease_holders.py) and closes the trials it was ingesting: their readers end with
the stored samples, and a new stream reopens them. On PostgreSQL, RetrieveSamples of an interrupted
trial ends only once its ingestion lease expires (45 s: see test_outages.py), so stored samples are
read up to the trial's `samples_count`, then the read is cancelled, after checking that nothing
follows; a reader started before a new stream gets the old samples then the new ones.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from shared.api import common_pb2, datalog_pb2, datalog_pb2_grpc, trial_datastore_pb2_grpc
from shared.api import trial_datastore_pb2 as ds
from tests.helpers.datastore import datalog_sample, trial_params
from tests.helpers.services import RunningService, start_service

TRIALS = 4
# Unacknowledged samples a client lets run ahead (the orchestrator does not wait at all).
IN_FLIGHT = 64
# Every trial has this many samples acknowledged before the kill.
MIN_ACKED = 300
# Samples of the new ingestion stream of an interrupted trial.
RESUMED = 25
WAIT_S = 30.0
# After the samples a trial counts, nothing more may come: a read waits this long for it.
NOTHING_MORE_S = 0.5


async def start_datastore(database_url: str, tmp_path: Path) -> RunningService:
    """A datastore process on `database_url` (the `database_url` fixture: an SQLite file or a
    fresh PostgreSQL database, which both outlive the process), at the default log level, as
    users run it; stop it with `with`."""
    args = ["--database_url", database_url, "--log_level", "info"]
    return await asyncio.to_thread(start_service, "services.datastore", args, log_dir=tmp_path)


@dataclass
class Clients:
    datastore: trial_datastore_pb2_grpc.TrialDatastoreSPStub
    datalog: datalog_pb2_grpc.DatalogSPStub


@asynccontextmanager
async def connect(service: RunningService) -> AsyncIterator[Clients]:
    async with grpc.aio.insecure_channel(service.address) as channel:
        yield Clients(
            trial_datastore_pb2_grpc.TrialDatastoreSPStub(channel), datalog_pb2_grpc.DatalogSPStub(channel)
        )


def params_input() -> datalog_pb2.RunTrialDatalogInput:
    return datalog_pb2.RunTrialDatalogInput(trial_params=trial_params(crash="yes"))


def sample_input(tick: int, state: int = common_pb2.RUNNING) -> datalog_pb2.RunTrialDatalogInput:
    return datalog_pb2.RunTrialDatalogInput(sample=datalog_sample(tick, state))


# ---- ingestion until the kill ----


@dataclass
class Stream:
    """One trial's ingestion, as the client saw it."""

    trial_id: str
    written: int = 0  # samples written (the parameters not counted)
    acks: int = 0  # acknowledgements received, the first one for the parameters
    error: grpc.StatusCode | None = None

    @property
    def acked(self) -> int:
        """Samples acknowledged."""
        return max(self.acks - 1, 0)


async def ingest_until_killed(clients: Clients, stream: Stream, all_acked: asyncio.Event) -> None:
    """Stream samples 0, 1, 2... with at most IN_FLIGHT unacknowledged, until the call breaks."""
    call = clients.datalog.RunTrialDatalog(metadata=(("trial-id", stream.trial_id), ("user-id", "crash")))
    window = asyncio.Semaphore(IN_FLIGHT)

    async def write() -> None:
        await call.write(params_input())
        while True:
            await window.acquire()
            stream.written += 1  # before: the server may get it even if the write does not return
            await call.write(sample_input(stream.written - 1))

    async def read() -> None:
        async for _ in call:
            stream.acks += 1
            if stream.acks > 1:
                window.release()
            if stream.acked >= MIN_ACKED:
                all_acked.set()

    writer = asyncio.create_task(write())
    try:
        await read()
    except grpc.aio.AioRpcError as error:
        stream.error = error.code()
    finally:
        writer.cancel()
        await asyncio.gather(writer, return_exceptions=True)


# ---- reading back after the restart ----


async def trial_info(clients: Clients, trial_id: str) -> ds.StoredTrialInfo:
    reply = await clients.datastore.RetrieveTrials(
        ds.RetrieveTrialsRequest(trial_ids=[trial_id]), timeout=WAIT_S
    )
    [info] = reply.trial_infos
    assert isinstance(info, ds.StoredTrialInfo)
    return info


async def stored_samples(
    clients: Clients, trial_id: str, count: int, closed: bool
) -> list[ds.StoredTrialSample]:
    """The trial's first `count` samples; and then nothing more comes: the read ends if the trial
    was `closed`, else it does not end (its stream never did), and is cancelled."""
    call = clients.datastore.RetrieveSamples(ds.RetrieveSamplesRequest(trial_ids=[trial_id]))
    samples: list[ds.StoredTrialSample] = []
    try:
        for _ in range(count):
            reply = await asyncio.wait_for(call.read(), WAIT_S)
            assert reply is not grpc.aio.EOF, f"{trial_id}: the read ended after {len(samples)} of {count}"
            samples.append(reply.trial_sample)
        if closed:
            assert await asyncio.wait_for(call.read(), WAIT_S) is grpc.aio.EOF, f"{trial_id}: more samples"
            return samples
        with pytest.raises(asyncio.TimeoutError):
            extra = await asyncio.wait_for(call.read(), NOTHING_MORE_S)
            pytest.fail(f"{trial_id}: a sample beyond samples_count {count}: {extra}")
    finally:
        call.cancel()
    return samples


def check_stored(stream: Stream, info: ds.StoredTrialInfo, samples: list[ds.StoredTrialSample]) -> None:
    """Acknowledged samples all there, once, in order; anything else only as their continuation."""
    count = info.samples_count
    assert stream.acked <= count <= stream.written, (
        f"{stream.trial_id}: {count} stored, {stream.acked} acknowledged, {stream.written} written"
    )
    assert [sample.tick_id for sample in samples] == list(range(count)), (
        f"{stream.trial_id}: gap or duplicate"
    )
    for sample in samples:
        expected = datalog_sample(sample.tick_id)
        assert sample.trial_id == stream.trial_id and sample.user_id == "crash"
        assert sample.state == common_pb2.RUNNING and sample.timestamp == expected.info.timestamp
        assert sample.payloads[sample.actor_samples[0].observation] == expected.observations.observations[0]
        assert sample.payloads[sample.actor_samples[2].action] == expected.actions[2].content
    assert info.last_state == (common_pb2.RUNNING if count else common_pb2.UNKNOWN)
    assert info.user_id == "crash" and info.params == trial_params(crash="yes")


# ---- resuming an interrupted trial ----


async def resume(clients: Clients, trial_id: str, first_tick: int, end: bool) -> int:
    """A new stream for the trial: RESUMED samples from `first_tick`, the last ENDED if `end`, then
    half-close. Returns the acks."""
    ticks = range(first_tick, first_tick + RESUMED)
    states = [common_pb2.ENDED if end and tick == ticks[-1] else common_pb2.RUNNING for tick in ticks]
    messages = [
        params_input(),
        *(sample_input(tick, state) for tick, state in zip(ticks, states, strict=True)),
    ]
    call = clients.datalog.RunTrialDatalog(
        iter(messages), metadata=(("trial-id", trial_id), ("user-id", "crash")), timeout=WAIT_S
    )
    return len([ack async for ack in call])


async def read_all(clients: Clients, trial_id: str) -> list[int]:
    """Tick ids of a reader of the trial, which must end."""
    call = clients.datastore.RetrieveSamples(ds.RetrieveSamplesRequest(trial_ids=[trial_id]), timeout=WAIT_S)
    return [reply.trial_sample.tick_id async for reply in call]


# ---- the test ----


async def test_kill_9_during_ingestion_loses_no_acknowledged_sample(
    database_url: str, tmp_path: Path
) -> None:
    streams = [Stream(f"crash-trial-{index}") for index in range(TRIALS)]

    with await start_datastore(database_url, tmp_path) as datastore:
        async with connect(datastore) as clients:
            acked = [asyncio.Event() for _ in streams]
            ingesting = [
                asyncio.create_task(ingest_until_killed(clients, stream, event))
                for stream, event in zip(streams, acked, strict=True)
            ]
            await asyncio.wait_for(asyncio.gather(*(event.wait() for event in acked)), WAIT_S)
            assert not any(task.done() for task in ingesting), "an ingestion stream ended before the kill"
            assert await asyncio.to_thread(datastore.terminate, signal.SIGKILL) == -signal.SIGKILL
            await asyncio.wait_for(asyncio.gather(*ingesting), WAIT_S)
    for stream in streams:
        assert stream.error is not None, f"{stream.trial_id}: the stream did not break"
    in_flight = sum(stream.written - stream.acked for stream in streams)
    assert in_flight > 0, "nothing was in flight at the kill: the test did not test it"

    # One process owns an SQLite file's trials: the restarted one closes the killed one's at once.
    closed_at_restart = database_url.startswith("sqlite")
    with await start_datastore(database_url, tmp_path) as datastore:
        async with connect(datastore) as clients:
            infos = [await trial_info(clients, stream.trial_id) for stream in streams]
            for stream, info in zip(streams, infos, strict=True):
                stored = await stored_samples(clients, stream.trial_id, info.samples_count, closed_at_restart)
                check_stored(stream, info, stored)

            # Interrupted trials take a new stream; their readers, started before it, end with it
            # (or, closed, at once): on the ENDED sample for one trial, at the close of a stream
            # without one for another.
            for stream, info, end in [(streams[0], infos[0], True), (streams[1], infos[1], False)]:
                reader = asyncio.create_task(read_all(clients, stream.trial_id))
                try:
                    if closed_at_restart:  # its reader ends at once, and a new stream reopens it
                        assert await asyncio.wait_for(reader, WAIT_S) == list(range(info.samples_count))
                    else:
                        await asyncio.sleep(0.2)
                        assert not reader.done(), f"{stream.trial_id}: a reader of an interrupted trial ended"
                    acks = await resume(clients, stream.trial_id, info.samples_count, end)
                    assert acks == 1 + RESUMED, f"{stream.trial_id}: {acks} acks for {1 + RESUMED} messages"
                    if closed_at_restart:
                        reader = asyncio.create_task(read_all(clients, stream.trial_id))
                    ticks = await asyncio.wait_for(reader, WAIT_S)
                finally:
                    reader.cancel()
                assert ticks == list(range(info.samples_count + RESUMED))
                resumed = await trial_info(clients, stream.trial_id)
                assert resumed.samples_count == info.samples_count + RESUMED
                assert resumed.last_state == (common_pb2.ENDED if end else common_pb2.RUNNING)
                assert await read_all(clients, stream.trial_id) == ticks  # new readers end at once
