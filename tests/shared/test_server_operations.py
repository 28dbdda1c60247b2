"""Operational features of the shared server bootstrap (shared/server.py), with the Directory as
the example service: health, reflection, TLS/mTLS, Prometheus metrics, graceful shutdown, port
selection, logging and the `Version`/`Status` calls.

Process-level behaviour (signals, exit codes, logs, flags and environment variables) runs the
service as users do, `python -m services.directory`; the rest runs it in this process on a real
port. Every database is an SQLite file in a temporary directory; all traffic is on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from prometheus_client.parser import text_string_to_metric_families

from services.directory.service import OPTIONS as DIRECTORY_OPTIONS
from services.directory.service import DirectoryService
from shared.api import common_pb2, directory_pb2, directory_pb2_grpc
from shared.config import parse_options
from shared.endpoints import SERVICE_TYPES
from shared.logging import LEVELS
from shared.version import COGMENT_API_VERSION, PACKAGE_VERSION
from tests.helpers.eventually import wait_until
from tests.helpers.fake_services import free_port
from tests.helpers.running import run_in_process
from tests.helpers.services import PROJECT_ROOT, RunningService, clean_environment, start_service
from tests.helpers.tls import KeyPair, Pki, encrypted_key, make_pki, openssl_available

pytestmark = pytest.mark.timeout(60)

DIRECTORY = "services.directory"
DIRECTORY_SP = "cogmentAPI.DirectorySP"
INQUIRE = f"/{DIRECTORY_SP}/Inquire"
VERSION = f"/{DIRECTORY_SP}/Version"
# Inquiries the directory has no answer to (it retries those for --registration_lag seconds).
MISSING = directory_pb2.InquireRequest(service_id=987654321)
EMPTY_INQUIRY = directory_pb2.InquireRequest()  # neither service_id nor details: INVALID_ARGUMENT

T = TypeVar("T")


# ---- helpers ----


def database_flags(directory: Path) -> list[str]:
    """An SQLite database in `directory`, which is also the data directory (for the key file)."""
    return ["--database_url", f"sqlite+aiosqlite:///{directory / 'd.db'}", "--data_dir", str(directory)]


def registration(host: str) -> directory_pb2.RegisterRequest:
    return directory_pb2.RegisterRequest(
        endpoint=directory_pb2.ServiceEndpoint(
            protocol=directory_pb2.ServiceEndpoint.GRPC, host=host, port=1
        ),
        details=directory_pb2.ServiceDetails(type=directory_pb2.ENVIRONMENT_SERVICE),
        permanent=True,
    )


def rpc_lines(service: RunningService, rpc: str) -> list[dict[str, Any]]:
    """The per-call log lines (`rpc` or `rpc failed`) of method `rpc`."""
    return [
        line
        for line in list(service.lines)
        if line.get("event") in ("rpc", "rpc failed") and line.get("rpc") == rpc
    ]


def json_lines(path: Path) -> list[dict[str, Any]]:
    """Every line of `path` as JSON (fails on a line that is not)."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def launch(args: list[str], env: dict[str, str], stderr_path: Path) -> subprocess.Popen[bytes]:
    """`python -m services.directory <args>` with exactly `args` (no logging flags added, unlike
    `start_service`), stderr to `stderr_path`, and no COGMENT_* variable but those in `env`."""
    environment = clean_environment(env)
    with stderr_path.open("wb") as stderr:
        return subprocess.Popen(
            [sys.executable, "-m", DIRECTORY, *args],
            cwd=PROJECT_ROOT,
            env=environment,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )


def run_to_exit(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run the directory with `args`, expecting it to exit by itself (bad configuration)."""
    environment = clean_environment(env)
    return subprocess.run(
        [sys.executable, "-m", DIRECTORY, *args],
        cwd=PROJECT_ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=30,
    )


def stop_process(process: subprocess.Popen[bytes]) -> int:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        return process.wait(15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(5)
        raise


def version(channel: grpc.Channel, timeout_s: float = 5.0) -> common_pb2.VersionInfo:
    stub = directory_pb2_grpc.DirectorySPStub(channel)
    reply: common_pb2.VersionInfo = stub.Version(common_pb2.VersionRequest(), timeout=timeout_s)
    return reply


def rpc_error_code(call: Callable[[], Any]) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as error:
        call()
    return error.value.code()  # type: ignore[no-any-return]


@asynccontextmanager
async def in_process(directory: Path, *flags: str) -> AsyncIterator[str]:
    """A directory served by this process on SQLite in `directory`; yields its address."""
    argv = ["--port", "0", "--bind_address", "127.0.0.1", *database_flags(directory), *flags]
    values = parse_options(DIRECTORY_OPTIONS, argv, prog="test", description="test", environ={})
    async with run_in_process(DirectoryService.from_values(values)) as service:
        yield f"127.0.0.1:{service.port}"


async def aio_code(call: Any) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await call
    return error.value.code()  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningService]:
    """One directory process (debug JSON logs, Prometheus metrics) shared by the read-mostly tests."""
    directory = tmp_path_factory.mktemp("served")
    args = [*database_flags(directory), "--metrics_port", str(free_port())]
    with start_service(DIRECTORY, args, log_dir=directory) as service:
        wait_until(lambda: service.events("serving metrics"), "the metrics endpoint")
        yield service


# ---- 1. health ----


async def test_health_check_serving_for_server_and_directory(tmp_path: Path) -> None:
    async with in_process(tmp_path) as address, grpc.aio.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", DIRECTORY_SP):
            reply = await health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, name

        unknown = health.Check(health_pb2.HealthCheckRequest(service="cogmentAPI.NoSuchSP"), timeout=5)
        assert await aio_code(unknown) == grpc.StatusCode.NOT_FOUND

        watch = health.Watch(health_pb2.HealthCheckRequest(service=DIRECTORY_SP), timeout=5)
        first = await watch.read()
        assert first.status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()


async def test_health_port_answers_in_plaintext_beside_a_tls_port(tmp_path: Path, pki: Pki) -> None:
    """What Kubernetes' gRPC probes (no TLS) need from a service that serves TLS."""
    health_port = free_port()
    flags = [*tls_flags(pki, mtls=True), "--health_port", str(health_port)]
    async with (
        in_process(tmp_path, *flags),
        grpc.aio.insecure_channel(f"127.0.0.1:{health_port}") as channel,
    ):
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", DIRECTORY_SP):
            reply = await health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, name
        # Nothing else is served there, but reflection of the health service (for grpcurl).
        version = directory_pb2_grpc.DirectorySPStub(channel).Version(common_pb2.VersionRequest(), timeout=5)
        assert await aio_code(version) == grpc.StatusCode.UNIMPLEMENTED
        listed = await _reflect(channel, reflection_pb2.ServerReflectionRequest(list_services=""))
        names = {service.name for service in listed.list_services_response.service}
        assert names == {"grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}

        def health_methods() -> set[str]:
            with grpc.insecure_channel(f"127.0.0.1:{health_port}") as sync_channel:
                pool = DescriptorPool(ProtoReflectionDescriptorDatabase(sync_channel))
                return {method.name for method in pool.FindServiceByName("grpc.health.v1.Health").methods}

        assert {"Check", "Watch"} <= await asyncio.to_thread(health_methods)


def test_cancelled_streams_logged_at_debug_level_do_not_crash_the_server() -> None:
    """grpcio 1.85 crashes reading a cancelled call's peer once the call is over: the per-call
    log line must use the peer read when the call started."""
    result = subprocess.run(
        [sys.executable, "-m", "tests.helpers.cancelled_stream_server"],
        cwd=PROJECT_ROOT,
        capture_output=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]


# ---- 2. reflection ----


async def _reflect(channel: grpc.aio.Channel, request: reflection_pb2.ServerReflectionRequest) -> Any:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    replies = [reply async for reply in stub.ServerReflectionInfo(iter([request]), timeout=5)]
    assert len(replies) == 1
    return replies[0]


async def test_reflection_lists_and_describes_the_directory(tmp_path: Path) -> None:
    async with (
        in_process(tmp_path, "--grpc_reflection") as address,
        grpc.aio.insecure_channel(address) as channel,
    ):
        listed = await _reflect(channel, reflection_pb2.ServerReflectionRequest(list_services=""))
        names = {service.name for service in listed.list_services_response.service}
        assert {DIRECTORY_SP, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names

        # What a generic client (grpcurl, the SDKs' tools) does: build descriptors from reflection.
        def directory_methods() -> set[str]:
            with grpc.insecure_channel(address) as sync_channel:
                pool = DescriptorPool(ProtoReflectionDescriptorDatabase(sync_channel))
                service = pool.FindServiceByName(DIRECTORY_SP)
                inquire = service.methods_by_name["Inquire"]
                assert inquire.input_type.full_name == "cogmentAPI.InquireRequest"
                assert inquire.server_streaming and not inquire.client_streaming
                return {method.name for method in service.methods}

        methods = await asyncio.to_thread(directory_methods)
        assert methods == {"Register", "Deregister", "Inquire", "Version", "Status"}


async def test_reflection_is_off_by_default(tmp_path: Path) -> None:
    async with in_process(tmp_path) as address, grpc.aio.insecure_channel(address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        # No request sent: a client still writing when the call ends may be told INTERNAL
        # instead of the server's status (grpc/grpc#36066, see shared.observer's drain).
        call = stub.ServerReflectionInfo(iter([]), timeout=5)
        assert await aio_code(_read_all(call)) == grpc.StatusCode.UNIMPLEMENTED


async def _read_all(call: Any) -> None:
    async for _ in call:
        pass


# ---- 3. TLS and mTLS ----


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    if not openssl_available():
        pytest.skip("the openssl command is needed to make test certificates")
    return make_pki(tmp_path_factory.mktemp("pki"))


def tls_flags(pki: Pki, *, mtls: bool) -> list[str]:
    flags = ["--tls_cert", str(pki.server.cert), "--tls_key", str(pki.server.key)]
    return [*flags, "--tls_client_ca", str(pki.ca)] if mtls else flags


async def _aio_version_code(
    address: str, credentials: grpc.ChannelCredentials | None, name: str | None = None
) -> grpc.StatusCode:
    options = [("grpc.ssl_target_name_override", name)] if name else []
    channel = (
        grpc.aio.secure_channel(address, credentials, options=options)
        if credentials
        else grpc.aio.insecure_channel(address)
    )
    async with channel:
        stub = directory_pb2_grpc.DirectorySPStub(channel)
        try:
            reply = await stub.Version(common_pb2.VersionRequest(), timeout=5)
        except grpc.aio.AioRpcError as error:
            return error.code()  # type: ignore[no-any-return]
        assert reply.versions
        return grpc.StatusCode.OK


async def test_tls_serves_secure_channels_only(tmp_path: Path, pki: Pki) -> None:
    async with in_process(tmp_path, *tls_flags(pki, mtls=False)) as address:
        # The certificate names both IP:127.0.0.1 and DNS:localhost.
        assert await _aio_version_code(address, pki.channel_credentials()) == grpc.StatusCode.OK
        assert await _aio_version_code(address, pki.channel_credentials(), "localhost") == grpc.StatusCode.OK
        # No client certificate is asked for without --tls_client_ca.
        with_cert = pki.channel_credentials(pki.client)
        assert await _aio_version_code(address, with_cert) == grpc.StatusCode.OK
        assert await _aio_version_code(address, None) == grpc.StatusCode.UNAVAILABLE
        # A client that does not trust the server's CA refuses it.
        untrusting = grpc.ssl_channel_credentials(pki.rogue_client.cert.read_bytes())
        assert await _aio_version_code(address, untrusting) == grpc.StatusCode.UNAVAILABLE


async def test_mtls_requires_a_client_certificate_signed_by_the_ca(tmp_path: Path, pki: Pki) -> None:
    async with in_process(tmp_path, *tls_flags(pki, mtls=True)) as address:
        assert await _aio_version_code(address, pki.channel_credentials(pki.client)) == grpc.StatusCode.OK
        assert await _aio_version_code(address, pki.channel_credentials()) == grpc.StatusCode.UNAVAILABLE
        rogue = pki.channel_credentials(pki.rogue_client)
        assert await _aio_version_code(address, rogue) == grpc.StatusCode.UNAVAILABLE
        assert await _aio_version_code(address, None) == grpc.StatusCode.UNAVAILABLE


def test_tls_and_mtls_from_environment_variables(tmp_path: Path, pki: Pki) -> None:
    env = {
        "COGMENT_DIRECTORY_TLS_CERT": str(pki.server.cert),
        "COGMENT_DIRECTORY_TLS_KEY": str(pki.server.key),
        "COGMENT_DIRECTORY_TLS_CLIENT_CA": str(pki.ca),
    }
    with start_service(DIRECTORY, database_flags(tmp_path), env, log_dir=tmp_path) as service:
        [serving] = service.events("serving")
        assert serving["tls"] is True and serving["mtls"] is True

        def code(client: KeyPair | None) -> grpc.StatusCode:
            with grpc.secure_channel(service.address, pki.channel_credentials(client)) as channel:
                try:
                    version(channel)
                except grpc.RpcError as error:
                    return error.code()  # type: ignore[no-any-return]
                return grpc.StatusCode.OK

        assert code(pki.client) == grpc.StatusCode.OK
        assert code(None) == grpc.StatusCode.UNAVAILABLE
        with grpc.insecure_channel(service.address) as channel:
            assert rpc_error_code(lambda: version(channel)) == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--tls_cert", "server.pem"], "--tls_cert and --tls_key go together"),
        (["--tls_key", "server.key"], "--tls_cert and --tls_key go together"),
        (["--tls_client_ca", "ca.pem"], "--tls_client_ca needs --tls_cert and --tls_key"),
    ],
    ids=["cert-only", "key-only", "ca-only"],
)
def test_incomplete_tls_configuration_exits_with_a_message(
    tmp_path: Path, flags: list[str], message: str
) -> None:
    result = run_to_exit(["--port", "0", "--bind_address", "127.0.0.1", *database_flags(tmp_path), *flags])
    assert result.returncode != 0
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_missing_tls_file_exits_with_a_message(tmp_path: Path, pki: Pki) -> None:
    missing = tmp_path / "no-such-key.pem"
    args = ["--port", "0", "--bind_address", "127.0.0.1", *database_flags(tmp_path)]
    result = run_to_exit([*args, "--tls_cert", str(pki.server.cert), "--tls_key", str(missing)])
    assert result.returncode != 0
    assert str(missing) in result.stderr
    assert "Traceback" not in result.stderr


# ---- 4. Prometheus metrics ----


def scrape(service: RunningService) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of the service's /metrics, keyed by (name, labels)."""
    [endpoint] = service.events("serving metrics")
    assert endpoint["path"] == "/metrics"
    url = f"http://127.0.0.1:{endpoint['port']}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        assert response.status == 200
        text = response.read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def sample(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def test_metrics_count_calls_by_method_and_code(served: RunningService) -> None:
    inquire = {"grpc_type": "server_stream", "grpc_service": DIRECTORY_SP, "grpc_method": "Inquire"}
    register = {"grpc_type": "bidi_stream", "grpc_service": DIRECTORY_SP, "grpc_method": "Register"}
    before = scrape(served)
    with grpc.insecure_channel(served.address) as channel:
        stub = directory_pb2_grpc.DirectorySPStub(channel)
        for _ in range(3):
            assert list(stub.Inquire(MISSING, timeout=5)) == []
        failed = rpc_error_code(lambda: list(stub.Inquire(EMPTY_INQUIRY, timeout=5)))
        assert failed == grpc.StatusCode.INVALID_ARGUMENT
        [registered] = list(stub.Register(iter([registration("metrics")]), timeout=5))
        assert registered.status == directory_pb2.RegisterReply.OK
    after = scrape(served)

    def delta(name: str, **labels: str) -> float:
        return sample(after, name, **labels) - sample(before, name, **labels)

    assert delta("grpc_server_started_total", **inquire) == 4
    assert delta("grpc_server_handled_total", **inquire, grpc_code="OK") == 3
    assert delta("grpc_server_handled_total", **inquire, grpc_code="INVALID_ARGUMENT") == 1
    assert delta("grpc_server_handled_total", **register, grpc_code="OK") == 1
    assert delta("grpc_server_handling_seconds_count", **inquire) == 4
    assert delta("grpc_server_handling_seconds_bucket", **inquire, le="+Inf") == 4
    buckets = [
        key
        for key in after
        if key[0] == "grpc_server_handling_seconds_bucket" and key[1] >= set(inquire.items())
    ]
    assert len(buckets) > 1  # the latency histogram has finite buckets besides +Inf

    # The directory's own: the entries gauge has every type and health from start-up.
    for health in ("healthy", "unhealthy"):
        for type_name in SERVICE_TYPES:
            labels = frozenset({("type", type_name), ("health", health)})
            assert ("cogment_directory_entries", labels) in after
            assert sample(after, "cogment_directory_entries", type=type_name, health=health) >= 0
    # The three missing ones found nothing (from the index, or a remembered answer); the invalid
    # one was not answered.
    none = sum(
        delta("cogment_directory_inquiries_total", source=source, outcome="none")
        for source in ("memory", "remembered", "database")
    )
    assert none == 3
    assert delta("cogment_directory_inquiries_total", source="database", outcome="none") == 0
    assert delta("cogment_directory_registrations_total", outcome="created") == 1
    # Every service's, labelled with its name.
    assert sample(after, "cogment_ready", cogment_service="directory") == 1
    assert sample(after, "cogment_dependency_up", cogment_service="directory", dependency="database") == 1
    build = {"version": PACKAGE_VERSION, "cogment_api": COGMENT_API_VERSION}
    assert sample(after, "cogment_build_info", cogment_service="directory", **build) == 1


def test_taken_metrics_port_exits_before_serving(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        metrics_port = taken.getsockname()[1]
        args = ["--port", "0", "--bind_address", "127.0.0.1", "--log_format", "json"]
        result = run_to_exit([*args, "--metrics_port", str(metrics_port), *database_flags(tmp_path)])
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert '"serving"' not in result.stderr
    assert str(metrics_port) in result.stderr


# ---- 5. graceful shutdown ----


def _events(service: RunningService) -> list[str]:
    return [str(line.get("event")) for line in list(service.lines)]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_drains_the_call_in_flight_then_exits_0(tmp_path: Path, sig: signal.Signals) -> None:
    lag_s, grace_s = 3, 5.0
    args = [*database_flags(tmp_path), "--registration_lag", str(lag_s), "--shutdown_grace", str(grace_s)]
    with (
        start_service(DIRECTORY, args, log_dir=tmp_path) as service,
        grpc.insecure_channel(service.address) as channel,
        ThreadPoolExecutor(1) as pool,
    ):
        stub = directory_pb2_grpc.DirectorySPStub(channel)
        version(channel)  # connected
        started = time.monotonic()
        in_flight = pool.submit(lambda: list(stub.Inquire(MISSING, timeout=20)))
        time.sleep(0.5)
        assert not in_flight.done()

        service.process.send_signal(sig)
        signalled = time.monotonic()
        wait_until(lambda: service.events("shutting down"), "the shutting down event", 5)
        # While the call drains, the port no longer accepts connections.
        with grpc.insecure_channel(service.address) as fresh:
            assert rpc_error_code(lambda: version(fresh, 2)) == grpc.StatusCode.UNAVAILABLE
        assert not in_flight.done(), "the in-flight call should still be running"

        assert in_flight.result(timeout=15) == []  # completed normally, after its retries
        assert time.monotonic() - started >= lag_s - 0.5
        assert service.process.wait(grace_s + 5) == 0
        assert time.monotonic() - signalled < grace_s + 2
        service.terminate()  # already exited: collects the rest of the log

        # Still refused once the process is gone.
        with grpc.insecure_channel(service.address) as fresh:
            assert rpc_error_code(lambda: version(fresh, 2)) == grpc.StatusCode.UNAVAILABLE

    events = _events(service)
    [shutting_down] = service.events("shutting down")
    assert shutting_down["grace_seconds"] == grace_s
    [inquired] = rpc_lines(service, INQUIRE)
    assert inquired["code"] == "OK"
    assert (
        events.index("shutting down")
        < events.index("rpc", events.index("shutting down"))
        < events.index("stopped")
    )
    assert events[-1] == "stopped"


def test_shutdown_grace_cancels_calls_that_outlast_it(tmp_path: Path) -> None:
    args = [*database_flags(tmp_path), "--registration_lag", "30", "--shutdown_grace", "1"]
    with (
        start_service(DIRECTORY, args, log_dir=tmp_path) as service,
        grpc.insecure_channel(service.address) as channel,
        ThreadPoolExecutor(1) as pool,
    ):
        stub = directory_pb2_grpc.DirectorySPStub(channel)
        version(channel)
        in_flight = pool.submit(lambda: list(stub.Inquire(MISSING, timeout=40)))
        time.sleep(0.5)
        service.process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        assert service.process.wait(10) == 0
        assert time.monotonic() - signalled < 3.5, "the grace period is 1 s"
        error = in_flight.exception(timeout=5)
        assert isinstance(error, grpc.RpcError)
        assert error.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
        service.terminate()

    [inquired] = rpc_lines(service, INQUIRE)
    assert inquired["code"] == "CANCELLED"
    assert _events(service)[-1] == "stopped"


# ---- 6. the port ----


def test_port_zero_picks_a_free_port_and_logs_it(served: RunningService) -> None:
    [serving] = served.events("serving")
    assert serving["service"] == "directory"
    assert serving["address"] == "127.0.0.1"
    assert serving["tls"] is False and serving["mtls"] is False
    port = serving["port"]
    assert isinstance(port, int) and 0 < port < 65536
    assert served.port == port
    with socket.create_connection(("127.0.0.1", port), timeout=2):
        pass
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        assert version(channel).versions


def test_taken_port_exits_non_zero(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_to_exit(["--port", str(port), "--bind_address", "127.0.0.1", *database_flags(tmp_path)])
    assert result.returncode != 0
    assert f"127.0.0.1:{port}" in result.stderr


def test_taken_port_error_is_a_clear_log_line(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_to_exit(
            [
                "--port",
                str(port),
                "--bind_address",
                "127.0.0.1",
                "--log_format",
                "json",
                *database_flags(tmp_path),
            ]
        )
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("{") and '"error"' in line]
    assert any(f"127.0.0.1:{port}" in line for line in errors)


def test_port_served_by_another_instance_is_taken(tmp_path: Path) -> None:
    with start_service(DIRECTORY, database_flags(tmp_path), log_dir=tmp_path) as first:
        second_dir = tmp_path / "second"
        second_dir.mkdir()
        stderr_path = second_dir / "stderr.log"
        args = ["--port", str(first.port), "--bind_address", "127.0.0.1", "--log_format", "json"]
        second = launch([*args, *database_flags(second_dir)], {}, stderr_path)
        try:
            wait_until(
                lambda: second.poll() is not None or '"serving"' in stderr_path.read_text(),
                "the second instance to exit or serve",
                30,
            )
            assert second.poll() is not None, "a second instance serves on the same port"
            assert second.returncode != 0
        finally:
            stop_process(second)


# ---- 7. logging ----


def test_debug_level_logs_one_line_per_call(served: RunningService) -> None:
    versions_before = len(rpc_lines(served, VERSION))
    inquiries_before = len(rpc_lines(served, INQUIRE))
    with grpc.insecure_channel(served.address) as channel:
        version(channel)
        version(channel)
        stub = directory_pb2_grpc.DirectorySPStub(channel)
        rpc_error_code(lambda: list(stub.Inquire(EMPTY_INQUIRY, timeout=5)))
    wait_until(
        lambda: (
            len(rpc_lines(served, VERSION)) >= versions_before + 2
            and len(rpc_lines(served, INQUIRE)) >= inquiries_before + 1
        ),
        "the per-call log lines",
        5,
    )
    time.sleep(0.2)  # a line too many would show up by now
    version_lines = rpc_lines(served, VERSION)[versions_before:]
    inquire_lines = rpc_lines(served, INQUIRE)[inquiries_before:]
    assert len(version_lines) == 2
    for line in version_lines:
        assert line["event"] == "rpc" and line["code"] == "OK" and line["level"] == "debug"
        assert isinstance(line["seconds"], float)
        assert "127.0.0.1" in str(line["peer"])
    [failed] = inquire_lines
    assert failed["event"] == "rpc failed" and failed["level"] == "info"
    assert failed["code"] == "INVALID_ARGUMENT"
    assert "set either service_id or details" in str(failed["details"])


def test_info_level_logs_failed_calls_only(tmp_path: Path) -> None:
    args = [*database_flags(tmp_path), "--log_level", "info"]
    with start_service(DIRECTORY, args, log_dir=tmp_path) as service:
        with grpc.insecure_channel(service.address) as channel:
            stub = directory_pb2_grpc.DirectorySPStub(channel)
            version(channel)
            stub.Status(common_pb2.StatusRequest(names=["*"]), timeout=5)
            assert list(stub.Inquire(MISSING, timeout=5)) == []
            rpc_error_code(lambda: list(stub.Inquire(EMPTY_INQUIRY, timeout=5)))
        wait_until(lambda: service.events("rpc failed"), "the failed call's log line", 5)
        assert service.events("rpc") == []
        [failed] = service.events("rpc failed")
        assert failed["rpc"] == INQUIRE and failed["code"] == "INVALID_ARGUMENT"
        assert all(line["level"] != "debug" for line in service.lines)


def test_json_format_gives_json_lines(served: RunningService) -> None:
    raw = [line for line in served.log_path.read_text().splitlines() if line.strip()]
    assert raw
    for line in raw:
        parsed = json.loads(line)
        assert {"event", "level", "timestamp"} <= parsed.keys()


@pytest.mark.parametrize("log_format", ["json", "text"])
def test_log_level_and_format_from_environment_variables(tmp_path: Path, log_format: str) -> None:
    stderr_path = tmp_path / "stderr.log"
    env = {"COGMENT_LOG_LEVEL": "DEBUG", "COGMENT_LOG_FORMAT": log_format}
    process = launch(
        ["--port", "0", "--bind_address", "127.0.0.1", *database_flags(tmp_path)], env, stderr_path
    )
    try:
        if log_format == "json":

            def port() -> int | None:
                lines = json_lines(stderr_path) if stderr_path.read_text().endswith("\n") else []
                return next((int(line["port"]) for line in lines if line["event"] == "serving"), None)
        else:

            def port() -> int | None:
                found = re.search(r"serving\s.*\bport=(\d+)", stderr_path.read_text())
                return int(found.group(1)) if found else None

        address = f"127.0.0.1:{wait_until(port, 'the serving log line', 30)}"
        with grpc.insecure_channel(address) as channel:
            version(channel)
        wait_until(lambda: VERSION in stderr_path.read_text(), "the rpc log line", 5)
    finally:
        assert stop_process(process) == 0

    text = stderr_path.read_text()
    if log_format == "json":
        lines = json_lines(stderr_path)
        [rpc] = [line for line in lines if line.get("rpc") == VERSION]
        assert rpc["event"] == "rpc" and rpc["level"] == "debug"
        assert lines[-1]["event"] == "stopped"
    else:
        assert not text.lstrip().startswith("{")
        assert re.search(rf"\[debug\s*\]\s+rpc\s.*rpc={re.escape(VERSION)}", text)
        assert re.search(r"\[info\s*\]\s+stopped", text)


@pytest.mark.parametrize("level", list(LEVELS))
def test_every_documented_log_level_serves_and_filters(tmp_path: Path, level: str) -> None:
    """Each level the options (and the chart's schema) allow starts the service, which logs what
    that level lets through and nothing below it (trace and off crashed at start-up once)."""
    port = free_port()
    stderr_path = tmp_path / "stderr.log"
    args = ["--port", str(port), "--bind_address", "127.0.0.1", *database_flags(tmp_path)]
    process = launch([*args, "--log_level", level, "--log_format", "json"], {}, stderr_path)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            wait_until(
                lambda: process.poll() is not None or succeeds(lambda: version(channel, 1)), "serving", 30
            )
            stub = directory_pb2_grpc.DirectorySPStub(channel)
            assert rpc_error_code(lambda: list(stub.Inquire(EMPTY_INQUIRY, timeout=5))) == (
                grpc.StatusCode.INVALID_ARGUMENT
            )
    finally:
        assert stop_process(process) == 0

    lines = json_lines(stderr_path)
    assert all(LEVELS[line["level"]] >= LEVELS[level] for line in lines), lines
    events = {(line["level"], line["event"]) for line in lines}
    if level == "off":
        assert stderr_path.read_text() == ""
    if LEVELS[level] <= LEVELS["debug"]:
        assert ("debug", "rpc") in events
    if LEVELS[level] <= LEVELS["info"]:
        assert {("info", "serving"), ("info", "rpc failed"), ("info", "stopped")} <= events


def test_chart_schema_allows_the_log_levels_the_services_accept() -> None:
    schema = json.loads((PROJECT_ROOT / "deploy" / "helm" / "values.schema.json").read_text())
    found: list[list[str]] = []

    def visit(node: Any) -> None:
        if isinstance(node, dict):
            if "level" in node.get("properties", {}):
                found.append(node["properties"]["level"]["enum"])
            for child in node.values():
                visit(child)
        elif isinstance(node, list):
            for child in node:
                visit(child)

    visit(schema)
    assert found and all(levels == list(LEVELS) for levels in found), found


def succeeds(call: Callable[[], Any]) -> bool:
    try:
        call()
    except grpc.RpcError:
        return False
    return True


def test_log_file_receives_json_lines(tmp_path: Path) -> None:
    log_file = tmp_path / "directory.log"
    log_file.write_text('{"event": "written before"}\n')  # the log is appended to
    stderr_path = tmp_path / "stderr.log"
    args = ["--port", "0", "--bind_address", "127.0.0.1", *database_flags(tmp_path)]
    # The format stays text (the default) on purpose: a log file is always JSON.
    process = launch([*args, "--log_level", "debug", "--log_file", str(log_file)], {}, stderr_path)
    try:

        def port() -> int | None:
            lines = json_lines(log_file) if log_file.read_text().endswith("\n") else []
            return next((int(line["port"]) for line in lines if line["event"] == "serving"), None)

        with grpc.insecure_channel(f"127.0.0.1:{wait_until(port, 'the serving log line', 30)}") as channel:
            version(channel)
        wait_until(lambda: VERSION in log_file.read_text(), "the rpc log line", 5)
    finally:
        assert stop_process(process) == 0

    lines = json_lines(log_file)
    assert lines[0] == {"event": "written before"}
    events = [line["event"] for line in lines]
    assert {"opening database", "serving", "rpc", "shutting down", "stopped"} <= set(events)
    assert events[-1] == "stopped"
    assert "serving" not in stderr_path.read_text()  # nothing of the log on stderr


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--log_level", "loud"], {}, "argument --log_level: invalid choice: 'loud'"),
        ([], {"COGMENT_DIRECTORY_PORT": "abc"}, "invalid value for COGMENT_DIRECTORY_PORT"),
        ([], {"COGMENT_LOG_FORMAT": "xml"}, "invalid value for COGMENT_LOG_FORMAT: 'xml'"),
        (["--port", "70000"], {}, "expected a port number 0..65535"),
    ],
    ids=["flag-log-level", "env-port", "env-log-format", "flag-port-range"],
)
def test_invalid_configuration_is_a_usage_error(
    tmp_path: Path, args: list[str], env: dict[str, str], message: str
) -> None:
    result = run_to_exit([*database_flags(tmp_path), *args], env)
    assert result.returncode == 2
    assert result.stderr.startswith("usage: python -m services.directory")
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "d.db").exists()  # rejected before anything started


# ---- 8. Status and Version ----


async def test_status_over_the_wire(tmp_path: Path) -> None:
    async with (
        in_process(tmp_path, "--load_balancing") as address,
        grpc.aio.insecure_channel(address) as channel,
    ):
        stub = directory_pb2_grpc.DirectorySPStub(channel)

        async def status(*names: str) -> dict[str, str]:
            reply = await stub.Status(common_pb2.StatusRequest(names=names), timeout=5)
            return dict(reply.statuses)

        everything = {"overall_load", "nb_entries", "load_balancing"}
        assert await status() == {}
        every = await status("*")
        assert set(every) == everything
        assert every["nb_entries"] == "0"
        assert every["load_balancing"] == "enabled"
        assert re.fullmatch(r"\d+", every["overall_load"]) and 0 <= int(every["overall_load"]) <= 100
        assert set(await status("nb_entries", "*", "bogus")) == everything
        assert await status("bogus", "nb_entries", "nope") == {"nb_entries": "0"}
        assert await status("bogus") == {}
        assert set(await status("load_balancing", "overall_load", "load_balancing")) == {
            "load_balancing",
            "overall_load",
        }

        replies = [reply async for reply in stub.Register(iter([registration("status")]), timeout=5)]
        assert replies[0].status == directory_pb2.RegisterReply.OK
        assert await status("nb_entries") == {"nb_entries": "1"}


async def test_version_over_the_wire(tmp_path: Path) -> None:
    async with in_process(tmp_path) as address, grpc.aio.insecure_channel(address) as channel:
        reply = await directory_pb2_grpc.DirectorySPStub(channel).Version(
            common_pb2.VersionRequest(), timeout=5
        )
        versions = {entry.name: entry.version for entry in reply.versions}
        assert versions["cogment-api"] == COGMENT_API_VERSION
        assert re.fullmatch(r"2\.\d+\.\d+", versions["cogment-api"])
        assert versions["grpc"] == grpc.__version__
        assert versions["cogment-aux-directory"] == versions["cogment-aux"]


UNREACHABLE_DATABASE = "postgresql+psycopg://postgres:secret@127.0.0.1:1/nowhere"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--database_url", UNREACHABLE_DATABASE], "Connection refused"),
        (["--database_url", "::secret@"], "the database URL cannot be read as"),
        (["--database_url", "mysql://user:secret@127.0.0.1/x"], "unsupported database URL mysql://user:***@"),
        (["--database_url", "sqlite:///x.db"], "The loaded 'pysqlite' is not async"),
        (["--data_dir", "{file}/data"], "the directory of the database file: Not a directory"),
        (["--port", "{busy}"], "(--port): Address already in use"),
        (["--health_port", "{busy}"], "(--health_port): Address already in use"),
        (["--bind_address", "192.0.2.1"], "192.0.2.1:0 (--port): Cannot assign requested address"),
    ],
    ids=[
        "unreachable",
        "not-a-url",
        "other-database",
        "sync-driver",
        "data-dir",
        "port",
        "health",
        "address",
    ],
)
def test_what_prevents_start_up_is_said_in_one_line(tmp_path: Path, flags: list[str], message: str) -> None:
    """Exit status 1 and one line naming the problem: no traceback, no gRPC core line, no password."""
    (tmp_path / "file").write_text("")
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        flags = [flag.format(file=tmp_path / "file", busy=busy.getsockname()[1]) for flag in flags]
        args = [
            "--port",
            "0",
            "--bind_address",
            "127.0.0.1",
            "--data_dir",
            str(tmp_path),
            "--log_level",
            "warning",
        ]
        result = run_to_exit([*args, *flags])
    assert result.returncode == 1
    [line] = result.stderr.splitlines()
    assert "cannot start" in line and message in line
    assert "secret" not in line


def test_a_bracketed_ipv6_wildcard_binds(tmp_path: Path) -> None:
    """What the port check asks the resolver must be what grpc accepts: `[::]` included."""
    port = free_port()
    process = launch(
        ["--port", str(port), "--bind_address", "[::]", *database_flags(tmp_path)], {}, tmp_path / "e"
    )
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            wait_until(
                lambda: process.poll() is not None or succeeds(lambda: version(channel, 1)), "serving", 30
            )
            assert process.poll() is None, (tmp_path / "e").read_text()
    finally:
        assert stop_process(process) == 0


@pytest.mark.parametrize(
    ("url", "message"),
    [(UNREACHABLE_DATABASE, "Connection refused"), ("mysql://user:secret@127.0.0.1/x", "unsupported")],
)
def test_migrate_says_what_prevents_it_in_one_line(url: str, message: str) -> None:
    migrate = subprocess.run(
        [sys.executable, "-m", "shared.migrate", "--database_url", url],
        cwd=PROJECT_ROOT,
        env=clean_environment(),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert migrate.returncode == 1
    [line] = migrate.stderr.splitlines()
    assert "cannot migrate" in line and message in line
    assert "secret" not in line


@pytest.mark.skipif(not openssl_available(), reason="needs the openssl command to make certificates")
def test_bad_tls_files_are_named_as_such(tmp_path: Path) -> None:
    pki = make_pki(tmp_path / "pki")
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("not a certificate\n")
    cases = [
        (
            ["--tls_cert", str(not_pem), "--tls_key", str(pki.server.key)],
            "are not a PEM certificate and its private key",
        ),
        (["--tls_cert", str(pki.server.cert), "--tls_key", str(pki.client.key)], "are not a PEM certificate"),
        (
            [
                "--tls_cert",
                str(pki.server.cert),
                "--tls_key",
                str(pki.server.key),
                "--tls_client_ca",
                str(not_pem),
            ],
            "is not a PEM CA bundle",
        ),
        (
            ["--tls_cert", str(pki.server.cert), "--tls_key", str(encrypted_key(pki.server.key, tmp_path))],
            "the private key is encrypted (pass-phrase protected), which grpc cannot use",
        ),
    ]
    for flags, message in cases:
        result = run_to_exit(
            ["--port", "0", "--bind_address", "127.0.0.1", *database_flags(tmp_path), *flags]
        )
        assert result.returncode == 1, result.stderr
        assert message in result.stderr, result.stderr
        assert "in use" not in result.stderr
