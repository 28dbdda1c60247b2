"""The console's reward curves (services.console.curves) against a plain converter that keeps
every tick's reward: the same returns at every point, the same bounds while samples come in tick
order (exact again after any late reward while a slot is one tick wide), and bounds that contain
every tick's reward otherwise; and slots that never exceed their capacity, however far the
ticks go."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from services.console.curves import SLOT_BYTES, RewardTotals
from services.console.model import Curve
from shared.api import trial_datastore_pb2

ACTORS = 2
Sample = tuple[int, dict[int, float]]  # (tick, reward by actor)


def stored(tick: int, rewards: dict[int, float]) -> trial_datastore_pb2.StoredTrialSample:
    return trial_datastore_pb2.StoredTrialSample(
        tick_id=tick,
        actor_samples=[
            trial_datastore_pb2.StoredTrialActorSample(actor=actor, reward=reward)
            for actor, reward in rewards.items()
        ],
    )


def plain_rewards(samples: list[Sample], actor: int) -> list[float]:
    """Each tick's reward, ticks 0 to the largest seen, late rewards at the tick they name."""
    ticks = max((tick for tick, _ in samples), default=-1) + 1
    rewards = [0.0] * ticks
    for tick, by_actor in samples:
        rewards[tick] += by_actor.get(actor, 0.0)
    return rewards


def expected_points(
    rewards: list[float], first_ticks: list[int]
) -> tuple[list[float], list[float], list[float]]:
    """The exact min, max and return at the end of each bucket starting at `first_ticks`."""
    lows, highs, returns = [], [], []
    ends = [*first_ticks[1:], len(rewards)]
    for start, end in zip(first_ticks, ends, strict=True):
        bucket = rewards[start:end]
        lows.append(min(bucket))
        highs.append(max(bucket))
        returns.append(math.fsum(rewards[:end]))
    return lows, highs, returns


def check(curve: Curve, rewards: list[float], *, exact_bounds: bool) -> None:
    assert curve.ticks[0] == 0 and curve.ticks == sorted(set(curve.ticks))
    lows, highs, returns = expected_points(rewards, curve.ticks)
    assert curve.returns == returns
    if exact_bounds:
        assert curve.reward_min == lows
        assert curve.reward_max == highs
    else:  # an envelope of every tick's reward
        assert all(low <= expected for low, expected in zip(curve.reward_min, lows, strict=True))
        assert all(high >= expected for high, expected in zip(curve.reward_max, highs, strict=True))


# Quarters: exact as the wire's float32 and in any sum, so that exact means equal.
rewards_strategy = st.dictionaries(
    st.integers(0, ACTORS - 1), st.integers(-400, 400).map(lambda r: r / 4), max_size=ACTORS
)


@st.composite
def trials(draw: st.DrawFn, late: bool) -> list[Sample]:
    """Samples in stored order: ticks that go up (several samples of a tick in a row, gaps
    between ticks), and with `late`, samples of ticks already passed."""
    samples: list[Sample] = []
    tick = 0
    for _ in range(draw(st.integers(1, 120))):
        if late and samples and draw(st.booleans()) and draw(st.booleans()):
            samples.append((draw(st.integers(0, tick)), draw(rewards_strategy)))
            continue
        tick += draw(st.sampled_from([0, 1, 1, 1, 2, 7, 40]))
        samples.append((tick, draw(rewards_strategy)))
    return samples


def totals_of(samples: list[Sample], capacity: int) -> RewardTotals:
    totals = RewardTotals(ACTORS, capacity)
    for tick, rewards in samples:
        totals.add(stored(tick, rewards))
    return totals


@settings(max_examples=150, deadline=None)
@given(trials(late=False), st.integers(2, 9), st.integers(1, 12))
def test_in_tick_order_the_curves_are_exact(samples: list[Sample], capacity: int, points: int) -> None:
    totals = totals_of(samples, capacity)
    assert totals.ticks == samples[-1][0] + 1
    for actor, curve in enumerate(totals.curves(["a", "b"], points)):
        assert len(curve.ticks) <= points
        check(curve, plain_rewards(samples, actor), exact_bounds=True)
    assert totals.returns() == [math.fsum(plain_rewards(samples, actor)) for actor in range(ACTORS)]


@settings(max_examples=150, deadline=None)
@given(trials(late=True), st.integers(2, 9), st.integers(1, 12))
def test_late_rewards_count_at_their_tick(samples: list[Sample], capacity: int, points: int) -> None:
    totals = totals_of(samples, capacity)
    for actor, curve in enumerate(totals.curves(["a", "b"], points)):
        check(curve, plain_rewards(samples, actor), exact_bounds=totals.width == 1)


@given(trials(late=True))
def test_slots_one_tick_wide_are_exact_with_late_rewards(samples: list[Sample]) -> None:
    totals = totals_of(samples, 10_000)
    assert totals.width == 1
    for actor, curve in enumerate(totals.curves(["a", "b"], 10_000)):
        check(curve, plain_rewards(samples, actor), exact_bounds=True)


def test_memory_stays_within_the_slots_whatever_the_ticks() -> None:
    totals = RewardTotals.within(ACTORS, 64 * SLOT_BYTES * ACTORS)
    assert totals.capacity == 64
    for tick in [*range(1000), 10**6, 10**12, 2**62]:
        totals.add(stored(tick, {0: 1.0, 1: -1.0}))
    slots = totals._actors[0]
    assert len(slots.sums) == len(slots.lows) == len(slots.highs) < 64
    assert totals.returns() == [1003.0, -1003.0]
    (first, _second) = totals.curves(["a", "b"], 10)
    assert first.returns[-1] == 1003.0 and first.reward_max == [1.0] + [0.0] * (len(first.ticks) - 2) + [1.0]
