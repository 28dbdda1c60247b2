"""Reward curves: each actor's reward per tick and its cumulative return, from a trial's samples
in stored order, downsampled to a bounded number of points (min/max per bucket of ticks), in
memory bounded whatever the trial's length.

A late reward (a sample of a tick already seen, stored after later ticks) counts at the tick it
names, as the training data does it (docs/training-data.md).

Each actor's rewards are folded into at most `capacity` slots of `width` ticks: the sum of the
slot's rewards, and the smallest and largest reward of one of its ticks (a tick without a reward
counts 0). The slots fill up in tick order; when a tick falls past the last of them, pairs are
merged and the width doubles, as often as needed. The last slot is open: it keeps its sum,
bounds and the number of its ticks that had a reward, and the tick being read is kept apart until
a later tick arrives, so that every reward of a tick is added before the tick is folded.
Returns are exact; the bounds are exact too, except after a late reward for a tick already
folded into a slot wider than one tick: the tick's own value is no longer known there, and the
bounds widen to keep it between them.
"""

from __future__ import annotations

import operator
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from services.console.model import Curve
from shared.api import trial_datastore_pb2

# Points per curve at most: a 100,000-tick trial draws 1,000 buckets of 100 ticks.
MAX_POINTS = 1000
# Bytes of one slot: its sum and two bounds, 8 bytes each.
SLOT_BYTES = 24


@dataclass
class _Open:
    """The last, open slot of one actor: what its folded ticks add up to."""

    total: float = 0.0
    low: float = 0.0
    high: float = 0.0
    rewarded: int = 0  # its folded ticks that had a reward (the others count 0)
    tick: int = -1  # the tick kept apart (-1: none), with what its rewards add up to so far
    value: float = 0.0


class _ActorSlots:
    """One actor's slots (see the module's docstring)."""

    def __init__(self) -> None:
        self.sums = array("d")
        self.lows = array("d")
        self.highs = array("d")
        self.open = _Open()

    def fold_tick(self) -> None:
        """Fold the tick kept apart into the open slot."""
        slot = self.open
        if slot.tick < 0:
            return
        if slot.rewarded == 0:
            slot.low = slot.high = slot.value
        else:
            slot.low, slot.high = min(slot.low, slot.value), max(slot.high, slot.value)
        slot.total += slot.value
        slot.rewarded += 1
        slot.tick, slot.value = -1, 0.0

    def close(self, width: int) -> None:
        """The open slot (`width` ticks, all read) becomes a full one."""
        self.fold_tick()
        slot = self.open
        low, high = (slot.low, slot.high) if slot.rewarded else (0.0, 0.0)
        if 0 < slot.rewarded < width:  # some of its ticks had no reward: 0 is one of its values
            low, high = min(low, 0.0), max(high, 0.0)
        self.sums.append(slot.total)
        self.lows.append(low)
        self.highs.append(high)
        self.open = _Open()

    def add_empty(self, count: int) -> None:
        """`count` full slots of ticks without a reward."""
        self.sums.extend(array("d", bytes(8 * count)))
        self.lows.extend(array("d", bytes(8 * count)))
        self.highs.extend(array("d", bytes(8 * count)))

    def merge_pairs(self) -> None:
        """Every two full slots as one (an odd last one with an empty slot after it)."""
        if len(self.sums) % 2:
            self.add_empty(1)
        sums, lows, highs = self.sums, self.lows, self.highs
        self.sums = array("d", map(operator.add, sums[0::2], sums[1::2]))
        self.lows = array("d", map(min, lows[0::2], lows[1::2]))
        self.highs = array("d", map(max, highs[0::2], highs[1::2]))

    def add_late(self, slot: int, reward: float, width: int) -> None:
        """A reward for a tick already folded into full slot `slot`, or into the open one
        (`slot` == the number of full slots), or counted there as a tick without a reward."""
        if slot == len(self.sums):
            target = self.open
            target.total += reward
            if target.rewarded == 0:  # every folded tick of the slot had no reward: this one is exact
                target.low = target.high = reward
                target.rewarded = 1
            else:
                target.low, target.high = _widened(target.low, target.high, reward)
            return
        self.sums[slot] += reward
        if width == 1:  # a slot of one tick: its value is its sum
            self.lows[slot] = self.highs[slot] = self.sums[slot]
        else:
            self.lows[slot], self.highs[slot] = _widened(self.lows[slot], self.highs[slot], reward)

    def open_values(self, read_ticks: int, width: int) -> tuple[float, float, float] | None:
        """The open slot's sum and bounds, the tick kept apart folded in, when it has read ticks."""
        covered = read_ticks - len(self.sums) * width
        if covered <= 0:
            return None
        slot = self.open
        total, low, high, rewarded = slot.total, slot.low, slot.high, slot.rewarded
        if slot.tick >= 0:
            low, high = (
                (min(low, slot.value), max(high, slot.value)) if rewarded else (slot.value, slot.value)
            )
            total += slot.value
            rewarded += 1
        if rewarded < covered:
            low, high = (min(low, 0.0), max(high, 0.0)) if rewarded else (0.0, 0.0)
        return total, low, high

    def bucket(
        self, start: int, end: int, opened: tuple[float, float, float] | None
    ) -> tuple[float, float, float]:
        """Sum and bounds of slots `start` to `end` (excluded; the open one is number
        len(sums), with the values `opened`), read from the arrays without copying them whole."""
        full_end = min(end, len(self.sums))
        totals, lows, highs = [], [], []
        if start < full_end:
            totals.append(sum(self.sums[start:full_end]))
            lows.append(min(self.lows[start:full_end]))
            highs.append(max(self.highs[start:full_end]))
        if end > len(self.sums) and opened is not None:
            totals.append(opened[0])
            lows.append(opened[1])
            highs.append(opened[2])
        return sum(totals), min(lows), max(highs)


def _widened(low: float, high: float, reward: float) -> tuple[float, float]:
    """Bounds of a slot after `reward` was added to one of its ticks, whose value was between
    them or 0 (a tick without a reward): the bounds moved by `reward` join them."""
    return min(low, min(low, 0.0) + reward), max(high, max(high, 0.0) + reward)


class RewardTotals:
    """Each actor's rewards as samples arrive (late ones included), in at most `capacity` slots
    per actor: `capacity * SLOT_BYTES` bytes per actor, whatever the trial's length."""

    def __init__(self, actor_count: int, capacity: int) -> None:
        if capacity < 2:
            raise ValueError("capacity must be at least 2 slots")
        self.capacity = capacity - capacity % 2  # merged by pairs
        self.width = 1  # ticks per slot
        self.ticks = 0  # one more than the largest tick seen
        self._full = 0  # full slots (the same for every actor)
        self._actors = [_ActorSlots() for _ in range(actor_count)]

    @classmethod
    def within(cls, actor_count: int, budget_bytes: int) -> RewardTotals:
        """Totals whose slots take at most `budget_bytes` (at least 2 slots per actor)."""
        return cls(actor_count, max(2, budget_bytes // (SLOT_BYTES * max(1, actor_count))))

    @property
    def _open_start(self) -> int:
        return self._full * self.width

    def _reach(self, tick: int) -> None:
        """Close the open slot once `tick` is past it, and widen the slots (merging pairs) until
        `tick`'s own is within the capacity; the slots between are empty. A far jump merges the
        slots with content only, fewer each time: never the empty ones it would add."""
        if tick < self._open_start + self.width:
            return
        for actor in self._actors:
            actor.close(self.width)
        self._full += 1
        while tick // self.width >= self.capacity:
            for actor in self._actors:
                actor.merge_pairs()
            self._full = -(-self._full // 2)
            self.width *= 2
        empty = tick // self.width - self._full
        if empty:  # ticks without a sample were passed
            for actor in self._actors:
                actor.add_empty(empty)
            self._full += empty

    def add(self, sample: trial_datastore_pb2.StoredTrialSample) -> None:
        tick = sample.tick_id
        if tick >= self.ticks:
            self._reach(tick)
            self.ticks = tick + 1
        for actor_sample in sample.actor_samples:
            if not actor_sample.HasField("reward") or actor_sample.actor >= len(self._actors):
                continue
            slots = self._actors[actor_sample.actor]
            reward = actor_sample.reward
            if tick == slots.open.tick:
                slots.open.value += reward
            elif tick >= self._open_start and tick > slots.open.tick:  # a new tick of the open slot
                slots.fold_tick()
                slots.open.tick, slots.open.value = tick, reward
            else:  # late: its tick was folded already
                slots.add_late(tick // self.width, reward, self.width)

    def curves(self, actor_names: Sequence[str], max_points: int = MAX_POINTS) -> list[Curve]:
        """One curve per actor over the ticks read (a tick without a reward counts 0)."""
        if max_points < 1:
            raise ValueError("max_points must be at least 1")
        curves = []
        for name, slots in zip(actor_names, self._actors, strict=True):
            opened = slots.open_values(self.ticks, self.width)
            count = self._full + (opened is not None)
            per_bucket = max(1, -(-count // max_points))  # slots per point (ceiling division)
            ticks, reward_min, reward_max, returns = [], [], [], []
            total = 0.0
            for start in range(0, count, per_bucket):
                bucket_sum, low, high = slots.bucket(start, start + per_bucket, opened)
                ticks.append(start * self.width)
                reward_min.append(low)
                reward_max.append(high)
                total += bucket_sum
                returns.append(total)
            curves.append(Curve(name, ticks, reward_min, reward_max, returns))
        return curves

    def returns(self) -> list[float]:
        """Each actor's return: the sum of its rewards."""
        return [
            sum(slots.sums) + slots.open.total + (slots.open.value if slots.open.tick >= 0 else 0.0)
            for slots in self._actors
        ]
