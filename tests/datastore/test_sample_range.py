"""The project's own `cogment_aux.api.TrialSamplesSP`, served beside TrialDatastoreSP: a range of a
trial's samples by position, as RetrieveSamples replays them, over real gRPC on SQLite and on
PostgreSQL; bounded in count and bytes; waiting for a running trial's next samples; bad requests
say what is wrong."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from services.datastore.client.api import DatastoreClient
from services.datastore.core import RANGE_MAX_BYTES
from services.datastore.model import SampleRange
from services.datastore.servicer import range_reply
from shared.api import common_pb2, trial_datastore_pb2, trial_samples_pb2, trial_samples_pb2_grpc
from shared.validation import MiB
from tests.helpers.datastore import (
    datalog_inputs,
    datalog_sample,
    full_trial,
    run_datalog,
    send_acknowledged,
    trial_params,
)
from tests.helpers.fake_services import FakeCogmentService
from tests.helpers.running import DatastoreFactory, RunningDatastore


async def sample_range(
    datastore: RunningDatastore,
    trial_id: str,
    first: int,
    count: int = 0,
    tick: int | None = None,
    timeout_ms: int = 0,
) -> trial_samples_pb2.RetrieveSampleRangeReply:
    stub = trial_samples_pb2_grpc.TrialSamplesSPStub(datastore.channel)
    request = trial_samples_pb2.RetrieveSampleRangeRequest(
        trial_id=trial_id, first=first, count=count, timeout_ms=timeout_ms
    )
    if tick is not None:
        request.tick = tick
    reply: trial_samples_pb2.RetrieveSampleRangeReply = await stub.RetrieveSampleRange(
        request, timeout=10 + timeout_ms / 1000
    )
    return reply


async def replayed(datastore: RunningDatastore, trial_id: str) -> list[trial_datastore_pb2.StoredTrialSample]:
    call = datastore.stub.RetrieveSamples(trial_datastore_pb2.RetrieveSamplesRequest(trial_ids=[trial_id]))
    return [reply.trial_sample async for reply in call]


async def test_ranges_are_what_retrieve_samples_replays(datastore: RunningDatastore) -> None:
    # 250 ticks, with late samples of earlier ticks among them.
    samples = full_trial(250)
    for late_after, tick in [(40, 12), (41, 12), (200, 3)]:
        samples.insert(late_after, datalog_sample(tick, out_of_sync=True, reward=1.0))
    await run_datalog(datastore, "long", samples)
    everything = await replayed(datastore, "long")
    assert len(everything) == 253

    reply = await sample_range(datastore, "long", 0)
    assert reply.samples_count == 253 and list(reply.samples) == everything[:100]  # 100 by default
    reply = await sample_range(datastore, "long", 39, 4)
    assert list(reply.samples) == everything[39:43]
    assert [sample.tick_id for sample in reply.samples] == [39, 12, 12, 40]
    reply = await sample_range(datastore, "long", 200, 1000)
    assert list(reply.samples) == everything[200:]
    for beyond in (253, 2**64 - 1):
        past = await sample_range(datastore, "long", beyond)
        assert list(past.samples) == [] and past.samples_count == 253
    async with DatastoreClient(f"grpc://127.0.0.1:{datastore.service.port}") as client:
        listed = await client.sample_range("long", 252, 5)
        assert listed is not None and list(listed.samples) == everything[252:]


async def test_the_datastore_finds_the_first_sample_of_a_tick(datastore: RunningDatastore) -> None:
    """Each tick's own sample, not a late one: here every reward of the trial comes late, after
    its last tick (ticks 0..59, then 0..59 again), which a search by position would mistake."""
    samples = full_trial(60) + [datalog_sample(tick, out_of_sync=True, reward=5.0) for tick in range(60)]
    await run_datalog(datastore, "rewards-last", samples)
    everything = await replayed(datastore, "rewards-last")
    for tick in (0, 1, 30, 59):
        found = await sample_range(datastore, "rewards-last", 0, 1, tick=tick)
        assert (found.first, list(found.samples)) == (tick, [everything[tick]])
        late = await sample_range(datastore, "rewards-last", tick + 1, 2, tick=tick)  # from a position on
        assert (late.first, list(late.samples)) == (60 + tick, everything[60 + tick : 62 + tick])
    missing = await sample_range(datastore, "rewards-last", 0, 1, tick=60)
    assert (list(missing.samples), missing.first, missing.samples_count) == ([], 120, 120)


async def test_a_range_ends_early_past_its_bytes_but_never_empty(
    datastore: RunningDatastore, monkeypatch: pytest.MonkeyPatch
) -> None:
    big = [datalog_sample(tick) for tick in range(4)]
    for sample in big:
        sample.observations.observations[0] = bytes(RANGE_MAX_BYTES // 2 + 1)
    await run_datalog(datastore, "big", big)
    store = datastore.service.store
    sample_sizes, looked = store.sample_sizes, []

    async def counted(*args: Any) -> list[int]:
        looked.append(args)
        return await sample_sizes(*args)

    monkeypatch.setattr(store, "sample_sizes", counted)
    first = await sample_range(datastore, "big", 0, 4)
    assert [sample.tick_id for sample in first.samples] == [0]  # a second would pass 2 MiB
    assert len(looked) == 1  # nor read past what fits
    assert [sample.tick_id for sample in (await sample_range(datastore, "big", 3, 4)).samples] == [3]


@pytest.mark.parametrize(
    ("trial_id", "first", "count", "code", "message"),
    [
        ("nope", 0, 0, grpc.StatusCode.NOT_FOUND, 'no trial "nope" found'),
        ("t", 0, 1001, grpc.StatusCode.INVALID_ARGUMENT, "count [1001] is over 1000"),
        ("", 0, 1, grpc.StatusCode.INVALID_ARGUMENT, "trial id"),
    ],
)
async def test_bad_ranges_say_what_is_wrong(
    datastore: RunningDatastore, trial_id: str, first: int, count: int, code: grpc.StatusCode, message: str
) -> None:
    await run_datalog(datastore, "t", full_trial(2))
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await sample_range(datastore, trial_id, first, count)
    assert raised.value.code() == code
    assert message in (raised.value.details() or "")


async def test_the_client_tells_a_datastore_without_ranges() -> None:
    """A Cogment 2.x datastore (here: a server of another service) does not serve it: None."""
    other = await FakeCogmentService("TrialDatastoreSP").start()
    try:
        async with DatastoreClient(f"grpc://127.0.0.1:{other.port}") as client:
            assert await client.sample_range("t", 0) is None
    finally:
        await other.stop()


async def test_a_waiting_range_follows_a_running_trial_until_it_ends(datastore: RunningDatastore) -> None:
    call = datastore.datalog.RunTrialDatalog(metadata=(("trial-id", "live"),))
    inputs = datalog_inputs(
        trial_params(), [datalog_sample(tick) for tick in range(4)] + [datalog_sample(4, common_pb2.ENDED)]
    )
    await send_acknowledged(call, inputs[:3])  # the parameters and ticks 0 and 1
    stored = await sample_range(datastore, "live", 0, timeout_ms=10_000)  # there already: at once
    assert [s.tick_id for s in stored.samples] == [0, 1]
    assert stored.HasField("finished") and not stored.finished and stored.samples_count == 2

    waiting = asyncio.ensure_future(sample_range(datastore, "live", 2, timeout_ms=30_000))
    await asyncio.sleep(0.3)
    assert not waiting.done()  # nothing after position 2 yet
    await send_acknowledged(call, inputs[3:4])
    woken = await asyncio.wait_for(waiting, 10)
    assert [s.tick_id for s in woken.samples] == [2] and woken.first == 2 and not woken.finished

    none_came = await sample_range(datastore, "live", 3, timeout_ms=200)  # answered empty in time
    assert list(none_came.samples) == [] and none_came.first == 3 and not none_came.finished
    await send_acknowledged(call, inputs[4:])
    rest = await sample_range(datastore, "live", 3, timeout_ms=30_000)
    assert [s.tick_id for s in rest.samples] == [3, 4] and rest.finished and rest.samples_count == 5
    await call.done_writing()
    past = await sample_range(datastore, "live", 5, timeout_ms=30_000)  # over: at once, empty
    assert list(past.samples) == [] and past.finished


async def test_a_waiting_range_ends_with_an_interrupted_trial(datastore: RunningDatastore) -> None:
    """Its ingestion closes without an ENDED sample (the orchestrator went away): no sample will
    come, the wait ends (where RetrieveSamples ends)."""
    call = datastore.datalog.RunTrialDatalog(metadata=(("trial-id", "cut"),))
    await send_acknowledged(call, datalog_inputs(trial_params(), [datalog_sample(0)]))
    waiting = asyncio.ensure_future(sample_range(datastore, "cut", 1, timeout_ms=30_000))
    await asyncio.sleep(0.3)
    assert not waiting.done()
    await call.done_writing()
    ended = await asyncio.wait_for(waiting, 10)
    assert list(ended.samples) == [] and ended.finished and ended.samples_count == 1


async def test_a_trial_deleted_during_a_wait_is_not_found(datastore: RunningDatastore) -> None:
    call = datastore.datalog.RunTrialDatalog(metadata=(("trial-id", "gone"),))
    await send_acknowledged(call, datalog_inputs(trial_params(), [datalog_sample(0)]))
    waiting = asyncio.ensure_future(sample_range(datastore, "gone", 1, timeout_ms=30_000))
    await asyncio.sleep(0.3)
    await datastore.stub.DeleteTrials(trial_datastore_pb2.DeleteTrialsRequest(trial_ids=["gone"]))
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await asyncio.wait_for(waiting, 10)
    assert raised.value.code() == grpc.StatusCode.NOT_FOUND
    call.cancel()


async def test_ranges_gathered_at_once_wait_their_turn_within_the_replay_budget(
    datastore_factory: DatastoreFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A range's samples count in the replay budget until it is answered: with room for one
    MiB-sized sample read (two copies) and another gathered, ten readers at once do not all
    hold theirs while the trials' progress is read."""
    async with datastore_factory("--replay_bytes", str(3 * MiB)) as datastore:
        for trial in range(10):
            sample = datalog_sample(0)
            sample.observations.observations[0] = bytes(MiB)
            await run_datalog(datastore, f"t{trial}", [sample])
        store = datastore.service.store
        progress = store.progress
        holding, most = 0, 0

        async def slow_progress(trial_seq: int) -> Any:
            nonlocal holding, most
            holding += 1
            most = max(most, holding)
            try:
                await asyncio.sleep(0.2)  # a database answering slowly
                return await progress(trial_seq)
            finally:
                holding -= 1

        monkeypatch.setattr(store, "progress", slow_progress)
        replies = await asyncio.gather(*(sample_range(datastore, f"t{trial}", 0) for trial in range(10)))
        assert [len(reply.samples) for reply in replies] == [1] * 10
        assert most == 2


@pytest.mark.parametrize("finished", [False, True])
@pytest.mark.parametrize("sizes", [[], [0], [1, 127, 128, 300_000]])
def test_the_reply_encoded_around_stored_samples_is_protobufs_own(finished: bool, sizes: list[int]) -> None:
    samples = [
        trial_datastore_pb2.StoredTrialSample(tick_id=tick, payloads=[bytes(size)] if size else [])
        for tick, size in enumerate(sizes)
    ]
    found = SampleRange([s.SerializeToString() for s in samples], 2**40, 2**33 + 5, finished)
    expected = trial_samples_pb2.RetrieveSampleRangeReply(
        samples=samples, samples_count=2**33 + 5, first=2**40, finished=finished
    )
    decoded = trial_samples_pb2.RetrieveSampleRangeReply.FromString(range_reply(found))
    assert decoded == expected and decoded.HasField("finished")
