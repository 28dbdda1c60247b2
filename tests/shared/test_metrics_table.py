"""The README's metrics table (Common to every service, Metrics) lists exactly the metric
families each service exposes, with their types: each row's prefix names the service it belongs
to, and the common rows belong to all three."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from shared.api import common_pb2, directory_pb2, directory_pb2_grpc
from shared.version import COGMENT_API_VERSION, PACKAGE_VERSION
from tests.helpers.fake_services import free_port
from tests.helpers.metrics import family_types, metrics_text
from tests.helpers.services import PROJECT_ROOT, RunningService, start_service

pytestmark = pytest.mark.timeout(120)

# Each service's `cogment_service` label and module, and the prefix of its own families.
SERVICES = {
    "directory": ("services.directory", "cogment_directory_"),
    "model_registry": ("services.model_registry", "cogment_model_registry_"),
    "trial_datastore": ("services.datastore", "cogment_trial_datastore_"),
}
# Families every service exposes.
COMMON_PREFIXES = ("cogment_dependency_", "cogment_ready", "cogment_build_info", "grpc_server_")
ROW = re.compile(r"^\| `(?P<name>[a-z_:]+)` \| (?P<type>\w+) \|")


def table_rows() -> dict[str, str]:
    """The README's Metrics table: family name -> type."""
    readme = (PROJECT_ROOT / "README.md").read_text()
    section = readme.split("\n### Metrics\n", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, str] = {}
    for line in section.splitlines():
        match = ROW.match(line)
        if match:
            assert match["name"] not in rows, f"two rows for {match['name']}"
            rows[match["name"]] = match["type"]
    return rows


def owner(name: str) -> str | None:
    """The service a family belongs to (None: every service)."""
    if name.startswith(COMMON_PREFIXES):
        return None
    owners = [service for service, (_, prefix) in SERVICES.items() if name.startswith(prefix)]
    assert len(owners) == 1, f"{name}: no service's prefix, nor a common one"
    return owners[0]


def version_call(grpc_service: str) -> Callable[[RunningService], None]:
    def call(service: RunningService) -> None:
        with grpc.insecure_channel(service.address) as channel:
            version = channel.unary_unary(
                f"/{grpc_service}/Version",
                request_serializer=common_pb2.VersionRequest.SerializeToString,
                response_deserializer=common_pb2.VersionInfo.FromString,
            )
            assert version(common_pb2.VersionRequest(), timeout=10).versions

    return call


def directory_work(service: RunningService) -> None:
    version_call("cogmentAPI.DirectorySP")(service)
    with grpc.insecure_channel(service.address) as channel:
        stub = directory_pb2_grpc.DirectorySPStub(channel)
        request = directory_pb2.RegisterRequest(
            endpoint=directory_pb2.ServiceEndpoint(
                protocol=directory_pb2.ServiceEndpoint.COGMENT, host="h", port=1
            ),
            details=directory_pb2.ServiceDetails(type=directory_pb2.ACTOR_SERVICE),
        )
        [reply] = list(stub.Register(iter([request]), timeout=10))
        assert reply.status == directory_pb2.RegisterReply.OK
        inquiry = directory_pb2.InquireRequest(
            details=directory_pb2.ServiceDetails(type=directory_pb2.ACTOR_SERVICE)
        )
        assert len(list(stub.Inquire(inquiry, timeout=10))) == 1


# A little work, so that families whose series appear with their first use are there.
WORK: dict[str, Callable[[RunningService], None]] = {
    "directory": directory_work,
    "model_registry": version_call("cogmentAPI.ModelRegistrySP"),
    "trial_datastore": version_call("cogmentAPI.TrialDatastoreSP"),
}


@pytest.fixture(scope="module")
def exposed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """Each service's /metrics text, after a little work."""
    log_dir: Path = tmp_path_factory.mktemp("metrics")
    texts: dict[str, str] = {}
    for name, (module, _) in SERVICES.items():
        with start_service(module, ["--metrics_port", str(free_port())], log_dir=log_dir) as service:
            WORK[name](service)
            texts[name] = metrics_text(service)
    yield texts


def test_every_row_names_a_service() -> None:
    rows = table_rows()
    assert rows
    for name in rows:
        owner(name)


@pytest.mark.parametrize("service", list(SERVICES))
def test_table_lists_what_the_service_exposes(service: str, exposed: dict[str, str]) -> None:
    rows = table_rows()
    expected = {name: kind for name, kind in rows.items() if owner(name) in (None, service)}
    assert family_types(exposed[service]) == expected


@pytest.mark.parametrize("service", list(SERVICES))
def test_common_families_carry_the_service_label(service: str, exposed: dict[str, str]) -> None:
    samples = {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(exposed[service])
        for sample in family.samples
    }
    assert samples[("cogment_ready", frozenset({("cogment_service", service)}))] == 1
    database = frozenset({("cogment_service", service), ("dependency", "database")})
    assert samples[("cogment_dependency_up", database)] == 1
    build = frozenset(
        {("cogment_service", service), ("version", PACKAGE_VERSION), ("cogment_api", COGMENT_API_VERSION)}
    )
    assert samples[("cogment_build_info", build)] == 1
