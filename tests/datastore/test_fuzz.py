"""Property-based fuzzing of every Trial Datastore RPC (TrialDatastoreSP, DatalogSP, LogExporterSP),
over real gRPC, on SQLite and on PostgreSQL.

As in the directory and registry suites (tests/helpers/fuzz.py): each test runs one real datastore
(`datastore_factory`) in an event loop of its own, in a background thread; hypothesis examples are
plain synchronous functions that hand their async body to that loop. The datastore is seeded with
trials to list (AddTrial) and to read (datalog: one ended, one interrupted, one without samples).

Checked, over random and malformed requests and `trial-id` / `user-id` metadata:
* AddTrial: exactly one non-empty `trial-id` and a user id without NUL are stored and read back
  verbatim (an upsert keeping the samples); anything else is INVALID_ARGUMENT.
* RetrieveTrials: any ids, properties, counts, handles and short timeouts, against an exact model
  of the listing of the seeded trials (creation order, filters, count, next handle).
* RetrieveSamples: any trial ids, actor filters and field numbers: NOT_FOUND for an unknown id,
  else each trial's samples once, in order, filtered as the reference filters (kept actors,
  cleared fields, index-stable payloads).
* AddSample: random StoredTrialSamples (any tick, timestamp, state, actor data, payloads, trial
  and user ids): those before the first bad one are stored verbatim and in order; the call ends
  OK, NOT_FOUND (unknown trial) or INVALID_ARGUMENT.
* DatalogSP / LogExporterSP RunTrialDatalog: random metadata, first messages and DatalogSamples
  (actors maps and actions out of range, any reward and message names, huge and non-finite
  values, NUL characters, bursts of samples): one ack per message, what is acknowledged is stored
  as the conversion of what was sent, the first bad message ends the call with INVALID_ARGUMENT,
  readers of the trial end with the stream; a client cancelling mid-stream leaves a prefix of its
  samples, acknowledged ones included.
* DeleteTrials: any ids; the named trials are gone (NOT_FOUND to readers), the others untouched.
* Version / Status of the three services, with any metadata: OK.
* Raw bytes to every method of the three services: parseable ones are served as usual,
  unparseable ones end the call with INVALID_ARGUMENT; beyond the receive limit,
  RESOURCE_EXHAUSTED.
* Never INTERNAL or UNKNOWN, and after every example the server still answers Status and serves
  its seeded ended trial from its database.

Defects this file found have dedicated tests at the end: trial handles >= 2**63 (were INTERNAL);
handles Python's int() reads but the reference refuses ("1_0", "٣", " 1"); trial states that do
not fit 16 bits (were a server error on PostgreSQL, for the streams batched with them too); a
DatalogSP stream cancelled while its trial was being created (the trial was never closed: its
readers never ended).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from google.protobuf import any_pb2
from google.protobuf.message import Message
from hypothesis import event, given, note, settings
from hypothesis import strategies as st

from services.datastore.conversion import DatalogConverter
from shared.api import common_pb2, datalog_pb2, datalog_pb2_grpc, trial_datastore_pb2_grpc
from shared.api import trial_datastore_pb2 as ds
from shared.validation import MAX_RECEIVE_MESSAGE_BYTES
from tests.helpers.datastore import datalog_inputs, datalog_sample, trial_params
from tests.helpers.fuzz import (
    CALL_TIMEOUT_S,
    CLIENT_CORE_ERROR,
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
    parse_handle,
    send_bidi,
    send_stream,
    small_texts,
    texts,
    uint32s,
    unary,
)
from tests.helpers.running import DatastoreFactory

# A RetrieveSamples reply of a trial known to hold more samples arrives within this.
READ_TIMEOUT_S = 10.0
SERVICES = ("TrialDatastoreSP", "DatalogSP", "LogExporterSP")
# The trial user id of a datalog without a `user-id` header (reference 4.3).
DEFAULT_DATALOG_USER = "log exporter server"
# What a client may be told about a request it got wrong. Never INTERNAL or UNKNOWN.
CLIENT_ERROR_CODES = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND})
INVALID = grpc.StatusCode.INVALID_ARGUMENT
NOT_FOUND = grpc.StatusCode.NOT_FOUND
OK = grpc.StatusCode.OK
# Where the strategies stop; beyond, dedicated tests at the end.
MAX_SAFE_HANDLE = 2**63 - 1
SMALLINT = (-(2**15), 2**15 - 1)

# The seeded trials. Listed ones are created by AddTrial, in this order: (id, user id, properties).
LISTED = [
    ("list-0", "u0", {"parity": "0", "k": "0"}),
    ("list-1", "u1", {"parity": "1", "k": "1", "": ""}),
    ("list-2", "", {"parity": "0", "nul\x00": "v\x00"}),
    ("list-3", "u3", {}),
    ("list-4", "u4", {"parity": "0", "k": "4", "é": "日本"}),
    ("list-5", "u5", {"parity": "1"}),
]
# Then, through DatalogSP (user "reader"): an ended trial, one whose stream closed before its end,
# one with no sample. Readers of all three end.
READ_ENDED, READ_CLOSED, READ_EMPTY = "read-ended", "read-closed", "read-empty"
READ_USER = "reader"


def reader_samples(count: int, ended: bool) -> list[datalog_pb2.DatalogSample]:
    """Samples with every kind of data (observations, actions, rewards with user data, messages)."""
    samples = []
    for tick in range(count):
        state = common_pb2.ENDED if ended and tick == count - 1 else common_pb2.RUNNING
        sample = datalog_sample(tick, state, reward=float(tick) if tick % 2 else None)
        if tick % 3 == 0:
            sample.messages.append(
                common_pb2.Message(
                    sender_name="alice", receiver_name="carol", payload=any_pb2.Any(value=b"hi %d" % tick)
                )
            )
        samples.append(sample)
    return samples


READ_TRIALS = {
    READ_ENDED: reader_samples(8, ended=True),
    READ_CLOSED: reader_samples(4, ended=False),
    READ_EMPTY: [],
}


@dataclass
class ListedTrial:
    trial_id: str
    seq: int  # its position, as handles give it
    user_id: str
    properties: dict[str, str]
    samples_count: int


# ---- one datastore per test, driven from a background event loop ----


class Harness(ServerHarness):
    """A running, seeded datastore."""

    def __init__(self, factory: DatastoreFactory) -> None:
        super().__init__("fuzz-datastore")
        self.listed: list[ListedTrial] = []
        self.full_samples: dict[str, list[ds.StoredTrialSample]] = {}
        with self.closing_on_error():
            self.datastore = self.enter(factory, timeout=90)
            self.channel: grpc.aio.Channel = self.datastore.channel
            self.stub: trial_datastore_pb2_grpc.TrialDatastoreSPStub = self.datastore.stub
            self.datalog: datalog_pb2_grpc.DatalogSPStub = self.datastore.datalog
            self.log_exporter: datalog_pb2_grpc.LogExporterSPStub = self.datastore.log_exporter
            self.run(self._seed)

    async def _seed(self) -> None:
        for trial_id, user_id, properties in LISTED:
            add = ds.AddTrialRequest(user_id=user_id, trial_params=trial_params(**properties))
            await self.stub.AddTrial(add, metadata=(("trial-id", trial_id),), timeout=CALL_TIMEOUT_S)
        for trial_id, samples in READ_TRIALS.items():
            call = self.datalog.RunTrialDatalog(
                iter(datalog_inputs(trial_params(read="yes"), samples)),
                metadata=(("trial-id", trial_id), ("user-id", READ_USER)),
                timeout=CALL_TIMEOUT_S,
            )
            assert_ok(await collect(call))  # (acknowledgements: test_run_trial_datalog_fuzz)
            request = ds.RetrieveSamplesRequest(trial_ids=[trial_id])
            replies = [r async for r in self.stub.RetrieveSamples(request, timeout=CALL_TIMEOUT_S)]
            self.full_samples[trial_id] = [reply.trial_sample for reply in replies]
            assert [s.tick_id for s in self.full_samples[trial_id]] == list(range(len(samples)))
        # Positions, as handles give them: page through one trial at a time.
        handle, positions = "", []
        while True:
            reply = await self.stub.RetrieveTrials(
                ds.RetrieveTrialsRequest(trials_count=1, trial_handle=handle)
            )
            if not reply.trial_infos:
                break
            handle = reply.next_trial_handle
            positions.append((reply.trial_infos[0], int(handle)))
        self.listed = [
            ListedTrial(info.trial_id, seq, info.user_id, dict(info.params.properties), info.samples_count)
            for info, seq in positions
        ]
        assert [t.trial_id for t in self.listed] == [t[0] for t in LISTED] + list(READ_TRIALS)

    def trial_info(self, trial_id: str) -> ds.StoredTrialInfo | None:
        request = ds.RetrieveTrialsRequest(trial_ids=[trial_id])
        outcome = self.run(lambda: unary(self.stub.RetrieveTrials(request, timeout=CALL_TIMEOUT_S)))
        assert_ok(outcome)
        infos = list(outcome.replies[0].trial_infos)
        assert len(infos) <= 1 and all(info.trial_id == trial_id for info in infos)
        return infos[0] if infos else None

    def samples(self, trial_id: str, count: int | None = None) -> list[ds.StoredTrialSample]:
        """The trial's stored samples: all of them (its readers end), or its first `count` (for
        trials whose readers wait for more)."""
        request = ds.RetrieveSamplesRequest(trial_ids=[trial_id])
        outcome = self.run(
            lambda: read_samples(self.stub.RetrieveSamples(request, timeout=CALL_TIMEOUT_S), count)
        )
        assert_ok(outcome)
        return [reply.trial_sample for reply in outcome.replies]

    def check_alive(self) -> None:
        """The server still answers, from its database too."""
        for service in SERVICES:
            reply = self.run(lambda s=service: status_call(self.channel, s, ["*"]))
            assert set(reply.statuses) >= {"overall_load"}
        info = self.trial_info(READ_ENDED)
        assert info is not None and info.samples_count == len(READ_TRIALS[READ_ENDED])
        assert self.samples(READ_ENDED) == self.full_samples[READ_ENDED]


@pytest.fixture
def fuzz(datastore_factory: DatastoreFactory) -> Iterator[Harness]:
    with Harness(datastore_factory) as harness:
        yield harness


# ---- calls ----


async def status_call(
    channel: grpc.aio.Channel, service: str, names: Sequence[str]
) -> common_pb2.StatusReply:
    method = channel.unary_unary(
        f"/cogmentAPI.{service}/Status",
        request_serializer=common_pb2.StatusRequest.SerializeToString,
        response_deserializer=common_pb2.StatusReply.FromString,
    )
    reply: common_pb2.StatusReply = await method(
        common_pb2.StatusRequest(names=names), timeout=CALL_TIMEOUT_S
    )
    return reply


async def read_samples(call: Any, count: int | None) -> Outcome:
    """All replies of a RetrieveSamples call (`count` None), or its first `count`, then cancel."""
    if count is None:
        return await collect(call)
    outcome = Outcome()
    try:
        while len(outcome.replies) < count:
            reply = await asyncio.wait_for(call.read(), READ_TIMEOUT_S)
            assert reply is not grpc.aio.EOF, f"the stream ended after {len(outcome.replies)} of {count}"
            outcome.replies.append(reply)
    except grpc.aio.AioRpcError as error:
        outcome.fail(error)
    call.cancel()
    return outcome


def pairs(key: str, values: Sequence[str]) -> list[tuple[str, str]]:
    return [(key, value) for value in values]


# ---- strategies ----

# gRPC metadata values are printable ASCII (the client refuses others), 8 KiB in all at most (the
# server refuses more): six values of up to 1000 characters fit.
header_texts = st.one_of(
    st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=12),
    st.sampled_from(["", " ", "*", " lead", "trail ", "a,b", "%00", "\\x00", "log exporter server"]),
    st.integers(300, 1_000).map(lambda n: "h" * n),
)
header_lists: st.SearchStrategy[list[str]] = st.one_of(
    st.just([]), st.lists(header_texts, min_size=1, max_size=3)
)
int32s = st.one_of(
    st.integers(-4, 8), st.sampled_from([-(2**31), 2**31 - 1]), st.integers(-(2**31), 2**31 - 1)
)
uint64s = st.one_of(st.sampled_from([0, 1, 2**63, 2**64 - 1]), st.integers(0, 2**64 - 1))
int64s = st.one_of(st.sampled_from([0, -1, -(2**63), 2**63 - 1]), st.integers(-(2**63), 2**63 - 1))
floats32 = st.floats(width=32)  # NaN and infinities included
# Trial states: the enum's, and other values that fit 16 bits (see test_states_beyond_16_bits...).
states = st.one_of(st.sampled_from(range(6)), st.sampled_from(range(6)), st.integers(*SMALLINT)).map(
    common_pb2.TrialState.ValueType
)
# Up to 20 KB: wildcard rewards copy user data once per receiver, and a stored sample must stay
# under gRPC's 4 MiB for RetrieveSamples.
payloads = st.one_of(st.binary(max_size=12), st.just(b""), st.just(bytes(range(256)) * 80))
properties = st.one_of(
    st.dictionaries(small_texts, small_texts, max_size=3), st.dictionaries(texts, texts, max_size=1)
)
ACTOR_NAMES = ["alice", "bob", "carol", "*", "a.b", "", "\x00", "class1.*"]
actor_names = st.one_of(st.sampled_from(ACTOR_NAMES), small_texts)
actor_classes = st.one_of(st.sampled_from(["class1", "class2", "*", "c.d", ""]), small_texts)


@st.composite
def trial_params_st(draw: st.DrawFn) -> common_pb2.TrialParams:
    actors = draw(st.lists(st.tuples(actor_names, actor_classes, small_texts), max_size=4))
    params = common_pb2.TrialParams(
        actors=[common_pb2.ActorParams(name=n, actor_class=c, implementation=i) for n, c, i in actors],
        properties=draw(properties),
        max_steps=draw(uint32s),
        max_inactivity=draw(uint32s),
        nb_buffered_ticks=draw(int64s),
    )
    if draw(st.booleans()):
        params.trial_config.content = draw(payloads)
        params.environment.name = draw(small_texts)
        params.datalog.exclude_fields.extend(draw(st.lists(small_texts, max_size=2)))
    return params


def name_pool(params: common_pb2.TrialParams) -> st.SearchStrategy[str]:
    """Names a sample may use: the trial's actors, `class.name` and wildcards, and anything."""
    names = [a.name for a in params.actors] + [f"{a.actor_class}.{a.name}" for a in params.actors]
    names += [f"{a.actor_class}.*" for a in params.actors] + ["*", "*.*", "", "env", "*.alice"]
    return st.one_of(st.sampled_from(names), st.sampled_from(names), small_texts)


@st.composite
def datalog_samples(draw: st.DrawFn, params: common_pb2.TrialParams) -> datalog_pb2.DatalogSample:
    actor_count = len(params.actors)
    names = name_pool(params)
    sample = datalog_pb2.DatalogSample()
    if draw(st.integers(0, 9)):
        sample.info.SetInParent()
        sample.info.tick_id = draw(uint64s)
        sample.info.timestamp = draw(uint64s)
        sample.info.state = draw(states)
        sample.info.out_of_sync = draw(st.booleans())
        sample.info.special_events.extend(draw(st.lists(small_texts, max_size=2)))
    if draw(st.booleans()):
        observations = draw(st.lists(payloads, max_size=3))
        sample.observations.observations.extend(observations)
        sample.observations.tick_id = draw(int64s)
        wild = st.lists(int32s, max_size=actor_count + 2)
        if observations:  # mostly indices that fit
            fitting = st.lists(st.integers(0, len(observations) - 1), max_size=actor_count)
            wild = st.one_of(fitting, fitting, wild)
        sample.observations.actors_map.extend(draw(wild))
    for content in draw(st.lists(payloads, max_size=actor_count + draw(st.sampled_from([0, 0, 0, 1])))):
        sample.actions.add(tick_id=draw(int64s), content=content)
    for _ in range(draw(st.integers(0, 3))):
        reward = sample.rewards.add(tick_id=draw(int64s), receiver_name=draw(names), value=draw(floats32))
        for _ in range(draw(st.integers(0, 2))):
            source = reward.sources.add(
                sender_name=draw(names), value=draw(floats32), confidence=draw(floats32)
            )
            if draw(st.booleans()):
                source.user_data.CopyFrom(any_pb2.Any(type_url=draw(small_texts), value=draw(payloads)))
    for _ in range(draw(st.integers(0, 2))):
        message = sample.messages.add(
            tick_id=draw(int64s), sender_name=draw(names), receiver_name=draw(names)
        )
        if draw(st.booleans()):
            message.payload.CopyFrom(any_pb2.Any(type_url=draw(small_texts), value=draw(payloads)))
    sample.default_actors.extend(draw(st.lists(uint32s, max_size=2)))
    sample.unavailable_actors.extend(draw(st.lists(uint32s, max_size=2)))
    return sample


def sample_is_valid(sample: datalog_pb2.DatalogSample, actor_count: int) -> bool:
    """What the datastore can store (reference 4.3, where the reference would crash instead):
    `info` present; an actors map with an entry per actor at most, each an observation index;
    an action per actor at most."""
    if not sample.HasField("info") or len(sample.actions) > actor_count:
        return False
    if sample.HasField("observations"):
        observations = sample.observations
        if len(observations.actors_map) > actor_count:
            return False
        if any(not 0 <= index < len(observations.observations) for index in observations.actors_map):
            return False
    return True


@st.composite
def stored_samples(draw: st.DrawFn) -> ds.StoredTrialSample:
    sample = ds.StoredTrialSample(
        user_id=draw(st.one_of(st.just(""), small_texts)),
        tick_id=draw(uint64s),
        timestamp=draw(uint64s),
        state=draw(states),
        payloads=draw(st.lists(payloads, max_size=3)),
    )
    for _ in range(draw(st.integers(0, 3))):
        actor = sample.actor_samples.add(actor=draw(uint32s))
        if draw(st.booleans()):
            actor.observation = draw(uint32s)
        if draw(st.booleans()):
            actor.action = draw(uint32s)
        if draw(st.booleans()):
            actor.reward = draw(floats32)
        for _ in range(draw(st.integers(0, 2))):
            reward = actor.received_rewards.add(
                sender=draw(int32s), reward=draw(floats32), confidence=draw(floats32)
            )
            if draw(st.booleans()):
                reward.user_data = draw(uint32s)
        actor.sent_messages.add(receiver=draw(int32s), payload=draw(uint32s))
    return sample


KNOWN_STATES = frozenset(common_pb2.TrialState.values())


def trial_states_after(state: int, sample_states: Sequence[int]) -> set[int]:
    """A trial's state after samples with these states (in-sync ones only; UNKNOWN sets none):
    the last one's. A number the enum does not know sets it, or not (both are sound: the
    reference keeps any number, a fix of test_states_beyond_16_bits... may ignore them)."""
    setting = [value for value in sample_states if value != common_pb2.UNKNOWN]
    known = [value for value in setting if value in KNOWN_STATES]
    return {setting[-1] if setting else state, known[-1] if known else state}


# ---- AddTrial ----


@settings(FUZZ, max_examples=30)
@given(
    id_kind=st.sampled_from(["fresh", "fresh", "pool", "headers"]),
    headers=header_lists,
    user_id=st.one_of(small_texts, texts),
    params=st.one_of(trial_params_st(), st.none()),
)
def test_add_trial_fuzz(
    fuzz: Harness, id_kind: str, headers: list[str], user_id: str, params: common_pb2.TrialParams | None
) -> None:
    """Exactly one non-empty `trial-id` and a user id without NUL: stored, read back verbatim, and
    an existing trial keeps its samples. Anything else: INVALID_ARGUMENT."""
    ids = {"fresh": [fuzz.fresh_id()], "pool": [f"pool-{len(user_id) % 3}"], "headers": headers}[id_kind]
    request = ds.AddTrialRequest(user_id=user_id)
    if params is not None:
        request.trial_params.CopyFrom(params)
    before = fuzz.trial_info(ids[0]) if len(ids) == 1 and ids[0] else None
    outcome = fuzz.run(
        lambda: unary(fuzz.stub.AddTrial(request, metadata=pairs("trial-id", ids), timeout=CALL_TIMEOUT_S))
    )
    event(f"AddTrial: {outcome.code.name}")
    if len(ids) != 1 or not ids[0] or "\x00" in user_id:
        assert_client_error(outcome, INVALID)
        if len(ids) == 1 and ids[0]:
            assert fuzz.trial_info(ids[0]) == before, "a refused AddTrial changed the trial"
        return
    assert_ok(outcome)
    info = fuzz.trial_info(ids[0])
    assert info is not None
    assert info.user_id == user_id and info.params == request.trial_params
    assert info.samples_count == (before.samples_count if before else 0)
    assert info.last_state == (before.last_state if before else common_pb2.UNKNOWN)
    if params is not None and params.properties:  # found by its properties too
        listed = fuzz.run(
            lambda: unary(fuzz.stub.RetrieveTrials(ds.RetrieveTrialsRequest(properties=params.properties)))
        )
        assert_ok(listed)
        assert ids[0] in [i.trial_id for i in listed.replies[0].trial_infos]
    fuzz.check_alive()


# ---- RetrieveTrials ----


def lenient_int(text: str) -> int | None:
    """What Python's int() makes of a handle (it reads more than decimal ASCII digits)."""
    try:
        return int(text)
    except ValueError:
        return None


invalid_handles = st.one_of(
    st.sampled_from(["-1", "x", "1.0", "0x1", "1e3", "1 2", "--1", "-", "+", "1-"]),
    small_texts.filter(lambda text: lenient_int(text) is None),
)
handles = st.one_of(
    st.just(""),
    st.integers(0, 12).map(str),
    st.integers(0, MAX_SAFE_HANDLE).map(str),
    st.sampled_from(["00", "0" * 30 + "1", str(MAX_SAFE_HANDLE)]),
    invalid_handles,
)


def expected_listing(
    listed: Sequence[ListedTrial], request: ds.RetrieveTrialsRequest
) -> tuple[list[ListedTrial], str] | None:
    """The trials and next handle of a RetrieveTrials reply (None: INVALID_ARGUMENT). Creation
    order from the handle; requested ids (any if none) whose properties include the requested
    ones; at most `trials_count` (0: all), and no more than the requested ids. The next handle is
    the position of the last one when the count is reached, else the end of the listing."""
    after = parse_handle(request.trial_handle)
    if after is None:
        return None
    wanted = set(request.trial_ids)
    limit = request.trials_count or None
    if wanted and (limit is None or limit > len(wanted)):
        limit = len(wanted)
    matches = [
        trial
        for trial in listed
        if trial.seq > after
        and (not wanted or trial.trial_id in wanted)
        and all(trial.properties.get(name) == value for name, value in request.properties.items())
    ]
    found = matches[:limit]
    if limit is not None and len(found) == limit:
        return found, str(found[-1].seq)
    return found, str(max([after] + [trial.seq for trial in listed]))


# Properties to list by: the seeded trials' (names and values mixed), or any.
listing_properties: st.SearchStrategy[dict[str, str]] = st.one_of(
    st.just({}),
    st.dictionaries(
        st.sampled_from(["parity", "k", "", "nul\x00", "é", "read"]),
        st.sampled_from(["0", "1", "4", "", "v\x00", "日本", "yes"]),
        max_size=2,
    ),
    properties,
)


@settings(FUZZ, max_examples=50)
@given(
    some_ids=st.lists(st.sampled_from([t[0] for t in LISTED] + list(READ_TRIALS)), max_size=4),
    other_ids=st.lists(texts, max_size=2),
    wanted_properties=listing_properties,
    count=st.one_of(st.integers(0, 8), uint32s),
    handle=handles,
    timeout_ms=st.one_of(st.just(0), st.just(0), st.integers(1, 20)),
)
def test_retrieve_trials_fuzz(
    fuzz: Harness,
    some_ids: list[str],
    other_ids: list[str],
    wanted_properties: dict[str, str],
    count: int,
    handle: str,
    timeout_ms: int,
) -> None:
    request = ds.RetrieveTrialsRequest(
        trial_ids=some_ids + other_ids,
        properties=wanted_properties,
        trials_count=count,
        trial_handle=handle,
        timeout=timeout_ms,
    )
    outcome = fuzz.run(lambda: unary(fuzz.stub.RetrieveTrials(request, timeout=CALL_TIMEOUT_S)))
    event(f"RetrieveTrials: {outcome.code.name}")
    expected = expected_listing(fuzz.listed, request)
    if expected is None:
        assert_client_error(outcome, INVALID)
        return
    assert_ok(outcome)
    trials, next_handle = expected
    reply = outcome.replies[0]
    assert [info.trial_id for info in reply.trial_infos] == [trial.trial_id for trial in trials]
    assert reply.next_trial_handle == next_handle
    for info, trial in zip(reply.trial_infos, trials, strict=True):
        assert info.user_id == trial.user_id and dict(info.params.properties) == trial.properties
        assert info.samples_count == trial.samples_count
    fuzz.check_alive()


# ---- RetrieveSamples ----

SAMPLE_FIELDS = {
    ds.STORED_TRIAL_SAMPLE_FIELD_OBSERVATION: "observation",
    ds.STORED_TRIAL_SAMPLE_FIELD_ACTION: "action",
    ds.STORED_TRIAL_SAMPLE_FIELD_REWARD: "reward",
    ds.STORED_TRIAL_SAMPLE_FIELD_RECEIVED_REWARDS: "received_rewards",
    ds.STORED_TRIAL_SAMPLE_FIELD_SENT_REWARDS: "sent_rewards",
    ds.STORED_TRIAL_SAMPLE_FIELD_RECEIVED_MESSAGES: "received_messages",
    ds.STORED_TRIAL_SAMPLE_FIELD_SENT_MESSAGES: "sent_messages",
}
OPTIONAL_FIELDS = {"observation", "action", "reward"}


def field_value(actor: ds.StoredTrialActorSample, name: str) -> Any:
    """Comparable value of a field (None: unset)."""
    if name in OPTIONAL_FIELDS:
        return getattr(actor, name) if actor.HasField(name) else None  # type: ignore[arg-type]
    return [item.SerializeToString() for item in getattr(actor, name)]


def payload_references(actor: ds.StoredTrialActorSample, name: str) -> list[int]:
    if name in ("observation", "action"):
        return [getattr(actor, name)] if actor.HasField(name) else []  # type: ignore[arg-type]
    if name.endswith("_rewards"):
        return [reward.user_data for reward in getattr(actor, name) if reward.HasField("user_data")]
    if name.endswith("_messages"):
        return [message.payload for message in getattr(actor, name)]
    return []


def check_filtered(
    got: ds.StoredTrialSample, full: ds.StoredTrialSample, request: ds.RetrieveSamplesRequest
) -> None:
    """The reference's filter (4.2): kept actors' entries only (AND of the three lists, an empty
    list keeping any), selected fields only (none known: all), payloads of the same length where
    only those the kept fields refer to are left."""
    actors = trial_params(read="yes").actors
    kept = [
        entry
        for entry in full.actor_samples
        if (not request.actor_names or actors[entry.actor].name in request.actor_names)
        and (not request.actor_classes or actors[entry.actor].actor_class in request.actor_classes)
        and (
            not request.actor_implementations
            or actors[entry.actor].implementation in request.actor_implementations
        )
    ]
    selected = {SAMPLE_FIELDS[n] for n in request.selected_sample_fields if n in SAMPLE_FIELDS} or set(
        SAMPLE_FIELDS.values()
    )
    for name in ("user_id", "trial_id", "tick_id", "timestamp", "state"):
        assert getattr(got, name) == getattr(full, name), name
    assert [entry.actor for entry in got.actor_samples] == [entry.actor for entry in kept]
    referenced: set[int] = set()
    for entry, whole in zip(got.actor_samples, kept, strict=True):
        for name in SAMPLE_FIELDS.values():
            if name in selected:
                assert field_value(entry, name) == field_value(whole, name), name
                referenced.update(payload_references(entry, name))
            else:
                assert field_value(entry, name) in (None, []), f"{name} not cleared"
    assert list(got.payloads) == [
        payload if index in referenced else b"" for index, payload in enumerate(full.payloads)
    ]


@settings(FUZZ, max_examples=30)
@given(
    some_ids=st.lists(st.sampled_from(list(READ_TRIALS)), max_size=3),
    other_ids=st.lists(texts, max_size=1),
    names=st.lists(st.one_of(st.sampled_from(["alice", "bob", "carol"]), small_texts), max_size=2),
    classes=st.lists(st.one_of(st.sampled_from(["class1", "class2"]), small_texts), max_size=2),
    implementations=st.lists(st.one_of(st.sampled_from(["impl_a", "impl_b"]), small_texts), max_size=2),
    fields=st.lists(
        st.one_of(st.integers(0, 8), int32s).map(ds.StoredTrialSampleField.ValueType), max_size=3
    ),
)
def test_retrieve_samples_fuzz(
    fuzz: Harness,
    some_ids: list[str],
    other_ids: list[str],
    names: list[str],
    classes: list[str],
    implementations: list[str],
    fields: list[ds.StoredTrialSampleField.ValueType],
) -> None:
    request = ds.RetrieveSamplesRequest(
        trial_ids=some_ids + other_ids,
        actor_names=names,
        actor_classes=classes,
        actor_implementations=implementations,
        selected_sample_fields=fields,
    )
    outcome = fuzz.run(lambda: collect(fuzz.stub.RetrieveSamples(request, timeout=CALL_TIMEOUT_S)))
    event(f"RetrieveSamples: {outcome.code.name}")
    if any(trial_id not in READ_TRIALS for trial_id in request.trial_ids):
        assert_client_error(outcome, NOT_FOUND)
        assert not outcome.replies
        return
    assert_ok(outcome)
    got = [reply.trial_sample for reply in outcome.replies]
    assert {sample.trial_id for sample in got} <= set(request.trial_ids)
    for trial_id in set(request.trial_ids):
        mine = [sample for sample in got if sample.trial_id == trial_id]
        full = fuzz.full_samples[trial_id]
        assert [sample.tick_id for sample in mine] == [sample.tick_id for sample in full]
        for sample, whole in zip(mine, full, strict=True):
            check_filtered(sample, whole, request)
    fuzz.check_alive()


# ---- AddSample ----


@st.composite
def add_sample_streams(draw: st.DrawFn) -> list[ds.AddSampleRequest]:
    requests = []
    for _ in range(draw(st.integers(0, 5))):
        kind = draw(st.sampled_from(["own", "own", "own", "empty_id", "other_id", "unset"]))
        if kind == "unset":
            requests.append(ds.AddSampleRequest())
            continue
        sample = draw(stored_samples())
        sample.trial_id = {"own": "", "empty_id": "", "other_id": draw(texts)}[kind]
        requests.append(ds.AddSampleRequest(trial_sample=sample))
    return requests


@settings(FUZZ, max_examples=30)
@given(
    target=st.sampled_from(["fresh", "fresh", "fresh", "fresh", "unknown", "headers"]),
    headers=header_lists,
    requests=add_sample_streams(),
    name_own_id=st.booleans(),
)
def test_add_sample_fuzz(
    fuzz: Harness, target: str, headers: list[str], requests: list[ds.AddSampleRequest], name_own_id: bool
) -> None:
    """Samples before the first bad one (no trial_sample, another trial's id, a user id with NUL)
    are stored verbatim, with the header's trial id, in order; the call ends OK, NOT_FOUND
    (unknown trial) or INVALID_ARGUMENT (bad metadata or sample)."""
    ids = [fuzz.fresh_id(target)] if target != "headers" else headers
    if target == "fresh":
        request = ds.AddTrialRequest(user_id="adder", trial_params=trial_params())
        fuzz.run(lambda: fuzz.stub.AddTrial(request, metadata=pairs("trial-id", ids), timeout=CALL_TIMEOUT_S))
    trial_id = ids[0] if len(ids) == 1 else ""
    if name_own_id:  # samples may name their own trial
        for item in requests:
            if item.HasField("trial_sample") and not item.trial_sample.trial_id:
                item.trial_sample.trial_id = trial_id
    before = fuzz.trial_info(trial_id) if trial_id else None
    outcome = fuzz.run(
        lambda: send_stream(
            fuzz.stub.AddSample(metadata=pairs("trial-id", ids), timeout=CALL_TIMEOUT_S), requests
        )
    )
    event(f"AddSample: {outcome.code.name}")
    note(f"ids={[i[:20] for i in ids]} -> {outcome.code.name} {outcome.details!r}")
    if not trial_id:
        assert_client_error(outcome, INVALID)
        return
    if before is None:
        assert_client_error(outcome, NOT_FOUND)
        assert fuzz.trial_info(trial_id) is None
        return

    def bad(item: ds.AddSampleRequest) -> bool:
        sample = item.trial_sample
        return (
            not item.HasField("trial_sample")
            or sample.trial_id not in ("", trial_id)
            or "\x00" in sample.user_id
        )

    first_bad = next((index for index, item in enumerate(requests) if bad(item)), None)
    if first_bad is None:
        assert_ok(outcome)
    else:
        assert_client_error(outcome, INVALID)
    stored = requests[:first_bad]
    info = fuzz.trial_info(trial_id)
    assert info is not None and info.samples_count == before.samples_count + len(stored)
    new = fuzz.samples(trial_id, info.samples_count)[before.samples_count :]
    for got, item in zip(new, stored, strict=True):
        sample = ds.StoredTrialSample()
        sample.CopyFrom(item.trial_sample)
        sample.trial_id = trial_id
        assert got.SerializeToString() == sample.SerializeToString()
    states = [item.trial_sample.state for item in stored]
    assert info.last_state in trial_states_after(before.last_state, states)
    fuzz.check_alive()


# ---- DatalogSP and LogExporterSP ----


@dataclass
class Datalog:
    """A RunTrialDatalog call to make, and what the server must make of it."""

    ids: list[str]  # `trial-id` header values
    users: list[str]  # `user-id` header values
    params: common_pb2.TrialParams
    first: str  # "params", "sample", "empty" or "none" (no message at all)
    body: list[datalog_pb2.RunTrialDatalogInput]  # what follows the first message

    def messages(self) -> list[datalog_pb2.RunTrialDatalogInput]:
        first = {
            "params": [datalog_pb2.RunTrialDatalogInput(trial_params=self.params)],
            "sample": [datalog_pb2.RunTrialDatalogInput(sample=datalog_sample(0))],
            "empty": [datalog_pb2.RunTrialDatalogInput()],
            "none": [],
        }[self.first]
        return first + (self.body if self.first != "none" else [])

    def metadata(self) -> list[tuple[str, str]]:
        return pairs("trial-id", self.ids) + pairs("user-id", self.users)

    def first_bad(self) -> int | None:
        """Index in the body of the first message that is not a valid sample."""
        actor_count = len(self.params.actors)
        for index, message in enumerate(self.body):
            if message.WhichOneof("msg") != "sample" or not sample_is_valid(message.sample, actor_count):
                return index
        return None


BURST_SAMPLES = 200
BURST_INFO = datalog_pb2.SampleInfo(timestamp=1, state=common_pb2.RUNNING)


@st.composite
def datalogs(draw: st.DrawFn, fresh_id: str) -> Datalog:
    ids = draw(st.sampled_from([[fresh_id], [fresh_id], [fresh_id], [fresh_id, "second"], None]))
    params = draw(trial_params_st())
    body = [
        datalog_pb2.RunTrialDatalogInput(sample=sample)
        for sample in draw(st.lists(datalog_samples(params), max_size=5))
    ]
    # Sometimes a burst of plain samples: commits then run while acknowledgements are being sent.
    for tick in range(draw(st.sampled_from([0, 0, 0, BURST_SAMPLES]))):
        body.append(datalog_pb2.RunTrialDatalogInput(sample=datalog_pb2.DatalogSample(info=BURST_INFO)))
        body[-1].sample.info.tick_id = tick
    stray = draw(st.sampled_from([None, None, None, None, "params", "empty"]))
    if stray is not None:
        message = datalog_pb2.RunTrialDatalogInput(trial_params=params) if stray == "params" else None
        body.insert(draw(st.integers(0, len(body))), message or datalog_pb2.RunTrialDatalogInput())
    return Datalog(
        ids=ids if ids is not None else draw(header_lists),
        users=draw(header_lists),
        params=params,
        first=draw(st.sampled_from(["params"] * 7 + ["sample", "empty", "none"])),
        body=body,
    )


def converted(datalog: Datalog, samples: Sequence[datalog_pb2.RunTrialDatalogInput]) -> list[bytes]:
    """What the datastore stores for these samples (the conversion is checked on its own, in
    test_samples.py; here: that what is stored is what it makes, bit for bit)."""
    converter = DatalogConverter(datalog.ids[0], datalog.users[0] if datalog.users else "", datalog.params)
    return [converter.convert(message.sample).SerializeToString() for message in samples]


def check_datalog_samples(
    fuzz: Harness,
    datalog: Datalog,
    before: ds.StoredTrialInfo | None,
    sent: list[datalog_pb2.RunTrialDatalogInput],
    cancelled: bool = False,
) -> int:
    """The trial holds what it held, then `sent`, converted, in order; its readers end (its stream
    closed); its user, parameters and state are the stream's. `cancelled`: a prefix of `sent`,
    read by count (test_readers_of_a_cancelled_datalog_end says why). Returns how many of `sent`
    are stored."""
    trial_id = datalog.ids[0]
    info = fuzz.trial_info(trial_id)
    assert info is not None
    had = before.samples_count if before else 0
    stored = fuzz.samples(trial_id, info.samples_count if cancelled else None)
    assert len(stored) == info.samples_count >= had
    new = [sample.SerializeToString() for sample in stored[had:]]
    assert new == converted(datalog, sent[: len(new)]), "not what was sent, or not in order"
    if cancelled:
        return len(new)
    assert len(new) == len(sent), f"{len(new)} of {len(sent)} samples stored"
    assert info.user_id == ((datalog.users[0] if datalog.users else "") or DEFAULT_DATALOG_USER)
    assert info.params == datalog.params
    in_sync = [message.sample.info.state for message in sent if not message.sample.info.out_of_sync]
    assert info.last_state in trial_states_after(before.last_state if before else common_pb2.UNKNOWN, in_sync)
    return len(new)


@settings(FUZZ, max_examples=50)
@given(data=st.data(), service=st.sampled_from(["DatalogSP", "DatalogSP", "LogExporterSP"]))
def test_run_trial_datalog_fuzz(fuzz: Harness, data: st.DataObject, service: str) -> None:
    datalog = data.draw(datalogs(fuzz.fresh_id("datalog")))
    messages = datalog.messages()
    bidi = service == "DatalogSP"
    cancel_after = (
        data.draw(st.one_of(st.none(), st.none(), st.none(), st.integers(0, len(messages)))) if bidi else None
    )
    note(
        f"ids={[i[:20] for i in datalog.ids]} users={[u[:20] for u in datalog.users]} "
        f"first={datalog.first} body={[m.WhichOneof('msg') for m in datalog.body]} "
        f"first_bad={datalog.first_bad()} cancel={cancel_after}"
    )
    trial_id = datalog.ids[0] if datalog.ids else ""
    before = fuzz.trial_info(trial_id) if trial_id else None
    # Calls are made in the harness loop: grpc.aio binds them to the loop they are made in.
    if bidi:
        outcome = fuzz.run(
            lambda: send_bidi(
                fuzz.datalog.RunTrialDatalog(metadata=datalog.metadata(), timeout=CALL_TIMEOUT_S),
                messages,
                cancel_after,
            )
        )
    else:
        exported = [datalog_pb2.LogExporterSampleRequest.FromString(m.SerializeToString()) for m in messages]
        outcome = fuzz.run(
            lambda: send_stream(
                fuzz.log_exporter.RunTrialDatalog(metadata=datalog.metadata(), timeout=CALL_TIMEOUT_S),
                exported,
            )
        )
    event(f"{service}: {outcome.code.name}")
    note(f"-> {outcome.code.name} {outcome.details!r}, {len(outcome.replies)} replies")
    first_bad = datalog.first_bad()
    opened = bool(trial_id) and datalog.first == "params"
    if cancel_after is not None and outcome.code == grpc.StatusCode.CANCELLED:
        # Cancelled: any prefix of the samples sent before, acknowledged ones included.
        if opened and (before is not None or fuzz.trial_info(trial_id) is not None):
            sent = datalog.body[: max(cancel_after - 1, 0)][:first_bad]
            stored = check_datalog_samples(fuzz, datalog, before, sent, cancelled=True)
            assert stored >= len(outcome.replies) - 1, "acknowledged samples missing"
        fuzz.check_alive()
        return
    if not datalog.ids or (datalog.first != "none" and not opened):
        assert_client_error(outcome, INVALID)
        assert not outcome.replies
        if trial_id:
            assert fuzz.trial_info(trial_id) == before, "a refused stream changed the trial"
    elif datalog.first == "none":
        assert_ok(outcome)
        assert len(outcome.replies) == (0 if bidi else 1)
        assert fuzz.trial_info(trial_id) == before
    else:
        if first_bad is None:
            assert_ok(outcome)
        else:
            assert_client_error(outcome, INVALID)
        sent = datalog.body[:first_bad]
        if bidi:
            assert len(outcome.replies) == 1 + len(sent), "not one acknowledgement per message stored"
        check_datalog_samples(fuzz, datalog, before, sent)
    fuzz.check_alive()


# ---- DeleteTrials ----


@settings(FUZZ, max_examples=20)
@given(
    created=st.lists(st.integers(0, 3), min_size=1, max_size=4),
    chosen=st.lists(st.integers(0, 3), max_size=4),
    other_ids=st.lists(texts, max_size=3),
    recreate=st.booleans(),
)
def test_delete_trials_fuzz(
    fuzz: Harness, created: list[int], chosen: list[int], other_ids: list[str], recreate: bool
) -> None:
    """Any ids: OK. The named trials are gone with their samples, the others are untouched; an id
    deleted can be created again, from nothing."""
    trial_ids = [fuzz.fresh_id("delete") for _ in created]
    for trial_id, samples in zip(trial_ids, created, strict=True):
        inputs = datalog_inputs(trial_params(), reader_samples(samples, ended=True))
        metadata = (("trial-id", trial_id),)
        assert_ok(
            fuzz.run(
                lambda i=inputs, m=metadata: collect(
                    fuzz.datalog.RunTrialDatalog(iter(i), metadata=m, timeout=CALL_TIMEOUT_S)
                )
            )
        )
    deleted = {trial_ids[index] for index in chosen if index < len(trial_ids)}
    request = ds.DeleteTrialsRequest(trial_ids=[*deleted, *other_ids])
    assert_ok(fuzz.run(lambda: unary(fuzz.stub.DeleteTrials(request, timeout=CALL_TIMEOUT_S))))
    for trial_id, samples in zip(trial_ids, created, strict=True):
        info = fuzz.trial_info(trial_id)
        read = ds.RetrieveSamplesRequest(trial_ids=[trial_id])
        outcome = fuzz.run(lambda r=read: collect(fuzz.stub.RetrieveSamples(r, timeout=CALL_TIMEOUT_S)))
        if trial_id in deleted:
            assert info is None
            assert_client_error(outcome, NOT_FOUND)
        else:
            assert info is not None and info.samples_count == samples
            assert_ok(outcome)
            assert [r.trial_sample.tick_id for r in outcome.replies] == list(range(samples))
    if recreate and deleted:
        trial_id = sorted(deleted)[0]
        request_add = ds.AddTrialRequest(user_id="again", trial_params=trial_params())
        fuzz.run(lambda: fuzz.stub.AddTrial(request_add, metadata=(("trial-id", trial_id),)))
        info = fuzz.trial_info(trial_id)
        assert info is not None and info.samples_count == 0 and info.user_id == "again"
    fuzz.check_alive()


# ---- Version / Status ----

metadata_pairs = st.lists(
    st.tuples(st.sampled_from(["trial-id", "user-id", "authentication-token", "x-any"]), header_texts),
    max_size=3,
)


@settings(FUZZ, max_examples=15)
@given(
    service=st.sampled_from(SERVICES),
    names=st.lists(st.one_of(small_texts, st.sampled_from(["*", "overall_load"])), max_size=4),
    metadata=metadata_pairs,
)
def test_version_and_status_fuzz(
    fuzz: Harness, service: str, names: list[str], metadata: list[tuple[str, str]]
) -> None:
    """Status has exactly the statuses asked for (`*`: all, and the scan stops there); Version
    answers. Metadata changes nothing."""
    status = fuzz.channel.unary_unary(
        f"/cogmentAPI.{service}/Status",
        request_serializer=common_pb2.StatusRequest.SerializeToString,
        response_deserializer=common_pb2.StatusReply.FromString,
    )
    outcome = fuzz.run(
        lambda: unary(
            status(common_pb2.StatusRequest(names=names), metadata=metadata, timeout=CALL_TIMEOUT_S)
        )
    )
    assert_ok(outcome)
    before_star = names[: names.index("*")] if "*" in names else names
    expected = {"overall_load"} if "*" in names or "overall_load" in before_star else set()
    assert set(outcome.replies[0].statuses) == expected
    if expected:
        assert 0 <= int(outcome.replies[0].statuses["overall_load"]) <= 255
    version = fuzz.channel.unary_unary(
        f"/cogmentAPI.{service}/Version",
        request_serializer=common_pb2.VersionRequest.SerializeToString,
        response_deserializer=common_pb2.VersionInfo.FromString,
    )
    outcome = fuzz.run(
        lambda: unary(version(common_pb2.VersionRequest(), metadata=metadata, timeout=CALL_TIMEOUT_S))
    )
    assert_version_reply(outcome)


# ---- raw bytes, valid protobuf or not ----

REQUEST_TYPES: dict[str, type[Message]] = {
    "TrialDatastoreSP/RetrieveTrials": ds.RetrieveTrialsRequest,
    "TrialDatastoreSP/RetrieveSamples": ds.RetrieveSamplesRequest,
    "TrialDatastoreSP/AddTrial": ds.AddTrialRequest,
    "TrialDatastoreSP/AddSample": ds.AddSampleRequest,
    "TrialDatastoreSP/DeleteTrials": ds.DeleteTrialsRequest,
    "DatalogSP/RunTrialDatalog": datalog_pb2.RunTrialDatalogInput,
    "LogExporterSP/RunTrialDatalog": datalog_pb2.LogExporterSampleRequest,
    **{f"{service}/Version": common_pb2.VersionRequest for service in SERVICES},
    **{f"{service}/Status": common_pb2.StatusRequest for service in SERVICES},
}
CLIENT_STREAMING = {"TrialDatastoreSP/AddSample", "LogExporterSP/RunTrialDatalog"}
BIDI_STREAMING = {"DatalogSP/RunTrialDatalog"}
STREAMING = CLIENT_STREAMING | BIDI_STREAMING
# The AddSample target: an existing trial, so that the samples themselves are read.
RAW_SAMPLES_TRIAL = "list-3"
# A RetrieveTrials request waiting longer than this (its timeout, in ms) is cut by a short deadline.
RAW_LONG_WAIT_MS = 1_000
RAW_SHORT_DEADLINE_S = 0.5
DATASTORE_CORRUPT = [
    *CORRUPT,
    b"\x0a\x01\xff",  # field 1 a string that is not UTF-8 (trial_ids, user_id, names...)
    b"\x22\x01\xff",  # RetrieveTrials: a handle not UTF-8
    b"\x0a\x03\x12\x01\xff",  # AddSample: trial_sample.trial_id not UTF-8
    b"\x12\x05\x0a\x03\x0a\x01\xff",  # RunTrialDatalog: sample.info holding garbage
    b"\x0a\x02\x12\x05",  # a nested message holding a truncated field
]


def valid_requests(method: str) -> st.SearchStrategy[Message]:
    _, name = method.split("/")
    sample_inputs = st.one_of(
        st.builds(datalog_pb2.RunTrialDatalogInput, trial_params=st.just(trial_params())),
        st.builds(datalog_pb2.RunTrialDatalogInput, sample=datalog_samples(trial_params())),
    )
    if method == "LogExporterSP/RunTrialDatalog":
        return sample_inputs.map(
            lambda m: datalog_pb2.LogExporterSampleRequest.FromString(m.SerializeToString())
        )
    return {
        "RetrieveTrials": st.builds(
            ds.RetrieveTrialsRequest,
            trial_ids=st.lists(small_texts, max_size=2),
            timeout=st.integers(0, 5),
            trials_count=uint32s,
            trial_handle=handles,
        ),
        "RetrieveSamples": st.builds(
            ds.RetrieveSamplesRequest,
            trial_ids=st.lists(st.one_of(st.sampled_from(list(READ_TRIALS)), small_texts), max_size=2),
            actor_names=st.lists(small_texts, max_size=2),
        ),
        "AddTrial": st.builds(ds.AddTrialRequest, user_id=small_texts, trial_params=trial_params_st()),
        "AddSample": st.builds(ds.AddSampleRequest, trial_sample=stored_samples()),
        "DeleteTrials": st.builds(ds.DeleteTrialsRequest, trial_ids=st.lists(small_texts, max_size=2)),
        "RunTrialDatalog": sample_inputs,
        "Version": st.just(common_pb2.VersionRequest()),
        "Status": st.builds(common_pb2.StatusRequest, names=st.lists(small_texts, max_size=3)),
    }[name]


RAW = RawRequests(
    REQUEST_TYPES, frozenset(STREAMING), DATASTORE_CORRUPT, valid_requests, max_unknown_fields=2
)


def waits_long(method: str, messages: list[bytes]) -> bool:
    """A RetrieveTrials request that may rightly wait past the call's deadline."""
    if method != "TrialDatastoreSP/RetrieveTrials" or not RAW.decodes(method, messages[0]):
        return False
    return ds.RetrieveTrialsRequest.FromString(messages[0]).timeout > RAW_LONG_WAIT_MS


async def raw_call(channel: grpc.aio.Channel, method: str, messages: list[bytes], trial_id: str) -> Outcome:
    """Call `method` with request bytes as they are; streams carry a `trial-id` header (`trial_id`,
    or the existing RAW_SAMPLES_TRIAL for AddSample)."""
    path, codec = f"/cogmentAPI.{method}", {"request_serializer": bytes, "response_deserializer": bytes}
    timeout = RAW_SHORT_DEADLINE_S if waits_long(method, messages) else CALL_TIMEOUT_S
    if method in STREAMING:
        header = RAW_SAMPLES_TRIAL if method == "TrialDatastoreSP/AddSample" else trial_id
        md = (("trial-id", header),)
        if method in BIDI_STREAMING:
            return await send_bidi(
                channel.stream_stream(path, **codec)(metadata=md, timeout=timeout), messages
            )
        return await send_stream(channel.stream_unary(path, **codec)(metadata=md, timeout=timeout), messages)
    if method == "TrialDatastoreSP/RetrieveSamples":
        return await collect(channel.unary_stream(path, **codec)(messages[0], timeout=timeout))
    return await unary(channel.unary_unary(path, **codec)(messages[0], timeout=timeout))


def check_raw_outcome(method: str, messages: list[bytes], outcome: Outcome, strict: bool) -> None:
    """Never a server error; an undecodable request ends the call with an error (`strict`:
    INVALID_ARGUMENT)."""
    good = RAW.decodable(method, messages, outcome)
    if (
        outcome.code == grpc.StatusCode.INTERNAL
        and outcome.details == CLIENT_CORE_ERROR
        and method in STREAMING
    ):
        event("grpcio client: Internal error from Core")
        assert False in good or outcome.code != OK
        return
    assert_no_server_error(outcome)
    if all(good):
        allowed = CLIENT_ERROR_CODES | {OK}
        if waits_long(method, messages):
            allowed |= {grpc.StatusCode.DEADLINE_EXCEEDED}
        assert outcome.code in allowed, f"{outcome.code.name}: {outcome.details}"
        return
    assert outcome.code != OK, "an undecodable request was answered OK"
    if strict:
        assert outcome.code == INVALID, f"{outcome.code.name}: {outcome.details}"


@settings(FUZZ, max_examples=60)
@given(call=RAW.calls())
def test_raw_bytes_never_break_the_server(fuzz: Harness, call: tuple[str, list[bytes]]) -> None:
    method, messages = call
    outcome = fuzz.run(raw_call, fuzz.channel, method, messages, fuzz.fresh_id("raw"))
    check_raw_outcome(method, messages, outcome, strict=False)
    fuzz.check_alive()


@settings(FUZZ, max_examples=30)
@given(call=RAW.calls(undecodable=True))
def test_raw_undecodable_requests_get_a_client_error(fuzz: Harness, call: tuple[str, list[bytes]]) -> None:
    method, messages = call
    outcome = fuzz.run(raw_call, fuzz.channel, method, messages, fuzz.fresh_id("raw"))
    check_raw_outcome(method, messages, outcome, strict=True)
    fuzz.check_alive()


# One method per service and call shape: the limit is the server's, not a method's.
OVERSIZED_METHODS = [
    "TrialDatastoreSP/RetrieveTrials",
    "TrialDatastoreSP/RetrieveSamples",
    "TrialDatastoreSP/AddSample",
    "DatalogSP/RunTrialDatalog",
    "LogExporterSP/RunTrialDatalog",
    "LogExporterSP/Status",
]


def test_oversized_messages_are_refused(fuzz: Harness) -> None:
    """Beyond the receive limit: RESOURCE_EXHAUSTED, whatever the call, and still serving."""
    message = ds.DeleteTrialsRequest(trial_ids=["t" * MAX_RECEIVE_MESSAGE_BYTES]).SerializeToString()
    for method in OVERSIZED_METHODS:
        outcome = fuzz.run(raw_call, fuzz.channel, method, [message], fuzz.fresh_id("huge"))
        assert outcome.code == grpc.StatusCode.RESOURCE_EXHAUSTED, f"{method} {outcome.code.name}"
    fuzz.check_alive()


# ---- defects found by this file ----


HUGE_HANDLES = [str(2**63), str(2**64), "9" * 30, "9" * 5000]
LENIENT_HANDLES = ["1_0", " 1", "1 ", "\u0663", "\uff11"]  # ARABIC-INDIC THREE, FULLWIDTH ONE
UNKNOWN_STATES = [SMALLINT[1] + 1, 2**31 - 1, SMALLINT[0] - 1]
# Samples of a well-formed stream running while a stream with an unknown state is refused.
BYSTANDER_SAMPLES = 2000


def test_huge_trial_handles_are_an_empty_page(fuzz: Harness) -> None:
    """A valid (decimal) handle past the end is an empty page, as "1000" is."""
    for handle in HUGE_HANDLES:
        request = ds.RetrieveTrialsRequest(trial_handle=handle)
        outcome = fuzz.run(lambda r=request: unary(fuzz.stub.RetrieveTrials(r, timeout=CALL_TIMEOUT_S)))
        assert_ok(outcome)
        assert list(outcome.replies[0].trial_infos) == [], handle[:30]
    fuzz.check_alive()


def test_handles_only_take_ascii_digits(fuzz: Harness) -> None:
    for handle in LENIENT_HANDLES:
        request = ds.RetrieveTrialsRequest(trial_handle=handle)
        outcome = fuzz.run(lambda r=request: unary(fuzz.stub.RetrieveTrials(r, timeout=CALL_TIMEOUT_S)))
        assert_client_error(outcome, INVALID)


def unknown_state_stream(fuzz: Harness, service: str, state: int) -> tuple[str, Outcome]:
    """One sample with `state`, through AddSample or DatalogSP, to a new trial: its id, and how
    the call ended."""
    trial_id = fuzz.fresh_id("state")
    if service == "AddSample":
        add = ds.AddTrialRequest(trial_params=trial_params())
        fuzz.run(lambda: fuzz.stub.AddTrial(add, metadata=(("trial-id", trial_id),)))
        sample = ds.StoredTrialSample(tick_id=0, state=common_pb2.TrialState.ValueType(state))
        return trial_id, fuzz.run(
            lambda: send_stream(
                fuzz.stub.AddSample(metadata=(("trial-id", trial_id),), timeout=CALL_TIMEOUT_S),
                [ds.AddSampleRequest(trial_sample=sample)],
            )
        )
    datalog = datalog_sample(0)
    datalog.info.state = common_pb2.TrialState.ValueType(state)
    return trial_id, fuzz.run(
        lambda: send_bidi(
            fuzz.datalog.RunTrialDatalog(metadata=(("trial-id", trial_id),), timeout=CALL_TIMEOUT_S),
            datalog_inputs(trial_params(), [datalog]),
        )
    )


def test_states_beyond_16_bits_are_not_server_errors(fuzz: Harness) -> None:
    """A state number the TrialState enum does not know (the enum is open on the wire) is stored,
    or refused as INVALID_ARGUMENT; never a server error, and never one for another stream whose
    samples are written in the same transaction."""
    for service in ("AddSample", "DatalogSP"):
        for state in UNKNOWN_STATES:
            trial_id, outcome = unknown_state_stream(fuzz, service, state)
            assert outcome.code in (OK, INVALID), (
                f"{service}, state {state}: {outcome.code.name} {outcome.details}"
            )
            info = fuzz.trial_info(trial_id)
            assert info is not None and info.samples_count == (1 if outcome.code == OK else 0)

    async def bystander() -> Outcome:
        samples = [datalog_sample(tick) for tick in range(BYSTANDER_SAMPLES)]
        call = fuzz.datalog.RunTrialDatalog(metadata=(("trial-id", "bystander"),), timeout=CALL_TIMEOUT_S)
        return await send_bidi(call, datalog_inputs(trial_params(), samples))

    running = fuzz.start(bystander)
    for state in UNKNOWN_STATES:
        unknown_state_stream(fuzz, "DatalogSP", state)
    outcome = running.result(CALL_TIMEOUT_S)
    assert_ok(outcome)
    assert len(outcome.replies) == 1 + BYSTANDER_SAMPLES
    fuzz.check_alive()


CANCEL_ATTEMPTS = 40
CANCELLED_READ_DEADLINE_S = 2.0


def test_readers_of_a_cancelled_datalog_end(fuzz: Harness) -> None:
    """A client cancelling its DatalogSP stream right after the parameters closes the stream as a
    half-close would: if the trial was created, its readers get its (zero) samples and end."""

    async def cancelled_streams() -> list[Outcome]:
        trial_ids = []
        for _ in range(CANCEL_ATTEMPTS):
            trial_ids.append(fuzz.fresh_id("cancelled"))
            call = fuzz.datalog.RunTrialDatalog(
                metadata=(("trial-id", trial_ids[-1]),), timeout=CALL_TIMEOUT_S
            )
            await send_bidi(call, datalog_inputs(trial_params(), [datalog_sample(0)]), cancel_after=1)
        await asyncio.sleep(0.2)  # what the server still does for them, it has done
        reply = await fuzz.stub.RetrieveTrials(ds.RetrieveTrialsRequest(trial_ids=trial_ids))
        created = [info.trial_id for info in reply.trial_infos]
        reads = [
            collect(
                fuzz.stub.RetrieveSamples(
                    ds.RetrieveSamplesRequest(trial_ids=[trial_id]), timeout=CANCELLED_READ_DEADLINE_S
                )
            )
            for trial_id in created
        ]
        return list(await asyncio.gather(*reads))

    outcomes = fuzz.run(cancelled_streams)
    stuck = [outcome for outcome in outcomes if outcome.code != OK]
    assert not stuck, f"{len(stuck)} of {len(outcomes)} created trials never end: {stuck[0].code.name}"
