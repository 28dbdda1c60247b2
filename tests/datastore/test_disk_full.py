"""The datastore on a full disk: RESOURCE_EXHAUSTED, not INTERNAL; reads still served; once a
little space is freed, what filled the disk can be deleted; and ingestion works again once SQLite
has room to move its log into the database, without a restart."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from shared.api import common_pb2
from shared.api import trial_datastore_pb2 as ds
from tests.helpers.datastore import datalog_sample, list_trials, read_samples, run_datalog
from tests.helpers.running import make_datastore_factory

MiB = 1024 * 1024
# Half of the 16 MiB volume, in files of 1 MiB: the trial that fills the rest stores megabytes.
BALLAST_FILES = 8
# Enough to delete what filled the disk: with SQLite overwriting freed pages (Debian's build does,
# unless told not to), deleting wrote the trial's samples again, and took 3 to 5 MiB; it takes 1 at
# most now. Ingesting needs the log (WAL) moved into the database, which must grow to hold it first.
FREED_TO_DELETE = 2


def big_sample(tick: int, state: int = common_pb2.RUNNING) -> object:
    sample = datalog_sample(tick, state)
    sample.observations.observations[0] = bytes(200 * 1024)
    return sample


async def test_a_full_disk_is_resource_exhausted_and_recovers(small_volume: Path) -> None:
    ballast = [small_volume / f"ballast-{index}" for index in range(BALLAST_FILES)]
    for piece in ballast:
        piece.write_bytes(bytes(MiB))
    url = f"sqlite+aiosqlite:///{small_volume / 'datastore.db'}"
    async with make_datastore_factory(url)() as datastore:
        assert await run_datalog(datastore, "small", [datalog_sample(0, common_pb2.ENDED)]) == 2
        with pytest.raises(grpc.aio.AioRpcError) as full:
            await run_datalog(datastore, "huge", [big_sample(tick) for tick in range(200)])
        assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, full.value.details()
        # Reads are still served.
        assert [info.trial_id for info in (await list_trials(datastore)).trial_infos] == ["small", "huge"]
        assert len(await read_samples(datastore, ["small"])) == 1

        for piece in ballast[:FREED_TO_DELETE]:  # the operator frees a little space, deletes what filled it
            piece.unlink()
        await datastore.stub.DeleteTrials(ds.DeleteTrialsRequest(trial_ids=["huge"]))
        for piece in ballast[FREED_TO_DELETE:]:  # then frees the rest
            piece.unlink()
        assert await run_datalog(datastore, "after", [datalog_sample(0, common_pb2.ENDED)]) == 2
        assert [sample.tick_id for sample in await read_samples(datastore, ["after"])] == [0]
