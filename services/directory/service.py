"""The Directory service: its options and its life cycle on the shared server bootstrap."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import grpc
from prometheus_client import Gauge

from services.directory.core import DEFAULT_FIRST_CHECK_WAIT_S, Directory, keyed_digest
from services.directory.health import HealthChecker
from services.directory.index import FollowedIndex
from services.directory.secret_key import directory_key
from services.directory.servicer import add_servicers
from services.directory.store import DirectoryStore
from shared.config import Option, non_negative_float, non_negative_int, parse_bool, positive_float
from shared.db import Database
from shared.endpoints import SERVICE_TYPES
from shared.logging import get_logger
from shared.notify import ChangeFeed
from shared.runtime import ServiceRuntime
from shared.server import Service
from shared.settings import ServerSettings, server_options
from shared.supervision import Periodic

DEFAULT_PORT = 9005
ENV_PREFIX = "COGMENT_DIRECTORY"
MAINTENANCE_PERIOD_S = 5.0
# Refresh the planner's statistics once the number of entries moved this much since the last time.
STATISTICS_DRIFT = 0.2
# ...and not below this many entries. Statistics of a nearly empty table make PostgreSQL plan the
# properties' foreign-key checks as sequential scans, a plan each connection keeps until the next
# ANALYZE: a burst of registrations on a fresh database slowed down as the table grew (10,000
# entries at 1,800/s instead of 5,000/s). A table never analyzed is assumed to be of some size.
STATISTICS_MIN_ENTRIES = 100
# The PostgreSQL notification channel of entry changes (read by every replica's index).
CHANGE_CHANNEL = "cogment_directory"

OPTIONS: list[Option] = [
    *server_options(ENV_PREFIX, DEFAULT_PORT),
    Option(
        "registration_lag",
        "seconds an inquiry with no match keeps retrying (once a second)",
        0,
        f"{ENV_PREFIX}_REGISTRATION_LAG",
        non_negative_int,
    ),
    Option(
        "registration_check_wait",
        "seconds Register waits for a new entry's first health check (entries of checked kinds are "
        "answered only once a check passed; the check goes on after this)",
        DEFAULT_FIRST_CHECK_WAIT_S,
        f"{ENV_PREFIX}_REGISTRATION_CHECK_WAIT",
        non_negative_float,
    ),
    Option(
        "load_balancing",
        "answer inquiries with the least loaded services, shuffled",
        False,
        f"{ENV_PREFIX}_LOAD_BALANCING",
        parse_bool,
    ),
    Option(
        "check_on_inquire",
        "health-check the matches of an inquiry before answering",
        False,
        f"{ENV_PREFIX}_CHECK_ON_INQUIRE",
        parse_bool,
    ),
    Option(
        "force_permanent",
        "register every service as permanent (never health-checked)",
        False,
        f"{ENV_PREFIX}_FORCE_PERMANENT",
        parse_bool,
    ),
    Option(
        "health_check_interval",
        "seconds between two health checks of an entry",
        60.0,
        f"{ENV_PREFIX}_HEALTH_CHECK_INTERVAL",
        positive_float,
    ),
    Option(
        "secret_key",
        "key the registration secrets are derived from and tokens digested with; the same for "
        "every replica (default: generated once into <data_dir>/directory.key, mode 0600; on "
        "PostgreSQL, kept in the database, with a warning)",
        None,
        f"{ENV_PREFIX}_SECRET_KEY",
    ),
]


@dataclass(frozen=True)
class DirectorySettings(ServerSettings):
    """The values of OPTIONS."""

    options: ClassVar[Sequence[Option]] = OPTIONS

    registration_lag: int
    registration_check_wait: float
    load_balancing: bool
    check_on_inquire: bool
    force_permanent: bool
    health_check_interval: float
    secret_key: str | None


log = get_logger("directory")
entries_gauge = Gauge(
    "cogment_directory_entries",
    "Registered entries, by service type and health (unhealthy: the last check failed).",
    ["type", "health"],
)


class DirectoryService(Service[DirectorySettings]):
    name = "directory"
    settings_type = DirectorySettings
    description = "Cogment Directory: service registration, discovery and health checking."

    def __init__(self, settings: DirectorySettings, *, database: Database | None = None) -> None:
        super().__init__(settings, database=database)
        self.feed = ChangeFeed(self.database, CHANGE_CHANNEL)
        self.store = DirectoryStore(self.database, self.dependencies)
        # On a database of one host (SQLite) every change is heard from the start: this process's
        # own, and other processes' by polling the file; on a shared one once the feed listens.
        self.index = FollowedIndex(self.store, listening=not self.database.shared_between_hosts)
        self.feed.follow(self.index)
        self.checker = HealthChecker(self.store, settings.health_check_interval)
        self._maintenance = Periodic("directory-maintenance", self._maintain, MAINTENANCE_PERIOD_S)
        # The entry count when the planner's statistics were last refreshed.
        self._analyzed_at_count: int | None = None
        self.directory: Directory | None = None

    async def start(self, runtime: ServiceRuntime) -> None:
        log.info("opening database", database=self.database.display_url)
        await self.database.migrate()
        settings = self.settings
        key = await directory_key(settings.secret_key, settings.data_dir, self.store)
        converted = await self.store.key_token_digests(functools.partial(keyed_digest, key))
        if converted:
            log.info("token digests are now keyed", tokens=converted)
        directory = Directory(
            self.store,
            self.checker,
            key,
            force_permanent=settings.force_permanent,
            load_balancing=settings.load_balancing,
            check_on_inquire=settings.check_on_inquire,
            registration_lag_s=settings.registration_lag,
            first_check_wait_s=settings.registration_check_wait,
            index=self.index,
        )
        self.directory = directory

        async def nb_entries() -> str:
            return str(await self.store.count())

        async def load_balancing() -> str:
            return "enabled" if directory.load_balancing else "disabled"

        runtime.add_status("nb_entries", nb_entries)
        runtime.add_status("load_balancing", load_balancing)
        await self.feed.start()
        self.index.start()
        self.checker.start()
        self._maintenance.start()

    def add_servicers(self, server: grpc.aio.Server, runtime: ServiceRuntime) -> Sequence[str]:
        assert self.directory is not None, "start() comes first"
        return add_servicers(server, self.directory, runtime)

    async def stop(self) -> None:
        await self.checker.stop()
        await self._maintenance.stop()
        await self.index.stop()
        await self.feed.stop()

    async def _maintain(self) -> None:
        """Publish the entry gauges and keep the planner's statistics current.

        On PostgreSQL an inquiry plan needs statistics to start from the property index; after a
        burst of registrations (a fresh deployment, a restart of many services) autovacuum can
        take a minute to notice, during which inquiries would scan every entry.
        """
        counts = await self.store.count_by_type()
        total = sum(counts.values())
        for type_name, service_type in SERVICE_TYPES.items():
            for unhealthy, health in ((False, "healthy"), (True, "unhealthy")):
                entries_gauge.labels(type_name, health).set(counts.get((service_type, unhealthy), 0))
        analyzed = self._analyzed_at_count
        if (
            self.database.shared_between_hosts
            and total >= STATISTICS_MIN_ENTRIES
            and (analyzed is None or abs(total - analyzed) > STATISTICS_DRIFT * analyzed)
        ):
            await self.store.refresh_statistics()
            self._analyzed_at_count = total
