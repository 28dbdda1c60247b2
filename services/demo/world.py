"""The demo's environment and policies: players on a grid look for a goal. Pure (no I/O) and
deterministic: a trial's seed decides everything it does.

One trial, tick by tick (`GatherTrial.ticks`):

* Tick t shows each player its observation: its column and row, the goal's offset from it, and
  how much of the trial has passed (`spec_pb2.Observation`, every value in [-1, 1]).
* On every tick but the last, each player moves one cell (or stays), as its policy says from that
  observation. The environment rewards each move: GOAL_BONUS for landing on the goal, otherwise
  minus the distance left to it (Manhattan, over twice the grid's width: in [-1, 0]). Once
  reached, the goal moves to a new cell.
* A player that reached the goal at tick t tells each other player at tick t + 1 (a `GoalFound`
  message). Each of them thanks it with a reward of THANKS_VALUE for tick t, sent one or two
  ticks after t: a reward for a past tick, which the orchestrator logs as an out-of-sync sample.
  Messages and thanks are sent on ticks where players act, so none comes after the last one.
* The last tick (`ticks - 1`) only shows the final observations: the environment ends the trial.

Policies are linear (`spec_pb2.PolicyWeights`): a score per move from the observation, the best
move played, a random one with probability epsilon. The demo's three stages blend a hand-made
policy that walks to the goal with fixed random weights; they do not depend on the seed, so that
every run publishes the same versions.
"""

from __future__ import annotations

import hashlib
import random
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TypeAlias

from services.demo.api import spec_pb2

Move: TypeAlias = spec_pb2.Move.ValueType

GRID_SIZE = 8
OBSERVATION_SIZE = 5  # column, row, goal column offset, goal row offset, progress
MOVES: tuple[Move, ...] = (spec_pb2.STAY, spec_pb2.UP, spec_pb2.DOWN, spec_pb2.LEFT, spec_pb2.RIGHT)
# Column and row change of each move.
STEPS: dict[Move, tuple[int, int]] = {
    spec_pb2.STAY: (0, 0),
    spec_pb2.UP: (0, 1),
    spec_pb2.DOWN: (0, -1),
    spec_pb2.LEFT: (-1, 0),
    spec_pb2.RIGHT: (1, 0),
}
GOAL_BONUS = 1.0
THANKS_VALUE = 0.5
THANKS_CONFIDENCE = 0.5
# Draws of a new goal cell away from the players before one under a player is accepted (a grid
# crowded with players may have no free cell).
GOAL_DRAWS = 8
# The seed of the policies' random weights: fixed, so that the published versions never change.
POLICY_SEED = "cogment-aux-demo-policy"
# The hand-made policy's weight on the goal's offset.
GREEDY_GAIN = 4.0

_FLOAT32 = struct.Struct(f"<{OBSERVATION_SIZE}f")


# ---- policies ----


@dataclass(frozen=True)
class PolicyStage:
    """One of the demo's policies: `greedy_share` of the hand-made weights and the rest random,
    playing a random move with probability `epsilon`."""

    name: str
    description: str
    greedy_share: float
    epsilon: float


STAGES = (
    PolicyStage("untrained", "random weights, half of its moves random", 0.0, 0.5),
    PolicyStage("halfway", "half walking to the goal, a fifth of its moves random", 0.5, 0.2),
    PolicyStage("greedy", "walks to the goal, one move in twenty random", 1.0, 0.05),
)


def _greedy_scores() -> list[list[float]]:
    """The hand-made policy's weights, one row per move: up when the goal is above, and so on."""
    rows = {move: [0.0] * OBSERVATION_SIZE for move in MOVES}
    rows[spec_pb2.UP][3] = GREEDY_GAIN
    rows[spec_pb2.DOWN][3] = -GREEDY_GAIN
    rows[spec_pb2.LEFT][2] = -GREEDY_GAIN
    rows[spec_pb2.RIGHT][2] = GREEDY_GAIN
    return [rows[move] for move in MOVES]


def policy_weights(stage: PolicyStage) -> spec_pb2.PolicyWeights:
    """The parameters of a stage's policy, what its model version holds."""
    rng = random.Random(POLICY_SEED)
    noise = [[rng.uniform(-1.0, 1.0) for _ in range(OBSERVATION_SIZE)] for _ in MOVES]
    greedy = _greedy_scores()
    share = stage.greedy_share
    weights = [
        share * greedy_weight + (1.0 - share) * noise_weight
        for greedy_row, noise_row in zip(greedy, noise, strict=True)
        for greedy_weight, noise_weight in zip(greedy_row, noise_row, strict=True)
    ]
    return spec_pb2.PolicyWeights(
        observation_size=OBSERVATION_SIZE, weights=weights, biases=[0.0] * len(MOVES), epsilon=stage.epsilon
    )


class Policy:
    """Plays the moves a `PolicyWeights` scores best (the first of equal ones), a random one with
    probability epsilon."""

    def __init__(self, weights: spec_pb2.PolicyWeights) -> None:
        size = weights.observation_size
        if size != OBSERVATION_SIZE or len(weights.weights) != size * len(MOVES):
            raise ValueError(
                f"policy weights of {len(weights.weights)} values over observations of {size}: "
                f"expected {OBSERVATION_SIZE * len(MOVES)} over {OBSERVATION_SIZE}"
            )
        if len(weights.biases) != len(MOVES):
            raise ValueError(f"policy weights with {len(weights.biases)} biases: expected {len(MOVES)}")
        values = list(weights.weights)
        self._rows = [values[index * size : (index + 1) * size] for index in range(len(MOVES))]
        self._biases = list(weights.biases)
        self._epsilon = weights.epsilon

    def move(self, observation: Sequence[float], rng: random.Random) -> Move:
        # Two draws on every call, explored or not: a trial's later draws do not depend on it.
        explore = rng.random() < self._epsilon
        random_move = MOVES[rng.randrange(len(MOVES))]
        if explore:
            return random_move
        best_move, best_score = MOVES[0], float("-inf")
        for move, row, bias in zip(MOVES, self._rows, self._biases, strict=True):
            score = bias + sum(weight * value for weight, value in zip(row, observation, strict=True))
            if score > best_score:
                best_move, best_score = move, score
        return best_move


# ---- the environment ----


@dataclass(frozen=True)
class GoalMessage:
    """A `GoalFound` message from the player that reached the goal at `found_tick`."""

    sender: int
    receiver: int
    column: int
    row: int
    found_tick: int


@dataclass(frozen=True)
class LateThanks:
    """A player's reward to the one that reached the goal at `found_tick`, sent later."""

    sender: int
    receiver: int
    found_tick: int


@dataclass(frozen=True)
class Tick:
    """What happens at one tick: every player's observation; on all but the last tick, their
    moves and the environment's reward for each; the messages sent, and the late rewards sent
    during it (for earlier ticks)."""

    tick_id: int
    observations: tuple[tuple[float, ...], ...]
    moves: tuple[Move, ...]  # empty on the last tick
    rewards: tuple[float, ...]  # empty on the last tick
    messages: tuple[GoalMessage, ...]
    thanks: tuple[LateThanks, ...]

    @property
    def last(self) -> bool:
        return not self.moves


def trial_seed(seed: int, index: int) -> int:
    """The seed of a run's `index`-th trial, as `EnvironmentConfig.seed` holds it (63 bits)."""
    digest = hashlib.sha256(f"cogment-aux-demo/{seed}/{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def _float32(values: Sequence[float]) -> tuple[float, ...]:
    """`values` as float32 rounds them: what a player sees is what the Observation carries."""
    return _FLOAT32.unpack(_FLOAT32.pack(*values))


class GatherTrial:
    """One trial of `len(policies)` players (player i plays `policies[i]`) over `ticks` ticks."""

    def __init__(self, seed: int, ticks: int, policies: Sequence[Policy], grid_size: int = GRID_SIZE) -> None:
        if ticks < 1:
            raise ValueError("a trial has at least one tick")
        if not policies:
            raise ValueError("a trial has at least one player")
        if grid_size < 2:
            raise ValueError("the grid has at least 2 columns")
        self.ticks_count = ticks
        self.policies = list(policies)
        self.grid_size = grid_size
        self._rng = random.Random(seed)
        cells = grid_size * grid_size
        self._positions = [divmod(self._rng.randrange(cells), grid_size) for _ in self.policies]
        self._goal = self._new_goal()

    def _new_goal(self) -> tuple[int, int]:
        occupied = set(self._positions)
        cells = self.grid_size * self.grid_size
        goal = divmod(self._rng.randrange(cells), self.grid_size)
        for _ in range(GOAL_DRAWS - 1):
            if goal not in occupied:
                break
            goal = divmod(self._rng.randrange(cells), self.grid_size)
        return goal

    def _observe(self, player: int, tick_id: int) -> tuple[float, ...]:
        column, row = self._positions[player]
        goal_column, goal_row = self._goal
        span = self.grid_size - 1
        progress = tick_id / (self.ticks_count - 1) if self.ticks_count > 1 else 1.0
        return _float32(
            (
                column / span,
                row / span,
                (goal_column - column) / span,
                (goal_row - row) / span,
                progress,
            )
        )

    def _reward(self, player: int, goal: tuple[int, int], reached: bool) -> float:
        """The environment's reward for a player's move towards `goal`."""
        if reached:
            return GOAL_BONUS
        column, row = self._positions[player]
        return -(abs(goal[0] - column) + abs(goal[1] - row)) / (2 * (self.grid_size - 1))

    def _move(self, player: int, move: Move) -> None:
        column, row = self._positions[player]
        step_column, step_row = STEPS[move]
        span = self.grid_size - 1
        self._positions[player] = (min(max(column + step_column, 0), span), min(max(row + step_row, 0), span))

    def ticks(self) -> Iterator[Tick]:
        """The trial's ticks, computed one at a time (a trial may be long)."""
        last_tick = self.ticks_count - 1
        players = range(len(self.policies))
        # Who reached the goal at the previous tick, and where it was.
        finders: frozenset[int] = frozenset()
        found_at = self._goal
        pending: dict[int, list[LateThanks]] = {}  # late rewards, by the tick they are sent at
        for tick_id in range(self.ticks_count):
            observations = tuple(self._observe(player, tick_id) for player in players)
            if tick_id == last_tick:
                yield Tick(tick_id, observations, (), (), (), ())
                return
            messages = []
            found_tick = tick_id - 1
            for finder in sorted(finders):
                for player in players:
                    if player == finder:
                        continue
                    messages.append(GoalMessage(finder, player, found_at[0], found_at[1], found_tick))
                    # Thanked one or two ticks after the find, if players still act then.
                    sent_at = found_tick + 1 + self._rng.randrange(2)
                    if sent_at < last_tick:
                        pending.setdefault(sent_at, []).append(LateThanks(player, finder, found_tick))
            moves = tuple(self.policies[player].move(observations[player], self._rng) for player in players)
            for player, move in zip(players, moves, strict=True):
                self._move(player, move)
            goal = self._goal
            finders = frozenset(player for player in players if self._positions[player] == goal)
            rewards = tuple(self._reward(player, goal, player in finders) for player in players)
            if finders:
                found_at = goal
                self._goal = self._new_goal()
            thanks = tuple(pending.pop(tick_id, ()))
            yield Tick(tick_id, observations, moves, rewards, tuple(messages), thanks)
