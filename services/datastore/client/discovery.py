"""Trial datastores found through a directory: `cogment://discover/datastore?name=value&...`
names those registered with the type DATASTORE_SERVICE and every property given (Cogment's
discovery syntax; `cogment://discover/service?__id=N` names one entry by id), and the directory
answers with their endpoints, most recently registered first. Replicas of one deployment
register each: this is how a client finds all of them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from urllib.parse import parse_qsl, urlsplit

import grpc

from services.directory.client.api import DirectoryClient
from shared.api import directory_pb2
from shared.channel import ClientTls
from shared.client import DEFAULT_TIMEOUT_S, ClientError
from shared.endpoints import GrpcEndpoint

DISCOVERY_PREFIX = "cogment://discover/"
# How often a feed asks the directory again which datastores it lists.
DISCOVERY_REFRESH_S = 10.0
EXPECTED = "expected cogment://discover/datastore[?name=value&...] or cogment://discover/service?__id=<id>"


def is_discovery(endpoint: str) -> bool:
    return endpoint.startswith(DISCOVERY_PREFIX)


def discovery_inquiry(url: str) -> directory_pb2.InquireRequest:
    """The directory inquiry a discovery URL makes (ValueError naming the URL if it is not one)."""
    parts = urlsplit(url)
    kind = parts.path.strip("/")
    if not is_discovery(url) or parts.fragment or kind not in ("datastore", "service"):
        raise ValueError(f"invalid discovery URL [{url}]: {EXPECTED}")
    properties = dict(parse_qsl(parts.query, keep_blank_values=True))
    if kind == "service":
        service_id = properties.get("__id", "")
        if not service_id.isdigit() or len(properties) != 1:
            raise ValueError(f"invalid discovery URL [{url}]: {EXPECTED}")
        return directory_pb2.InquireRequest(service_id=int(service_id))
    details = directory_pb2.ServiceDetails(type=directory_pb2.DATASTORE_SERVICE, properties=properties)
    return directory_pb2.InquireRequest(details=details)


def endpoint_url(endpoint: directory_pb2.ServiceEndpoint) -> str | None:
    """A directory entry's endpoint as a `grpc://` (`grpcs://`) URL; None for a protocol a
    datastore client cannot call."""
    if endpoint.protocol == directory_pb2.ServiceEndpoint.GRPC:
        return GrpcEndpoint(endpoint.host, endpoint.port).url
    if endpoint.protocol == directory_pb2.ServiceEndpoint.GRPC_SSL:
        return GrpcEndpoint(endpoint.host, endpoint.port, tls=True).url
    return None


async def discover_datastores(
    url: str,
    directory: str,
    *,
    token: str = "",
    tls: ClientTls | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> list[str]:
    """The endpoints of the datastores `url` names, as `directory` lists them now (its healthy
    entries), most recently registered first. ClientError when the directory cannot answer."""
    inquiry = discovery_inquiry(url)
    async with DirectoryClient(directory, token=token, timeout_s=timeout_s, tls=tls) as client:
        try:
            entries = await client.inquire(inquiry)
        except grpc.aio.AioRpcError as error:
            raise ClientError(client.describe_rpc_error(error, "discovering trial datastores")) from None
    urls = [endpoint_url(entry.endpoint) for entry in entries]
    return list(dict.fromkeys(url for url in urls if url is not None))


def datastore_endpoints(
    endpoint: str,
    directory: str | None,
    *,
    token: str = "",
    tls: ClientTls | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> Callable[[], Awaitable[list[str]]]:
    """What lists the datastores `endpoint` names: itself (`grpc://`, `grpcs://`), or those a
    discovery URL finds through `directory`, asked each time. ValueError naming the parameter
    for a discovery URL that is not one, or without a directory."""
    if not is_discovery(endpoint):

        async def one() -> list[str]:
            return [endpoint]

        return one
    discovery_inquiry(endpoint)
    if directory is None:
        raise ValueError(f"directory: {endpoint} is found through a directory: give its grpc://host:port")
    found_through = directory

    async def discovered() -> list[str]:
        return await discover_datastores(endpoint, found_through, token=token, tls=tls, timeout_s=timeout_s)

    return discovered
