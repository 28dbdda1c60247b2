"""Trials for the console's tests: the three actors of tests.helpers.datastore (alice and bob of
class1, carol of class2), class1's observations and actions being the demo's messages (which the
console decodes when given them), with rewards."""

from __future__ import annotations

import random

from services.demo.api import spec_pb2
from shared.api import common_pb2, datalog_pb2
from tests.helpers.datastore import trial_params


def observation(tick: int) -> bytes:
    return spec_pb2.Observation(values=[tick / 10, -1.0]).SerializeToString()


def sample(
    tick: int, state: int = common_pb2.RUNNING, rewards: dict[str, float] | None = None
) -> datalog_pb2.DatalogSample:
    message = datalog_pb2.DatalogSample(
        info=datalog_pb2.SampleInfo(tick_id=tick, timestamp=1000 + tick, state=state)
    )
    message.observations.observations.append(observation(tick))
    message.observations.actors_map.extend([0, 0, 0])
    action = common_pb2.Action(content=spec_pb2.Action(move=spec_pb2.RIGHT).SerializeToString())
    message.actions.extend([action] * 3)
    for receiver, value in (rewards or {}).items():
        source = common_pb2.RewardSource(sender_name="env", value=value, confidence=1)
        message.rewards.append(common_pb2.Reward(receiver_name=receiver, tick_id=tick, sources=[source]))
    return message


def rewarded_trial(ticks: int, seed: int = 0) -> list[datalog_pb2.DatalogSample]:
    """A trial that ends at its last tick, each actor rewarded at random every tick."""
    draw = random.Random(seed)
    return [
        sample(
            tick,
            common_pb2.ENDED if tick == ticks - 1 else common_pb2.RUNNING,
            {name: round(draw.uniform(-1, 1), 2) for name in ("alice", "bob", "carol")},
        )
        for tick in range(ticks)
    ]


def trial_inputs(
    samples: list[datalog_pb2.DatalogSample], with_params: bool = True, **properties: str
) -> list[datalog_pb2.RunTrialDatalogInput]:
    """What the orchestrator writes on a datalog stream: the parameters first (once), then samples."""
    inputs = [datalog_pb2.RunTrialDatalogInput(sample=one) for one in samples]
    if with_params:
        inputs.insert(0, datalog_pb2.RunTrialDatalogInput(trial_params=trial_params(**properties)))
    return inputs
