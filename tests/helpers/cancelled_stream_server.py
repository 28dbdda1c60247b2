"""`python -m tests.helpers.cancelled_stream_server`: a server with the suite's call interceptor,
whose streaming handler outlives its client's cancellation, and a client that cancels it fifty
times. Exits 0 when the server survived. grpcio 1.85 crashes (SIGSEGV) when `context.peer()` is
read once a cancelled call is over, which the interceptor's per-call log line used to do."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import AsyncIterator
from typing import Any

import grpc

from shared.logging import configure_logging
from shared.observer import ObservabilityInterceptor


async def endless(request: bytes, context: Any) -> AsyncIterator[bytes]:
    try:
        while True:
            yield b"x" * 100
            await asyncio.sleep(0)
    finally:
        for _ in range(3):  # still running after the client is gone
            await asyncio.sleep(0.01)


async def main() -> int:
    configure_logging("debug", "json", None)
    logging.getLogger().setLevel(logging.DEBUG)
    server = grpc.aio.server(interceptors=[ObservabilityInterceptor()])
    handler = grpc.unary_stream_rpc_method_handler(
        endless, request_deserializer=bytes, response_serializer=bytes
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Endless", {"Run": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    for _ in range(50):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_stream(
                "/test.Endless/Run", request_serializer=bytes, response_deserializer=bytes
            )(b"")
            for _ in range(10):
                await call.read()
            call.cancel()
        await asyncio.sleep(0.05)
    await server.stop(None)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
