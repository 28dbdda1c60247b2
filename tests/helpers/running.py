"""Services run in this process on 127.0.0.1, reached over real gRPC connections: what the
suite's shared fixtures (conftest.py) yield (`RunningDirectory`, `RunningDatastore`,
`RunningRegistry`), the factories that start them, and `serving` / `run_in_process` for tests
that start their own."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
from sqlalchemy.engine import make_url

from services.datastore.service import DatastoreService
from services.directory.service import DirectoryService
from services.model_registry.service import ModelRegistryService
from shared.api import datalog_pb2_grpc, directory_pb2_grpc, model_registry_pb2_grpc, trial_datastore_pb2_grpc
from shared.config import parse_options
from shared.server import Service, serve


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
    values = parse_options(
        service_class.settings_type.options, argv, prog="test", description="test", environ={}
    )
    async with (
        run_in_process(service_class.from_values(values)) as service,
        grpc.aio.insecure_channel(f"127.0.0.1:{service.port}") as channel,
    ):
        yield service, channel


DirectoryFactory = Callable[..., AbstractAsyncContextManager[RunningDirectory]]


def make_directory_factory(database_url: str) -> DirectoryFactory:
    """`async with factory("--load_balancing") as d:` runs a directory in-process on
    `database_url` with the given extra flags; several may run at once (replicas)."""

    # Its key file next to an SQLite database (on PostgreSQL the key stays in the database).
    url = make_url(database_url)
    data_dir = str(Path(url.database).parent) if url.get_backend_name() == "sqlite" and url.database else None

    @asynccontextmanager
    async def start(*flags: str) -> AsyncIterator[RunningDirectory]:
        defaults = ["--data_dir", data_dir] if data_dir and "--data_dir" not in flags else []
        running = serving(DirectoryService, "--database_url", database_url, *defaults, *flags)
        async with running as (service, channel):
            yield RunningDirectory(service, channel, directory_pb2_grpc.DirectorySPStub(channel))

    return start


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


@dataclass
class RunningRegistry:
    service: ModelRegistryService
    channel: grpc.aio.Channel
    stub: model_registry_pb2_grpc.ModelRegistrySPStub


RegistryFactory = Callable[..., AbstractAsyncContextManager[RunningRegistry]]


def make_registry_factory(*storage: str) -> RegistryFactory:
    """`async with factory(*flags) as r:` runs a Model Registry in-process on the database and
    blob store that the `storage` flags name; several may run at once (replicas)."""

    @asynccontextmanager
    async def start(*flags: str) -> AsyncIterator[RunningRegistry]:
        async with serving(ModelRegistryService, *storage, *flags) as (service, channel):
            yield RunningRegistry(service, channel, model_registry_pb2_grpc.ModelRegistrySPStub(channel))

    return start
