"""The directory's vocabulary, shared by its gRPC layer, core, store and health checker."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from shared.api import directory_entries_pb2, directory_pb2

# The change-feed key of one entry, and of every entry (a change to all of them): the in-memory
# index (services.directory.index) re-reads the entries it hears of.
ENTRY_KEY_PREFIX = "entry:"
ALL_ENTRIES_KEY = "entries"

GRPC = directory_pb2.ServiceEndpoint.GRPC
GRPC_SSL = directory_pb2.ServiceEndpoint.GRPC_SSL
COGMENT = directory_pb2.ServiceEndpoint.COGMENT
VALID_PROTOCOLS = frozenset({GRPC, GRPC_SSL, COGMENT})

OTHER_SERVICE = directory_pb2.OTHER_SERVICE
UNKNOWN_SERVICE = directory_pb2.UNKNOWN_SERVICE
VALID_SERVICE_TYPES = frozenset(
    {*range(directory_pb2.TRIAL_LIFE_CYCLE_SERVICE, directory_pb2.DIRECTORY_SERVICE + 1), OTHER_SERVICE}
)

# gRPC service answering Status/Version for each Cogment service type (used by health checks).
GRPC_SERVICE_BY_TYPE: dict[int, str] = {
    directory_pb2.TRIAL_LIFE_CYCLE_SERVICE: "TrialLifecycleSP",
    directory_pb2.CLIENT_ACTOR_CONNECTION_SERVICE: "ClientActorSP",
    directory_pb2.ACTOR_SERVICE: "ServiceActorSP",
    directory_pb2.ENVIRONMENT_SERVICE: "EnvironmentSP",
    directory_pb2.PRE_HOOK_SERVICE: "TrialHooksSP",
    directory_pb2.DATALOG_SERVICE: "DatalogSP",
    directory_pb2.DATASTORE_SERVICE: "TrialDatastoreSP",
    directory_pb2.MODEL_REGISTRY_SERVICE: "ModelRegistrySP",
    directory_pb2.DIRECTORY_SERVICE: "DirectorySP",
}

# Largest service id: ids are random non-zero 63-bit integers (they fit a signed BIGINT).
MAX_SERVICE_ID = 2**63 - 1
# How long a replica holds an entry it is checking (its first check, or a periodic one) before
# another may take it over: a check lasts at most ~35 s (TCP: 5 + 10 + 20 s), plus a margin.
CHECK_LEASE_NS = 120 * 1_000_000_000


@dataclass(frozen=True)
class Endpoint:
    protocol: int
    host: str
    port: int


@dataclass(frozen=True)
class Registration:
    """A validated registration request."""

    endpoint: Endpoint
    service_type: int
    properties: dict[str, str]
    permanent: bool

    @property
    def health_checked(self) -> bool:
        """Permanent entries and COGMENT endpoints (clients, not network services) are never checked."""
        return not self.permanent and self.endpoint.protocol in (GRPC, GRPC_SSL)


NOT_CHECKED = directory_entries_pb2.ENTRY_HEALTH_NOT_CHECKED
AWAITING_FIRST_CHECK = directory_entries_pb2.ENTRY_HEALTH_AWAITING_FIRST_CHECK
HEALTHY = directory_entries_pb2.ENTRY_HEALTH_HEALTHY
FAILING = directory_entries_pb2.ENTRY_HEALTH_FAILING


@dataclass
class Entry:
    """A stored registration, as inquiries return it."""

    service_id: int
    endpoint: Endpoint
    service_type: int
    properties: dict[str, str]
    permanent: bool
    registered_at: int
    load: int = 0
    failed_checks: int = 0
    last_check_at: int = 0

    @property
    def health(self) -> int:
        """Where its health checks stand (an EntryHealth): only HEALTHY and NOT_CHECKED entries
        are answered to inquiries."""
        if self.permanent or self.endpoint.protocol not in (GRPC, GRPC_SSL):
            return NOT_CHECKED
        if self.failed_checks:
            return FAILING
        return HEALTHY if self.last_check_at else AWAITING_FIRST_CHECK


@dataclass(frozen=True)
class Inquiry:
    """Either one service id, or a type (UNKNOWN_SERVICE = any) and a property subset."""

    service_id: int | None = None
    service_type: int = UNKNOWN_SERVICE
    properties: dict[str, str] = field(default_factory=dict)

    @property
    def can_match(self) -> bool:
        """False for an id no entry can have (0, as `wait_for_ready` sends): answered at once."""
        return self.service_id is None or 0 < self.service_id <= MAX_SERVICE_ID


@dataclass(frozen=True)
class CheckTarget:
    """What the health checker needs to know of an entry."""

    service_id: int
    endpoint: Endpoint
    service_type: int
    failed_checks: int
    load: int


@dataclass(frozen=True)
class CheckResult:
    healthy: bool
    # None keeps the previous load (TCP checks cannot read one).
    load: int | None = None


def entry_keys(service_ids: Iterable[int]) -> list[str]:
    return [f"{ENTRY_KEY_PREFIX}{service_id}" for service_id in service_ids]
