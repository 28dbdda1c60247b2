"""The image, built from the Dockerfile as it is, and the Helm chart's containers run from it.

buildah builds the Dockerfile on a STAND-IN for python:3.11-slim (Debian's Python 3.11: there is no
image registry here; see tests/helpers/image.py). podman then runs what the chart renders, one
replica of each Deployment and the migration Job, from that image: the chart's command and
arguments, environment, user and groups, security context (read-only root, writable /data and
/tmp only), memory and CPU limits and volumes (host directories). Only what differs on one
machine changes: the containers share the host's network, so each service listens on 127.0.0.1
and ports of its own, the directory's Service is its container, the S3 server is SeaweedFS in
plain HTTP with a bucket of the test's, and the Secrets hold the test's database URL and keys.
Against those containers runs the official SDK's suite: the tests of
tests/{directory,model_registry,datastore}/test_sdk_interop.py themselves, on what the SDK 2.10.1
scripts of tests/interop report; with the default values (SQLite files on the data volumes) and
with ci/postgresql-s3-values.yaml (PostgreSQL and S3, the migration Job first).

The image also runs as `docker run` users run it: `services all` on its empty /data volume, with
its own defaults, in a network of its own, and `migrate` on an SQLite file. This is the wheel
built from the repository (the builder stage's `pip wheel .`), installed in a fresh virtual
environment, serving every service from an empty working directory and migrating a database.

Skipped only when podman or buildah is missing (.ci/run installs them).
"""

from __future__ import annotations

import asyncio
import base64
import importlib.metadata
import inspect
import json
import os
import secrets
import sqlite3
import types
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from alembic.script import ScriptDirectory
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shared.api import datalog_pb2_grpc, directory_pb2, trial_datastore_pb2_grpc
from shared.db import MIGRATIONS_DIR
from tests.datastore import test_sdk_interop as datastore_suite
from tests.directory import test_sdk_interop as directory_suite
from tests.fixtures.seaweedfs import SeaweedS3, new_bucket_name
from tests.helpers.eventually import wait_until
from tests.helpers.helm import (
    POSTGRESQL_S3_VALUES,
    PROJECT_ROOT,
    Manifest,
    by_component,
    container_env,
    env_of,
    of_kind,
    pod_spec,
    render,
    reserve_port,
)
from tests.helpers.image import (
    IMAGE_REPOSITORY,
    Container,
    Podman,
    build_image,
    chart_container_options,
    missing_tools,
    run_container,
    stand_in_python_image,
)
from tests.helpers.running import RunningDatastore
from tests.helpers.sdk import run_sdk_script
from tests.helpers.services import directory_entries
from tests.model_registry import test_sdk_interop as registry_suite

MISSING = missing_tools()
pytestmark = [
    pytest.mark.skipif(
        bool(MISSING),
        reason=f"needs {' and '.join(MISSING)} to build and run the image "
        "(apt-get install podman buildah runc mmdebstrap, as .ci/run does)",
    ),
    pytest.mark.timeout(900),
]

RELEASE, NAMESPACE = "cogment", "cogment"
DIRECTORY_SERVICE_URL = f"grpc://{RELEASE}-cogment-aux-directory.{NAMESPACE}.svc.cluster.local:9005"
SERVICE_ENDPOINTS = {
    "COGMENT_MODEL_REGISTRY_ENDPOINT": "model-registry",
    "COGMENT_TRIAL_DATASTORE_ENDPOINT": "datastore",
}
ENV_PREFIXES = ("COGMENT_DIRECTORY", "COGMENT_MODEL_REGISTRY", "COGMENT_TRIAL_DATASTORE")
SERVICE_PORTS = {"directory": 9005, "model_registry": 9002, "trial_datastore": 9003}
SITE_PACKAGES = "/opt/venv/lib/python3.11/site-packages"


@pytest.fixture(scope="module")
def podman(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Podman]:
    engine = Podman(tmp_path_factory.mktemp("podman"))
    try:
        yield engine
    finally:
        engine.close()


@pytest.fixture(scope="module")
def image(podman: Podman) -> str:
    """The image built from the repository's tree, removed at the end (the stand-in is kept)."""
    tag = f"{IMAGE_REPOSITORY}:{os.getpid()}-{secrets.token_hex(4)}"
    build_image(podman, tag, stand_in_python_image(podman))
    return tag


# ---- the image as users run it ----

CONTENTS = """
import importlib.metadata, json, os, pathlib, shutil, shared
dist = importlib.metadata.distribution("cogment-aux")
versions = pathlib.Path(shared.__file__).parent / "migrations" / "versions"
print(json.dumps({
    "package": shared.__file__,
    "version": dist.version,
    "installer": dist.read_text("INSTALLER").strip(),
    "direct_url": json.loads(dist.read_text("direct_url.json")),
    "migrations": sorted(path.name for path in versions.glob("*.py")),
    "beside": os.path.exists(os.path.join(os.path.dirname(os.path.dirname(shared.__file__)), "migrations")),
    "source_tree": os.path.exists("/src"),
    "command": shutil.which("cogment-aux"),
}))
"""


def test_the_image_holds_the_repositorys_wheel_and_runs_cogment_aux(podman: Podman, image: str) -> None:
    config = podman.inspect_image(image)["Config"]
    assert (config["Entrypoint"], config["Cmd"]) == (["cogment-aux"], ["services", "directory"])
    assert config["User"] == "10001:10001" and config["WorkingDir"] == "/data"
    assert "/data" in config["Volumes"]
    env = dict(item.split("=", 1) for item in config["Env"])
    # The services' own default is 127.0.0.1, which nothing outside a container reaches.
    assert {prefix: env[f"{prefix}_BIND_ADDRESS"] for prefix in ENV_PREFIXES} == dict.fromkeys(
        ENV_PREFIXES, "0.0.0.0"
    )
    assert env["COGMENT_LOG_FORMAT"] == "json"

    options = ["--network", "none", "--read-only", "--read-only-tmpfs=false", "--entrypoint", "python"]
    inside = run_container(podman, "contents", [*options, image, "-c", CONTENTS])
    assert inside.wait(60) == 0, inside.logs()
    contents = json.loads(inside.output())
    # The wheel, installed by pip into the virtual environment: not the source tree, not editable.
    assert contents["package"] == f"{SITE_PACKAGES}/shared/__init__.py"
    assert contents["version"] == importlib.metadata.version("cogment-aux")
    assert contents["installer"] == "pip"
    assert contents["direct_url"]["url"].endswith(f"cogment_aux-{contents['version']}-py3-none-any.whl")
    assert "dir_info" not in contents["direct_url"]
    assert contents["command"] == "/opt/venv/bin/cogment-aux"
    # The alembic history travels inside the package, and only there.
    assert contents["migrations"] == sorted(
        path.name for path in (PROJECT_ROOT / "migrations/versions").glob("*.py")
    )
    assert contents["beside"] is False and contents["source_tree"] is False


PROBE = """
import json, socket, grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
health = {}
for port in %s:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        grpc.channel_ready_future(channel).result(timeout=60)
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        health[port] = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
listening = []
for table in ("/proc/net/tcp", "/proc/net/tcp6"):
    for line in open(table).read().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        if state == "0A":  # LISTEN
            address, port = local.split(":")
            family = socket.AF_INET6 if len(address) == 32 else socket.AF_INET
            listening.append([socket.inet_ntop(family, bytes.fromhex(address)[::-1]), int(port, 16)])
print(json.dumps({"health": health, "listening": listening}))
"""
# Every interface: grpc listens on [::] (IPv4 too) when asked for 0.0.0.0 and IPv6 is there.
ANY_ADDRESS = ("0.0.0.0", "::")


def test_the_image_serves_every_service_from_an_empty_volume_and_migrates(
    podman: Podman, image: str, tmp_path: Path
) -> None:
    """`services all` with the image's defaults, in a network of its own: its ports as the README
    says, on every interface, its state on the /data volume (an empty one, as podman makes it
    from the image); then `migrate` of an SQLite file to the latest revision."""
    locked = [
        "--read-only",
        "--read-only-tmpfs=false",
        "--cap-drop",
        "ALL",
        "--security-opt",
        "no-new-privileges",
    ]
    services = run_container(podman, "all", ["--network", "none", *locked, image, "services", "all"])
    ports = sorted(SERVICE_PORTS.values())
    probe = services.exec("python", "-c", PROBE % ports, timeout=120)
    assert probe.returncode == 0, probe.stderr + services.logs()
    report = json.loads(probe.stdout)
    assert report["health"] == {str(port): "SERVING" for port in ports}
    assert sorted(port for address, port in report["listening"] if address in ANY_ADDRESS) == ports
    volume = services.mount_source("/data")  # the anonymous volume podman made from the image's /data
    assert services.stop(30) == 0, services.logs()
    serving = [e for e in services.events() if e.get("event") == "serving"]
    grpc_serving = [e for e in serving if e["service"] != "console"]
    assert sorted((e["address"], e["port"]) for e in grpc_serving) == [("0.0.0.0", port) for port in ports]
    # The web console serves the loopback only, unless given an access token: not published.
    assert [(e["address"], e["port"]) for e in serving if e["service"] == "console"] == [("127.0.0.1", 9010)]
    files = {path.name: path.stat().st_uid for path in volume.iterdir()}
    assert {"directory.db", "directory.key", "model_registry.db", "datastore.db"} <= set(files), files
    assert set(files.values()) == {10001}

    data = tmp_path / "data"
    data.mkdir()
    os.chown(data, 10001, 10001)
    url = "sqlite+aiosqlite:////data/migrated.db"
    migrate = run_container(
        podman, "migrate", ["--network", "none", *locked, "--volume", f"{data}:/data", image, "migrate",
                            "--database_url", url],
    )  # fmt: skip
    assert migrate.wait(120) == 0, migrate.logs()
    head = ScriptDirectory(str(MIGRATIONS_DIR)).get_current_head()
    (done,) = [e for e in migrate.events() if e.get("event") == "schema up to date"]
    assert done["revision"] == head
    with sqlite3.connect(data / "migrated.db") as database:
        assert database.execute("SELECT version_num FROM alembic_version").fetchall() == [(head,)]


# ---- the chart's containers ----


def rendered_secrets(manifests: list[Manifest]) -> dict[str, dict[str, str]]:
    """The Secrets the chart makes itself (the directory's key, the console's token), decoded."""
    return {
        secret["metadata"]["name"]: {
            key: base64.b64decode(value).decode() for key, value in secret["data"].items()
        }
        for secret in of_kind(manifests, "Secret")
    }


class ContainerRelease:
    """A rendered release's workloads as containers of the image, on the host's network."""

    def __init__(
        self,
        podman: Podman,
        manifests: list[Manifest],
        root: Path,
        secrets: Mapping[str, Mapping[str, str]],
        image: str,
        s3: SeaweedS3 | None,
    ) -> None:
        self.podman = podman
        self.manifests = manifests
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.secrets = secrets
        self.image = image
        self.taken: set[int] = set()
        self.ports: dict[str, int] = {}
        self.health_ports: dict[str, int] = {}
        self.containers: dict[str, Container] = {}
        self.s3 = s3
        self.bucket = new_bucket_name()

    def rewrite(self, component: str, name: str, value: str) -> str:
        """What differs between a pod and a container on this host's network."""
        if name.endswith("_BIND_ADDRESS") or name == "COGMENT_CONSOLE_HOST":
            return "127.0.0.1"  # the host's network: keep the services off its other interfaces
        if name.endswith("_HEALTH_PORT"):
            self.health_ports[component] = reserve_port(self.taken)
            return str(self.health_ports[component])
        if name.endswith("_METRICS_PORT"):
            return str(reserve_port(self.taken))
        if name.endswith("_PORT"):
            self.ports[component] = reserve_port(self.taken)
            return str(self.ports[component])
        if name == "COGMENT_DIRECTORY_ENDPOINT":
            assert value == DIRECTORY_SERVICE_URL, value
            return f"grpc://127.0.0.1:{self.ports['directory']}"
        if name in SERVICE_ENDPOINTS:  # the console reads the release's services by name
            served = SERVICE_ENDPOINTS[name]
            assert (
                value == f"grpc://{RELEASE}-cogment-aux-{served}.{NAMESPACE}.svc.cluster.local:{value[-4:]}"
            )
            return f"grpc://127.0.0.1:{self.ports[served]}"
        if self.s3 is not None and name.endswith("_S3_ENDPOINT"):
            return self.s3.endpoint
        if name.endswith("_S3_SECURE"):
            return "false"  # SeaweedFS here speaks plain HTTP
        if name.endswith("_S3_BUCKET"):
            return self.bucket
        return value

    def _run(self, component: str, workload: Manifest) -> Container:
        spec = pod_spec(workload)
        (container,) = spec["containers"]
        assert container["image"] == self.image  # what the chart names is what runs
        env = container_env(container, secrets=self.secrets, field_refs={"status.podIP": "127.0.0.1"})
        options = chart_container_options(
            spec,
            container,
            env={name: self.rewrite(component, name, value) for name, value in env.items()},
            volumes_dir=self.root / component / "volumes",
            secrets=self.secrets,
        )
        running = run_container(self.podman, component, [*options, self.image, *container.get("args", [])])
        self.containers[component] = running
        return running

    def run_job(self) -> Container:
        (job,) = of_kind(self.manifests, "Job")
        return self._run("migrations", job)

    def start(self, component: str) -> Container:
        """Start the component's container and wait for its startup probe, as kubelet runs it."""
        deployment = by_component(self.manifests, "Deployment")[component]
        running = self._run(component, deployment)
        probe = pod_spec(deployment)["containers"][0]["startupProbe"]
        deadline_s = probe["periodSeconds"] * probe["failureThreshold"]

        def serving() -> bool:
            assert running.running(), f"{component} ended:\n{running.logs()}"
            if "httpGet" in probe:  # the console
                return http_get(self.ports[component], probe["httpGet"]["path"])[0] == 200
            return probe_serving(self.health_ports[component], probe["grpc"].get("service", ""))

        wait_until(serving, f"{component}'s startup probe", deadline_s, interval_s=0.5)
        return running

    def save_logs(self) -> None:
        for component, container in self.containers.items():
            (self.root / f"{component}.log").write_text(container.logs())

    def remove(self) -> None:
        for container in self.containers.values():
            self.podman.remove(container.name)


def http_get(port: int, path: str, token: str | None = None) -> tuple[int, str]:
    """(status, body) of GET http://127.0.0.1:port/path; (0, why) when nothing answers."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(
            urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers=headers), timeout=10
        ) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()
    except OSError as error:
        return 0, str(error)


def probe_serving(port: int, service: str) -> bool:
    """A kubelet gRPC probe: grpc.health.v1 Check in plaintext."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=2
            )
        except grpc.RpcError:
            return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


@pytest.fixture
def container_release(podman: Podman, tmp_path: Path) -> Iterator[Callable[..., ContainerRelease]]:
    made: list[ContainerRelease] = []

    def make(
        manifests: list[Manifest], secrets: Mapping[str, Mapping[str, str]], image: str, s3: SeaweedS3 | None
    ) -> ContainerRelease:
        release = ContainerRelease(podman, manifests, tmp_path / "release", secrets, image, s3)
        made.append(release)
        return release

    yield make
    for release in made:  # the logs are kept beside the test's files
        try:
            release.save_logs()
        finally:
            release.remove()


# ---- the official SDK's suite ----


def _cases(function: Callable[..., Any]) -> list[dict[str, Any]]:
    """The argument sets of a test function's parametrize marks (one empty set without any)."""
    cases: list[dict[str, Any]] = [{}]
    for mark in getattr(function, "pytestmark", []):
        if mark.name != "parametrize":
            continue
        names, values = mark.args[0], mark.args[1]
        names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
        rows = [getattr(value, "values", value) for value in values]  # pytest.param(...) or plain
        rows = [row if len(names) > 1 else (row,) for row in rows]
        cases = [{**case, **dict(zip(names, row, strict=True))} for case in cases for row in rows]
    return cases


def run_suite(module: types.ModuleType, provided: Mapping[str, Any]) -> int:
    """Call every test function of `module` with each of its parametrized cases, `provided` as its
    fixtures (a test needing another one fails this); report every failure at once. Returns the
    number of cases run."""
    failures, ran = [], 0
    for name, function in vars(module).items():
        if not (name.startswith("test_") and inspect.isfunction(function)):
            continue
        # Called without an event loop: a coroutine would be created, never run, and count as passed.
        assert not inspect.iscoroutinefunction(function), f"{module.__name__}.{name} is async"
        parameters = inspect.signature(function).parameters
        for case in _cases(function):
            arguments = {**provided, **case}
            missing = [parameter for parameter in parameters if parameter not in arguments]
            assert not missing, f"{module.__name__}.{name} needs {missing}"
            try:
                function(**{parameter: arguments[parameter] for parameter in parameters})
            except (AssertionError, pytest.fail.Exception) as error:
                failures.append(f"{module.__name__}.{name}{case or ''}: {error}")
            ran += 1
    assert not failures, "\n\n".join(failures)
    return ran


@dataclass
class Served:
    """What the suites read of a service they did not start."""

    endpoint: str
    log_path: Path


# Those of the datastore's suite that can share one datastore (the others each want a fresh one),
# in this order: the first lists every trial there is.
DATASTORE_SUITE = (
    "test_sdk_lists_trials_with_users_states_counts_and_params",
    "test_sdk_reads_every_sample_of_finished_trials_in_order",
    "test_sdk_reads_a_trial_live_until_its_ended_sample",
)


async def run_datastore_suite(port: int, sdk_python: Path, workdir: Path) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        datastore = RunningDatastore(
            service=types.SimpleNamespace(port=port),  # the suite reads only its port
            channel=channel,
            stub=trial_datastore_pb2_grpc.TrialDatastoreSPStub(channel),
            datalog=datalog_pb2_grpc.DatalogSPStub(channel),
            log_exporter=datalog_pb2_grpc.LogExporterSPStub(channel),
        )
        for name in DATASTORE_SUITE:
            (workdir / name).mkdir(parents=True)
            await getattr(datastore_suite, name)(datastore, sdk_python, workdir / name)


@pytest.mark.parametrize("values", ["sqlite", "postgresql-s3"])
def test_the_chart_containers_pass_the_sdk_suite(
    values: str,
    image: str,
    sdk_python: Path,
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
    container_release: Callable[..., ContainerRelease],
    request: pytest.FixtureRequest,
) -> None:
    repository, _, tag = image.rpartition(":")
    # One replica of each Deployment runs here: rendered as such, the directory answers in the
    # order the suite expects (with replicas, the chart turns its load balancing on, and that
    # shuffles answers; tests/deploy/test_scale_out.py runs replicas).
    chart_values = {"image.repository": repository, "image.tag": tag}
    chart_values |= {f"{key}.replicaCount": "1" for key in ("directory", "modelRegistry", "datastore")}
    external: dict[str, dict[str, str]] = {}
    s3: SeaweedS3 | None = None
    if values == "postgresql-s3":
        s3 = request.getfixturevalue("seaweed_s3")
        external = {
            "cogment-aux-database": {"database-url": request.getfixturevalue("postgres_url")},
            "cogment-aux-s3": {"access-key": s3.access_key, "secret-key": s3.secret_key},
        }
    manifests = render(
        [POSTGRESQL_S3_VALUES] if s3 else [], chart_values, release=RELEASE, namespace=NAMESPACE
    )
    deployments = by_component(manifests, "Deployment")
    directory_env = env_of(pod_spec(deployments["directory"])["containers"][0])
    # The suite's "default" directory: neither checks on inquiry nor load balancing.
    assert directory_env["COGMENT_DIRECTORY_CHECK_ON_INQUIRE"]["value"] == "false"
    assert directory_env["COGMENT_DIRECTORY_LOAD_BALANCING"]["value"] == "false"
    release = container_release(manifests, {**rendered_secrets(manifests), **external}, image, s3)

    if s3 is not None:  # the migration Job, to its end, before any service
        job = release.run_job()
        assert job.wait(300) == 0, job.logs()
        assert [e for e in job.events() if e.get("event") == "schema up to date"], job.logs()
    for component in ("directory", "model-registry", "datastore"):  # the directory's port first
        release.start(component)

    # The registry and the datastore registered in the chart's directory, each with its pod's IP.
    directory_address = f"127.0.0.1:{release.ports['directory']}"
    expected = {
        directory_pb2.MODEL_REGISTRY_SERVICE: [("127.0.0.1", release.ports["model-registry"])],
        directory_pb2.DATASTORE_SERVICE: [("127.0.0.1", release.ports["datastore"])],
        directory_pb2.DATALOG_SERVICE: [("127.0.0.1", release.ports["datastore"])],
    }

    def registered() -> bool:
        return {
            kind: [(e.endpoint.host, e.endpoint.port) for e in directory_entries(directory_address, kind)]
            for kind in expected
        } == expected

    wait_until(registered, "registration in the chart's directory", 30, interval_s=0.2)

    # The official SDK's suites, as their own modules assert them (the logs are saved at the end).
    logs = {component: release.root / f"{component}.log" for component in release.containers}
    report = run_sdk_script(
        sdk_python,
        directory_suite.SCRIPT,
        [f"grpc://{directory_address}", "all"],
        tmp_path_factory.mktemp("sdk-directory"),
        directory_suite.SCRIPT_TIMEOUT,
    )
    report["_directory_log"] = str(logs["directory"])
    assert run_suite(directory_suite, {"sdk_report": report, "directory_config": "default"}) > 10

    served_registry = Served(f"grpc://127.0.0.1:{release.ports['model-registry']}", logs["model-registry"])
    report = registry_suite._run_script(
        sdk_python, served_registry, "main", tmp_path_factory.mktemp("sdk-registry")
    )
    provided = {"sdk_report": report, "sdk_python": sdk_python, "registry_service": served_registry,
                "tmp_path_factory": tmp_path_factory}  # fmt: skip
    assert run_suite(registry_suite, provided) > 10

    asyncio.run(run_datastore_suite(release.ports["datastore"], sdk_python, tmp_path / "sdk-datastore"))

    # The web console from the same image (read-only root, the pod's user): it reads the three
    # services by their Services' names, behind the token the chart generated.
    release.start("console")
    token = rendered_secrets(manifests)[f"{RELEASE}-cogment-aux-console-token"]["token"]
    console_port = release.ports["console"]
    assert http_get(console_port, "/")[0] == 401
    status, overview = http_get(console_port, "/", token)
    assert status == 200 and overview.count('class="up"') == 3, overview
    status, trials = http_get(console_port, "/trials", token)
    assert status == 200 and "<tr data-trial=" in trials, trials
    assert http_get(console_port, "/static/vendor/plotly.min.js", token)[0] == 200
    assert (
        release.containers["console"].stop(pod_spec(deployments["console"])["terminationGracePeriodSeconds"])
        == 0
    )

    # SIGTERM, as Kubernetes stops a pod: the registry and the datastore deregister, every one
    # ends with status 0 within its grace period.
    for component in ("datastore", "model-registry", "directory"):
        if component == "directory":
            assert not any(directory_entries(directory_address, kind) for kind in expected)
        grace = pod_spec(deployments[component])["terminationGracePeriodSeconds"]
        container = release.containers[component]
        assert container.stop(grace) == 0, container.logs()
    for component in ("directory", "model-registry", "datastore", "console"):
        container = release.containers[component]
        (serving,) = [e for e in container.events() if e.get("event") == "serving"]  # JSON lines only
        assert serving["port"] == release.ports[component]
    if s3 is None:  # each service's SQLite file on its data volume, written as the pod's user
        for component, database in [("directory", "directory.db"), ("model-registry", "model_registry.db"),
                                    ("datastore", "datastore.db")]:  # fmt: skip
            path = release.root / component / "volumes" / "data" / database
            assert path.stat().st_uid == 10001, path
