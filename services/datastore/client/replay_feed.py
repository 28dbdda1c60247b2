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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

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

    def value(self, raw: bytes | None) -> Any:
        if self.decode is None:
            return raw
        if raw is None:
            if self.blank is None:
                raise ValueError("a step without a value came before any value: its shape is unknown")
            return self.blank
        decoded = self.decode(raw)
        if self.blank is None:
            self.blank = np.zeros_like(np.asarray(decoded))
        return decoded


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
        sample: trial_datastore_pb2.StoredTrialSample,
        observations: _Column,
        actions: _Column,
    ) -> None:
        if self.order.is_late(sample):
            position = self.positions.get(sample.tick_id)
            for index, reward, _ in _late_rewards(sample):
                if position is not None and reward is not None and index in self.actors:
                    buffer.add_late_reward((self.trial_id, index), position, reward)
            return
        self.positions[sample.tick_id] = len(self.positions)
        self.last_state = sample.state
        by_index = {actor.actor: actor for actor in sample.actor_samples}
        for index in self.actors:
            actor = by_index.get(index)
            observation = action = None
            reward = 0.0
            if actor is not None:
                if actor.HasField("observation"):
                    observation = _payload(sample, actor.observation)
                if actor.HasField("action"):
                    action = _payload(sample, actor.action)
                if actor.HasField("reward"):
                    reward = actor.reward
            # (The feed waited for room before the sample: its actors' steps go in together.)
            buffer.extend(
                (self.trial_id, index),
                [observations.value(observation)],
                [actions.value(action)],
                [reward],
                ended=sample.state == common_pb2.ENDED,
                wait=False,
            )

    def finish(self, buffer: ReplayBuffer) -> None:
        """The trial's samples are all in: its last step is terminal if it ended."""
        for index in self.actors:
            buffer.finish((self.trial_id, index), ended=self.last_state == common_pb2.ENDED)


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
                handle, backlog = await self._start(client)
                self._started.set()
                for info in backlog:
                    self._follow(trials, client, info)
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
    ) -> None:
        task = asyncio.create_task(self._trial(client, info), name=f"replay-{info.trial_id}")
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

    async def _start(self, client: DatastoreClient) -> tuple[str, list[trial_datastore_pb2.StoredTrialInfo]]:
        """Where the listing ends (trials created after it are followed), and the trials to
        backfill: the latest stored ones whose selected actors' steps fill the capacity. They are
        read together: when they overshoot it, the oldest steps of each leave first."""
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
        return handle, backlog[::-1]

    async def _trial(self, client: DatastoreClient, info: trial_datastore_pb2.StoredTrialInfo) -> None:
        actors = self._actors.indices(info.params)
        if not actors:
            return
        trial = _TrialSteps(info.trial_id, actors, info.last_state)
        request = trial_datastore_pb2.RetrieveSamplesRequest(trial_ids=[info.trial_id])
        call = client.stub.RetrieveSamples(request)
        try:
            async for reply in call:
                if not self._buffer.room():  # waited for off the loop, which other feeds share
                    await asyncio.to_thread(self._buffer.wait_for_room)
                trial.add(self._buffer, reply.trial_sample, self._observations, self._actions)
        finally:
            call.cancel()
        trial.finish(self._buffer)
