"""Self-registration in a directory (`shared.registration`, `shared.directory_registration`,
`shared.host_discovery`), against a real in-process directory and a stand-in service answering
the directory's health checks."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
from structlog.testing import capture_logs

import shared.directory_registration as registration_module
from shared.api import common_pb2, directory_pb2, directory_pb2_grpc
from shared.channel import ClientTls
from shared.config import parse_options
from shared.directory_registration import SOURCE_COMMAND_LINE, SOURCE_IMPLICIT, DirectoryRegistration
from shared.endpoints import ServiceType, parse_grpc_endpoint
from shared.errors import StartupError
from shared.host_discovery import discover_host
from shared.registration import RegistrationSettings, registration_options
from shared.version import PACKAGE_VERSION
from tests.helpers.fake_services import free_port
from tests.helpers.running import DirectoryFactory, RunningDirectory
from tests.helpers.tls import make_pki, openssl_available

MODEL_REGISTRY = directory_pb2.MODEL_REGISTRY_SERVICE
WAIT_S = 15.0


def registration_from(
    values: Mapping[str, Any], service_types: Sequence[ServiceType]
) -> DirectoryRegistration:
    """The registration of a service configured with `values` (option values; those of
    `registration_options()` left out take their defaults, `bind_address` and `tls_cert` are the
    service's own)."""
    defaults = parse_options(
        registration_options("MODEL_REGISTRY"), [], prog="t", description="t", environ={}
    )
    settings = RegistrationSettings.from_values(
        {**defaults, **{k: v for k, v in values.items() if k in defaults}}
    )
    return DirectoryRegistration.from_settings(
        settings, service_types, bind_address=values.get("bind_address", ""), ssl=bool(values.get("tls_cert"))
    )


def test_a_client_certificate_without_its_key_stops_the_start() -> None:
    """A configuration error, said as one, not a traceback; a certificate alone asks for TLS."""
    with pytest.raises(StartupError, match="--directory_tls_cert and --directory_tls_key go together"):
        registration_from(
            {"directory_endpoint": "grpc://127.0.0.1:9005", "directory_tls_cert": "client.pem"},
            [MODEL_REGISTRY],
        )
    registration = registration_from(
        {
            "directory_endpoint": "grpc://127.0.0.1:9005",
            "directory_tls_cert": "c.pem",
            "directory_tls_key": "c.key",
        },
        [MODEL_REGISTRY],
    )
    assert registration.directory_tls == ClientTls("", "c.pem", "c.key")


@pytest.fixture
def database_url(tmp_path: Path) -> str:
    """The registration is the client side: one database kind is enough here."""
    return f"sqlite+aiosqlite:///{tmp_path / 'directory.db'}"


class _StatusHandler(grpc.GenericRpcHandler):  # type: ignore[misc]
    """Answers `/cogmentAPI.<any>/Status`, as the directory's health checks expect."""

    def service(self, details: Any) -> Any:
        if not details.method.startswith("/cogmentAPI.") or not details.method.endswith("/Status"):
            return None

        async def status(request: common_pb2.StatusRequest, context: Any) -> common_pb2.StatusReply:
            return common_pb2.StatusReply(statuses={"overall_load": "0"})

        return grpc.unary_unary_rpc_method_handler(
            status,
            request_deserializer=common_pb2.StatusRequest.FromString,
            response_serializer=common_pb2.StatusReply.SerializeToString,
        )


@pytest.fixture
async def service_port() -> AsyncIterator[int]:
    """The port of a stand-in service that the directory finds healthy."""
    server = grpc.aio.server()
    server.add_generic_rpc_handlers([_StatusHandler()])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield port
    await server.stop(None)


async def inquire(
    directory: RunningDirectory, service_type: ServiceType = directory_pb2.UNKNOWN_SERVICE, token: str = ""
) -> list[directory_pb2.FullServiceData]:
    metadata = (("authentication-token", token),) if token else ()
    request = directory_pb2.InquireRequest(details=directory_pb2.ServiceDetails(type=service_type))
    return [reply.data async for reply in directory.stub.Inquire(request, metadata=metadata, timeout=5)]


async def test_registers_on_start_and_deregisters_on_stop(
    directory: RunningDirectory, service_port: int
) -> None:
    registration = DirectoryRegistration(
        f"grpc://{directory.address}",
        [MODEL_REGISTRY],
        authentication_token="secret-token",
        host="127.0.0.1",
        properties={"team": "blue", "__version": "overridden"},
    )
    await registration.start(service_port)
    await asyncio.wait_for(registration.wait(), WAIT_S)
    [registered] = registration.registered

    assert await inquire(directory, MODEL_REGISTRY) == []  # the token scopes it
    [found] = await inquire(directory, MODEL_REGISTRY, token="secret-token")
    assert found.service_id == registered.service_id
    assert found.endpoint == directory_pb2.ServiceEndpoint(
        protocol=directory_pb2.ServiceEndpoint.GRPC, host="127.0.0.1", port=service_port
    )
    assert found.details.type == MODEL_REGISTRY
    assert not found.permanent
    assert dict(found.details.properties) == {
        "team": "blue",
        "__registration_source": SOURCE_COMMAND_LINE,
        "__version": PACKAGE_VERSION,
    }

    await registration.stop()
    assert registration.registered == []
    assert await inquire(directory, token="secret-token") == []


async def test_registers_each_service_type(directory: RunningDirectory, service_port: int) -> None:
    """The datastore registers twice on one port: as DATASTORE and as DATALOG."""
    types = [directory_pb2.DATASTORE_SERVICE, directory_pb2.DATALOG_SERVICE]
    registration = DirectoryRegistration(f"grpc://{directory.address}", types, host="127.0.0.1")
    await registration.start(service_port)
    await asyncio.wait_for(registration.wait(), WAIT_S)
    assert [r.service_type for r in registration.registered] == types

    found = await inquire(directory)
    assert sorted(f.details.type for f in found) == sorted(types)
    assert {f.endpoint.port for f in found} == {service_port}
    assert len({f.service_id for f in found}) == 2

    await registration.stop()
    assert await inquire(directory) == []


async def test_does_not_block_and_registers_once_the_directory_is_up(
    directory_factory: DirectoryFactory, service_port: int
) -> None:
    directory_port = free_port()
    registration = DirectoryRegistration(
        f"grpc://127.0.0.1:{directory_port}",
        [MODEL_REGISTRY],
        host="127.0.0.1",
        attempt_timeout_s=1.0,
        retry_max_s=0.5,
    )
    started = time.monotonic()
    with capture_logs() as logs:
        await registration.start(service_port)
        assert time.monotonic() - started < 0.5
        await asyncio.sleep(1.5)
    assert registration.registered == []
    assert any(entry["event"].startswith("directory not reachable yet") for entry in logs)

    async with directory_factory(
        "--port", str(directory_port), "--health_check_interval", "0.2"
    ) as directory:
        await asyncio.wait_for(registration.wait(), WAIT_S)
        [found] = await inquire(directory, MODEL_REGISTRY)
        assert found.endpoint.port == service_port
        await registration.stop()
        assert await inquire(directory) == []


async def test_stop_while_the_directory_is_down() -> None:
    registration = DirectoryRegistration(
        f"grpc://127.0.0.1:{free_port()}", [MODEL_REGISTRY], host="127.0.0.1", retry_max_s=0.5
    )
    await registration.start(12345)
    await asyncio.sleep(0.3)
    started = time.monotonic()
    await registration.stop()
    assert time.monotonic() - started < 2.0
    assert registration.registered == []


async def test_stop_logs_deregistration_failures(
    directory_factory: DirectoryFactory, service_port: int
) -> None:
    """The directory goes away before the service stops: stop() only logs, within its timeout."""
    async with directory_factory("--health_check_interval", "0.2") as directory:
        registration = DirectoryRegistration(
            f"grpc://{directory.address}", [MODEL_REGISTRY], host="127.0.0.1", deregister_timeout_s=1.0
        )
        await registration.start(service_port)
        await asyncio.wait_for(registration.wait(), WAIT_S)
        assert len(registration.registered) == 1
    started = time.monotonic()
    with capture_logs() as logs:
        await registration.stop()
    assert time.monotonic() - started < 3.0
    assert any(entry["event"] == "could not deregister from the directory" for entry in logs)


async def test_refused_registration_is_logged_and_not_retried(directory: RunningDirectory) -> None:
    registration = DirectoryRegistration(f"grpc://{directory.address}", [MODEL_REGISTRY], host="bad\x00host")
    with capture_logs() as logs:
        await registration.start(1234)
        await asyncio.wait_for(registration.wait(), WAIT_S)
    assert registration.registered == []
    [refused] = [entry for entry in logs if entry["event"] == "the directory refused the registration"]
    assert "NUL" in refused["error"]
    await registration.stop()


async def test_implicit_host_is_the_bind_address(directory: RunningDirectory, service_port: int) -> None:
    values = parse_options(
        registration_options("MODEL_REGISTRY"),
        ["--directory_endpoint", f"grpc://{directory.address}"],
        prog="test",
        description="test",
        environ={},
    )
    registration = registration_from({**values, "bind_address": "127.0.0.1"}, [MODEL_REGISTRY])
    await registration.start(service_port)
    await asyncio.wait_for(registration.wait(), WAIT_S)
    [found] = await inquire(directory, MODEL_REGISTRY)
    assert found.endpoint.host == "127.0.0.1"
    assert found.details.properties["__registration_source"] == SOURCE_IMPLICIT
    await registration.stop()


async def test_tls_service_registers_as_grpc_ssl(directory: RunningDirectory, service_port: int) -> None:
    values = {
        "directory_endpoint": f"grpc://{directory.address}",
        "directory_registration_host": "127.0.0.1",
        "tls_cert": "/some/cert.pem",
    }
    registration = registration_from(values, [MODEL_REGISTRY])
    await registration.start(service_port)
    await asyncio.wait_for(registration.wait(), WAIT_S)
    [found] = await inquire(directory, MODEL_REGISTRY)
    assert found.endpoint.protocol == directory_pb2.ServiceEndpoint.GRPC_SSL
    await registration.stop()


async def test_no_registration_when_no_host_can_be_found(
    directory: RunningDirectory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(registration_module, "discover_host", lambda directory=None: None)
    registration = DirectoryRegistration(
        f"grpc://{directory.address}", [MODEL_REGISTRY], bind_address="0.0.0.0"
    )
    with capture_logs() as logs:
        await registration.start(1234)
        await asyncio.wait_for(registration.wait(), WAIT_S)
    assert registration.registered == []
    assert any(
        entry["log_level"] == "error" and "--directory_registration_host" in entry["event"] for entry in logs
    )
    assert await inquire(directory) == []
    await registration.stop()


async def test_discovered_host_is_used(
    directory: RunningDirectory, service_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(registration_module, "discover_host", lambda directory=None: "127.0.0.1")
    registration = DirectoryRegistration(f"grpc://{directory.address}", [MODEL_REGISTRY])
    await registration.start(service_port)
    await asyncio.wait_for(registration.wait(), WAIT_S)
    [found] = await inquire(directory, MODEL_REGISTRY)
    assert found.endpoint.host == "127.0.0.1"
    assert found.details.properties["__registration_source"] == SOURCE_IMPLICIT
    await registration.stop()


# ---- without a directory ----


def test_discover_host_skips_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    def getaddrinfo(host: str, *args: Any) -> list[Any]:
        return [
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.1.1", 0)),
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.1.2.3", 0)),
        ]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    assert discover_host() == "10.1.2.3"


def test_discover_host_without_a_non_loopback_address(monkeypatch: pytest.MonkeyPatch) -> None:
    def getaddrinfo(host: str, *args: Any) -> list[Any]:
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", 0))]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    assert discover_host() is None
    # The route to a loopback directory is loopback too: still nothing.
    assert discover_host(parse_grpc_endpoint("grpc://127.0.0.1:9005")) is None


async def test_disabled_without_a_directory_endpoint() -> None:
    values = parse_options(registration_options("MODEL_REGISTRY"), [], prog="t", description="t", environ={})
    assert values["directory_endpoint"] == ""
    registration = registration_from(values, [MODEL_REGISTRY])
    assert not registration.enabled
    await registration.start(1234)
    await registration.wait()
    await registration.stop()
    assert registration.registered == []


def test_options_from_the_environment() -> None:
    environ = {
        "COGMENT_DIRECTORY_ENDPOINT": "grpc://dir.example:9005",
        "COGMENT_DIRECTORY_AUTHENTICATION_TOKEN": "tok",
        "COGMENT_TRIAL_DATASTORE_DIRECTORY_REGISTRATION_HOST": "10.0.0.7",
        "COGMENT_TRIAL_DATASTORE_DIRECTORY_REGISTRATION_PROPERTIES": "a=1, b",
    }
    for name in ("TRIAL_DATASTORE", "COGMENT_TRIAL_DATASTORE"):
        values = parse_options(registration_options(name), [], prog="t", description="t", environ=environ)
        registration = registration_from(values, [directory_pb2.DATASTORE_SERVICE])
        assert registration.enabled
        assert registration.endpoint is not None and registration.endpoint.address == "dir.example:9005"
        assert registration.authentication_token == "tok"
        assert registration.host == "10.0.0.7"
        assert registration.properties == {"a": "1", "b": ""}
        assert registration.protocol == directory_pb2.ServiceEndpoint.GRPC


def test_flags_override_the_environment() -> None:
    environ = {"COGMENT_DIRECTORY_ENDPOINT": "grpc://dir.example:9005"}
    values = parse_options(
        registration_options("MODEL_REGISTRY"),
        ["--directory_endpoint", "grpc://[::1]:9006", "--directory_registration_properties", "x=y"],
        prog="t",
        description="t",
        environ=environ,
    )
    registration = registration_from(values, [MODEL_REGISTRY])
    assert registration.endpoint is not None and registration.endpoint.address == "[::1]:9006"
    assert registration.properties == {"x": "y"}


def test_unparsable_properties_are_ignored_with_a_warning() -> None:
    environ = {
        "COGMENT_DIRECTORY_ENDPOINT": "grpc://dir.example:9005",
        "COGMENT_MODEL_REGISTRY_DIRECTORY_REGISTRATION_PROPERTIES": "a=b=c",
    }
    values = parse_options(
        registration_options("MODEL_REGISTRY"), [], prog="t", description="t", environ=environ
    )
    with capture_logs() as logs:
        registration = registration_from(values, [MODEL_REGISTRY])
    assert registration.enabled
    assert registration.properties == {}
    assert [entry["log_level"] for entry in logs] == ["warning"]
    assert "more than one '='" in logs[0]["error"]


def test_invalid_directory_endpoint_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    environ = {"COGMENT_DIRECTORY_ENDPOINT": "dir.example:9005"}
    with pytest.raises(SystemExit) as caught:
        parse_options(registration_options("MODEL_REGISTRY"), [], prog="t", description="t", environ=environ)
    assert caught.value.code == 2
    assert "invalid value for COGMENT_DIRECTORY_ENDPOINT: invalid endpoint [dir.example:9005]" in (
        capsys.readouterr().err
    )
    with pytest.raises(SystemExit):
        parse_options(
            registration_options("MODEL_REGISTRY"),
            ["--directory_endpoint", "grpc://host"],
            prog="t",
            description="t",
            environ={},
        )
    assert "missing port" in capsys.readouterr().err


def test_invalid_endpoint_given_directly() -> None:
    with pytest.raises(ValueError, match="missing port"):
        DirectoryRegistration("grpc://localhost", [MODEL_REGISTRY])


@pytest.mark.skipif(not openssl_available(), reason="needs the openssl command to make certificates")
async def test_registers_in_a_directory_that_requires_mtls(
    directory_factory: DirectoryFactory, service_port: int, tmp_path: Path
) -> None:
    pki = make_pki(tmp_path / "pki")
    server_tls = ["--tls_cert", str(pki.server.cert), "--tls_key", str(pki.server.key)]
    async with directory_factory(*server_tls, "--tls_client_ca", str(pki.ca)) as directory:
        values = {
            "directory_endpoint": f"grpc://{directory.address}",
            "directory_registration_host": "127.0.0.1",
            "directory_tls_ca": str(pki.ca),
            "directory_tls_cert": str(pki.client.cert),
            "directory_tls_key": str(pki.client.key),
        }
        registration = registration_from(values, [MODEL_REGISTRY])
        await registration.start(service_port)
        await asyncio.wait_for(registration.wait(), WAIT_S)
        assert len(registration.registered) == 1
        async with grpc.aio.secure_channel(directory.address, pki.channel_credentials(pki.client)) as channel:
            stub = directory_pb2_grpc.DirectorySPStub(channel)
            request = directory_pb2.InquireRequest(details=directory_pb2.ServiceDetails(type=MODEL_REGISTRY))
            assert len([reply async for reply in stub.Inquire(request, timeout=5)]) == 1
            await registration.stop()
            assert [reply async for reply in stub.Inquire(request, timeout=5)] == []


async def test_unreadable_directory_tls_files_leave_the_service_unregistered(
    directory: RunningDirectory, tmp_path: Path
) -> None:
    values = {
        "directory_endpoint": f"grpc://{directory.address}",
        "directory_registration_host": "127.0.0.1",
        "directory_tls_ca": str(tmp_path / "missing-ca.pem"),
    }
    registration = registration_from(values, [MODEL_REGISTRY])
    with capture_logs() as logs:
        await registration.start(1234)
        await asyncio.wait_for(registration.wait(), WAIT_S)
    assert registration.registered == []
    assert any(entry["log_level"] == "error" and "missing-ca.pem" in str(entry.get("file")) for entry in logs)
    await registration.stop()


async def test_a_restarted_service_replaces_what_its_dead_predecessor_registered(
    directory: RunningDirectory, service_port: int, tmp_path: Path
) -> None:
    state_file = tmp_path / "data" / "registration.json"

    def process() -> DirectoryRegistration:
        return DirectoryRegistration(
            f"grpc://{directory.address}", [MODEL_REGISTRY], host="127.0.0.1", state_file=state_file
        )

    dead = process()
    await dead.start(service_port)
    await asyncio.wait_for(dead.wait(), WAIT_S)
    [old] = dead.registered
    assert state_file.stat().st_mode & 0o777 == 0o600  # it holds the secret
    # It dies without deregistering (kill -9); the next process serves on the same port.
    restarted = process()
    await restarted.start(service_port)
    await asyncio.wait_for(restarted.wait(), WAIT_S)
    [new] = restarted.registered
    assert new.service_id != old.service_id
    assert [found.service_id for found in await inquire(directory, MODEL_REGISTRY)] == [new.service_id]

    await restarted.stop()
    assert await inquire(directory, MODEL_REGISTRY) == []
    assert not state_file.exists()  # nothing left registered
