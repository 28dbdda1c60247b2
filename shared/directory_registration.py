"""`DirectoryRegistration`: a service's registration in a Cogment Directory while it serves, as
`shared.registration` describes it, deregistered when it stops (and after a crash, by the next
process, through its state file)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from shared.api import directory_pb2, directory_pb2_grpc
from shared.channel import ClientTls, open_channel
from shared.endpoints import ServiceType, parse_grpc_endpoint, parse_properties, service_type_name
from shared.errors import StartupError
from shared.host_discovery import discover_host
from shared.logging import get_logger
from shared.private_file import write_private_file
from shared.registration import RegistrationSettings
from shared.supervision import cancel_and_wait
from shared.version import PACKAGE_VERSION

TOKEN_METADATA_KEY = "authentication-token"
REGISTRATION_SOURCE_PROPERTY = "__registration_source"
VERSION_PROPERTY = "__version"
SOURCE_COMMAND_LINE = "Self-Command_Line"
SOURCE_IMPLICIT = "Self-Implicit"

DEREGISTER_TIMEOUT_S = 10.0
# One registration attempt waits this long for the directory before the next one starts.
ATTEMPT_TIMEOUT_S = 10.0
RETRY_INITIAL_S = 0.25
RETRY_MAX_S = 5.0
# While the directory stays unreachable, a warning is logged about this often.
WARN_EVERY_S = 60.0
_WILDCARD_ADDRESSES = frozenset({"", "0.0.0.0", "::", "[::]"})

log = get_logger("shared.registration")


@dataclass(frozen=True)
class RegisteredService:
    """One registration the directory accepted."""

    service_type: ServiceType
    service_id: int
    secret: str


class DirectoryRegistration:
    """Registers a service in a directory while it serves; see `shared.registration`."""

    def __init__(
        self,
        directory_endpoint: str,
        service_types: Sequence[ServiceType],
        *,
        authentication_token: str = "",
        host: str = "",
        properties: Mapping[str, str] | None = None,
        bind_address: str = "",
        ssl: bool = False,
        directory_tls: ClientTls | None = None,
        deregister_timeout_s: float = DEREGISTER_TIMEOUT_S,
        attempt_timeout_s: float = ATTEMPT_TIMEOUT_S,
        retry_max_s: float = RETRY_MAX_S,
        state_file: Path | None = None,
    ) -> None:
        """`directory_endpoint` empty disables registration; otherwise an invalid URL raises
        ValueError. `bind_address` is the address the service listens on: a specific (not
        wildcard) one is registered when no `host` is given."""
        self.endpoint = parse_grpc_endpoint(directory_endpoint) if directory_endpoint.strip() else None
        self.service_types = list(service_types)
        self.authentication_token = authentication_token
        self.host = host.strip()
        self.properties = dict(properties or {})
        bind_address = bind_address.strip()
        self.bind_address = "" if bind_address in _WILDCARD_ADDRESSES else bind_address.strip("[]")
        self.protocol = directory_pb2.ServiceEndpoint.GRPC_SSL if ssl else directory_pb2.ServiceEndpoint.GRPC
        self.directory_tls = directory_tls
        self.deregister_timeout_s = deregister_timeout_s
        self.attempt_timeout_s = attempt_timeout_s
        self.retry_max_s = retry_max_s
        self.state_file = state_file
        self._registered: list[RegisteredService] = []
        self._channel: grpc.aio.Channel | None = None
        self._task: asyncio.Task[None] | None = None
        self._log = log.bind(directory=str(self.endpoint) if self.endpoint else None)

    @classmethod
    def from_settings(
        cls,
        settings: RegistrationSettings,
        service_types: Sequence[ServiceType],
        *,
        bind_address: str = "",
        ssl: bool = False,
        **kwargs: Any,
    ) -> DirectoryRegistration:
        """From the settings of `registration_options()`, for a service listening on
        `bind_address` (over TLS when `ssl`). Unparsable registration properties are ignored
        with a warning."""
        text = settings.directory_registration_properties
        try:
            properties = parse_properties(text)
        except ValueError as error:
            log.warning("ignoring the directory registration properties", properties=text, error=str(error))
            properties = {}
        files = (settings.directory_tls_ca, settings.directory_tls_cert, settings.directory_tls_key)
        try:
            # Any of them asks for TLS (without a CA bundle: the system's CAs).
            directory_tls = ClientTls(*files) if any(files) else None
        except ValueError:
            raise StartupError("--directory_tls_cert and --directory_tls_key go together") from None
        return cls(
            settings.directory_endpoint,
            service_types,
            directory_tls=directory_tls,
            authentication_token=settings.directory_authentication_token,
            host=settings.directory_registration_host,
            properties=properties,
            bind_address=bind_address,
            ssl=ssl,
            **kwargs,
        )

    @property
    def enabled(self) -> bool:
        return self.endpoint is not None and bool(self.service_types)

    @property
    def registered(self) -> list[RegisteredService]:
        """The registrations the directory accepted so far (and not yet deregistered)."""
        return list(self._registered)

    async def start(self, port: int) -> None:
        """Start registering the service listening on `port`; returns at once."""
        if not self.enabled:
            return
        if self._task is not None:
            raise RuntimeError("directory registration already started")
        assert self.endpoint is not None
        options = [
            # Reconnect soon after the directory comes (back) up, not after gRPC's up to 2 min.
            ("grpc.initial_reconnect_backoff_ms", int(RETRY_INITIAL_S * 1000)),
            ("grpc.min_reconnect_backoff_ms", int(RETRY_INITIAL_S * 1000)),
            ("grpc.max_reconnect_backoff_ms", int(self.retry_max_s * 1000)),
        ]
        try:
            self._channel = open_channel(self.endpoint, self.directory_tls, options)
        except OSError as error:
            self._log.error(
                "cannot read the directory TLS files: the service is not registered",
                file=error.filename,
                error=error.strerror,
            )
            return
        self._task = asyncio.get_running_loop().create_task(
            self._register(port), name="directory-registration"
        )

    async def wait(self) -> None:
        """Wait until the registration task ends (registered, refused or given up); for tests."""
        if self._task is not None:
            await asyncio.wait([self._task])

    async def stop(self, timeout_s: float | None = None) -> None:
        """Cancel a pending registration and deregister, within `timeout_s` when given (else the
        deregistration timeout); never raises for directory errors."""
        task, self._task = self._task, None
        if task is not None and not task.done():
            await cancel_and_wait(task)
        channel, self._channel = self._channel, None
        if channel is None:
            return
        try:
            registered, self._registered = self._registered, []
            if registered:
                if timeout_s is None or timeout_s > self.deregister_timeout_s:
                    timeout_s = self.deregister_timeout_s
                await self._save(await self._deregister(channel, registered, timeout_s))
        finally:
            await channel.close()

    # ---- internals ----

    def _metadata(self) -> tuple[tuple[str, str], ...]:
        return ((TOKEN_METADATA_KEY, self.authentication_token),) if self.authentication_token else ()

    async def _registration_host(self) -> tuple[str | None, str]:
        if self.host:
            return self.host, SOURCE_COMMAND_LINE
        if self.bind_address:
            return self.bind_address, SOURCE_IMPLICIT
        host = await asyncio.to_thread(discover_host, self.endpoint)
        return host, SOURCE_IMPLICIT

    async def _register(self, port: int) -> None:
        try:
            left = await self._load()
            if left:
                # A previous process of this service died registered: its entries go first.
                assert self._channel is not None
                self._log.info(
                    "deregistering what a previous process left", service_ids=[r.service_id for r in left]
                )
                self._registered = await self._deregister(self._channel, left, self.deregister_timeout_s)
                await self._save(self._registered)
            host, source = await self._registration_host()
            if host is None:
                self._log.error(
                    "not registering in the directory: could not discover a non-loopback IPv4 "
                    "address of this host; set --directory_registration_host (or its environment "
                    "variable) to the address the directory and clients should use"
                )
                return
            self._log.info(
                "registering in the directory",
                types=[service_type_name(t) for t in self.service_types],
                host=host,
                port=port,
                protocol=directory_pb2.ServiceEndpoint.Protocol.Name(self.protocol),
            )
            properties = {
                **self.properties,
                REGISTRATION_SOURCE_PROPERTY: source,
                VERSION_PROPERTY: PACKAGE_VERSION,
            }
            await self._register_until_done(host, port, properties)
        except asyncio.CancelledError:
            raise
        except Exception as error:  # never take the service down
            self._log.error("directory registration failed", exc_info=error)

    async def _register_until_done(self, host: str, port: int, properties: dict[str, str]) -> None:
        assert self._channel is not None
        stub = directory_pb2_grpc.DirectorySPStub(self._channel)
        pending = list(self.service_types)
        delay = RETRY_INITIAL_S
        first_failure: float | None = None
        last_warning = 0.0
        while pending:
            requests = [
                directory_pb2.RegisterRequest(
                    endpoint=directory_pb2.ServiceEndpoint(protocol=self.protocol, host=host, port=port),
                    details=directory_pb2.ServiceDetails(type=service_type, properties=properties),
                    permanent=False,
                )
                for service_type in pending
            ]
            call = stub.Register(
                iter(requests),
                metadata=self._metadata(),
                timeout=self.attempt_timeout_s,
                wait_for_ready=True,
            )
            try:
                # One reply per request, in order; the stream ends once they are all answered.
                async for reply in call:
                    if pending:
                        self._handle_reply(pending.pop(0), reply, host, port)
                if pending:
                    raise RuntimeError("the directory ended the Register stream without replying")
                await self._save(self._registered)
            except (grpc.aio.AioRpcError, RuntimeError) as error:
                now = time.monotonic()
                details = (
                    {"code": error.code().name, "details": error.details()}
                    if isinstance(error, grpc.aio.AioRpcError)
                    else {"details": str(error)}
                )
                if first_failure is None:
                    first_failure = last_warning = now
                    self._log.warning("directory not reachable yet; will keep trying to register", **details)
                elif now - last_warning >= WARN_EVERY_S:
                    last_warning = now
                    self._log.warning(
                        "still trying to register in the directory",
                        seconds=round(now - first_failure),
                        **details,
                    )
                else:
                    self._log.debug("directory registration attempt failed", **details)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.retry_max_s)
            finally:
                call.cancel()

    def _handle_reply(
        self, service_type: ServiceType, reply: directory_pb2.RegisterReply, host: str, port: int
    ) -> None:
        type_name = service_type_name(service_type)
        if reply.status == directory_pb2.RegisterReply.OK:
            self._registered.append(RegisteredService(service_type, reply.service_id, reply.secret))
            self._log.info(
                "registered in the directory",
                type=type_name,
                service_id=reply.service_id,
                host=host,
                port=port,
            )
        else:
            self._log.error(
                "the directory refused the registration", type=type_name, error=reply.error_msg, host=host
            )

    async def _deregister(
        self, channel: grpc.aio.Channel, registered: list[RegisteredService], timeout_s: float
    ) -> list[RegisteredService]:
        """Deregister these; returns those the directory did not answer for (still registered,
        perhaps)."""
        stub = directory_pb2_grpc.DirectorySPStub(channel)
        requests = [
            directory_pb2.DeregisterRequest(service_id=r.service_id, secret=r.secret) for r in registered
        ]
        call = stub.Deregister(
            iter(requests), metadata=self._metadata(), timeout=timeout_s, wait_for_ready=True
        )
        answered = 0
        try:
            async for reply in call:
                if answered == len(registered):
                    break
                registration = registered[answered]
                answered += 1
                if reply.status == directory_pb2.DeregisterReply.OK:
                    self._log.info(
                        "deregistered from the directory",
                        type=service_type_name(registration.service_type),
                        service_id=registration.service_id,
                    )
                else:
                    self._log.warning(
                        "the directory refused the deregistration",
                        service_id=registration.service_id,
                        error=reply.error_msg,
                    )
        except grpc.aio.AioRpcError as error:
            self._log.warning(
                "could not deregister from the directory",
                code=error.code().name,
                details=error.details(),
                service_ids=[r.service_id for r in registered],
            )
        except Exception as error:
            self._log.warning("could not deregister from the directory", exc_info=error)
        finally:
            call.cancel()
        return registered[answered:]

    async def _load(self) -> list[RegisteredService]:
        """What the state file says is still registered (nothing if there is no such file)."""
        if self.state_file is None:
            return []
        try:
            text = await asyncio.to_thread(self.state_file.read_text)
            return [RegisteredService(**item) for item in json.loads(text)]
        except FileNotFoundError:
            return []
        except (OSError, ValueError, TypeError) as error:
            self._log.warning(
                "ignoring an unreadable registration state file", file=str(self.state_file), error=str(error)
            )
            return []

    async def _save(self, registered: list[RegisteredService]) -> None:
        """Record what is registered (removing the file when nothing is); failures are logged."""
        if self.state_file is None:
            return
        try:
            await asyncio.to_thread(_write_state, self.state_file, registered)
        except OSError as error:
            self._log.warning(
                "could not write the registration state file", file=str(self.state_file), error=str(error)
            )


def _write_state(path: Path, registered: list[RegisteredService]) -> None:
    if registered:
        write_private_file(path, json.dumps([dataclasses.asdict(r) for r in registered]))
    else:
        path.unlink(missing_ok=True)
