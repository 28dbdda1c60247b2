"""The Trial Datastore's pure sample transformations: datalog conversion
(docs/compatibility.md#datastore-conversion) and the RetrieveSamples filter
(docs/compatibility.md#sample-filter), including the reference's own test cases."""

from __future__ import annotations

import struct
from collections.abc import Sequence

import pytest
from google.protobuf import any_pb2
from hypothesis import given, settings
from hypothesis import strategies as st

from services.datastore.conversion import DatalogConverter
from services.datastore.sample_filter import SampleFilter
from shared.api import common_pb2, datalog_pb2, environment_pb2, trial_datastore_pb2
from shared.errors import InvalidArgument

OBSERVATION = trial_datastore_pb2.STORED_TRIAL_SAMPLE_FIELD_OBSERVATION
ACTION = trial_datastore_pb2.STORED_TRIAL_SAMPLE_FIELD_ACTION
REWARD = trial_datastore_pb2.STORED_TRIAL_SAMPLE_FIELD_REWARD
RECEIVED_REWARDS = trial_datastore_pb2.STORED_TRIAL_SAMPLE_FIELD_RECEIVED_REWARDS
SENT_REWARDS = trial_datastore_pb2.STORED_TRIAL_SAMPLE_FIELD_SENT_REWARDS
RECEIVED_MESSAGES = trial_datastore_pb2.STORED_TRIAL_SAMPLE_FIELD_RECEIVED_MESSAGES
SENT_MESSAGES = trial_datastore_pb2.STORED_TRIAL_SAMPLE_FIELD_SENT_MESSAGES
ALL_BUT_REWARD = [OBSERVATION, ACTION, RECEIVED_REWARDS, SENT_REWARDS, RECEIVED_MESSAGES, SENT_MESSAGES]


def trial_params(*actors: tuple[str, str] | tuple[str, str, str]) -> common_pb2.TrialParams:
    """Params with actors given as (name, class) or (name, class, implementation)."""
    return common_pb2.TrialParams(
        actors=[
            common_pb2.ActorParams(name=a[0], actor_class=a[1], implementation=a[2] if len(a) > 2 else "")
            for a in actors
        ]
    )


# The reference's datalog test trial.
FOUR_ACTORS = trial_params(
    ("myactor", "class1"), ("myactor2", "class1"), ("myactor3", "class2"), ("myactor4", "class2")
)


def converter(params: common_pb2.TrialParams = FOUR_ACTORS) -> DatalogConverter:
    return DatalogConverter("my-trial", "my-user", params)


def info(
    tick_id: int = 0,
    state: common_pb2.TrialState.ValueType = common_pb2.RUNNING,
    timestamp: int = 0,
    out_of_sync: bool = False,
) -> datalog_pb2.SampleInfo:
    return datalog_pb2.SampleInfo(tick_id=tick_id, state=state, timestamp=timestamp, out_of_sync=out_of_sync)


def packed(value: bytes) -> any_pb2.Any:
    return any_pb2.Any(type_url="type.googleapis.com/some.Message", value=value)


def reward(receiver: str, *sources: common_pb2.RewardSource, value: float = 0.0) -> common_pb2.Reward:
    return common_pb2.Reward(receiver_name=receiver, value=value, sources=sources)


def source(
    value: float, confidence: float, sender: str = "", user_data: bytes | None = None
) -> common_pb2.RewardSource:
    return common_pb2.RewardSource(
        sender_name=sender,
        value=value,
        confidence=confidence,
        user_data=packed(user_data) if user_data is not None else None,
    )


# ---------------------------------------------------------------------------------------------------------
# DatalogConverter


def test_header_and_one_actor_sample_per_actor_even_without_data() -> None:
    sample = datalog_pb2.DatalogSample(info=info(tick_id=42, state=common_pb2.ENDED, timestamp=1_700_000_000))

    stored = converter().convert(sample)

    assert stored.user_id == "my-user"  # the reference left it empty
    assert stored.trial_id == "my-trial"
    assert stored.tick_id == 42
    assert stored.timestamp == 1_700_000_000
    assert stored.state == common_pb2.ENDED
    assert [actor.actor for actor in stored.actor_samples] == [0, 1, 2, 3]
    for actor in stored.actor_samples:
        assert actor == trial_datastore_pb2.StoredTrialActorSample(actor=actor.actor)
    assert list(stored.payloads) == []


def test_trial_without_actors() -> None:
    stored = DatalogConverter("t", "u", common_pb2.TrialParams()).convert(
        datalog_pb2.DatalogSample(
            info=info(), rewards=[reward("*", source(1, 1))], messages=[common_pb2.Message(sender_name="x")]
        )
    )
    assert len(stored.actor_samples) == 0
    assert list(stored.payloads) == [b""]  # the message payload is still stored once


def test_reward_only_sample() -> None:
    # The reference's first datalog sample: one reward for one actor, nothing else.
    stored = converter().convert(
        datalog_pb2.DatalogSample(info=info(), rewards=[reward("myactor", source(12, 1), value=12)])
    )

    first = stored.actor_samples[0]
    assert not first.HasField("action")
    assert not first.HasField("observation")
    assert first.reward == 12.0
    assert [r.sender for r in first.received_rewards] == [-1]
    for other in stored.actor_samples[1:]:
        assert not other.HasField("reward")
        assert len(other.received_rewards) == 0


def test_reference_wildcard_reward_example() -> None:
    # The reference's test-verified example (datalogServer_test.go, TestRunTrialDatalogSimple).
    user_data = b"serialized user data"
    sample = datalog_pb2.DatalogSample(
        info=info(),
        rewards=[
            reward("*", source(12, 1, user_data=user_data), value=12),
            reward("myactor", source(24, 0.5), value=8),
            reward("*.*", source(24, 0.5), value=8),
            reward("class2.*", source(6, 1), value=8),
            reward("class2.myactor4", source(60, 0.5), value=8),
            reward("", source(24, 0.5), value=8),  # dropped
            reward("class1", source(24, 0.5), value=8),  # dropped: a bare class name is no receiver
        ],
    )

    stored = converter().convert(sample)

    assert [actor.reward for actor in stored.actor_samples] == [18.0, 16.0, 12.0, 20.0]
    assert [len(actor.received_rewards) for actor in stored.actor_samples] == [3, 2, 3, 4]
    fourth = stored.actor_samples[3]
    assert fourth.received_rewards[0].HasField("user_data")
    assert stored.payloads[fourth.received_rewards[0].user_data] == user_data  # Any value, type_url dropped
    for received in fourth.received_rewards[1:]:
        assert not received.HasField("user_data")
    # The user data is stored once per receiver of the wildcard reward, in actor order.
    assert list(stored.payloads) == [user_data] * 4
    assert [actor.received_rewards[0].user_data for actor in stored.actor_samples] == [0, 1, 2, 3]
    # Sources without an actor sender: -1, and nobody has sent rewards.
    for actor in stored.actor_samples:
        assert all(received.sender == -1 for received in actor.received_rewards)
        assert len(actor.sent_rewards) == 0
    # Received entries are in reward order.
    assert [(r.reward, r.confidence) for r in stored.actor_samples[0].received_rewards] == [
        (12, 1),
        (24, 0.5),
        (24, 0.5),
    ]


def test_observations_are_stored_once_and_shared() -> None:
    sample = datalog_pb2.DatalogSample(
        info=info(),
        observations=environment_pb2.ObservationSet(
            observations=[b"obs-a", b"obs-b"], actors_map=[1, 0, 1, 1]
        ),
    )

    stored = converter().convert(sample)

    assert list(stored.payloads) == [b"obs-a", b"obs-b"]
    assert [actor.observation for actor in stored.actor_samples] == [1, 0, 1, 1]


def test_actors_map_shorter_than_actors_leaves_the_others_without_observation() -> None:
    sample = datalog_pb2.DatalogSample(
        info=info(), observations=environment_pb2.ObservationSet(observations=[b"obs"], actors_map=[0])
    )

    stored = converter().convert(sample)

    assert stored.actor_samples[0].observation == 0
    assert [actor.HasField("observation") for actor in stored.actor_samples] == [True, False, False, False]


def test_unused_observations_are_stored_too() -> None:
    sample = datalog_pb2.DatalogSample(
        info=info(),
        observations=environment_pb2.ObservationSet(observations=[b"o0", b"o1", b"o2"], actors_map=[2]),
    )
    stored = converter().convert(sample)
    assert list(stored.payloads) == [b"o0", b"o1", b"o2"]
    assert stored.actor_samples[0].observation == 2


def test_reference_observation_and_action_sample() -> None:
    sample = datalog_pb2.DatalogSample(
        info=info(tick_id=1, state=common_pb2.ENDED),
        observations=environment_pb2.ObservationSet(
            tick_id=1, observations=[b"an_observation"], actors_map=[0]
        ),
        actions=[common_pb2.Action(tick_id=1, content=b"an_action")],
    )

    stored = converter().convert(sample)

    first = stored.actor_samples[0]
    assert stored.payloads[first.action] == b"an_action"
    assert stored.payloads[first.observation] == b"an_observation"
    assert not first.HasField("reward")


def test_one_action_payload_per_entry_even_when_empty() -> None:
    sample = datalog_pb2.DatalogSample(
        info=info(),
        observations=environment_pb2.ObservationSet(observations=[b"obs"], actors_map=[0, 0, 0, 0]),
        actions=[
            common_pb2.Action(content=b"act-0"),
            common_pb2.Action(),  # default or unavailable actor: the placeholder stays empty
            common_pb2.Action(content=b"act-2"),
            common_pb2.Action(),
        ],
        default_actors=[1],
        unavailable_actors=[3],
    )

    stored = converter().convert(sample)

    assert list(stored.payloads) == [b"obs", b"act-0", b"", b"act-2", b""]
    assert [actor.action for actor in stored.actor_samples] == [1, 2, 3, 4]


def test_actor_to_actor_reward_with_user_data() -> None:
    sample = datalog_pb2.DatalogSample(
        info=info(),
        rewards=[reward("myactor3", source(2, 0.25, sender="myactor", user_data=b"why"))],
    )

    stored = converter().convert(sample)

    sender, _, receiver, _ = stored.actor_samples
    assert list(stored.payloads) == [b"why"]
    # Both ends on both entries (the reference left the owner's own index at 0).
    entry = trial_datastore_pb2.StoredTrialActorSampleReward(
        sender=0, receiver=2, reward=2, confidence=0.25, user_data=0
    )
    assert receiver.received_rewards[0] == entry
    assert sender.sent_rewards[0] == entry
    assert receiver.reward == 2.0
    assert not sender.HasField("reward")  # sending does not make an actor targeted
    assert len(receiver.sent_rewards) == 0


def test_environment_sent_reward_has_no_sent_rewards_entry() -> None:
    sample = datalog_pb2.DatalogSample(
        info=info(), rewards=[reward("myactor2", source(5, 1, sender="env"), source(7, 1, sender="unknown"))]
    )

    stored = converter().convert(sample)

    assert [r.sender for r in stored.actor_samples[1].received_rewards] == [-1, -1]
    assert all(len(actor.sent_rewards) == 0 for actor in stored.actor_samples)
    assert stored.actor_samples[1].reward == 6.0


def test_empty_user_data_is_not_stored() -> None:
    sample = datalog_pb2.DatalogSample(info=info(), rewards=[reward("myactor", source(1, 1, user_data=b""))])
    stored = converter().convert(sample)
    assert list(stored.payloads) == []
    assert not stored.actor_samples[0].received_rewards[0].HasField("user_data")


def test_reward_without_sources_sets_aggregate_zero() -> None:
    stored = converter().convert(
        datalog_pb2.DatalogSample(info=info(), rewards=[reward("myactor2", value=99)])
    )

    second = stored.actor_samples[1]
    assert second.HasField("reward")
    assert second.reward == 0.0  # Reward.value (the orchestrator's aggregate) is ignored
    assert len(second.received_rewards) == 0
    assert not stored.actor_samples[0].HasField("reward")


def test_aggregate_counts_only_positive_confidences() -> None:
    stored = converter().convert(
        datalog_pb2.DatalogSample(
            info=info(),
            rewards=[
                reward("myactor", source(100, 0), source(4, 1), source(10, 0.5)),
                reward("myactor2", source(5, 0), source(7, -1)),
            ],
        )
    )

    first, second = stored.actor_samples[0], stored.actor_samples[1]
    assert (
        first.reward == 6.0
    )  # (4 * 1 + 10 * 0.5) / 1.5; the zero-confidence source is recorded but unweighted
    assert [r.reward for r in first.received_rewards] == [100, 4, 10]
    assert second.HasField("reward")
    assert second.reward == 0.0  # total confidence 0
    assert [(r.reward, r.confidence) for r in second.received_rewards] == [(5, 0), (7, -1)]


def test_aggregate_spans_all_rewards_of_the_sample() -> None:
    stored = converter().convert(
        datalog_pb2.DatalogSample(
            info=info(), rewards=[reward("myactor4", source(1, 1)), reward("class2.myactor4", source(3, 1))]
        )
    )
    assert stored.actor_samples[3].reward == 2.0


def test_wildcard_receivers_in_actor_order() -> None:
    params = trial_params(("d", "c2"), ("a", "c1"), ("c", "c2"), ("b", "c1"))
    sample = datalog_pb2.DatalogSample(
        info=info(),
        rewards=[
            reward("*", source(1, 1, sender="b", user_data=b"star")),
            reward("c2.*", source(2, 1, sender="b", user_data=b"class")),
        ],
    )

    stored = converter(params).convert(sample)

    # One user data payload per receiver, appended in actor index order.
    assert list(stored.payloads) == [b"star"] * 4 + [b"class"] * 2
    assert [(r.receiver, r.user_data) for r in stored.actor_samples[3].sent_rewards] == [
        (0, 0),
        (1, 1),
        (2, 2),
        (3, 3),
        (0, 4),
        (2, 5),
    ]
    # The sender rewarding itself through a wildcard gets both entries.
    assert [r.sender for r in stored.actor_samples[3].received_rewards] == [3]


@pytest.mark.parametrize(
    "receiver",
    [
        "",
        "class1",
        "environment",
        "unknown",
        "*.myactor",
        "class3.*",
        "class1.myactor3",
        "myactor.class1",
        "**",
    ],
)
def test_unresolvable_receivers_are_dropped(receiver: str) -> None:
    sample = datalog_pb2.DatalogSample(
        info=info(), rewards=[reward(receiver, source(1, 1, sender="myactor", user_data=b"lost"))]
    )

    stored = converter().convert(sample)

    assert list(stored.payloads) == []
    for actor in stored.actor_samples:
        assert actor == trial_datastore_pb2.StoredTrialActorSample(actor=actor.actor)


def test_class_name_receiver_is_split_at_the_first_dot() -> None:
    params = trial_params(("agent.v2", "team"), ("other", "team"))
    sample = datalog_pb2.DatalogSample(
        info=info(),
        rewards=[
            reward("team.agent.v2", source(5, 1)),  # class `team`, name `agent.v2`
            reward("agent.v2", source(7, 1)),  # read as class `agent`: nobody
        ],
        messages=[common_pb2.Message(sender_name="agent.v2", receiver_name="other")],  # exact names
    )

    stored = converter(params).convert(sample)

    assert stored.actor_samples[0].reward == 5.0
    assert not stored.actor_samples[1].HasField("reward")
    assert stored.actor_samples[1].received_messages[0].sender == 0


def test_duplicate_actor_names() -> None:
    params = trial_params(("twin", "c1"), ("twin", "c2"), ("solo", "c2"))
    sample = datalog_pb2.DatalogSample(
        info=info(),
        actions=[common_pb2.Action(content=b"x"), common_pb2.Action(content=b"y"), common_pb2.Action()],
        rewards=[reward("twin", source(1, 1, sender="twin")), reward("c2.twin", source(2, 1))],
        messages=[common_pb2.Message(sender_name="solo", receiver_name="twin")],
    )

    stored = converter(params).convert(sample)

    # One actor sample per params entry; a bare name is the first actor with it, `class.name` is exact.
    assert [actor.actor for actor in stored.actor_samples] == [0, 1, 2]
    assert [actor.action for actor in stored.actor_samples] == [0, 1, 2]
    assert stored.actor_samples[0].reward == 1.0
    assert stored.actor_samples[1].reward == 2.0
    assert [r.receiver for r in stored.actor_samples[0].sent_rewards] == [0]
    assert len(stored.actor_samples[0].received_messages) == 1
    assert len(stored.actor_samples[1].received_messages) == 0


def test_messages() -> None:
    sample = datalog_pb2.DatalogSample(
        info=info(),
        messages=[
            common_pb2.Message(sender_name="env", receiver_name="myactor2", payload=packed(b"from env")),
            common_pb2.Message(sender_name="myactor", receiver_name="myactor4", payload=packed(b"hello")),
            common_pb2.Message(sender_name="myactor3", receiver_name="env", payload=packed(b"to env")),
            common_pb2.Message(sender_name="myactor", receiver_name="*"),  # no wildcards; unset payload
            common_pb2.Message(sender_name="nobody", receiver_name="class1.myactor"),  # nobody at all
        ],
    )

    stored = converter().convert(sample)

    assert list(stored.payloads) == [b"from env", b"hello", b"to env", b"", b""]
    a0, a1, a2, a3 = stored.actor_samples
    message = trial_datastore_pb2.StoredTrialActorSampleMessage
    assert list(a1.received_messages) == [message(sender=-1, receiver=1, payload=0)]
    assert list(a3.received_messages) == [message(sender=0, receiver=3, payload=1)]
    assert list(a0.sent_messages) == [
        message(sender=0, receiver=3, payload=1),
        message(sender=0, receiver=-1, payload=3),
    ]
    assert list(a2.sent_messages) == [message(sender=2, receiver=-1, payload=2)]
    assert len(a0.received_messages) == len(a2.received_messages) == 0
    assert len(a1.sent_messages) == len(a3.sent_messages) == 0


def test_payload_order_observations_actions_rewards_messages() -> None:
    sample = datalog_pb2.DatalogSample(
        info=info(),
        messages=[
            common_pb2.Message(sender_name="myactor", receiver_name="myactor2", payload=packed(b"msg"))
        ],
        rewards=[reward("myactor2", source(1, 1, user_data=b"ud"))],
        actions=[common_pb2.Action(content=b"act")],
        observations=environment_pb2.ObservationSet(observations=[b"obs"], actors_map=[0]),
    )
    stored = converter().convert(sample)
    assert list(stored.payloads) == [b"obs", b"act", b"ud", b"msg"]


def test_out_of_sync_sample_is_converted_like_the_others() -> None:
    sample = datalog_pb2.DatalogSample(
        info=info(tick_id=3, state=common_pb2.UNKNOWN, out_of_sync=True),
        rewards=[reward("myactor", source(-1, 1, sender="myactor2"))],
    )

    stored = converter().convert(sample)

    assert stored.tick_id == 3
    assert stored.state == common_pb2.UNKNOWN
    assert stored.actor_samples[0].reward == -1.0
    assert len(stored.actor_samples[1].sent_rewards) == 1
    assert not any(
        actor.HasField("observation") or actor.HasField("action") for actor in stored.actor_samples
    )


def test_converter_keeps_no_state_between_samples() -> None:
    convert = converter().convert
    first = convert(datalog_pb2.DatalogSample(info=info(tick_id=0), rewards=[reward("*", source(1, 1))]))
    second = convert(
        datalog_pb2.DatalogSample(info=info(tick_id=1), rewards=[reward("myactor", source(3, 1))])
    )

    assert [actor.reward for actor in first.actor_samples] == [1.0] * 4
    assert second.actor_samples[0].reward == 3.0
    assert [actor.HasField("reward") for actor in second.actor_samples] == [True, False, False, False]


def test_converted_sample_round_trips_through_bytes() -> None:
    sample = datalog_pb2.DatalogSample(
        info=info(tick_id=7),
        observations=environment_pb2.ObservationSet(observations=[b"o"], actors_map=[0, 0, 0, 0]),
        rewards=[reward("*", source(1, 1, user_data=b"u"))],
    )
    stored = converter().convert(sample)
    assert trial_datastore_pb2.StoredTrialSample.FromString(stored.SerializeToString()) == stored


def test_sample_without_info_is_invalid() -> None:
    with pytest.raises(InvalidArgument, match="without `info`"):
        converter().convert(datalog_pb2.DatalogSample(actions=[common_pb2.Action()]))


@pytest.mark.parametrize(
    ("actors_map", "message"),
    [
        (
            [0, 2],
            r"actors_map\[1\] = 2 is not an observation index \(2 observations: allowed indices are 0 to 1\)",
        ),
        (
            [0, -1],
            r"actors_map\[1\] = -1 is not an observation index \(2 observations: allowed indices are 0 to",
        ),
        (
            [0, 1, 0, 1, 0],
            r"actors_map has 5 entries: entry 4 has no actor \(4 actors: allowed indices are 0 to 3\)",
        ),
    ],
)
def test_actors_map_out_of_range_is_invalid(actors_map: list[int], message: str) -> None:
    sample = datalog_pb2.DatalogSample(
        info=info(),
        observations=environment_pb2.ObservationSet(observations=[b"a", b"b"], actors_map=actors_map),
    )
    with pytest.raises(InvalidArgument, match=message):
        converter().convert(sample)


def test_actors_map_without_observations_is_invalid() -> None:
    sample = datalog_pb2.DatalogSample(
        info=info(), observations=environment_pb2.ObservationSet(actors_map=[0])
    )
    with pytest.raises(InvalidArgument, match=r"actors_map\[0\] = 0 .*there is no observation"):
        converter().convert(sample)


def test_more_actions_than_actors_is_invalid() -> None:
    sample = datalog_pb2.DatalogSample(info=info(), actions=[common_pb2.Action()] * 5)
    with pytest.raises(
        InvalidArgument, match=r"actions has 5 entries: entry 4 has no actor \(4 actors: allowed"
    ):
        converter().convert(sample)
    with pytest.raises(
        InvalidArgument, match=r"entry 1 has no actor \(1 actor: allowed indices are 0 to 0\)"
    ):
        converter(trial_params(("a", "c"))).convert(sample)
    with pytest.raises(
        InvalidArgument, match=r"entry 0 has no actor \(there is no actor, so no index is allowed\)"
    ):
        converter(common_pb2.TrialParams()).convert(sample)


# ---------------------------------------------------------------------------------------------------------
# DatalogConverter against a message-building reference: the converter encodes samples itself, this builds
# them field by field from the rules above, written for clarity, not speed.


class ReferenceConverter:
    """DatalogConverter's behaviour, building the StoredTrialSample message field by field."""

    def __init__(self, trial_id: str, user_id: str, params: common_pb2.TrialParams) -> None:
        self.trial_id = trial_id
        self.user_id = user_id
        self.actors = [(actor.name, actor.actor_class) for actor in params.actors]

    def index(self, name: str) -> int:
        """Exact names: the first actor with the name, -1 for the environment and unknown names."""
        return next((index for index, (actor, _) in enumerate(self.actors) if actor == name), -1)

    def receivers(self, name: str) -> list[int]:
        """`*` and `*.*`: everyone; `class.name`, split at the first dot (`name` may be `*`); a bare name."""
        if name in ("*", "*.*"):
            return list(range(len(self.actors)))
        if "." in name:
            actor_class, actor_name = name.split(".", 1)
            return [
                index
                for index, (actor, class_) in enumerate(self.actors)
                if class_ == actor_class and actor_name in ("*", actor)
            ]
        index = self.index(name)
        return [index] if index >= 0 else []

    def convert(self, sample: datalog_pb2.DatalogSample) -> trial_datastore_pb2.StoredTrialSample:
        if not sample.HasField("info"):
            raise InvalidArgument(
                "DatalogSample without `info` (tick id, timestamp, state): the datastore needs it, "
                "do not exclude the `info` field from the datalog"
            )
        count = len(self.actors)
        stored = trial_datastore_pb2.StoredTrialSample(
            user_id=self.user_id,
            trial_id=self.trial_id,
            tick_id=sample.info.tick_id,
            timestamp=sample.info.timestamp,
            state=sample.info.state,
        )
        actors = [stored.actor_samples.add(actor=index) for index in range(count)]
        payloads: list[bytes] = []

        if sample.HasField("observations"):
            actors_map = sample.observations.actors_map
            observations = sample.observations.observations
            if len(actors_map) > count:
                raise InvalidArgument(
                    f"DatalogSample.observations.actors_map has {len(actors_map)} entries: entry "
                    f"{count} has no actor ({allowed(count, 'actor')})"
                )
            payloads.extend(observations)
            for actor, observation in enumerate(actors_map):
                if not 0 <= observation < len(observations):
                    raise InvalidArgument(
                        f"DatalogSample.observations.actors_map[{actor}] = {observation} is not an "
                        f"observation index ({allowed(len(observations), 'observation')})"
                    )
                actors[actor].observation = observation

        if len(sample.actions) > count:
            raise InvalidArgument(
                f"DatalogSample.actions has {len(sample.actions)} entries: entry {count} has no actor "
                f"({allowed(count, 'actor')})"
            )
        for actor, action in enumerate(sample.actions):
            actors[actor].action = len(payloads)
            payloads.append(action.content)

        sums: dict[int, list[float]] = {}  # targeted actor: [weighted sum, confidence sum]
        for reward in sample.rewards:
            for receiver in self.receivers(reward.receiver_name):
                totals = sums.setdefault(receiver, [0.0, 0.0])
                for source in reward.sources:
                    if source.confidence > 0:
                        totals[0] += source.value * source.confidence
                        totals[1] += source.confidence
                    entry = trial_datastore_pb2.StoredTrialActorSampleReward(
                        sender=self.index(source.sender_name),
                        receiver=receiver,
                        reward=source.value,
                        confidence=source.confidence,
                    )
                    if source.user_data.value:
                        entry.user_data = len(payloads)
                        payloads.append(source.user_data.value)
                    actors[receiver].received_rewards.append(entry)
                    if entry.sender >= 0:
                        actors[entry.sender].sent_rewards.append(entry)
        for receiver, (weighted, confidence) in sums.items():
            actors[receiver].reward = weighted / confidence if confidence > 0 else 0.0

        for message in sample.messages:
            entry_message = trial_datastore_pb2.StoredTrialActorSampleMessage(
                sender=self.index(message.sender_name),
                receiver=self.index(message.receiver_name),
                payload=len(payloads),
            )
            payloads.append(message.payload.value)
            if entry_message.receiver >= 0:
                actors[entry_message.receiver].received_messages.append(entry_message)
            if entry_message.sender >= 0:
                actors[entry_message.sender].sent_messages.append(entry_message)

        stored.payloads.extend(payloads)
        return stored


def allowed(count: int, what: str) -> str:
    if count == 0:
        return f"there is no {what}, so no index is allowed"
    return f"{count} {what}{'s' if count > 1 else ''}: allowed indices are 0 to {count - 1}"


def assert_converted_as_reference(
    params: common_pb2.TrialParams, samples: Sequence[datalog_pb2.DatalogSample]
) -> None:
    """One converter converts `samples` in order (reusing its plans) as the reference does: the same
    message, or the same error."""
    fast = DatalogConverter("the-trial", "the-user", params)
    reference = ReferenceConverter("the-trial", "the-user", params)
    for sample in samples:
        try:
            expected: bytes | str = reference.convert(sample).SerializeToString()
        except InvalidArgument as error:
            expected = str(error)
        try:
            encoded, state = fast.convert_to_bytes(sample)
        except InvalidArgument as error:
            assert str(error) == expected
            continue
        # Equal once parsed, compared re-encoded byte for byte (NaN payloads and -0.0 included).
        assert trial_datastore_pb2.StoredTrialSample.FromString(encoded).SerializeToString() == expected
        # And the very bytes `SerializeToString` gives, but for the reward entries' zero values, which the
        # converter writes and `SerializeToString` leaves out.
        if not any(
            struct.pack("<f", number) == bytes(4)
            for reward in sample.rewards
            for reward_source in reward.sources
            for number in (reward_source.value, reward_source.confidence)
        ):
            assert encoded == expected
        assert state == sample.info.state


NAMES = ("a", "b", "*", "a.b", "", "env")
CLASSES = ("x", "y", "x.z", "*")
RECEIVERS = ("*", "*.*", "", "a", "b", "x", "x.*", "x.a", "x.b", "y.*", "y.a", "x.a.b", "*.a", "*.*.*", "env")
payload_bytes = st.binary(max_size=12)
floats32 = st.floats(width=32)  # NaN, infinities and -0.0 included


@st.composite
def trials(draw: st.DrawFn) -> common_pb2.TrialParams:
    actors = draw(st.lists(st.tuples(st.sampled_from(NAMES[:-1]), st.sampled_from(CLASSES)), max_size=5))
    return trial_params(*actors)


@st.composite
def datalog_samples(draw: st.DrawFn, actor_count: int) -> datalog_pb2.DatalogSample:
    """Mostly valid samples; now and then one the converter must refuse."""
    wild = draw(st.integers(0, 15)) == 0
    sample = datalog_pb2.DatalogSample()
    if not (wild and draw(st.booleans())):
        sample.info.CopyFrom(
            datalog_pb2.SampleInfo(
                tick_id=draw(st.integers(0, 2**64 - 1)),
                timestamp=draw(st.integers(0, 2**64 - 1)),
                state=common_pb2.TrialState.ValueType(
                    draw(st.integers(-(2**31), 2**31 - 1) if wild else st.sampled_from(range(6)))
                ),
                out_of_sync=draw(st.booleans()),
            )
        )
    if draw(st.booleans()):
        observations = draw(st.lists(payload_bytes, max_size=4))
        index = st.integers(-1, len(observations)) if wild else st.integers(0, len(observations) - 1)
        actors_map = draw(st.lists(index, max_size=actor_count + wild)) if observations or wild else []
        sample.observations.CopyFrom(
            environment_pb2.ObservationSet(observations=observations, actors_map=actors_map)
        )
    for _ in range(draw(st.integers(0, actor_count + wild))):
        sample.actions.add(content=draw(payload_bytes))
    for _ in range(draw(st.integers(0, 3))):
        added = sample.rewards.add(receiver_name=draw(st.sampled_from(RECEIVERS)), value=draw(floats32))
        for _ in range(draw(st.integers(0, 3))):
            user_data = draw(st.one_of(st.none(), payload_bytes))
            added.sources.append(
                source(
                    draw(floats32), draw(floats32), sender=draw(st.sampled_from(NAMES)), user_data=user_data
                )
            )
    for _ in range(draw(st.integers(0, 3))):
        payload = draw(st.one_of(st.none(), payload_bytes))
        sample.messages.add(
            sender_name=draw(st.sampled_from(NAMES)),
            receiver_name=draw(st.sampled_from(NAMES)),
            payload=packed(payload) if payload is not None else None,
        )
    return sample


@st.composite
def revalued(draw: st.DrawFn, sample: datalog_pb2.DatalogSample) -> datalog_pb2.DatalogSample:
    """`sample` with other payloads and reward values, as a trial's next tick: mostly of the same shape, or
    of a close one (the same counts, another actors map)."""
    copy = datalog_pb2.DatalogSample()
    copy.CopyFrom(sample)
    observations = copy.observations.observations
    for index in range(len(observations)):
        observations[index] = draw(payload_bytes)
    actors_map = copy.observations.actors_map
    actors_map[:] = draw(st.permutations(actors_map[:]))
    for action in copy.actions:
        action.content = draw(payload_bytes)
    for reward in copy.rewards:
        for reward_source in reward.sources:
            reward_source.value = draw(floats32)
            reward_source.confidence = draw(floats32)
            if reward_source.user_data.value:
                reward_source.user_data.value = draw(payload_bytes)
    for message in copy.messages:
        if message.HasField("payload"):
            message.payload.value = draw(payload_bytes)
    return copy


@settings(max_examples=400, deadline=None)
@given(data=st.data(), params=trials())
def test_converter_matches_the_reference(data: st.DataObject, params: common_pb2.TrialParams) -> None:
    samples = data.draw(st.lists(datalog_samples(len(params.actors)), min_size=1, max_size=3))
    samples += [data.draw(revalued(sample)) for sample in samples for _ in range(2)]
    assert_converted_as_reference(params, samples)


def test_converter_matches_the_reference_on_a_large_trial() -> None:
    # Multi-byte varints: actor, observation and payload indices, payload and actor sample lengths.
    params = trial_params(*((f"actor-{index}", f"class-{index % 3}") for index in range(150)))
    sample = datalog_pb2.DatalogSample(
        info=info(tick_id=300, timestamp=2**40, state=common_pb2.RUNNING),
        observations=environment_pb2.ObservationSet(
            observations=[bytes([index]) * index for index in range(200)], actors_map=range(50, 200)
        ),
        actions=[common_pb2.Action(content=b"a" * index) for index in range(150)],
        rewards=[
            reward("*", source(37, 0.5, sender="actor-137", user_data=b"everyone")),
            reward("class-1.*", source(1, 1, sender="env"), source(-2, 3, sender="actor-3")),
            reward("actor-140", source(0.1, 0.9, user_data=b"one")),
        ],
        messages=[
            common_pb2.Message(sender_name=f"actor-{index}", receiver_name="actor-140", payload=packed(b"m"))
            for index in range(150)
        ],
    )
    assert_converted_as_reference(params, [sample, sample])


def test_converter_with_more_sample_shapes_than_it_keeps_plans_for() -> None:
    params = trial_params(("a", "x"), ("b", "x"), ("c", "y"))
    samples = [
        datalog_pb2.DatalogSample(
            info=info(tick_id=tick),
            observations=environment_pb2.ObservationSet(observations=[b"o"] * (tick + 1), actors_map=[tick]),
            rewards=[reward("*", source(tick, 1))],
        )
        for tick in range(100)
    ]
    assert_converted_as_reference(params, samples + samples)


# ---------------------------------------------------------------------------------------------------------
# SampleFilter, with the reference's test data (trialSampleFilter_test.go)

FILTER_PARAMS = trial_params(
    ("my-actor-1", "my-actor-class-1", "my-actor-implementation-1"),
    ("my-actor-2", "my-actor-class-2", "my-actor-implementation-2"),
)


def stored_sample() -> trial_datastore_pb2.StoredTrialSample:
    Reward = trial_datastore_pb2.StoredTrialActorSampleReward
    Message = trial_datastore_pb2.StoredTrialActorSampleMessage
    return trial_datastore_pb2.StoredTrialSample(
        user_id="my-user-id",
        trial_id="my-trial",
        tick_id=12,
        timestamp=1_700_000_000,
        state=common_pb2.RUNNING,
        actor_samples=[
            trial_datastore_pb2.StoredTrialActorSample(
                actor=0,
                observation=0,
                action=1,
                reward=0.5,
                received_rewards=[
                    Reward(sender=-1, reward=0.5, confidence=1),
                    Reward(sender=1, reward=0.5, confidence=0.2, user_data=2),
                ],
            ),
            trial_datastore_pb2.StoredTrialActorSample(
                actor=1,
                observation=0,
                action=3,
                sent_rewards=[Reward(receiver=0, reward=0.5, confidence=0.2, user_data=2)],
                received_messages=[Message(sender=-1, payload=4)],
                sent_messages=[Message(receiver=-1, payload=5)],
            ),
        ],
        payloads=[
            b"an observation",
            b"an action",
            b"a reward user data",
            b"another action",
            b"a message payload",
            b"another message payload",
        ],
    )


def make_filter(
    names: Sequence[str] = (),
    classes: Sequence[str] = (),
    implementations: Sequence[str] = (),
    fields: Sequence[int] = (),
    params: common_pb2.TrialParams = FILTER_PARAMS,
) -> SampleFilter:
    return SampleFilter(params, names, classes, implementations, fields)


def filtered(
    sample_filter: SampleFilter, sample: trial_datastore_pb2.StoredTrialSample | None = None
) -> trial_datastore_pb2.StoredTrialSample:
    """`sample` (default: a fresh reference sample) after applying the filter in place."""
    result = stored_sample() if sample is None else sample
    sample_filter.apply(result)
    return result


def emptied(sample: trial_datastore_pb2.StoredTrialSample) -> list[bool]:
    return [payload == b"" for payload in sample.payloads]


def assert_idempotent(sample_filter: SampleFilter, once: trial_datastore_pb2.StoredTrialSample) -> None:
    twice = trial_datastore_pb2.StoredTrialSample()
    twice.CopyFrom(once)
    sample_filter.apply(twice)
    assert twice == once


def assert_header_kept(sample: trial_datastore_pb2.StoredTrialSample) -> None:
    original = stored_sample()
    assert (sample.user_id, sample.trial_id, sample.tick_id, sample.timestamp, sample.state) == (
        original.user_id,
        original.trial_id,
        original.tick_id,
        original.timestamp,
        original.state,
    )
    assert len(sample.payloads) == len(original.payloads)


def test_no_filters_is_identity() -> None:
    sample_filter = make_filter()
    assert sample_filter.keeps_everything
    assert filtered(sample_filter) == stored_sample()


@pytest.mark.parametrize(
    "fields",
    [
        [OBSERVATION, ACTION, REWARD, RECEIVED_REWARDS, SENT_REWARDS, RECEIVED_MESSAGES, SENT_MESSAGES],
        [0],  # UNKNOWN is ignored, and nothing left means all
        [0, 99],  # so are numbers this version does not know
        [
            SENT_MESSAGES,
            0,
            RECEIVED_MESSAGES,
            SENT_REWARDS,
            RECEIVED_REWARDS,
            REWARD,
            ACTION,
            OBSERVATION,
            42,
        ],
    ],
)
def test_selecting_all_fields_keeps_everything(fields: list[int]) -> None:
    sample_filter = make_filter(fields=fields)
    assert sample_filter.keeps_everything
    assert filtered(sample_filter) == stored_sample()


def test_field_filter_drops_rewards_and_messages() -> None:
    sample_filter = make_filter(fields=[ACTION, OBSERVATION, REWARD])
    assert not sample_filter.keeps_everything

    sample = filtered(sample_filter)

    assert sample != stored_sample()
    assert sample.ByteSize() < stored_sample().ByteSize()
    assert_header_kept(sample)
    for actor in sample.actor_samples:
        assert len(actor.received_rewards) == len(actor.sent_rewards) == 0
        assert len(actor.received_messages) == len(actor.sent_messages) == 0
        assert actor.HasField("observation") and actor.HasField("action")
    assert sample.actor_samples[0].reward == 0.5
    assert emptied(sample) == [False, False, True, False, True, True]
    assert_idempotent(sample_filter, sample)


def test_field_filter_drops_aggregated_reward() -> None:
    sample_filter = make_filter(fields=ALL_BUT_REWARD)

    sample = filtered(sample_filter)

    assert sample.ByteSize() < stored_sample().ByteSize()
    assert not sample.actor_samples[0].HasField("reward")
    assert not sample.actor_samples[1].HasField("reward")
    assert emptied(sample) == [False] * 6
    assert_idempotent(sample_filter, sample)


def test_field_filter_keeps_only_the_payloads_of_kept_fields() -> None:
    sample = filtered(make_filter(fields=[SENT_MESSAGES]))
    assert emptied(sample) == [True, True, True, True, True, False]
    assert [len(actor.sent_messages) for actor in sample.actor_samples] == [0, 1]
    assert not any(
        actor.HasField("observation") or actor.HasField("action") for actor in sample.actor_samples
    )

    sample = filtered(make_filter(fields=[SENT_REWARDS]))
    assert emptied(sample) == [True, True, False, True, True, True]  # user data referenced by actor 1
    assert [len(actor.sent_rewards) for actor in sample.actor_samples] == [0, 1]
    assert [len(actor.received_rewards) for actor in sample.actor_samples] == [0, 0]


def test_actor_name_filter() -> None:
    sample_filter = make_filter(names=["my-actor-2"], fields=ALL_BUT_REWARD)

    sample = filtered(sample_filter)

    assert sample.ByteSize() < stored_sample().ByteSize()
    assert [actor.actor for actor in sample.actor_samples] == [1]
    # Actor 1's observation (shared with actor 0), sent reward user data, action and messages are kept.
    assert emptied(sample) == [False, True, False, False, False, False]
    assert_header_kept(sample)
    assert_idempotent(sample_filter, sample)


def test_actor_class_filter() -> None:
    sample_filter = make_filter(classes=["my-actor-class-1"], fields=ALL_BUT_REWARD)

    sample = filtered(sample_filter)

    assert [actor.actor for actor in sample.actor_samples] == [0]
    assert emptied(sample) == [False, False, False, True, True, True]
    assert_idempotent(sample_filter, sample)


def test_actor_implementation_filter() -> None:
    sample_filter = make_filter(implementations=["my-actor-implementation-2"], fields=ALL_BUT_REWARD)

    sample = filtered(sample_filter)

    assert [actor.actor for actor in sample.actor_samples] == [1]
    assert emptied(sample) == [False, True, False, False, False, False]
    assert_idempotent(sample_filter, sample)


def test_actor_implementation_and_class_filters_are_anded() -> None:
    sample_filter = make_filter(
        classes=["my-actor-class-2"], implementations=["my-actor-implementation-1"], fields=ALL_BUT_REWARD
    )

    sample = filtered(sample_filter)

    assert sample.ByteSize() < stored_sample().ByteSize()
    assert len(sample.actor_samples) == 0
    assert emptied(sample) == [True] * 6
    assert_header_kept(sample)
    assert_idempotent(sample_filter, sample)


def test_actor_filter_alone_keeps_all_fields_of_selected_actors() -> None:
    sample_filter = make_filter(names=["my-actor-1", "unknown"])
    assert not sample_filter.keeps_everything

    sample = filtered(sample_filter)

    assert list(sample.actor_samples) == [stored_sample().actor_samples[0]]
    assert emptied(sample) == [False, False, False, True, True, True]


def test_payload_shared_between_kept_and_removed_actor_stays() -> None:
    sample = stored_sample()
    sample.actor_samples[1].received_messages[0].payload = 1  # actor 1 reads actor 0's action payload

    kept_first = filtered(make_filter(names=["my-actor-1"]), sample)
    assert kept_first.payloads[1] == b"an action"
    assert kept_first.payloads[0] == b"an observation"

    kept_second = filtered(make_filter(names=["my-actor-2"], fields=[RECEIVED_MESSAGES]))
    assert emptied(kept_second) == [True, True, True, True, False, True]


def test_removed_actors_keep_the_indices_of_the_others() -> None:
    params = trial_params(("a", "x"), ("b", "y"), ("c", "x"))
    sample = trial_datastore_pb2.StoredTrialSample(
        actor_samples=[trial_datastore_pb2.StoredTrialActorSample(actor=index) for index in range(3)]
    )
    filtered(make_filter(classes=["x"], params=params), sample)
    assert [actor.actor for actor in sample.actor_samples] == [0, 2]


def test_actor_index_outside_params() -> None:
    def sample_with_stray_actor() -> trial_datastore_pb2.StoredTrialSample:
        sample = stored_sample()
        sample.actor_samples.add(actor=7, action=1)
        return sample

    # An actor filter cannot select an actor the params do not describe.
    sample = filtered(
        make_filter(classes=["my-actor-class-1", "my-actor-class-2"]), sample_with_stray_actor()
    )
    assert [actor.actor for actor in sample.actor_samples] == [0, 1]
    # Without an actor filter everything is kept, fields are still filtered.
    sample = filtered(make_filter(fields=[ACTION]), sample_with_stray_actor())
    assert [(actor.actor, actor.action) for actor in sample.actor_samples] == [(0, 1), (1, 3), (7, 1)]
    assert emptied(sample) == [True, False, True, False, True, True]


def test_payload_indices_out_of_range_are_ignored() -> None:
    sample = trial_datastore_pb2.StoredTrialSample(
        actor_samples=[
            trial_datastore_pb2.StoredTrialActorSample(
                actor=0,
                observation=40,
                action=0,
                received_messages=[trial_datastore_pb2.StoredTrialActorSampleMessage(payload=9)],
            )
        ],
        payloads=[b"action", b"orphan"],
    )
    filtered(make_filter(fields=[OBSERVATION, ACTION, RECEIVED_MESSAGES]), sample)
    assert list(sample.payloads) == [b"action", b""]
    assert sample.actor_samples[0].observation == 40


def test_filter_on_converted_samples() -> None:
    params = trial_params(("myactor", "class1", "impl-a"), ("myactor2", "class1", "impl-b"))
    stored = DatalogConverter("t", "u", params).convert(
        datalog_pb2.DatalogSample(
            info=info(),
            observations=environment_pb2.ObservationSet(observations=[b"o0", b"o1"], actors_map=[0, 1]),
            actions=[common_pb2.Action(content=b"a0"), common_pb2.Action(content=b"a1")],
            rewards=[reward("*", source(1, 1, sender="myactor", user_data=b"ud"))],
            messages=[
                common_pb2.Message(sender_name="myactor2", receiver_name="myactor", payload=packed(b"m"))
            ],
        )
    )
    assert list(stored.payloads) == [b"o0", b"o1", b"a0", b"a1", b"ud", b"ud", b"m"]

    SampleFilter(params, [], [], ["impl-b"], [OBSERVATION, RECEIVED_REWARDS]).apply(stored)

    assert [actor.actor for actor in stored.actor_samples] == [1]
    only = stored.actor_samples[0]
    assert only.observation == 1
    assert not only.HasField("action") and not only.HasField("reward")
    assert len(only.sent_messages) == 0
    assert list(stored.payloads) == [b"", b"o1", b"", b"", b"", b"ud", b""]
