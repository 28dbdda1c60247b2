"""Scale-out smoke test: what the Helm chart would run, run here.

The chart is rendered with ci/scale-out-values.yaml (PostgreSQL, S3, TLS with client
certificates, self-registration in the directory over mTLS, metrics), and each rendered
container becomes a local process with the image's entrypoint, the container's args and its
environment: Secret references resolved from the test's PostgreSQL database, SeaweedFS keys,
token and certificates, Secret and projected volumes written to directories, field references
answered as Kubernetes would. Only what differs on one machine is rewritten: every replica
listens on 127.0.0.1 and ports of its own, in-cluster host names (the directory's Service, the
registered Services) become the local servers, SeaweedFS speaks plain HTTP, and the bucket is the
test's own.

The migration Job runs once; then two replicas of each service start together against the one
database and bucket: each replica of the registry and the datastore registers itself in the
directory over mTLS, every replica answers kubelet's gRPC probes on its plaintext health port,
and each service is exercised through both replicas. Then the web console's two replicas read
them all over mTLS, behind their access token, and stop promptly with a page's stream open. A
second test runs the self-registration wiring in plaintext, with the default values (SQLite files
on the data volumes) and with the scale-out values without TLS.
"""

from __future__ import annotations

import http.client
import os
import secrets
import signal
import threading
import urllib.error
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
from tests.helpers.eventually import wait_until
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
    reserve_port,
    start_local,
)
from tests.helpers.services import RunningService
from tests.helpers.tls import Pki, make_pki, openssl_available

pytestmark = pytest.mark.timeout(240)

RELEASE, NAMESPACE = "cogment", "cogment"
DIRECTORY_HOST = f"{RELEASE}-cogment-aux-directory.{NAMESPACE}.svc.cluster.local"
TOKEN = "scale-out-token"
CONSOLE_TOKEN = "scale-out-console-token"


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
    if env_name == "COGMENT_CONSOLE_AUTH_TOKEN":
        return CONSOLE_TOKEN
    raise AssertionError(f"no test value for the Secret behind {env_name}")


def _tls_file_for(volume: str, path: str, pki: Pki | None) -> str:
    """What a mounted certificate file holds: the server's certificate, except in the volumes of
    the directory registration and of the console's client, where tls.crt and tls.key are the
    client certificate (the server's has no clientAuth usage, as the scale-out values say)."""
    assert pki is not None, "a TLS Secret is mounted but the test made no certificates"
    pair = pki.client if volume in ("directory-tls", "client-tls") else pki.server
    files = {"tls.crt": pair.cert, "tls.key": pair.key, "ca.crt": pki.ca}
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
            sources = (
                [volume["secret"] | {"name": volume["secret"]["secretName"]}] if "secret" in volume else []
            )
            sources += [source["secret"] for source in volume.get("projected", {}).get("sources", [])]
            for source in sources:
                for item in source["items"]:
                    put(source["name"], item["key"], _tls_file_for(volume["name"], item["path"], pki))
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
        # The directory replicas' endpoints, in start order: the directory's Service, which the
        # registering replicas reach in turn (as the Service would spread them).
        self.directory_endpoints: list[str] = []
        self.health_ports: dict[RunningService, int] = {}
        self.running: list[RunningService] = []
        self._taken_ports: set[int] = set()
        self._count = 0

    def rewrite(self, name: str, value: str) -> str:
        """What differs between a pod and a process of this machine (the same for every replica)."""
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
        if name.endswith("_DIRECTORY_REGISTRATION_HOST") and value.endswith(
            f".{NAMESPACE}.svc.cluster.local"
        ):
            return "127.0.0.1"  # directoryRegistration.host=service: the Service is this machine
        return value

    def _command(self, component: str, workload: Manifest, where: Path) -> tuple[LocalCommand, int | None]:
        """The replica's command, and the port of its health service (None for the Job)."""
        spec = pod_spec(workload)
        (container,) = spec["containers"]
        health_port: int | None = None

        def rewrite(name: str, value: str) -> str:
            nonlocal health_port
            if name.endswith("_HEALTH_PORT"):
                health_port = reserve_port(self._taken_ports)
                return str(health_port)
            if component == "directory" and name == "COGMENT_DIRECTORY_PORT":
                # Known before the replica starts, so that registering replicas may start with it.
                port = reserve_port(self._taken_ports)
                self.directory_endpoints.append(f"grpc://127.0.0.1:{port}")
                return str(port)
            if name == "COGMENT_DIRECTORY_ENDPOINT":
                assert value == f"grpc://{DIRECTORY_HOST}:9005", value
                assert self.directory_endpoints, "no directory replica to register in"
                return self.directory_endpoints[self._count % len(self.directory_endpoints)]
            return self.rewrite(name, value)

        command = local_command(
            spec,
            container,
            entrypoint=self.entrypoint,
            secrets=self.secrets,
            field_refs={"status.podIP": "127.0.0.1"},
            volumes_dir=where / "volumes",
            rewrite=rewrite,
        )
        return command, health_port

    def run_job(self) -> tuple[int, str]:
        """Run the migration Job's container to completion: (exit status, log)."""
        (job,) = of_kind(self.manifests, "Job")
        where = self.root / "migrations"
        command, _ = self._command("migrations", job, where)
        process = start_local(command, cwd=where)
        _, stderr = process.communicate(timeout=120)
        return process.returncode, stderr

    def start_many(self, components: Sequence[str]) -> list[RunningService]:
        """Start replicas of several components at once (the start-ups overlap); directory
        replicas listed first get their ports before the others start."""
        deployments = by_component(self.manifests, "Deployment")
        started = []
        for component in components:
            self._count += 1
            where = self.root / f"{component}-{self._count}"
            command, health_port = self._command(component, deployments[component], where)
            service = RunningService(start_local(command, cwd=where), where / "log")
            assert health_port is not None, f"{component} serves no health port"
            self.health_ports[service] = health_port
            self.running.append(service)
            started.append(service)
        for service in started:
            service.wait_serving(60)
        return started

    def start_console(self, endpoints: dict[str, str]) -> RunningService:
        """A console replica, reading the services at `endpoints` (by variable name) instead of
        their Services' DNS names."""
        self._count += 1
        where = self.root / f"console-{self._count}"

        def rewrite(name: str, value: str) -> str:
            if name == "COGMENT_CONSOLE_HOST":
                return "127.0.0.1"
            if name == "COGMENT_CONSOLE_PORT":
                return str(reserve_port(self._taken_ports))
            if name in endpoints:
                assert value.endswith(f".{NAMESPACE}.svc.cluster.local:{value.rsplit(':', 1)[1]}"), value
                return endpoints[name]
            return self.rewrite(name, value)

        command = local_command(
            pod_spec(by_component(self.manifests, "Deployment")["console"]),
            self.container("console"),
            entrypoint=self.entrypoint,
            secrets=self.secrets,
            field_refs={},
            volumes_dir=where / "volumes",
            rewrite=rewrite,
        )
        service = RunningService(start_local(command, cwd=where), where / "log")
        self.running.append(service)
        service.wait_serving(60)
        return service

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


def kubelet_probe(release: LocalRelease, component: str, replica: RunningService, kind: str) -> bool:
    """Run the container's probe as kubelet would: a native gRPC probe, in plaintext, of the
    container's `health` port (here: the replica's own health port)."""
    container = release.container(component)
    probe = container[kind]
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert probe["grpc"]["port"] == ports["health"] != ports["grpc"], probe
    with grpc.insecure_channel(f"127.0.0.1:{release.health_ports[replica]}") as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=probe["grpc"].get("service", "")),
            timeout=probe.get("timeoutSeconds", 1),
        )
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def console_get(console: RunningService, path: str, token: str | None = CONSOLE_TOKEN) -> tuple[int, str]:
    """(status, body) of GET `path`, with the access token as a bearer token (None: without)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    request = urllib.request.Request(f"http://127.0.0.1:{console.port}{path}", headers=headers)
    try:
        with opener.open(request, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def http_probe(release: LocalRelease, console: RunningService, kind: str) -> bool:
    """The console container's probe as kubelet runs it: GET of its path on its named port."""
    container = release.container("console")
    probe = container[kind]["httpGet"]
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert probe["port"] in ports, probe
    status, body = console_get(console, probe["path"], token=None)  # kubelet has no token
    return status == 200 and body == "ok\n"


def registered(
    channel: grpc.Channel, service_type: directory_pb2.ServiceType.ValueType
) -> list[tuple[str, int, int]]:
    """(host, port, protocol) of the entries of `service_type` the directory answers with."""
    request = directory_pb2.InquireRequest(details=directory_pb2.ServiceDetails(type=service_type))
    found = directory_pb2_grpc.DirectorySPStub(channel).Inquire(
        request, metadata=(("authentication-token", TOKEN),), timeout=10
    )
    return sorted((e.data.endpoint.host, e.data.endpoint.port, e.data.endpoint.protocol) for e in found)


def wait_registered(
    channel: grpc.Channel,
    expected: dict[directory_pb2.ServiceType.ValueType, list[tuple[str, int, int]]],
    timeout_s: float = 30,
) -> None:
    for service_type, entries in expected.items():
        wait_until(
            lambda: registered(channel, service_type) == entries,  # noqa: B023 (called within the loop)
            f"the {directory_pb2.ServiceType.Name(service_type)} entries {entries}",
            timeout_s,
            interval_s=0.1,
        )


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


def trials_through_discovery(
    directory: grpc.Channel, credentials: grpc.ChannelCredentials, trials: int
) -> list[int]:
    """Run `trials` short trials as the orchestrator does: each one inquires the directory for the
    datalog service and logs to the first endpoint it is given. Returns the ports used."""
    request = directory_pb2.InquireRequest(
        details=directory_pb2.ServiceDetails(type=directory_pb2.DATALOG_SERVICE)
    )
    ports = []
    for _trial in range(trials):
        answer = directory_pb2_grpc.DirectorySPStub(directory).Inquire(
            request, metadata=(("authentication-token", TOKEN),), timeout=10
        )
        first = next(answer).data.endpoint
        answer.cancel()
        ports.append(first.port)
        with grpc.secure_channel(f"127.0.0.1:{first.port}", credentials) as channel:
            acks = list(
                datalog_pb2_grpc.DatalogSPStub(channel).RunTrialDatalog(
                    iter(datalog_inputs(trial_params(), full_trial(3))),
                    metadata=(("trial-id", f"spread-{secrets.token_hex(4)}"), ("user-id", "tester")),
                    timeout=30,
                )
            )
        assert len(acks) == 4
    return ports


# ---- the tests ----

GRPC, GRPC_SSL = int(directory_pb2.ServiceEndpoint.GRPC), int(directory_pb2.ServiceEndpoint.GRPC_SSL)


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
    for name, replicas in by_name.items():
        for service in replicas:
            # kubelet's native gRPC probes, in plaintext, on the health port...
            assert kubelet_probe(release, name, service, "readinessProbe")
            assert kubelet_probe(release, name, service, "livenessProbe")
            assert kubelet_probe(release, name, service, "startupProbe")
            (serving,) = service.events("serving")
            assert serving["tls"] is True and serving["mtls"] is True
            # ...while the gRPC port speaks TLS only.
            with grpc.insecure_channel(service.address) as plaintext, pytest.raises(grpc.RpcError):
                health_pb2_grpc.HealthStub(plaintext).Check(health_pb2.HealthCheckRequest(), timeout=5)

    # Each replica of the registry and the datastore registered itself in the directory, over
    # mTLS, as its Service's DNS name (here this machine) and its own port, GRPC_SSL.
    registries, datastores = by_name["model-registry"], by_name["datastore"]
    expected = {
        directory_pb2.MODEL_REGISTRY_SERVICE: sorted(("127.0.0.1", r.port, GRPC_SSL) for r in registries),
        directory_pb2.DATASTORE_SERVICE: sorted(("127.0.0.1", d.port, GRPC_SSL) for d in datastores),
        directory_pb2.DATALOG_SERVICE: sorted(("127.0.0.1", d.port, GRPC_SSL) for d in datastores),
    }
    for directory in by_name["directory"]:  # whichever replica they reached, both answer
        with grpc.secure_channel(directory.address, credentials) as channel:
            wait_registered(channel, expected)
    for service, types in [(r, ["modelregistry"]) for r in registries] + [
        (d, ["datastore", "datalog"]) for d in datastores
    ]:
        assert sorted(str(e["type"]) for e in service.events("registered in the directory")) == sorted(types)

    # The chart turns the directory's load balancing on for several replicas: trials discovered
    # the orchestrator's way reach both datastores (20 trials on one: a 1 in 500,000 chance).
    with grpc.secure_channel(by_name["directory"][0].address, credentials) as channel:
        ports = trials_through_discovery(channel, credentials, 20)
    assert set(ports) == {datastore.port for datastore in datastores}, ports

    exercises = {
        "directory": exercise_directory,
        "model-registry": exercise_registry,
        "datastore": exercise_datastore,
    }
    for name, (a, b) in by_name.items():
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

    # The console's replicas read every service over mTLS (each from another replica), as the
    # chart wires them: its CA and client certificate, the directory token, its access token.
    consoles = [
        release.start_console(
            {
                "COGMENT_DIRECTORY_ENDPOINT": f"grpcs://{by_name['directory'][i].address}",
                "COGMENT_MODEL_REGISTRY_ENDPOINT": f"grpcs://{registries[i].address}",
                "COGMENT_TRIAL_DATASTORE_ENDPOINT": f"grpcs://{datastores[i].address}",
            }
        )
        for i in range(2)
    ]
    for console in consoles:
        assert all(
            http_probe(release, console, kind) for kind in ("startupProbe", "livenessProbe", "readinessProbe")
        )
        assert console_get(console, "/", token=None)[0] == 401
        status, overview = console_get(console, "/")
        assert status == 200 and overview.count('class="up"') == 3, overview
        status, trials = console_get(console, "/trials")
        assert status == 200 and "scale-out-" in trials and "spread-" in trials
        status, model = console_get(console, "/models/pilot")
        assert status == 200 and model.count("<tr data-version=") == 2, model
        status, entries = console_get(console, "/directory")  # the registered replicas, by token
        assert status == 200 and entries.count("<tr data-entry=") == 6, entries
    # A page's stream left open (a model's new versions) does not hold a stop up for long.
    opened = threading.Event()

    def follow_versions() -> None:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        request = urllib.request.Request(
            f"http://127.0.0.1:{consoles[0].port}/api/models/pilot/events",
            headers={"Authorization": f"Bearer {CONSOLE_TOKEN}"},
        )
        try:
            with opener.open(request, timeout=60) as stream:
                opened.set()
                stream.read()
        except (OSError, http.client.HTTPException):
            pass  # cut by the stop, as expected

    reader = threading.Thread(target=follow_versions, daemon=True)
    reader.start()
    assert opened.wait(30)
    assert consoles[0].terminate(signal.SIGTERM, timeout_s=20) == 0
    reader.join(20)
    assert not reader.is_alive()
    assert consoles[1].terminate(signal.SIGTERM) == 0
    for console in consoles:
        release.running.remove(console)

    # A registry replica going away (SIGTERM) deregisters itself, over mTLS too.
    registries[0].stop()
    assert registries[0].process.returncode == 0
    with grpc.secure_channel(by_name["directory"][0].address, credentials) as channel:
        assert registered(channel, directory_pb2.MODEL_REGISTRY_SERVICE) == [
            ("127.0.0.1", registries[1].port, GRPC_SSL)
        ]
    assert release.stop() == [0] * 6  # graceful shutdown on SIGTERM


TOKEN_SECRET = {"directoryRegistration.authenticationToken.existingSecret": "cogment-aux-directory-token"}


@pytest.mark.parametrize(
    ("values_files", "set_values", "registry_replicas"),
    [
        ([], TOKEN_SECRET, 1),
        ([SCALE_OUT_VALUES], {"tls.enabled": "false"}, 2),
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
    TLS: each replica registers in the chart's directory in plaintext, and deregisters when it
    stops; the probes check the health port."""
    manifests = render(values_files, set_values, release=RELEASE, namespace=NAMESPACE)
    release = local_release(manifests, None)
    if of_kind(manifests, "Job"):
        code, log = release.run_job()
        assert code == 0, log
    (directory,) = release.start_many(["directory"])
    assert kubelet_probe(release, "directory", directory, "readinessProbe")
    names = ["model-registry"] * registry_replicas + ["datastore"]
    registries = release.start_many(names)
    for name, service in zip(names, registries, strict=True):
        assert kubelet_probe(release, name, service, "readinessProbe")
    if not values_files:  # SQLite: each service's file is on its data volume
        for where, database in [("directory-1", "directory.db"), ("model-registry-2", "model_registry.db"),
                                ("datastore-3", "datastore.db")]:  # fmt: skip
            assert (release.root / where / "volumes" / "data" / database).is_file()

    datastore = registries[-1]
    with grpc.insecure_channel(directory.address) as channel:
        wait_registered(
            channel,
            {
                directory_pb2.MODEL_REGISTRY_SERVICE: sorted(
                    ("127.0.0.1", r.port, GRPC) for r in registries[:-1]
                ),
                directory_pb2.DATASTORE_SERVICE: [("127.0.0.1", datastore.port, GRPC)],
                directory_pb2.DATALOG_SERVICE: [("127.0.0.1", datastore.port, GRPC)],
            },
        )
        # A replica going away (SIGTERM, as Kubernetes stops a pod) deregisters itself.
        registries[0].stop()
        assert registries[0].process.returncode == 0
        remaining = sorted(("127.0.0.1", r.port, GRPC) for r in registries[1:-1])
        assert registered(channel, directory_pb2.MODEL_REGISTRY_SERVICE) == remaining
    assert release.stop() == [0] * (2 + registry_replicas)
