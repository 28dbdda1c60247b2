"""What the Cogment 2.x orchestrator would log of the demo's trials: their parameters and the
`DatalogSample`s of their ticks, in the order and shape it sends them on its `DatalogSP` stream
(`docs/compatibility.md`, "Datastore ingestion" and "Datastore conversion"). Pure: the
messages of a trial are built as its stream asks for them.

How the 2.x orchestrator logs a trial, which the demo follows:

* The first message holds the `TrialParams`; each tick then gives one sample: its info (tick id,
  timestamp in ns, the trial's state), the environment's `ObservationSet` (one observation per
  player here, `actors_map` pointing each player to its own), one `Action` per actor, the rewards
  for that tick and the messages sent during it.
* It keeps the current tick's sample (its `nb_buffered_ticks`, 2 by default, holds the current
  tick and the one being sent), so a reward for an earlier tick cannot join that tick's sample:
  it is sent at once as an out-of-sync sample: `out_of_sync` set, the past tick's id, no state, no
  observations or actions, only the reward. It goes out before the current tick's sample.
* When the environment ends the trial, the last sample carries its final observations, the state
  ENDED, and one empty action per actor with the tick id of an action never received (-2): no
  actor acts on the final observations.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from google.protobuf import any_pb2

from services.demo.api import spec_pb2
from services.demo.world import (
    GRID_SIZE,
    STAGES,
    THANKS_CONFIDENCE,
    THANKS_VALUE,
    GatherTrial,
    GoalMessage,
    LateThanks,
    Policy,
    PolicyStage,
    Tick,
)
from shared.api import common_pb2, datalog_pb2
from shared.api import environment_pb2 as env

ENVIRONMENT_NAME = "env"  # the orchestrator's default
ENVIRONMENT_IMPLEMENTATION = "cogment-aux-demo-gather"
ACTOR_CLASS = "player"
ACTOR_ENDPOINT = "cogment://discover"  # found through the directory, by class and implementation
NB_BUFFERED_TICKS = 2  # the orchestrator's default
# The tick id the orchestrator gives an action it never received.
NO_DATA_TICK_ID = -2
# The orchestrator's special events, spelt as it spells them (the datastore does not store them).
ENDED_EVENT = "Evironment ended trial"
OUT_OF_SYNC_EVENT = "Out of sync reward"


@dataclass(frozen=True)
class PlayerPolicy:
    """What a player plays: a stage's weights, and the model version holding them
    (`model_version` 0: not published to a registry)."""

    stage: PolicyStage
    weights: spec_pb2.PolicyWeights
    model_id: str
    model_version: int

    @property
    def implementation(self) -> str:
        return f"demo-policy-{self.stage.name}"


@dataclass
class TrialCounts:
    """What was sent of a trial's datalog, counted as its messages are built."""

    samples: int = 0  # every sample, out-of-sync ones included
    ticks: int = 0
    late_rewards: int = 0  # out-of-sync samples
    messages: int = 0


@dataclass(frozen=True)
class TrialPlan:
    """One trial of the demo: its id, its seed, how many ticks, who plays what, and how it is
    described in its parameters."""

    trial_id: str
    seed: int
    ticks: int
    players: tuple[PlayerPolicy, ...]
    properties: Mapping[str, str] = field(default_factory=dict)
    datalog_endpoint: str = ""
    grid_size: int = GRID_SIZE

    @staticmethod
    def actor_name(player: int) -> str:
        return f"player-{player + 1}"

    def params(self) -> common_pb2.TrialParams:
        """The trial's parameters, as the orchestrator sends them first (with its defaults
        applied: the environment's name)."""
        config = spec_pb2.EnvironmentConfig(grid_size=self.grid_size, ticks=self.ticks, seed=self.seed)
        return common_pb2.TrialParams(
            datalog=common_pb2.DatalogParams(endpoint=self.datalog_endpoint),
            environment=common_pb2.EnvironmentParams(
                name=ENVIRONMENT_NAME,
                endpoint=ACTOR_ENDPOINT,
                implementation=ENVIRONMENT_IMPLEMENTATION,
                config=common_pb2.SerializedMessage(content=config.SerializeToString()),
            ),
            actors=[
                common_pb2.ActorParams(
                    name=self.actor_name(index),
                    actor_class=ACTOR_CLASS,
                    endpoint=ACTOR_ENDPOINT,
                    implementation=player.implementation,
                    config=common_pb2.SerializedMessage(
                        content=spec_pb2.ActorConfig(
                            model_id=player.model_id,
                            model_version=player.model_version,
                            policy_stage=player.stage.name,
                        ).SerializeToString()
                    ),
                )
                for index, player in enumerate(self.players)
            ],
            # A bound the environment's own end comes before.
            max_steps=self.ticks,
            nb_buffered_ticks=NB_BUFFERED_TICKS,
            properties=dict(self.properties),
        )

    def datalog_inputs(self, counts: TrialCounts) -> Iterator[datalog_pb2.RunTrialDatalogInput]:
        """The messages of the trial's datalog stream, in order, each built when asked for (its
        timestamp is then): the parameters, then per tick the late rewards sent during it and
        the tick's sample. `counts` follows what was built."""
        yield datalog_pb2.RunTrialDatalogInput(trial_params=self.params())
        world = GatherTrial(
            self.seed, self.ticks, [Policy(player.weights) for player in self.players], self.grid_size
        )
        for tick in world.ticks():
            for thanks in tick.thanks:
                counts.samples += 1
                counts.late_rewards += 1
                yield datalog_pb2.RunTrialDatalogInput(sample=self._late_reward(thanks))
            counts.samples += 1
            counts.ticks += 1
            counts.messages += len(tick.messages)
            yield datalog_pb2.RunTrialDatalogInput(sample=self._tick_sample(tick))

    def _tick_sample(self, tick: Tick) -> datalog_pb2.DatalogSample:
        now = time.time_ns()
        tick_id = tick.tick_id
        sample = datalog_pb2.DatalogSample(
            info=datalog_pb2.SampleInfo(
                tick_id=tick_id,
                timestamp=now,
                state=common_pb2.ENDED if tick.last else common_pb2.RUNNING,
                special_events=[ENDED_EVENT] if tick.last else [],
            ),
            observations=env.ObservationSet(
                tick_id=tick_id,
                timestamp=now,
                observations=[
                    spec_pb2.Observation(values=values).SerializeToString() for values in tick.observations
                ],
                actors_map=range(len(tick.observations)),
            ),
        )
        if tick.last:
            sample.actions.extend(common_pb2.Action(tick_id=NO_DATA_TICK_ID) for _ in self.players)
            return sample
        sample.actions.extend(
            common_pb2.Action(
                tick_id=tick_id,
                timestamp=now,
                content=spec_pb2.Action(move=move).SerializeToString(),
            )
            for move in tick.moves
        )
        sample.rewards.extend(
            common_pb2.Reward(
                tick_id=tick_id,
                receiver_name=self.actor_name(player),
                value=value,
                sources=[common_pb2.RewardSource(sender_name=ENVIRONMENT_NAME, value=value, confidence=1.0)],
            )
            for player, value in enumerate(tick.rewards)
        )
        sample.messages.extend(self._message(tick_id, message) for message in tick.messages)
        return sample

    def _message(self, tick_id: int, message: GoalMessage) -> common_pb2.Message:
        payload = any_pb2.Any()
        payload.Pack(spec_pb2.GoalFound(column=message.column, row=message.row, tick_id=message.found_tick))
        return common_pb2.Message(
            tick_id=tick_id,
            sender_name=self.actor_name(message.sender),
            receiver_name=self.actor_name(message.receiver),
            payload=payload,
        )

    def _late_reward(self, thanks: LateThanks) -> datalog_pb2.DatalogSample:
        user_data = any_pb2.Any()
        user_data.Pack(spec_pb2.Thanks(found_tick_id=thanks.found_tick))
        return datalog_pb2.DatalogSample(
            info=datalog_pb2.SampleInfo(
                tick_id=thanks.found_tick,
                timestamp=time.time_ns(),
                out_of_sync=True,
                special_events=[OUT_OF_SYNC_EVENT],
            ),
            rewards=[
                common_pb2.Reward(
                    tick_id=thanks.found_tick,
                    receiver_name=self.actor_name(thanks.receiver),
                    value=THANKS_VALUE,
                    sources=[
                        common_pb2.RewardSource(
                            sender_name=self.actor_name(thanks.sender),
                            value=THANKS_VALUE,
                            confidence=THANKS_CONFIDENCE,
                            user_data=user_data,
                        )
                    ],
                )
            ],
        )


def players_of(
    trial_index: int, actors: int, policies: Mapping[str, PlayerPolicy]
) -> tuple[PlayerPolicy, ...]:
    """Who plays what in a run's `trial_index`-th trial (`policies`: by stage name): the stages in
    turn, shifted by one per trial, so that every trial of two players or more mixes them."""
    return tuple(policies[STAGES[(trial_index + player) % len(STAGES)].name] for player in range(actors))
