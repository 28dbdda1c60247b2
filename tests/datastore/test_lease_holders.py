"""Lease holders known to be gone where the database has one host (SQLite): a process's lock file,
free once the process ended however it ended, and never taken for gone while it lives."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from pathlib import Path

from services.datastore.lease_holders import HolderLocks
from shared.api import common_pb2
from tests.datastore.test_outages import DatalogStream
from tests.helpers.datastore import datalog_sample, read_samples, trial_params
from tests.helpers.running import make_datastore_factory


def test_a_holder_is_gone_once_its_process_ended_however_it_ended(tmp_path: Path) -> None:
    alive, sweeper = HolderLocks(tmp_path), HolderLocks(tmp_path)
    alive.hold("alive")
    sweeper.hold("sweeper")
    killed = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, time
            from pathlib import Path
            from services.datastore.lease_holders import HolderLocks
            HolderLocks(Path({str(tmp_path)!r})).hold("killed")
            print("held", flush=True)
            time.sleep(60)
        """)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert killed.stdout is not None and killed.stdout.readline() == "held\n"
        # Live holders (this process's own among them) are not gone; an unknown one is.
        assert sweeper.gone(["alive", "killed", "sweeper", "never"]) == ["never"]
        killed.kill()
        killed.wait()
        assert sweeper.gone(["alive", "killed"]) == ["killed"]
        assert not (tmp_path / "killed.lock").exists()  # found gone once
        alive.release()
        assert sweeper.gone(["alive"]) == ["alive"]
    finally:
        killed.kill()
        killed.wait()
        sweeper.release()


async def test_a_replica_on_the_same_file_leaves_a_live_streams_trial_open(tmp_path: Path) -> None:
    """Two datastores on one SQLite file: the one that does not ingest sweeps (every third of its
    short lease) and closes nothing, since the ingesting one lives; the trial ends with its stream."""
    start = make_datastore_factory(f"sqlite+aiosqlite:///{tmp_path / 'datastore.db'}")
    lease = ("--ingestion_lease", "0.6", "--outage_bound", "0.4")
    async with start(*lease) as sweeper, start(*lease) as ingesting:
        stream = DatalogStream(ingesting.datalog, "t-live")
        stream.send(*(datalog_sample(tick) for tick in range(3)), params=trial_params())
        await stream.wait_acks(4)
        reader = asyncio.create_task(read_samples(sweeper, ["t-live"]))
        await asyncio.sleep(2)  # several sweeps of both
        assert not reader.done(), "the trial of a live stream was closed"
        stream.send(datalog_sample(3, common_pb2.ENDED))
        await stream.wait_acks(5)
        await stream.close()
        assert [sample.tick_id for sample in await asyncio.wait_for(reader, 10)] == [0, 1, 2, 3]
