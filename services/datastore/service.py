"""The Trial Datastore service: its options and its life cycle on the shared server bootstrap."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import grpc

from services.datastore import metrics
from services.datastore.batcher import (
    DEFAULT_INTERVAL_S,
    DEFAULT_MAX_IN_FLIGHT_BYTES,
    DEFAULT_MAX_SAMPLES,
    DEFAULT_MAX_STREAM_BYTES,
    SampleBatcher,
)
from services.datastore.core import DEFAULT_READ_BATCH_BYTES, DEFAULT_REPLAY_BYTES, TrialDatastore
from services.datastore.lease_holders import HolderLocks
from services.datastore.leases import DEFAULT_LEASE_S, IngestionLeases, check_outage_bound
from services.datastore.servicer import add_servicers
from services.datastore.store import DatastoreStore
from shared.api import directory_pb2
from shared.config import Option, positive_float, positive_int, up_to_a_second
from shared.db import Database
from shared.logging import get_logger
from shared.notify import ChangeFeed
from shared.registration import RegistrationSettings, registration_options
from shared.runtime import ServiceRuntime
from shared.server import Service
from shared.settings import ServerSettings, server_options

DEFAULT_PORT = 9003
ENV_PREFIX = "COGMENT_TRIAL_DATASTORE"
CHANGE_CHANNEL = "cogment_datastore"

OPTIONS: list[Option] = [
    *server_options(ENV_PREFIX, DEFAULT_PORT),
    Option("batch_max_samples", "ingested samples written per transaction at most (samples arriving "
           "while one commits share the next)", DEFAULT_MAX_SAMPLES, f"{ENV_PREFIX}_BATCH_MAX_SAMPLES",
           positive_int),
    Option("batch_interval", "seconds at least between the starts of two ingestion transactions, "
           "unless a full batch waits: a steady flow of samples shares fewer transactions, each "
           "acknowledged sample waiting this long more at most; 0 starts each as soon as the "
           "previous one ends", DEFAULT_INTERVAL_S, f"{ENV_PREFIX}_BATCH_INTERVAL", up_to_a_second),
    Option("read_batch_bytes", "bytes of stored samples a replaying reader reads at once, and holds "
           "at most while its client reads slowly (a larger sample is read alone)",
           DEFAULT_READ_BATCH_BYTES, f"{ENV_PREFIX}_READ_BATCH_BYTES", positive_int),
    Option("replay_bytes", "bytes of stored samples every replaying reader together holds, read and "
           "not yet sent, each counted twice (as read and as sent): past it readers wait their "
           "turn (a sample larger than this is read alone)", DEFAULT_REPLAY_BYTES,
           f"{ENV_PREFIX}_REPLAY_BYTES", positive_int),
    Option("ingestion_stream_bytes", "bytes of samples one ingestion stream may have received and not "
           "yet committed: past it the stream reads no further (gRPC flow control holds its sender "
           "back) until commits catch up", DEFAULT_MAX_STREAM_BYTES,
           f"{ENV_PREFIX}_INGESTION_STREAM_BYTES", positive_int),
    Option("ingestion_bytes", "bytes of samples every ingestion stream together holds: received and "
           "not yet committed, and three times the sample each is reading (as large as its "
           "largest, or as new streams' lately): past it streams wait their turn to read, and "
           "gRPC flow control holds their senders back", DEFAULT_MAX_IN_FLIGHT_BYTES,
           f"{ENV_PREFIX}_INGESTION_BYTES", positive_int),
    Option("ingestion_lease", "seconds after which a trial whose ingesting process died (its "
           "stream never closed) is closed as interrupted, by any replica; at least 1.5 times "
           "--outage_bound", DEFAULT_LEASE_S,
           f"{ENV_PREFIX}_INGESTION_LEASE", positive_float),
    *registration_options("TRIAL_DATASTORE"),
]  # fmt: skip


@dataclass(frozen=True)
class DatastoreSettings(ServerSettings, RegistrationSettings):
    """The values of OPTIONS."""

    options: ClassVar[Sequence[Option]] = OPTIONS

    batch_interval: float
    batch_max_samples: int
    ingestion_bytes: int
    ingestion_lease: float
    ingestion_stream_bytes: int
    read_batch_bytes: int
    replay_bytes: int


log = get_logger("datastore")


class DatastoreService(Service[DatastoreSettings]):
    name = "datastore"
    settings_type = DatastoreSettings
    description = "Cogment Trial Datastore: datalog ingestion, stored trials, replay and live samples."

    def __init__(self, settings: DatastoreSettings, *, database: Database | None = None) -> None:
        check_outage_bound(settings.ingestion_lease, settings.outage_bound)
        super().__init__(settings, database=database)
        self.feed = ChangeFeed(self.database, CHANGE_CHANNEL)
        self.store = DatastoreStore(self.database)
        self.batcher = SampleBatcher(
            self.store,
            self.dependencies,
            max_samples=settings.batch_max_samples,
            max_stream_bytes=settings.ingestion_stream_bytes,
            max_in_flight_bytes=settings.ingestion_bytes,
            interval_s=settings.batch_interval,
        )
        self.leases = IngestionLeases(
            self.store, settings.ingestion_lease, self.dependencies, self._holder_locks()
        )
        self.datastore = TrialDatastore(
            self.store,
            self.feed,
            self.batcher,
            self.leases,
            self.dependencies,
            read_batch_bytes=settings.read_batch_bytes,
            replay_bytes=settings.replay_bytes,
        )
        metrics.watch(
            open_streams=lambda: self.leases.streams,
            readers=lambda: self.datastore.readers,
            held=lambda: self.batcher.in_flight_bytes,
            budget=settings.ingestion_bytes,
        )
        self.registration = self.directory_registration(
            [directory_pb2.DATASTORE_SERVICE, directory_pb2.DATALOG_SERVICE]
        )

    def _holder_locks(self) -> HolderLocks | None:
        """Lock files tell which lease holders are gone where the database has one host and is a file."""
        file = self.database.url.database or ""
        if self.database.shared_between_hosts or file in ("", ":memory:") or file.startswith("file:"):
            return None
        return HolderLocks.beside(file)

    async def start(self, runtime: ServiceRuntime) -> None:
        log.info("opening storage", database=self.database.display_url)
        await self.database.migrate()
        await self.feed.start()
        self.batcher.start()
        self.leases.start()

    def add_servicers(self, server: grpc.aio.Server, runtime: ServiceRuntime) -> Sequence[str]:
        return add_servicers(server, self.datastore, runtime)

    async def stop(self) -> None:
        await self.leases.stop()
        await self.batcher.stop()  # what was received is written
        await self.feed.stop()
