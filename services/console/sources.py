"""Where the console reads from: the three services' clients, each endpoint given or discovered
through the directory (and found again when its service moves), and what each service is
doing now (up with its version, or down and why)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import grpc

from services.console.model import ServiceState
from services.datastore.client.api import DatastoreClient
from services.directory.client.api import DirectoryClient
from services.model_registry.client.api import ModelRegistryClient
from shared.api import directory_pb2
from shared.channel import ClientTls
from shared.client import ClientError, ServiceClient
from shared.endpoints import GrpcEndpoint

T = TypeVar("T")
C = TypeVar("C", bound=ServiceClient)

# The console answers a page within a few seconds even when a service does not answer.
CALL_TIMEOUT_S = 5.0
# How long a discovered endpoint is trusted before the directory is asked again after a failure.
REDISCOVERY_S = 10.0
# Where the quick start serves each service: tried when the directory does not list one.
QUICK_START = {
    "model_registry": "grpc://localhost:9002",
    "trial_datastore": "grpc://localhost:9003",
}
DISCOVERED_TYPES = {
    "model_registry": directory_pb2.MODEL_REGISTRY_SERVICE,
    "trial_datastore": directory_pb2.DATASTORE_SERVICE,
}


GRPC, GRPC_SSL = directory_pb2.ServiceEndpoint.GRPC, directory_pb2.ServiceEndpoint.GRPC_SSL


class Unavailable(Exception):
    """A service could not answer: the page shows it as down (the message says why)."""

    def __init__(self, service: str, message: str) -> None:
        super().__init__(message)
        self.service = service


@dataclass(frozen=True)
class SourceSettings:
    directory_endpoint: str
    model_registry_endpoint: str
    trial_datastore_endpoint: str
    directory_token: str
    tls: ClientTls | None


class _Slot:
    """One service's client, made on first use and remade when its endpoint changes."""

    def __init__(self, name: str, given: str, make: Callable[[str], ServiceClient]) -> None:
        self.name = name
        self.given = given
        self.make = make
        self.client: ServiceClient | None = None
        self.endpoint = given
        self.found_at = 0.0
        # One per service: discovering one service's endpoint uses the directory's client.
        self.lock = asyncio.Lock()


class Sources:
    """The console's clients. `call(name, fn)` runs `fn(client)` and turns any failure of the
    service into `Unavailable`, which the pages show; nothing else is caught."""

    def __init__(self, settings: SourceSettings) -> None:
        self.settings = settings
        tls = settings.tls
        self._slots = {
            "directory": _Slot(
                "directory",
                settings.directory_endpoint,
                lambda endpoint: DirectoryClient(endpoint, settings.directory_token, CALL_TIMEOUT_S, tls),
            ),
            "model_registry": _Slot(
                "model_registry",
                settings.model_registry_endpoint,
                lambda endpoint: ModelRegistryClient(endpoint, CALL_TIMEOUT_S, tls),
            ),
            "trial_datastore": _Slot(
                "trial_datastore",
                settings.trial_datastore_endpoint,
                lambda endpoint: DatastoreClient(endpoint, CALL_TIMEOUT_S, tls),
            ),
        }

    async def close(self) -> None:
        for slot in self._slots.values():
            if slot.client is not None:
                await slot.client.close()
                slot.client = None

    def endpoint(self, name: str) -> str:
        return self._slots[name].endpoint

    async def _discover(self, name: str) -> str:
        """The endpoint of `name` the directory lists first, else the quick start's."""
        try:
            request = directory_pb2.InquireRequest(
                details=directory_pb2.ServiceDetails(type=DISCOVERED_TYPES[name])
            )
            found = await self.directory(lambda directory: directory.inquire(request))
        except Unavailable:
            found = []
        for data in found:
            endpoint = data.endpoint
            if endpoint.protocol in (
                directory_pb2.ServiceEndpoint.GRPC,
                directory_pb2.ServiceEndpoint.GRPC_SSL,
            ):
                tls = endpoint.protocol == directory_pb2.ServiceEndpoint.GRPC_SSL
                return GrpcEndpoint(endpoint.host, endpoint.port, tls).url
        return QUICK_START[name]

    async def client(self, name: str) -> ServiceClient:
        """The client of `name`, made (its endpoint discovered) on first use."""
        slot = self._slots[name]
        async with slot.lock:
            if slot.client is None:
                if not slot.given and name not in DISCOVERED_TYPES:
                    raise Unavailable(name, f"no {name.replace('_', ' ')} endpoint is configured")
                if not slot.given:
                    slot.endpoint = await self._discover(name)
                    slot.found_at = time.monotonic()
                try:
                    slot.client = slot.make(slot.endpoint)
                except ClientError as error:
                    raise Unavailable(name, str(error)) from None
            return slot.client

    async def _forget(self, name: str) -> None:
        """After a failure: a discovered endpoint is looked up again (not more often than
        REDISCOVERY_S), in case its service moved."""
        slot = self._slots[name]
        if slot.given or time.monotonic() - slot.found_at < REDISCOVERY_S:
            return
        async with slot.lock:
            if slot.client is not None:
                await slot.client.close()
                slot.client = None

    async def _call(self, name: str, kind: type[C], fn: Callable[[C], Awaitable[T]]) -> T:
        """`fn(client of name)`, a failure of the service as Unavailable."""
        client = await self.client(name)
        assert isinstance(client, kind)
        try:
            return await fn(client)
        except grpc.aio.AioRpcError as error:
            if error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                await self._forget(name)
            raise Unavailable(name, client.describe_rpc_error(error, name.replace("_", " "))) from None
        except ClientError as error:
            await self._forget(name)
            raise Unavailable(name, str(error)) from None

    async def directory(self, fn: Callable[[DirectoryClient], Awaitable[T]]) -> T:
        return await self._call("directory", DirectoryClient, fn)

    async def registry(self, fn: Callable[[ModelRegistryClient], Awaitable[T]]) -> T:
        return await self._call("model_registry", ModelRegistryClient, fn)

    async def datastore(self, fn: Callable[[DatastoreClient], Awaitable[T]]) -> T:
        return await self._call("trial_datastore", DatastoreClient, fn)

    async def state(self, name: str) -> ServiceState:
        """The service's version, or why it cannot be reached or serve."""
        try:
            versions = await self._call(name, ServiceClient, lambda client: client.version())
            ready = await self._call(name, ServiceClient, lambda client: client.ready())
        except Unavailable as error:
            return ServiceState(name, self.endpoint(name), error=str(error))
        version = versions.get("cogment-aux", "") or _first(versions)
        if ready is False:
            return ServiceState(
                name,
                self.endpoint(name),
                version,
                error="it answers but is not ready: its database or blob store is away (it says so "
                "in its log); its pages wait for it",
            )
        return ServiceState(name, self.endpoint(name), version)


def _first(versions: dict[str, str]) -> str:
    return next((f"{name} {version}" for name, version in versions.items()), "")
