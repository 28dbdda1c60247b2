"""The Trial Datastore's two sample transformations, kept pure (no I/O) so they are easy to test and cheap.

* `DatalogConverter` turns what the orchestrator logs (`DatalogSample`, names and per-tick sets) into what the
  datastore stores and serves (`StoredTrialSample`, actor indices and one flat list of payloads referenced by
  index). It runs once per sample on the ingestion path, so everything that depends only on the trial
  (name and wildcard resolution) is computed once per trial.
* `SampleFilter` is what `RetrieveSamples` keeps of a stored sample for the requested actors and fields; it
  keeps `payloads` index-stable so the indices inside the kept fields stay valid.

Both follow the reference datastore (`reference-behaviour.md` sections 4.2 and 4.3), except for its defects:
the sample's `user_id` is the trial's user, wildcards resolve in actor order, malformed samples raise
`InvalidRequest` instead of crashing the server.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.datastore.errors import InvalidRequest
from shared.api import common_pb2, datalog_pb2, trial_datastore_pb2

StoredTrialSample = trial_datastore_pb2.StoredTrialSample


def _allowed_indices(count: int, what: str) -> str:
    """The allowed range of a `what` index, for error messages."""
    if count == 0:
        return f"there is no {what}, so no index is allowed"
    return f"{count} {what}{'s' if count > 1 else ''}: allowed indices are 0 to {count - 1}"


class DatalogConverter:
    """Turns the orchestrator's DatalogSamples of one trial into StoredTrialSamples (reference, section 4.3).

    One instance per datalog stream: the actor tables derived from the trial's params are built here once, so
    converting a sample only does dictionary lookups.
    """

    __slots__ = ("_actor_count", "_index_by_name", "_receivers", "_trial_id", "_user_id")

    def __init__(self, trial_id: str, user_id: str, params: common_pb2.TrialParams) -> None:
        self._trial_id = trial_id
        self._user_id = user_id
        actors = params.actors
        self._actor_count = len(actors)

        # Exact names (senders, message ends, plain reward receivers): the first actor with a name wins.
        index_by_name: dict[str, int] = {}
        for index, actor in enumerate(actors):
            index_by_name.setdefault(actor.name, index)
        self._index_by_name = index_by_name

        # Every reward `receiver_name` resolving to at least one actor, mapped to its actors in index order.
        # A name containing a dot is `class.name` (split at the first dot) and never an exact actor name.
        receivers: dict[str, list[int]] = {}
        for index, actor in enumerate(actors):
            if "." in actor.actor_class:
                continue  # the class part ends at the first dot: such a class cannot be named
            receivers.setdefault(f"{actor.actor_class}.*", []).append(index)
            if actor.name != "*":  # `class.*` already lists it, once
                receivers.setdefault(f"{actor.actor_class}.{actor.name}", []).append(index)
        resolved: dict[str, tuple[int, ...]] = {key: tuple(indices) for key, indices in receivers.items()}
        for name, index in index_by_name.items():
            if "." not in name:
                resolved[name] = (index,)
        # Wildcards last: they win over an actor (or class) literally named `*`, as in the reference.
        everyone = tuple(range(self._actor_count))
        resolved["*"] = everyone
        resolved["*.*"] = everyone
        self._receivers = resolved

    def convert(self, sample: datalog_pb2.DatalogSample) -> trial_datastore_pb2.StoredTrialSample:
        if not sample.HasField("info"):
            raise InvalidRequest(
                "DatalogSample without `info` (tick id, timestamp, state): the datastore needs it, "
                "do not exclude the `info` field from the datalog"
            )
        info = sample.info
        actor_count = self._actor_count
        stored = StoredTrialSample(
            user_id=self._user_id,
            trial_id=self._trial_id,
            tick_id=info.tick_id,
            timestamp=info.timestamp,
            state=info.state,
        )
        # One entry per actor of the trial, even without data; `actors[i]` is actor i's entry.
        add_actor = stored.actor_samples.add
        actors = [add_actor(actor=index) for index in range(actor_count)]
        payloads: list[bytes] = []  # copied into `stored` once at the end

        if sample.HasField("observations"):
            # Each observation is stored once; actors seeing the same one share its payload index.
            observation_set = sample.observations
            actors_map = observation_set.actors_map
            if len(actors_map) > actor_count:
                raise InvalidRequest(
                    f"DatalogSample.observations.actors_map has {len(actors_map)} entries: entry "
                    f"{actor_count} has no actor ({_allowed_indices(actor_count, 'actor')})"
                )
            observation_count = len(observation_set.observations)
            base = len(payloads)
            payloads.extend(observation_set.observations)
            for actor_index, observation_index in enumerate(actors_map):
                if not 0 <= observation_index < observation_count:
                    raise InvalidRequest(
                        f"DatalogSample.observations.actors_map[{actor_index}] = {observation_index} is not "
                        f"an observation index ({_allowed_indices(observation_count, 'observation')})"
                    )
                actors[actor_index].observation = base + observation_index

        # One payload per action entry, even empty (default or unavailable actors' placeholders).
        actions = sample.actions
        if len(actions) > actor_count:
            raise InvalidRequest(
                f"DatalogSample.actions has {len(actions)} entries: entry {actor_count} has no actor "
                f"({_allowed_indices(actor_count, 'actor')})"
            )
        for actor_index, action in enumerate(actions):
            actors[actor_index].action = len(payloads)
            payloads.append(action.content)

        if sample.rewards:
            self._add_rewards(sample.rewards, actors, payloads)

        index_by_name = self._index_by_name
        for message in sample.messages:
            # Exact names only; the environment and unknown names are -1. Unset payload: empty bytes.
            payload_index = len(payloads)
            payloads.append(message.payload.value)
            receiver = index_by_name.get(message.receiver_name, -1)
            sender = index_by_name.get(message.sender_name, -1)
            # Both ends on both entries: the reference left the owner's own index at 0, which the
            # SDK reads (it would name actor 0); clients that ignore it see no difference.
            if receiver >= 0:
                actors[receiver].received_messages.add(
                    sender=sender, receiver=receiver, payload=payload_index
                )
            if sender >= 0:
                actors[sender].sent_messages.add(sender=sender, receiver=receiver, payload=payload_index)

        stored.payloads.extend(payloads)
        return stored

    def _add_rewards(
        self,
        rewards: Sequence[common_pb2.Reward],
        actors: list[trial_datastore_pb2.StoredTrialActorSample],
        payloads: list[bytes],
    ) -> None:
        """Received/sent reward entries, and each targeted actor's confidence-weighted mean reward."""
        actor_count = self._actor_count
        weighted_sums = [0.0] * actor_count
        confidences = [0.0] * actor_count
        targeted = [False] * actor_count
        receivers = self._receivers
        index_by_name = self._index_by_name
        for reward in rewards:
            targets = receivers.get(reward.receiver_name)
            if targets is None:
                continue  # empty, bare class, environment or unknown name: dropped, as in the reference
            # Resolve each source once, whatever the number of receivers.
            sources = [
                (
                    index_by_name.get(source.sender_name, -1),
                    source.value,
                    source.confidence,
                    source.user_data.value,
                )
                for source in reward.sources
            ]
            for receiver in targets:
                targeted[receiver] = True
                received_rewards = actors[receiver].received_rewards
                for sender, value, confidence, user_data in sources:
                    if confidence > 0:
                        weighted_sums[receiver] += value * confidence
                        confidences[receiver] += confidence
                    user_data_index: int | None = None
                    if user_data:  # a new payload per receiver, as in the reference
                        user_data_index = len(payloads)
                        payloads.append(user_data)
                    # Both ends filled, as for messages.
                    entry = {
                        "sender": sender,
                        "receiver": receiver,
                        "reward": value,
                        "confidence": confidence,
                        "user_data": user_data_index,
                    }
                    received_rewards.add(**entry)
                    if sender >= 0:
                        actors[sender].sent_rewards.add(**entry)
        for index in range(actor_count):
            if targeted[index]:
                total = confidences[index]
                actors[index].reward = weighted_sums[index] / total if total > 0 else 0.0


_OBSERVATION = trial_datastore_pb2.STORED_TRIAL_SAMPLE_FIELD_OBSERVATION
_ACTION = trial_datastore_pb2.STORED_TRIAL_SAMPLE_FIELD_ACTION
_REWARD = trial_datastore_pb2.STORED_TRIAL_SAMPLE_FIELD_REWARD
_RECEIVED_REWARDS = trial_datastore_pb2.STORED_TRIAL_SAMPLE_FIELD_RECEIVED_REWARDS
_SENT_REWARDS = trial_datastore_pb2.STORED_TRIAL_SAMPLE_FIELD_SENT_REWARDS
_RECEIVED_MESSAGES = trial_datastore_pb2.STORED_TRIAL_SAMPLE_FIELD_RECEIVED_MESSAGES
_SENT_MESSAGES = trial_datastore_pb2.STORED_TRIAL_SAMPLE_FIELD_SENT_MESSAGES
_ALL_FIELDS = frozenset(
    {_OBSERVATION, _ACTION, _REWARD, _RECEIVED_REWARDS, _SENT_REWARDS, _RECEIVED_MESSAGES, _SENT_MESSAGES}
)


class SampleFilter:
    """What RetrieveSamples keeps of one trial's samples (reference section 4.2).

    Built once per (request, trial) since actor selection depends on the trial's params, then applied to each
    sample. When it would change nothing (`keeps_everything`), the caller can send the stored bytes as they
    are instead of parsing and re-serializing every sample.
    """

    __slots__ = (
        "_action",
        "_keeps_everything",
        "_observation",
        "_received_messages",
        "_received_rewards",
        "_reward",
        "_selected_actors",
        "_sent_messages",
        "_sent_rewards",
    )

    def __init__(
        self,
        params: common_pb2.TrialParams,
        actor_names: Sequence[str],
        actor_classes: Sequence[str],
        actor_implementations: Sequence[str],
        fields: Sequence[int],
    ) -> None:
        # Actor selection: AND of the three lists, an empty list selecting any. None = no actor filter at all.
        names, classes, implementations = (
            frozenset(actor_names),
            frozenset(actor_classes),
            frozenset(actor_implementations),
        )
        self._selected_actors: frozenset[int] | None = None
        if names or classes or implementations:
            self._selected_actors = frozenset(
                index
                for index, actor in enumerate(params.actors)
                if (not names or actor.name in names)
                and (not classes or actor.actor_class in classes)
                and (not implementations or actor.implementation in implementations)
            )

        # Field selection: UNKNOWN (0) and numbers this version does not know are ignored; nothing left = all.
        selected_fields = _ALL_FIELDS.intersection(fields) or _ALL_FIELDS
        self._observation = _OBSERVATION in selected_fields
        self._action = _ACTION in selected_fields
        self._reward = _REWARD in selected_fields
        self._received_rewards = _RECEIVED_REWARDS in selected_fields
        self._sent_rewards = _SENT_REWARDS in selected_fields
        self._received_messages = _RECEIVED_MESSAGES in selected_fields
        self._sent_messages = _SENT_MESSAGES in selected_fields
        self._keeps_everything = self._selected_actors is None and selected_fields == _ALL_FIELDS

    @property
    def keeps_everything(self) -> bool:
        """True when applying it would change nothing: then the caller sends stored bytes as they are."""
        return self._keeps_everything

    def apply(self, sample: trial_datastore_pb2.StoredTrialSample) -> None:
        """Filters `sample` in place (idempotent)."""
        if self._keeps_everything:
            return
        actor_samples = sample.actor_samples
        selected = self._selected_actors
        if selected is not None:
            # Backwards, so deleting does not shift the entries still to visit.
            for position in range(len(actor_samples) - 1, -1, -1):
                if actor_samples[position].actor not in selected:
                    del actor_samples[position]

        # Clear unselected fields, and collect the payloads the kept fields refer to.
        referenced: set[int] = set()
        for actor_sample in actor_samples:
            if not self._observation:
                actor_sample.ClearField("observation")
            elif actor_sample.HasField("observation"):
                referenced.add(actor_sample.observation)
            if not self._action:
                actor_sample.ClearField("action")
            elif actor_sample.HasField("action"):
                referenced.add(actor_sample.action)
            if not self._reward:
                actor_sample.ClearField("reward")
            if not self._received_rewards:
                actor_sample.ClearField("received_rewards")
            else:
                referenced.update(
                    reward.user_data
                    for reward in actor_sample.received_rewards
                    if reward.HasField("user_data")
                )
            if not self._sent_rewards:
                actor_sample.ClearField("sent_rewards")
            else:
                referenced.update(
                    reward.user_data for reward in actor_sample.sent_rewards if reward.HasField("user_data")
                )
            if not self._received_messages:
                actor_sample.ClearField("received_messages")
            else:
                referenced.update(message.payload for message in actor_sample.received_messages)
            if not self._sent_messages:
                actor_sample.ClearField("sent_messages")
            else:
                referenced.update(message.payload for message in actor_sample.sent_messages)

        # Same length, so indices stay valid; unreferenced payloads are emptied without being read.
        payloads = sample.payloads
        for index in range(len(payloads)):
            if index not in referenced:
                payloads[index] = b""
