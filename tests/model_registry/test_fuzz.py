"""Property-based fuzzing of every ModelRegistrySP RPC, over real gRPC, on SQLite with local blobs
and on PostgreSQL with SeaweedFS (S3).

Each test runs one real registry (`registry_factory`) in an event loop of its own, in a background
thread; hypothesis examples are plain synchronous functions that hand their async body to that
loop (tests/helpers/fuzz.py, shared with the directory and datastore suites).

Checked, over random and malformed requests:
* CreateOrUpdateModel / DeleteModel / RetrieveModels: exact outcomes (OK, INVALID_ARGUMENT,
  NOT_FOUND) for any model id (empty, NUL, huge, unicode), user data, count and handle; what is
  accepted reads back verbatim.
* CreateVersion: headers and bodies in any order, any sizes, hashes, timestamps and model ids.
  Valid uploads get the next number and their data reads back; anything else gets a client
  error and leaves the model's versions as they were (no gap in the numbering either).
* RetrieveVersionInfos / RetrieveVersionData / VersionUpdate on a seeded model (and any other id):
  any version numbers, counts and handles, against an exact model of the reference's rules.
* Version / Status: OK.
* Raw bytes to every method: parseable ones are served as usual, unparseable ones end the call
  with INVALID_ARGUMENT.
* Never INTERNAL or UNKNOWN, and after every example the server still answers from its storage.

Defects this file found, now fixed, keep dedicated tests at the end: error details echoing huge
ids past gRPC's metadata limit; model handles >= 2**63 or > 4300 digits; version handles and
counts >= 2**31 on PostgreSQL; creation timestamps >= 2**63.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from google.protobuf.message import Message
from hypothesis import event, given, note, settings
from hypothesis import strategies as st

from shared.api import common_pb2, model_registry_pb2_grpc
from shared.api import model_registry_pb2 as mr
from shared.validation import MAX_RECEIVE_MESSAGE_BYTES
from tests.helpers.digest import sha256_b64
from tests.helpers.fuzz import (
    CALL_TIMEOUT_S,
    CORRUPT,
    FUZZ,
    Outcome,
    RawRequests,
    ServerHarness,
    assert_client_error,
    assert_no_server_error,
    assert_ok,
    assert_version_reply,
    collect,
    iterate,
    length_delimited,
    parse_handle,
    send_stream,
    small_texts,
    texts,
    uint32s,
    unary,
)
from tests.helpers.running import RegistryFactory

SERVICE = "cogmentAPI.ModelRegistrySP"
# A VersionUpdate stream with something to send sends it at once; one without waits this long.
FIRST_UPDATE_TIMEOUT_S = 0.5
# gRPC's default message limit: uploads send chunks close to it.
MAX_GRPC_MESSAGE = 4 * 1024 * 1024
# What a client may be told about a request it got wrong. Never INTERNAL or UNKNOWN.
CLIENT_ERROR_CODES = frozenset(
    {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.OUT_OF_RANGE}
)
SEEDED_MODEL = "fuzz-seeded-model"
SEEDED_DATA = [b"first", b"", b"third version" * 100, bytes(range(256)) * 50]


# ---- one registry per test, driven from a background event loop ----


class Harness(ServerHarness):
    """A running registry, with a seeded model."""

    def __init__(self, factory: RegistryFactory) -> None:
        super().__init__("fuzz-registry")
        with self.closing_on_error():
            self.registry = self.enter(factory, timeout=90)
            self.stub: model_registry_pb2_grpc.ModelRegistrySPStub = self.registry.stub
            assert self.registry.service.port is not None
            self.port: int = self.registry.service.port
            self.channel: grpc.aio.Channel = self.enter(
                lambda: grpc.aio.insecure_channel(f"127.0.0.1:{self.port}")
            )
            self.run(self._seed)

    async def _seed(self) -> None:
        await self.stub.CreateOrUpdateModel(
            mr.CreateOrUpdateModelRequest(
                model_info=mr.ModelInfo(model_id=SEEDED_MODEL, user_data={"a": "b"})
            )
        )
        for number, data in enumerate(SEEDED_DATA, 1):
            messages = version_stream(SEEDED_MODEL, [data], data_size=len(data), data_hash=sha256_b64(data))
            reply = await self.stub.CreateVersion(iterate(messages), timeout=CALL_TIMEOUT_S)
            assert reply.version_info.version_number == number

    def version_numbers(self, model_id: str) -> list[int] | None:
        """The model's visible versions (None: no such model)."""
        outcome = self.run(
            lambda: unary(
                self.stub.RetrieveVersionInfos(
                    mr.RetrieveVersionInfosRequest(model_id=model_id), timeout=CALL_TIMEOUT_S
                )
            )
        )
        if outcome.code == grpc.StatusCode.NOT_FOUND:
            return None
        assert_ok(outcome)
        return [info.version_number for info in outcome.replies[0].version_infos]

    def check_alive(self) -> None:
        """The server still answers, from its database and blob store too."""
        status = self.run(
            lambda: self.stub.Status(common_pb2.StatusRequest(names=["*"]), timeout=CALL_TIMEOUT_S)
        )
        assert status is not None
        assert self.version_numbers(SEEDED_MODEL) == list(range(1, len(SEEDED_DATA) + 1))
        request = mr.RetrieveVersionDataRequest(model_id=SEEDED_MODEL, version_number=-1)
        outcome = self.run(lambda: collect(self.stub.RetrieveVersionData(request, timeout=CALL_TIMEOUT_S)))
        assert_ok(outcome)
        assert b"".join(reply.data_chunk for reply in outcome.replies) == SEEDED_DATA[-1]


@pytest.fixture
def fuzz(registry_factory: RegistryFactory) -> Iterator[Harness]:
    with Harness(registry_factory) as harness:
        yield harness


# ---- calls ----


async def first_of_stream(call: Any, timeout_s: float = FIRST_UPDATE_TIMEOUT_S) -> tuple[Outcome, bool]:
    """The first reply of an endless stream, or its error; then cancel it. True: timed out."""
    outcome = Outcome()
    try:
        reply = await asyncio.wait_for(call.read(), timeout_s)
    except asyncio.TimeoutError:
        call.cancel()
        return outcome, True
    except grpc.aio.AioRpcError as error:
        outcome.fail(error)
        return outcome, False
    if reply is grpc.aio.EOF:
        outcome.code, outcome.details = await call.code(), await call.details() or ""
        return outcome, False
    call.cancel()
    outcome.replies.append(reply)
    return outcome, False


def create_version(fuzz: Harness, messages: Sequence[mr.CreateVersionRequestChunk]) -> Outcome:
    return fuzz.run(lambda: send_stream(fuzz.stub.CreateVersion(timeout=CALL_TIMEOUT_S), messages))


# ---- strategies ----

model_ids = texts
user_datas = st.one_of(
    st.dictionaries(small_texts, small_texts, max_size=4),
    st.dictionaries(texts, texts, max_size=2),
)
int32s = st.one_of(
    st.integers(-6, 6), st.sampled_from([-(2**31), 2**31 - 1]), st.integers(-(2**31), 2**31 - 1)
)
uint64s = st.one_of(st.sampled_from([0, 1, 2**63 - 1, 2**63, 2**64 - 1]), st.integers(0, 2**64 - 1))
# The strategies stay within these bounds, where the oracle below models paging exactly; values
# beyond them have dedicated tests at the end (test_huge_handles_are_not_server_errors,
# test_version_handles_and_counts_beyond_int32_are_not_server_errors,
# test_creation_timestamps_beyond_int64_are_not_server_errors).
MAX_SAFE_HANDLE = 2**63 - 1
MAX_SAFE_VERSION_HANDLE = 2**31 - 1
MAX_SAFE_VERSION_COUNT = 2**31 - 1
MAX_SAFE_TIMESTAMP = 2**63 - 1


def handle_texts(max_value: int) -> st.SearchStrategy[str]:
    digits = len(str(max_value)) - 1
    return st.one_of(
        st.just(""),
        st.integers(0, 10).map(str),
        st.sampled_from(["-1", "+1", " 1", "1 ", "0x1", "1.0", "٣", "²", "1e3", "00", "0" * 30 + "1"]),
        st.integers(0, max_value).map(str),
        st.just(str(max_value)),
        st.integers(1, digits).map(lambda n: "9" * n),
        small_texts,
    )


handles = handle_texts(MAX_SAFE_HANDLE)
version_handles = handle_texts(MAX_SAFE_VERSION_HANDLE)
version_counts = st.one_of(
    st.sampled_from([0, 1, 2, 3, MAX_SAFE_VERSION_COUNT]), st.integers(0, MAX_SAFE_VERSION_COUNT)
)
safe_timestamps = st.one_of(st.sampled_from([0, 1, MAX_SAFE_TIMESTAMP]), st.integers(0, MAX_SAFE_TIMESTAMP))


def valid_model_id(model_id: str) -> bool:
    return bool(model_id) and "\x00" not in model_id


def valid_user_data(user_data: dict[str, str]) -> bool:
    return not any("\x00" in text for pair in user_data.items() for text in pair)


# ---- models ----


@st.composite
def model_operations(draw: st.DrawFn) -> list[tuple[str, Any]]:
    operations: list[tuple[str, Any]] = []
    for _ in range(draw(st.integers(1, 5))):
        kind = draw(st.sampled_from(["create", "create", "delete", "retrieve"]))
        if kind == "create":
            request = mr.CreateOrUpdateModelRequest()
            if draw(st.integers(0, 9)):
                request.model_info.SetInParent()
                request.model_info.model_id = draw(model_ids)
                request.model_info.user_data.update(draw(user_datas))
            operations.append((kind, request))
        elif kind == "delete":
            operations.append((kind, mr.DeleteModelRequest(model_id=draw(model_ids))))
        else:
            operations.append(
                (
                    kind,
                    mr.RetrieveModelsRequest(
                        model_ids=draw(st.lists(model_ids, max_size=3)),
                        models_count=draw(uint32s),
                        model_handle=draw(handles),
                    ),
                )
            )
    return operations


def retrieve_models(fuzz: Harness, request: mr.RetrieveModelsRequest) -> Outcome:
    return fuzz.run(lambda: unary(fuzz.stub.RetrieveModels(request, timeout=CALL_TIMEOUT_S)))


def model_exists(fuzz: Harness, model_id: str) -> dict[str, str] | None:
    outcome = retrieve_models(fuzz, mr.RetrieveModelsRequest(model_ids=[model_id]))
    if outcome.code == grpc.StatusCode.NOT_FOUND:
        return None
    assert_ok(outcome)
    (info,) = outcome.replies[0].model_infos
    assert info.model_id == model_id
    return dict(info.user_data)


@settings(FUZZ, max_examples=80)
@given(operations=model_operations())
def test_model_requests_fuzz(fuzz: Harness, operations: list[tuple[str, Any]]) -> None:
    for kind, request in operations:
        if kind == "create":
            outcome = fuzz.run(
                lambda r=request: unary(fuzz.stub.CreateOrUpdateModel(r, timeout=CALL_TIMEOUT_S))
            )
            info = request.model_info
            valid = (
                request.HasField("model_info")
                and valid_model_id(info.model_id)
                and valid_user_data(dict(info.user_data))
            )
            event(f"CreateOrUpdateModel: {outcome.code.name}")
            if valid:
                assert_ok(outcome)
                assert model_exists(fuzz, info.model_id) == dict(info.user_data)
            else:
                assert_client_error(outcome, grpc.StatusCode.INVALID_ARGUMENT)
        elif kind == "delete":
            model_id = request.model_id
            existed = valid_model_id(model_id) and model_exists(fuzz, model_id) is not None
            outcome = fuzz.run(lambda r=request: unary(fuzz.stub.DeleteModel(r, timeout=CALL_TIMEOUT_S)))
            event(f"DeleteModel: {outcome.code.name}")
            if not valid_model_id(model_id):
                assert_client_error(outcome, grpc.StatusCode.INVALID_ARGUMENT)
            elif existed:
                assert_ok(outcome)
                assert model_exists(fuzz, model_id) is None
            else:
                assert_client_error(outcome, grpc.StatusCode.NOT_FOUND)
        else:
            check_retrieve_models(fuzz, request)
    fuzz.check_alive()


def check_retrieve_models(fuzz: Harness, request: mr.RetrieveModelsRequest) -> None:
    outcome = retrieve_models(fuzz, request)
    event(f"RetrieveModels: {outcome.code.name}")
    offset = parse_handle(request.model_handle)
    if offset is None:
        assert_client_error(outcome, grpc.StatusCode.INVALID_ARGUMENT)
        return
    if request.model_ids:
        wanted = list(request.model_ids)[
            offset : offset + request.models_count if request.models_count else None
        ]
        if outcome.code == grpc.StatusCode.NOT_FOUND:  # one is unknown
            assert any(
                not valid_model_id(model_id) or model_exists(fuzz, model_id) is None for model_id in wanted
            )
            return
        assert_ok(outcome)
        assert [info.model_id for info in outcome.replies[0].model_infos] == wanted
    else:
        assert_ok(outcome)
        listed = [info.model_id for info in outcome.replies[0].model_infos]
        assert listed == sorted(listed, key=lambda text: [ord(c) for c in text])
        if request.models_count:
            assert len(listed) <= request.models_count
        if offset < 10**9:
            assert outcome.replies[0].next_model_handle == str(offset + len(listed))


# ---- CreateVersion ----


def version_stream(
    model_id: str,
    bodies: Sequence[bytes],
    *,
    data_size: int,
    data_hash: str = "",
    archived: bool = True,
    user_data: dict[str, str] | None = None,
    creation_timestamp: int = 0,
) -> list[mr.CreateVersionRequestChunk]:
    info = mr.ModelVersionInfo(
        model_id=model_id,
        archived=archived,
        data_size=data_size,
        data_hash=data_hash,
        user_data=user_data or {},
        creation_timestamp=creation_timestamp,
    )
    return [
        mr.CreateVersionRequestChunk(header=mr.CreateVersionRequestChunk.Header(version_info=info)),
        *(mr.CreateVersionRequestChunk(body=mr.CreateVersionRequestChunk.Body(data_chunk=b)) for b in bodies),
    ]


@dataclass
class Upload:
    """A CreateVersion stream to send, and what the server must make of it."""

    messages: list[mr.CreateVersionRequestChunk]
    target: str  # the model the header names ("" if none)
    valid: bool
    data: bytes
    unknown_model: bool  # names a valid id that was never created
    note: str


_SMALL_BODIES = st.one_of(st.integers(0, 64), st.sampled_from([0, 1]))
BODY_SIZES = st.one_of(
    _SMALL_BODIES,
    _SMALL_BODIES,
    _SMALL_BODIES,
    st.integers(0, 70_000),
    st.sampled_from([MAX_GRPC_MESSAGE - 2048, 1 << 20]),
)


@st.composite
def uploads(draw: st.DrawFn, fuzz: Harness) -> Upload:
    rng = random.Random(draw(st.integers(0, 2**32)))
    sizes = draw(st.lists(BODY_SIZES, max_size=5))
    bodies = [rng.randbytes(size) for size in sizes]
    data = b"".join(bodies)
    # Which model the header names: a fresh one (created), an unknown one, or a wild id.
    target_kind = draw(st.sampled_from(["fresh", "fresh", "fresh", "unknown", "wild"]))
    if target_kind == "wild":
        target = draw(model_ids.filter(lambda text: text != SEEDED_MODEL))
        unknown = True  # created below only if valid
    else:
        target = fuzz.fresh_id(target_kind)
        unknown = target_kind == "unknown"
    size_kind = draw(st.sampled_from(["exact", "exact", "exact", "+1", "-1", "any"]))
    data_size = {
        "exact": len(data),
        "+1": len(data) + 1,
        "-1": len(data) - 1,
        "any": draw(uint64s),
    }[size_kind]
    data_size = max(data_size, 0)
    hash_kind = draw(st.sampled_from(["none", "right", "right", "wrong", "text"]))
    data_hash = {
        "none": "",
        "right": sha256_b64(data),
        "wrong": sha256_b64(data + b"x"),
        "text": draw(texts),
    }[hash_kind]
    user_data = draw(st.one_of(st.just({}), user_datas))
    timestamp = draw(st.one_of(st.just(0), safe_timestamps))
    messages = version_stream(
        target,
        bodies,
        data_size=data_size,
        data_hash=data_hash,
        archived=draw(st.booleans()),
        user_data=user_data,
        creation_timestamp=timestamp,
    )
    # Disorder: a header without version_info, no header, a body or an empty chunk first,
    # a second header somewhere.
    disorder = draw(st.sampled_from(["none", "none", "none", "none", "no_info", "drop_header", "move_header",
                                     "extra_header", "empty_chunk", "nothing"]))  # fmt: skip
    if disorder == "no_info":
        messages[0] = mr.CreateVersionRequestChunk(header=mr.CreateVersionRequestChunk.Header())
    elif disorder == "drop_header":
        messages = messages[1:]
    elif disorder == "move_header" and len(messages) > 1:
        header = messages.pop(0)
        messages.insert(draw(st.integers(1, len(messages))), header)
    elif disorder == "extra_header":
        messages.insert(draw(st.integers(1, len(messages))), messages[0])
    elif disorder == "empty_chunk":
        messages.insert(draw(st.integers(0, len(messages))), mr.CreateVersionRequestChunk())
    elif disorder == "nothing":
        messages = []
    ordered = disorder == "none" or (disorder == "move_header" and len(messages) == 1)
    valid = (
        ordered
        and valid_model_id(target)
        and valid_user_data(user_data)
        and data_size == len(data)
        and (not data_hash or data_hash == sha256_b64(data))
        and target_kind != "unknown"
    )
    description = (
        f"target={target_kind} size={size_kind} hash={hash_kind} disorder={disorder} "
        f"bodies={sizes} timestamp={timestamp} user_data={len(user_data)}"
    )
    return Upload(messages, target, valid, data, unknown, description)


def create_model(fuzz: Harness, model_id: str) -> None:
    request = mr.CreateOrUpdateModelRequest(model_info=mr.ModelInfo(model_id=model_id))
    assert_ok(fuzz.run(lambda r=request: unary(fuzz.stub.CreateOrUpdateModel(r, timeout=CALL_TIMEOUT_S))))


def version_data(fuzz: Harness, model_id: str, number: int) -> Outcome:
    request = mr.RetrieveVersionDataRequest(model_id=model_id, version_number=number)
    return fuzz.run(lambda: collect(fuzz.stub.RetrieveVersionData(request, timeout=CALL_TIMEOUT_S)))


@settings(FUZZ, max_examples=60)
@given(data=st.data(), prior_versions=st.integers(0, 2))
def test_create_version_fuzz(fuzz: Harness, data: st.DataObject, prior_versions: int) -> None:
    upload = data.draw(uploads(fuzz))
    note(upload.note)
    created_target = False
    if valid_model_id(upload.target) and not upload.target.startswith("unknown-"):
        if model_exists(fuzz, upload.target) is None:
            create_model(fuzz, upload.target)
            created_target = True
        for _ in range(prior_versions):
            messages = version_stream(upload.target, [b"prior"], data_size=5)
            assert_ok(create_version(fuzz, messages))
    before = fuzz.version_numbers(upload.target) if valid_model_id(upload.target) else None
    upload_valid = upload.valid and (created_target or before is not None)

    outcome = create_version(fuzz, upload.messages)
    event(f"CreateVersion: {outcome.code.name}")
    if upload_valid:
        assert_ok(outcome)
        info = outcome.replies[0].version_info
        assert before is not None
        # Numbers are never reused: the next is one above the highest ever given (transient
        # versions may have been evicted meanwhile, but prior ones here are archived).
        assert info.version_number == (max(before) if before else 0) + 1
        assert info.model_id == upload.target and info.data_size == len(upload.data)
        assert info.data_hash == sha256_b64(upload.data)
        after = fuzz.version_numbers(upload.target)
        assert after is not None and info.version_number in after
        read = version_data(fuzz, upload.target, info.version_number)
        assert_ok(read)
        assert b"".join(reply.data_chunk for reply in read.replies) == upload.data
    else:
        assert_client_error(outcome, *CLIENT_ERROR_CODES)
        if valid_model_id(upload.target):
            assert fuzz.version_numbers(upload.target) == before, "a rejected upload left a version"
        if before is not None:  # and the next valid upload takes the next number: no gap
            messages = version_stream(upload.target, [b"next"], data_size=4)
            reply = create_version(fuzz, messages)
            assert_ok(reply)
            assert reply.replies[0].version_info.version_number == (max(before) if before else 0) + 1
    fuzz.check_alive()


# ---- version queries, on the seeded model ----

query_model_ids = st.one_of(st.just(SEEDED_MODEL), st.just(SEEDED_MODEL), model_ids)


def resolve(number: int, latest: int) -> int | None:
    wanted = latest + number + 1 if number < 0 else number
    return wanted if 1 <= wanted <= latest else None


@settings(FUZZ, max_examples=80)
@given(
    model_id=query_model_ids,
    numbers=st.lists(int32s, max_size=4),
    count=version_counts,
    handle=version_handles,
)
def test_retrieve_version_infos_fuzz(
    fuzz: Harness, model_id: str, numbers: list[int], count: int, handle: str
) -> None:
    request = mr.RetrieveVersionInfosRequest(
        model_id=model_id, version_numbers=numbers, versions_count=count, version_handle=handle
    )
    outcome = fuzz.run(lambda: unary(fuzz.stub.RetrieveVersionInfos(request, timeout=CALL_TIMEOUT_S)))
    event(f"RetrieveVersionInfos: {outcome.code.name}")
    start = parse_handle(handle)
    latest = len(SEEDED_DATA)
    if not valid_model_id(model_id) or start is None:
        assert_client_error(outcome, grpc.StatusCode.INVALID_ARGUMENT)
    elif model_id != SEEDED_MODEL:
        assert_client_error(outcome, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.OK)
    else:
        if numbers:
            wanted = numbers[start : start + count if count else None]
            resolved: list[int | None] = [resolve(number, latest) for number in wanted]
            if None in resolved:
                assert_client_error(outcome, grpc.StatusCode.NOT_FOUND)
                return
        else:
            first = max(start, 1)
            resolved = [*range(first, latest + 1)][: count or None]
        assert_ok(outcome)
        infos = outcome.replies[0].version_infos
        assert [info.version_number for info in infos] == resolved
        for info in infos:
            assert info.model_id == SEEDED_MODEL and info.archived
            assert info.data_size == len(SEEDED_DATA[info.version_number - 1])
            assert info.data_hash == sha256_b64(SEEDED_DATA[info.version_number - 1])
    fuzz.check_alive()


@settings(FUZZ, max_examples=60)
@given(model_id=query_model_ids, number=int32s)
def test_retrieve_version_data_fuzz(fuzz: Harness, model_id: str, number: int) -> None:
    outcome = version_data(fuzz, model_id, number)
    event(f"RetrieveVersionData: {outcome.code.name}")
    if not valid_model_id(model_id):
        assert_client_error(outcome, grpc.StatusCode.INVALID_ARGUMENT)
    elif model_id != SEEDED_MODEL:
        assert_client_error(outcome, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.OK)
    else:
        wanted = resolve(number, len(SEEDED_DATA))
        if wanted is None:
            assert_client_error(outcome, grpc.StatusCode.NOT_FOUND)
            assert not outcome.replies
        else:
            assert_ok(outcome)
            assert b"".join(reply.data_chunk for reply in outcome.replies) == SEEDED_DATA[wanted - 1]
    fuzz.check_alive()


@settings(FUZZ, max_examples=50)
@given(model_id=query_model_ids)
def test_version_update_fuzz(fuzz: Harness, model_id: str) -> None:
    """The first message (the latest version) or the error, then the stream is cancelled."""
    request = mr.VersionUpdateRequest(model_id=model_id)
    outcome, timed_out = fuzz.run(
        lambda: first_of_stream(fuzz.stub.VersionUpdate(request, timeout=CALL_TIMEOUT_S))
    )
    event(f"VersionUpdate: {'timeout' if timed_out else outcome.code.name}")
    if not valid_model_id(model_id):
        assert not timed_out
        assert_client_error(outcome, grpc.StatusCode.INVALID_ARGUMENT)
    elif model_id == SEEDED_MODEL:
        assert not timed_out
        assert_ok(outcome)
        assert outcome.replies[0].version_info.version_number == len(SEEDED_DATA)
    elif not timed_out:  # another model (unknown, or one without versions: no message)
        assert_client_error(outcome, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OK)
    fuzz.check_alive()


@settings(FUZZ, max_examples=30)
@given(names=st.lists(st.one_of(small_texts, st.just("*")), max_size=4))
def test_version_and_status_fuzz(fuzz: Harness, names: list[str]) -> None:
    status = fuzz.run(
        lambda: unary(fuzz.stub.Status(common_pb2.StatusRequest(names=names), timeout=CALL_TIMEOUT_S))
    )
    assert_ok(status)
    if "*" not in names:
        assert set(status.replies[0].statuses) <= set(names)
    version = fuzz.run(lambda: unary(fuzz.stub.Version(common_pb2.VersionRequest(), timeout=CALL_TIMEOUT_S)))
    assert_version_reply(version)


# ---- raw bytes, valid protobuf or not ----

REQUEST_TYPES: dict[str, type[Message]] = {
    "CreateOrUpdateModel": mr.CreateOrUpdateModelRequest,
    "DeleteModel": mr.DeleteModelRequest,
    "RetrieveModels": mr.RetrieveModelsRequest,
    "CreateVersion": mr.CreateVersionRequestChunk,
    "RetrieveVersionInfos": mr.RetrieveVersionInfosRequest,
    "RetrieveVersionData": mr.RetrieveVersionDataRequest,
    "VersionUpdate": mr.VersionUpdateRequest,
    "Version": common_pb2.VersionRequest,
    "Status": common_pb2.StatusRequest,
}
CLIENT_STREAMING = {"CreateVersion"}
SERVER_STREAMING = {"RetrieveVersionData", "VersionUpdate"}
REGISTRY_CORRUPT = [
    *CORRUPT,
    b"\x0a\x01\xff",  # field 1 a string that is not UTF-8 (model_id...)
    b"\x0a\x03\x0a\x01\xff",  # CreateOrUpdateModel: model_info.model_id not UTF-8
    b"\x0a\x05\x0a\x03\x0a\x01\xff",  # CreateVersion: header.version_info.model_id not UTF-8
    b"\x22\x01\xff",  # a handle not UTF-8
    b"\x0a\x02\x12\x05",  # a nested message holding a truncated field
]


def valid_requests(method: str) -> st.SearchStrategy[Message]:
    info = st.builds(
        mr.ModelVersionInfo,
        model_id=small_texts,
        data_size=st.integers(0, 3),
        data_hash=st.just(""),
        creation_timestamp=st.integers(0, 2**62),
    )
    return {
        "CreateOrUpdateModel": st.builds(
            mr.CreateOrUpdateModelRequest, model_info=st.builds(mr.ModelInfo, model_id=small_texts)
        ),
        "DeleteModel": st.builds(mr.DeleteModelRequest, model_id=small_texts),
        "RetrieveModels": st.builds(
            mr.RetrieveModelsRequest, model_ids=st.lists(small_texts, max_size=2), models_count=uint32s
        ),
        "CreateVersion": st.one_of(
            st.builds(
                mr.CreateVersionRequestChunk,
                header=st.builds(mr.CreateVersionRequestChunk.Header, version_info=info),
            ),
            st.builds(
                mr.CreateVersionRequestChunk,
                body=st.builds(mr.CreateVersionRequestChunk.Body, data_chunk=st.binary(max_size=3)),
            ),
        ),
        "RetrieveVersionInfos": st.builds(
            mr.RetrieveVersionInfosRequest,
            model_id=query_model_ids,
            version_numbers=st.lists(int32s, max_size=2),
        ),
        "RetrieveVersionData": st.builds(
            mr.RetrieveVersionDataRequest, model_id=query_model_ids, version_number=int32s
        ),
        "VersionUpdate": st.builds(mr.VersionUpdateRequest, model_id=query_model_ids),
        "Version": st.just(common_pb2.VersionRequest()),
        "Status": st.builds(common_pb2.StatusRequest, names=st.lists(small_texts, max_size=3)),
    }[method]


RAW = RawRequests(
    REQUEST_TYPES, frozenset(CLIENT_STREAMING), REGISTRY_CORRUPT, valid_requests, max_unknown_fields=2
)


async def raw_call(
    channel: grpc.aio.Channel,
    method: str,
    messages: list[bytes],
    first_timeout_s: float = FIRST_UPDATE_TIMEOUT_S,
) -> Outcome:
    path, codec = f"/{SERVICE}/{method}", {"request_serializer": bytes, "response_deserializer": bytes}
    if method in CLIENT_STREAMING:
        return await send_stream(channel.stream_unary(path, **codec)(timeout=CALL_TIMEOUT_S), messages)
    if method == "VersionUpdate":  # endless when it names a model: its first message only
        call = channel.unary_stream(path, **codec)(messages[0], timeout=CALL_TIMEOUT_S)
        outcome, _ = await first_of_stream(call, first_timeout_s)
        return outcome
    if method in SERVER_STREAMING:
        return await collect(channel.unary_stream(path, **codec)(messages[0], timeout=CALL_TIMEOUT_S))
    return await unary(channel.unary_unary(path, **codec)(messages[0], timeout=CALL_TIMEOUT_S))


def check_raw_outcome(method: str, messages: list[bytes], outcome: Outcome, strict: bool) -> None:
    """Never a server error; an undecodable request ends the call with an error (`strict`:
    INVALID_ARGUMENT, or the client error of a request before it on a CreateVersion stream)."""
    good = RAW.decodable(method, messages, outcome)
    assert_no_server_error(outcome)
    if all(good):
        if outcome.code != grpc.StatusCode.OK:
            assert outcome.code in CLIENT_ERROR_CODES, f"{outcome.code.name}: {outcome.details}"
        return
    assert outcome.code != grpc.StatusCode.OK, "an undecodable request was answered OK"
    if strict:
        if method in CLIENT_STREAMING and good[0]:
            # The server may refuse the header (unknown model...) before reading the rest.
            assert outcome.code in CLIENT_ERROR_CODES, f"{outcome.code.name}: {outcome.details}"
        else:
            assert outcome.code == grpc.StatusCode.INVALID_ARGUMENT, f"{outcome.code.name}: {outcome.details}"


@settings(FUZZ, max_examples=100)
@given(call=RAW.calls())
def test_raw_bytes_never_break_the_server(fuzz: Harness, call: tuple[str, list[bytes]]) -> None:
    method, messages = call
    outcome = fuzz.run(raw_call, fuzz.channel, method, messages)
    check_raw_outcome(method, messages, outcome, strict=False)
    fuzz.check_alive()


@settings(FUZZ, max_examples=50)
@given(call=RAW.calls(undecodable=True))
def test_raw_undecodable_requests_get_a_client_error(fuzz: Harness, call: tuple[str, list[bytes]]) -> None:
    method, messages = call
    outcome = fuzz.run(raw_call, fuzz.channel, method, messages)
    check_raw_outcome(method, messages, outcome, strict=True)
    fuzz.check_alive()


def test_oversized_messages_are_refused(fuzz: Harness) -> None:
    """Beyond the server's receive limit: RESOURCE_EXHAUSTED, and still serving."""
    model_info = mr.ModelInfo(model_id="m" * MAX_RECEIVE_MESSAGE_BYTES)
    message = length_delimited(1, model_info.SerializeToString())
    for method in sorted(REQUEST_TYPES):
        outcome = fuzz.run(raw_call, fuzz.channel, method, [message], 10.0)
        assert outcome.code == grpc.StatusCode.RESOURCE_EXHAUSTED, f"{method} {outcome.code.name}"
        fuzz.check_alive()


def test_error_details_about_huge_ids_keep_their_code(fuzz: Harness) -> None:
    """An unknown 10 KB model id is NOT_FOUND, as a short one: error details quote client input
    cut short (whole, it overflowed gRPC's 8 KiB trailer and the client saw RESOURCE_EXHAUSTED)."""
    model_id = "é" * 10_000  # percent-encoded in the trailer: 60 KB
    outcome = fuzz.run(lambda: unary(fuzz.stub.DeleteModel(mr.DeleteModelRequest(model_id=model_id))))
    assert outcome.code == grpc.StatusCode.NOT_FOUND, f"{outcome.code.name}: {outcome.details}"


@pytest.mark.parametrize("handle", [str(2**63), "9" * 5000])
@pytest.mark.parametrize("method", ["RetrieveModels", "RetrieveVersionInfos"])
def test_huge_handles_are_not_server_errors(fuzz: Harness, method: str, handle: str) -> None:
    """A valid (decimal) handle past the end is an empty page, as "1000" is (it once overflowed
    the SQL offset, or int() over 4300 digits)."""
    if method == "RetrieveModels":
        outcome = fuzz.run(
            lambda: unary(fuzz.stub.RetrieveModels(mr.RetrieveModelsRequest(model_handle=handle)))
        )
    else:
        request = mr.RetrieveVersionInfosRequest(model_id=SEEDED_MODEL, version_handle=handle)
        outcome = fuzz.run(lambda: unary(fuzz.stub.RetrieveVersionInfos(request)))
    assert outcome.code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT), outcome.code.name
    fuzz.check_alive()


@pytest.mark.parametrize("timestamp", [2**63, 2**64 - 1])
def test_creation_timestamps_beyond_int64_are_not_server_errors(fuzz: Harness, timestamp: int) -> None:
    """The column is a signed BIGINT: such timestamps are refused as INVALID_ARGUMENT (they once
    failed the commit with INTERNAL)."""
    model_id = fuzz.fresh_id()
    create_model(fuzz, model_id)
    outcome = create_version(
        fuzz, version_stream(model_id, [b"x"], data_size=1, creation_timestamp=timestamp)
    )
    assert fuzz.version_numbers(model_id) == ([1] if outcome.code == grpc.StatusCode.OK else [])
    assert outcome.code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT), outcome.code.name
    if outcome.code == grpc.StatusCode.OK:
        assert outcome.replies[0].version_info.creation_timestamp == timestamp


@pytest.mark.parametrize(
    ("handle", "count"), [(str(2**31), 0), (str(2**32 + 1), 0), ("", 2**31), ("", 2**32 - 1)]
)
def test_version_handles_and_counts_beyond_int32_are_not_server_errors(
    fuzz: Harness, handle: str, count: int
) -> None:
    """Past the end: an empty page (or everything), never an error (PostgreSQL once refused them
    as "integer out of range": they are clamped to 32 bits)."""
    request = mr.RetrieveVersionInfosRequest(
        model_id=SEEDED_MODEL, version_handle=handle, versions_count=count
    )
    outcome = fuzz.run(lambda: unary(fuzz.stub.RetrieveVersionInfos(request)))
    assert_ok(outcome)
    expected = [] if handle else list(range(1, len(SEEDED_DATA) + 1))
    assert [info.version_number for info in outcome.replies[0].version_infos] == expected
