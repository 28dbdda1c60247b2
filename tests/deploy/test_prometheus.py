"""The shipped dashboards and alerts against a real Prometheus (Debian's package) scraping the
three services on 127.0.0.1, as the chart's ServiceMonitors would (a job per Service, the
release's namespace), after a short workload: trials through the datalog (one interrupted, one
on a replica killed mid-trial, one through a PostgreSQL outage), a reader, uploads (one refused),
downloads through the hot-version cache, a VersionUpdate follower, an S3 outage, registrations,
inquiries and health checks.

Then every query of every panel of every dashboard in the chart returns data to draw; the
counters agree with the work done; and the chart's alert rules, loaded by this Prometheus,
evaluate without error, the refused upload firing CogmentUploadsRefused.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import secrets
import signal
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from services.datastore.client.api import DatastoreClient
from services.directory.client.api import DirectoryClient
from services.model_registry.client.api import ModelRegistryClient
from shared.api import common_pb2, datalog_pb2, datalog_pb2_grpc, directory_pb2, model_registry_pb2_grpc
from shared.api import model_registry_pb2 as mr
from shared.client import ClientError
from tests.fixtures.postgres import PostgresCluster
from tests.fixtures.seaweedfs import SeaweedS3, new_bucket_name
from tests.helpers.datastore import datalog_inputs, datalog_sample, send_acknowledged, trial_params
from tests.helpers.digest import sha256_b64
from tests.helpers.eventually import eventually
from tests.helpers.fake_services import free_port
from tests.helpers.helm import CHART_DIR, of_kind, render
from tests.helpers.metrics import metrics_text
from tests.helpers.prometheus import Prometheus, finite_values
from tests.helpers.services import RunningService, start_service

pytestmark = pytest.mark.timeout(420)

NAMESPACE = "cogment"
# The chart's Service names for the release "cogment": the jobs its ServiceMonitors create.
JOBS = {
    "directory": "cogment-cogment-aux-directory",
    "model_registry": "cogment-cogment-aux-model-registry",
    "datastore": "cogment-cogment-aux-datastore",
}
# What the dashboards' variables and Grafana's macros stand for in the queries sent here.
RATE_INTERVAL = "10s"
WAIT_S = 60.0
TICKS = 20
VERSION_BYTES = 1024 * 1024
VERSIONS = 5
CHUNK = 256 * 1024

DATASTORE_DETAILS = directory_pb2.ServiceDetails(type=directory_pb2.DATASTORE_SERVICE)

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(service: RunningService) -> Samples:
    """The service's own /metrics, read directly."""
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(metrics_text(service))
        for sample in family.samples
    }


async def until(condition: Any, what: str, timeout_s: float = WAIT_S) -> None:
    """`condition` (blocking: run in a thread) until it holds."""
    await eventually(lambda: asyncio.to_thread(condition), what, timeout_s, interval_s=0.2)


def metrics_target(service: RunningService) -> str:
    metrics_text(service)  # once it serves them
    [serving] = service.events("serving metrics")
    return f"127.0.0.1:{serving['port']}"


def dependency_up(service: RunningService, name: str, dependency: str) -> float:
    return scrape(service).get(
        ("cogment_dependency_up", frozenset({("cogment_service", name), ("dependency", dependency)})), -1
    )


class Work:
    """What the workload did, to compare with what the metrics say."""

    def __init__(self) -> None:
        self.samples = 0
        self.trials_started = 0
        self.trials_ended = 0
        self.received_bytes = 0
        self.sent_bytes = 0
        self.versions = 0
        self.registrations = 0


@asynccontextmanager
async def datalog(address: str, trial_id: str) -> AsyncIterator[Any]:
    async with grpc.aio.insecure_channel(address) as channel:
        call = datalog_pb2_grpc.DatalogSPStub(channel).RunTrialDatalog(
            metadata=(("trial-id", trial_id), ("user-id", "prometheus-test"))
        )
        yield call


def rewarded(tick: int, ticks: int) -> datalog_pb2.DatalogSample:
    state = common_pb2.ENDED if tick == ticks - 1 else common_pb2.RUNNING
    return datalog_sample(tick, state, reward=float(tick % 3))


async def run_trial(address: str, trial_id: str, ticks: int, work: Work, *, end: bool = True) -> None:
    """A trial through DatalogSP, each sample acknowledged; `end=False`: the stream closes before
    the trial's ENDED sample (it is then interrupted)."""
    samples = [rewarded(tick, ticks) for tick in range(ticks)]
    if not end:
        samples = samples[:-1]
    async with datalog(address, trial_id) as call:
        await send_acknowledged(call, datalog_inputs(trial_params(), samples))
        await call.done_writing()
        assert await call.read() is grpc.aio.EOF
    work.trials_started += 1
    work.trials_ended += end
    work.samples += len(samples)


async def directory_work(directory: RunningService, datastore: RunningService, work: Work) -> None:
    client = DirectoryClient(directory.endpoint)
    async with client:
        await register_and_inquire(client, datastore, work)


async def register_and_inquire(client: DirectoryClient, datastore: RunningService, work: Work) -> None:

    def entry(port: int, permanent: bool = False) -> directory_pb2.RegisterRequest:
        return directory_pb2.RegisterRequest(
            endpoint=directory_pb2.ServiceEndpoint(
                protocol=directory_pb2.ServiceEndpoint.GRPC, host="127.0.0.1", port=port
            ),
            details=DATASTORE_DETAILS,
            permanent=permanent,
        )

    datastore_port = int(datastore.address.rsplit(":", 1)[1])
    await client.register(entry(datastore_port))  # healthy
    await client.register(entry(free_port()))  # fails its checks, removed after 3
    temporary = await client.register(entry(datastore_port + 1, permanent=True))
    work.registrations += 3
    for _ in range(3):
        assert await client.inquire(directory_pb2.InquireRequest(details=DATASTORE_DETAILS))
    none = directory_pb2.ServiceDetails(type=directory_pb2.ENVIRONMENT_SERVICE)
    assert not await client.inquire(directory_pb2.InquireRequest(details=none))
    with pytest.raises((ClientError, grpc.aio.AioRpcError)):  # INVALID_ARGUMENT: an empty inquiry
        await client.inquire(directory_pb2.InquireRequest())
    await client.deregister(
        directory_pb2.DeregisterRequest(service_id=temporary.service_id, secret=temporary.secret)
    )


async def registry_work(
    registry: RunningService, client: ModelRegistryClient, work: Work
) -> asyncio.Task[list[int]]:
    """Versions (the last one transient), downloads through a cache of 4 versions (evicting),
    a refused upload; returns the task of a VersionUpdate follower, left open."""
    await client.create_model("policy")
    follower_ready = asyncio.Event()

    async def follow() -> list[int]:
        numbers = []
        async for info in client.follow_versions("policy"):
            follower_ready.set()
            numbers.append(info.version_number)
        return numbers

    datas = [secrets.token_bytes(VERSION_BYTES) for _ in range(VERSIONS)]
    for number, data in enumerate(datas, start=1):
        info = await client.publish_version("policy", data, archived=number != VERSIONS)
        assert info.version_number == number
        work.received_bytes += len(data)
        work.versions += 1
    follower = asyncio.create_task(follow())
    await asyncio.wait_for(follower_ready.wait(), WAIT_S)
    for number in (1, 1, 2, 3, 4, 5, 1):  # misses, a hit, evictions: 4 versions fit in memory
        _, data = await client.retrieve_version("policy", number)
        assert data == datas[number - 1]
        work.sent_bytes += VERSION_BYTES

    bad = secrets.token_bytes(CHUNK)
    header = mr.CreateVersionRequestChunk.Header(
        version_info=mr.ModelVersionInfo(
            model_id="policy", archived=True, data_size=len(bad), data_hash=sha256_b64(b"other data")
        )
    )

    async def messages() -> AsyncIterator[mr.CreateVersionRequestChunk]:
        yield mr.CreateVersionRequestChunk(header=header)
        yield mr.CreateVersionRequestChunk(body=mr.CreateVersionRequestChunk.Body(data_chunk=bad))

    async with grpc.aio.insecure_channel(registry.address) as channel:
        stub = model_registry_pb2_grpc.ModelRegistrySPStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.CreateVersion(messages(), timeout=WAIT_S)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    work.received_bytes += len(bad)
    return follower


async def outage_trial(
    datastore: RunningService, directory: RunningService, postgres: PostgresCluster, work: Work
) -> None:
    """A trial whose samples keep coming while PostgreSQL is down for a few seconds: the
    datastore holds them and commits them when it is back."""
    ticks = 40
    async with datalog(datastore.address, "through-outage") as call:
        inputs = datalog_inputs(trial_params(), [rewarded(tick, ticks) for tick in range(ticks)])
        await send_acknowledged(call, inputs[:10])
        await asyncio.to_thread(postgres.pause)
        try:
            sending = asyncio.create_task(send_acknowledged(call, inputs[10:]))
            await until(
                lambda: dependency_up(datastore, "trial_datastore", "database") == 0, "datastore down"
            )
            await until(lambda: dependency_up(directory, "directory", "database") == 0, "directory down")
            await asyncio.sleep(2)  # scraped while down
        finally:
            await asyncio.to_thread(postgres.resume)
        await asyncio.wait_for(sending, WAIT_S)
        await call.done_writing()
        assert await call.read() is grpc.aio.EOF
    work.trials_started += 1
    work.trials_ended += 1
    work.samples += ticks
    await until(lambda: dependency_up(directory, "directory", "database") == 1, "directory back")


async def killed_replica_trial(doomed: RunningService, survivor: RunningService, work: Work) -> None:
    """A replica killed while it ingests a trial: the survivor closes the trial once its lease
    expires (a lease closure)."""
    async with datalog(doomed.address, "on-a-killed-replica") as call:
        samples = [rewarded(tick, TICKS) for tick in range(10)]
        await send_acknowledged(call, datalog_inputs(trial_params(), samples))
        work.trials_started += 1
        work.samples += len(samples)
        await asyncio.sleep(2.5)  # scraped with its samples
        doomed.process.send_signal(signal.SIGKILL)
        await asyncio.to_thread(doomed.process.wait)
        call.cancel()
    closures: tuple[str, frozenset[tuple[str, str]]] = (
        "cogment_trial_datastore_lease_closures_total",
        frozenset(),
    )
    await until(lambda: scrape(survivor).get(closures, 0) == 1, "the survivor closes the trial")


async def steady_traffic(
    directory: RunningService,
    models: ModelRegistryClient,
    datastore: RunningService,
    work: Work,
    stop: asyncio.Event,
) -> None:
    """What clients keep doing while the rest of the workload runs (services are polled, the
    latest version fetched, trials listed and replayed), so that rates and latencies have
    changes between scrapes to show. Calls that fail during the outages are part of it."""
    async with (
        DirectoryClient(directory.endpoint, timeout_s=2) as inquirer,
        DatastoreClient(datastore.endpoint, timeout_s=2) as trials,
    ):
        while not stop.is_set():
            with contextlib.suppress(ClientError, grpc.aio.AioRpcError):
                await inquirer.inquire(directory_pb2.InquireRequest(details=DATASTORE_DETAILS))
            with contextlib.suppress(ClientError, grpc.aio.AioRpcError):
                await models.retrieve_version("policy", 1)
                work.sent_bytes += VERSION_BYTES
            with contextlib.suppress(ClientError, grpc.aio.AioRpcError):
                await trials.list_trials()
                async for _ in trials.samples({"trial-0": TICKS}):
                    pass
            await asyncio.sleep(0.5)


async def refused_datalog(datastore: RunningService) -> None:
    """A datalog stream without the trial-id metadata the orchestrator sends: INVALID_ARGUMENT."""
    async with grpc.aio.insecure_channel(datastore.address) as channel:
        call = datalog_pb2_grpc.DatalogSPStub(channel).RunTrialDatalog()
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await call.write(datalog_pb2.RunTrialDatalogInput(trial_params=trial_params()))
            await call.read()
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture
def rules(tmp_path: Path) -> Path:
    """The chart's alert rules for the release "cogment" in its namespace, as a rule file."""
    manifests = render(set_values={"metrics.enabled": "true", "metrics.prometheusRule.enabled": "true"})
    [rule] = of_kind(manifests, "PrometheusRule")
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    return path


def panel_queries() -> Iterator[tuple[str, str, str]]:
    """(dashboard, panel, expr) of every query of every panel of the chart's dashboards."""
    for path in sorted((CHART_DIR / "dashboards").glob("*.json")):
        board = json.loads(path.read_text())
        for panel in board["panels"]:
            for target in panel.get("targets", []):
                yield board["title"], panel["title"], target["expr"]


def job_variable_queries() -> Iterator[tuple[str, str]]:
    """(dashboard, series selector) of each dashboard's `job` variable (label_values(s, job))."""
    for path in sorted((CHART_DIR / "dashboards").glob("*.json")):
        board = json.loads(path.read_text())
        [job] = [v for v in board["templating"]["list"] if v["name"] == "job"]
        assert job["query"].startswith("label_values(") and job["query"].endswith(", job)")
        yield board["title"], job["query"].removeprefix("label_values(").removesuffix(", job)")


async def test_dashboards_and_alerts_against_a_real_prometheus(
    faulty_postgres: PostgresCluster, faulty_seaweed_s3: SeaweedS3, rules: Path, tmp_path: Path
) -> None:
    postgres, s3 = faulty_postgres, faulty_seaweed_s3
    work = Work()

    def start(module: str, *args: str) -> RunningService:
        return start_service(module, ["--metrics_port", "0", "--log_level", "info", *args], log_dir=tmp_path)

    async with AsyncExitStack() as stack:
        directory = stack.enter_context(
            await asyncio.to_thread(
                start,
                "services.directory",
                "--database_url", postgres.create_database(),
                "--health_check_interval", "1",
            )
        )  # fmt: skip
        registry = stack.enter_context(
            await asyncio.to_thread(
                start,
                "services.model_registry",
                "--database_url", postgres.create_database(),
                "--s3_endpoint", s3.endpoint, "--s3_bucket", new_bucket_name(),
                "--s3_access_key", s3.access_key, "--s3_secret_key", s3.secret_key, "--s3_secure", "false",
                "--data_cache_bytes", str(VERSION_BYTES * 4),
            )
        )  # fmt: skip
        datastore_url = postgres.create_database()
        # The doomed replica's lease is short, so that the survivor closes its trial soon after
        # the kill; the survivor rides the PostgreSQL outage out, which its lease must outlive.
        survivor = stack.enter_context(
            await asyncio.to_thread(
                start, "services.datastore", "--database_url", datastore_url,
                "--ingestion_lease", "30", "--outage_bound", "20",
            )
        )  # fmt: skip
        doomed = stack.enter_context(
            await asyncio.to_thread(
                start, "services.datastore", "--database_url", datastore_url,
                "--ingestion_lease", "1.5", "--outage_bound", "1",
            )
        )  # fmt: skip
        targets = {
            JOBS["directory"]: [directory],
            JOBS["model_registry"]: [registry],
            JOBS["datastore"]: [survivor, doomed],
        }
        (tmp_path / "prometheus").mkdir()
        prometheus = Prometheus(
            tmp_path / "prometheus",
            {job: ([metrics_target(service) for service in services], {"namespace": NAMESPACE})
             for job, services in targets.items()},
            [rules],
        )  # fmt: skip
        await asyncio.to_thread(prometheus.__enter__)
        stack.callback(prometheus.__exit__)
        models = await stack.enter_async_context(ModelRegistryClient(registry.endpoint))
        started = time.time()

        await directory_work(directory, survivor, work)
        follower = await registry_work(registry, models, work)
        for number in range(3):
            await run_trial(survivor.address, f"trial-{number}", TICKS, work)
        stop_traffic = asyncio.Event()
        traffic = asyncio.create_task(steady_traffic(directory, models, survivor, work, stop_traffic))
        await refused_datalog(survivor)
        await run_trial(survivor.address, "interrupted", TICKS, work, end=False)
        async with DatastoreClient(doomed.endpoint) as reader:
            assert len([sample async for sample in reader.samples({"trial-0": TICKS})]) == TICKS
        await killed_replica_trial(doomed, survivor, work)
        await outage_trial(survivor, directory, postgres, work)
        await asyncio.to_thread(s3.pause)
        try:
            await until(lambda: dependency_up(registry, "model_registry", "blob_store") == 0, "S3 down")
            await asyncio.sleep(2)
        finally:
            await asyncio.to_thread(s3.resume)
        await until(lambda: dependency_up(registry, "model_registry", "blob_store") == 1, "S3 back")
        removed: tuple[str, frozenset[tuple[str, str]]] = (
            "cogment_directory_removed_unhealthy_total",
            frozenset(),
        )
        await until(lambda: scrape(directory).get(removed, 0) == 1, "the failing entry removed")
        stop_traffic.set()
        await asyncio.wait_for(traffic, WAIT_S)
        await asyncio.sleep(3)  # the last changes scraped
        ended = time.time()

        missing = []
        for board, panel, expr in panel_queries():
            query = (
                expr.replace("$__rate_interval", RATE_INTERVAL)
                .replace("$__range", f"{math.ceil(ended - started) + 60}s")
                .replace('"$job"', '".+"')
            )
            values = await asyncio.to_thread(prometheus.query_range, query, started, ended)
            if not finite_values(values):
                missing.append(f"{board} / {panel}: {expr}")
        assert missing == [], "panels with nothing to draw:\n" + "\n".join(missing)
        for board, selector in job_variable_queries():
            jobs = await asyncio.to_thread(prometheus.api, "label/job/values", **{"match[]": selector})
            assert jobs and set(jobs) <= set(JOBS.values()), (board, jobs)

        def total(family: str, **labels: str) -> float:
            matchers = ", ".join(f'{key}="{value}"' for key, value in labels.items())
            return prometheus.query(f"sum(last_over_time({family}{{{matchers}}}[1h]))")

        figures = {
            "samples": total("cogment_trial_datastore_ingested_samples_total", api="datalog"),
            "trials_started": total("cogment_trial_datastore_trials_started_total"),
            "trials_ended": total("cogment_trial_datastore_trials_ended_total"),
            "received_bytes": total("cogment_model_registry_received_bytes_total"),
            "sent_bytes": total("cogment_model_registry_sent_bytes_total"),
            "versions": total("cogment_model_registry_versions_created_total"),
            "registrations": total("cogment_directory_registrations_total", outcome="created"),
        }
        assert figures == {name: float(getattr(work, name)) for name in figures}
        assert total("cogment_trial_datastore_trials_interrupted_total") == 1
        assert total("cogment_trial_datastore_lease_closures_total") == 1
        assert total("cogment_model_registry_refused_uploads_total", reason="hash") == 1
        assert total("cogment_trial_datastore_outage_held_batches_total") >= 1
        returns = total("cogment_trial_datastore_trial_return_bucket", le="+Inf")
        assert returns == work.trials_ended * len(trial_params().actors)  # one per actor of an ended trial

        groups = (await asyncio.to_thread(prometheus.api, "rules"))["groups"]
        states = {
            rule["name"]: (rule["health"], rule["state"]) for group in groups for rule in group["rules"]
        }
        assert all(health == "ok" for health, _ in states.values()), states
        assert states["CogmentUploadsRefused"][1] == "firing"
        assert states["CogmentInternalErrors"][1] == "inactive"
        follower.cancel()
