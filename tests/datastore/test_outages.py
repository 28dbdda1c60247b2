"""The datastore through a PostgreSQL outage: ingestion keeps its samples and commits them when the
database is back, live readers carry on, readiness goes NOT_SERVING and back, and nothing
acknowledged is lost or repeated."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from shared.api import common_pb2, datalog_pb2, datalog_pb2_grpc
from shared.api import trial_datastore_pb2 as ds
from tests.fixtures.postgres import PostgresCluster, ProxiedDatabase, new_database_name
from tests.helpers.datastore import datalog_sample, read_samples, trial_params
from tests.helpers.exposed_metrics import delta, exposed
from tests.helpers.health import NOT_SERVING, SERVING, health, wait_for_health
from tests.helpers.running import RunningDatastore, make_datastore_factory
from tests.helpers.services import start_service

OUTAGE_S = 3.0
WAIT_S = 20.0


class DatalogStream:
    """One DatalogSP stream, fed sample by sample, its acknowledgements counted as they come."""

    def __init__(self, datalog: datalog_pb2_grpc.DatalogSPStub, trial_id: str) -> None:
        self.queue: asyncio.Queue[datalog_pb2.RunTrialDatalogInput | None] = asyncio.Queue()
        self.acks = 0
        self.acked = asyncio.Event()
        self.call = datalog.RunTrialDatalog(self._requests(), metadata=(("trial-id", trial_id),))
        self.reader = asyncio.create_task(self._read())

    async def _requests(self) -> AsyncIterator[datalog_pb2.RunTrialDatalogInput]:
        while (request := await self.queue.get()) is not None:
            yield request

    async def _read(self) -> None:
        async for _ in self.call:
            self.acks += 1
            self.acked.set()

    def send(self, *samples: datalog_pb2.DatalogSample, params: common_pb2.TrialParams | None = None) -> None:
        if params is not None:
            self.queue.put_nowait(datalog_pb2.RunTrialDatalogInput(trial_params=params))
        for sample in samples:
            self.queue.put_nowait(datalog_pb2.RunTrialDatalogInput(sample=sample))

    async def wait_acks(self, count: int) -> float:
        started = time.monotonic()
        while self.acks < count:
            assert not self.reader.done() or self.reader.exception() is None, self.reader.exception()
            assert time.monotonic() - started < WAIT_S, f"{self.acks} acknowledgements, {count} expected"
            self.acked.clear()
            await asyncio.wait([asyncio.create_task(self.acked.wait()), self.reader], timeout=0.5)
        return time.monotonic() - started

    async def close(self) -> None:
        self.queue.put_nowait(None)
        await asyncio.wait_for(self.reader, WAIT_S)


@pytest.fixture
async def replicas(
    faulty_postgres: PostgresCluster,
) -> AsyncIterator[tuple[RunningDatastore, RunningDatastore]]:
    url = faulty_postgres.create_database(new_database_name())
    start = make_datastore_factory(url)
    async with start("--outage_bound", "30") as first, start("--outage_bound", "30") as second:
        yield first, second


async def test_postgresql_outage_loses_nothing_and_recovers_by_itself(
    replicas: tuple[RunningDatastore, RunningDatastore], faulty_postgres: PostgresCluster
) -> None:
    writer, other = replicas
    stream = DatalogStream(writer.datalog, "t-outage")
    stream.send(*(datalog_sample(tick) for tick in range(20)), params=trial_params())
    await stream.wait_acks(21)
    live = asyncio.create_task(read_samples(other, ["t-outage"]))  # a live reader on the other replica

    before = exposed("cogment_trial_datastore_")
    faulty_postgres.pause()
    await wait_for_health(writer.channel, NOT_SERVING)
    await wait_for_health(other.channel, NOT_SERVING)
    assert await health(writer.channel, "liveness") == SERVING  # no restarts for an outage
    # Unary calls say what happened, with the status that tells the client to retry.
    with pytest.raises(grpc.aio.AioRpcError) as unavailable:
        await other.stub.RetrieveTrials(ds.RetrieveTrialsRequest(trial_ids=["t-outage"]), timeout=10)
    assert unavailable.value.code() == grpc.StatusCode.UNAVAILABLE
    stream.send(*(datalog_sample(tick) for tick in range(20, 40)))
    await asyncio.sleep(OUTAGE_S)
    assert stream.acks == 21, "acknowledged while the database was away"

    faulty_postgres.resume()
    recovered_s = await stream.wait_acks(41)
    held = delta(
        before, exposed("cogment_trial_datastore_"), "cogment_trial_datastore_outage_held_batches_total"
    )
    assert held >= 1  # the batch of the samples sent during the outage
    print(f"datastore: the held samples were committed {recovered_s:.3f} s after PostgreSQL came back")
    await wait_for_health(writer.channel, SERVING)
    await wait_for_health(other.channel, SERVING)

    stream.send(datalog_sample(40, common_pb2.ENDED))
    await stream.wait_acks(42)
    await stream.close()
    stored = await asyncio.wait_for(live, WAIT_S)
    assert [sample.tick_id for sample in stored] == list(range(41))
    again = await read_samples(writer, ["t-outage"])
    assert [sample.tick_id for sample in again] == list(range(41))

    # The sample writer is alive: a new trial is stored and acknowledged as usual.
    after = DatalogStream(writer.datalog, "t-after")
    after.send(datalog_sample(0, common_pb2.ENDED), params=trial_params())
    await after.wait_acks(2)
    await after.close()


async def test_an_outage_longer_than_the_bound_fails_the_stream_with_unavailable(
    faulty_postgres: PostgresCluster,
) -> None:
    url = faulty_postgres.create_database(new_database_name())
    async with make_datastore_factory(url)("--outage_bound", "1") as datastore:
        stream = DatalogStream(datastore.datalog, "t-long")
        stream.send(datalog_sample(0), params=trial_params())
        await stream.wait_acks(2)
        faulty_postgres.pause()
        stream.send(datalog_sample(1))
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await asyncio.wait_for(stream.reader, WAIT_S)
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "--outage_bound" in (failed.value.details() or "")
        faulty_postgres.resume()
        await wait_for_health(datastore.channel, SERVING)
        resumed = DatalogStream(datastore.datalog, "t-long")
        resumed.send(datalog_sample(1, common_pb2.ENDED), params=trial_params())
        await resumed.wait_acks(2)
        await resumed.close()
        assert [sample.tick_id for sample in await read_samples(datastore, ["t-long"])] == [0, 1]


async def test_a_killed_ingesting_replica_leaves_no_trial_running(postgres_url: str, tmp_path: Path) -> None:
    """kill -9 of the replica that ingests a trial: the other replica closes the trial when its
    lease expires, so a live reader waiting there ends with every acknowledged sample."""
    lease = ("--ingestion_lease", "1.5", "--outage_bound", "1")
    args = ["--database_url", postgres_url, "--log_level", "info", *lease]
    with await asyncio.to_thread(start_service, "services.datastore", args, log_dir=tmp_path) as doomed:
        async with (
            make_datastore_factory(postgres_url)(*lease) as survivor,
            grpc.aio.insecure_channel(doomed.address) as channel,
        ):
            stream = DatalogStream(datalog_pb2_grpc.DatalogSPStub(channel), "t-killed")
            stream.send(*(datalog_sample(tick) for tick in range(30)), params=trial_params())
            await stream.wait_acks(31)
            live = asyncio.create_task(read_samples(survivor, ["t-killed"]))
            await asyncio.sleep(0.5)
            assert not live.done(), "the reader ended while the trial was being ingested"
            before = exposed("cogment_trial_datastore_")
            doomed.process.send_signal(signal.SIGKILL)
            started = time.monotonic()
            stored = await asyncio.wait_for(live, WAIT_S)
            closures = "cogment_trial_datastore_lease_closures_total"
            assert delta(before, exposed("cogment_trial_datastore_"), closures) == 1
            closed_s = time.monotonic() - started
            print(f"datastore: the killed replica's trial was closed {closed_s:.3f} s after the kill")
            assert [sample.tick_id for sample in stored] == list(range(30))
            (info,) = (
                await survivor.stub.RetrieveTrials(ds.RetrieveTrialsRequest(trial_ids=["t-killed"]))
            ).trial_infos
            assert info.samples_count == 30
            # A new datalog stream reopens it, as after any interruption.
            resumed = DatalogStream(survivor.datalog, "t-killed")
            resumed.send(datalog_sample(30, common_pb2.ENDED), params=trial_params())
            await resumed.wait_acks(2)
            await resumed.close()
            assert [sample.tick_id for sample in await read_samples(survivor, ["t-killed"])] == list(
                range(31)
            )
            stream.reader.cancel()


async def test_samples_whose_commit_answer_was_lost_on_the_wire_are_stored_once(
    proxied_database: ProxiedDatabase,
) -> None:
    """The connection breaks once PostgreSQL committed a batch, before its answer reached the
    datastore: it rides that out like an outage, and its retry stores nothing twice."""
    async with make_datastore_factory(proxied_database.url)() as datastore:
        stream = DatalogStream(datastore.datalog, "t-lost")
        stream.send(*(datalog_sample(tick) for tick in range(10)), params=trial_params())
        await stream.wait_acks(11)
        lost = proxied_database.proxy.arm_lost_commit(b"json_to_recordset")  # the batch statement
        stream.send(*(datalog_sample(tick) for tick in range(10, 20)))
        assert await lost.wait(WAIT_S), "the batch was rolled back, not committed"
        stream.send(*(datalog_sample(tick) for tick in range(20, 30)), datalog_sample(30, common_pb2.ENDED))
        await stream.wait_acks(32)
        await stream.close()
        assert [sample.tick_id for sample in await read_samples(datastore, ["t-lost"])] == list(range(31))
        (info,) = (
            await datastore.stub.RetrieveTrials(ds.RetrieveTrialsRequest(trial_ids=["t-lost"]))
        ).trial_infos
        assert info.samples_count == 31


async def test_a_database_that_goes_silent_without_closing_anything_is_ridden_out(
    proxied_database: ProxiedDatabase,
) -> None:
    """A black hole between the datastore and PostgreSQL (connections stay open and acknowledged,
    nothing is answered), then the network heals: the statements and probes caught in it are
    interrupted, not waited on for ever; every sample is stored once and health is SERVING again."""
    async with make_datastore_factory(proxied_database.url)() as datastore:
        stream = DatalogStream(datastore.datalog, "t-silent")
        stream.send(*(datalog_sample(tick) for tick in range(5)), params=trial_params())
        await stream.wait_acks(6)
        proxied_database.proxy.blackhole()
        stream.send(*(datalog_sample(tick) for tick in range(5, 10)))
        await wait_for_health(datastore.channel, NOT_SERVING)  # its probe timed out
        proxied_database.proxy.restore()
        stream.send(*(datalog_sample(tick) for tick in range(10, 15)), datalog_sample(15, common_pb2.ENDED))
        await stream.wait_acks(17)
        await stream.close()
        await wait_for_health(datastore.channel, SERVING)
        assert [sample.tick_id for sample in await read_samples(datastore, ["t-silent"])] == list(range(16))


def test_an_outage_bound_that_a_lease_would_not_outlive_is_refused_at_start(tmp_path: Path) -> None:
    """A replica could close a trial whose stream still rides an outage out: the datastore says so,
    naming both flags and what would do, and exits 1."""
    result = subprocess.run(
        [
            sys.executable, "-m", "services.datastore", "--port", "0", "--bind_address", "127.0.0.1",
            "--data_dir", str(tmp_path), "--outage_bound", "40", "--ingestion_lease", "45",
        ],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert result.returncode == 1
    [line] = result.stderr.splitlines()
    assert "cannot start" in line
    assert "--outage_bound (40 s) must be at most two thirds of --ingestion_lease (45 s)" in line
    assert "lower --outage_bound to 30 or raise --ingestion_lease to 60" in line
