"""Issue 29's robustness test, in the spirit of etcd's functional tester and Jepsen: the three
services run on one PostgreSQL and one S3, each reached through a fault proxy, under a workload of
their real clients (trials through the datalog followed live on another replica, model versions
uploaded, downloaded and followed, registrations inquired and deregistered, health checks), while a
schedule drawn from a seed cuts, blackholes and slows both links and loses commit answers.

Afterwards, with every link restored, what was acknowledged must be there exactly once: every
sample of every trial, in order, on both replicas, as its live reader got it; every version, whole,
its data once; every registration, once, deregistered ones gone; and every service SERVING again
soon after the last fault.

The seeds are fixed, and printed: `pytest tests/shared/test_seeded_fault_schedule.py
--fault-schedule-seed N` replays the faults of a run (which statement a lost answer meets depends
on the timing), and `--fault-schedule-seconds S` makes a longer run.
"""

from __future__ import annotations

import asyncio
import random
import sys
import threading
import traceback
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import grpc
import pytest
from sqlalchemy.engine import make_url

from tests.fixtures.postgres import PostgresCluster
from tests.fixtures.seaweedfs import SeaweedS3, new_bucket_name
from tests.helpers.fault_datalog import DatalogWorkload
from tests.helpers.fault_proxy import HOST, FaultProxy
from tests.helpers.fault_schedule import POSTGRESQL, S3, EventLog, FaultSchedule
from tests.helpers.fault_workload import (
    DirectoryWorkload,
    Findings,
    HealthWatch,
    RegistryWorkload,
    status_of,
)
from tests.helpers.running import (
    RunningDatastore,
    RunningDirectory,
    RunningRegistry,
    make_datastore_factory,
    make_directory_factory,
    make_registry_factory,
)

DEFAULT_SEEDS = (2901, 2902)
DEFAULT_SECONDS = 22.0
# The datastore refuses an outage bound over two thirds of its lease; every fault is far shorter.
OUTAGE_FLAGS = ("--outage_bound", "20")
DATASTORE_FLAGS = (*OUTAGE_FLAGS, "--ingestion_lease", "30")
# The registry keeps small versions in memory: downloads meet the cache and S3 both.
REGISTRY_CACHE_BYTES = 4 * 1024 * 1024
# The workload runs alone before the first fault and after the last.
WARM_UP_S = 2.0
CALM_S = 2.0
# What the workload may take to finish what is under way once told to stop (a trial is 6 s at most;
# a write retried after its deadline, 60 s at most).
DRAIN_S = 70.0
# The issue asks for readiness within a second of the last fault; measured, and held to a bound
# generous enough for a shared two-core machine running the whole suite.
SERVING_BOUND_S = 5.0


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "fault_seed" not in metafunc.fixturenames:
        return
    seed = metafunc.config.getoption("--fault-schedule-seed")
    seconds = metafunc.config.getoption("--fault-schedule-seconds") or DEFAULT_SECONDS
    seeds = DEFAULT_SEEDS if seed is None else (seed,)
    timeout = pytest.mark.timeout(int(seconds + 240))  # start-up, drain and checks at most
    metafunc.parametrize("fault_seed", [pytest.param(s, id=f"seed{s}", marks=timeout) for s in seeds])


@pytest.fixture
def fault_seconds(request: pytest.FixtureRequest) -> float:
    return float(request.config.getoption("--fault-schedule-seconds") or DEFAULT_SECONDS)


@pytest.fixture
def databases(postgres_cluster: PostgresCluster) -> Iterator[dict[str, str]]:
    """A fresh database for each service, dropped after the test."""
    urls = {name: postgres_cluster.create_database() for name in ("datastore", "registry", "directory")}
    yield urls
    for url in urls.values():
        database = make_url(url).database
        assert database is not None
        postgres_cluster.drop_database(database)


@dataclass
class Services:
    writer: RunningDatastore  # the datastore replica the trials are sent to
    other: RunningDatastore  # the one their live readers follow them on
    registry: RunningRegistry
    directory: RunningDirectory


@asynccontextmanager
async def services_behind(
    postgresql: FaultProxy, s3: FaultProxy, databases: dict[str, str], seaweed_s3: SeaweedS3
) -> AsyncIterator[Services]:
    """The services, in this process, reaching PostgreSQL and S3 through the proxies."""
    registry_storage = (
        "--database_url", postgresql.url_for(databases["registry"]),
        "--s3_endpoint", f"{HOST}:{s3.port}", "--s3_bucket", new_bucket_name(),
        "--s3_access_key", seaweed_s3.access_key, "--s3_secret_key", seaweed_s3.secret_key,
        "--s3_secure", "false", "--data_cache_bytes", str(REGISTRY_CACHE_BYTES),
    )  # fmt: skip
    datastore = make_datastore_factory(postgresql.url_for(databases["datastore"]))
    async with (
        datastore(*DATASTORE_FLAGS) as writer,
        datastore(*DATASTORE_FLAGS) as other,
        make_registry_factory(*registry_storage)(*OUTAGE_FLAGS) as registry,
        make_directory_factory(postgresql.url_for(databases["directory"]))(*OUTAGE_FLAGS) as directory,
    ):
        try:
            yield Services(writer, other, registry, directory)
        finally:
            # What still waits on a connection whose bytes were swallowed fails now, rather than
            # holding the services' stop (an S3 read waits out its 300 s timeout).
            postgresql.cut()
            s3.cut()


async def test_acknowledged_work_survives_a_seeded_fault_schedule(
    fault_seed: int,
    fault_seconds: float,
    databases: dict[str, str],
    postgres_cluster: PostgresCluster,
    seaweed_s3: SeaweedS3,
    request: pytest.FixtureRequest,
) -> None:
    replay = f"pytest {request.path.relative_to(request.config.rootpath)} --fault-schedule-seed {fault_seed}"
    print(f"fault schedule seed {fault_seed}, {fault_seconds:g} s of faults (replay: {replay})")
    log = EventLog()
    findings = Findings(log)
    rng = random.Random(fault_seed)
    assert postgres_cluster.port is not None
    s3_port = int(seaweed_s3.endpoint.rpartition(":")[2])
    async with (
        FaultProxy(postgres_cluster.port) as postgresql,
        FaultProxy(s3_port, postgres=False) as s3,
        services_behind(postgresql, s3, databases, seaweed_s3) as services,
    ):
        prefix = f"s{fault_seed}"
        trials = DatalogWorkload(
            services.writer, services.other, random.Random(rng.random()), findings, prefix
        )
        versions = RegistryWorkload(
            services.registry, random.Random(rng.random()), findings, f"model-{prefix}"
        )
        registrations = DirectoryWorkload(services.directory, random.Random(rng.random()), findings, prefix)
        watch = HealthWatch(
            {
                "datastore (writer)": services.writer.channel,
                "datastore (other)": services.other.channel,
                "model registry": services.registry.channel,
                "directory": services.directory.channel,
            },
            findings,
        )
        await versions.start()
        schedule = FaultSchedule(fault_seed, fault_seconds, {POSTGRESQL: postgresql, S3: s3}, log)
        for fault in schedule.faults:
            print(f"  planned at {fault.at_s:6.2f} s: {fault}")

        stop = asyncio.Event()
        running = [asyncio.create_task(work.run(stop)) for work in (trials, versions, registrations, watch)]
        await asyncio.sleep(WARM_UP_S)
        await schedule.run()
        back = await watch.serving_after(schedule.ended, SERVING_BOUND_S * 4)
        log(f"SERVING again after the last fault: {format_seconds(back)}")
        await asyncio.sleep(CALM_S)
        log("the workload stops")
        stop.set()
        done, pending = await asyncio.wait(running, timeout=DRAIN_S)
        for task in pending:
            task.cancel()
        if pending:
            print(database_thread_stacks())
            findings.violation(
                f"the workload did not finish within {DRAIN_S:g} s of being told to stop (trials not "
                f"done: {[trial.trial_id for trial in trials.trials if not trial.done]})"
            )
        for task in done:
            task.result()  # a workload that crashed: its traceback

        log("checks")
        for workload in (trials, versions, registrations):
            try:
                await workload.check()
            except grpc.aio.AioRpcError as error:  # a service that does not answer: said with the rest
                findings.violation(f"{type(workload).__name__}.check: {status_of(error)}")
        log("checks done")
        for name in watch.channels:
            if name not in back or back[name] > SERVING_BOUND_S:
                findings.violation(
                    f"{name} was not SERVING within {SERVING_BOUND_S:g} s of the last fault "
                    f"({format_seconds(back)})"
                )
        deregistered = sum(entry.deregistered for entry in registrations.entries)
        print(
            f"seed {fault_seed}: faults {dict(sorted(schedule.counts.items()))}, lost answers "
            f"{dict(schedule.lost)}; {len(trials.trials)} trials, {trials.samples} samples "
            f"acknowledged; {len(versions.acknowledged)} of {len(versions.uploads)} versions "
            f"acknowledged, {versions.downloads} downloads ({versions.failed_downloads} failed); "
            f"{len(registrations.acknowledged)} of {len(registrations.entries)} registrations "
            f"acknowledged, {deregistered} deregistered, {registrations.inquiries} inquiries; "
            f"{watch.changes} health changes; SERVING again {format_seconds(back)}"
        )
        assert not findings.violations, f"seed {fault_seed} ({replay}):\n" + "\n".join(findings.violations)


def format_seconds(back: dict[str, float]) -> str:
    return ", ".join(f"{name} {seconds:.2f} s" for name, seconds in back.items()) or "none"


def database_thread_stacks() -> str:
    """Where the threads that wait on PostgreSQL or S3 are: what a hang is read from."""
    frames = sys._current_frames()
    stacks = [
        f"thread {thread.name}:\n" + "".join(traceback.format_stack(frames[thread.ident]))
        for thread in threading.enumerate()
        if thread.ident in frames and thread.name.startswith(("postgresql-", "blobstore-"))
    ]
    return "\n".join(stacks)
