"""The demo's environment and policies (`services.demo.world`): deterministic given a seed, and
the events its trials are made of (moves, rewards, messages, late thanks) consistent with each
other."""

from __future__ import annotations

import itertools
import random

import pytest

from services.demo.api import spec_pb2
from services.demo.world import (
    GOAL_BONUS,
    GRID_SIZE,
    MOVES,
    OBSERVATION_SIZE,
    STAGES,
    GatherTrial,
    Policy,
    Tick,
    policy_weights,
    trial_seed,
)

POLICIES = [Policy(policy_weights(stage)) for stage in STAGES]


def play(seed: int, ticks: int, players: int) -> list[Tick]:
    policies = [POLICIES[index % len(POLICIES)] for index in range(players)]
    return list(GatherTrial(seed, ticks, policies).ticks())


def test_the_same_seed_plays_the_same_trial() -> None:
    assert play(11, 60, 4) == play(11, 60, 4)
    assert play(11, 60, 4) != play(12, 60, 4)
    assert trial_seed(3, 0) == trial_seed(3, 0)
    assert len({trial_seed(3, index) for index in range(100)} | {trial_seed(4, 0)}) == 101
    assert all(0 <= trial_seed(seed, 7) < 2**63 for seed in (0, 1, 2**63 - 1))


def test_a_tick_per_tick_id_the_last_one_only_observed() -> None:
    ticks = play(5, 40, 3)
    assert [tick.tick_id for tick in ticks] == list(range(40))
    for tick in ticks[:-1]:
        assert len(tick.observations) == len(tick.moves) == len(tick.rewards) == 3
        assert all(move in MOVES for move in tick.moves)
        assert all(-1.0 <= reward <= 0.0 or reward == GOAL_BONUS for reward in tick.rewards)
    last = ticks[-1]
    assert last.last and last.moves == () and last.rewards == () and last.messages == () and last.thanks == ()
    for tick in ticks:
        for observation in tick.observations:
            assert len(observation) == OBSERVATION_SIZE
            assert all(-1.0 <= value <= 1.0 for value in observation)
            # What the Observation message carries, to the bit.
            assert tuple(spec_pb2.Observation(values=observation).values) == observation
        assert tick.observations[0][4] == pytest.approx(tick.tick_id / 39)


def test_a_single_tick_trial_is_its_final_observation() -> None:
    (tick,) = play(1, 1, 2)
    assert tick.tick_id == 0 and tick.last and len(tick.observations) == 2


def test_finds_are_told_then_thanked_one_or_two_ticks_later() -> None:
    ticks = play(21, 300, 4)
    finders = {tick.tick_id: {p for p, r in enumerate(tick.rewards) if r == GOAL_BONUS} for tick in ticks}
    messages = [(tick.tick_id, message) for tick in ticks for message in tick.messages]
    thanks = [(tick.tick_id, late) for tick in ticks for late in tick.thanks]
    assert messages and thanks
    for tick_id, message in messages:
        # Told at the tick after the find, to every other player.
        assert message.found_tick == tick_id - 1
        assert message.sender in finders[message.found_tick]
        assert message.receiver != message.sender
    told = {(message.found_tick, message.sender, message.receiver) for _, message in messages}
    for tick_id, late in thanks:
        assert late.found_tick + 1 <= tick_id <= late.found_tick + 2
        assert (late.found_tick, late.receiver, late.sender) in told
        assert late.receiver in finders[late.found_tick]
    # Every message is thanked, but for those whose thanks would come after the players' last act.
    assert len(thanks) <= len(messages)
    assert {(m.found_tick, m.sender, m.receiver) for _, m in messages if m.found_tick + 2 < 299} <= {
        (late.found_tick, late.receiver, late.sender) for _, late in thanks
    }


def test_the_goal_moves_once_reached() -> None:
    ticks = play(8, 200, 3)
    for before, after in itertools.pairwise(ticks):
        if GOAL_BONUS not in before.rewards:
            continue
        finder = before.rewards.index(GOAL_BONUS)
        # The finder stands where the goal was: the goal's offset from it is no longer zero,
        # unless the grid had no free cell (it has here).
        assert after.observations[finder][2:4] != (0.0, 0.0)


def test_the_greedy_policy_walks_to_the_goal() -> None:
    exact = spec_pb2.PolicyWeights()
    exact.CopyFrom(policy_weights(STAGES[-1]))
    exact.epsilon = 0.0
    policy = Policy(exact)
    rng = random.Random(0)
    span = GRID_SIZE - 1
    assert policy.move((0, 0, 3 / span, 0, 0), rng) == spec_pb2.RIGHT
    assert policy.move((0.5, 0, -2 / span, 0, 0), rng) == spec_pb2.LEFT
    assert policy.move((0, 0, 0, 1 / span, 0), rng) == spec_pb2.UP
    assert policy.move((0, 0.5, 0, -1 / span, 0), rng) == spec_pb2.DOWN
    # The greedy players find the goal far more often than the untrained ones.
    greedy = sum(t.rewards.count(GOAL_BONUS) for t in GatherTrial(4, 400, [policy]).ticks())
    untrained = sum(t.rewards.count(GOAL_BONUS) for t in GatherTrial(4, 400, [POLICIES[0]]).ticks())
    assert greedy > 2 * untrained


def test_policy_weights_never_change() -> None:
    for stage in STAGES:
        first = policy_weights(stage).SerializeToString(deterministic=True)
        assert policy_weights(stage).SerializeToString(deterministic=True) == first
    assert len({policy_weights(stage).SerializeToString() for stage in STAGES}) == len(STAGES)


def test_malformed_weights_are_refused() -> None:
    with pytest.raises(ValueError, match="expected 25 over 5"):
        Policy(spec_pb2.PolicyWeights(observation_size=5, weights=[1.0] * 24, biases=[0.0] * 5))
    with pytest.raises(ValueError, match="biases"):
        Policy(spec_pb2.PolicyWeights(observation_size=5, weights=[1.0] * 25, biases=[0.0] * 4))
