"""The Directory's Python client: register, deregister and find services.

    async with DirectoryClient("grpc://localhost:9005", token="") as directory:
        reply = await directory.register(directory_pb2.RegisterRequest(...))
        services = await directory.inquire(directory_pb2.InquireRequest(details=...))

Calls end within the client's timeout; failures are `grpc.aio.AioRpcError`s, which
`describe_rpc_error` turns into a sentence (the command line prints it), or `ClientError`s.
"""

from __future__ import annotations

import grpc

from shared.api import directory_entries_pb2, directory_entries_pb2_grpc, directory_pb2, directory_pb2_grpc
from shared.channel import ClientTls
from shared.client import DEFAULT_TIMEOUT_S, ClientError, ServiceClient
from shared.endpoints import GrpcEndpoint

DEFAULT_ENDPOINT = GrpcEndpoint("localhost", 9005)
TOKEN_METADATA_KEY = "authentication-token"
# Initial and maximum delays between two connection attempts.
RECONNECT_BACKOFF_MS = (250, 1000)
# How long `wait_for_ready`, having waited in vain, gives one more attempt to say why.
LAST_ATTEMPT_S = 2.0


class DirectoryClient(ServiceClient):
    """One directory connection; calls end within `timeout_s`."""

    service = "directory"
    grpc_service = "cogmentAPI.DirectorySP"
    default_endpoint = DEFAULT_ENDPOINT

    def __init__(
        self,
        endpoint: GrpcEndpoint | str = DEFAULT_ENDPOINT,
        token: str = "",
        timeout_s: float = DEFAULT_TIMEOUT_S,
        tls: ClientTls | None = None,
    ) -> None:
        """`token`: the `authentication-token` the entries are scoped by; `tls`: see
        `shared.channel.ClientTls` (a `grpcs://` endpoint without it: the system's CAs)."""
        # Retry connecting often: waiting for a directory that is starting should end soon
        # after it serves, not after gRPC's default backoff (which grows to 2 minutes).
        super().__init__(
            endpoint,
            timeout_s,
            tls,
            [
                ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[0]),
                ("grpc.min_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[0]),
                ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[1]),
            ],
        )
        self._metadata = ((TOKEN_METADATA_KEY, token),) if token else ()
        self._stub = directory_pb2_grpc.DirectorySPStub(self.channel)
        self._entries_stub = directory_entries_pb2_grpc.DirectoryEntriesSPStub(self.channel)

    async def register(self, request: directory_pb2.RegisterRequest) -> directory_pb2.RegisterReply:
        replies: list[directory_pb2.RegisterReply] = [
            reply
            async for reply in self._stub.Register(
                iter([request]), metadata=self._metadata, timeout=self.timeout_s
            )
        ]
        if not replies:
            raise ClientError("Service registration failed [the directory sent no reply]")
        return replies[0]

    async def deregister(self, request: directory_pb2.DeregisterRequest) -> directory_pb2.DeregisterReply:
        replies: list[directory_pb2.DeregisterReply] = [
            reply
            async for reply in self._stub.Deregister(
                iter([request]), metadata=self._metadata, timeout=self.timeout_s
            )
        ]
        if not replies:
            raise ClientError("Service deregistration failed [the directory sent no reply]")
        return replies[0]

    async def inquire(
        self, request: directory_pb2.InquireRequest, *, wait_for_ready: bool = False
    ) -> list[directory_pb2.FullServiceData]:
        return [
            reply.data
            async for reply in self._stub.Inquire(
                request, metadata=self._metadata, timeout=self.timeout_s, wait_for_ready=wait_for_ready
            )
        ]

    async def list_entries(
        self, count: int = 0, handle: str = ""
    ) -> directory_entries_pb2.ListEntriesReply | None:
        """A page of the entries the token sees with their health, healthy or not, newest first,
        from `handle` (a previous page's `next_handle`). None when the directory does not serve
        `cogment_aux.api.DirectoryEntriesSP` (the reference's does not): inquiries then list the
        healthy entries alone."""
        reply: directory_entries_pb2.ListEntriesReply | None = await self.if_served(
            self._entries_stub.ListEntries(
                directory_entries_pb2.ListEntriesRequest(count=count, handle=handle),
                metadata=self._metadata,
                timeout=self.timeout_s,
            )
        )
        return reply

    async def wait_for_ready(self) -> None:
        """Inquire for service id 0 (which never exists, answered at once) as soon as the
        directory can be reached, until the timeout. In vain, a ClientError says why the last
        connection attempt failed (a TLS server met in plaintext...) when it can tell, after one
        more attempt of at most LAST_ATTEMPT_S."""
        request = directory_pb2.InquireRequest(service_id=0)
        try:
            await self.inquire(request, wait_for_ready=True)
        except grpc.aio.AioRpcError as error:
            if error.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                raise
            # A waiting call ends with the deadline only, whatever kept it from connecting: one
            # call that does not wait fails with the connection's own error (or is answered: the
            # directory is ready after all).
            last_attempt = self._stub.Inquire(request, metadata=self._metadata, timeout=LAST_ATTEMPT_S)
            try:
                await last_attempt.read()
            except grpc.aio.AioRpcError as last:
                if last.code() != grpc.StatusCode.UNAVAILABLE:
                    raise error from None
                details = last.details() or ""
                raise ClientError(f"{self.no_answer()} ({details}){self.transport_hint(details)}") from None
            finally:
                last_attempt.cancel()  # answered: a stream of no entries, not read to its end
