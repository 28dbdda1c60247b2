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
class LiveTrial:
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
        observations: DecodedColumn,
        actions: DecodedColumn,
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
