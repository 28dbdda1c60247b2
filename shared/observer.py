"""Every call, observed in one place: counted and timed (Prometheus), logged, and ended with the
status its outcome calls for.

This is where errors become statuses (see `shared.errors`): a `ServiceError` ends the call with
its own code and message, a failure of a dependency with the code `classify` gives it, anything
else is a bug: INTERNAL, with its traceback logged, and never a crash. Request bytes that do not
parse end the call with INVALID_ARGUMENT (grpc itself would answer UNKNOWN).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from shared import metrics
from shared.errors import Unavailable, classify
from shared.handlers import HANDLER_FACTORY, UNDECODABLE_MESSAGE
from shared.logging import get_logger

log = get_logger("shared.observer")

_RPC_TYPES = {
    (False, False): "unary",
    (False, True): "server_stream",
    (True, False): "client_stream",
    (True, True): "bidi_stream",
}
# The attribute of a grpc method handler holding its behaviour, by rpc type.
_BEHAVIOR_ATTRIBUTES = {
    "unary": "unary_unary",
    "server_stream": "unary_stream",
    "client_stream": "stream_unary",
    "bidi_stream": "stream_stream",
}
INTERNAL_ERROR_MESSAGE = "internal error (logged on the server)"
# What is left of a failed call's request stream is read for at most this long, and this much.
DRAIN_LIMIT_S = 2.0
DRAIN_LIMIT_BYTES = 64 * 1024 * 1024


@dataclass
class _CallRecorder:
    """The figures and log fields of one method, looked up once rather than per call."""

    rpc: str
    stats: metrics.RpcStats
    # Told when a call failed because a dependency is away (see shared.dependencies).
    on_dependency_failure: Callable[[], None]

    @classmethod
    def for_method(
        cls, method: str, rpc_type: str, on_dependency_failure: Callable[[], None]
    ) -> _CallRecorder:
        service, _, name = method.lstrip("/").partition("/")
        return cls(
            rpc=method,
            stats=metrics.rpc_metrics.stats(rpc_type, service, name),
            on_dependency_failure=on_dependency_failure,
        )

    def finish(self, code: grpc.StatusCode, started_at: float, details: str | None, peer: str) -> None:
        elapsed = time.perf_counter() - started_at
        self.stats.finished(code.name, elapsed)
        if code in (grpc.StatusCode.OK, grpc.StatusCode.CANCELLED):
            if log.is_enabled_for(logging.DEBUG):  # skip building the fields on the hot path
                log.debug("rpc", rpc=self.rpc, code=code.name, seconds=round(elapsed, 6), peer=peer)
        else:
            log.info(
                "rpc failed",
                rpc=self.rpc,
                code=code.name,
                details=details,
                peer=peer,
                seconds=round(elapsed, 6),
            )


def _final_code(context: Any) -> grpc.StatusCode:
    code = context.code()
    if code is None:
        return grpc.StatusCode.OK
    return code if isinstance(code, grpc.StatusCode) else grpc.StatusCode.UNKNOWN


def _outcome(
    error: BaseException | None, recorder: _CallRecorder, context: Any
) -> tuple[grpc.StatusCode, str | None]:
    """The status a call ends with, and its message, given how its handler ended."""
    if error is None or isinstance(error, grpc.aio.AbortError):
        return _final_code(context), context.details()
    if isinstance(error, (asyncio.CancelledError, GeneratorExit)):
        return grpc.StatusCode.CANCELLED, None
    if not isinstance(error, Exception):
        return grpc.StatusCode.UNKNOWN, None
    failure = classify(error)
    if failure is None:
        log.error("unexpected error in rpc", rpc=recorder.rpc, exc_info=error)
        return grpc.StatusCode.INTERNAL, INTERNAL_ERROR_MESSAGE
    if failure is not error:
        # The dependency's outage is logged once where it is watched, not once per call.
        log.debug("rpc failed on a dependency", rpc=recorder.rpc, code=failure.code.name, error=str(error))
        if isinstance(failure, Unavailable):
            recorder.on_dependency_failure()
    return failure.code, str(failure)


# Stands for request bytes that do not parse: the call then ends with INVALID_ARGUMENT (grpc
# itself would answer UNKNOWN, or the handler's loop INTERNAL).
_UNDECODABLE = object()


def _tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except DecodeError:
            return _UNDECODABLE

    return deserialize


class _ReceivedRequests:
    """A client stream's requests, read one at a time with `context.read()`, none kept once
    handed over: gRPC's own request iterator keeps each message until the next one arrives, which
    a method bounding the bytes it holds (the datastore's ingestion) cannot allow. Bytes that do
    not parse end the call with INVALID_ARGUMENT."""

    def __init__(self, context: Any) -> None:
        self._context = context

    def __aiter__(self) -> _ReceivedRequests:
        return self

    async def __anext__(self) -> Any:
        request = await self._context.read()
        if request is grpc.aio.EOF:
            raise StopAsyncIteration
        if request is _UNDECODABLE:
            await self._context.abort(grpc.StatusCode.INVALID_ARGUMENT, UNDECODABLE_MESSAGE)
        return request


async def _admitted(request: Any, context: Any) -> Any:
    if request is _UNDECODABLE:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, UNDECODABLE_MESSAGE)
    return request


async def _drain(requests: AsyncIterator[Any]) -> None:
    """Read and drop what is left of a request stream, within DRAIN_LIMIT_S and DRAIN_LIMIT_BYTES.

    A client still writing when its call ends with an error may be told INTERNAL ("Internal error
    from Core") instead of that error: grpc's asyncio client lets a write that fails because the
    call ended overwrite the status the server sent (grpc/grpc#36066). Once the client has sent
    everything, it sees the real status.
    """

    async def drop() -> None:
        received = 0
        async for request in requests:
            received += request.ByteSize()
            if received > DRAIN_LIMIT_BYTES:
                return

    with contextlib.suppress(Exception):  # the stream broke, or the limit: end the call anyway
        await asyncio.wait_for(drop(), DRAIN_LIMIT_S)


class _ObservedCall:
    """Counts, times and logs one call (from its creation), and ends it with the status of its
    outcome. Plain methods rather than an async context manager: this runs on every call."""

    __slots__ = ("context", "peer", "recorder", "requests", "started_at")

    def __init__(self, recorder: _CallRecorder, context: Any, requests: AsyncIterator[Any] | None) -> None:
        recorder.stats.started += 1
        self.recorder = recorder
        self.context = context
        # The request stream of a client-streaming call (what is left of it is drained on errors).
        self.requests = requests
        self.started_at = time.perf_counter()
        # Read now: grpcio 1.85 can crash (SIGSEGV) in `peer()` once the client cancelled the call.
        self.peer = context.peer()

    def succeeded(self) -> None:
        self.recorder.finish(_final_code(self.context), self.started_at, self.context.details(), self.peer)

    async def failed(self, error: BaseException) -> None:
        """Record how the handler failed; an Exception ends the call with its status (raises
        AbortError), anything else (a cancellation) is for the caller to raise on."""
        code, details = _outcome(error, self.recorder, self.context)
        self.recorder.finish(code, self.started_at, details, self.peer)
        if isinstance(error, Exception) and not isinstance(error, grpc.aio.AbortError):
            if self.requests is not None:
                await _drain(self.requests)
            await self.context.abort(code, details)


def _wrap_unary_response(
    behavior: Callable[..., Any], recorder: _CallRecorder, streaming: bool
) -> Callable[..., Any]:
    async def handle(request: Any, context: Any) -> Any:
        requests = _ReceivedRequests(context) if streaming else None  # not gRPC's iterator, `request`
        call = _ObservedCall(recorder, context, requests)
        try:
            response = await behavior(requests if streaming else await _admitted(request, context), context)
        except BaseException as error:
            await call.failed(error)
            raise
        call.succeeded()
        return response

    return handle


def _wrap_stream_response(
    behavior: Callable[..., Any], recorder: _CallRecorder, streaming: bool
) -> Callable[..., Any]:
    async def handle(request: Any, context: Any) -> AsyncIterator[Any]:
        requests = _ReceivedRequests(context) if streaming else None  # not gRPC's iterator, `request`
        call = _ObservedCall(recorder, context, requests)
        try:
            async for response in behavior(
                requests if streaming else await _admitted(request, context), context
            ):
                yield response
        except BaseException as error:
            await call.failed(error)
            raise
        call.succeeded()

    return handle


def _ignore() -> None:
    pass


class ObservabilityInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    def __init__(self, on_dependency_failure: Callable[[], None] = _ignore) -> None:
        self._handlers: dict[str, Any] = {}
        self._on_dependency_failure = on_dependency_failure

    async def intercept_service(self, continuation: Callable[..., Any], details: Any) -> Any:
        handler = await continuation(details)
        if handler is None:
            return None
        method = details.method
        cached = self._handlers.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        streaming = (handler.request_streaming, handler.response_streaming)
        rpc_type = _RPC_TYPES[streaming]
        behavior = getattr(handler, _BEHAVIOR_ATTRIBUTES[rpc_type])
        recorder = _CallRecorder.for_method(method, rpc_type, self._on_dependency_failure)
        wrap = _wrap_stream_response if inspect.isasyncgenfunction(behavior) else _wrap_unary_response
        new_handler = HANDLER_FACTORY[streaming](
            wrap(behavior, recorder, handler.request_streaming),
            request_deserializer=_tolerant(handler.request_deserializer),
            response_serializer=handler.response_serializer,
        )
        self._handlers[method] = (handler, new_handler)
        return new_handler
