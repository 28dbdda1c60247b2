"""The Trial Datastore's own metrics over real gRPC: counters agree with the work done, gauges
with what is open, and the number of series stays bounded whatever trials clients send."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from services.datastore.conversion import DatalogConverter
from services.datastore.metrics import MAX_ACTOR_CLASS_LABELS, OTHER_ACTOR_CLASS, ActorClassLabels
from shared.api import common_pb2, datalog_pb2, trial_samples_pb2, trial_samples_pb2_grpc
from shared.api import trial_datastore_pb2 as ds
from tests.helpers.datastore import (
    add_trial,
    datalog_inputs,
    datalog_sample,
    full_trial,
    run_datalog,
    send_acknowledged,
    trial_params,
)
from tests.helpers.eventually import eventually
from tests.helpers.exposed_metrics import delta, exposed, value
from tests.helpers.running import RunningDatastore, make_datastore_factory

P = "cogment_trial_datastore_"
BUDGET = 50_000_000


@pytest.fixture
async def datastore(tmp_path: Path) -> AsyncIterator[RunningDatastore]:
    """On SQLite only: what is counted does not depend on the database."""
    factory = make_datastore_factory(f"sqlite+aiosqlite:///{tmp_path / 'metrics.db'}")
    async with factory("--ingestion_bytes", str(BUDGET)) as running:
        yield running


async def test_ingestion_counters_agree_with_the_samples_sent(datastore: RunningDatastore) -> None:
    before = exposed(P)
    await run_datalog(datastore, "ended", full_trial(3))
    await run_datalog(datastore, "interrupted", full_trial(3)[:2])
    exported = [
        datalog_pb2.LogExporterSampleRequest(trial_params=trial_params()),
        *(datalog_pb2.LogExporterSampleRequest(sample=s) for s in full_trial(5)),
    ]
    await datastore.log_exporter.RunTrialDatalog(iter(exported), metadata=(("trial-id", "exported"),))
    await add_trial(datastore, "added")
    added = [ds.StoredTrialSample(tick_id=tick, user_id="u", payloads=[b"x" * tick]) for tick in range(4)]
    await datastore.stub.AddSample(
        iter(ds.AddSampleRequest(trial_sample=sample) for sample in added), metadata=(("trial-id", "added"),)
    )
    after = exposed(P)

    assert delta(before, after, P + "ingested_samples_total", api="datalog") == 5
    assert delta(before, after, P + "ingested_samples_total", api="log_exporter") == 5
    assert delta(before, after, P + "ingested_samples_total", api="add_sample") == 4
    # The bytes stored: AddSample's samples as sent, with the trial id the datastore sets.
    for sample in added:
        sample.trial_id = "added"
    added_bytes = sum(sample.ByteSize() for sample in added)
    assert delta(before, after, P + "ingested_bytes_total", api="add_sample") == added_bytes
    assert delta(before, after, P + "ingested_bytes_total", api="datalog") > 5 * len("obs-0")
    assert delta(before, after, P + "trials_started_total") == 3  # AddTrial starts no ingestion
    assert delta(before, after, P + "trials_ended_total") == 2
    assert delta(before, after, P + "trials_interrupted_total") == 1
    # Every committed sample is in some transaction, and waited for it.
    assert delta(before, after, P + "commit_batch_samples_sum") == 14
    transactions = delta(before, after, P + "commit_batch_samples_count")
    assert 1 <= transactions == delta(before, after, P + "commit_duration_seconds_count")
    assert delta(before, after, P + "ack_wait_seconds_count") >= 4  # one per stream at least
    assert delta(before, after, P + "outage_held_batches_total") == 0
    assert value(after, P + "held_bytes") == 0
    assert value(after, P + "held_bytes_budget") == BUDGET


async def test_gauges_follow_open_streams_and_readers(datastore: RunningDatastore) -> None:
    before = exposed(P)
    call = datastore.datalog.RunTrialDatalog(metadata=(("trial-id", "live"),))
    await send_acknowledged(call, datalog_inputs(trial_params(), full_trial(4)[:2]))
    reader = datastore.stub.RetrieveSamples(ds.RetrieveSamplesRequest(trial_ids=["live"]))
    for _ in range(2):
        await reader.read()
    samples = trial_samples_pb2_grpc.TrialSamplesSPStub(datastore.channel)
    waiting = samples.RetrieveSampleRange(
        trial_samples_pb2.RetrieveSampleRangeRequest(trial_id="live", first=2, timeout_ms=30_000)
    )
    await eventually(lambda: value(exposed(P), P + "live_readers") == 2, "the range waiting")
    during = exposed(P)
    assert value(during, P + "datalog_streams") == 1

    await send_acknowledged(call, datalog_inputs(trial_params(), full_trial(4)[2:])[1:])
    await call.done_writing()
    assert await call.read() == grpc.aio.EOF
    assert [await reader.read() for _ in range(3)][-1] == grpc.aio.EOF  # the last two, then the end
    ranged = await waiting  # woken by tick 2, and tick 3 if it came by then
    after = exposed(P)
    assert value(after, P + "datalog_streams") == 0
    assert value(after, P + "live_readers") == 0
    assert delta(before, after, P + "replayed_samples_total") == 4 + len(ranged.samples) > 4
    assert delta(before, after, P + "trials_ended_total") == 1


async def test_ended_trials_give_returns_by_actor_class_lengths_and_durations(
    datastore: RunningDatastore,
) -> None:
    before = exposed(P)
    # Rewards go to bob (class1) from alice (class1); carol (class2) gets none. The late reward,
    # out of sync, counts too.
    samples = [
        datalog_sample(0, reward=1.5),
        datalog_sample(1),
        datalog_sample(2, reward=-0.5),
        datalog_sample(3, common_pb2.ENDED, reward=2.0),
        datalog_sample(1, common_pb2.UNKNOWN, out_of_sync=True, reward=4.0),
    ]
    await run_datalog(datastore, "rewarded", samples)
    await run_datalog(datastore, "cut", [datalog_sample(0, reward=100.0)])  # interrupted: no figures
    after = exposed(P)

    # One return per actor: alice 0 and bob 7 in class1, carol 0 in class2. Returns may be negative:
    # no _sum nor _count (prometheus_client's rule), the +Inf bucket counts them.
    def returns(actor_class: str, le: str) -> float:
        return delta(before, after, P + "trial_return_bucket", actor_class=actor_class, le=le)

    assert returns("class1", "+Inf") == 2
    assert (returns("class1", "-1.0"), returns("class1", "0.0"), returns("class1", "3.0")) == (0, 1, 1)
    assert returns("class1", "10.0") == 2  # bob's 1.5 - 0.5 + 2 + 4
    assert (returns("class2", "-1.0"), returns("class2", "0.0"), returns("class2", "+Inf")) == (0, 1, 1)
    # Ticks 0 to 3, timestamps 1000 to 1003 ns. Read from the buckets: the sums, floats, no longer
    # change by 4 or by 3 ns once the fuzz tests' trials of 2^64 ticks and ns are in them.
    assert delta(before, after, P + "trial_ticks_count") == 1
    ticks = {le: delta(before, after, P + "trial_ticks_bucket", le=le) for le in ("1.0", "10.0")}
    assert ticks == {"1.0": 0, "10.0": 1}
    assert delta(before, after, P + "trial_duration_seconds_count") == 1
    assert delta(before, after, P + "trial_duration_seconds_bucket", le="0.1") == 1


def test_actor_class_labels_are_capped() -> None:
    labels = ActorClassLabels(limit=3)
    assert [labels.label(name) for name in ["a", "b", "a", "c", "d", "b", "e"]] == [
        "a", "b", "a", "c", OTHER_ACTOR_CLASS, "b", OTHER_ACTOR_CLASS,
    ]  # fmt: skip
    assert labels.label("x" * 1000) == OTHER_ACTOR_CLASS  # too long, even with room


async def test_series_stay_bounded_whatever_trials_and_classes_clients_send(
    datastore: RunningDatastore,
) -> None:
    trials = 1500

    def params(index: int) -> common_pb2.TrialParams:
        return common_pb2.TrialParams(
            actors=[common_pb2.ActorParams(name="a", actor_class=f"class-{index}", implementation="i")]
        )

    sample = datalog_pb2.DatalogSample(
        info=datalog_pb2.SampleInfo(tick_id=0, timestamp=1, state=common_pb2.ENDED)
    )

    async def one_trial(index: int) -> None:
        call = datastore.datalog.RunTrialDatalog(
            iter(datalog_inputs(params(index), [sample])), metadata=(("trial-id", f"trial-{index}"),)
        )
        assert len([ack async for ack in call]) == 2

    async def trials_from(first: int, count: int, concurrency: int = 50) -> None:
        for start in range(first, first + count, concurrency):
            await asyncio.gather(
                *(one_trial(i) for i in range(start, min(start + concurrency, first + count)))
            )

    before = exposed(P)
    await trials_from(0, 100)
    early = exposed(P)
    await trials_from(100, trials - 100)
    after = exposed(P)

    assert delta(before, after, P + "trials_ended_total") == trials
    assert delta(before, after, P + "ingested_samples_total", api="datalog") == trials
    classes = {dict(labels)["actor_class"] for name, labels in after if name == P + "trial_return_bucket"}
    assert len(classes) <= MAX_ACTOR_CLASS_LABELS + 1
    assert OTHER_ACTOR_CLASS in classes
    other = delta(before, after, P + "trial_return_bucket", actor_class=OTHER_ACTOR_CLASS, le="+Inf")
    assert other >= trials - MAX_ACTOR_CLASS_LABELS
    # 1,400 more trials, each of a class of its own: not one series more.
    assert set(after) == set(early)


def test_returns_sum_each_actors_rewards_whoever_they_target() -> None:
    converter = DatalogConverter("t", "u", trial_params())

    def rewarded(tick: int, *rewards: tuple[str, float, float]) -> datalog_pb2.DatalogSample:
        sample = datalog_sample(tick)
        sample.rewards.extend(
            common_pb2.Reward(
                receiver_name=receiver,
                sources=[common_pb2.RewardSource(sender_name="env", value=value, confidence=confidence)],
            )
            for receiver, value, confidence in rewards
        )
        return sample

    # class1.* is alice and bob; * everyone. Two rewards to one actor in a sample: their
    # confidence-weighted mean, as stored.
    converter.convert_to_bytes(rewarded(0, ("class1.*", 1.0, 1.0)))
    converter.convert_to_bytes(rewarded(1, ("*", 2.0, 1.0), ("carol", 5.0, 3.0)))
    converter.convert_to_bytes(rewarded(2))
    assert converter.returns == pytest.approx([3.0, 3.0, 2.0 * 0.25 + 5.0 * 0.75])
