"""Scale-out smoke test: what the Helm chart would run, run here.

The chart is rendered with ci/scale-out-values.yaml (PostgreSQL, S3, TLS with client
certificates, metrics), and each rendered container becomes a local process with the image's
entrypoint, the container's args and its environment: Secret references resolved from the
test's PostgreSQL database, SeaweedFS keys and certificates, Secret volumes written to
directories, field references answered as Kubernetes would. Only what differs on one machine is
rewritten: every replica listens on 127.0.0.1 and a free port, in-cluster host names become the
local servers, SeaweedFS speaks plain HTTP, and the bucket is the test's own.

The migration Job runs once; then two replicas of each service run against the one database and
bucket, and each service is exercised through both replicas. A second test runs the
self-registration wiring and kubelet's native gRPC probes, with the default values (SQLite files
on the data volumes) and with the scale-out values without TLS (the registration client has no
TLS yet).
"""

from __future__ import annotations

import os
import secrets
import socket
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import psycopg
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from sqlalchemy.engine import make_url

from shared.api import (
    common_pb2,
    datalog_pb2_grpc,
    directory_pb2,
    directory_pb2_grpc,
    model_registry_pb2_grpc,
    trial_datastore_pb2_grpc,
)
from shared.api import model_registry_pb2 as mr
from shared.api import trial_datastore_pb2 as ds
from tests.fixtures.seaweedfs import SeaweedS3, new_bucket_name
from tests.helpers.datastore import datalog_inputs, full_trial, trial_params
from tests.helpers.helm import (
    SCALE_OUT_VALUES,
    LocalCommand,
    Manifest,
    Secrets,
    by_component,
    image_entrypoint,
    local_command,
    of_kind,
    pod_spec,
    render,
    start_local,
)
from tests.helpers.services import RunningService
from tests.helpers.tls import Pki, make_pki, openssl_available

pytestmark = pytest.mark.timeout(240)

RELEASE, NAMESPACE = "cogment", "cogment"
DIRECTORY_HOST = f"{RELEASE}-cogment-aux-directory.{NAMESPACE}.svc.cluster.local"
TOKEN = "scale-out-token"


def _secret_value_for(env_name: str, postgres_url: str, s3: SeaweedS3) -> str:
    """What the Secret behind an environment variable holds, by the variable's meaning."""
    if env_name.endswith("_DATABASE_URL"):
        return postgres_url
    if env_name.endswith("_S3_ACCESS_KEY"):
        return s3.access_key
    if env_name.endswith("_S3_SECRET_KEY"):
        return s3.secret_key
    if env_name == "COGMENT_DIRECTORY_SECRET_KEY":
        return "scale-out-directory-key-" + "k" * 32
    if env_name == "COGMENT_DIRECTORY_AUTHENTICATION_TOKEN":
        return TOKEN
    raise AssertionError(f"no test value for the Secret behind {env_name}")


def _tls_file_for(path: str, pki: Pki | None) -> str:
    assert pki is not None, "a TLS Secret is mounted but the test made no certificates"
    files = {"tls.crt": pki.server.cert, "tls.key": pki.server.key, "ca.crt": pki.ca}
    return files[path].read_text()


def make_secrets(manifests: Sequence[Manifest], postgres_url: str, s3: SeaweedS3, pki: Pki | None) -> Secrets:
    """Every Secret the rendered workloads reference, filled with the test's values."""
    found: dict[str, dict[str, str]] = {}

    def put(name: str, key: str, value: str) -> None:
        previous = found.setdefault(name, {}).setdefault(key, value)
        assert previous == value, f"Secret {name} key {key} is used for two different things"

    for workload in of_kind(manifests, "Deployment") + of_kind(manifests, "Job"):
        spec = pod_spec(workload)
        for container in spec["containers"]:
            for entry in container.get("env", []):
                ref = entry.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    put(ref["name"], ref["key"], _secret_value_for(entry["name"], postgres_url, s3))
        for volume in spec.get("volumes", []):
            if "secret" in volume:
                for item in volume["secret"]["items"]:
                    put(volume["secret"]["secretName"], item["key"], _tls_file_for(item["path"], pki))
    return found


class LocalRelease:
    """The rendered release's workloads as local processes."""

    def __init__(self, manifests: list[Manifest], root: Path, secrets: Secrets, s3: SeaweedS3) -> None:
        self.manifests = manifests
        self.root = root
        self.secrets = secrets
        self.s3 = s3
        self.bucket = new_bucket_name()
        self.entrypoint = image_entrypoint()
        self.directory_endpoint: str | None = None
        self.running: list[RunningService] = []
        self._count = 0

    def rewrite(self, name: str, value: str) -> str:
        """What differs between a pod and a process of this machine."""
        if name.endswith("_BIND_ADDRESS"):
            return "127.0.0.1"
        if name.endswith("_PORT"):  # gRPC and metrics: every replica shares this host
            return "0"
        if name.endswith("_S3_ENDPOINT"):
            return self.s3.endpoint
        if name.endswith("_S3_SECURE"):
            return "false"  # SeaweedFS here speaks plain HTTP
        if name.endswith("_S3_BUCKET"):
            return self.bucket
        if name == "COGMENT_DIRECTORY_ENDPOINT":
            assert value == f"grpc://{DIRECTORY_HOST}:9005", value
            assert self.directory_endpoint is not None, "start a directory replica first"
            return self.directory_endpoint
        return value

    def _command(self, workload: Manifest, where: Path) -> LocalCommand:
        spec = pod_spec(workload)
        (container,) = spec["containers"]
        return local_command(
            spec,
            container,
            entrypoint=self.entrypoint,
            secrets=self.secrets,
            field_refs={"status.podIP": "127.0.0.1"},
            volumes_dir=where / "volumes",
            rewrite=self.rewrite,
        )

    def run_job(self) -> tuple[int, str]:
        """Run the migration Job's container to completion: (exit status, log)."""
        (job,) = of_kind(self.manifests, "Job")
        where = self.root / "migrations"
        process = start_local(self._command(job, where), cwd=where)
        _, stderr = process.communicate(timeout=120)
        return process.returncode, stderr

    def start_many(self, components: Sequence[str]) -> list[RunningService]:
        """Start replicas of several components at once (the start-ups overlap)."""
        deployments = by_component(self.manifests, "Deployment")
        started = []
        for component in components:
            self._count += 1
            where = self.root / f"{component}-{self._count}"
            process = start_local(self._command(deployments[component], where), cwd=where)
            service = RunningService(process, where / "log")
            self.running.append(service)
            started.append(service)
        for service in started:
            service.wait_serving(60)
        return started

    def container(self, component: str) -> dict[str, Any]:
        container: dict[str, Any] = pod_spec(by_component(self.manifests, "Deployment")[component])[
            "containers"
        ][0]
        return container

    def stop(self) -> list[int]:
        codes = []
        for service in reversed(self.running):
            service.stop()
            codes.append(service.process.returncode)
        self.running.clear()
        return codes


@pytest.fixture
def local_release(
    tmp_path: Path, postgres_url: str, seaweed_s3: SeaweedS3
) -> Iterator[Callable[[list[Manifest], Pki | None], LocalRelease]]:
    releases: list[LocalRelease] = []

    def make(manifests: list[Manifest], pki: Pki | None) -> LocalRelease:
        secrets = make_secrets(manifests, postgres_url, seaweed_s3, pki)
        release = LocalRelease(manifests, tmp_path / f"release-{len(releases)}", secrets, seaweed_s3)
        releases.append(release)
        return release

    yield make
    for release in releases:
        release.stop()


def kubelet_probe(container: dict[str, Any], port: int, kind: str = "readinessProbe") -> bool:
    """Run the container's probe as kubelet would against the replica's local port."""
    probe = container[kind]
    if "grpc" in probe:
        assert probe["grpc"]["port"] == container["ports"][0]["containerPort"]
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=probe["grpc"].get("service", "")),
                timeout=probe.get("timeoutSeconds", 1),
            )
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)
    assert probe["tcpSocket"]["port"] == "grpc"
    with socket.create_connection(("127.0.0.1", port), timeout=probe.get("timeoutSeconds", 1)):
        return True


def schema_revision(postgres_url: str) -> str | None:
    url = make_url(postgres_url).set(drivername="postgresql")
    with psycopg.connect(url.render_as_string(hide_password=False)) as connection:
        row = connection.execute("SELECT version_num FROM alembic_version").fetchone()
    return None if row is None else str(row[0])


def scrape_metrics(service: RunningService) -> str:
    (event,) = service.events("serving metrics")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"http://127.0.0.1:{event['port']}/metrics", timeout=5) as response:
        return str(response.read().decode())


# ---- what each service does through two replicas ----


def exercise_directory(a: grpc.Channel, b: grpc.Channel) -> None:
    metadata = (("authentication-token", TOKEN),)
    details = directory_pb2.ServiceDetails(
        type=directory_pb2.ACTOR_SERVICE, properties={"__actor_class": "pilot"}
    )
    request = directory_pb2.RegisterRequest(
        endpoint=directory_pb2.ServiceEndpoint(
            protocol=directory_pb2.ServiceEndpoint.GRPC, host="127.0.0.1", port=1
        ),
        details=details,
        permanent=True,  # never health-checked: nothing listens there
    )
    (reply,) = directory_pb2_grpc.DirectorySPStub(a).Register(iter([request]), metadata=metadata, timeout=10)
    assert reply.status == directory_pb2.RegisterReply.OK, reply.error_msg
    found = list(
        directory_pb2_grpc.DirectorySPStub(b).Inquire(
            directory_pb2.InquireRequest(details=details), metadata=metadata, timeout=10
        )
    )
    assert [entry.data.service_id for entry in found] == [reply.service_id]
    # The secret from replica A deregisters through replica B.
    (gone,) = directory_pb2_grpc.DirectorySPStub(b).Deregister(
        iter([directory_pb2.DeregisterRequest(service_id=reply.service_id, secret=reply.secret)]),
        metadata=metadata,
        timeout=10,
    )
    assert gone.status == directory_pb2.DeregisterReply.OK, gone.error_msg


def _version_chunks(model_id: str, data: bytes) -> Iterator[mr.CreateVersionRequestChunk]:
    info = mr.ModelVersionInfo(model_id=model_id, archived=True, data_size=len(data))
    yield mr.CreateVersionRequestChunk(header=mr.CreateVersionRequestChunk.Header(version_info=info))
    for start in range(0, len(data), 1 << 20):
        body = mr.CreateVersionRequestChunk.Body(data_chunk=data[start : start + (1 << 20)])
        yield mr.CreateVersionRequestChunk(body=body)


def exercise_registry(a: grpc.Channel, b: grpc.Channel) -> None:
    stub_a, stub_b = (
        model_registry_pb2_grpc.ModelRegistrySPStub(a),
        model_registry_pb2_grpc.ModelRegistrySPStub(b),
    )
    stub_a.CreateOrUpdateModel(
        mr.CreateOrUpdateModelRequest(model_info=mr.ModelInfo(model_id="pilot", user_data={"team": "a"})),
        timeout=10,
    )
    first, second = os.urandom(3 * 1024 * 1024 + 7), os.urandom(1000)
    assert stub_a.CreateVersion(_version_chunks("pilot", first), timeout=60).version_info.version_number == 1
    # The next number is taken through the other replica: one sequence per model.
    assert stub_b.CreateVersion(_version_chunks("pilot", second), timeout=60).version_info.version_number == 2
    for stub, number, data in [(stub_b, 1, first), (stub_a, 2, second), (stub_b, -1, second)]:
        request = mr.RetrieveVersionDataRequest(model_id="pilot", version_number=number)
        assert b"".join(reply.data_chunk for reply in stub.RetrieveVersionData(request, timeout=60)) == data
    infos = stub_b.RetrieveVersionInfos(mr.RetrieveVersionInfosRequest(model_id="pilot"), timeout=10)
    assert [info.version_number for info in infos.version_infos] == [1, 2]


def exercise_datastore(a: grpc.Channel, b: grpc.Channel) -> None:
    trial_id = f"scale-out-{secrets.token_hex(4)}"
    samples = full_trial(5)
    acks = list(
        datalog_pb2_grpc.DatalogSPStub(a).RunTrialDatalog(
            iter(datalog_inputs(trial_params(), samples)),
            metadata=(("trial-id", trial_id), ("user-id", "tester")),
            timeout=30,
        )
    )
    assert len(acks) == 1 + len(samples)
    stub_b = trial_datastore_pb2_grpc.TrialDatastoreSPStub(b)
    (info,) = stub_b.RetrieveTrials(ds.RetrieveTrialsRequest(trial_ids=[trial_id]), timeout=10).trial_infos
    assert (info.user_id, info.samples_count, info.last_state) == ("tester", 5, common_pb2.ENDED)
    stored = [
        reply.trial_sample
        for reply in stub_b.RetrieveSamples(ds.RetrieveSamplesRequest(trial_ids=[trial_id]), timeout=30)
    ]
    assert [sample.tick_id for sample in stored] == [0, 1, 2, 3, 4]


# ---- the tests ----


@pytest.mark.skipif(not openssl_available(), reason="needs the openssl command to make certificates")
def test_scale_out_values_run_two_replicas_per_service(
    tmp_path: Path, postgres_url: str, local_release: Callable[[list[Manifest], Pki | None], LocalRelease]
) -> None:
    manifests = render([SCALE_OUT_VALUES], release=RELEASE, namespace=NAMESPACE)
    pki = make_pki(tmp_path / "pki")
    release = local_release(manifests, pki)

    # The migration Job, once, before any replica.
    code, log = release.run_job()
    assert code == 0, log
    assert "schema up to date" in log
    revision = schema_revision(postgres_url)
    assert revision is not None

    # Two replicas of each service, started together, on the one database and bucket.
    names = ["directory", "model-registry", "datastore"]
    started = release.start_many([name for name in names for _replica in range(2)])
    by_name = {name: started[2 * i : 2 * i + 2] for i, name in enumerate(names)}
    assert schema_revision(postgres_url) == revision  # the replicas found the schema migrated

    credentials = pki.channel_credentials(pki.client)
    exercises = {
        "directory": exercise_directory,
        "model-registry": exercise_registry,
        "datastore": exercise_datastore,
    }
    for name, (a, b) in by_name.items():
        container = release.container(name)
        for service in (a, b):
            assert kubelet_probe(container, service.port, "readinessProbe")
            assert kubelet_probe(container, service.port, "livenessProbe")
            (serving,) = service.events("serving")
            assert serving["tls"] is True and serving["mtls"] is True
        with (
            grpc.secure_channel(a.address, credentials) as channel_a,
            grpc.secure_channel(b.address, credentials) as channel_b,
        ):
            health = health_pb2_grpc.HealthStub(channel_b).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            exercises[name](channel_a, channel_b)
        # Without a client certificate, mTLS turns the caller away.
        with (
            grpc.secure_channel(a.address, pki.channel_credentials()) as anonymous,
            pytest.raises(grpc.RpcError),
        ):
            health_pb2_grpc.HealthStub(anonymous).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert "grpc_server_handled_total" in scrape_metrics(a)

    assert release.stop() == [0] * 6  # graceful shutdown on SIGTERM


TOKEN_SECRET = {"directoryRegistration.authenticationToken.existingSecret": "cogment-aux-directory-token"}


@pytest.mark.parametrize(
    ("values_files", "set_values", "registry_replicas"),
    [
        ([], TOKEN_SECRET, 1),
        (
            [SCALE_OUT_VALUES],
            {"tls.enabled": "false", "directoryRegistration.enabled": "true", **TOKEN_SECRET},
            2,
        ),
    ],
    ids=["sqlite-defaults", "postgresql-s3-plaintext"],
)
def test_registry_and_datastore_replicas_register_in_the_directory(
    values_files: list[Path],
    set_values: dict[str, str],
    registry_replicas: int,
    local_release: Callable[[list[Manifest], Pki | None], LocalRelease],
) -> None:
    """The default values (SQLite files on the data volumes) and the scale-out values without
    TLS: each replica registers in the chart's directory, and deregisters when it stops."""
    manifests = render(values_files, set_values, release=RELEASE, namespace=NAMESPACE)
    release = local_release(manifests, None)
    if of_kind(manifests, "Job"):
        code, log = release.run_job()
        assert code == 0, log
    (directory,) = release.start_many(["directory"])
    assert kubelet_probe(release.container("directory"), directory.port)  # the native gRPC probe
    release.directory_endpoint = directory.endpoint
    names = ["model-registry"] * registry_replicas + ["datastore"]
    registries = release.start_many(names)
    for name, service in zip(names, registries, strict=True):
        assert kubelet_probe(release.container(name), service.port)
    if not values_files:  # SQLite: each service's file is on its data volume
        for where, database in [("directory-1", "directory.db"), ("model-registry-2", "model_registry.db"),
                                ("datastore-3", "datastore.db")]:  # fmt: skip
            assert (release.root / where / "volumes" / "data" / database).is_file()

    def registered(service_type: directory_pb2.ServiceType.ValueType) -> list[tuple[str, int]]:
        with grpc.insecure_channel(directory.address) as channel:
            request = directory_pb2.InquireRequest(details=directory_pb2.ServiceDetails(type=service_type))
            found = directory_pb2_grpc.DirectorySPStub(channel).Inquire(
                request, metadata=(("authentication-token", TOKEN),), timeout=10
            )
            return sorted((entry.data.endpoint.host, entry.data.endpoint.port) for entry in found)

    datastore = registries[-1]
    expected = {
        directory_pb2.MODEL_REGISTRY_SERVICE: sorted(("127.0.0.1", r.port) for r in registries[:-1]),
        directory_pb2.DATASTORE_SERVICE: [("127.0.0.1", datastore.port)],
        directory_pb2.DATALOG_SERVICE: [("127.0.0.1", datastore.port)],
    }
    for service_type, endpoints in expected.items():
        deadline = time.monotonic() + 30
        while registered(service_type) != endpoints and time.monotonic() < deadline:
            time.sleep(0.1)
        assert registered(service_type) == endpoints
    # A replica going away (SIGTERM, as Kubernetes stops a pod) deregisters itself.
    registries[0].stop()
    assert registries[0].process.returncode == 0
    remaining = sorted(("127.0.0.1", r.port) for r in registries[1:-1])
    assert registered(directory_pb2.MODEL_REGISTRY_SERVICE) == remaining
    assert release.stop() == [0] * (2 + registry_replicas)
