"""Serving a servicer's methods, and the pre-encoded responses of large or many replies."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError, Message
from google.protobuf.message_factory import GetMessageClass

from shared.errors import InvalidArgument

M = TypeVar("M", bound=Message)

# What request bytes that do not parse are answered (INVALID_ARGUMENT; grpc itself would answer UNKNOWN).
UNDECODABLE_MESSAGE = "request is not a valid message of this method's type"

# The grpc handler factory of a method, by (client streaming, server streaming).
HANDLER_FACTORY: Mapping[tuple[bool, bool], Callable[..., grpc.RpcMethodHandler]] = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def add_servicer(
    server: grpc.aio.Server,
    service: ServiceDescriptor,
    servicer: object,
    response_serializers: Mapping[str, Callable[[Any], bytes]] | None = None,
    raw_requests: Iterable[str] = (),
) -> str:
    """Serve every method of `service` with the servicer's method of the same name; the
    service's full name.

    What the generated `add_*Servicer_to_server` functions do, plus per-method response
    serializers: a method can then yield bytes it encoded itself (e.g. large data chunks framed
    without building, then serializing, a message around each). The methods of `raw_requests` are
    given their request's bytes, to parse with `parse_request` (or not, when they recognise them).
    """
    overrides = response_serializers or {}
    raw = set(raw_requests)
    single = {method.name for method in service.methods if not method.client_streaming}
    assert raw <= single, f"raw requests are for methods of one request: {sorted(raw - single)}"
    handlers = {}
    for method in service.methods:
        factory = HANDLER_FACTORY[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = factory(
            getattr(servicer, method.name),
            request_deserializer=(
                _request_bytes if method.name in raw else GetMessageClass(method.input_type).FromString
            ),
            response_serializer=overrides.get(
                method.name, GetMessageClass(method.output_type).SerializeToString
            ),
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)
    return str(service.full_name)


def _request_bytes(data: bytes) -> bytes:
    return data


def parse_request(message_type: type[M], data: bytes) -> M:
    """The request of a method served with its raw bytes (see `add_servicer`)."""
    try:
        return message_type.FromString(data)
    except DecodeError:
        raise InvalidArgument(UNDECODABLE_MESSAGE) from None


ONE_BYTE_VARINTS = tuple(bytes((value,)) for value in range(0x80))


def varint(value: int) -> bytes:
    """Base-128 varint of a non-negative integer: protobuf's lengths and unsigned fields."""
    if value < 0x80:
        return ONE_BYTE_VARINTS[value]
    encoded = []
    while value >= 0x80:
        encoded.append(value & 0x7F | 0x80)
        value >>= 7
    encoded.append(value)
    return bytes(encoded)


def field_one_frame(payload: bytes | memoryview) -> bytes:
    """The encoding of a message whose field 1 (bytes, or an embedded message) holds `payload`.

    Streams of large or many replies yield these (with `pre_encoded` as the method's response
    serializer): building a message around a payload, then serializing it, copies the payload
    twice more on the event loop, and that bounds the stream's speed. The wire bytes are the same.
    """
    return b"\x0a" + varint(len(payload)) + payload


def pre_encoded(frame: bytes) -> bytes:
    """Response serializer of methods that yield encoded messages."""
    return frame


# What one reply may hold: gRPC clients (the official SDK among them) refuse messages over 4 MiB
# by default. An unpaged listing is cut to fit, with the handle of what comes next.
REPLY_BUDGET_BYTES = 4 * 1024 * 1024 - 16 * 1024
# A repeated message field's tag and length, at most.
_FIELD_OVERHEAD = 6


def fitting_count(
    sizes: Iterable[int], budget: int = REPLY_BUDGET_BYTES, overhead: int = _FIELD_OVERHEAD
) -> int:
    """How many items of these sizes, from the first, fit in the budget (at least one, so that
    paging always moves on); `overhead`: what each adds beyond its size (by default, its field's
    framing in one reply)."""
    total = 0
    count = 0
    for size in sizes:
        total += size + overhead
        if total > budget:
            return max(count, 1)
        count += 1
    return count
