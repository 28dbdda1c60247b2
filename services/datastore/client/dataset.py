"""Trials as a columnar dataset: the rows of the Parquet export (`client export --format parquet`).

A trial becomes one row per tick and actor in `steps.parquet`, and one row in `trials.parquet`;
the README's "Trials as training data" describes every column. Rows are built from the stored
samples as `RetrieveSamples` serves them, in order, and written in row groups, so an export holds
one row group and one sample in memory whatever the dataset's size (and, for a trial read twice,
its late rewards).

Late rewards: the orchestrator sends a reward for a past tick as a separate (out-of-sync) sample
naming that tick, stored after later ticks' samples. A sample whose tick is not after the last
tick already seen is such a sample: its rewards are folded into the rows of the tick it names
(added to `reward`, appended to `received_rewards`), and it makes no row of its own. A trial is
read once when its rows fit in a row group: late rewards are then folded into the rows still held
(`TrialStepper`). A trial that does not fit is read twice: its rewards first (`LateRewards`,
rewards only), then its samples, whose rows may be written before the late rewards come. Either
way a row's reward is its own plus the sum of its late ones, added in that order.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from services.datastore.client.api import state_name
from shared.api import common_pb2, trial_datastore_pb2

STEPS_FILE = "steps.parquet"
TRIALS_FILE = "trials.parquet"
PARTIAL_SUFFIX = ".partial"
# A row group is written once it holds this many rows or this many bytes of payloads.
ROW_GROUP_ROWS = 65_536
ROW_GROUP_BYTES = 64 * 1024 * 1024

_REWARD = pa.struct(
    [
        ("sender", pa.int32()),
        ("value", pa.float32()),
        ("confidence", pa.float32()),
        ("user_data", pa.binary()),
    ]
)
_MESSAGE = pa.struct([("sender", pa.int32()), ("payload", pa.binary())])
STEPS_SCHEMA = pa.schema(
    [
        ("trial_id", pa.string()),
        ("tick_id", pa.uint64()),
        ("timestamp", pa.uint64()),
        ("actor", pa.uint32()),
        ("actor_name", pa.string()),
        ("actor_class", pa.string()),
        ("actor_implementation", pa.string()),
        ("observation", pa.binary()),
        ("action", pa.binary()),
        ("reward", pa.float32()),
        ("received_rewards", pa.list_(_REWARD)),
        ("received_messages", pa.list_(_MESSAGE)),
        ("is_first", pa.bool_()),
        ("is_last", pa.bool_()),
        ("is_terminal", pa.bool_()),
        ("state", pa.string()),
    ]
)
TRIALS_SCHEMA = pa.schema(
    [
        ("trial_id", pa.string()),
        ("user_id", pa.string()),
        ("state", pa.string()),
        ("ended", pa.bool_()),
        ("interrupted", pa.bool_()),
        ("samples", pa.uint64()),
        ("ticks", pa.uint64()),
        ("properties", pa.map_(pa.string(), pa.string())),
        (
            "actors",
            pa.list_(
                pa.struct(
                    [("name", pa.string()), ("actor_class", pa.string()), ("implementation", pa.string())]
                )
            ),
        ),
        ("params", pa.binary()),
    ]
)

Reward = dict[str, Any]  # a `_REWARD` struct


def _payload(sample: trial_datastore_pb2.StoredTrialSample, index: int) -> bytes | None:
    return sample.payloads[index] if index < len(sample.payloads) else None


def _rewards(
    sample: trial_datastore_pb2.StoredTrialSample, actor: trial_datastore_pb2.StoredTrialActorSample
) -> list[Reward]:
    return [
        {
            "sender": reward.sender,
            "value": reward.reward,
            "confidence": reward.confidence,
            "user_data": _payload(sample, reward.user_data) if reward.HasField("user_data") else None,
        }
        for reward in actor.received_rewards
    ]


def _rewards_bytes(rewards: list[Reward]) -> int:
    return sum(len(reward["user_data"] or b"") for reward in rewards)


def _late_rewards(
    sample: trial_datastore_pb2.StoredTrialSample,
) -> Iterable[tuple[int, float | None, list[Reward]]]:
    """What a late sample gives each actor: (actor index, reward or None, rewards received)."""
    for actor in sample.actor_samples:
        yield actor.actor, actor.reward if actor.HasField("reward") else None, _rewards(sample, actor)


class TickOrder:
    """Tells a trial's samples of new ticks from its late rewards (samples of a past tick)."""

    def __init__(self) -> None:
        self._last_tick: int | None = None

    def is_late(self, sample: trial_datastore_pb2.StoredTrialSample) -> bool:
        if self._last_tick is not None and sample.tick_id <= self._last_tick:
            return True
        self._last_tick = sample.tick_id
        return False


@dataclass
class LateRewards:
    """A trial's late rewards, by (tick, actor index): their sum and each of them."""

    sums: dict[tuple[int, int], float] = field(default_factory=dict)
    rewards: dict[tuple[int, int], list[Reward]] = field(default_factory=dict)
    _order: TickOrder = field(default_factory=TickOrder)

    def read(self, sample: trial_datastore_pb2.StoredTrialSample) -> None:
        """Keep the rewards of `sample` if it is a late one (samples in stored order)."""
        if self._order.is_late(sample):
            for actor, reward, received in _late_rewards(sample):
                self.add((sample.tick_id, actor), reward, received)

    def add(self, key: tuple[int, int], reward: float | None, received: list[Reward]) -> None:
        if reward is not None:
            self.sums[key] = self.sums.get(key, 0.0) + reward
        if received:
            self.rewards.setdefault(key, []).extend(received)


class StepsWriter:
    """Writes `steps.parquet` in row groups, trial after trial."""

    def __init__(self, path: Path) -> None:
        self._writer = pq.ParquetWriter(path, STEPS_SCHEMA)
        self._columns: dict[str, list[Any]] = {name: [] for name in STEPS_SCHEMA.names}
        # Payload bytes of each row held (observation, action, user data, messages), and in all.
        self._row_bytes: list[int] = []
        self._bytes = 0
        # Rows held that late rewards were folded into: (their own reward, the late ones' sum).
        self._folded: dict[int, tuple[float | None, float]] = {}
        self.rows = 0

    @property
    def full(self) -> bool:
        return len(self._row_bytes) >= ROW_GROUP_ROWS or self._bytes >= ROW_GROUP_BYTES

    def flush(self) -> None:
        """Write what is held as a row group (a blocking write: off the event loop)."""
        if self._row_bytes:
            self._writer.write_table(pa.Table.from_pydict(self._columns, schema=STEPS_SCHEMA))
            for values in self._columns.values():
                values.clear()
            self._row_bytes.clear()
            self._bytes = 0
            self._folded.clear()

    def close(self) -> None:
        self.flush()
        self._writer.close()

    @property
    def held_rows(self) -> int:
        """Rows not written yet (the row group being filled)."""
        return len(self._row_bytes)

    def rollback(self, rows: int) -> None:
        """Drop the rows held after the first `rows` (a trial to be read again)."""
        self.rows -= self.held_rows - rows
        for values in self._columns.values():
            del values[rows:]
        self._bytes -= sum(self._row_bytes[rows:])
        del self._row_bytes[rows:]
        self._folded = {row: folded for row, folded in self._folded.items() if row < rows}

    def fold(self, row: int, reward: float | None, received: list[Reward]) -> None:
        """Add a late reward to a row held: its reward is its own plus the sum of the late ones,
        summed in that order whichever way the trial is read (`LateRewards`, `add_tick`)."""
        if reward is not None:
            own, late = self._folded.get(row, (self._columns["reward"][row], 0.0))
            late += reward
            self._folded[row] = (own, late)
            self._columns["reward"][row] = late if own is None else own + late
        self._columns["received_rewards"][row].extend(received)
        size = _rewards_bytes(received)
        self._row_bytes[row] += size
        self._bytes += size

    def add_tick(
        self,
        trial: TrialSteps,
        sample: trial_datastore_pb2.StoredTrialSample,
        *,
        is_last: bool,
        is_terminal: bool,
    ) -> int:
        """The rows of one tick's sample, one per actor of the trial; where the first is held."""
        columns = self._columns
        first_row = len(columns["trial_id"])
        by_index = {actor.actor: actor for actor in sample.actor_samples}
        state = state_name(sample.state)
        for index, (name, actor_class, implementation) in enumerate(trial.actors):
            actor = by_index.get(index)
            observation = action = reward = None
            rewards: list[Reward] = []
            messages: list[dict[str, Any]] = []
            if actor is not None:
                if actor.HasField("observation"):
                    observation = _payload(sample, actor.observation)
                if actor.HasField("action"):
                    action = _payload(sample, actor.action)
                if actor.HasField("reward"):
                    reward = actor.reward
                rewards = _rewards(sample, actor)
                messages = [
                    {"sender": message.sender, "payload": _payload(sample, message.payload)}
                    for message in actor.received_messages
                ]
            key = (sample.tick_id, index)
            late_sum = trial.late.sums.get(key)
            if late_sum is not None:
                self._folded[len(columns["trial_id"])] = (reward, late_sum)  # more may be folded in
                reward = late_sum if reward is None else reward + late_sum
            rewards += trial.late.rewards.get(key, [])
            columns["trial_id"].append(trial.trial_id)
            columns["tick_id"].append(sample.tick_id)
            columns["timestamp"].append(sample.timestamp)
            columns["actor"].append(index)
            columns["actor_name"].append(name)
            columns["actor_class"].append(actor_class)
            columns["actor_implementation"].append(implementation)
            columns["observation"].append(observation)
            columns["action"].append(action)
            columns["reward"].append(reward)
            columns["received_rewards"].append(rewards)
            columns["received_messages"].append(messages)
            columns["is_first"].append(trial.ticks == 0)
            columns["is_last"].append(is_last)
            columns["is_terminal"].append(is_terminal)
            columns["state"].append(state)
            size = len(observation or b"") + len(action or b"") + _rewards_bytes(rewards)
            size += sum(len(message["payload"] or b"") for message in messages)
            self._row_bytes.append(size)
            self._bytes += size
            self.rows += 1
        trial.ticks += 1
        return first_row


@dataclass
class TrialSteps:
    """One trial being exported: what its rows need, and what its `trials.parquet` row says."""

    trial_id: str
    info: trial_datastore_pb2.StoredTrialInfo
    late: LateRewards
    # Its ingestion had stopped before it ended when the export started: it will not end (the
    # datastore's TrialStatusSP says so; false when it cannot tell).
    interrupted: bool = False
    ticks: int = 0  # ticks written
    samples: int = 0  # stored samples read (late rewards included)

    @functools.cached_property
    def actors(self) -> list[tuple[str, str, str]]:
        """(name, class, implementation) of each actor, in index order (read once per tick)."""
        return [(a.name, a.actor_class, a.implementation) for a in self.info.params.actors]

    @property
    def ended(self) -> bool:
        """Whether the trial had ended when the export started (its last sample is then in)."""
        return self.info.last_state == common_pb2.ENDED


class TrialStepper:
    """Feeds one trial's samples, in stored order, to a StepsWriter: a tick's rows are written
    once the next tick comes (or the trial's samples end), to know whether it is the last.

    `rewards_read_first`: the trial's LateRewards were read before (two passes), and late samples
    are skipped; otherwise (one pass) they are folded into the rows they name, which must still be
    held by the writer (the caller reads the trial again otherwise)."""

    def __init__(self, trial: TrialSteps, writer: StepsWriter, *, rewards_read_first: bool) -> None:
        self.trial = trial
        self._writer = writer
        self._rewards_read_first = rewards_read_first
        self._order = TickOrder()
        self._held: trial_datastore_pb2.StoredTrialSample | None = None
        self._first_rows: dict[int, int] = {}  # tick -> the writer's row of its first actor (one pass)

    def add(self, sample: trial_datastore_pb2.StoredTrialSample) -> None:
        self.trial.samples += 1
        if self._order.is_late(sample):
            if not self._rewards_read_first:
                self._fold(sample)
            return
        if self._held is not None:
            row = self._writer.add_tick(self.trial, self._held, is_last=False, is_terminal=False)
            if not self._rewards_read_first:
                self._first_rows[self._held.tick_id] = row
        self._held = sample

    def _fold(self, sample: trial_datastore_pb2.StoredTrialSample) -> None:
        """A late sample's rewards, into its tick's rows (held ones, or the tick not written yet);
        those naming a tick the trial does not have are dropped."""
        tick = sample.tick_id
        first_row = self._first_rows.get(tick)
        for actor, reward, received in _late_rewards(sample):
            if self._held is not None and tick == self._held.tick_id:
                self.trial.late.add((tick, actor), reward, received)
            elif first_row is not None and 0 <= actor < len(self.trial.actors):
                self._writer.fold(first_row + actor, reward, received)

    def finish(self) -> None:
        if self._held is not None:
            ended = self.trial.ended
            self._writer.add_tick(self.trial, self._held, is_last=True, is_terminal=ended)
            self._held = None


def write_trials(path: Path, trials: Iterable[TrialSteps]) -> None:
    """`trials.parquet`: one row per exported trial."""
    rows = [
        {
            "trial_id": trial.trial_id,
            "user_id": trial.info.user_id,
            "state": state_name(trial.info.last_state),
            "ended": trial.ended,
            "interrupted": trial.interrupted,
            "samples": trial.samples,
            "ticks": trial.ticks,
            "properties": list(trial.info.params.properties.items()),
            "actors": [
                {"name": name, "actor_class": actor_class, "implementation": implementation}
                for name, actor_class, implementation in trial.actors
            ],
            "params": trial.info.params.SerializeToString(deterministic=True),
        }
        for trial in trials
    ]
    pq.write_table(pa.Table.from_pylist(rows, schema=TRIALS_SCHEMA), path)


def partial(path: Path) -> Path:
    return path.with_name(path.name + PARTIAL_SUFFIX)


def publish(directory: Path) -> None:
    """Move the finished files in place (each rename is atomic: a reader sees a whole file)."""
    for name in (STEPS_FILE, TRIALS_FILE):
        os.replace(partial(directory / name), directory / name)
