"""What the demo sends on a trial's datalog stream (`services.demo.orchestration`), message by
message: the shape and order of the 2.x orchestrator's (wire-compat.md), and what the datastore's
conversion makes of it."""

from __future__ import annotations

from services.datastore.conversion import DatalogConverter
from services.demo.api import spec_pb2
from services.demo.orchestration import (
    ACTOR_CLASS,
    ENVIRONMENT_IMPLEMENTATION,
    ENVIRONMENT_NAME,
    NO_DATA_TICK_ID,
    TrialCounts,
    TrialPlan,
    players_of,
)
from services.demo.publishing import local_policies
from services.demo.world import GOAL_BONUS, STAGES, THANKS_VALUE
from shared.api import common_pb2, datalog_pb2


def plan(ticks: int = 60, actors: int = 3, index: int = 0) -> TrialPlan:
    return TrialPlan(
        trial_id=f"t-{index}",
        seed=1234 + index,
        ticks=ticks,
        players=players_of(index, actors, local_policies("the-model", {"greedy": 7})),
        properties={"demo": "cogment-aux", "run": "r"},
        datalog_endpoint="grpc://127.0.0.1:9003",
    )


def inputs(trial: TrialPlan) -> tuple[list[datalog_pb2.RunTrialDatalogInput], TrialCounts]:
    counts = TrialCounts()
    return list(trial.datalog_inputs(counts)), counts


def test_parameters_first_then_one_sample_per_tick() -> None:
    trial = plan()
    messages, counts = inputs(trial)
    assert messages[0].WhichOneof("msg") == "trial_params"
    assert all(message.WhichOneof("msg") == "sample" for message in messages[1:])
    params = messages[0].trial_params
    assert params.environment.name == ENVIRONMENT_NAME
    assert params.environment.implementation == ENVIRONMENT_IMPLEMENTATION
    config = spec_pb2.EnvironmentConfig.FromString(params.environment.config.content)
    assert (config.ticks, config.seed) == (60, 1234)
    assert [actor.name for actor in params.actors] == ["player-1", "player-2", "player-3"]
    assert {actor.actor_class for actor in params.actors} == {ACTOR_CLASS}
    stages = [spec_pb2.ActorConfig.FromString(actor.config.content) for actor in params.actors]
    assert [config.policy_stage for config in stages] == [stage.name for stage in STAGES]
    assert [config.model_version for config in stages] == [0, 0, 7]
    assert [actor.implementation for actor in params.actors] == [f"demo-policy-{s.name}" for s in STAGES]
    assert dict(params.properties) == {"demo": "cogment-aux", "run": "r"}
    assert params.datalog.endpoint == "grpc://127.0.0.1:9003"

    in_sync = [m.sample for m in messages[1:] if not m.sample.info.out_of_sync]
    late = [m.sample for m in messages[1:] if m.sample.info.out_of_sync]
    assert [sample.info.tick_id for sample in in_sync] == list(range(60))
    assert counts.ticks == 60 and counts.late_rewards == len(late) > 0
    assert counts.samples == len(messages) - 1
    assert counts.messages == sum(len(sample.messages) for sample in in_sync) > 0


def test_each_tick_carries_every_player() -> None:
    messages, _ = inputs(plan())
    in_sync = [m.sample for m in messages[1:] if not m.sample.info.out_of_sync]
    for sample in in_sync[:-1]:
        assert sample.info.state == common_pb2.RUNNING
        assert list(sample.observations.actors_map) == [0, 1, 2]
        assert len(sample.observations.observations) == 3
        for raw in sample.observations.observations:
            assert len(spec_pb2.Observation.FromString(raw).values) == 5
        assert [action.tick_id for action in sample.actions] == [sample.info.tick_id] * 3
        for action in sample.actions:
            spec_pb2.Action.FromString(action.content)
        # The environment's reward to each player, for this tick.
        assert [reward.receiver_name for reward in sample.rewards] == ["player-1", "player-2", "player-3"]
        for reward in sample.rewards:
            assert reward.tick_id == sample.info.tick_id
            (source,) = reward.sources
            assert source.sender_name == ENVIRONMENT_NAME and source.value == reward.value
        for message in sample.messages:
            found = spec_pb2.GoalFound()
            assert message.payload.Unpack(found)
            assert found.tick_id == sample.info.tick_id - 1 and message.sender_name != message.receiver_name


def test_the_last_sample_ends_the_trial_without_actions() -> None:
    messages, _ = inputs(plan(ticks=12))
    last = messages[-1].sample
    assert last.info.state == common_pb2.ENDED and last.info.tick_id == 11 and not last.info.out_of_sync
    assert len(last.observations.observations) == 3
    assert [(action.tick_id, action.content) for action in last.actions] == [(NO_DATA_TICK_ID, b"")] * 3
    assert not last.rewards and not last.messages


def test_late_rewards_are_out_of_sync_samples_sent_before_the_current_tick() -> None:
    messages, _ = inputs(plan(ticks=200, actors=4, index=2))
    last_tick = -1
    goal_reached: dict[int, set[str]] = {}
    late_count = 0
    for message in messages[1:]:
        sample = message.sample
        if not sample.info.out_of_sync:
            last_tick = sample.info.tick_id
            goal_reached[last_tick] = {r.receiver_name for r in sample.rewards if r.value == GOAL_BONUS}
            continue
        late_count += 1
        # For a past tick whose sample went out already (one or two ticks back), with no
        # state, no observations, no actions: only the reward.
        assert last_tick - 1 <= sample.info.tick_id <= last_tick
        assert sample.info.state == common_pb2.UNKNOWN
        assert not sample.HasField("observations") and not sample.actions and not sample.messages
        (reward,) = sample.rewards
        assert reward.tick_id == sample.info.tick_id and reward.value == THANKS_VALUE
        assert reward.receiver_name in goal_reached[sample.info.tick_id]
        (source,) = reward.sources
        assert source.sender_name != reward.receiver_name
        thanks = spec_pb2.Thanks()
        assert source.user_data.Unpack(thanks) and thanks.found_tick_id == sample.info.tick_id
    assert late_count > 0


def test_the_datastore_converts_every_sample() -> None:
    """The datastore's own conversion takes each sample: one actor sample per player, late
    rewards to the player that found the goal, messages between players."""
    messages, _ = inputs(plan(ticks=80))
    converter = DatalogConverter("t-0", "user", messages[0].trial_params)
    stored = [converter.convert(message.sample) for message in messages[1:]]
    assert all(len(sample.actor_samples) == 3 for sample in stored)
    late = [sample for sample, m in zip(stored, messages[1:], strict=True) if m.sample.info.out_of_sync]
    for sample in late:
        received = [actor for actor in sample.actor_samples if actor.received_rewards]
        (receiver,) = received
        (entry,) = receiver.received_rewards
        assert entry.sender != receiver.actor and entry.reward == THANKS_VALUE
        assert spec_pb2.Thanks.FromString(sample.payloads[entry.user_data]).found_tick_id == sample.tick_id
    sent = [
        (actor.actor, entry.receiver, sample.payloads[entry.payload])
        for sample in stored
        for actor in sample.actor_samples
        for entry in actor.sent_messages
    ]
    assert sent and all(sender != receiver >= 0 for sender, receiver, _ in sent)
    assert all(spec_pb2.GoalFound.FromString(payload).tick_id >= 0 for _, _, payload in sent)
