"""Stand-ins for the services a directory health-checks: a Cogment gRPC service answering
Status (or only Version), and a bare TCP listener. They count the calls they get."""

from __future__ import annotations

import asyncio
import socket
import struct
from typing import Any

import grpc

from shared.api import common_pb2


class FakeCogmentService:
    """A gRPC server for `/cogmentAPI.<service>/Status` and `/Version`, on 127.0.0.1."""

    def __init__(self, service: str, load: str | None = "0", with_status: bool = True) -> None:
        self.service = service
        self.load = load
        self.with_status = with_status
        self.status_calls = 0
        self.version_calls = 0
        self.port = 0
        self._server: Any = None

    async def _status(self, request: common_pb2.StatusRequest, context: Any) -> common_pb2.StatusReply:
        self.status_calls += 1
        reply = common_pb2.StatusReply()
        if self.load is not None and "overall_load" in request.names:
            reply.statuses["overall_load"] = self.load
        return reply

    async def _version(self, request: common_pb2.VersionRequest, context: Any) -> common_pb2.VersionInfo:
        self.version_calls += 1
        return common_pb2.VersionInfo()

    async def start(self) -> FakeCogmentService:
        handlers = {
            "Version": grpc.unary_unary_rpc_method_handler(
                self._version,
                request_deserializer=common_pb2.VersionRequest.FromString,
                response_serializer=common_pb2.VersionInfo.SerializeToString,
            )
        }
        if self.with_status:
            handlers["Status"] = grpc.unary_unary_rpc_method_handler(
                self._status,
                request_deserializer=common_pb2.StatusRequest.FromString,
                response_serializer=common_pb2.StatusReply.SerializeToString,
            )
        self._server = grpc.aio.server()
        self._server.add_generic_rpc_handlers(
            [grpc.method_handlers_generic_handler(f"cogmentAPI.{self.service}", handlers)]
        )
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        await self._server.start()
        return self

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(None)


class FakeTcpService:
    """A TCP listener on 127.0.0.1 that answers anything with a line, stays silent, or resets
    each connection it accepts at once (a server shedding load)."""

    def __init__(self, silent: bool = False, resets: bool = False) -> None:
        self.silent = silent
        self.resets = resets
        self.connections = 0
        self.port = 0
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[None]] = set()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        task.add_done_callback(self._handlers.discard)
        try:
            if self.resets:
                # No lingering: closing sends a reset, not the end of the stream.
                writer.get_extra_info("socket").setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                )
                writer.transport.abort()
                return
            if self.silent:
                await asyncio.sleep(3600)
            await reader.read(256)
            writer.write(b"HTTP/1.1 200 OK\r\n\r\n")
            await writer.drain()
        finally:
            writer.close()

    async def start(self) -> FakeTcpService:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for handler in list(self._handlers):  # silent connections would keep it open
                handler.cancel()
            await self._server.wait_closed()


def free_port() -> int:
    """A port nothing listens on (bound then released)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
