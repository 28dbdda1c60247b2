"""The console's options and life cycle: an HTTP server (uvicorn) on 127.0.0.1:9010 by default,
reading the three services through their gRPC APIs. Serving another interface needs an access
token, unless the operator opts out with a flag that names the risk."""

from __future__ import annotations

import asyncio
import ipaddress
import signal
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import uvicorn

from services.console.app import build_app
from services.console.decode import DecoderError, Decoders
from services.console.sources import Sources, SourceSettings
from services.console.views import DEFAULT_CURVES_BYTES, MIN_CURVE_BYTES, TRIAL_CURVE_BYTES, Console
from shared.channel import ClientTls
from shared.cli import TLS_OPTIONS, tls_of
from shared.config import Option, parse_bool, parse_options, port_number, positive_int
from shared.logging import configure_logging, get_logger, logging_options
from shared.server import supervisor_notifier

DEFAULT_PORT = 9010
# Seconds a stop (SIGTERM, Ctrl-C) gives open requests before they are cut: the streams of the
# pages left open (a running trial's curves, a model's versions) would otherwise never end.
SHUTDOWN_GRACE_S = 3
ENV_PREFIX = "COGMENT_CONSOLE"
DESCRIPTION = """\
The Cogment web console: trials with their reward curves and samples, models and their versions,
and the directory, in a browser. It reads everything through the services' gRPC APIs (any Cogment
2.x deployment). An endpoint not given is discovered through the directory."""

OPTIONS: list[Option] = [
    Option(
        "port", "HTTP port to listen on; 0 picks a free port", DEFAULT_PORT, f"{ENV_PREFIX}_PORT", port_number
    ),
    Option(
        "host",
        "address to listen on; another interface than the loopback needs --auth_token",
        "127.0.0.1",
        f"{ENV_PREFIX}_HOST",
    ),
    Option(
        "directory_endpoint",
        "the directory, grpc://host:port (grpcs:// over TLS); empty: none (give the other two)",
        "grpc://localhost:9005",
        "COGMENT_DIRECTORY_ENDPOINT",
    ),
    Option(
        "model_registry_endpoint",
        "the model registry; empty: discovered through the directory",
        "",
        "COGMENT_MODEL_REGISTRY_ENDPOINT",
    ),
    Option(
        "trial_datastore_endpoint",
        "the trial datastore; empty: discovered through the directory",
        "",
        "COGMENT_TRIAL_DATASTORE_ENDPOINT",
    ),
    Option(
        "directory_authentication_token",
        "the directory token the entries are scoped by",
        "",
        "COGMENT_DIRECTORY_AUTHENTICATION_TOKEN",
    ),
    *TLS_OPTIONS,
    Option(
        "auth_token",
        "access token of the console: asked once in the page (or sent as a bearer token); "
        "required to serve another interface than the loopback",
        "",
        f"{ENV_PREFIX}_AUTH_TOKEN",
    ),
    Option(
        "allow_anyone_on_the_network",
        "serve another interface than the loopback without an access token: anyone who reaches "
        "the port reads every trial, model and entry",
        False,
        f"{ENV_PREFIX}_ALLOW_ANYONE_ON_THE_NETWORK",
        parse_bool,
    ),
    Option(
        "curves_bytes",
        "memory for the reward curves drawn at once, in bytes: each trial page (or trial of a "
        f"comparison) being drawn takes up to {TRIAL_CURVE_BYTES >> 20} MiB of it; past it, a "
        "page says to try again in a moment",
        DEFAULT_CURVES_BYTES,
        f"{ENV_PREFIX}_CURVES_BYTES",
        positive_int,
    ),
    Option(
        "proto_module",
        "Python modules of the trials' compiled protobuf messages, comma-separated (e.g. "
        "services.demo.api.spec_pb2): the inspector decodes observations and actions with them",
        "",
        f"{ENV_PREFIX}_PROTO_MODULE",
    ),
    Option(
        "messages",
        "messages of each actor class, CLASS=OBSERVATION,ACTION (full names) separated by "
        "semicolons, e.g. player=cogment_aux_demo.Observation,cogment_aux_demo.Action",
        "",
        f"{ENV_PREFIX}_MESSAGES",
    ),
    *logging_options(),
]

log = get_logger("console")


class ConfigurationError(ValueError):
    """Settings that cannot be served; the message names the flags."""


@dataclass(frozen=True)
class ConsoleSettings:
    port: int = DEFAULT_PORT
    host: str = "127.0.0.1"
    directory_endpoint: str = "grpc://localhost:9005"
    model_registry_endpoint: str = ""
    trial_datastore_endpoint: str = ""
    directory_authentication_token: str = ""
    tls: ClientTls | None = None
    auth_token: str = ""
    allow_anyone_on_the_network: bool = False
    curves_bytes: int = DEFAULT_CURVES_BYTES
    proto_module: str = ""
    messages: str = ""

    @classmethod
    def from_values(cls, values: dict[str, Any]) -> ConsoleSettings:
        names = set(cls.__dataclass_fields__) - {"tls"}
        return cls(tls=tls_of(values), **{name: values[name] for name in names})

    @property
    def loopback_only(self) -> bool:
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False

    def check(self) -> None:
        if self.curves_bytes < MIN_CURVE_BYTES:
            raise ConfigurationError(
                f"--curves_bytes {self.curves_bytes} cannot draw one trial's curves: give at least "
                f"{MIN_CURVE_BYTES} ({MIN_CURVE_BYTES >> 20} MiB)"
            )
        if not self.loopback_only and not self.auth_token and not self.allow_anyone_on_the_network:
            raise ConfigurationError(
                f"--host {self.host} serves other machines: give an access token (--auth_token), or "
                "accept that anyone on the network reads every trial, model and entry "
                "(--allow_anyone_on_the_network)"
            )


def decoders_of(settings: ConsoleSettings) -> Decoders:
    modules = [module.strip() for module in settings.proto_module.split(",") if module.strip()]
    messages = [spec.strip() for spec in settings.messages.split(";") if spec.strip()]
    return Decoders.load(modules, messages)


async def serve(settings: ConsoleSettings) -> None:
    settings.check()
    decoders = decoders_of(settings)
    sources = Sources(
        SourceSettings(
            settings.directory_endpoint,
            settings.model_registry_endpoint,
            settings.trial_datastore_endpoint,
            settings.directory_authentication_token,
            settings.tls,
        )
    )
    app = build_app(Console(sources, decoders, settings.curves_bytes), settings.auth_token)
    # The socket is bound here, so that a port taken is one clear line (uvicorn would exit).
    try:
        sock = socket.create_server((settings.host, settings.port), reuse_port=False)
    except OSError as error:
        await sources.close()
        where = f"{settings.host}:{settings.port}"
        raise ConfigurationError(f"cannot serve on {where}: {error.strerror}") from None
    config = uvicorn.Config(
        app, log_config=None, access_log=False, lifespan="off", timeout_graceful_shutdown=SHUTDOWN_GRACE_S
    )
    server = uvicorn.Server(config)  # it stops gracefully on SIGINT and SIGTERM
    # ...and raises them again once stopped, to whatever handled them before: nothing, so that
    # the console ends as the services do (its clients closed, `stopped` logged, status 0).
    for handled in (signal.SIGINT, signal.SIGTERM):
        signal.signal(handled, lambda _signum, _frame: None)
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        # uvicorn says it listens only through this flag (no event to wait on).
        while not server.started and not serving.done():  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        if server.started:
            port = sock.getsockname()[1]
            log.info(
                "serving",
                url=f"http://{settings.host}:{port}/",
                port=port,
                address=settings.host,
                token_required=bool(settings.auth_token),
            )
            notify = supervisor_notifier()
            if notify is not None:
                notify()
        await serving
    finally:
        sock.close()
        await sources.close()
        log.info("stopped")


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    values = parse_options(OPTIONS, argv, prog=prog or "python -m services.console", description=DESCRIPTION)
    configure_logging(values["log_level"], values["log_format"], values["log_file"], service="console")
    try:
        settings = ConsoleSettings.from_values(values)
        asyncio.run(serve(settings))
    except (ConfigurationError, DecoderError) as error:
        log.error("cannot start", error=str(error))
        return 1
    return 0
