"""The live replay feed under faults and limits: replicas away at start or for a moment, a
directory that lists nothing for a while, buffers held by their ratio, a process that ends
without closing its buffer, and the memory of trials read."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from services.datastore.client import replay_feed
from services.datastore.client.replay_buffer import ReplayBuffer
from services.datastore.client.replay_feed import DatastoreFeed
from services.datastore.client.replay_steps import ActorSelection
from shared.api import common_pb2, datalog_pb2, directory_pb2
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
from tests.helpers.fault_proxy import FaultProxy
from tests.helpers.replay import directory_entries, endpoint, held_buffer
from tests.helpers.running import (
    RunningDatastore,
    make_datastore_factory,
    make_directory_factory,
)

WAIT_S = 10.0
ROOT = Path(__file__).resolve().parents[2]
ACTORS = 3  # trial_params(): alice, bob, carol


def ticks(count: int, *, ended: bool = True) -> list[datalog_pb2.DatalogSample]:
    samples = [datalog_sample(tick) for tick in range(count - 1)]
    return [*samples, datalog_sample(count - 1, common_pb2.ENDED if ended else common_pb2.RUNNING)]


async def until(condition: Callable[[], object], what: str, wait_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + wait_s
    while not condition():
        assert time.monotonic() < deadline, f"not in time: {what}"
        await asyncio.sleep(0.02)


async def fed(buffer: ReplayBuffer, count: int, wait_s: float = WAIT_S) -> None:
    """Until `buffer` (uniform, no ratio) holds `count` transitions; its feed's failure raised."""
    deadline = time.monotonic() + wait_s
    while len(buffer) < count:
        with contextlib.suppress(TimeoutError):
            await asyncio.to_thread(buffer.sample, 1, 0.0)  # raises the feed's failure, if any
        assert time.monotonic() < deadline, f"not in time: {buffer.stats()}"
        await asyncio.sleep(0.02)
    assert len(buffer) == count, buffer.stats()


def executor_threads() -> int:
    """Threads `asyncio.to_thread` has on the feeds' loop at most (its default executor's)."""
    executor = getattr(replay_feed._feeds_loop(), "_default_executor", None)
    if executor is not None:
        return int(executor._max_workers)
    return min(32, (os.cpu_count() or 1) + 4)


async def test_a_listed_replica_that_is_away_at_start_does_not_fail_the_buffer(
    datastore: RunningDatastore, tmp_path: Path
) -> None:
    """The directory lists two datastores, one of them gone (a permanent entry is not health
    checked): the buffer follows the one that answers."""
    directory_start = make_directory_factory(f"sqlite+aiosqlite:///{tmp_path / 'directory.db'}")
    async with directory_start() as directory:
        assert datastore.service.port is not None
        for replica, port in (("up", datastore.service.port), ("gone", free_port())):
            await register_ok(  # (a permanent entry of the same type and properties is replaced)
                directory,
                register_request(
                    directory_pb2.DATASTORE_SERVICE,
                    {"replica": replica},
                    host="127.0.0.1",
                    port=port,
                    protocol=directory_pb2.ServiceEndpoint.GRPC,
                    permanent=True,
                ),
            )
        buffer = await asyncio.to_thread(
            ReplayBuffer.from_datastore,
            "cogment://discover/datastore",
            directory=f"grpc://{directory.address}",
            capacity=1000,
            timeout_s=5.0,
        )
        try:
            await run_datalog(datastore, "t", ticks(4))
            assert len(await directory_entries(directory)) == 2
            await fed(buffer, ACTORS * 3)
        finally:
            await asyncio.to_thread(buffer.close)


async def test_a_buffer_held_by_its_ratio_does_not_take_the_threads_another_buffer_needs(
    datastore: RunningDatastore,
) -> None:
    """A held buffer's trials wait for room on the feeds' loop, not in its executor's threads:
    as many of them as it has threads hold no other buffer back."""
    held = await held_buffer(datastore)
    sampled: ReplayBuffer | None = None
    feed = held._feed
    assert feed is not None
    try:
        threads = executor_threads()
        for trial in range(threads):
            await run_datalog(datastore, f"h{trial}", ticks(4))
        # Each of its trials waits for room.
        await until(lambda: len(feed._trials) == threads, "the held buffer's trials are read")
        await asyncio.sleep(0.5)
        sampled = await held_buffer(datastore)
        await run_datalog(datastore, "s", ticks(20))  # 57 transitions: room for 57 samples
        for _ in range(20):
            await asyncio.to_thread(sampled.sample, 1, 5.0)  # TimeoutError after 3
    finally:
        await asyncio.to_thread(held.close)
        if sampled is not None:
            await asyncio.to_thread(sampled.close)


async def test_inserts_stay_within_the_error_buffer(datastore: RunningDatastore) -> None:
    """docs/training-data.md: `inserts * samples_per_insert - samples` stays within
    `samples_per_insert * min_size +- error_buffer`, with three trials waiting for the room one
    sample makes (a sample's actors wait for room for all of them)."""
    buffer = await asyncio.to_thread(
        ReplayBuffer.from_datastore,
        endpoint(datastore),
        capacity=1000,
        samples_per_insert=1.0,
        error_buffer=3.0,  # min_size 1: diff within [-2, 4], room for a sample's 3 actors
    )

    def diff() -> float:
        stats = buffer.stats()
        return float(stats["inserts"] - stats["samples"])

    try:
        for trial in range(3):
            await run_datalog(datastore, f"t{trial}", ticks(10))
        await until(lambda: diff() >= 2, "the feed held by the ratio")
        await asyncio.sleep(0.5)  # every trial waiting for room
        highest = diff()
        for _ in range(4):  # room for one sample's actors at most, shared by three trials
            await asyncio.to_thread(buffer.sample, 1, 5.0)
            await asyncio.sleep(0.5)
            highest = max(highest, diff())
        assert highest <= 4.0, buffer.stats()
    finally:
        await asyncio.to_thread(buffer.close)


async def test_a_datastore_back_between_two_short_outages_keeps_feeding(datastore: RunningDatastore) -> None:
    """Two outages 2 s apart, each shorter than `timeout_s`: the follower's long poll that
    reached the datastore between them counts as progress, and the feed goes on."""
    async with FaultProxy(datastore.service.port or 0, postgres=False) as proxy:
        buffer = await asyncio.to_thread(
            ReplayBuffer.from_datastore, f"grpc://127.0.0.1:{proxy.port}", capacity=1000, timeout_s=1.0
        )
        try:
            for _ in range(2):  # each outage lasts a moment; 2 s apart, the follower back between
                await until(lambda: proxy.connections > 0, "the feed is connected")
                proxy.cut()
                proxy.restore()
                await asyncio.sleep(2.0)
            await run_datalog(datastore, "after", ticks(4))
            await fed(buffer, ACTORS * 3)
        finally:
            await asyncio.to_thread(buffer.close)


async def test_trials_started_while_no_datastore_was_listed_are_read(datastore: RunningDatastore) -> None:
    """A directory that lists no datastore for a moment (a health check failed): the feed goes
    on following it, and reads the trials started meanwhile."""
    listed = [endpoint(datastore)]

    async def endpoints() -> list[str]:
        return list(listed)

    buffer = ReplayBuffer(1000)
    feed = DatastoreFeed(buffer, endpoints, refresh_s=0.05, actors=ActorSelection())
    buffer._feed = feed
    await asyncio.to_thread(feed.start)
    try:
        listed.clear()
        await asyncio.sleep(0.3)  # refreshed: no datastore listed
        await run_datalog(datastore, "gap", ticks(4))
        listed.append(endpoint(datastore))
        await asyncio.sleep(0.3)
        await run_datalog(datastore, "after", ticks(4))
        await fed(buffer, 2 * ACTORS * 3, wait_s=5.0)  # "gap" too
    finally:
        await asyncio.to_thread(buffer.close)


async def test_trials_read_are_not_remembered_for_ever(datastore: RunningDatastore) -> None:
    """A trial read and listed by every datastore followed is forgotten: a learner that runs for
    days following short trials keeps no id of them."""
    buffer = await asyncio.to_thread(ReplayBuffer.from_datastore, endpoint(datastore), capacity=10_000)
    feed = buffer._feed
    assert feed is not None
    try:
        for trial in range(20):
            await run_datalog(datastore, f"t{trial}", ticks(2))
        await fed(buffer, 20 * ACTORS)
        await until(lambda: not feed._trials, "every trial read")
        assert not feed._listed, f"{len(feed._listed)} ids of trials read kept"
    finally:
        await asyncio.to_thread(buffer.close)


async def test_a_trial_of_another_kind_first_does_not_fail_a_selection_later_trials_match(
    datastore: RunningDatastore,
) -> None:
    """A datastore shared with trials of another kind: the first trial having none of the
    selected actors is skipped, and the later ones are read."""
    buffer = await asyncio.to_thread(
        ReplayBuffer.from_datastore, endpoint(datastore), capacity=1000, actor_classes=["class1"]
    )
    other = trial_params()
    for actor in other.actors:
        actor.actor_class = "class9"
    try:
        await run_datalog(datastore, "other", ticks(4), params=other)
        await run_datalog(datastore, "mine", ticks(4), params=trial_params())
        await fed(buffer, 2 * 3)  # alice and bob of "mine"
    finally:
        await asyncio.to_thread(buffer.close)


async def test_a_read_from_a_replica_that_stops_answering_goes_on_from_another(
    postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replica that vanishes without closing its connections (a partition, a node lost): its
    follower gives it up (or the read's range runs out of time), and the read goes on from the
    other, after the samples already in."""
    monkeypatch.setattr(replay_feed, "FOLLOW_WAIT_MS", 500)
    start = make_datastore_factory(postgres_url)
    async with (
        start() as first,
        start() as second,
        FaultProxy(first.service.port or 0, postgres=False) as proxy,
    ):
        listed = [f"grpc://127.0.0.1:{proxy.port}"]

        async def endpoints() -> list[str]:
            return list(listed)

        buffer = ReplayBuffer(1000)
        feed = DatastoreFeed(buffer, endpoints, refresh_s=0.05, actors=ActorSelection(), timeout_s=1.0)
        buffer._feed = feed
        await asyncio.to_thread(feed.start)
        try:
            call = first.datalog.RunTrialDatalog(metadata=(("trial-id", "partitioned"),))
            # Bob is given 1 at each tick: a sample read twice would count as a late reward.
            samples = [datalog_sample(tick, reward=1.0) for tick in range(20)]
            inputs = datalog_inputs(trial_params(), [*samples, datalog_sample(20, common_pb2.ENDED)])
            await send_acknowledged(call, inputs[:11])  # ticks 0 to 9, read through the proxy
            await fed(buffer, ACTORS * 9)
            listed.append(endpoint(second))
            await until(lambda: endpoint(second) in feed._followers, "the second replica followed")
            proxy.blackhole()
            await send_acknowledged(call, inputs[11:])
            await call.done_writing()
            await fed(buffer, ACTORS * 20, wait_s=30.0)
            assert buffer._steps.column("reward").sum() == 20  # every step once (the others: 0)
            assert not buffer.stats()["live_episodes"]
        finally:
            await asyncio.to_thread(buffer.close)


async def test_a_read_idle_for_longer_than_the_timeout_rides_out_another_fault(
    datastore: RunningDatastore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A running trial's read answered (empty ranges, the trial idle) has reached its datastore:
    a fault long after an earlier one starts a new count, and the read goes on elsewhere."""
    monkeypatch.setattr(replay_feed, "FOLLOW_WAIT_MS", 500)
    monkeypatch.setattr(replay_feed, "RANGE_WAIT_MS", 500)
    port = datastore.service.port or 0
    async with FaultProxy(port, postgres=False) as one, FaultProxy(port, postgres=False) as other:
        proxies = {f"grpc://127.0.0.1:{proxy.port}": proxy for proxy in (one, other)}

        async def endpoints() -> list[str]:
            return list(proxies)

        buffer = ReplayBuffer(1000)
        feed = DatastoreFeed(buffer, endpoints, actors=ActorSelection(), timeout_s=2.0)
        buffer._feed = feed
        await asyncio.to_thread(feed.start)
        try:
            call = datastore.datalog.RunTrialDatalog(metadata=(("trial-id", "idle"),))
            inputs = datalog_inputs(trial_params(), ticks(5))
            await send_acknowledged(call, inputs[:4])  # ticks 0 to 2
            await fed(buffer, ACTORS * 2)

            def reading() -> str | None:
                return next((endpoint for endpoint, reads in feed._reads.items() if reads), None)

            first = reading()
            assert first is not None
            proxies[first].cut()  # the read fails (its next range at the latest), and goes on
            await until(lambda: reading() not in (None, first), "the read going on from the other")
            proxies[first].restore()  # (before its follower gives it up)
            await asyncio.sleep(5.0)  # the trial idle, for more than twice the timeout
            second = reading()
            assert second is not None and second != first
            proxies[second].blackhole()  # its next range runs out of time
            await asyncio.sleep(6.0)
            await send_acknowledged(call, inputs[4:])
            await call.done_writing()
            await fed(buffer, ACTORS * 4)
            await until(lambda: not buffer.stats()["live_episodes"], "the trial finished")
        finally:
            for proxy in proxies.values():
                proxy.restore()
            await asyncio.to_thread(buffer.close)


HELD_AT_EXIT = """
import sys, time
from services.datastore.client.replay_buffer import ReplayBuffer
buffer = ReplayBuffer.from_datastore(sys.argv[1], capacity=1000, samples_per_insert=1.0, error_buffer=1.0)
print("started", flush=True)
deadline = time.monotonic() + 10
while buffer.stats()["inserts"] < 2:  # then held by the ratio: nobody samples
    assert time.monotonic() < deadline, "nothing inserted"
    time.sleep(0.02)
time.sleep(0.5)
print("held", flush=True)
# The training loop ends (an exception, or no `close()`): the process should exit.
"""


async def test_a_process_with_a_held_buffer_not_closed_exits(datastore: RunningDatastore) -> None:
    """A training loop that ends without `close()` while its buffer is held by the ratio: the
    process exits (no thread waits for room)."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        HELD_AT_EXIT,
        endpoint(datastore),
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert process.stdout is not None
        assert await asyncio.wait_for(process.stdout.readline(), WAIT_S) == b"started\n"
        await run_datalog(datastore, "t", ticks(10))
        assert await asyncio.wait_for(process.stdout.readline(), WAIT_S) == b"held\n"
        try:
            code = await asyncio.wait_for(process.wait(), 10.0)
        except asyncio.TimeoutError:
            raise AssertionError("the process did not exit: its executor thread waits for room") from None
        assert code == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
