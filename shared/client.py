"""What every service's client (its Python API and its command line) shares: the connection, the
timeout of its calls, and failures said in words a user can act on (`ClientError`)."""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from types import TracebackType
from typing import ClassVar, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shared.api import common_pb2
from shared.channel import ClientTls, TlsFileError, open_channel, tls_for
from shared.endpoints import GrpcEndpoint, parse_grpc_endpoint
from shared.supervision import within

DEFAULT_TIMEOUT_S = 30.0

T = TypeVar("T")
S = TypeVar("S", bound="ServiceClient")

# What grpc's error details say when the transport, not the service, failed: a hint for each.
_PLAINTEXT_MET_TLS = "Socket closed"  # a plaintext client's first bytes were refused by a TLS server
_TLS_MET_PLAINTEXT = "WRONG_VERSION_NUMBER"
_UNTRUSTED_CERTIFICATE = "CERTIFICATE_VERIFY_FAILED"
_NOT_SERVED = "Method not found"


class ClientError(Exception):
    """A failure said in words a user can act on (the command line prints `Error: <message>`
    and exits with code 1)."""


def endpoint_of(endpoint: GrpcEndpoint | str) -> GrpcEndpoint:
    """`endpoint`, parsed if it is a URL; a ClientError if it is not a valid one."""
    if isinstance(endpoint, GrpcEndpoint):
        return endpoint
    try:
        return parse_grpc_endpoint(endpoint)
    except ValueError as error:
        raise ClientError(str(error)) from None


class ServiceClient:
    """One connection to a service, with the timeout of its calls and the words its failures are
    reported with. Use it with `async with`, or call `close()`."""

    # The service, as messages name it ("model registry").
    service: ClassVar[str]
    # Its gRPC service, whose `Version` call every Cogment service has ("cogmentAPI.DirectorySP").
    grpc_service: ClassVar[str]
    # Where the quick start serves it (for the hint given when another service answers).
    default_endpoint: ClassVar[GrpcEndpoint]

    def __init__(
        self,
        endpoint: GrpcEndpoint | str,
        timeout_s: float,
        tls: ClientTls | None,
        channel_options: Sequence[tuple[str, int]] = (),
    ) -> None:
        """Raises ClientError for an invalid endpoint URL or TLS files that cannot be read or used."""
        self.endpoint = endpoint_of(endpoint)
        self.timeout_s = timeout_s
        self.tls = tls_for(self.endpoint, tls)
        try:
            self.channel = open_channel(self.endpoint, self.tls, channel_options)
        except TlsFileError as error:
            raise ClientError(error.strerror) from None
        except OSError as error:
            raise ClientError(f"cannot read [{error.filename}]: {error.strerror or error}") from None

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self: S) -> S:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.close()

    async def version(self) -> dict[str, str]:
        """What the service's `Version` call says: component name -> version."""
        call = self.channel.unary_unary(
            f"/{self.grpc_service}/Version",
            request_serializer=common_pb2.VersionRequest.SerializeToString,
            response_deserializer=common_pb2.VersionInfo.FromString,
        )
        reply: common_pb2.VersionInfo = await call(common_pb2.VersionRequest(), timeout=self.timeout_s)
        return {version.name: version.version for version in reply.versions}

    @staticmethod
    async def if_served(call: Awaitable[T]) -> T | None:
        """What `call` (to one of the project's own services, `cogment_aux.api.*`) answers, or
        None when the server does not serve it (`UNIMPLEMENTED`: a Cogment 2.x one)."""
        try:
            return await call
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.UNIMPLEMENTED:
                return None
            raise

    async def ready(self) -> bool | None:
        """Whether the service says it can serve (grpc.health.v1, the service ""): False while
        it answers but its database or blob store is away; None when it has no health service
        (a Cogment 2.x one may not)."""
        try:
            reply = await health_pb2_grpc.HealthStub(self.channel).Check(
                health_pb2.HealthCheckRequest(), timeout=self.timeout_s
            )
        except grpc.aio.AioRpcError as error:
            if error.code() in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.NOT_FOUND):
                return None
            raise
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    def no_answer(self) -> str:
        return f"the {self.service} at {self.endpoint} did not answer within {self.timeout_s:g} s"

    async def within_timeout(self, step: Awaitable[T], call: grpc.aio.Call | None = None) -> T:
        """`step`, or a ClientError (cancelling `call`) if it takes longer than the timeout."""
        try:
            return await within(step, self.timeout_s)
        except TimeoutError:
            if call is not None:
                call.cancel()
            raise ClientError(self.no_answer()) from None

    def describe_rpc_error(self, error: grpc.aio.AioRpcError, command: str) -> str:
        code = error.code()
        details = error.details() or ""
        if code == grpc.StatusCode.UNAVAILABLE:
            hint = self.transport_hint(details)
            return f"cannot reach the {self.service} at {self.endpoint} ({details}){hint}"
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return self.no_answer()
        if code == grpc.StatusCode.UNIMPLEMENTED and _NOT_SERVED in details:
            return (
                f"the server at {self.endpoint} does not serve the {self.service} ({details}): is it "
                f"another service's port? The quick start serves the {self.service} at "
                f"{self.default_endpoint}"
            )
        return f"{command} failed: {code.name}: {details} ({self.service} {self.endpoint})"

    def transport_hint(self, details: str) -> str:
        """What to change when `details` says the connection itself failed, in TLS terms."""
        if self.tls is None and _PLAINTEXT_MET_TLS in details:
            return (
                ": the server may require TLS: give the CA bundle that signed its certificate with "
                "--tls_ca (or use a grpcs:// endpoint to trust the system's CAs)"
            )
        if self.tls is not None and _PLAINTEXT_MET_TLS in details:
            if self.tls.cert:
                return ": the server may not accept this client certificate (--tls_cert)"
            return ": the server may require a client certificate: give --tls_cert and --tls_key"
        if self.tls is not None and _TLS_MET_PLAINTEXT in details:
            return ": the server does not speak TLS: use a grpc:// endpoint without --tls_* flags"
        if self.tls is not None and _UNTRUSTED_CERTIFICATE in details:
            what = f"the CA bundle [{self.tls.ca}]" if self.tls.ca else "the system's CAs (give --tls_ca)"
            return f": its certificate is not signed by {what}"
        return ""
