"""What the property-based fuzz suites (tests/*/test_fuzz.py) share.

Each of them runs one real server per test function, not per hypothesis example: the server lives
in an event loop of its own, in a background thread (`ServerHarness`), and hypothesis examples are
plain synchronous functions that hand their async body to that loop. So nothing depends on
pytest-asyncio, and a server's start-up (migrations, a PostgreSQL database) is paid once a test.

Also here: how a call ended (`Outcome`) and the coroutines that make calls into one, the
assertions on it, the text and number strategies the suites draw from, and the machinery that
sends any bytes, parseable or not, to a service's methods (`RawRequests`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import random
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack, contextmanager
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message
from hypothesis import HealthCheck, event, note, settings
from hypothesis import strategies as st

T = TypeVar("T")
H = TypeVar("H", bound="ServerHarness")

CALL_TIMEOUT_S = 20.0
# What a grpcio client reports, in place of the server's status, when the server ends a
# client-streaming call (refusing an upload at its header) while a large message is still being
# written. Never sent by the server, whose INTERNAL details are "internal error (logged...)".
CLIENT_CORE_ERROR = "Internal error from Core"

# Examples share one server, and some draw megabytes: no deadline, and none of the health checks
# that would fail such tests for being slow or large rather than wrong.
FUZZ = settings(
    max_examples=60,
    deadline=None,
    print_blob=True,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.large_base_example,
    ],
)


# ---- one server per test, driven from a background event loop ----


class ServerHarness:
    """An event loop in a thread of its own, and what a suite runs in it until `close()`.

    gRPC's aio channels and calls belong to the loop that made them: every call is made through
    `run` or `start`. Subclasses enter their server with `enter`, inside `closing_on_error`."""

    def __init__(self, name: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()
        self._stack = AsyncExitStack()
        self._ids = itertools.count()

    def __enter__(self: H) -> H:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    @contextmanager
    def closing_on_error(self) -> Iterator[None]:
        """Close if setting up fails: the loop's thread would outlive the test otherwise."""
        try:
            yield
        except BaseException:
            self.close()
            raise

    def enter(self, make: Callable[[], AbstractAsyncContextManager[T]], timeout: float = 60.0) -> T:
        """Enter `make()` in the loop (where it is made too: channels take the loop they are made
        in), until `close()`."""
        return self.run(lambda: self._stack.enter_async_context(make()), timeout=timeout)

    def start(self, function: Callable[..., Awaitable[T]], *args: Any) -> concurrent.futures.Future[T]:
        """Start `await function(*args)` in the loop, for calls that run alongside others."""

        async def body() -> T:
            return await function(*args)

        return asyncio.run_coroutine_threadsafe(body(), self._loop)

    def run(self, function: Callable[..., Awaitable[T]], *args: Any, timeout: float = 60.0) -> T:
        """`await function(*args)` in the loop."""
        return self.start(function, *args).result(timeout)

    def fresh_id(self, prefix: str = "fuzz") -> str:
        """An id no earlier example of the test used: they all share the server."""
        return f"{prefix}-{next(self._ids)}"

    def close(self) -> None:
        try:
            self.run(self._stack.aclose, timeout=60)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(30)
            self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            self._loop.close()


# ---- calls ----


@dataclass
class Outcome:
    """What a call returned: the replies, then its final status (errors are data, for oracles)."""

    replies: list[Any] = field(default_factory=list)
    code: grpc.StatusCode = grpc.StatusCode.OK
    details: str = ""

    def fail(self, error: grpc.aio.AioRpcError) -> None:
        """The call ended in `error`."""
        self.code, self.details = error.code(), error.details() or ""


async def collect(call: Any) -> Outcome:
    """Every reply of a server-streaming (or bidirectional) call, then its status."""
    outcome = Outcome()
    try:
        async for reply in call:
            outcome.replies.append(reply)
    except grpc.aio.AioRpcError as error:
        outcome.fail(error)
    return outcome


async def unary(call: Any) -> Outcome:
    """The reply of a unary call, or its error."""
    outcome = Outcome()
    try:
        outcome.replies.append(await call)
    except grpc.aio.AioRpcError as error:
        outcome.fail(error)
    return outcome


async def iterate(items: Sequence[T]) -> AsyncIterator[T]:
    """`items` as a request stream that grpcio sends as fast as it can, then half-closes."""
    for item in items:
        yield item


async def send_stream(call: Any, messages: Sequence[Any]) -> Outcome:
    """Write `messages` one at a time on a client-streaming call, stopping when the server has
    already ended it (refusing the header, say), then its status. (Handing grpcio an iterator
    instead, a server ending the call early can leave the client with its own INTERNAL "Internal
    error from Core" in place of the server's status.)"""
    try:
        for message in messages:
            if call.done():
                break
            await call.write(message)
        if not call.done():
            await call.done_writing()
    except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
        pass  # the call is over: its status says why
    return await unary(call)


async def _read_replies(call: Any, outcome: Outcome) -> None:
    try:
        async for reply in call:
            outcome.replies.append(reply)
    except grpc.aio.AioRpcError as error:
        outcome.fail(error)
    except asyncio.CancelledError:
        if not call.cancelled():  # this task was cancelled, not the call
            raise
        outcome.code = grpc.StatusCode.CANCELLED


async def send_bidi(call: Any, messages: Sequence[Any], cancel_after: int | None = None) -> Outcome:
    """Write `messages` on a bidirectional call (stopping once the server ended it, or cancelling
    the call after `cancel_after` of them) while collecting its replies, then its status."""
    outcome = Outcome()
    reading = asyncio.ensure_future(_read_replies(call, outcome))
    try:
        for message in messages[:cancel_after]:
            if call.done():
                break
            await call.write(message)
        if cancel_after is not None:
            call.cancel()
        elif not call.done():
            await call.done_writing()
    except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
        pass  # the call is over: its status says why
    await asyncio.wait_for(reading, CALL_TIMEOUT_S)
    return outcome


# ---- assertions ----


def assert_ok(outcome: Outcome) -> None:
    assert outcome.code == grpc.StatusCode.OK, f"{outcome.code.name}: {outcome.details}"


def assert_no_server_error(outcome: Outcome) -> None:
    """Whatever a client sends, it is never told INTERNAL or UNKNOWN."""
    assert outcome.code not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), (
        f"server error {outcome.code.name}: {outcome.details}"
    )


def assert_version_reply(outcome: Outcome) -> None:
    """A Version call answered, each version named and set."""
    assert_ok(outcome)
    for item in outcome.replies[0].versions:
        assert item.name and item.version


def assert_client_error(outcome: Outcome, *allowed: grpc.StatusCode) -> None:
    """The call ended in one of the `allowed` codes (or in grpcio's own CLIENT_CORE_ERROR, which
    stands in for the server's status)."""
    if outcome.code == grpc.StatusCode.INTERNAL and outcome.details == CLIENT_CORE_ERROR:
        # Not the server's status (its INTERNAL says "internal error (logged on the server)").
        event("grpcio client: Internal error from Core")
        return
    assert_no_server_error(outcome)
    assert outcome.code in allowed, (
        f"expected {[c.name for c in allowed]}, got {outcome.code.name}: {outcome.details}"
    )


# ---- strategies ----

unicode_chars = st.characters(codec="utf-8")  # every code point except lone surrogates
sane_chars = st.characters(codec="utf-8", exclude_characters="\x00")
# Texts that storage and matching code may treat specially: wildcards, escapes and quotes...
QUOTING_TEXTS = ["*", "%", "_", "\\", "'", '"']
# ...and beyond ASCII: accents, CJK, an emoji (4 UTF-8 bytes), a bidi override, a BOM, the last
# code point.
UNICODE_TEXTS = ["é", "日本語", "🙂", "\u202e", "\ufeff", "\U0010ffff"]
SPECIAL_TEXTS = [
    "",
    " ",
    "\x00",
    "a\x00b",
    *QUOTING_TEXTS,
    "../../etc/passwd",
    "/",
    ".",
    "..",
    ".incomplete",
    *UNICODE_TEXTS,
]
# Code points of every UTF-8 length, for incompressible huge strings.
_RANDOM_POOL = "az09-./é∑日本🙂\U0001f680\x7f"
_ASCII_POOL = "abcdefghijklmnopqrstuvwxyz0123456789"


def random_text(seed: int, size_bytes: int, ascii_only: bool = False) -> str:
    """About `size_bytes` of UTF-8 that barely compresses."""
    rng = random.Random(seed)
    pool = _ASCII_POOL if ascii_only else _RANDOM_POOL
    chars: list[str] = []
    used = 0
    while used < size_bytes:
        chars.append(rng.choice(pool))
        used += len(chars[-1].encode())
    return "".join(chars)


@st.composite
def huge_texts(draw: st.DrawFn) -> str:
    """Strings of 1 to 40 KB, repetitive or random; well under gRPC's limits."""
    size = draw(st.integers(1_000, 40_000))
    if draw(st.booleans()):
        return draw(unicode_chars) * size
    return random_text(draw(st.integers(0, 2**32)), size)


small_texts = st.one_of(st.text(unicode_chars, max_size=12), st.sampled_from(SPECIAL_TEXTS))
texts = st.one_of(small_texts, small_texts, small_texts, huge_texts())
uint32s = st.one_of(st.sampled_from([0, 1, 2, 3, 2**31, 2**32 - 1]), st.integers(0, 2**32 - 1))


def parse_handle(handle: str) -> int | None:
    """The reference's rule for paging handles: empty = 0, else a non-negative number in ASCII
    decimal digits (as Go's strconv parses it: other scripts' digits are refused)."""
    if not handle:
        return 0
    if not (handle.isascii() and handle.isdecimal()):
        return None
    try:
        return int(handle)
    except ValueError:  # beyond int()'s digit limit: still a valid handle
        return 10**100


# ---- raw bytes, valid protobuf or not ----

# Byte strings that parse as no request: bad tags and wire types, truncations, overruns. Suites add
# the corruptions of their own request types (invalid UTF-8 in a string field...).
CORRUPT = [
    b"\xff",
    b"\x00",
    b"\x08",
    b"\x0f",
    b"\x0b",
    b"\x08" + b"\xff" * 10 + b"\x01",
    b"\x0a\x05ab",
    b"\x12\x7f",
]


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def length_delimited(number: int, payload: bytes) -> bytes:
    """Field `number` holding `payload` (a string, bytes or a message), as protobuf encodes it."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


@st.composite
def unknown_fields(draw: st.DrawFn, max_fields: int) -> bytes:
    """Well-formed fields with numbers no request uses: a parser must skip them."""
    out = b""
    for _ in range(draw(st.integers(0, max_fields))):
        number = draw(st.integers(16, 2**29 - 1))
        if draw(st.booleans()):
            out += _varint(number << 3) + _varint(draw(st.integers(0, 2**64 - 1)))
        else:
            out += length_delimited(number, draw(st.binary(max_size=30)))
    return out


@dataclass(frozen=True)
class RawRequests:
    """A service's methods as raw bytes: what their requests are, which take a stream of them, and
    how to draw valid ones; from those, any bytes to send them, parseable or not."""

    request_types: Mapping[str, type[Message]]
    streaming: frozenset[str]  # the methods that take a stream of requests
    corrupt: Sequence[bytes]  # CORRUPT and the service's own
    valid_requests: Callable[[str], st.SearchStrategy[Message]]
    max_unknown_fields: int

    def decodes(self, method: str, raw: bytes) -> bool:
        try:
            self.request_types[method].FromString(raw)
        except DecodeError:
            return False
        return True

    def decodable(self, method: str, messages: Sequence[bytes], outcome: Outcome) -> list[bool]:
        """Which of `messages` parse, noted with how the call ended (and counted in hypothesis'
        statistics)."""
        good = [self.decodes(method, raw) for raw in messages]
        ended = f"{outcome.code.name} {outcome.details!r}, {len(outcome.replies)} replies"
        note(f"{method}: decodable={good} -> {ended}")
        event(f"raw {method}: {'undecodable' if False in good else 'decodable'} -> {outcome.code.name}")
        return good

    def decodable_messages(self, method: str) -> st.SearchStrategy[bytes]:
        """A valid request, plus fields of numbers it does not have (which a parser skips)."""
        return _decodable_messages(self, method)

    def undecodable_messages(self, method: str) -> st.SearchStrategy[bytes]:
        """Known corruptions, or a valid request cut short and followed by one."""
        return _undecodable_messages(self, method)

    def raw_messages(self, method: str) -> st.SearchStrategy[bytes]:
        """Any bytes: random, decodable or not."""
        return st.one_of(
            st.binary(max_size=64), self.decodable_messages(method), self.undecodable_messages(method)
        )

    def calls(self, undecodable: bool = False) -> st.SearchStrategy[tuple[str, list[bytes]]]:
        """A method and what to send it: one message, or a stream of them (possibly empty).
        `undecodable`: at least one message does not parse."""
        return _raw_calls(self, undecodable)


@st.composite
def _decodable_messages(draw: st.DrawFn, requests: RawRequests, method: str) -> bytes:
    return draw(requests.valid_requests(method)).SerializeToString() + draw(
        unknown_fields(requests.max_unknown_fields)
    )


@st.composite
def _undecodable_messages(draw: st.DrawFn, requests: RawRequests, method: str) -> bytes:
    # Some are corrupt for one request type only (a string field is a varint or unknown in others).
    corrupt = st.sampled_from([raw for raw in requests.corrupt if not requests.decodes(method, raw)])
    if draw(st.booleans()):
        return draw(corrupt)
    encoded = draw(requests.valid_requests(method)).SerializeToString()
    cut = draw(st.integers(0, len(encoded)))
    spliced = encoded[:cut] + draw(corrupt)
    return spliced if not requests.decodes(method, spliced) else draw(corrupt)


@st.composite
def _raw_calls(draw: st.DrawFn, requests: RawRequests, undecodable: bool) -> tuple[str, list[bytes]]:
    method = draw(st.sampled_from(sorted(requests.request_types)))
    if method not in requests.streaming:
        message = requests.undecodable_messages(method) if undecodable else requests.raw_messages(method)
        return method, [draw(message)]
    if not undecodable and draw(st.booleans()):
        return method, draw(st.lists(requests.decodable_messages(method), max_size=4))
    messages = draw(st.lists(requests.raw_messages(method), max_size=3))
    messages.insert(draw(st.integers(0, len(messages))), draw(requests.undecodable_messages(method)))
    # Nothing after the first undecodable message: the server may end the call there, and a grpcio
    # client still writing then reports its own INTERNAL "Internal error from Core" instead of the
    # server's status.
    first_bad = next(index for index, raw in enumerate(messages) if not requests.decodes(method, raw))
    return method, messages[: first_bad + 1]
