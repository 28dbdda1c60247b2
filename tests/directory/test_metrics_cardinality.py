"""The directory's metrics have a bounded number of series, whatever clients send: 10,000
distinct entries (every service type, distinct properties and tokens) and inquiries with
distinct properties and tokens add no series to those a little of the same work made."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from shared.api import directory_pb2, directory_pb2_grpc
from shared.endpoints import SERVICE_TYPES
from tests.helpers.fake_services import free_port
from tests.helpers.metrics import metrics_text, our_series
from tests.helpers.services import RunningService, start_service

pytestmark = pytest.mark.timeout(300)

ENTRIES = 10_000
TOKENS = 10
INQUIRIES = 1000
# What the directory exposes of its own, whatever it was sent: it holds about 200 series.
MAX_SERIES = 400
TYPES = list(SERVICE_TYPES.values())
COGMENT = directory_pb2.ServiceEndpoint.COGMENT
GRPC = directory_pb2.ServiceEndpoint.GRPC


def series_names(text: str) -> set[str]:
    """Each series by name and labels (its value left out)."""
    return {re.sub(r" [^ ]+$", "", line) for line in our_series(text)}


def entries_count(text: str) -> float:
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "cogment_directory_entries"
        for sample in family.samples
    )


def register(stub: directory_pb2_grpc.DirectorySPStub, token: str, first: int, count: int) -> None:
    """`count` entries numbered from `first`: every type in turn, each with its own properties,
    never health-checked (COGMENT endpoints)."""
    requests = (
        directory_pb2.RegisterRequest(
            endpoint=directory_pb2.ServiceEndpoint(protocol=COGMENT, host=f"host-{n}", port=1 + n % 60_000),
            details=directory_pb2.ServiceDetails(
                type=TYPES[n % len(TYPES)], properties={"n": str(n), f"key-{n}": f"value-{n}"}
            ),
        )
        for n in range(first, first + count)
    )
    replies = list(stub.Register(requests, metadata=(("authentication-token", token),), timeout=240))
    assert [reply.status for reply in replies] == [directory_pb2.RegisterReply.OK] * count


def register_failing(stub: directory_pb2_grpc.DirectorySPStub, count: int) -> None:
    """`count` gRPC entries on ports nobody listens on: their health checks fail."""
    requests = (
        directory_pb2.RegisterRequest(
            endpoint=directory_pb2.ServiceEndpoint(protocol=GRPC, host="127.0.0.1", port=free_port()),
            details=directory_pb2.ServiceDetails(type=directory_pb2.ENVIRONMENT_SERVICE),
        )
        for _ in range(count)
    )
    assert len(list(stub.Register(requests, timeout=60))) == count


def inquire(stub: directory_pb2_grpc.DirectorySPStub, token: str, n: int) -> None:
    """Entry `n` by its properties (found if `token` registered it) and a property nobody has
    (none), each twice (the second answer is remembered)."""
    metadata = (("authentication-token", token),)
    found = directory_pb2.InquireRequest(details=directory_pb2.ServiceDetails(properties={"n": str(n)}))
    missing = directory_pb2.InquireRequest(
        details=directory_pb2.ServiceDetails(properties={"missing": str(n)})
    )
    for _ in range(2):
        list(stub.Inquire(found, metadata=metadata, timeout=10))
        assert list(stub.Inquire(missing, metadata=metadata, timeout=10)) == []


def wait_for_entries(service: RunningService, count: int) -> str:
    """The metrics once the entries gauge (refreshed every 5 s) counts at least `count`."""
    deadline = time.monotonic() + 30
    while True:
        text = metrics_text(service)
        if entries_count(text) >= count or time.monotonic() > deadline:
            return text
        time.sleep(0.5)


@pytest.fixture
def directory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningService]:
    log_dir = tmp_path_factory.mktemp("cardinality")
    args = ["--metrics_port", str(free_port()), "--log_level", "info"]
    with start_service("services.directory", args, log_dir=log_dir) as service:
        yield service


def test_series_stay_bounded_whatever_clients_send(directory: RunningService) -> None:
    with grpc.insecure_channel(directory.address) as channel:
        stub = directory_pb2_grpc.DirectorySPStub(channel)
        # A little of every kind of work: every type, both outcomes of checks and inquiries.
        register(stub, "token-0", 0, len(TYPES))
        register_failing(stub, 1)
        inquire(stub, "token-0", 0)
        before = series_names(wait_for_entries(directory, len(TYPES)))
        assert 'cogment_directory_health_checks_total{outcome="failed"}' in before
        assert 'cogment_directory_inquiries_total{outcome="none",source="remembered"}' in before

        # Much more of it, with what clients choose distinct every time.
        per_token = ENTRIES // TOKENS
        for t in range(TOKENS):
            register(stub, f"token-{t}", len(TYPES) + t * per_token, per_token)
        register_failing(stub, 20)
        for i in range(INQUIRIES):
            inquire(stub, f"token-{i % TOKENS}", len(TYPES) + i * 7)
        text = wait_for_entries(directory, ENTRIES + len(TYPES))

    assert entries_count(text) >= ENTRIES + len(TYPES)
    # Each health check is timed: 21 entries failed theirs at least once (more may be under way,
    # so the two figures are not compared with each other).
    checks = re.search(r'^cogment_directory_health_checks_total\{outcome="failed"\} (\S+)$', text, re.M)
    timed = re.search(r'^cogment_directory_health_check_seconds_count\{outcome="failed"\} (\S+)$', text, re.M)
    assert checks and timed
    assert float(checks[1]) >= 21
    assert float(timed[1]) >= 21
    after = series_names(text)
    assert after == before
    assert len(after) <= MAX_SERIES
