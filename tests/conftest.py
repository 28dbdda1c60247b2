"""Fixtures shared by the test suite: databases (SQLite file, throwaway PostgreSQL cluster), real
S3 (SeaweedFS), and in-process services reached over real gRPC connections."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest

from services.datastore.service import DatastoreService
from services.directory.service import DirectoryService
from shared.api import datalog_pb2_grpc, directory_pb2_grpc, trial_datastore_pb2_grpc
from shared.config import parse_options
from shared.server import Service, serve
from tests.interop.sdk_env import SdkEnvError, ensure_sdk_python

pytest_plugins = ["tests.fixtures.postgres", "tests.fixtures.seaweedfs"]


@pytest.fixture(scope="session")
def sdk_python() -> Path:
    """Interpreter of the venv holding the official Cogment SDK 2.10.1 (built on first use)."""
    try:
        return ensure_sdk_python()
    except SdkEnvError as error:
        pytest.fail(f"cannot set up the Cogment SDK environment: {error}")


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Each test using this runs twice: on an SQLite file and on a fresh PostgreSQL database."""
    if request.param == "sqlite":
        return f"sqlite+aiosqlite:///{tmp_path / 'test.db'}"
    return str(request.getfixturevalue("postgres_url"))


@dataclass
class RunningDirectory:
    service: DirectoryService
    channel: grpc.aio.Channel
    stub: directory_pb2_grpc.DirectorySPStub

    @property
    def port(self) -> int:
        assert self.service.port is not None
        return self.service.port

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


S = TypeVar("S", bound=Service[Any])


@asynccontextmanager
async def run_in_process(service: S) -> AsyncIterator[S]:
    """Serve `service` in this event loop until the block ends."""
    stop = asyncio.Event()
    task = asyncio.create_task(serve(service, stop, handle_signals=False))
    while service.port is None:
        if task.done():
            task.result()  # raises the start-up error
            raise RuntimeError("service stopped before serving")
        await asyncio.sleep(0.01)
    try:
        yield service
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


@asynccontextmanager
async def serving(service_class: type[S], *flags: str) -> AsyncIterator[tuple[S, grpc.aio.Channel]]:
    """Run a service in-process on 127.0.0.1 (a free port) with `flags`, and a channel to it."""
    argv = ["--port", "0", "--bind_address", "127.0.0.1", *flags]
    values = parse_options(service_class.options, argv, prog="test", description="test", environ={})
    async with (
        run_in_process(service_class.from_values(values)) as service,
        grpc.aio.insecure_channel(f"127.0.0.1:{service.port}") as channel,
    ):
        yield service, channel


DirectoryFactory = Callable[..., AbstractAsyncContextManager[RunningDirectory]]


def make_directory_factory(database_url: str) -> DirectoryFactory:
    """`async with factory("--load_balancing") as d:` runs a directory in-process on
    `database_url` with the given extra flags; several may run at once (replicas)."""

    @asynccontextmanager
    async def start(*flags: str) -> AsyncIterator[RunningDirectory]:
        running = serving(DirectoryService, "--database_url", database_url, *flags)
        async with running as (service, channel):
            yield RunningDirectory(service, channel, directory_pb2_grpc.DirectorySPStub(channel))

    return start


@pytest.fixture
def directory_factory(database_url: str) -> DirectoryFactory:
    """Directories on `database_url`: tests using it run on SQLite and on PostgreSQL."""
    return make_directory_factory(database_url)


@pytest.fixture
async def directory(directory_factory: DirectoryFactory) -> AsyncIterator[RunningDirectory]:
    """A directory with default settings but a fast health-check interval."""
    async with directory_factory("--health_check_interval", "0.2") as running:
        yield running


@dataclass
class RunningDatastore:
    service: DatastoreService
    channel: grpc.aio.Channel
    stub: trial_datastore_pb2_grpc.TrialDatastoreSPStub
    datalog: datalog_pb2_grpc.DatalogSPStub
    log_exporter: datalog_pb2_grpc.LogExporterSPStub


DatastoreFactory = Callable[..., AbstractAsyncContextManager[RunningDatastore]]


def make_datastore_factory(database_url: str) -> DatastoreFactory:
    """`async with factory(*flags) as d:` runs a Trial Datastore in-process on `database_url`;
    several may run at once (replicas)."""

    @asynccontextmanager
    async def start(*flags: str) -> AsyncIterator[RunningDatastore]:
        running = serving(DatastoreService, "--database_url", database_url, *flags)
        async with running as (service, channel):
            yield RunningDatastore(
                service,
                channel,
                trial_datastore_pb2_grpc.TrialDatastoreSPStub(channel),
                datalog_pb2_grpc.DatalogSPStub(channel),
                datalog_pb2_grpc.LogExporterSPStub(channel),
            )

    return start


@pytest.fixture
def datastore_factory(database_url: str) -> DatastoreFactory:
    """Datastores on `database_url`: tests using it run on SQLite and on PostgreSQL."""
    return make_datastore_factory(database_url)


@pytest.fixture
async def datastore(datastore_factory: DatastoreFactory) -> AsyncIterator[RunningDatastore]:
    async with datastore_factory() as running:
        yield running
