"""Trial Datastore behaviour over real gRPC, on SQLite and on PostgreSQL."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from google.protobuf import any_pb2

from shared.api import common_pb2, datalog_pb2
from shared.api import environment_pb2 as env
from shared.api import trial_datastore_pb2 as ds
from shared.validation import MAX_PROPERTIES
from tests.helpers.datastore import (
    add_trial,
    datalog_inputs,
    datalog_sample,
    full_trial,
    list_trials,
    read_samples,
    run_datalog,
    trial_params,
)
from tests.helpers.running import DatastoreFactory, RunningDatastore, make_datastore_factory

F = ds.StoredTrialSampleField


# ---- ingestion ----


async def test_datalog_acknowledges_every_message_and_stores_the_conversion(
    datastore: RunningDatastore,
) -> None:
    acks = await run_datalog(
        datastore, "t1", [*full_trial(3)[:2], datalog_sample(2, common_pb2.ENDED, reward=2.5)]
    )
    assert acks == 4  # the parameters and three samples
    stored = await read_samples(datastore, ["t1"])
    assert [s.tick_id for s in stored] == [0, 1, 2]
    assert all(s.trial_id == "t1" and s.user_id == "the-user" for s in stored)
    last = stored[-1]
    assert last.state == common_pb2.ENDED and last.timestamp == 1002
    assert [a.actor for a in last.actor_samples] == [0, 1, 2]
    # Observations stored once, shared through the actors map.
    assert last.payloads[last.actor_samples[1].observation] == b"shared"
    assert last.actor_samples[1].observation == last.actor_samples[2].observation
    assert last.payloads[last.actor_samples[0].action] == b"act-2-0"
    bob = last.actor_samples[1]
    assert bob.reward == pytest.approx(2.5)
    assert bob.received_rewards[0].sender == 0
    assert last.payloads[bob.received_rewards[0].user_data] == b"why"
    assert last.actor_samples[0].sent_rewards[0].receiver == 1

    [info] = (await list_trials(datastore)).trial_infos
    assert info.trial_id == "t1" and info.user_id == "the-user"
    assert info.last_state == common_pb2.ENDED and info.samples_count == 3
    assert info.params == trial_params()


async def test_log_exporter_replies_once_everything_is_stored(datastore: RunningDatastore) -> None:
    requests = [
        datalog_pb2.LogExporterSampleRequest(trial_params=trial_params()),
        *(datalog_pb2.LogExporterSampleRequest(sample=s) for s in full_trial(5)),
    ]
    await datastore.log_exporter.RunTrialDatalog(iter(requests), metadata=(("trial-id", "exported"),))
    [info] = (await list_trials(datastore, trial_ids=["exported"])).trial_infos
    assert info.samples_count == 5 and info.last_state == common_pb2.ENDED
    # No user-id header: the reference's user id for the trial, none for the samples.
    assert info.user_id == "log exporter server"
    assert [s.user_id for s in await read_samples(datastore, ["exported"])] == [""] * 5


async def test_out_of_sync_samples_are_kept_and_never_change_the_state(datastore: RunningDatastore) -> None:
    samples = [
        datalog_sample(0),
        datalog_sample(1, common_pb2.ENDED),
        datalog_sample(0, common_pb2.UNKNOWN, out_of_sync=True, reward=1.0),
    ]
    await run_datalog(datastore, "late", samples)
    [info] = (await list_trials(datastore)).trial_infos
    assert info.last_state == common_pb2.ENDED and info.samples_count == 3
    stored = await read_samples(datastore, ["late"])
    assert [(s.tick_id, s.state) for s in stored] == [(0, common_pb2.RUNNING), (1, common_pb2.ENDED), (0, 0)]
    # The late reward is its own row; the first tick's observations are still there.
    assert stored[0].actor_samples[0].HasField("observation")
    assert stored[2].actor_samples[1].reward == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("messages", "fragment"),
    [
        ([datalog_pb2.RunTrialDatalogInput(sample=datalog_sample(0))], "initial message"),
        (
            datalog_inputs(trial_params(), [datalog_pb2.DatalogSample(observations=env.ObservationSet())]),
            "info",
        ),
        (
            datalog_inputs(
                trial_params(),
                [
                    datalog_pb2.DatalogSample(
                        info=datalog_pb2.SampleInfo(), observations=env.ObservationSet(actors_map=[3])
                    )
                ],
            ),
            "actors_map",
        ),
        (
            [
                datalog_pb2.RunTrialDatalogInput(trial_params=trial_params()),
                datalog_pb2.RunTrialDatalogInput(trial_params=trial_params()),
            ],
            "body message",
        ),
    ],
)
async def test_bad_datalog_messages_are_invalid_arguments(
    datastore: RunningDatastore, messages: list[datalog_pb2.RunTrialDatalogInput], fragment: str
) -> None:
    call = datastore.datalog.RunTrialDatalog(iter(messages), metadata=(("trial-id", "bad"),))
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        async for _ in call:
            pass
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert fragment in (raised.value.details() or "")


async def test_datalog_without_trial_id_is_rejected(datastore: RunningDatastore) -> None:
    call = datastore.datalog.RunTrialDatalog(iter(datalog_inputs(trial_params(), [])))
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        async for _ in call:
            pass
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "trial-id" in (raised.value.details() or "")


async def test_samples_acknowledged_before_a_bad_one_are_stored(datastore: RunningDatastore) -> None:
    bad = datalog_pb2.DatalogSample()  # no info
    call = datastore.datalog.RunTrialDatalog(
        iter(datalog_inputs(trial_params(), [datalog_sample(0), datalog_sample(1), bad])),
        metadata=(("trial-id", "partial"),),
    )
    acks = 0
    with pytest.raises(grpc.aio.AioRpcError):
        async for _ in call:
            acks += 1
    [info] = (await list_trials(datastore)).trial_infos
    assert acks == 3 and info.samples_count == 2
    # The stream closed: readers get what is there and end, the trial being interrupted.
    assert [s.tick_id for s in await read_samples(datastore, ["partial"])] == [0, 1]


# ---- AddTrial, AddSample, DeleteTrials ----


async def test_add_trial_needs_exactly_one_trial_id(datastore: RunningDatastore) -> None:
    for metadata in [(), (("trial-id", "a"), ("trial-id", "b")), (("trial-id", ""),)]:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await datastore.stub.AddTrial(ds.AddTrialRequest(), metadata=metadata)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_add_trial_upserts_and_add_sample_appends(datastore: RunningDatastore) -> None:
    await add_trial(datastore, "manual", user_id="first", kind="a")
    await add_trial(datastore, "manual", user_id="second", kind="b")
    samples = [
        ds.AddSampleRequest(
            trial_sample=ds.StoredTrialSample(tick_id=t, state=common_pb2.RUNNING, trial_id=tid)
        )
        for t, tid in [(0, ""), (1, "manual")]
    ]
    await datastore.stub.AddSample(iter(samples), metadata=(("trial-id", "manual"),))
    [info] = (await list_trials(datastore)).trial_infos
    assert info.user_id == "second" and info.params.properties == {"kind": "b"}
    assert info.samples_count == 2 and info.last_state == common_pb2.RUNNING
    assert (await list_trials(datastore, properties={"kind": "a"})).trial_infos == []


async def test_add_sample_checks_trial_and_ids(datastore: RunningDatastore) -> None:
    sample = ds.AddSampleRequest(trial_sample=ds.StoredTrialSample(tick_id=0))
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await datastore.stub.AddSample(iter([sample]), metadata=(("trial-id", "nope"),))
    assert raised.value.code() == grpc.StatusCode.NOT_FOUND
    await add_trial(datastore, "t")
    for request in [
        ds.AddSampleRequest(),
        ds.AddSampleRequest(trial_sample=ds.StoredTrialSample(trial_id="other")),
    ]:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await datastore.stub.AddSample(iter([request]), metadata=(("trial-id", "t"),))
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_delete_trials_and_create_again(datastore: RunningDatastore) -> None:
    for trial_id in ["a", "b", "c"]:
        await run_datalog(datastore, trial_id, full_trial(2))
    await datastore.stub.DeleteTrials(ds.DeleteTrialsRequest(trial_ids=["a", "c", "unknown"]))
    reply = await list_trials(datastore)
    assert [i.trial_id for i in reply.trial_infos] == ["b"]
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await read_samples(datastore, ["a"])
    assert raised.value.code() == grpc.StatusCode.NOT_FOUND
    await run_datalog(datastore, "a", full_trial(1))
    reply = await list_trials(datastore)
    assert [(i.trial_id, i.samples_count) for i in reply.trial_infos] == [("b", 2), ("a", 1)]


# ---- RetrieveTrials ----


async def test_trials_page_in_creation_order(datastore: RunningDatastore) -> None:
    for index in range(10):
        await add_trial(datastore, f"trial-{index}", parity=str(index % 2))
    first = await list_trials(datastore, trials_count=5)
    assert [i.trial_id for i in first.trial_infos] == [f"trial-{i}" for i in range(5)]
    assert first.next_trial_handle == "5"
    second = await list_trials(datastore, trials_count=5, trial_handle=first.next_trial_handle)
    assert [i.trial_id for i in second.trial_infos] == [f"trial-{i}" for i in range(5, 10)]
    assert second.next_trial_handle == "10"
    assert (await list_trials(datastore, trial_handle="10")).trial_infos == []
    assert (await list_trials(datastore, trial_handle="10")).next_trial_handle == "10"
    # Requested ids come back in creation order.
    chosen = await list_trials(datastore, trial_ids=["trial-7", "trial-2", "missing", "trial-4"])
    assert [i.trial_id for i in chosen.trial_infos] == ["trial-2", "trial-4", "trial-7"]
    odd = await list_trials(datastore, properties={"parity": "1"}, trials_count=3)
    assert [i.trial_id for i in odd.trial_infos] == ["trial-1", "trial-3", "trial-5"]
    assert odd.next_trial_handle == "6"
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await list_trials(datastore, trial_handle="x")
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_trials_selected_by_properties_up_to_the_limit(datastore: RunningDatastore) -> None:
    full = {f"p{index}": f"v{index}" for index in range(MAX_PROPERTIES)}
    await add_trial(datastore, "full", **full)
    await add_trial(datastore, "one-differs", **dict(full, p7="other"))
    one_missing = {name: value for name, value in full.items() if name != "p63"}
    await add_trial(datastore, "one-missing", **one_missing)

    async def selected(properties: dict[str, str]) -> list[str]:
        return [info.trial_id for info in (await list_trials(datastore, properties=properties)).trial_infos]

    assert await selected(full) == ["full"]
    assert await selected(dict(full, p7="other")) == ["one-differs"]
    without_p7_and_p63 = {name: value for name, value in full.items() if name not in ("p7", "p63")}
    assert await selected(without_p7_and_p63) == ["full", "one-differs", "one-missing"]


async def test_retrieve_trials_waits_for_trials_created_later(datastore: RunningDatastore) -> None:
    async def create_later() -> None:
        await asyncio.sleep(0.3)
        for index in range(3):
            await add_trial(datastore, f"later-{index}")

    started = time.monotonic()
    creating = asyncio.create_task(create_later())
    reply = await list_trials(datastore, trials_count=3, timeout=10_000)
    await creating
    assert [i.trial_id for i in reply.trial_infos] == ["later-0", "later-1", "later-2"]
    assert time.monotonic() - started < 5  # returned when the count was reached
    # Requested ids: returns as soon as they all exist, even with no count.
    started = time.monotonic()
    reply = await list_trials(datastore, trial_ids=["later-1", "later-2"], timeout=10_000)
    assert len(reply.trial_infos) == 2 and time.monotonic() - started < 2
    # Not there: what exists when the timeout runs out.
    reply = await list_trials(datastore, trial_ids=["later-0", "never"], timeout=300)
    assert [i.trial_id for i in reply.trial_infos] == ["later-0"]


# ---- RetrieveSamples ----


async def test_retrieve_samples_follows_a_live_trial_until_it_ends(datastore: RunningDatastore) -> None:
    await add_trial(datastore, "live")
    received: list[int] = []

    async def read() -> None:
        call = datastore.stub.RetrieveSamples(ds.RetrieveSamplesRequest(trial_ids=["live"]), timeout=30)
        async for reply in call:
            received.append(reply.trial_sample.tick_id)

    reader = asyncio.create_task(read())
    await asyncio.sleep(0.2)
    assert not reader.done()
    await run_datalog(datastore, "live", full_trial(50))
    await asyncio.wait_for(reader, 10)
    assert received == list(range(50))


async def test_concurrent_trials_and_readers(datastore: RunningDatastore) -> None:
    trial_ids = [f"c{index}" for index in range(4)]
    for trial_id in trial_ids:
        await add_trial(datastore, trial_id)
    readers = [asyncio.create_task(read_samples(datastore, trial_ids)) for _ in range(5)]
    await asyncio.sleep(0.1)
    await asyncio.gather(*(run_datalog(datastore, trial_id, full_trial(200)) for trial_id in trial_ids))
    for result in await asyncio.gather(*readers):
        assert len(result) == 800
        for trial_id in trial_ids:
            assert [s.tick_id for s in result if s.trial_id == trial_id] == list(range(200))


async def test_retrieve_samples_filters(datastore: RunningDatastore) -> None:
    await run_datalog(datastore, "f", [datalog_sample(0, common_pb2.ENDED, reward=1.0)])
    [everything] = await read_samples(datastore, ["f"])
    [by_class] = await read_samples(datastore, ["f"], actor_classes=["class2"])
    assert [a.actor for a in by_class.actor_samples] == [2]
    assert len(by_class.payloads) == len(everything.payloads)
    [by_impl] = await read_samples(
        datastore, ["f"], actor_implementations=["impl_a"], actor_names=["alice", "bob"]
    )
    assert [a.actor for a in by_impl.actor_samples] == [0]
    [observations] = await read_samples(
        datastore, ["f"], selected_sample_fields=[F.STORED_TRIAL_SAMPLE_FIELD_OBSERVATION]
    )
    bob = observations.actor_samples[1]
    assert bob.HasField("observation") and not bob.HasField("action") and not bob.HasField("reward")
    assert not bob.received_rewards
    assert b"why" not in observations.payloads and b"shared" in observations.payloads


async def test_retrieve_samples_errors_and_empty_request(datastore: RunningDatastore) -> None:
    assert await read_samples(datastore, []) == []
    await add_trial(datastore, "exists")
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await read_samples(datastore, ["exists", "missing"])
    assert raised.value.code() == grpc.StatusCode.NOT_FOUND
    assert "missing" in (raised.value.details() or "")


async def test_samples_survive_a_restart(datastore_factory: DatastoreFactory) -> None:
    async with datastore_factory() as first:
        await run_datalog(first, "durable", full_trial(20))
    async with datastore_factory() as second:
        assert [s.tick_id for s in await read_samples(second, ["durable"])] == list(range(20))


async def test_version_and_status(datastore: RunningDatastore) -> None:
    for service in ["TrialDatastoreSP", "DatalogSP", "LogExporterSP"]:
        status = datastore.channel.unary_unary(
            f"/cogmentAPI.{service}/Status",
            request_serializer=common_pb2.StatusRequest.SerializeToString,
            response_deserializer=common_pb2.StatusReply.FromString,
        )
        reply = await status(common_pb2.StatusRequest(names=["overall_load"]))
        assert 0 <= int(reply.statuses["overall_load"]) <= 255
    info = await datastore.stub.Version(common_pb2.VersionRequest())
    assert any(v.name == "cogment-api" for v in info.versions)


async def test_the_references_worked_reward_example(datastore: RunningDatastore) -> None:
    """docs/compatibility.md#datastore-conversion: wildcard receivers, confidence-weighted means, dropped
    names."""
    actors = [("myactor", "class1"), ("myactor2", "class1"), ("myactor3", "class2"), ("myactor4", "class2")]
    params = common_pb2.TrialParams(actors=[common_pb2.ActorParams(name=n, actor_class=c) for n, c in actors])

    def reward(receiver: str, value: float, confidence: float, user_data: bytes = b"") -> common_pb2.Reward:
        source = common_pb2.RewardSource(sender_name="env", value=value, confidence=confidence)
        if user_data:
            source.user_data.CopyFrom(any_pb2.Any(value=user_data))
        return common_pb2.Reward(receiver_name=receiver, sources=[source])

    sample = datalog_pb2.DatalogSample(
        info=datalog_pb2.SampleInfo(tick_id=0, state=common_pb2.ENDED),
        rewards=[
            reward("*", 12, 1, b"details"),
            reward("myactor", 24, 0.5),
            reward("*.*", 24, 0.5),
            reward("class2.*", 6, 1),
            reward("class2.myactor4", 60, 0.5),
            reward("", 100, 1),
            reward("class1", 100, 1),
        ],
    )
    await run_datalog(datastore, "rewards", [sample], params=params)
    [stored] = await read_samples(datastore, ["rewards"])
    assert [round(a.reward, 4) for a in stored.actor_samples] == [18, 16, 12, 20]
    first = stored.actor_samples[0]
    assert [r.reward for r in first.received_rewards] == [12, 24, 24]
    assert all(r.sender == -1 for r in first.received_rewards)  # the environment
    assert stored.payloads[first.received_rewards[0].user_data] == b"details"
    assert not first.received_rewards[1].HasField("user_data")
    assert not any(a.sent_rewards for a in stored.actor_samples)


async def test_live_readers_follow_a_trial_ingested_through_another_replica(postgres_url: str) -> None:
    factory = make_datastore_factory(postgres_url)
    async with factory() as writer, factory() as reader:
        await add_trial(writer, "shared")
        received: list[float] = []

        async def read() -> None:
            call = reader.stub.RetrieveSamples(ds.RetrieveSamplesRequest(trial_ids=["shared"]), timeout=30)
            async for _ in call:
                received.append(time.monotonic())

        reading = asyncio.create_task(read())
        await asyncio.sleep(0.3)
        sent_at = time.monotonic()
        await run_datalog(writer, "shared", full_trial(1))
        await asyncio.wait_for(reading, 10)
        assert len(received) == 1 and received[0] - sent_at < 1.0
        # And a RetrieveTrials waiting on one replica sees a trial created through the other.
        waiting = asyncio.create_task(list_trials(reader, trial_ids=["newcomer"], timeout=10_000))
        await asyncio.sleep(0.3)
        created_at = time.monotonic()
        await add_trial(writer, "newcomer")
        reply = await asyncio.wait_for(waiting, 10)
        assert [i.trial_id for i in reply.trial_infos] == ["newcomer"]
        assert time.monotonic() - created_at < 1.0


async def test_ingestion_through_two_replicas_keeps_each_trials_order(postgres_url: str) -> None:
    factory = make_datastore_factory(postgres_url)
    async with factory() as first, factory() as second:
        trial_ids = [f"r{index}" for index in range(6)]
        await asyncio.gather(
            *(
                run_datalog(first if index % 2 else second, trial_id, full_trial(100))
                for index, trial_id in enumerate(trial_ids)
            )
        )
        stored = await read_samples(first, trial_ids)
        for trial_id in trial_ids:
            assert [s.tick_id for s in stored if s.trial_id == trial_id] == list(range(100))
        reply = await list_trials(second)
        assert sorted(i.trial_id for i in reply.trial_infos) == sorted(trial_ids)
        assert {i.samples_count for i in reply.trial_infos} == {100}


async def test_every_message_of_long_concurrent_streams_is_acknowledged(datastore: RunningDatastore) -> None:
    """Commits land while acknowledgements are being sent: none may be skipped or doubled."""
    counts = await asyncio.gather(*(run_datalog(datastore, f"long-{i}", full_trial(1500)) for i in range(4)))
    assert counts == [1501] * 4
    reply = await list_trials(datastore)
    assert {info.samples_count for info in reply.trial_infos} == {1500}


async def test_a_listing_too_large_for_one_reply_is_cut_with_a_next_handle(
    datastore: RunningDatastore,
) -> None:
    """Clients refuse replies over 4 MiB (the SDK among them): an unpaged RetrieveTrials is cut
    to fit, and its next handle leads to the rest."""
    for index in range(6):  # each under MAX_TRIAL_PARAMS_BYTES; six are over 4 MiB
        await add_trial(datastore, f"t{index}", blob="x" * (900 * 1024))
    seen: list[str] = []
    handle = ""
    while True:
        reply = await list_trials(datastore, trial_handle=handle)
        if not reply.trial_infos:
            break
        assert 0 < len(reply.trial_infos) < 6  # several replies: none over the client's limit
        seen += [info.trial_id for info in reply.trial_infos]
        handle = reply.next_trial_handle
    assert seen == [f"t{index}" for index in range(6)]


async def test_requests_over_a_limit_are_refused_naming_it(datastore: RunningDatastore) -> None:
    many = {f"p{index}": "v" for index in range(65)}
    cases = [
        (
            datastore.stub.AddTrial(
                ds.AddTrialRequest(trial_params=common_pb2.TrialParams(properties=many)),
                metadata=(("trial-id", "t"),),
            ),
            "MAX_PROPERTIES",
        ),
        (datastore.stub.RetrieveTrials(ds.RetrieveTrialsRequest(properties=many)), "MAX_PROPERTIES"),
        (
            datastore.stub.RetrieveTrials(ds.RetrieveTrialsRequest(trial_ids=["t"] * 10_001)),
            "MAX_LISTED_ITEMS",
        ),
        (datastore.stub.DeleteTrials(ds.DeleteTrialsRequest(trial_ids=["t"] * 10_001)), "MAX_LISTED_ITEMS"),
        (
            datastore.stub.AddTrial(
                ds.AddTrialRequest(
                    trial_params=common_pb2.TrialParams(properties={"big": "x" * 2 * 1024 * 1024})
                ),
                metadata=(("trial-id", "t"),),
            ),
            "MAX_PROPERTIES_BYTES",
        ),
    ]
    for call, limit in cases:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await call
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert limit in (refused.value.details() or ""), refused.value.details()
