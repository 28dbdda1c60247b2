"""A replay buffer fed live by a real datastore: trials followed as they start, transitions as
their samples are committed, the same ones `TrainingData` reads; backfill; failures surfaced."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from services.datastore.client import replay_buffer, replay_feed
from services.datastore.client.api import DatastoreClient
from services.datastore.client.replay_buffer import ReplayBuffer
from services.datastore.client.training import TrainingData
from shared.api import common_pb2, datalog_pb2, directory_pb2
from shared.client import ClientError
from tests.helpers.datastore import (
    datalog_inputs,
    datalog_sample,
    run_datalog,
    send_acknowledged,
    trial_params,
)
from tests.helpers.directory import register_ok
from tests.helpers.directory import request as register_request
from tests.helpers.fake_services import free_port
from tests.helpers.replay import directory_entries, endpoint, held_buffer
from tests.helpers.running import (
    DatastoreFactory,
    RunningDatastore,
    make_datastore_factory,
    make_directory_factory,
)

WAIT_S = 10.0


async def transitions(buffer: ReplayBuffer, count: int) -> None:
    """Until `buffer` holds `count` transitions."""
    deadline = time.monotonic() + WAIT_S
    while len(buffer) != count:
        assert time.monotonic() < deadline, f"not in time: {buffer.stats()}"
        await asyncio.sleep(0.02)


def by_observation(batch: dict[str, np.ndarray]) -> list[tuple[object, ...]]:
    return sorted(
        zip(
            batch["observations"].tolist(),
            batch["next_observations"].tolist(),
            batch["actions"].tolist(),
            np.round(batch["rewards"], 4).tolist(),
            batch["terminals"].tolist(),
            batch["timeouts"].tolist(),
            strict=True,
        )
    )


@pytest.mark.parametrize("served", ["waiting ranges", "ranges without waits", "no ranges"])
async def test_trials_are_followed_as_they_run(
    datastore: RunningDatastore, monkeypatch: pytest.MonkeyPatch, served: str
) -> None:
    """Read by ranges the datastore answers as samples come; from an earlier release, whose
    ranges do not wait, and from the reference datastore, which serves no ranges, by streams."""
    read_range = DatastoreClient.sample_range

    async def as_served(client: DatastoreClient, *args: Any, wait_ms: int = 0) -> Any:
        if served == "no ranges":
            return None
        reply = await read_range(client, *args, wait_ms=wait_ms if served == "waiting ranges" else 0)
        if served == "ranges without waits":
            reply.ClearField("finished")  # which an earlier release does not know
        return reply

    streams: list[object] = []
    batches = replay_feed._batches

    def counted_batches(replies: Any, most: int, linger_s: float) -> Any:
        streams.append(replies)
        return batches(replies, most, linger_s)

    monkeypatch.setattr(DatastoreClient, "sample_range", as_served)
    monkeypatch.setattr(replay_feed, "_batches", counted_batches)
    await run_datalog(datastore, "before", [datalog_sample(0), datalog_sample(1, common_pb2.ENDED)])
    buffer = await asyncio.to_thread(
        ReplayBuffer.from_datastore,
        endpoint(datastore),
        capacity=1000,
        actor_names=["alice", "bob"],
        decode_observation=bytes.decode,
        sampler="fifo",
    )
    try:
        live = datastore.datalog.RunTrialDatalog(metadata=(("trial-id", "live"),))
        inputs = datalog_inputs(
            trial_params(), [datalog_sample(tick, reward=0.5 + tick) for tick in range(3)]
        )
        await send_acknowledged(live, inputs)  # ticks 0 to 2: two transitions per actor
        await transitions(buffer, 4)
        # A late reward for tick 1, then the end: the trial's last transitions are terminal.
        late = [datalog_sample(1, out_of_sync=True, reward=7.0), datalog_sample(3, common_pb2.ENDED)]
        await send_acknowledged(live, datalog_inputs(trial_params(), late)[1:])
        await live.done_writing()
        await transitions(buffer, 6)
        got = await asyncio.to_thread(buffer.sample, 6)
        data = await asyncio.to_thread(
            TrainingData.from_datastore,
            endpoint(datastore),
            ["live"],
            actor_names=["alice", "bob"],
            decode_observation=bytes.decode,
        )
        assert by_observation(got) == by_observation(data.d4rl())  # "before" was not followed
        # The trial's stream ends once the datastore has sent it all: its episodes are over.
        deadline = time.monotonic() + WAIT_S
        while buffer.stats()["live_episodes"]:
            assert time.monotonic() < deadline, buffer.stats()
            await asyncio.sleep(0.02)
        assert len(streams) == (0 if served == "waiting ranges" else 1)
    finally:
        await asyncio.to_thread(buffer.close)


async def test_backfill_loads_the_latest_stored_trials(datastore: RunningDatastore) -> None:
    for trial in range(3):
        await run_datalog(datastore, f"t{trial}", [datalog_sample(tick) for tick in range(4)])
    # Room for the steps of about two trials (2 actors x 4 ticks each): the latest two.
    buffer = await asyncio.to_thread(
        ReplayBuffer.from_datastore,
        endpoint(datastore),
        capacity=16,
        actor_names=["alice", "bob"],
        backfill=True,
        decode_observation=bytes.decode,
        sampler="fifo",
    )
    try:
        await transitions(buffer, 12)
        assert buffer.stats()["steps"] == 16
    finally:
        await asyncio.to_thread(buffer.close)


async def test_backfill_reads_closed_trials_in_ranges_as_training_data_reads_them(
    datastore: RunningDatastore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ranges of 3 samples: late rewards fold into steps of an earlier range, of the same one, of
    a step not stored yet; an ended trial's last transitions are terminal, an interrupted one's
    timeouts; and the reads were ranges, not streams."""
    monkeypatch.setattr(replay_feed, "RANGE_SAMPLES", 3)
    ranges: list[str] = []
    read_range = DatastoreClient.sample_range

    async def counted(client: DatastoreClient, trial_id: str, *args: Any, **kwargs: Any) -> Any:
        ranges.append(trial_id)
        return await read_range(client, trial_id, *args, **kwargs)

    monkeypatch.setattr(DatastoreClient, "sample_range", counted)
    ticks = [datalog_sample(tick, reward=float(tick)) for tick in range(6)]
    late = [datalog_sample(tick, out_of_sync=True, reward=10.0 * tick) for tick in (0, 5, 4)]
    await run_datalog(
        datastore, "ended", [*ticks[:3], late[0], *ticks[3:], *late[1:], datalog_sample(6, common_pb2.ENDED)]
    )
    await run_datalog(datastore, "interrupted", [*ticks[:5], late[2]])
    buffer = await asyncio.to_thread(
        ReplayBuffer.from_datastore,
        endpoint(datastore),
        capacity=1000,
        actor_names=["alice", "bob"],
        backfill=True,
        decode_observation=bytes.decode,
        sampler="fifo",
    )
    try:
        await transitions(buffer, 2 * 6 + 2 * 4)
        got = await asyncio.to_thread(buffer.sample, 20)
        data = await asyncio.to_thread(
            TrainingData.from_datastore,
            endpoint(datastore),
            ["ended", "interrupted"],
            actor_names=["alice", "bob"],
            decode_observation=bytes.decode,
        )
        assert by_observation(got) == by_observation(data.d4rl())
        assert got["terminals"].sum() == 2 and got["timeouts"].sum() == 2
        assert set(ranges) == {"ended", "interrupted"} and len(ranges) == 4 + 2  # 10 and 6 samples
    finally:
        await asyncio.to_thread(buffer.close)


async def test_batches_gather_what_comes_within_the_linger_in_order_and_raise_failures() -> None:
    async def replies(count: int, failure: Exception | None = None) -> AsyncIterator[int]:
        for reply in range(count):
            yield reply
        if failure is not None:
            raise failure

    got = []
    async for batch in replay_feed._batches(replies(10), 4, 0.01):
        got.append(batch)  # those that came within 10 ms: all there are, four at most
    assert got == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    before_failure = []
    with pytest.raises(ValueError, match="gone"):
        async for batch in replay_feed._batches(replies(3, ValueError("gone")), 4, 0.0):
            before_failure.extend(batch)
    assert before_failure == [0, 1, 2]


async def test_a_datastore_that_cannot_be_reached_fails_the_next_sample() -> None:
    buffer = await asyncio.to_thread(
        ReplayBuffer.from_datastore, f"grpc://127.0.0.1:{free_port()}", capacity=10
    )
    try:
        with pytest.raises(ClientError):
            await asyncio.to_thread(buffer.sample, 1, 10.0)
    finally:
        await asyncio.to_thread(buffer.close)


async def test_a_buffer_following_one_replica_gets_every_transition_another_ingests_once(
    postgres_url: str,
) -> None:
    """Two replicas on one PostgreSQL: trials run through the first while the buffer follows the
    second (the change feed carries their commits across); every transition arrives once."""
    start = make_datastore_factory(postgres_url)
    async with start() as ingesting, start() as followed:
        buffer = await asyncio.to_thread(
            ReplayBuffer.from_datastore, endpoint(followed), capacity=10_000, sampler="fifo"
        )
        try:

            async def trial(number: int) -> None:
                call = ingesting.datalog.RunTrialDatalog(metadata=(("trial-id", f"r{number}"),))
                ticks = [datalog_sample(tick) for tick in range(20)] + [datalog_sample(20, common_pb2.ENDED)]
                await send_acknowledged(call, datalog_inputs(trial_params(), ticks))
                await call.done_writing()

            await asyncio.gather(*map(trial, range(6)))
            # 6 trials x 3 actors x 20 transitions, every one once.
            await transitions(buffer, 360)
            batch = await asyncio.to_thread(buffer.sample, 360)
            assert batch["terminals"].sum() == 18 and not batch["timeouts"].any()
            # Each tick's action of each actor, once per trial.
            expected = Counter(
                {f"act-{tick}-{actor}".encode(): 6 for tick in range(20) for actor in range(3)}
            )
            assert Counter(batch["actions"].tolist()) == expected
            assert len(buffer) == 0  # a FIFO gives each once
        finally:
            await asyncio.to_thread(buffer.close)


async def test_a_buffer_held_back_by_its_ratio_holds_no_other_back(datastore: RunningDatastore) -> None:
    """Feeds share one event loop: the held one waits for room off it."""
    held = await held_buffer(datastore)
    free = await asyncio.to_thread(ReplayBuffer.from_datastore, endpoint(datastore), capacity=1000)
    try:
        await run_datalog(datastore, "t", [datalog_sample(tick) for tick in range(20)])
        await transitions(free, 3 * 19)
        assert len(held) < 10 and held.stats()["inserts"] < 10  # nobody samples it
        later = await asyncio.to_thread(ReplayBuffer.from_datastore, endpoint(datastore), capacity=10)
        await asyncio.to_thread(later.close)  # starting and stopping a feed are not held either
    finally:
        await asyncio.to_thread(held.close)
        await asyncio.to_thread(free.close)


async def test_replicas_found_through_the_directory_are_followed_and_a_read_fails_over(
    postgres_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two replicas on one PostgreSQL: the buffer finds the first through the directory, then the
    second once it is listed; the replica it reads a live trial from stops mid-trial, and the
    read goes on from the other where it stopped: every transition once."""
    monkeypatch.setattr(replay_buffer, "DISCOVERY_REFRESH_S", 0.2)
    start = make_datastore_factory(postgres_url)
    directory_start = make_directory_factory(f"sqlite+aiosqlite:///{tmp_path / 'directory.db'}")
    async with directory_start("--health_check_interval", "0.2") as directory, start() as ingesting:
        registered = (
            "--directory_endpoint",
            f"grpc://{directory.address}",
            "--directory_registration_host",
            "127.0.0.1",
        )
        first = start(*registered, "--shutdown_grace", "0.2")
        await first.__aenter__()
        try:
            deadline = time.monotonic() + WAIT_S
            while not await directory_entries(directory):
                assert time.monotonic() < deadline, "the first replica never registered"
                await asyncio.sleep(0.05)
            buffer = await asyncio.to_thread(
                ReplayBuffer.from_datastore,
                "cogment://discover/datastore",
                directory=f"grpc://{directory.address}",
                capacity=1000,
                sampler="fifo",
                timeout_s=20,
            )
        except BaseException:
            await first.__aexit__(None, None, None)
            raise
        try:
            call = ingesting.datalog.RunTrialDatalog(metadata=(("trial-id", "moved"),))
            # Bob is given 1 at each tick: a sample read twice would count as a late reward.
            ticks = [datalog_sample(tick, reward=1.0) for tick in range(20)]
            inputs = datalog_inputs(trial_params(), [*ticks, datalog_sample(20, common_pb2.ENDED)])
            await send_acknowledged(call, inputs[:11])  # ticks 0 to 9, read from the first replica
            await transitions(buffer, 3 * 9)
            # The ingesting replica is listed too, and followed; then the first one stops.
            await register_ok(
                directory,
                register_request(
                    directory_pb2.DATASTORE_SERVICE,
                    host="127.0.0.1",
                    port=ingesting.service.port,
                    protocol=directory_pb2.ServiceEndpoint.GRPC,
                    permanent=True,
                ),
            )
            await asyncio.sleep(1.0)
            await first.__aexit__(None, None, None)
            await send_acknowledged(call, inputs[11:])
            await call.done_writing()
            await transitions(buffer, 3 * 20)
            batch = await asyncio.to_thread(buffer.sample, 60)
            assert batch["terminals"].sum() == 3 and batch["rewards"].sum() == 20
            assert Counter(batch["actions"].tolist()) == Counter(
                {f"act-{tick}-{actor}".encode(): 1 for tick in range(20) for actor in range(3)}
            )
        finally:
            await asyncio.to_thread(buffer.close)


async def test_a_datastore_away_longer_than_the_timeout_fails_the_next_sample(
    datastore_factory: DatastoreFactory,
) -> None:
    async with datastore_factory("--shutdown_grace", "0.2") as datastore:
        buffer = await asyncio.to_thread(
            ReplayBuffer.from_datastore, endpoint(datastore), capacity=100, timeout_s=1.0
        )
    try:  # the datastore has stopped: the follower tries again for a second, then gives up
        with pytest.raises(ClientError, match="the replay feed stopped: UNAVAILABLE"):
            await asyncio.to_thread(buffer.sample, 1, 10.0)
    finally:
        await asyncio.to_thread(buffer.close)


def test_bad_discovery_is_named() -> None:
    with pytest.raises(
        ValueError, match=r"directory: cogment://discover/datastore is found through a directory"
    ):
        ReplayBuffer.from_datastore("cogment://discover/datastore", capacity=10)
    with pytest.raises(ValueError, match=r"invalid discovery URL \[cogment://discover/actor\]"):
        ReplayBuffer.from_datastore("cogment://discover/actor", directory="grpc://127.0.0.1:1", capacity=10)


async def test_a_selection_that_matches_no_actor_says_so_when_a_sample_times_out(
    datastore: RunningDatastore,
) -> None:
    buffer = await asyncio.to_thread(
        ReplayBuffer.from_datastore, endpoint(datastore), capacity=100, actor_classes=["clas1"]
    )
    try:
        await run_datalog(datastore, "t", [datalog_sample(0), datalog_sample(1, common_pb2.ENDED)])
        with pytest.raises(
            TimeoutError,
            match=r"held the sample back \(min_size\) for 2.0 s: actor_classes=\['clas1'\] selects no actor "
            r"of trial t, whose actors are: alice \(class1, impl_a\), bob",
        ):
            await asyncio.to_thread(buffer.sample, 1, 2.0)
    finally:
        await asyncio.to_thread(buffer.close)


async def test_steps_without_a_value_wait_for_one_to_know_their_zeros(datastore: RunningDatastore) -> None:
    """A trial whose first ticks have no observation: its steps are held until one comes, then get
    zeros of its shape, as TrainingData gives them."""

    def tick_number(raw: bytes) -> np.ndarray:
        return np.array([float(raw.split(b"-")[1])], np.float32)

    def unobserved(tick: int) -> datalog_pb2.DatalogSample:
        sample = datalog_sample(tick)
        sample.ClearField("observations")
        return sample

    buffer = await asyncio.to_thread(
        ReplayBuffer.from_datastore,
        endpoint(datastore),
        capacity=100,
        actor_names=["alice"],
        decode_observation=tick_number,
        sampler="fifo",
    )
    try:
        call = datastore.datalog.RunTrialDatalog(metadata=(("trial-id", "blank"),))
        ticks = [
            *map(unobserved, range(3)),
            *map(datalog_sample, range(3, 6)),
            datalog_sample(6, common_pb2.ENDED),
        ]
        inputs = datalog_inputs(trial_params(), ticks)
        await send_acknowledged(call, inputs[:4])
        await asyncio.sleep(0.5)
        assert buffer.stats()["steps"] == 0  # held: the zeros' shape is not known yet
        await send_acknowledged(call, inputs[4:])
        await call.done_writing()
        await transitions(buffer, 6)
        got = await asyncio.to_thread(buffer.sample, 6)
        data = await asyncio.to_thread(
            TrainingData.from_datastore,
            endpoint(datastore),
            ["blank"],
            actor_names=["alice"],
            decode_observation=tick_number,
        )
        assert by_observation(got) == by_observation(data.d4rl())
        assert got["observations"].tolist().count([0.0]) == 3
    finally:
        await asyncio.to_thread(buffer.close)
