"""Reward curves: each actor's reward per tick and its cumulative return, from a trial's samples
in stored order, downsampled to a bounded number of points (min/max per bucket of ticks), in
memory bounded whatever the trial's length.

A late reward (a sample of a tick already seen, stored after later ticks) counts at the tick it
names, as the training data does it (docs/training-data.md).

Each actor's rewards are folded into at most `capacity` slots of `width` ticks: the sum of the
slot's rewards, and the smallest and largest reward of one of its ticks (a tick without a reward
counts 0). The slots fill up in tick order; when they are all used, pairs are merged and the
width doubles. The last slot is open: it keeps its sum, bounds and the number of its ticks that
had a reward, and the tick being read is kept apart until a later tick arrives, so that every
reward of a tick is added before the tick is folded. Returns are exact; the bounds are exact
too, except after a late reward for a tick already folded into a slot wider than one tick: the
tick's own value is no longer known there, and the bounds widen to keep it between them.
"""

from __future__ import annotations

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
        """Every two full slots as one (their count is even)."""
        sums, lows, highs = self.sums, self.lows, self.highs
        self.sums = array("d", (sums[i] + sums[i + 1] for i in range(0, len(sums), 2)))
        self.lows = array("d", (min(lows[i], lows[i + 1]) for i in range(0, len(lows), 2)))
        self.highs = array("d", (max(highs[i], highs[i + 1]) for i in range(0, len(highs), 2)))

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

    def slot_values(self, read_ticks: int, width: int) -> tuple[list[float], list[float], list[float]]:
        """Sums and bounds of the full slots, then of the open one when it has read ticks."""
        sums, lows, highs = list(self.sums), list(self.lows), list(self.highs)
        covered = read_ticks - len(sums) * width
        if covered > 0:
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
            sums.append(total)
            lows.append(low)
            highs.append(high)
        return sums, lows, highs


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
        """Close slots until `tick` falls in the open one, merging when they are all used."""
        if tick < self._open_start + self.width:
            return
        for actor in self._actors:
            actor.close(self.width)
        self._full += 1
        # Slots whose ticks all passed without a sample: added at once, merged as needed.
        while True:
            if self._full == self.capacity:
                for actor in self._actors:
                    actor.merge_pairs()
                self._full //= 2
                self.width *= 2
            empty = (tick - self._open_start) // self.width
            if self._full + empty < self.capacity:
                break
            fill = self.capacity - self._full
            for actor in self._actors:
                actor.add_empty(fill)
            self._full = self.capacity
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
            sums, lows, highs = slots.slot_values(self.ticks, self.width)
            per_bucket = max(1, -(-len(sums) // max_points))  # slots per point (ceiling division)
            ticks, reward_min, reward_max, returns = [], [], [], []
            total = 0.0
            for start in range(0, len(sums), per_bucket):
                end = start + per_bucket
                ticks.append(start * self.width)
                reward_min.append(min(lows[start:end]))
                reward_max.append(max(highs[start:end]))
                total += sum(sums[start:end])
                returns.append(total)
            curves.append(Curve(name, ticks, reward_min, reward_max, returns))
        return curves

    def returns(self) -> list[float]:
        """Each actor's return: the sum of its rewards."""
        return [
            sum(slots.sums) + slots.open.total + (slots.open.value if slots.open.tick >= 0 else 0.0)
            for slots in self._actors
        ]
