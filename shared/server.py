"""Server bootstrap shared by every service.

A service subclasses `Service` (start its storage and background work, add its servicers, stop)
and calls `run_service()`. This module supplies the rest: the grpc.aio server and its port (0
picks a free one, logged), `Version` and `Status` for every servicer (`VersionStatusMixin`), the
standard `grpc.health.v1` health service, optional reflection, optional TLS and mTLS, per-call
logging and Prometheus metrics, an unexpected-error guard (INTERNAL, never a crash), and a
graceful shutdown on SIGTERM/SIGINT that drains in-flight calls within a grace period.
"""

from __future__ import annotations

import asyncio
import gc
import inspect
import logging
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError
from google.protobuf.message_factory import GetMessageClass
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from shared import metrics
from shared.api import common_pb2
from shared.config import Option, parse_bool, parse_options, port_number, positive_float
from shared.db import DEFAULT_DATA_DIR, default_database_url
from shared.load import LoadMonitor
from shared.logging import configure_logging, get_logger, logging_options
from shared.version import COGMENT_API_VERSION, PACKAGE_VERSION

log = get_logger("shared.server")


def service_options(env_prefix: str, default_port: int) -> list[Option]:
    """Options every service has; `env_prefix` is e.g. `COGMENT_DIRECTORY`."""
    return [
        Option(
            "port",
            "gRPC port to listen on; 0 picks a free port",
            default_port,
            f"{env_prefix}_PORT",
            port_number,
        ),
        Option("bind_address", "address to listen on", "0.0.0.0", f"{env_prefix}_BIND_ADDRESS"),
        Option(
            "grpc_reflection", "serve gRPC reflection", False, f"{env_prefix}_GRPC_REFLECTION", parse_bool
        ),
        Option(
            "health_port",
            "also serve grpc.health.v1, in plaintext, on this port (for Kubernetes' gRPC probes, "
            "which cannot speak TLS); off when unset",
            None,
            f"{env_prefix}_HEALTH_PORT",
            port_number,
        ),
        Option(
            "metrics_port",
            "serve Prometheus metrics over HTTP on this port (off when unset)",
            None,
            f"{env_prefix}_METRICS_PORT",
            port_number,
        ),
        Option(
            "data_dir",
            "directory of the embedded database and local files (created if missing)",
            DEFAULT_DATA_DIR,
            f"{env_prefix}_DATA_DIR",
        ),
        Option(
            "database_url",
            "SQLAlchemy URL: sqlite+aiosqlite:///FILE or postgresql+psycopg://... "
            "(default: an SQLite file in the data directory)",
            None,
            f"{env_prefix}_DATABASE_URL",
        ),
        Option("tls_cert", "PEM server certificate file: serve TLS", None, f"{env_prefix}_TLS_CERT"),
        Option("tls_key", "PEM private key file of the server certificate", None, f"{env_prefix}_TLS_KEY"),
        Option(
            "tls_client_ca",
            "PEM CA bundle: require client certificates signed by it (mTLS)",
            None,
            f"{env_prefix}_TLS_CLIENT_CA",
        ),
        Option(
            "shutdown_grace",
            "seconds given to in-flight calls on shutdown",
            5.0,
            f"{env_prefix}_SHUTDOWN_GRACE",
            positive_float,
        ),
        *logging_options(),
    ]


def database_url(values: dict[str, Any], service: str) -> str:
    return str(values["database_url"] or default_database_url(values["data_dir"], service))


StatusProvider = Callable[[], Awaitable[str]]


class ServiceRuntime:
    """What every servicer shares: versions, statuses and the load monitor."""

    def __init__(self, service: str, load: LoadMonitor) -> None:
        self.load = load
        self._versions = [
            ("cogment-api", COGMENT_API_VERSION),
            ("grpc", grpc.__version__),
            ("cogment-aux", PACKAGE_VERSION),
            (f"cogment-aux-{service}", PACKAGE_VERSION),
        ]
        self._statuses: dict[str, StatusProvider] = {}
        self.add_status("overall_load", self._overall_load)

    async def _overall_load(self) -> str:
        return str(self.load.overall_load)

    def add_status(self, name: str, provider: StatusProvider) -> None:
        self._statuses[name] = provider

    def version_info(self) -> common_pb2.VersionInfo:
        return common_pb2.VersionInfo(
            versions=[common_pb2.VersionInfo.Version(name=name, version=v) for name, v in self._versions]
        )

    async def status_reply(self, names: Iterable[str]) -> common_pb2.StatusReply:
        """Names are read in order, unknown ones ignored; `*` adds every status and ends the scan."""
        wanted: list[str] = []
        for name in names:
            if name == "*":
                wanted.extend(self._statuses)
                break
            if name in self._statuses:
                wanted.append(name)
        reply = common_pb2.StatusReply()
        for name in dict.fromkeys(wanted):
            reply.statuses[name] = await self._statuses[name]()
        return reply


class VersionStatusMixin:
    """`Version` and `Status`, which every Cogment service answers the same way."""

    runtime: ServiceRuntime

    async def Version(self, request: common_pb2.VersionRequest, context: Any) -> common_pb2.VersionInfo:
        return self.runtime.version_info()

    async def Status(self, request: common_pb2.StatusRequest, context: Any) -> common_pb2.StatusReply:
        return await self.runtime.status_reply(request.names)


# ---- per-call logging, metrics and the unexpected-error guard ----

_RPC_TYPES = {
    (False, False): "unary",
    (False, True): "server_stream",
    (True, False): "client_stream",
    (True, True): "bidi_stream",
}
_HANDLER_FACTORIES = {
    "unary": (grpc.unary_unary_rpc_method_handler, "unary_unary"),
    "server_stream": (grpc.unary_stream_rpc_method_handler, "unary_stream"),
    "client_stream": (grpc.stream_unary_rpc_method_handler, "stream_unary"),
    "bidi_stream": (grpc.stream_stream_rpc_method_handler, "stream_stream"),
}
INTERNAL_ERROR_MESSAGE = "internal error (logged on the server)"
# gRPC's default is 4 MiB, but what a service sends back must be accepted again: a stored trial
# sample (reward user data is copied per receiver) can be larger, and its export re-imported.
MAX_RECEIVE_MESSAGE_BYTES = 64 * 1024 * 1024


@dataclass
class _CallRecorder:
    """Metrics children and log fields of one method, looked up once rather than per call."""

    rpc: str
    labels: tuple[str, str, str]
    started: Any
    seconds: Any
    handled: dict[grpc.StatusCode, Any]

    @classmethod
    def for_method(cls, method: str, rpc_type: str) -> _CallRecorder:
        service, _, name = method.lstrip("/").partition("/")
        labels = (rpc_type, service, name)
        return cls(
            rpc=method,
            labels=labels,
            started=metrics.started_total.labels(*labels),
            seconds=metrics.handling_seconds.labels(*labels),
            handled={},
        )

    def finish(self, code: grpc.StatusCode, started_at: float, context: Any, peer: str) -> None:
        elapsed = time.perf_counter() - started_at
        handled = self.handled.get(code)
        if handled is None:
            handled = self.handled[code] = metrics.handled_total.labels(*self.labels, code.name)
        handled.inc()
        self.seconds.observe(elapsed)
        if code in (grpc.StatusCode.OK, grpc.StatusCode.CANCELLED):
            if log.is_enabled_for(logging.DEBUG):  # skip building the fields on the hot path
                log.debug("rpc", rpc=self.rpc, code=code.name, seconds=round(elapsed, 6), peer=peer)
        else:
            log.info(
                "rpc failed",
                rpc=self.rpc,
                code=code.name,
                details=context.details(),
                peer=peer,
                seconds=round(elapsed, 6),
            )


def _final_code(context: Any) -> grpc.StatusCode:
    code = context.code()
    if code is None:
        return grpc.StatusCode.OK
    return code if isinstance(code, grpc.StatusCode) else grpc.StatusCode.UNKNOWN


async def _guard_unexpected(error: Exception, recorder: _CallRecorder, context: Any) -> None:
    log.error("unexpected error in rpc", rpc=recorder.rpc, exc_info=error)
    await context.abort(grpc.StatusCode.INTERNAL, INTERNAL_ERROR_MESSAGE)


# Stands for request bytes that do not parse: the call then ends with INVALID_ARGUMENT (grpc
# itself would answer UNKNOWN, or the handler's loop INTERNAL).
_UNDECODABLE = object()
UNDECODABLE_MESSAGE = "request is not a valid message of this method's type"


def _tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except DecodeError:
            return _UNDECODABLE

    return deserialize


async def _checked_stream(requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
    async for request in requests:
        if request is _UNDECODABLE:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, UNDECODABLE_MESSAGE)
        yield request


async def _admitted(request: Any, streaming: bool, context: Any) -> Any:
    if streaming:
        return _checked_stream(request, context)
    if request is _UNDECODABLE:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, UNDECODABLE_MESSAGE)
    return request


class _ObservedCall:
    """Counts, times and logs one call; turns an unexpected error into INTERNAL."""

    __slots__ = ("context", "peer", "recorder", "started_at")

    def __init__(self, recorder: _CallRecorder, context: Any) -> None:
        self.recorder = recorder
        self.context = context
        self.started_at = 0.0
        self.peer = ""

    async def __aenter__(self) -> None:
        self.recorder.started.inc()
        self.started_at = time.perf_counter()
        # Read now: grpcio 1.85 can crash (SIGSEGV) in `peer()` once the client cancelled the call.
        self.peer = self.context.peer()

    async def __aexit__(self, _type: Any, error: BaseException | None, _traceback: Any) -> bool:
        if error is None or isinstance(error, grpc.aio.AbortError):
            code = _final_code(self.context)
        elif isinstance(error, (asyncio.CancelledError, GeneratorExit)):
            code = grpc.StatusCode.CANCELLED
        else:
            code = grpc.StatusCode.INTERNAL if isinstance(error, Exception) else grpc.StatusCode.UNKNOWN
        self.recorder.finish(code, self.started_at, self.context, self.peer)
        if code is grpc.StatusCode.INTERNAL and isinstance(error, Exception):
            await _guard_unexpected(error, self.recorder, self.context)  # raises AbortError
        return False


def _wrap_unary_response(
    behavior: Callable[..., Any], recorder: _CallRecorder, streaming: bool
) -> Callable[..., Any]:
    async def handle(request: Any, context: Any) -> Any:
        async with _ObservedCall(recorder, context):
            return await behavior(await _admitted(request, streaming, context), context)

    return handle


def _wrap_stream_response(
    behavior: Callable[..., Any], recorder: _CallRecorder, streaming: bool
) -> Callable[..., Any]:
    async def handle(request: Any, context: Any) -> AsyncIterator[Any]:
        async with _ObservedCall(recorder, context):
            async for response in behavior(await _admitted(request, streaming, context), context):
                yield response

    return handle


class ObservabilityInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    def __init__(self) -> None:
        self._handlers: dict[str, Any] = {}

    async def intercept_service(self, continuation: Callable[..., Any], details: Any) -> Any:
        handler = await continuation(details)
        if handler is None:
            return None
        method = details.method
        cached = self._handlers.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        rpc_type = _RPC_TYPES[(handler.request_streaming, handler.response_streaming)]
        factory, attribute = _HANDLER_FACTORIES[rpc_type]
        behavior = getattr(handler, attribute)
        recorder = _CallRecorder.for_method(method, rpc_type)
        wrap = _wrap_stream_response if inspect.isasyncgenfunction(behavior) else _wrap_unary_response
        new_handler = factory(
            wrap(behavior, recorder, handler.request_streaming),
            request_deserializer=_tolerant(handler.request_deserializer),
            response_serializer=handler.response_serializer,
        )
        self._handlers[method] = (handler, new_handler)
        return new_handler


# ---- entry points ----


def run_service_main(
    options: Sequence[Option],
    service_class: Callable[[dict[str, Any]], Service],
    argv: Sequence[str] | None,
    *,
    prog: str,
    description: str,
) -> int:
    """What `python -m services.<name>` does: read the flags, set up logging, serve until a signal."""
    values = parse_options(options, argv, prog=prog, description=description)
    configure_logging(values["log_level"], values["log_format"], values["log_file"])
    asyncio.run(serve(service_class(values)))
    return 0


# ---- registering servicers ----

_HANDLER_BY_STREAMING = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def add_servicer(
    server: grpc.aio.Server,
    service: ServiceDescriptor,
    servicer: object,
    response_serializers: Mapping[str, Callable[[Any], bytes]] | None = None,
) -> None:
    """Serve every method of `service` with the servicer's method of the same name.

    What the generated `add_*Servicer_to_server` functions do, plus per-method response
    serializers: a method can then yield bytes it encoded itself (e.g. large data chunks framed
    without building, then serializing, a message around each).
    """
    overrides = response_serializers or {}
    handlers = {}
    for method in service.methods:
        factory = _HANDLER_BY_STREAMING[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = factory(
            getattr(servicer, method.name),
            request_deserializer=GetMessageClass(method.input_type).FromString,
            response_serializer=overrides.get(
                method.name, GetMessageClass(method.output_type).SerializeToString
            ),
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)


def field_one_frame(payload: bytes) -> bytes:
    """The encoding of a message whose field 1 (bytes, or an embedded message) holds `payload`.

    Streams of large or many replies yield these (with `pre_encoded` as the method's response
    serializer): building a message around a payload, then serializing it, copies the payload
    twice more on the event loop, and that bounds the stream's speed. The wire bytes are the same.
    """
    length = len(payload)
    prefix = bytearray(b"\x0a")
    while length > 0x7F:
        prefix.append((length & 0x7F) | 0x80)
        length >>= 7
    prefix.append(length)
    return bytes(prefix) + payload


def pre_encoded(frame: bytes) -> bytes:
    """Response serializer of methods that yield encoded messages."""
    return frame


# ---- the service life cycle ----


class Service:
    """One deployable service. Subclasses override what they need."""

    name: str = "service"

    def __init__(self, values: dict[str, Any]) -> None:
        self.values = values
        # The bound port, once serving (the configured one may be 0).
        self.port: int | None = None

    @property
    def grpc_service_names(self) -> Sequence[str]:
        """Full names of the gRPC services served (for health and reflection)."""
        raise NotImplementedError

    async def start(self, runtime: ServiceRuntime) -> None:
        """Open storage and start background work, before the port opens."""

    def add_servicers(self, server: grpc.aio.Server, runtime: ServiceRuntime) -> None:
        raise NotImplementedError

    async def on_serving(self, port: int) -> None:
        """Called once the port is open (e.g. to register in a directory)."""

    async def on_shutdown(self) -> None:
        """Called when shutdown begins, while calls still drain (e.g. to deregister)."""

    async def stop(self) -> None:
        """Called after the server stopped: release storage and background work."""


class StartupError(Exception):
    """A start-up problem the operator has to fix: logged as one clear line, exit status 1."""


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as error:
        raise StartupError(f"cannot read {what} {path}: {error.strerror}") from None


def _bind(server: grpc.aio.Server, values: dict[str, Any]) -> int:
    address = f"{values['bind_address']}:{values['port']}"
    try:
        if values["tls_cert"] or values["tls_key"]:
            if not (values["tls_cert"] and values["tls_key"]):
                raise StartupError("--tls_cert and --tls_key go together")
            client_ca = _read(values["tls_client_ca"], "--tls_client_ca") if values["tls_client_ca"] else None
            credentials = grpc.ssl_server_credentials(
                [(_read(values["tls_key"], "--tls_key"), _read(values["tls_cert"], "--tls_cert"))],
                root_certificates=client_ca,
                require_client_auth=client_ca is not None,
            )
            port = server.add_secure_port(address, credentials)
        elif values["tls_client_ca"]:
            raise StartupError("--tls_client_ca needs --tls_cert and --tls_key")
        else:
            port = server.add_insecure_port(address)
    except RuntimeError:  # grpc's way of saying the address could not be bound
        port = 0
    if port == 0:
        raise StartupError(f"could not listen on {address}: in use, or not an address of this machine")
    return int(port)


def _bind_health(values: dict[str, Any], health: HealthServicer) -> tuple[grpc.aio.Server | None, int | None]:
    """The plaintext server of `--health_port` (the health service alone), and its port."""
    if values["health_port"] is None:
        return None, None
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    address = f"{values['bind_address']}:{values['health_port']}"
    try:
        port = server.add_insecure_port(address)
    except RuntimeError:
        port = 0
    if port == 0:
        raise StartupError(f"could not listen on {address} (--health_port): in use, or not an address")
    return server, int(port)


def _serve_metrics(values: dict[str, Any]) -> int | None:
    if values["metrics_port"] is None:
        return None
    try:
        return metrics.serve_metrics(values["metrics_port"], values["bind_address"])
    except OSError as error:
        raise StartupError(
            f"could not serve metrics on {values['bind_address']}:{values['metrics_port']}: {error.strerror}"
        ) from None


async def serve(
    service: Service, stop_event: asyncio.Event | None = None, *, handle_signals: bool = True
) -> None:
    """Run `service` until SIGTERM/SIGINT (or `stop_event`), then shut it down gracefully.

    Ports are bound before the service opens its storage, so a misconfiguration fails fast and
    the `serving` line is only logged once everything listens. Start-up problems exit with
    status 1 and one clear log line.
    """
    values = service.values
    server = grpc.aio.server(
        interceptors=[ObservabilityInterceptor()],
        # No SO_REUSEPORT: a second instance on a port in use must fail, not share the connections.
        options=[("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", MAX_RECEIVE_MESSAGE_BYTES)],
    )
    health = HealthServicer()
    try:
        port = _bind(server, values)
        health_server, health_port = _bind_health(values, health)
        metrics_port = _serve_metrics(values)
    except StartupError as error:
        log.error("cannot start", service=service.name, error=str(error))
        raise SystemExit(1) from None

    stop_event = stop_event or asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = (signal.SIGTERM, signal.SIGINT) if handle_signals else ()
    for sig in signals:
        loop.add_signal_handler(sig, stop_event.set)
    load = LoadMonitor()
    load.start()
    runtime = ServiceRuntime(service.name, load)
    try:
        await service.start(runtime)
    except Exception as error:
        log.error("cannot start", service=service.name, error=str(error), exc_info=error)
        await service.stop()
        await load.stop()
        raise SystemExit(1) from None

    try:
        service.add_servicers(server, runtime)
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        names = list(service.grpc_service_names)
        if values["grpc_reflection"]:
            reflection.enable_server_reflection(
                [*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
                server,
            )
        await server.start()
        if health_server is not None:
            await health_server.start()
        # Start-up objects (modules, protos, SQL metadata) live as long as the process: keep them
        # out of the collector's full passes, which otherwise show up as latency spikes.
        gc.freeze()
        service.port = port
        for name in ["", *names]:
            await health.set(name, health_pb2.HealthCheckResponse.SERVING)
        load.serviceable = True
        log.info(
            "serving",
            service=service.name,
            port=port,
            address=values["bind_address"],
            tls=bool(values["tls_cert"]),
            mtls=bool(values["tls_client_ca"]),
            health_port=health_port,
            version=PACKAGE_VERSION,
        )
        if metrics_port is not None:
            log.info("serving metrics", port=metrics_port, path="/metrics")
        await service.on_serving(port)
        await stop_event.wait()
        log.info("shutting down", service=service.name, grace_seconds=values["shutdown_grace"])
        load.serviceable = False
        await health.enter_graceful_shutdown()
        await service.on_shutdown()
    finally:
        await server.stop(values["shutdown_grace"])
        if health_server is not None:
            await health_server.stop(None)
        await service.stop()
        await load.stop()
        for sig in signals:
            loop.remove_signal_handler(sig)
    log.info("stopped", service=service.name)
