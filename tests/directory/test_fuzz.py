"""Property-based fuzzing of every DirectorySP RPC, over real gRPC, on SQLite and PostgreSQL.

Each test runs one real directory (`directory_factory`, so on both databases, with health checks
every 0.2 s) in an event loop of its own, in a background thread; hypothesis examples are plain
synchronous functions that hand their async body to that loop (tests/helpers/fuzz.py). So there is
one directory per test, not per example, and nothing depends on pytest-asyncio.

Checked, over random and malformed requests and `authentication-token` metadata:
* Register/Deregister: exactly one reply per request, in order, OK or FAILED (FAILED with an
  `error_msg`, no id, no secret, and not a storage error); outcomes follow the reference's
  validation rules; what is accepted reads back verbatim, to its token only; deregistration takes
  the right id, secret and token, once. Streams sent at once, or one request per reply.
* Inquire: well-formed replies matching the inquiry and the token, or INVALID_ARGUMENT; never
  INTERNAL/UNKNOWN.
* Status/Version: OK; Status has exactly the statuses asked for (`*` = all).
* Raw bytes: parseable ones are served as usual, unparseable ones end the call in an error.
* After every example the server still answers Status from its database.

* Unparseable request bytes get INVALID_ARGUMENT; long property names and values are stored on
  both databases (both were defects this file found).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc
import pytest
from google.protobuf.message import Message
from hypothesis import event, example, given, note, settings
from hypothesis import strategies as st

from services.directory.servicer import TOKEN_PROPERTY
from shared.api import common_pb2, directory_pb2, directory_pb2_grpc
from shared.validation import MAX_RECEIVE_MESSAGE_BYTES
from tests.helpers.fuzz import (
    CALL_TIMEOUT_S,
    CORRUPT,
    FUZZ,
    QUOTING_TEXTS,
    UNICODE_TEXTS,
    Outcome,
    RawRequests,
    ServerHarness,
    assert_no_server_error,
    assert_ok,
    assert_version_reply,
    collect,
    iterate,
    length_delimited,
    random_text,
    sane_chars,
    unary,
    unicode_chars,
)
from tests.helpers.running import DirectoryFactory

SERVICE = "cogmentAPI.DirectorySP"
TOKEN_KEY = "authentication-token"
# A request on an interleaved stream waits this long for its reply (they take milliseconds).
REPLY_TIMEOUT_S = 5.0
MAX_SERVICE_ID = 2**63 - 1
# Health checks every 0.2 s run alongside the fuzzing (and check the fuzzed endpoints).
HEALTH_FLAGS = ("--health_check_interval", "0.2")

VALID_PROTOCOLS = frozenset({1, 2, 3})  # GRPC, GRPC_SSL, COGMENT
COGMENT = directory_pb2.ServiceEndpoint.COGMENT
VALID_TYPES = frozenset({*range(1, 10), 100})  # TRIAL_LIFE_CYCLE..DIRECTORY, OTHER_SERVICE
KNOWN_STATUSES = ("overall_load", "nb_entries", "load_balancing")
# The reference's replies for storage failures (docs/compatibility.md#directory), and this one's for
# Deregister: a server defect, whatever the request.
STORAGE_FAILURES = ("Could not add service to database", "Could not update service in database")
DEREGISTER_STORAGE_FAILURE = "database error"
# What a client may be told about a request it got wrong. Never INTERNAL or UNKNOWN.
CLIENT_ERROR_CODES = frozenset({grpc.StatusCode.INVALID_ARGUMENT})


# ---- one directory per test, driven from a background event loop ----


class Harness(ServerHarness):
    """A running directory."""

    def __init__(self, factory: DirectoryFactory, *flags: str) -> None:
        super().__init__("fuzz-directory")
        with self.closing_on_error():
            self.directory = self.enter(lambda: factory(*flags))
        self.channel: grpc.aio.Channel = self.directory.channel
        self.stub: directory_pb2_grpc.DirectorySPStub = self.directory.stub

    def check_alive(self) -> None:
        """The server still answers, from its database too."""
        request = common_pb2.StatusRequest(names=["*"])
        reply = self.run(lambda: self.stub.Status(request, timeout=CALL_TIMEOUT_S))
        assert set(reply.statuses) == set(KNOWN_STATUSES)
        assert reply.statuses["nb_entries"].isdecimal()


@pytest.fixture
def fuzz(directory_factory: DirectoryFactory) -> Iterator[Harness]:
    with Harness(directory_factory, *HEALTH_FLAGS) as harness:
        yield harness


# ---- calls ----


def metadata(token: str | None, extra: Sequence[tuple[str, str]] = ()) -> tuple[tuple[str, str], ...] | None:
    """`None` sends no token at all (the same as an empty one)."""
    pairs = [*extra] if token is None else [(TOKEN_KEY, token), *extra]
    return tuple(pairs) or None


async def bidi(method: Any, requests: Sequence[Any], md: Any, interleave: bool) -> Outcome:
    """All requests then half-close, or (interleave) each request waits for its reply."""
    if not interleave:
        return await collect(method(iterate(requests), metadata=md, timeout=CALL_TIMEOUT_S))
    call = method(metadata=md, timeout=CALL_TIMEOUT_S)
    outcome = Outcome()
    try:
        for request in requests:
            await call.write(request)
            try:
                reply = await asyncio.wait_for(call.read(), REPLY_TIMEOUT_S)
            except asyncio.TimeoutError:
                call.cancel()
                raise AssertionError(f"no reply within {REPLY_TIMEOUT_S} s to {request}") from None
            assert reply is not grpc.aio.EOF, "the stream ended before answering a request"
            outcome.replies.append(reply)
        await call.done_writing()
        assert await call.read() is grpc.aio.EOF, "a reply nobody asked for"
        outcome.code = await call.code()
        outcome.details = await call.details() or ""
    except grpc.aio.AioRpcError as error:
        outcome.fail(error)
    return outcome


def assert_answered(outcome: Outcome, requests: Sequence[Any]) -> None:
    """A request stream ended OK, after one reply per request."""
    assert_ok(outcome)
    assert len(outcome.replies) == len(requests), "not one reply per request"


# ---- strategies ----

# grpc metadata values must be printable ASCII.
printable_ascii = st.characters(min_codepoint=0x20, max_codepoint=0x7E)
tokens = st.one_of(st.none(), st.just(""), st.text(printable_ascii, max_size=40))
SPECIAL_TEXTS = [
    "",
    " ",
    "\x00",
    "a\x00b",
    "\x00" * 3,
    *QUOTING_TEXTS,
    "localhost",
    "127.0.0.1",
    "::1",
    "[::1]",
    "0.0.0.0",
    "unix:/tmp/x",
    "dns:///x:1",
    *UNICODE_TEXTS,
    "__id",
    "__authentication-token",
]


@st.composite
def huge_texts(draw: st.DrawFn, max_random_bytes: int = 40_000) -> str:
    """Large strings, repetitive or random (incompressible), ASCII or not; well under 4 MiB."""
    size = draw(st.integers(1_000, 40_000))
    kind = draw(st.sampled_from(["repeat", "ascii", "unicode"]))
    if kind == "repeat":
        return draw(unicode_chars) * size
    return random_text(draw(st.integers(0, 2**32)), min(size, max_random_bytes), kind == "ascii")


small_texts = st.one_of(
    st.text(unicode_chars, max_size=12),
    st.sampled_from(SPECIAL_TEXTS),
    st.text(printable_ascii, min_size=1, max_size=12),
)
texts = st.one_of(small_texts, small_texts, small_texts, huge_texts())


@st.composite
def property_maps(draw: st.DrawFn) -> dict[str, str]:
    properties = draw(st.dictionaries(small_texts, small_texts, max_size=4))
    if draw(st.integers(0, 7)) == 0:  # now and then one huge name or value
        # Random text stays under PostgreSQL's index limit: see test_register_long_properties.
        huge = draw(huge_texts(max_random_bytes=2_000))
        if draw(st.booleans()):
            properties[huge] = draw(small_texts)
        else:
            properties[draw(small_texts)] = huge
    return properties


int32s = st.integers(-(2**31), 2**31 - 1)
protocols = st.one_of(st.sampled_from([0, 1, 2, 3]), st.sampled_from([1, 2, 3]), int32s)
service_types = st.one_of(st.sampled_from([0, *VALID_TYPES]), st.sampled_from(sorted(VALID_TYPES)), int32s)
ports = st.one_of(
    st.sampled_from([0, 1, 80, 65535, 65536, 2**31 - 1, 2**31, 2**32 - 1]), st.integers(0, 2**32 - 1)
)
service_ids = st.one_of(
    st.sampled_from([0, 1, MAX_SERVICE_ID, MAX_SERVICE_ID + 1, 2**64 - 1]), st.integers(0, 2**64 - 1)
)
hosts = st.one_of(st.sampled_from(["", "\x00", "a\x00", " "]), small_texts, huge_texts())


@st.composite
def details(draw: st.DrawFn) -> directory_pb2.ServiceDetails:
    return directory_pb2.ServiceDetails(type=draw(service_types), properties=draw(property_maps()))


# Sane values, for the fields a request does not fuzz.
sane_texts = st.text(sane_chars, max_size=8)
sane_hosts = st.one_of(
    st.text(sane_chars, min_size=1, max_size=20), st.sampled_from(["localhost", "127.0.0.1"])
)
sane_properties = st.dictionaries(sane_texts, sane_texts, max_size=3)
REGISTER_FIELDS = ("endpoint", "details", "protocol", "host", "port", "type", "properties")


@st.composite
def register_requests(draw: st.DrawFn) -> directory_pb2.RegisterRequest:
    """A valid registration with some fields replaced by wild values: unset or empty endpoint or
    details, any protocol/type integer, any port, any host or properties."""
    wild = draw(st.lists(st.sampled_from(REGISTER_FIELDS), max_size=2, unique=True), label="wild fields")
    request = directory_pb2.RegisterRequest(permanent=draw(st.booleans()))
    if "endpoint" in wild:
        if draw(st.booleans()):
            request.endpoint.SetInParent()  # set but empty
    else:
        request.endpoint.protocol = draw(protocols if "protocol" in wild else st.sampled_from([1, 2, 3]))
        request.endpoint.host = draw(hosts if "host" in wild else sane_hosts)
        request.endpoint.port = draw(ports if "port" in wild else st.integers(0, 65535))
    if "details" in wild:
        if draw(st.booleans()):
            request.details.SetInParent()
    else:
        request.details.type = draw(service_types if "type" in wild else st.sampled_from(sorted(VALID_TYPES)))
        request.details.properties.update(draw(property_maps() if "properties" in wild else sane_properties))
    return request


@st.composite
def valid_registrations(draw: st.DrawFn) -> directory_pb2.RegisterRequest:
    """Accepted and never health-checked (COGMENT protocol), so they stay visible."""
    return directory_pb2.RegisterRequest(
        endpoint=directory_pb2.ServiceEndpoint(
            protocol=COGMENT, host=draw(sane_hosts), port=draw(st.integers(0, 65535))
        ),
        details=directory_pb2.ServiceDetails(
            type=draw(st.sampled_from(sorted(VALID_TYPES))), properties=draw(sane_properties)
        ),
        permanent=draw(st.booleans()),
    )


def other_token(token: str | None) -> str:
    """A token the server cannot confuse with `token` (even if it trimmed header whitespace)."""
    return f"{token or ''}-other"


# ---- oracles ----


def has_nul(*values: str) -> bool:
    return any("\x00" in value for value in values)


def register_verdict(request: directory_pb2.RegisterRequest) -> bool | None:
    """True: must be accepted; False: must be refused; None: either (the reference accepts it,
    this implementation may refuse what it cannot store or serve)."""
    if not (request.HasField("endpoint") and request.HasField("details")):
        return False  # the reference crashes on these; an unset host/type is invalid anyway
    endpoint, info = request.endpoint, request.details
    if not endpoint.host or endpoint.protocol not in VALID_PROTOCOLS or info.type not in VALID_TYPES:
        return False
    if endpoint.port > 65535 or has_nul(endpoint.host, *info.properties.keys(), *info.properties.values()):
        return None
    return True


def health_checked(request: directory_pb2.RegisterRequest) -> bool:
    return not request.permanent and request.endpoint.protocol != COGMENT


def check_register_reply(request: directory_pb2.RegisterRequest, reply: directory_pb2.RegisterReply) -> None:
    assert reply.status in (directory_pb2.RegisterReply.OK, directory_pb2.RegisterReply.FAILED), reply
    verdict = register_verdict(request)
    event(f"Register: {directory_pb2.RegisterReply.Status.Name(reply.status)} (verdict {verdict})")
    if reply.status == directory_pb2.RegisterReply.OK:
        assert verdict is not False, f"accepted an invalid registration: {reply}"
        assert 0 < reply.service_id <= MAX_SERVICE_ID and reply.secret, reply
    else:
        assert verdict is not True, f"refused a valid registration: {reply.error_msg!r}"
        assert reply.error_msg, "FAILED without an error message"
        assert not reply.error_msg.startswith(STORAGE_FAILURES), f"a storage error: {reply.error_msg!r}"
        assert reply.service_id == 0 and not reply.secret, reply


def check_full_data(data: directory_pb2.FullServiceData) -> None:
    """What any stored entry satisfies, whatever was registered."""
    assert 0 < data.service_id <= MAX_SERVICE_ID, data.service_id
    assert data.endpoint.host
    assert data.endpoint.protocol in VALID_PROTOCOLS
    assert data.details.type in VALID_TYPES


def same_registration(data: directory_pb2.FullServiceData, request: directory_pb2.RegisterRequest) -> None:
    assert data.endpoint == request.endpoint
    assert data.details.type == request.details.type
    assert dict(data.details.properties) == dict(request.details.properties)
    assert data.permanent == request.permanent


def matches(data: directory_pb2.FullServiceData, inquiry: directory_pb2.InquireRequest) -> bool:
    if inquiry.WhichOneof("inquiry") == "service_id":
        return data.service_id == inquiry.service_id
    wanted = inquiry.details
    if wanted.type and data.details.type != wanted.type:
        return False
    stored = data.details.properties
    # An inquired `__authentication-token` is the token to inquire with, not a property to match.
    wanted_properties = {name: value for name, value in wanted.properties.items() if name != TOKEN_PROPERTY}
    return all(name in stored and stored[name] == value for name, value in wanted_properties.items())


# ---- the shared steps ----


def register(
    fuzz: Harness,
    requests: Sequence[directory_pb2.RegisterRequest],
    token: str | None,
    interleave: bool = False,
) -> list[directory_pb2.RegisterReply]:
    outcome = fuzz.run(lambda: bidi(fuzz.stub.Register, requests, metadata(token), interleave))
    assert_answered(outcome, requests)
    for request, reply in zip(requests, outcome.replies, strict=True):
        check_register_reply(request, reply)
    return outcome.replies


def inquire(fuzz: Harness, request: directory_pb2.InquireRequest, token: str | None) -> Outcome:
    outcome = fuzz.run(
        lambda: collect(fuzz.stub.Inquire(request, metadata=metadata(token), timeout=CALL_TIMEOUT_S))
    )
    assert_no_server_error(outcome)
    event(f"Inquire: {outcome.code.name}, {'some' if outcome.replies else 'no'} replies")
    if outcome.code != grpc.StatusCode.OK:
        assert outcome.code in CLIENT_ERROR_CODES, f"{outcome.code.name}: {outcome.details}"
        assert not outcome.replies
        return outcome
    ids = [reply.data.service_id for reply in outcome.replies]
    assert len(ids) == len(set(ids)), f"an entry listed twice: {ids}"
    for reply in outcome.replies:
        assert reply.HasField("data")
        check_full_data(reply.data)
        assert matches(reply.data, request), f"{reply.data} does not match {request}"
    return outcome


def read_back(fuzz: Harness, service_id: int, token: str | None) -> directory_pb2.FullServiceData | None:
    outcome = inquire(fuzz, directory_pb2.InquireRequest(service_id=service_id), token)
    assert outcome.code == grpc.StatusCode.OK
    assert len(outcome.replies) <= 1
    return outcome.replies[0].data if outcome.replies else None


# ---- the tests ----


def corner_requests() -> list[directory_pb2.RegisterRequest]:
    """Every validation rule, once each, between valid requests (explicit examples, so that each
    run covers them whatever hypothesis draws)."""

    def request(
        protocol: int = COGMENT,
        host: str = "client",
        port: int = 0,
        service_type: int = directory_pb2.ACTOR_SERVICE,
        properties: dict[str, str] | None = None,
        permanent: bool = False,
    ) -> directory_pb2.RegisterRequest:
        return directory_pb2.RegisterRequest(
            endpoint=directory_pb2.ServiceEndpoint(protocol=protocol, host=host, port=port),
            details=directory_pb2.ServiceDetails(type=service_type, properties=properties or {}),
            permanent=permanent,
        )

    empty_endpoint, empty_details = request(), request()
    empty_endpoint.endpoint.Clear()
    empty_details.details.Clear()
    corners = [
        directory_pb2.RegisterRequest(details=directory_pb2.ServiceDetails(type=1)),  # no endpoint
        directory_pb2.RegisterRequest(endpoint=directory_pb2.ServiceEndpoint(protocol=3, host="h")),
        directory_pb2.RegisterRequest(),
        empty_endpoint,
        empty_details,
        request(host=""),
        request(host="\x00"),
        request(host="h\x00"),
        *(request(protocol=p) for p in (0, 4, -1, 2**31 - 1, -(2**31))),
        *(request(service_type=t) for t in (0, 10, 99, 101, -1, 2**31 - 1)),
        *(request(port=p) for p in (65536, 2**32 - 1)),
        request(properties={"\x00": "v"}),
        request(properties={"k": "\x00"}),
    ]
    valid = [
        request(port=65535, permanent=True),
        request(host="h" * 100_000),
        request(host=random_text(1, 100_000)),
        request(host="日本語🙂\u202e", properties={"": "", "🙂": "\ufeff"}),
        request(protocol=directory_pb2.ServiceEndpoint.GRPC, host="127.0.0.1", port=1),
        request(protocol=directory_pb2.ServiceEndpoint.GRPC_SSL, host="::1", service_type=100),
        request(properties={"k" * 1000: "v" * 1000}, permanent=True),
    ]
    mixed = []
    for index, corner in enumerate(corners):
        mixed += [corner, valid[index % len(valid)]]
    return mixed


@settings(FUZZ, max_examples=100)
@given(
    requests=st.lists(st.one_of(register_requests(), valid_registrations()), max_size=5),
    token=tokens,
    interleave=st.booleans(),
)
@example(requests=corner_requests(), token=None, interleave=False)
@example(requests=corner_requests(), token=" a token ", interleave=True)
def test_register_fuzz(
    fuzz: Harness, requests: list[directory_pb2.RegisterRequest], token: str | None, interleave: bool
) -> None:
    """One reply per request, in order, as the validation rules say; what is accepted reads back."""
    replies = register(fuzz, requests, token, interleave)
    # The last accepted request per id (a permanent re-registration updates its entry in place).
    accepted = {
        reply.service_id: request
        for request, reply in zip(requests, replies, strict=True)
        if reply.status == directory_pb2.RegisterReply.OK
    }
    for service_id, request in accepted.items():
        if health_checked(request):
            continue  # a failed health check may hide or remove it at any time
        data = read_back(fuzz, service_id, token)
        assert data is not None, f"accepted entry {service_id} is not visible to its token"
        same_registration(data, request)
        assert read_back(fuzz, service_id, other_token(token)) is None, "visible to another token"
    fuzz.check_alive()


# Over PostgreSQL's btree row limit (~2.7 kB): properties are matched through digests.
@settings(FUZZ, max_examples=20)
@given(
    size=st.integers(2_800, 100_000),
    seed=st.integers(0, 2**32),
    ascii_only=st.booleans(),
    as_name=st.booleans(),
    permanent=st.booleans(),
)
def test_register_long_properties(
    fuzz: Harness,
    size: int,
    seed: int,
    ascii_only: bool,
    as_name: bool,
    permanent: bool,
) -> None:
    """Properties are not validated by the reference: long random names and values are stored,
    read back verbatim and can be inquired for."""
    text = random_text(seed, size, ascii_only)
    properties = {text: "v"} if as_name else {"k": text}
    request = directory_pb2.RegisterRequest(
        endpoint=directory_pb2.ServiceEndpoint(protocol=COGMENT, host="client"),
        details=directory_pb2.ServiceDetails(type=directory_pb2.ACTOR_SERVICE, properties=properties),
        permanent=permanent,
    )
    (reply,) = register(fuzz, [request], "long")
    data = read_back(fuzz, reply.service_id, "long")
    assert data is not None
    same_registration(data, request)
    found = inquire(fuzz, directory_pb2.InquireRequest(details=request.details), "long")
    assert reply.service_id in {r.data.service_id for r in found.replies}
    fuzz.check_alive()


# Secrets close to the right one (any of them may also be the right one: the oracle compares).
NEAR_MISSES: dict[str, Callable[[str], str]] = {
    "extended": lambda secret: secret + "x",
    "truncated": lambda secret: secret[:-1],
    "swapped_case": str.swapcase,
    "last_changed": lambda secret: secret[:-1] + ("B" if secret.endswith("A") else "A"),
    "padded": lambda secret: secret + "=",
    "spaced": lambda secret: f" {secret}",
    "with_nul": lambda secret: secret + "\x00",
    "empty": lambda secret: "",
}


@settings(FUZZ, max_examples=100)
@given(
    registrations=st.lists(valid_registrations(), max_size=3),
    operations=st.lists(
        st.tuples(
            st.one_of(st.integers(0, 2), service_ids),  # small: index of a registration; else a raw id
            st.sampled_from(["right", *NEAR_MISSES, "random"]),
            texts,
        ),
        max_size=6,
    ),
    token=tokens,
    asker=st.sampled_from(["owner", "owner", "same", "other"]),
    interleave=st.booleans(),
)
def test_deregister_fuzz(
    fuzz: Harness,
    registrations: list[directory_pb2.RegisterRequest],
    operations: list[tuple[int, str, str]],
    token: str | None,
    asker: str,
    interleave: bool,
) -> None:
    """Only the right id, secret and token remove an entry, once; every request gets its reply.
    `asker`: the owner's token as registered, the same token spelt differently (absent = empty),
    or another token."""
    replies = register(fuzz, registrations, token)
    assert all(reply.status == directory_pb2.RegisterReply.OK for reply in replies)
    live = {reply.service_id: reply.secret for reply in replies}
    registered = list(live)
    requests, expected = [], []
    for target, secret_kind, random_secret in operations:
        service_id = registered[target] if target < len(registered) else target
        right = live.get(service_id, "")
        if secret_kind == "right":
            secret = right
        elif secret_kind == "random":
            secret = random_secret
        else:
            secret = NEAR_MISSES[secret_kind](right)
        requests.append(directory_pb2.DeregisterRequest(service_id=service_id, secret=secret))
        ok = asker != "other" and service_id in live and secret == live[service_id]
        expected.append(ok)
        if ok:
            del live[service_id]
    if asker == "owner":
        stream_token = token
    elif asker == "same":
        stream_token = "" if token is None else None if token == "" else token
    else:
        stream_token = other_token(token)
    outcome = fuzz.run(lambda: bidi(fuzz.stub.Deregister, requests, metadata(stream_token), interleave))
    assert_answered(outcome, requests)
    for request, reply, ok in zip(requests, outcome.replies, expected, strict=True):
        note(f"{request} -> {reply}")
        if ok:
            assert reply.status == directory_pb2.DeregisterReply.OK, reply
        else:
            assert reply.status == directory_pb2.DeregisterReply.FAILED, reply
            assert reply.error_msg and DEREGISTER_STORAGE_FAILURE not in reply.error_msg, reply
    for service_id in registered:
        assert (read_back(fuzz, service_id, token) is not None) == (service_id in live)
    fuzz.check_alive()


# Permanent registrations drawn from a few identities (token, type, properties), to collide.
permanent_twins = st.builds(
    lambda host, service_type, properties: directory_pb2.RegisterRequest(
        endpoint=directory_pb2.ServiceEndpoint(protocol=COGMENT, host=host),
        details=directory_pb2.ServiceDetails(type=service_type, properties=properties),
        permanent=True,
    ),
    st.sampled_from(["a", "b"]),
    st.sampled_from([1, 100]),
    st.sampled_from([{}, {"k": "v"}, {"k": "v", "\x00": ""}]),
)


@settings(FUZZ, max_examples=50)
@given(
    streams=st.lists(
        st.tuples(
            st.lists(st.one_of(register_requests(), valid_registrations(), permanent_twins), max_size=4),
            st.one_of(st.sampled_from([None, "", "twin"]), tokens),
        ),
        min_size=2,
        max_size=4,
    )
)
def test_concurrent_register_streams(
    fuzz: Harness, streams: list[tuple[list[directory_pb2.RegisterRequest], str | None]]
) -> None:
    """Streams at once: each gets one reply per request, in order; permanent registrations of one
    identity (token, type, properties) share one entry, whatever the interleaving."""

    async def all_at_once() -> list[Outcome]:
        calls = [bidi(fuzz.stub.Register, requests, metadata(token), False) for requests, token in streams]
        return list(await asyncio.gather(*calls))

    entries: dict[tuple[str, int, tuple[tuple[str, str], ...]], set[int]] = {}
    for (requests, token), outcome in zip(streams, fuzz.run(all_at_once), strict=True):
        assert_answered(outcome, requests)
        for request, reply in zip(requests, outcome.replies, strict=True):
            check_register_reply(request, reply)
            if reply.status == directory_pb2.RegisterReply.OK and request.permanent:
                properties = tuple(sorted(request.details.properties.items()))
                identity = (token or "", request.details.type, properties)
                entries.setdefault(identity, set()).add(reply.service_id)
    for identity, ids in entries.items():
        assert len(ids) == 1, f"one permanent identity, several entries: {identity} -> {ids}"
    fuzz.check_alive()


@st.composite
def inquiries(
    draw: st.DrawFn, probe_id: int, probe: directory_pb2.RegisterRequest
) -> directory_pb2.InquireRequest:
    kind = draw(st.sampled_from(["unset", "id", "probe_id", "details", "empty_details", "probe_details"]))
    if kind == "unset":
        return directory_pb2.InquireRequest()
    if kind == "id":
        return directory_pb2.InquireRequest(service_id=draw(service_ids))
    if kind == "probe_id":
        return directory_pb2.InquireRequest(service_id=probe_id)
    if kind == "details":
        return directory_pb2.InquireRequest(details=draw(details()))
    if kind == "empty_details":  # the oneof set to an empty message (a crash in the reference)
        request = directory_pb2.InquireRequest()
        request.details.SetInParent()
        return request
    names = draw(st.lists(st.sampled_from(sorted(probe.details.properties) or [""]), unique=True))
    wanted = {name: probe.details.properties[name] for name in names if name in probe.details.properties}
    return directory_pb2.InquireRequest(
        details=directory_pb2.ServiceDetails(
            type=draw(st.sampled_from([0, probe.details.type])), properties=wanted
        )
    )


@settings(FUZZ, max_examples=100)
@given(probe=valid_registrations(), token=tokens, data=st.data())
def test_inquire_fuzz(
    fuzz: Harness, probe: directory_pb2.RegisterRequest, token: str | None, data: st.DataObject
) -> None:
    """Well-formed matching replies or INVALID_ARGUMENT; a token sees its own entries only."""
    (reply,) = register(fuzz, [probe], token)
    probe_id = reply.service_id
    request = data.draw(inquiries(probe_id, probe), label="inquiry")
    asker = data.draw(st.sampled_from(["owner", "other", "random"]), label="asker")
    if asker == "owner":
        asking_token = token
    elif asker == "other":
        asking_token = other_token(token)
    else:
        asking_token = data.draw(tokens, label="token")
    outcome = inquire(fuzz, request, asking_token)
    which = request.WhichOneof("inquiry")
    if which is None:
        assert outcome.code == grpc.StatusCode.INVALID_ARGUMENT, "an empty inquiry must be refused"
    elif which == "service_id" or request.details.type == 0 or request.details.type in VALID_TYPES:
        assert_ok(outcome)
    else:  # an out-of-range type: refused, or nothing can match it
        assert not outcome.replies
    found = {r.data.service_id: r.data for r in outcome.replies}
    if asker == "other":
        assert probe_id not in found, "an entry leaked to another token"
    elif (
        asker == "owner"
        and outcome.code == grpc.StatusCode.OK
        and matches(directory_pb2.FullServiceData(service_id=probe_id, details=probe.details), request)
    ):
        assert probe_id in found, "a matching entry is missing"
        same_registration(found[probe_id], probe)
    fuzz.check_alive()


status_names = st.one_of(st.sampled_from(["*", *KNOWN_STATUSES]), texts)


def expected_statuses(names: Sequence[str]) -> set[str]:
    wanted: set[str] = set()
    for name in names:
        if name == "*":
            return wanted | set(KNOWN_STATUSES)
        if name in KNOWN_STATUSES:
            wanted.add(name)
    return wanted


extra_metadata = st.lists(
    st.tuples(
        st.sampled_from(["x-fuzz", "user-id", "trial-id", TOKEN_KEY]), st.text(printable_ascii, max_size=20)
    ),
    max_size=3,
)


@settings(FUZZ, max_examples=150)
@given(names=st.lists(status_names, max_size=6), token=tokens, extra=extra_metadata)
def test_status_fuzz(
    fuzz: Harness, names: list[str], token: str | None, extra: list[tuple[str, str]]
) -> None:
    """Status answers OK with exactly the known statuses asked for (`*` = all, ends the scan)."""
    request = common_pb2.StatusRequest(names=names)
    outcome = fuzz.run(
        lambda: unary(fuzz.stub.Status(request, metadata=metadata(token, extra), timeout=CALL_TIMEOUT_S))
    )
    assert_ok(outcome)
    statuses = outcome.replies[0].statuses
    assert set(statuses) == expected_statuses(names)
    if "overall_load" in statuses:
        assert statuses["overall_load"].isdecimal() and int(statuses["overall_load"]) <= 255
    if "nb_entries" in statuses:
        assert statuses["nb_entries"].isdecimal()
    if "load_balancing" in statuses:
        assert statuses["load_balancing"] in ("enabled", "disabled")


@settings(FUZZ, max_examples=100)
@given(token=tokens, extra=extra_metadata)
def test_version_fuzz(fuzz: Harness, token: str | None, extra: list[tuple[str, str]]) -> None:
    outcome = fuzz.run(
        lambda: unary(
            fuzz.stub.Version(
                common_pb2.VersionRequest(), metadata=metadata(token, extra), timeout=CALL_TIMEOUT_S
            )
        )
    )
    assert_version_reply(outcome)


# ---- raw bytes, valid protobuf or not ----

REQUEST_TYPES: dict[str, type[Message]] = {
    "Register": directory_pb2.RegisterRequest,
    "Deregister": directory_pb2.DeregisterRequest,
    "Inquire": directory_pb2.InquireRequest,
    "Version": common_pb2.VersionRequest,
    "Status": common_pb2.StatusRequest,
}
STREAMING_REQUESTS = {"Register", "Deregister"}
DIRECTORY_CORRUPT = [
    *CORRUPT,
    b"\x0a\x01\xff",  # Status: names[0] not UTF-8
    b"\x12\x01\xff",  # Deregister: secret not UTF-8
    b"\x0a\x03\x12\x01\xff",  # Register: endpoint.host not UTF-8
    b"\x12\x05\x12\x03\x0a\x01\xff",  # Inquire: a property name not UTF-8
    b"\x0a\x02\x12\x05",  # Register: endpoint holds a truncated string
]


def valid_requests(method: str) -> st.SearchStrategy[Message]:
    return {
        "Register": register_requests(),
        "Deregister": st.builds(directory_pb2.DeregisterRequest, service_id=service_ids, secret=small_texts),
        "Inquire": st.one_of(
            st.builds(directory_pb2.InquireRequest, service_id=service_ids),
            st.builds(directory_pb2.InquireRequest, details=details()),
        ),
        "Version": st.just(common_pb2.VersionRequest()),
        "Status": st.builds(common_pb2.StatusRequest, names=st.lists(status_names, max_size=3)),
    }[method]


RAW = RawRequests(
    REQUEST_TYPES, frozenset(STREAMING_REQUESTS), DIRECTORY_CORRUPT, valid_requests, max_unknown_fields=3
)


async def raw_call(
    channel: grpc.aio.Channel, method: str, messages: list[bytes], token: str | None
) -> Outcome:
    path, codec = f"/{SERVICE}/{method}", {"request_serializer": bytes, "response_deserializer": bytes}
    md, timeout = metadata(token), CALL_TIMEOUT_S
    if method in STREAMING_REQUESTS:
        return await collect(
            channel.stream_stream(path, **codec)(iterate(messages), metadata=md, timeout=timeout)
        )
    if method == "Inquire":
        return await collect(channel.unary_stream(path, **codec)(messages[0], metadata=md, timeout=timeout))
    return await unary(channel.unary_unary(path, **codec)(messages[0], metadata=md, timeout=timeout))


def check_raw_outcome(method: str, messages: list[bytes], outcome: Outcome, strict: bool) -> None:
    """Decodable requests are answered as usual; an undecodable one ends the call with an error
    (`strict`: a client-error code), or, on a stream, may instead get a FAILED reply."""
    reply_type = {
        "Register": directory_pb2.RegisterReply,
        "Deregister": directory_pb2.DeregisterReply,
        "Inquire": directory_pb2.InquireReply,
        "Version": common_pb2.VersionInfo,
        "Status": common_pb2.StatusReply,
    }[method]
    replies = [reply_type.FromString(raw) for raw in outcome.replies]
    good = RAW.decodable(method, messages, outcome)
    first_bad = good.index(False) if False in good else len(good)

    def failed_as_client_error() -> None:
        assert outcome.code != grpc.StatusCode.OK, "an undecodable request was answered OK"
        if strict:
            assert outcome.code in CLIENT_ERROR_CODES, f"{outcome.code.name}: {outcome.details}"

    if method in STREAMING_REQUESTS:
        ok_statuses = (reply_type.OK, reply_type.FAILED)  # type: ignore[attr-defined]
        assert all(reply.status in ok_statuses for reply in replies)
        if first_bad == len(messages) or outcome.code == grpc.StatusCode.OK:
            # All decodable, or the server answers a FAILED reply per undecodable request.
            assert_answered(outcome, messages)
            for raw, ok, reply in zip(messages, good, replies, strict=True):
                if not ok:
                    assert reply.status == reply_type.FAILED and reply.error_msg  # type: ignore[attr-defined]
                elif method == "Register":
                    check_register_reply(directory_pb2.RegisterRequest.FromString(raw), reply)
                else:
                    assert reply.status == reply_type.OK or reply.error_msg  # type: ignore[attr-defined]
        else:
            assert len(replies) == first_bad, "the requests before the undecodable one were not all answered"
            failed_as_client_error()
        return
    if first_bad == 0:
        assert not replies
        failed_as_client_error()
    elif method == "Inquire":  # random bytes may decode to an empty inquiry
        assert outcome.code == grpc.StatusCode.OK or outcome.code in CLIENT_ERROR_CODES, outcome.code
    else:
        assert_ok(outcome)


@settings(FUZZ, max_examples=150)
@given(call=RAW.calls(), token=tokens)
def test_raw_bytes_never_break_the_server(
    fuzz: Harness, call: tuple[str, list[bytes]], token: str | None
) -> None:
    """Any bytes, parseable or not, to every method: decodable requests are served as usual,
    undecodable ones end in an error, and the server keeps serving."""
    method, messages = call
    outcome = fuzz.run(raw_call, fuzz.channel, method, messages, token)
    check_raw_outcome(method, messages, outcome, strict=False)
    fuzz.check_alive()


@settings(FUZZ, max_examples=50)
@given(call=RAW.calls(undecodable=True))
def test_raw_undecodable_requests_get_a_client_error(fuzz: Harness, call: tuple[str, list[bytes]]) -> None:
    """grpcio 1.85 (aio) deserializes with the handler's `request_deserializer`: left alone, unary
    requests would end with UNKNOWN "Unexpected <class DecodeError>" before any application code
    runs, and streamed requests raise DecodeError inside the handler's `async for`. The server's
    interceptor wraps the deserializer so that both answer INVALID_ARGUMENT."""
    method, messages = call
    outcome = fuzz.run(raw_call, fuzz.channel, method, messages, None)
    check_raw_outcome(method, messages, outcome, strict=True)
    fuzz.check_alive()


def test_oversized_messages_are_refused(fuzz: Harness) -> None:
    """Beyond the server's receive limit (e.g. a huge host): RESOURCE_EXHAUSTED, and still serving."""
    endpoint = directory_pb2.ServiceEndpoint(host="h" * MAX_RECEIVE_MESSAGE_BYTES)
    message = length_delimited(1, endpoint.SerializeToString())
    for method in sorted(REQUEST_TYPES):
        outcome = fuzz.run(raw_call, fuzz.channel, method, [message], None)
        assert outcome.code == grpc.StatusCode.RESOURCE_EXHAUSTED, f"{method} {outcome.code.name}"
        fuzz.check_alive()
