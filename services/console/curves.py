"""Reward curves: each actor's reward per tick and its cumulative return, from a trial's samples
in stored order, downsampled to a bounded number of points (min/max per bucket of ticks).

A late reward (a sample of a tick already seen, stored after later ticks) counts at the tick it
names, as the training data does it (docs/training-data.md).
"""

from __future__ import annotations

from collections.abc import Sequence

from services.console.model import Curve
from shared.api import trial_datastore_pb2

# Points per curve at most: a 100,000-tick trial draws 1,000 buckets of 100 ticks.
MAX_POINTS = 1000


class RewardTotals:
    """Each actor's reward by tick, summed as samples arrive (late ones included)."""

    def __init__(self, actor_count: int) -> None:
        self._by_tick: list[dict[int, float]] = [{} for _ in range(actor_count)]
        self.ticks = 0  # one more than the largest tick seen

    def add(self, sample: trial_datastore_pb2.StoredTrialSample) -> None:
        self.ticks = max(self.ticks, sample.tick_id + 1)
        for actor_sample in sample.actor_samples:
            if actor_sample.HasField("reward") and actor_sample.actor < len(self._by_tick):
                rewards = self._by_tick[actor_sample.actor]
                rewards[sample.tick_id] = rewards.get(sample.tick_id, 0.0) + actor_sample.reward

    def curves(self, actor_names: Sequence[str], ticks: int, max_points: int = MAX_POINTS) -> list[Curve]:
        """One curve per actor over ticks 0..`ticks`-1 (a tick without a reward counts 0)."""
        return [
            downsample(name, [rewards.get(tick, 0.0) for tick in range(ticks)], max_points)
            for name, rewards in zip(actor_names, self._by_tick, strict=True)
        ]

    def returns(self) -> list[float]:
        """Each actor's return: the sum of its rewards."""
        return [sum(rewards.values()) for rewards in self._by_tick]


def downsample(actor: str, rewards: Sequence[float], max_points: int = MAX_POINTS) -> Curve:
    """`rewards` (one per tick) as at most `max_points` buckets of consecutive ticks: the first
    tick of each, its smallest and largest reward, and the return at its last tick."""
    if max_points < 1:
        raise ValueError("max_points must be at least 1")
    size = max(1, -(-len(rewards) // max_points))  # ceiling division
    ticks: list[int] = []
    lows: list[float] = []
    highs: list[float] = []
    returns: list[float] = []
    total = 0.0
    for start in range(0, len(rewards), size):
        bucket = rewards[start : start + size]
        ticks.append(start)
        lows.append(min(bucket))
        highs.append(max(bucket))
        total += sum(bucket)
        returns.append(total)
    return Curve(actor, ticks, lows, highs, returns)
