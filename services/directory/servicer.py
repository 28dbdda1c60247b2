"""The directory's gRPC layer: validates requests, translates them for the core, and answers in
the reference's wire format (FAILED replies, not gRPC errors, on Register/Deregister). Inquire
is given its request's bytes and yields replies it encoded (`add_servicers`): a repeated
inquiry is answered from the bytes of its last answer while nothing it depends on changed.
Beside it, the project's own DirectoryEntriesSP lists entries with their health."""

from __future__ import annotations

import weakref
from collections.abc import AsyncIterator
from typing import Any

import grpc

from services.directory.core import Directory, deregistrations_total, inquiries_total, registrations_total
from services.directory.model import (
    UNKNOWN_SERVICE,
    VALID_PROTOCOLS,
    VALID_SERVICE_TYPES,
    Endpoint,
    Entry,
    Inquiry,
    Registration,
)
from shared.api import directory_entries_pb2, directory_pb2
from shared.errors import InvalidArgument, ServiceError, Unavailable, classify
from shared.handlers import add_servicer, parse_request, pre_encoded
from shared.logging import get_logger
from shared.runtime import ServiceRuntime, VersionStatusMixin
from shared.validation import (
    MAX_INT64_POSITION,
    checked_name_size,
    checked_properties,
    checked_text,
    parse_handle,
)

TOKEN_METADATA_KEY = "authentication-token"
# Reserved property of discovery URLs; the orchestrator moves it to the metadata, the Python SDK
# sends it as an inquired property. Either way it is the token, not a property to match.
TOKEN_PROPERTY = "__authentication-token"
MAX_PORT = 65535
# Encoded inquiry replies remembered (EncodedReplies): how many, their bytes in all, the largest.
REPLIES_REMEMBERED = 65_536
REPLIES_BYTES = 16 * 1024 * 1024
REMEMBERED_REPLY_BYTES = 4096
# Whole answers remembered (EncodedAnswers): how many, their bytes in all (requests, tokens and
# bookkeeping included), the largest request and token, the largest replies; the bookkeeping
# counted per answer (dict slot, key and value tuples, list) and per reply (list slot, bytes
# header).
ANSWERS_REMEMBERED = 16_384
ANSWERS_BYTES = 16 * 1024 * 1024
REMEMBERED_REQUEST_BYTES = 4096
REMEMBERED_ANSWER_BYTES = 16 * 1024
# Entries per ListEntries page: by default, and at most.
LIST_DEFAULT_COUNT = 100
LIST_MAX_COUNT = 1000
ANSWER_OVERHEAD_BYTES = 400
REPLY_OVERHEAD_BYTES = 48

log = get_logger("directory.grpc")


def authentication_token(context: Any) -> str:
    """The `authentication-token` metadata value (absent = empty token)."""
    for key, value in context.invocation_metadata() or ():
        if key == TOKEN_METADATA_KEY:
            return value if isinstance(value, str) else value.decode("utf-8", "replace")
    return ""


def registration_from_request(request: directory_pb2.RegisterRequest) -> Registration:
    if not request.HasField("endpoint"):
        raise InvalidArgument("Missing endpoint")
    if not request.HasField("details"):
        raise InvalidArgument("Missing details")
    endpoint, details = request.endpoint, request.details
    if not endpoint.host:
        raise InvalidArgument("Empty host")
    checked_name_size(endpoint.host, "host")
    checked_text(endpoint.host, "host")
    if endpoint.protocol not in VALID_PROTOCOLS:
        raise InvalidArgument(f"Invalid protocol [{endpoint.protocol}]")
    if endpoint.port > MAX_PORT:
        raise InvalidArgument(f"Invalid port [{endpoint.port}]")
    if details.type not in VALID_SERVICE_TYPES:
        raise InvalidArgument(f"Invalid service type [{details.type}]")
    checked_properties(details.properties, "properties")
    for name, value in details.properties.items():
        checked_text(name, f"property name [{name!r}]")
        checked_text(value, f"value of property [{name}]")
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
            raise InvalidArgument(f"Invalid service type [{request.details.type}]")
        properties = dict(checked_properties(request.details.properties, "inquired properties"))
        property_token = properties.pop(TOKEN_PROPERTY, "")
        return Inquiry(service_type=request.details.type, properties=properties), token or property_token
    raise InvalidArgument("Empty request: set either service_id or details")


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


def listing_from_request(
    request: directory_entries_pb2.ListEntriesRequest,
) -> tuple[int, tuple[int, int] | None]:
    """(rows, the position its handle names) of a ListEntries request."""
    if request.count > LIST_MAX_COUNT:
        raise InvalidArgument(f"count [{request.count}] is over {LIST_MAX_COUNT}")
    if not request.handle:
        return request.count or LIST_DEFAULT_COUNT, None
    registered_at, colon, service_id = request.handle.partition(":")
    if not (colon and registered_at and service_id):
        raise InvalidArgument(f"Invalid handle [{request.handle[:64]}]: give the next_handle of a reply")
    position = (
        parse_handle(registered_at, "handle", MAX_INT64_POSITION),
        parse_handle(service_id, "handle", MAX_INT64_POSITION),
    )
    return request.count or LIST_DEFAULT_COUNT, position


def directory_entry(entry: Entry) -> directory_entries_pb2.DirectoryEntry:
    return directory_entries_pb2.DirectoryEntry(
        data=full_service_data(entry),
        registered_at=entry.registered_at,
        health=entry.health,  # type: ignore[arg-type]
        failed_checks=entry.failed_checks,
        last_check_at=entry.last_check_at,
        load=entry.load,
    )


def _refused(error: Exception) -> bool:
    """Whether a request failed with `error` through the client's fault (what the directory's
    rules raise), not the directory's (an outage outlasting the bound raises Unavailable too)."""
    return isinstance(error, ServiceError) and not isinstance(error, Unavailable)


def _refusal(error: Exception, unexpected: str, action: str) -> str:
    """The `error_msg` of the FAILED reply to a request that failed with `error`: what the client
    got wrong, or `unexpected [error type]` for a bug (logged). A database that cannot be reached
    is raised instead: a status the client retries on, where a FAILED reply reads as a refusal
    that self-registering services do not retry (docs/compatibility.md#directory)."""
    if _refused(error):
        return str(error)
    if classify(error) is not None:
        raise error
    log.error(f"could not {action}", exc_info=error)
    return f"{unexpected} [{type(error).__name__}]"


def add_servicers(server: grpc.aio.Server, directory: Directory, runtime: ServiceRuntime) -> list[str]:
    """Serve the directory's gRPC services on `server`; their full names."""
    directory_sp = directory_pb2.DESCRIPTOR.services_by_name["DirectorySP"]
    entries_sp = directory_entries_pb2.DESCRIPTOR.services_by_name["DirectoryEntriesSP"]
    servicer = DirectoryServicer(directory, runtime)
    return [
        add_servicer(server, directory_sp, servicer, {"Inquire": pre_encoded}, raw_requests=["Inquire"]),
        add_servicer(server, entries_sp, DirectoryEntriesServicer(directory)),
    ]


class DirectoryEntriesServicer:
    """The project's own extension (`cogment_aux.api.DirectoryEntriesSP`): every entry a token
    sees with its health, those inquiries do not answer included (see `directory_entries.proto`)."""

    def __init__(self, directory: Directory) -> None:
        self.directory = directory

    async def ListEntries(
        self, request: directory_entries_pb2.ListEntriesRequest, context: Any
    ) -> directory_entries_pb2.ListEntriesReply:
        rows, before = listing_from_request(request)
        entries = await self.directory.list_entries(authentication_token(context), rows, before)
        last = entries[-1] if len(entries) == rows else None
        return directory_entries_pb2.ListEntriesReply(
            entries=[directory_entry(entry) for entry in entries],
            next_handle=f"{last.registered_at}:{last.service_id}" if last else "",
        )


class EncodedAnswers:
    """The encoded replies of recent answers, by the inquiry's request bytes and metadata token,
    all found at one answer stamp (`Directory.answer_stamp`): they hold while it does, and are
    forgotten as soon as a newer stamp is seen. Orchestrators and SDKs ask the same inquiries
    again and again; such an inquiry is then neither parsed nor looked up. Bounded: ANSWERS_REMEMBERED
    answers and ANSWERS_BYTES at most, bookkeeping included (all are forgotten past either), none
    of a request and token over REMEMBERED_REQUEST_BYTES or of replies over REMEMBERED_ANSWER_BYTES."""

    def __init__(self) -> None:
        self._answers: dict[tuple[bytes, str], tuple[list[bytes], int]] = {}
        self._stamp = 0
        self._bytes = 0

    @staticmethod
    def accepts(request: bytes, token: str) -> bool:
        return len(request) + len(token) <= REMEMBERED_REQUEST_BYTES

    def get(self, request: bytes, token: str, stamp: int) -> list[bytes] | None:
        if stamp != self._stamp:
            return None
        remembered = self._answers.get((request, token))
        return remembered[0] if remembered is not None else None

    def put(self, request: bytes, token: str, stamp: int, replies: list[bytes], size: int) -> None:
        """`size`: the replies' bytes, at most REMEMBERED_ANSWER_BYTES; the request and token
        are `accepts`ed. An answer found at an older stamp than the one seen last is dropped."""
        if stamp < self._stamp:
            return
        if stamp > self._stamp:
            self._forget(stamp)
        key = (request, token)
        size += len(request) + len(token) + ANSWER_OVERHEAD_BYTES + REPLY_OVERHEAD_BYTES * len(replies)
        earlier = self._answers.pop(key, None)
        if earlier is not None:
            self._bytes -= earlier[1]
        if len(self._answers) >= ANSWERS_REMEMBERED or self._bytes + size > ANSWERS_BYTES:
            self._forget(stamp)
        self._answers[key] = (replies, size)
        self._bytes += size

    def _forget(self, stamp: int) -> None:
        self._answers.clear()
        self._bytes = 0
        self._stamp = stamp


class EncodedReplies:
    """The InquireReply of each entry, encoded once per Entry object: the index hands out the
    same object until it holds a new record of the entry (a change, a health-check result).
    Bounded: replies of REPLIES_REMEMBERED entries and REPLIES_BYTES at most (all are forgotten
    past either), none over REMEMBERED_REPLY_BYTES; entries are referred to weakly, so an entry
    the index dropped is not kept alive."""

    def __init__(self) -> None:
        self._replies: dict[int, tuple[weakref.ref[Entry], bytes]] = {}
        self._bytes = 0

    def of(self, entry: Entry) -> bytes:
        remembered = self._replies.get(entry.service_id)
        if remembered is not None and remembered[0]() is entry:
            return remembered[1]
        encoded = directory_pb2.InquireReply(data=full_service_data(entry)).SerializeToString()
        if remembered is not None:  # of an earlier record of the entry
            del self._replies[entry.service_id]
            self._bytes -= len(remembered[1])
        if len(encoded) <= REMEMBERED_REPLY_BYTES:
            if len(self._replies) >= REPLIES_REMEMBERED or self._bytes + len(encoded) > REPLIES_BYTES:
                self._replies.clear()
                self._bytes = 0
            self._replies[entry.service_id] = (weakref.ref(entry), encoded)
            self._bytes += len(encoded)
        return encoded


class DirectoryServicer(VersionStatusMixin):
    def __init__(self, directory: Directory, runtime: ServiceRuntime) -> None:
        self.directory = directory
        self.runtime = runtime
        self.replies = EncodedReplies()
        self.answers = EncodedAnswers()

    async def Register(
        self, request_iterator: AsyncIterator[directory_pb2.RegisterRequest], context: Any
    ) -> AsyncIterator[directory_pb2.RegisterReply]:
        token = authentication_token(context)
        async for request in request_iterator:
            # Failures are FAILED replies (see _refusal): the stream stays usable, as clients expect.
            try:
                registration = registration_from_request(request)
                service_id, secret = await self.directory.register(registration, token)
            except Exception as error:
                # Refused: the client's mistake; failed: the database, or a bug.
                registrations_total.labels("refused" if _refused(error) else "failed").inc()
                message = _refusal(error, "Could not add service to database", "register a service")
                yield directory_pb2.RegisterReply(
                    status=directory_pb2.RegisterReply.FAILED, error_msg=message
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
            except Exception as error:
                if not isinstance(error, ServiceError):  # the others are counted by the core
                    deregistrations_total.labels("failed").inc()
                failed = f"Failed to deregister service ID [{request.service_id}]: database error"
                message = _refusal(error, failed, "deregister a service")
                yield directory_pb2.DeregisterReply(
                    status=directory_pb2.DeregisterReply.FAILED, error_msg=message
                )
                continue
            yield directory_pb2.DeregisterReply(status=directory_pb2.DeregisterReply.OK)

    async def Inquire(self, request: bytes, context: Any) -> AsyncIterator[bytes]:
        """Yields encoded InquireReply messages: a remembered answer's (`EncodedAnswers`), else
        each match's (`EncodedReplies`)."""
        metadata_token = authentication_token(context)
        stamp = self.directory.answer_stamp()
        if stamp is not None and not self.answers.accepts(request, metadata_token):
            stamp = None
        if stamp is not None:
            answer = self.answers.get(request, metadata_token, stamp)
            if answer is not None:
                inquiries_total.inc("remembered", "found" if answer else "none")
                for reply in answer:
                    yield reply
                return
        inquiry, token = inquiry_from_request(
            parse_request(directory_pb2.InquireRequest, request), metadata_token
        )
        replies = self.replies
        # What is sent, kept until it is too large to remember (a wide answer is never held whole).
        sent: list[bytes] | None = [] if stamp is not None else None
        sent_bytes = 0
        async for page in self.directory.inquire(inquiry, token):
            for entry in page:
                reply = replies.of(entry)
                if sent is not None:
                    sent_bytes += len(reply)
                    if sent_bytes > REMEMBERED_ANSWER_BYTES:
                        sent = None
                    else:
                        sent.append(reply)
                yield reply
        # Not an empty answer that a registration lag would have waited on; and found at the stamp
        # it is stored with, nothing having changed while it was sent.
        if (
            sent is not None
            and (sent or not self.directory.registration_lag_s)
            and stamp == self.directory.answer_stamp()
        ):
            assert stamp is not None  # `sent` is a list only then
            self.answers.put(request, metadata_token, stamp, sent, sent_bytes)
