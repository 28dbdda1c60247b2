"""The datastore on a full disk: RESOURCE_EXHAUSTED, not INTERNAL; reads still served; and
ingestion works again once space is freed (and what filled it deleted), without a restart."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from shared.api import common_pb2
from shared.api import trial_datastore_pb2 as ds
from tests.helpers.datastore import datalog_sample, list_trials, read_samples, run_datalog
from tests.helpers.running import make_datastore_factory

# Most of the volume: freeing it leaves SQLite room to checkpoint its WAL and delete.
BALLAST_BYTES = 12 * 1024 * 1024


def big_sample(tick: int, state: int = common_pb2.RUNNING) -> object:
    sample = datalog_sample(tick, state)
    sample.observations.observations[0] = bytes(200 * 1024)
    return sample


async def test_a_full_disk_is_resource_exhausted_and_recovers(small_volume: Path) -> None:
    ballast = small_volume / "ballast"
    ballast.write_bytes(bytes(BALLAST_BYTES))
    url = f"sqlite+aiosqlite:///{small_volume / 'datastore.db'}"
    async with make_datastore_factory(url)() as datastore:
        assert await run_datalog(datastore, "small", [datalog_sample(0, common_pb2.ENDED)]) == 2
        with pytest.raises(grpc.aio.AioRpcError) as full:
            await run_datalog(datastore, "huge", [big_sample(tick) for tick in range(200)])
        assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, full.value.details()
        # Reads are still served.
        assert [info.trial_id for info in (await list_trials(datastore)).trial_infos] == ["small", "huge"]
        assert len(await read_samples(datastore, ["small"])) == 1

        ballast.unlink()  # the operator frees some space, then deletes what filled the disk
        await datastore.stub.DeleteTrials(ds.DeleteTrialsRequest(trial_ids=["huge"]))
        assert await run_datalog(datastore, "after", [datalog_sample(0, common_pb2.ENDED)]) == 2
        assert [sample.tick_id for sample in await read_samples(datastore, ["after"])] == [0]
