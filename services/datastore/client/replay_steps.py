"""A trial's samples turned into replay steps with the Parquet dataset's conventions
(docs/training-data.md): one step per selected actor and tick, a late reward added to the step of
the tick it names, a trial's last step terminal if it ended; payloads decoded by the user's
decoders, a step without a value given zeros like the values decoded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from services.datastore.client.dataset import TickOrder, _late_rewards, _payload
from shared.api import common_pb2, trial_datastore_pb2

if TYPE_CHECKING:
    from services.datastore.client.replay_buffer import ReplayBuffer

Decoder = Callable[[bytes], Any]
# What a sample without an actor's sample gives it: no observation, no action, no reward.
_NO_ACTOR_SAMPLE = trial_datastore_pb2.StoredTrialActorSample()


@dataclass(frozen=True)
class ActorSelection:
    classes: Sequence[str] = ()
    names: Sequence[str] = ()
    implementations: Sequence[str] = ()

    def __post_init__(self) -> None:
        for label, wanted in self._given():
            if isinstance(wanted, str):
                raise TypeError(f"{label}: a list of names, not the string {wanted!r}")

    def _given(self) -> list[tuple[str, Sequence[str]]]:
        return [
            ("actor_classes", self.classes),
            ("actor_names", self.names),
            ("actor_implementations", self.implementations),
        ]

    def selects_none_of(self, trial_id: str, params: common_pb2.TrialParams) -> str:
        """Why a trial has no selected actor, in the parameters' words (a typo, most likely)."""
        asked = ", ".join(f"{label}={list(wanted)}" for label, wanted in self._given() if wanted)
        actors = ", ".join(f"{a.name} ({a.actor_class}, {a.implementation})" for a in params.actors)
        return f"{asked} selects no actor of trial {trial_id}, whose actors are: {actors or 'none'}"

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
class DecodedColumn:
    """A column's decoder, and the zeros a step without a value gets: zeros like the first value
    decoded, or (`settle`) 0.0 when a trial ended before any value came (as `TrainingData` gives
    a column without any value)."""

    decode: Decoder | None
    blank: Any = None

    def learn(self, raws: list[bytes | None]) -> None:
        """Know the blank from the first value among `raws`, if it is not known yet."""
        if self.decode is not None and self.blank is None:
            first = next((raw for raw in raws if raw is not None), None)
            if first is not None:
                self.blank = np.zeros_like(np.asarray(self.decode(first)))

    def ready(self, raws: list[bytes | None]) -> bool:
        """Whether `raws` can be given values now (a step without one needs the blank)."""
        return self.decode is None or self.blank is not None or all(raw is not None for raw in raws)

    def settle(self) -> None:
        if self.decode is not None and self.blank is None:
            self.blank = np.zeros(())

    def values(self, raws: list[bytes | None]) -> list[Any]:
        if self.decode is None:
            return raws
        return [self.blank if raw is None else self.decode(raw) for raw in raws]


@dataclass
class _HeldSteps:
    """An actor's steps not in the buffer yet: raw observations and actions, rewards."""

    observations: list[bytes | None] = field(default_factory=list)
    actions: list[bytes | None] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)


@dataclass
class LiveTrial:
    """One trial's samples turned into its selected actors' steps.

    A batch of samples goes in with one `extend` per actor (its costs are per call more than per
    step). Steps are held back while a column has no value to shape the zeros of a step without
    one (until a value comes, or the trial's end settles it), so that every actor's episode has
    the same number of steps in the buffer: `stored`."""

    trial_id: str
    actors: list[int]
    last_state: int
    order: TickOrder = field(default_factory=TickOrder)
    # Tick -> position in the episodes, for late rewards: of the steps given (`steps`), those the
    # buffer may still hold (see `_forget_removed_positions`).
    positions: dict[int, int] = field(default_factory=dict)
    steps: int = 0
    stored: int = 0
    held: dict[int, _HeldSteps] = field(default_factory=dict)
    samples_read: int = 0  # (late ones too): a read that failed goes on after them

    def __post_init__(self) -> None:
        self.held = {index: _HeldSteps() for index in self.actors}

    def add(
        self,
        buffer: ReplayBuffer,
        samples: Sequence[trial_datastore_pb2.StoredTrialSample],
        observations: DecodedColumn,
        actions: DecodedColumn,
    ) -> None:
        """Samples in stored order; a late reward is added to its step, held or stored."""
        for sample in samples:
            if self.order.is_late(sample):
                position = self.positions.get(sample.tick_id)
                for index, reward, _ in _late_rewards(sample):
                    if position is None or reward is None or index not in self.held:
                        continue
                    if position >= self.stored:
                        self.held[index].rewards[position - self.stored] += reward
                    else:
                        buffer.add_late_reward((self.trial_id, index), position, reward)
                continue
            self.positions[sample.tick_id] = self.steps
            self.steps += 1
            self.last_state = sample.state
            by_index = {actor.actor: actor for actor in sample.actor_samples}
            for index, held in self.held.items():
                actor = by_index.get(index, _NO_ACTOR_SAMPLE)
                held.observations.append(
                    _payload(sample, actor.observation) if actor.HasField("observation") else None
                )
                held.actions.append(_payload(sample, actor.action) if actor.HasField("action") else None)
                held.rewards.append(actor.reward if actor.HasField("reward") else 0.0)
        self.samples_read += len(samples)
        self._store(buffer, observations, actions)
        self._forget_removed_positions(buffer)

    def finish(self, buffer: ReplayBuffer, observations: DecodedColumn, actions: DecodedColumn) -> None:
        """The trial's samples are all in: its last step is terminal if it ended."""
        observations.settle()
        actions.settle()
        self._store(buffer, observations, actions)
        for index in self.actors:
            buffer.finish((self.trial_id, index), ended=self.last_state == common_pb2.ENDED)

    def _store(self, buffer: ReplayBuffer, observations: DecodedColumn, actions: DecodedColumn) -> None:
        if self.stored == self.steps:
            return
        for held in self.held.values():
            observations.learn(held.observations)
            actions.learn(held.actions)
        # After learning, the blanks are known, or every held value is missing: all go, or none.
        if not all(
            observations.ready(held.observations) and actions.ready(held.actions)
            for held in self.held.values()
        ):
            return
        for index, held in self.held.items():
            # (The feed waited for room for these samples' steps: they go in together.)
            buffer.extend(
                (self.trial_id, index),
                observations.values(held.observations),
                actions.values(held.actions),
                held.rewards,
                ended=self.last_state == common_pb2.ENDED,
                wait=False,
            )
            self.held[index] = _HeldSteps()
        self.stored = self.steps

    def _forget_removed_positions(self, buffer: ReplayBuffer) -> None:
        """Forget the ticks of steps every actor's episode lost (a late reward for them keeps
        nothing) once they are half of those known: what a long trial keeps follows what the
        buffer holds, not the trial's length."""
        first = min(buffer.first_position((self.trial_id, index)) for index in self.actors)
        known_from = self.steps - len(self.positions)
        if first - known_from > len(self.positions) // 2:
            self.positions = {tick: at for tick, at in self.positions.items() if at >= first}
