"""The directory's gRPC layer: validates requests, translates them for the core, and answers in
the reference's wire format (FAILED replies, not gRPC errors, on Register/Deregister)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc

from services.directory.core import DeregistrationError, Directory
from services.directory.model import (
    UNKNOWN_SERVICE,
    VALID_PROTOCOLS,
    VALID_SERVICE_TYPES,
    Endpoint,
    Entry,
    Inquiry,
    Registration,
)
from shared.api import directory_pb2, directory_pb2_grpc
from shared.logging import get_logger
from shared.server import ServiceRuntime, VersionStatusMixin

TOKEN_METADATA_KEY = "authentication-token"
# Reserved property of discovery URLs; the orchestrator moves it to the metadata, the Python SDK
# sends it as an inquired property. Either way it is the token, not a property to match.
TOKEN_PROPERTY = "__authentication-token"
MAX_PORT = 65535

log = get_logger("directory.grpc")


class InvalidRequest(Exception):
    pass


def authentication_token(context: Any) -> str:
    """The `authentication-token` metadata value (absent = empty token)."""
    for key, value in context.invocation_metadata() or ():
        if key == TOKEN_METADATA_KEY:
            return value if isinstance(value, str) else value.decode("utf-8", "replace")
    return ""


def _check_text(what: str, value: str) -> None:
    # Text columns (PostgreSQL in particular) cannot hold NUL characters.
    if "\x00" in value:
        raise InvalidRequest(f"Invalid {what}: NUL characters are not allowed")


def registration_from_request(request: directory_pb2.RegisterRequest) -> Registration:
    if not request.HasField("endpoint"):
        raise InvalidRequest("Missing endpoint")
    if not request.HasField("details"):
        raise InvalidRequest("Missing details")
    endpoint, details = request.endpoint, request.details
    if not endpoint.host:
        raise InvalidRequest("Empty host")
    _check_text("host", endpoint.host)
    if endpoint.protocol not in VALID_PROTOCOLS:
        raise InvalidRequest(f"Invalid protocol [{endpoint.protocol}]")
    if endpoint.port > MAX_PORT:
        raise InvalidRequest(f"Invalid port [{endpoint.port}]")
    if details.type not in VALID_SERVICE_TYPES:
        raise InvalidRequest(f"Invalid service type [{details.type}]")
    for name, value in details.properties.items():
        _check_text(f"property name [{name!r}]", name)
        _check_text(f"value of property [{name}]", value)
    return Registration(
        endpoint=Endpoint(endpoint.protocol, endpoint.host, endpoint.port),
        service_type=details.type,
        properties=dict(details.properties),
        permanent=request.permanent,
    )


def inquiry_from_request(request: directory_pb2.InquireRequest, token: str) -> tuple[Inquiry, str]:
    """The inquiry and the token to inquire with (metadata first, else `__authentication-token`)."""
    which = request.WhichOneof("inquiry")
    if which == "service_id":
        return Inquiry(service_id=request.service_id), token
    if which == "details":
        if request.details.type != UNKNOWN_SERVICE and request.details.type not in VALID_SERVICE_TYPES:
            raise InvalidRequest(f"Invalid service type [{request.details.type}]")
        properties = dict(request.details.properties)
        property_token = properties.pop(TOKEN_PROPERTY, "")
        return Inquiry(service_type=request.details.type, properties=properties), token or property_token
    raise InvalidRequest("Empty request: set either service_id or details")


def full_service_data(entry: Entry) -> directory_pb2.FullServiceData:
    return directory_pb2.FullServiceData(
        endpoint=directory_pb2.ServiceEndpoint(
            protocol=entry.endpoint.protocol,  # type: ignore[arg-type]
            host=entry.endpoint.host,
            port=entry.endpoint.port,
        ),
        service_id=entry.service_id,
        details=directory_pb2.ServiceDetails(
            type=entry.service_type,  # type: ignore[arg-type]
            properties=entry.properties,
        ),
        permanent=entry.permanent,
    )


class DirectoryServicer(VersionStatusMixin, directory_pb2_grpc.DirectorySPServicer):
    def __init__(self, directory: Directory, runtime: ServiceRuntime) -> None:
        self.directory = directory
        self.runtime = runtime

    async def Register(
        self, request_iterator: AsyncIterator[directory_pb2.RegisterRequest], context: Any
    ) -> AsyncIterator[directory_pb2.RegisterReply]:
        token = authentication_token(context)
        async for request in request_iterator:
            try:
                registration = registration_from_request(request)
                service_id, secret = await self.directory.register(registration, token)
            except InvalidRequest as error:
                yield directory_pb2.RegisterReply(
                    status=directory_pb2.RegisterReply.FAILED, error_msg=str(error)
                )
                continue
            except Exception as error:
                log.error("could not register service", exc_info=error)
                yield directory_pb2.RegisterReply(
                    status=directory_pb2.RegisterReply.FAILED,
                    error_msg=f"Could not add service to database [{type(error).__name__}]",
                )
                continue
            yield directory_pb2.RegisterReply(
                status=directory_pb2.RegisterReply.OK, service_id=service_id, secret=secret
            )

    async def Deregister(
        self, request_iterator: AsyncIterator[directory_pb2.DeregisterRequest], context: Any
    ) -> AsyncIterator[directory_pb2.DeregisterReply]:
        token = authentication_token(context)
        async for request in request_iterator:
            try:
                await self.directory.deregister(request.service_id, request.secret, token)
            except DeregistrationError as error:
                yield directory_pb2.DeregisterReply(
                    status=directory_pb2.DeregisterReply.FAILED, error_msg=str(error)
                )
                continue
            except Exception as error:
                log.error("could not deregister service", exc_info=error)
                yield directory_pb2.DeregisterReply(
                    status=directory_pb2.DeregisterReply.FAILED,
                    error_msg=f"Failed to deregister service ID [{request.service_id}]: "
                    f"database error [{type(error).__name__}]",
                )
                continue
            yield directory_pb2.DeregisterReply(status=directory_pb2.DeregisterReply.OK)

    async def Inquire(
        self, request: directory_pb2.InquireRequest, context: Any
    ) -> AsyncIterator[directory_pb2.InquireReply]:
        try:
            inquiry, token = inquiry_from_request(request, authentication_token(context))
        except InvalidRequest as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
            return
        for entry in await self.directory.inquire(inquiry, token):
            yield directory_pb2.InquireReply(data=full_service_data(entry))
