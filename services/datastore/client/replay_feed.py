"""A replay buffer fed by a datastore: trials followed as they start (`RetrieveTrials`, waiting for
the next), each trial's samples as they are committed (`RetrieveSamples`), turned into the
selected actors' steps with the Parquet dataset's conventions (docs/training-data.md): one step
per actor and tick, a late reward added to the step of the tick it names, a trial's last step
terminal if it ended.

Feeds run on an event loop of their own in a thread of their own, so that the training loop's
`sample()` stays synchronous; a failure (the datastore away, a decoder raising) is handed to the
buffer, whose next call raises it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterable, AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar, cast

import grpc
import numpy as np

from services.datastore.client.api import DatastoreClient
from services.datastore.client.dataset import TickOrder, _late_rewards, _payload
from shared.api import common_pb2, trial_datastore_pb2
from shared.channel import ClientTls
from shared.client import DEFAULT_TIMEOUT_S, ClientError

if TYPE_CHECKING:
    from services.datastore.client.replay_buffer import ReplayBuffer

Decoder = Callable[[bytes], Any]
T = TypeVar("T")
# Samples turned into steps together at most: one `extend` per actor for all of them.
BATCH_SAMPLES = 256
# What a sample without an actor's sample gives it: no observation, no action, no reward.
_NO_ACTOR_SAMPLE = trial_datastore_pb2.StoredTrialActorSample()
# How long a sample streamed waits for others to be turned into steps with it: the lag it adds.
LINGER_S = 0.005
# Samples asked for per RetrieveSampleRange (the datastore answers up to 2 MiB of them).
RANGE_SAMPLES = 1000
# How long one RetrieveTrials waits for the next trial (the datastore answers as soon as one comes).
FOLLOW_WAIT_MS = 10_000
# Trials listed per page while looking for where the listing ends (or for backfill).
PAGE_TRIALS = 1000

_FEEDS_LOOP: asyncio.AbstractEventLoop | None = None
_FEEDS_LOOP_LOCK = threading.Lock()


def _feeds_loop() -> asyncio.AbstractEventLoop:
    """The event loop every feed of the process runs on, in a thread of its own, for the life of
    the process. One loop, never closed: gRPC's asyncio support keeps calling into each loop it
    served, and a loop closed under it prints "Event loop is closed" tracebacks."""
    global _FEEDS_LOOP
    with _FEEDS_LOOP_LOCK:
        if _FEEDS_LOOP is None:
            _FEEDS_LOOP = asyncio.new_event_loop()
            threading.Thread(target=_FEEDS_LOOP.run_forever, name="replay-feeds", daemon=True).start()
        return _FEEDS_LOOP


@dataclass(frozen=True)
class ActorSelection:
    classes: Sequence[str] = ()
    names: Sequence[str] = ()
    implementations: Sequence[str] = ()

    def __post_init__(self) -> None:
        for label, wanted in (
            ("actor_classes", self.classes),
            ("actor_names", self.names),
            ("actor_implementations", self.implementations),
        ):
            if isinstance(wanted, str):
                raise TypeError(f"{label}: a list of names, not the string {wanted!r}")

    def indices(self, params: common_pb2.TrialParams) -> list[int]:
        """The selected actors of a trial (every one when nothing is selected)."""
        return [
            index
            for index, actor in enumerate(params.actors)
            if (not self.classes or actor.actor_class in self.classes)
            and (not self.names or actor.name in self.names)
            and (not self.implementations or actor.implementation in self.implementations)
        ]


@dataclass
class _Column:
    """A column's decoder, and the zeros a step without a value gets once a value was decoded."""

    decode: Decoder | None
    blank: Any = None

    def values(self, raws: list[bytes | None]) -> list[Any]:
        if self.decode is None:
            return raws
        decoded = [None if raw is None else self.decode(raw) for raw in raws]
        if self.blank is None:
            first = next((value for value in decoded if value is not None), None)
            if first is None:
                if decoded:
                    raise ValueError("steps without a value came before any value: their shape is unknown")
                return decoded
            self.blank = np.zeros_like(np.asarray(first))
        return [self.blank if value is None else value for value in decoded]


@dataclass
class _TrialSteps:
    """One trial's samples turned into its selected actors' steps."""

    trial_id: str
    actors: list[int]
    last_state: int
    order: TickOrder = field(default_factory=TickOrder)
    positions: dict[int, int] = field(default_factory=dict)  # tick -> position in the episodes

    def add(
        self,
        buffer: ReplayBuffer,
        samples: Sequence[trial_datastore_pb2.StoredTrialSample],
        observations: _Column,
        actions: _Column,
    ) -> None:
        """Samples in stored order: one `extend` per actor for their new ticks (whose costs are
        per call more than per step), a late reward added to its step, still here or stored."""
        first = len(self.positions)
        raw_observations: dict[int, list[bytes | None]] = {index: [] for index in self.actors}
        raw_actions: dict[int, list[bytes | None]] = {index: [] for index in self.actors}
        rewards: dict[int, list[float]] = {index: [] for index in self.actors}
        for sample in samples:
            if self.order.is_late(sample):
                position = self.positions.get(sample.tick_id)
                for index, reward, _ in _late_rewards(sample):
                    if position is None or reward is None or index not in rewards:
                        continue
                    if position >= first:
                        rewards[index][position - first] += reward
                    else:
                        buffer.add_late_reward((self.trial_id, index), position, reward)
                continue
            self.positions[sample.tick_id] = len(self.positions)
            self.last_state = sample.state
            by_index = {actor.actor: actor for actor in sample.actor_samples}
            for index in self.actors:
                actor = by_index.get(index, _NO_ACTOR_SAMPLE)
                raw_observations[index].append(
                    _payload(sample, actor.observation) if actor.HasField("observation") else None
                )
                raw_actions[index].append(
                    _payload(sample, actor.action) if actor.HasField("action") else None
                )
                rewards[index].append(actor.reward if actor.HasField("reward") else 0.0)
        if len(self.positions) == first:
            return
        for index in self.actors:
            # (The feed waited for room before the samples: their steps go in together.)
            buffer.extend(
                (self.trial_id, index),
                observations.values(raw_observations[index]),
                actions.values(raw_actions[index]),
                rewards[index],
                ended=self.last_state == common_pb2.ENDED,
                wait=False,
            )

    def finish(self, buffer: ReplayBuffer) -> None:
        """The trial's samples are all in: its last step is terminal if it ended."""
        for index in self.actors:
            buffer.finish((self.trial_id, index), ended=self.last_state == common_pb2.ENDED)


class _End:
    """What `_batches`' reader leaves last: the replies ended, or failed with `error`."""

    def __init__(self, error: BaseException | None) -> None:
        self.error = error


async def _batches(replies: AsyncIterable[T], most: int, linger_s: float) -> AsyncIterator[list[T]]:
    """`replies` in lists: those that came within `linger_s` of the first of each (`most` at
    most, and held), so that the consumer's costs per call are shared by many replies. (A
    stream's replies come one read at a time: while the consumer works, none come.)"""
    queue: asyncio.Queue[T | _End] = asyncio.Queue(most)

    async def read() -> None:
        try:
            async for reply in replies:
                await queue.put(reply)
        except Exception as error:
            await queue.put(_End(error))
        else:
            await queue.put(_End(None))

    reader = asyncio.create_task(read())
    try:
        while True:
            batch = [await queue.get()]
            if not isinstance(batch[0], _End):
                await asyncio.sleep(linger_s)
            while len(batch) < most and not queue.empty() and not isinstance(batch[-1], _End):
                batch.append(queue.get_nowait())
            last = batch[-1]
            end = last if isinstance(last, _End) else None
            if end is not None:
                batch.pop()
            if batch:
                yield cast(list[T], batch)
            if end is not None:
                if end.error is not None:
                    raise end.error
                return
    finally:
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)


class DatastoreFeed:
    """Feeds `buffer` from the datastore at `endpoint`, on the feeds' event loop, until `stop`."""

    def __init__(
        self,
        buffer: ReplayBuffer,
        endpoint: str,
        *,
        actors: ActorSelection,
        trial_properties: Mapping[str, str] | None = None,
        backfill: bool = False,
        decode_observation: Decoder | None = None,
        decode_action: Decoder | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        tls: ClientTls | None = None,
    ) -> None:
        self._buffer = buffer
        self._endpoint = endpoint
        self._actors = actors
        self._properties = dict(trial_properties or {})
        self._backfill = backfill
        self._observations = _Column(decode_observation)
        self._actions = _Column(decode_action)
        self._timeout_s = timeout_s
        self._tls = tls
        self._started = threading.Event()
        self._stopped = threading.Event()
        self._main: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Once the trials to follow are known: every trial created from now on is fed."""
        loop = _feeds_loop()
        loop.call_soon_threadsafe(self._create)
        self._started.wait()

    def stop(self) -> None:
        main = self._main
        if main is not None:
            main.get_loop().call_soon_threadsafe(main.cancel)
            self._stopped.wait()

    def _create(self) -> None:
        self._main = asyncio.get_running_loop().create_task(self._feed(), name="replay-feed")
        self._main.add_done_callback(self._ended)

    def _ended(self, _: asyncio.Task[None]) -> None:
        self._started.set()  # (a feed that failed before it started: its failure is the buffer's)
        self._stopped.set()

    async def _feed(self) -> None:
        trials: set[asyncio.Task[None]] = set()
        try:
            async with DatastoreClient(self._endpoint, self._timeout_s, self._tls) as client:
                handle, backlog, closed = await self._start(client)
                self._started.set()
                for info in backlog:
                    self._follow(trials, client, info, closed=info.trial_id in closed)
                while True:
                    reply = await client.stub.RetrieveTrials(
                        trial_datastore_pb2.RetrieveTrialsRequest(
                            trials_count=1,
                            trial_handle=handle,
                            timeout=FOLLOW_WAIT_MS,
                            properties=self._properties,
                        ),
                        timeout=FOLLOW_WAIT_MS / 1000 + self._timeout_s,
                    )
                    handle = reply.next_trial_handle or handle
                    for info in reply.trial_infos:
                        self._follow(trials, client, info)
        except asyncio.CancelledError:
            raise
        except Exception as error:
            self._failed(error)
        finally:
            for task in trials:
                task.cancel()
            await asyncio.gather(*trials, return_exceptions=True)

    def _follow(
        self,
        trials: set[asyncio.Task[None]],
        client: DatastoreClient,
        info: trial_datastore_pb2.StoredTrialInfo,
        *,
        closed: bool = False,
    ) -> None:
        task = asyncio.create_task(self._trial(client, info, closed), name=f"replay-{info.trial_id}")
        trials.add(task)
        task.add_done_callback(trials.discard)
        task.add_done_callback(self._trial_done)

    def _trial_done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and (error := task.exception()) is not None:
            self._failed(error)
            if self._main is not None:
                self._main.cancel()  # the buffer has failed: nothing more is fed

    def _failed(self, error: BaseException) -> None:
        """The training loop hears of it at its next call: the datastore away, a decoder raising."""
        if isinstance(error, grpc.aio.AioRpcError):
            error = ClientError(f"the replay feed stopped: {error.code().name}: {error.details()}")
        self._buffer.fail(error)

    async def _start(
        self, client: DatastoreClient
    ) -> tuple[str, list[trial_datastore_pb2.StoredTrialInfo], set[str]]:
        """Where the listing ends (trials created after it are followed); the trials to
        backfill: the latest stored ones whose selected actors' steps fill the capacity (read
        together: when they overshoot it, the oldest steps of each leave first); and which of
        those are closed (no sample is coming: they can be read in ranges)."""
        handle = ""
        listed: list[trial_datastore_pb2.StoredTrialInfo] = []
        while True:
            reply = await client.list_trials(PAGE_TRIALS, handle, self._properties)
            listed.extend(reply.trial_infos if self._backfill else [])
            handle = reply.next_trial_handle or handle
            if len(reply.trial_infos) < PAGE_TRIALS:
                break
        backlog: list[trial_datastore_pb2.StoredTrialInfo] = []
        steps = 0
        for info in reversed(listed):
            if steps >= self._buffer.capacity:
                break
            backlog.append(info)
            steps += info.samples_count * len(self._actors.indices(info.params))
        statuses = await client.trial_statuses([info.trial_id for info in backlog]) if backlog else None
        closed = {trial_id for trial_id, status in (statuses or {}).items() if status.closed}
        return handle, backlog[::-1], closed

    async def _trial(
        self, client: DatastoreClient, info: trial_datastore_pb2.StoredTrialInfo, closed: bool
    ) -> None:
        actors = self._actors.indices(info.params)
        if not actors:
            return
        trial = _TrialSteps(info.trial_id, actors, info.last_state)
        async for samples in self._samples(client, info.trial_id, closed):
            while samples:
                room = self._buffer.insert_room()
                if room == 0:  # waited for off the loop, which other feeds share
                    await asyncio.to_thread(self._buffer.wait_for_room)
                    room = self._buffer.insert_room()
                # Within the ratio's room: a sample's actors go in together, one sample at least.
                count = len(samples) if room is None else max(1, room // len(actors))
                trial.add(self._buffer, samples[:count], self._observations, self._actions)
                samples = samples[count:]
        trial.finish(self._buffer)

    async def _samples(
        self, client: DatastoreClient, trial_id: str, closed: bool
    ) -> AsyncIterator[Sequence[trial_datastore_pb2.StoredTrialSample]]:
        """The trial's samples in stored order, in lists. A closed trial's in ranges of up to
        `RANGE_SAMPLES` (`RetrieveSampleRange`: a reply costs about what one sample of a stream
        does); the others as they are committed (`RetrieveSamples`), and those of a datastore
        that serves no ranges (the reference's)."""
        if closed:
            first = 0
            while (reply := await client.sample_range(trial_id, first, RANGE_SAMPLES)) is not None:
                if reply.samples:
                    yield reply.samples
                first = reply.first + len(reply.samples)
                if not reply.samples or first >= reply.samples_count:
                    return
            # (None: the first call, since a datastore serves ranges or not.)
        call = client.stub.RetrieveSamples(trial_datastore_pb2.RetrieveSamplesRequest(trial_ids=[trial_id]))
        try:
            async for replies in _batches(call, BATCH_SAMPLES, LINGER_S):
                yield [reply.trial_sample for reply in replies]
        finally:
            call.cancel()
