"""The life cycle of a service's server.

A service subclasses `Service` (start its storage and background work, add its servicers, stop)
and is run by `serve()`: the grpc.aio server and its port (0 picks a free one, logged), the
standard `grpc.health.v1` health service, optional reflection, optional TLS and mTLS, calls
observed by `shared.observer`, and a graceful shutdown on SIGTERM/SIGINT that drains in-flight
calls within a grace period.
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import socket
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from shared import metrics
from shared.config import parse_options
from shared.db import Database
from shared.dependencies import Dependencies
from shared.directory_registration import DirectoryRegistration
from shared.endpoints import ServiceType
from shared.errors import StartupError, classify, describe
from shared.load import LoadMonitor
from shared.logging import configure_logging, get_logger
from shared.observer import ObservabilityInterceptor
from shared.registration import RegistrationSettings
from shared.runtime import ServiceRuntime
from shared.settings import ServerSettings
from shared.tls_files import ca_error, key_pair_error
from shared.validation import MAX_RECEIVE_MESSAGE_BYTES
from shared.version import COGMENT_API_VERSION, PACKAGE_VERSION

log = get_logger("shared.server")

# The grpc.health.v1 service name of liveness: SERVING as long as the process serves, whatever its
# dependencies; "" and each served service tell readiness.
LIVENESS_SERVICE = "liveness"
HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
# Set by a supervisor to a file descriptor the service writes a line to once it serves: one that
# exits without having written it failed to start (`python -m services` says which did).
SERVING_FD_ENV = "COGMENT_AUX_SERVING_FD"
# The `service` label of a service's metrics where it differs from its name: the name in its
# families' prefix (cogment_trial_datastore_*).
METRICS_NAMES = {"datastore": "trial_datastore"}
SettingsT = TypeVar("SettingsT", bound=ServerSettings)
ServiceT = TypeVar("ServiceT", bound="Service[Any]")


class Service(Generic[SettingsT]):
    """One deployable service, configured by its typed settings. Subclasses override what they
    need, and name their settings class in `settings_type`.

    The constructor is the service's composition root: it builds every part from the settings,
    except the dependencies given to it (the database here; a subclass may take more, such as a
    blob store), which tests pass in to run the service on parts of their own."""

    # `python -m services.<name>`: its settings (and their option table) and what `--help` says of it.
    name: ClassVar[str] = "service"
    settings_type: ClassVar[type[ServerSettings]] = ServerSettings
    description: ClassVar[str] = ""

    def __init__(self, settings: SettingsT, *, database: Database | None = None) -> None:
        self.settings = settings
        # Closed by `serve()` once the service stopped.
        self.database = database or Database(settings.database_url_of(self.name))
        # What the service needs to serve; `serve()` watches them (readiness, riding out outages).
        self.dependencies = Dependencies(
            [self.database.as_dependency()], settings.outage_bound, service=self.metrics_name
        )
        # The bound port, once serving (the configured one may be 0).
        self.port: int | None = None
        # Its registration in a directory, if it registers itself: `serve()` starts it once the
        # port is open and deregisters when shutdown begins.
        self.registration: DirectoryRegistration | None = None

    @property
    def metrics_name(self) -> str:
        """The `service` label of its metrics."""
        return METRICS_NAMES.get(self.name, self.name)

    async def start(self, runtime: ServiceRuntime) -> None:
        """Open storage and start background work, before the port opens."""

    def add_servicers(self, server: grpc.aio.Server, runtime: ServiceRuntime) -> Sequence[str]:
        """Serve the service's gRPC services on `server`; their full names (for health and
        reflection)."""
        raise NotImplementedError

    def directory_registration(self, service_types: Sequence[ServiceType]) -> DirectoryRegistration:
        """This service's registration as `service_types` in the directory its settings name (they
        include `registration_options()`), for `self.registration`. What it registered is kept in
        the data directory: what a process that died left registered is deregistered by the next."""
        settings = self.settings
        assert isinstance(settings, RegistrationSettings), "the service has no registration options"
        return DirectoryRegistration.from_settings(
            settings,
            service_types,
            bind_address=settings.bind_address,
            ssl=bool(settings.tls_cert),
            state_file=Path(settings.data_dir) / f"{self.name}-directory-registration.json",
        )

    async def stop(self) -> None:
        """Called after the server stopped: release storage and background work."""

    @classmethod
    def from_values(cls: type[ServiceT], values: Mapping[str, Any]) -> ServiceT:
        """The service configured by option values (see `shared.config.parse_options`)."""
        return cls(cls.settings_type.from_values(values))


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as error:
        raise StartupError(f"cannot read {what} {path}: {error.strerror}") from None


def _check_tls_files(cert: str, key: str, client_ca: str | None) -> None:
    """Raise a StartupError naming what is wrong with the TLS files: grpc would only fail to
    listen, without saying why."""
    if (reason := key_pair_error(cert, key)) is not None:
        raise StartupError(
            f"--tls_cert {cert} and --tls_key {key} are not a PEM certificate and its private key ({reason})"
        )
    if client_ca and (reason := ca_error(client_ca)) is not None:
        raise StartupError(f"--tls_client_ca {client_ca} is not a PEM CA bundle ({reason})")


def _check_can_listen(host: str, port: int, flag: str) -> None:
    """Raise a StartupError saying why `host`:`port` cannot be listened on: grpc would fail
    without a reason, after printing its own core log line."""
    where = f"{host}:{port} ({flag})"
    try:
        addresses = socket.getaddrinfo(
            host.strip("[]") or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as error:
        raise StartupError(f"could not listen on {where}: {error.strerror}") from None
    for family, kind, protocol, _name, address in addresses:
        try:
            probe = socket.socket(family, kind, protocol)
        except OSError:
            continue  # a family this host does not have (IPv6 turned off): grpc skips it too
        with probe:
            # As grpc's listeners: a port whose old connections linger (TIME_WAIT) is free.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as error:
                raise StartupError(f"could not listen on {where}: {error.strerror}") from None


def _bind(server: grpc.aio.Server, settings: ServerSettings) -> int:
    address = f"{settings.bind_address}:{settings.port}"
    _check_can_listen(settings.bind_address, settings.port, "--port")
    try:
        if settings.tls_cert or settings.tls_key:
            if not (settings.tls_cert and settings.tls_key):
                raise StartupError("--tls_cert and --tls_key go together")
            client_ca = _read(settings.tls_client_ca, "--tls_client_ca") if settings.tls_client_ca else None
            credentials = grpc.ssl_server_credentials(
                [(_read(settings.tls_key, "--tls_key"), _read(settings.tls_cert, "--tls_cert"))],
                root_certificates=client_ca,
                require_client_auth=client_ca is not None,
            )
            _check_tls_files(settings.tls_cert, settings.tls_key, settings.tls_client_ca)
            port = server.add_secure_port(address, credentials)
        elif settings.tls_client_ca:
            raise StartupError("--tls_client_ca needs --tls_cert and --tls_key")
        else:
            port = server.add_insecure_port(address)
    except RuntimeError:  # grpc's way of saying the address could not be bound
        port = 0
    if port == 0:
        raise StartupError(f"could not listen on {address}: in use, or not an address of this machine")
    return int(port)


def _bind_health(
    settings: ServerSettings, health: HealthServicer
) -> tuple[grpc.aio.Server | None, int | None]:
    """The plaintext server of `--health_port` (the health service alone), and its port."""
    if settings.health_port is None:
        return None, None
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    # Reflection of the health service alone, so that grpcurl needs no proto file there.
    reflection.enable_server_reflection([HEALTH_SERVICE, reflection.SERVICE_NAME], server)
    address = f"{settings.bind_address}:{settings.health_port}"
    _check_can_listen(settings.bind_address, settings.health_port, "--health_port")
    try:
        port = server.add_insecure_port(address)
    except RuntimeError:
        port = 0
    if port == 0:
        raise StartupError(f"could not listen on {address} (--health_port): in use, or not an address")
    return server, int(port)


def _serve_metrics(settings: ServerSettings) -> int | None:
    if settings.metrics_port is None:
        return None
    try:
        return metrics.serve_metrics(settings.metrics_port, settings.bind_address)
    except OSError as error:
        raise StartupError(
            f"could not serve metrics on {settings.bind_address}:{settings.metrics_port}: {error.strerror}"
        ) from None


async def serve(
    service: Service[Any],
    stop_event: asyncio.Event | None = None,
    *,
    handle_signals: bool = True,
    on_serving: Callable[[], None] | None = None,
) -> None:
    """Run `service` until SIGTERM/SIGINT (or `stop_event`), then shut it down gracefully.

    Ports are bound before the service opens its storage, so a misconfiguration fails fast and
    the `serving` line is only logged once everything listens (`on_serving` is called then).
    Start-up problems exit with status 1 and one clear log line.
    """
    settings = service.settings
    dependencies = service.dependencies
    server = grpc.aio.server(
        interceptors=[ObservabilityInterceptor(dependencies.suspect)],
        options=[
            # No SO_REUSEPORT: a second instance on a port in use must fail, not share the connections.
            ("grpc.so_reuseport", 0),
            ("grpc.max_receive_message_length", MAX_RECEIVE_MESSAGE_BYTES),
            # No bandwidth-delay probing: it grows the flow-control windows of the streams a service
            # has stopped reading (to bound what it holds) until gRPC itself buffers hundreds of MiB
            # for them. A message being read still gets a window of its whole size.
            ("grpc.http2.bdp_probe", 0),
        ],
    )
    health = HealthServicer()
    try:
        port = _bind(server, settings)
        health_server, health_port = _bind_health(settings, health)
        metrics_port = _serve_metrics(settings)
    except StartupError as error:
        log.error("cannot start", service=service.name, error=str(error))
        raise SystemExit(1) from None

    stop_event = stop_event or asyncio.Event()
    shutdown_deadline: float | None = None  # the event loop's time by which the server stops
    loop = asyncio.get_running_loop()
    signals = (signal.SIGTERM, signal.SIGINT) if handle_signals else ()
    for sig in signals:
        loop.add_signal_handler(sig, stop_event.set)
    metrics.build_info.labels(service.metrics_name, PACKAGE_VERSION, COGMENT_API_VERSION).set(1)
    ready_gauge = metrics.ready.labels(service.metrics_name)
    ready_gauge.set(0)
    load = LoadMonitor()
    load.start()
    runtime = ServiceRuntime(service.name, load)
    try:
        await service.start(runtime)
    except Exception as error:
        # A dependency that cannot be reached is said in one line; a bug with its traceback.
        unreachable = classify(error) is not None or isinstance(error, StartupError)
        log.error(
            "cannot start",
            service=service.name,
            error=describe(error) if unreachable else str(error),
            exc_info=None if unreachable else error,
        )
        await service.stop()
        await service.database.close()
        await load.stop()
        raise SystemExit(1) from None

    try:
        names = list(service.add_servicers(server, runtime))
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        if settings.grpc_reflection:
            reflection.enable_server_reflection(
                [*names, HEALTH_SERVICE, reflection.SERVICE_NAME],
                server,
            )
        await server.start()
        if health_server is not None:
            await health_server.start()
        # Start-up objects (modules, protos, SQL metadata) live as long as the process: keep them
        # out of the collector's full passes, which otherwise show up as latency spikes.
        gc.freeze()
        service.port = port
        serving = True

        async def set_readiness(ready: bool) -> None:
            # Readiness follows the dependencies; liveness does not (no restarts for an outage).
            if serving:
                status = (
                    health_pb2.HealthCheckResponse.SERVING
                    if ready
                    else health_pb2.HealthCheckResponse.NOT_SERVING
                )
                for name in ["", *names]:
                    await health.set(name, status)
                load.serviceable = ready
                ready_gauge.set(1 if ready else 0)

        await health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        await set_readiness(True)
        dependencies.on_change(set_readiness)
        dependencies.start()
        log.info(
            "serving",
            service=service.name,
            port=port,
            address=settings.bind_address,
            tls=bool(settings.tls_cert),
            mtls=bool(settings.tls_client_ca),
            health_port=health_port,
            version=PACKAGE_VERSION,
        )
        if on_serving is not None:
            on_serving()
        if metrics_port is not None:
            log.info("serving metrics", port=metrics_port, path="/metrics")
        if service.registration is not None:
            await service.registration.start(port)
        await stop_event.wait()
        log.info("shutting down", service=service.name, grace_seconds=settings.shutdown_grace)
        shutdown_deadline = loop.time() + settings.shutdown_grace
        serving = False
        load.serviceable = False
        ready_gauge.set(0)
        await health.enter_graceful_shutdown()
        if service.registration is not None:
            # Deregistered before the port closes, so that nobody is sent to a closed port. A
            # directory that is gone gets half the grace at most: in-flight calls have the rest.
            await service.registration.stop(timeout_s=settings.shutdown_grace / 2)
    finally:
        grace = settings.shutdown_grace if shutdown_deadline is None else shutdown_deadline - loop.time()
        await server.stop(max(grace, 0.0))
        if health_server is not None:
            await health_server.stop(None)
        await service.stop()  # while the dependencies are still watched: pending writes may need them
        await dependencies.stop()
        await service.database.close()
        await load.stop()
        for sig in signals:
            loop.remove_signal_handler(sig)
    log.info("stopped", service=service.name)


def run_service_main(
    service_class: type[Service[Any]], argv: Sequence[str] | None = None, prog: str | None = None
) -> int:
    """What `python -m services.<name>` (or `prog`) does: read the flags, set up logging, serve
    until a signal."""
    values = parse_options(
        service_class.settings_type.options,
        argv,
        prog=prog or f"python -m services.{service_class.name}",
        description=service_class.description,
    )
    settings = service_class.settings_type.from_values(values)
    configure_logging(settings.log_level, settings.log_format, settings.log_file, service=service_class.name)
    on_serving = supervisor_notifier()
    try:
        service = service_class(settings)
    except StartupError as error:
        log.error("cannot start", service=service_class.name, error=str(error))
        return 1
    asyncio.run(serve(service, on_serving=on_serving))
    return 0


def supervisor_notifier() -> Callable[[], None] | None:
    """What tells the supervisor that started this process (`python -m services`) that it serves:
    a line written to the file descriptor `SERVING_FD_ENV` names, if any. The variable is removed,
    so that nothing this process starts inherits it."""
    text = os.environ.pop(SERVING_FD_ENV, "")
    try:
        fd = int(text)
    except ValueError:
        return None

    def notify() -> None:
        try:
            os.write(fd, b"serving\n")  # a few bytes into an empty pipe: never blocks
            os.close(fd)
        except OSError:
            pass  # the supervisor is gone: nobody left to tell

    return notify
