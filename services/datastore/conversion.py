"""The Trial Datastore's conversion of samples, kept pure (no I/O) so it is easy to test and cheap.

`DatalogConverter` turns what the orchestrator logs (`DatalogSample`, names and per-tick sets) into what the
datastore stores and serves (`StoredTrialSample`, actor indices and one flat list of payloads referenced by
index). It runs once per sample on the ingestion path, so everything that depends only on the trial
(name and wildcard resolution) is computed once per trial, and the encoding once per sample shape.

It follows the reference datastore (`docs/compatibility.md#datastore-conversion`), except for its defects:
the sample's `user_id` is the trial's user, wildcards resolve in actor order, malformed samples raise
`InvalidArgument` instead of crashing the server. (`sample_filter.py` holds the readers' side.)
"""

from __future__ import annotations

import operator
import struct
from collections.abc import Callable

from shared.api import common_pb2, datalog_pb2, trial_datastore_pb2
from shared.errors import InvalidArgument
from shared.handlers import ONE_BYTE_VARINTS, varint

StoredTrialSample = trial_datastore_pb2.StoredTrialSample

# `DatalogConverter` writes StoredTrialSamples in the protobuf wire format itself. A tag is one byte here,
# `field number << 3 | wire type` (0 varint, 1 fixed64, 2 length-delimited, 5 fixed32).
# StoredTrialSample
_TICK_ID_TAG = b"\x18"  # 3 << 3
_TIMESTAMP_TAG = b"\x21"  # 4 << 3 | 1
_STATE_TAG = b"\x28"  # 5 << 3
_ACTOR_SAMPLE_TAG = b"\x32"  # 6 << 3 | 2
# StoredTrialActorSample
_ACTOR_TAG = b"\x08"  # 1 << 3
_OBSERVATION_TAG = b"\x10"  # 2 << 3
_ACTION_TAG = b"\x18"  # 3 << 3
_REWARD_TAG = b"\x25"  # 4 << 3 | 5
_RECEIVED_REWARD_TAG = b"\x32"  # 6 << 3 | 2
_SENT_REWARD_TAG = b"\x3a"  # 7 << 3 | 2
_RECEIVED_MESSAGE_TAG = b"\x42"  # 8 << 3 | 2
_SENT_MESSAGE_TAG = b"\x4a"  # 9 << 3 | 2
# StoredTrialActorSampleReward and StoredTrialActorSampleMessage
_SENDER_TAG = b"\x08"  # 1 << 3
_RECEIVER_TAG = b"\x10"  # 2 << 3
_USER_DATA_TAG = b"\x30"  # 6 << 3
_PAYLOAD_TAG = b"\x18"  # 3 << 3, a message's `payload`
# A reward entry's `reward` and `confidence`, float32 both, tags included.
_REWARD_VALUES = struct.Struct("<BfBf")
_VALUE_TAG = 4 << 3 | 5
_CONFIDENCE_TAG = 5 << 3 | 5

_FLOAT32 = struct.Struct("<f").pack
_FIXED64 = struct.Struct("<Q").pack
_INT64_MASK = (1 << 64) - 1
_CONTENT = operator.attrgetter("content")
# Plans (and layouts) kept per converter: a trial's samples have a handful of shapes (first, running, last,
# out-of-sync samples...). Past this, they are all dropped, so that a trial whose shapes change keeps planning
# the current ones, at worst about as costly as building the messages field by field.
_MAX_PLANS = 32


def _int32(value: int) -> bytes:
    """Varint of an int32 field: a negative value is sign-extended to 64 bits (10 bytes), as protobuf does."""
    return varint(value & _INT64_MASK)


# `state`, left out for UNKNOWN (0); values outside the enum are encoded when met.
_STATE_FIELDS = {
    state: _STATE_TAG + varint(state) if state else b"" for state in common_pb2.TrialState.values()
}


def _allowed_indices(count: int, what: str) -> str:
    """The allowed range of a `what` index, for error messages."""
    if count == 0:
        return f"there is no {what}, so no index is allowed"
    return f"{count} {what}{'s' if count > 1 else ''}: allowed indices are 0 to {count - 1}"


# A sample's shape: what the encoding of its actor samples depends on, all but its payloads and reward
# values. (observation count, actors map, action count, rewards, messages): a reward, if some actor receives
# it, is its receiver name and its sources' (sender name, has user data); a message, its (sender name,
# receiver name).
_RewardShape = tuple[str, tuple[tuple[str, bool], ...]]
_Shape = tuple[int, tuple[int, ...], int, tuple[_RewardShape, ...], tuple[tuple[str, str], ...]]


class _Plan:
    """How to encode the samples of one shape: `b"".join(pieces(pool))`, `pieces` picking the encoding's
    pieces in order from `pool`: the sample's variables, then `constants`, then the sample's encoded header
    (its fields before `actor_samples`) and payloads.

    The variables are the `_REWARD_VALUES` of each source of the sample's rewards (those some actor
    receives), in order, then the encoded mean reward of each of `mean_groups`: the positions, among these
    rewards, of the ones targeting an actor (actors targeted by the same rewards share their mean, the
    actors of `mean_actors`, one tuple per group).
    """

    __slots__ = ("constants", "mean_actors", "mean_groups", "pieces")

    def __init__(
        self,
        constants: tuple[bytes, ...],
        pieces: Callable[[list[bytes]], tuple[bytes, ...]],
        mean_groups: tuple[tuple[int, ...], ...],
        mean_actors: tuple[tuple[int, ...], ...],
    ) -> None:
        self.constants = constants
        self.pieces = pieces
        self.mean_groups = mean_groups
        self.mean_actors = mean_actors


class DatalogConverter:
    """Turns the orchestrator's DatalogSamples of one trial into StoredTrialSamples
    (docs/compatibility.md#datastore-conversion).

    One instance per datalog stream: the actor tables derived from the trial's params are built here once, so
    converting a sample only does dictionary lookups.

    Ingestion only needs the stored sample's bytes, which `convert_to_bytes` writes in the wire format itself:
    building the nested messages field by field then serializing them was the largest per-sample cost of
    ingestion, every Python operation costing far more than the few bytes it handles. So the work per actor
    is planned once per sample shape (the same from one tick to the next in most trials): the encoded actor
    samples as constant pieces and variable ones (reward values), joined from C. The bytes are the ones
    `SerializeToString` gives (fields in number order, proto3 defaults left out, `optional` fields written
    when set even to 0) but for one thing: reward entries always have their `reward` and `confidence`, even 0,
    so that a sample's shape does not depend on its reward values; they parse the same. The tests check the
    result against a message-building reference.
    """

    __slots__ = (
        "_actor_count",
        "_actor_fields",
        "_header",
        "_index_by_name",
        "_layouts",
        "_plans",
        "_receiver_fields",
        "_receivers",
        "_sender_fields",
        "returns",
    )

    def __init__(self, trial_id: str, user_id: str, params: common_pb2.TrialParams) -> None:
        actors = params.actors
        self._actor_count = actor_count = len(actors)

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
        everyone = tuple(range(actor_count))
        resolved["*"] = everyone
        resolved["*.*"] = everyone
        self._receivers = resolved

        # StoredTrialSample.user_id and .trial_id, left out when empty like any proto3 default.
        header = b""
        for tag, text in ((b"\x0a", user_id), (b"\x12", trial_id)):
            if text:
                encoded = text.encode()
                header += tag + varint(len(encoded)) + encoded
        self._header = header
        # StoredTrialActorSample.actor of each actor (the default 0 is left out).
        self._actor_fields = tuple(_ACTOR_TAG + varint(index) if index else b"" for index in everyone)
        # The int32 `sender` and `receiver` of reward and message entries: each actor's then, last so that
        # index -1 finds it, the environment's (or an unknown name's).
        self._sender_fields = tuple(
            _SENDER_TAG + _int32(index) if index else b"" for index in (*everyone, -1)
        )
        self._receiver_fields = tuple(
            _RECEIVER_TAG + _int32(index) if index else b"" for index in (*everyone, -1)
        )
        self._layouts: dict[
            tuple[int, tuple[int, ...], int], tuple[tuple[bytes, ...], tuple[bytes, ...]]
        ] = {}
        self._plans: dict[_Shape, _Plan] = {}
        # Per actor, the sum of the rewards it received in the samples converted so far (its
        # stored per-sample rewards, before their rounding to float32): its return.
        self.returns = [0.0] * actor_count

    def convert(self, sample: datalog_pb2.DatalogSample) -> trial_datastore_pb2.StoredTrialSample:
        """The stored sample as a message (ingestion stores `convert_to_bytes`)."""
        return StoredTrialSample.FromString(self.convert_to_bytes(sample)[0])

    def convert_to_bytes(self, sample: datalog_pb2.DatalogSample) -> tuple[bytes, int]:
        """The encoded StoredTrialSample, and its `state` (the trial state the orchestrator logged)."""
        if not sample.HasField("info"):
            raise InvalidArgument(
                "DatalogSample without `info` (tick id, timestamp, state): the datastore needs it, "
                "do not exclude the `info` field from the datalog"
            )
        info = sample.info
        header = self._header
        tick_id = info.tick_id
        if tick_id:
            header += _TICK_ID_TAG + varint(tick_id)
        timestamp = info.timestamp
        if timestamp:
            header += _TIMESTAMP_TAG + _FIXED64(timestamp)
        state = info.state
        state_field = _STATE_FIELDS.get(state)
        header += _STATE_TAG + _int32(state) if state_field is None else state_field

        # Payloads: the observations, each stored once, then one per action entry, even empty (default or
        # unavailable actors' placeholders), then reward user data and message payloads as they come.
        # (Repeated fields are read through a slice, a list made from C: iterating them is slower.)
        if sample.HasField("observations"):
            observation_set = sample.observations
            payloads = observation_set.observations[:]
            actors_map = tuple(observation_set.actors_map[:])
        else:
            payloads = []
            actors_map = ()
        observation_count = len(payloads)
        actions = sample.actions[:]
        payloads += map(_CONTENT, actions)

        # The rewards some actor receives (the others, to an empty, bare class, environment or unknown name,
        # are dropped as in the reference): their shapes, their sources' values (the first variables), and
        # the weights of their sources with a positive confidence: (value * confidence, confidence).
        reward_shapes: list[_RewardShape] = []
        variables: list[bytes] = []
        reward_weights: list[list[tuple[float, float]]] = []
        rewards = sample.rewards
        if rewards:
            receivers = self._receivers
            for reward in rewards[:]:
                receiver_name = reward.receiver_name
                targets = receivers.get(receiver_name)
                if targets is None:
                    continue
                source_shapes = []
                weights = []
                user_data_payloads = []
                for source in reward.sources[:]:
                    value = source.value
                    confidence = source.confidence
                    if confidence > 0:
                        weights.append((value * confidence, confidence))
                    variables.append(_REWARD_VALUES.pack(_VALUE_TAG, value, _CONFIDENCE_TAG, confidence))
                    user_data = source.user_data.value
                    if user_data:
                        user_data_payloads.append(user_data)
                    source_shapes.append((source.sender_name, bool(user_data)))
                if user_data_payloads:  # a new payload per receiver, as in the reference
                    payloads += user_data_payloads * len(targets)
                reward_shapes.append((receiver_name, tuple(source_shapes)))
                reward_weights.append(weights)
        message_shapes: tuple[tuple[str, str], ...] = ()
        if sample.messages:
            messages = sample.messages[:]
            message_shapes = tuple((message.sender_name, message.receiver_name) for message in messages)
            payloads += [message.payload.value for message in messages]  # unset: empty bytes

        shape = (observation_count, actors_map, len(actions), tuple(reward_shapes), message_shapes)
        plan = self._plans.get(shape)
        if plan is None:
            plan = self._plan(*shape)
            if len(self._plans) == _MAX_PLANS:
                self._plans.clear()
            self._plans[shape] = plan
        returns = self.returns
        for group, actors in zip(plan.mean_groups, plan.mean_actors, strict=True):
            # The confidence-weighted mean over the sources of the group's rewards, summed in order as the
            # reference does; 0 without a positive confidence. A mean of float32 values cannot overflow
            # float32 (packing would raise).
            weighted_sum = confidence_sum = 0.0
            for position in group:
                for product, confidence in reward_weights[position]:
                    weighted_sum += product
                    confidence_sum += confidence
            mean = weighted_sum / confidence_sum if confidence_sum > 0 else 0.0
            variables.append(_FLOAT32(mean))
            for actor in actors:
                returns[actor] += mean
        # StoredTrialSample.payloads, the last field, encoded from C.
        encoded_payloads = StoredTrialSample()
        encoded_payloads.payloads.extend(payloads)
        pool = [*variables, *plan.constants, header, encoded_payloads.SerializeToString()]
        return b"".join(plan.pieces(pool)), state

    def _layout(
        self, observation_count: int, actors_map: tuple[int, ...], action_count: int
    ) -> tuple[tuple[bytes, ...], tuple[bytes, ...]]:
        """Checks a sample's observations and actions, and returns each actor sample's `actor`,
        `observation` and `action` fields, and each actor sample encoded with only these."""
        key = (observation_count, actors_map, action_count)
        layout = self._layouts.get(key)
        if layout is not None:
            return layout
        actor_count = self._actor_count
        if len(actors_map) > actor_count:
            raise InvalidArgument(
                f"DatalogSample.observations.actors_map has {len(actors_map)} entries: entry "
                f"{actor_count} has no actor ({_allowed_indices(actor_count, 'actor')})"
            )
        bodies = list(self._actor_fields)
        for actor_index, observation_index in enumerate(actors_map):
            if not 0 <= observation_index < observation_count:
                raise InvalidArgument(
                    f"DatalogSample.observations.actors_map[{actor_index}] = {observation_index} is not "
                    f"an observation index ({_allowed_indices(observation_count, 'observation')})"
                )
            # Actors seeing the same observation share its payload index, which is its observation index.
            bodies[actor_index] += _OBSERVATION_TAG + varint(observation_index)
        if action_count > actor_count:
            raise InvalidArgument(
                f"DatalogSample.actions has {action_count} entries: entry {actor_count} has no actor "
                f"({_allowed_indices(actor_count, 'actor')})"
            )
        for actor_index in range(action_count):
            bodies[actor_index] += _ACTION_TAG + varint(observation_count + actor_index)
        layout = tuple(bodies), tuple(_ACTOR_SAMPLE_TAG + varint(len(body)) + body for body in bodies)
        if len(self._layouts) == _MAX_PLANS:
            self._layouts.clear()
        self._layouts[key] = layout
        return layout

    def _plan(
        self,
        observation_count: int,
        actors_map: tuple[int, ...],
        action_count: int,
        reward_shapes: tuple[_RewardShape, ...],
        message_shapes: tuple[tuple[str, str], ...],
    ) -> _Plan:
        """Checks a sample shape and plans the encoding of its samples (see `_Plan`)."""
        bodies, encoded_bodies = self._layout(observation_count, actors_map, action_count)
        payload_count = observation_count + action_count
        index_by_name = self._index_by_name
        sender_fields = self._sender_fields
        receiver_fields = self._receiver_fields
        # The fields after `action` of the actors with some, as (bytes, variable, bytes) triples and bytes,
        # with their total length: the variables are the reward entries' values and the actors' means.
        received: dict[int, list[tuple[bytes, int, bytes]]] = {}  # per targeted actor, `received_rewards`
        sent: dict[int, list[tuple[bytes, int, bytes]]] = {}  # per sending actor, `sent_rewards`
        lengths = [0] * self._actor_count

        targeting: dict[int, list[int]] = {}  # per targeted actor, the positions of the rewards targeting it
        value_count = 0
        for position, (receiver_name, source_shapes) in enumerate(reward_shapes):
            sources = []
            for variable, (sender_name, has_user_data) in enumerate(source_shapes, value_count):
                sender = index_by_name.get(sender_name, -1)
                sources.append((sender, sender_fields[sender], has_user_data, variable))
            value_count += len(sources)
            for receiver in self._receivers[receiver_name]:
                positions = targeting.get(receiver)
                if positions is None:
                    targeting[receiver] = [position]
                    entries = received[receiver] = []
                    lengths[receiver] += len(_REWARD_TAG) + 4  # a float32
                else:
                    positions.append(position)
                    entries = received[receiver]
                receiver_field = receiver_fields[receiver]
                for sender, sender_field, has_user_data, variable in sources:
                    ends = sender_field + receiver_field  # both filled, as for messages
                    user_data = b""
                    if has_user_data:  # a new payload per receiver, as in the reference
                        user_data = _USER_DATA_TAG + varint(payload_count)
                        payload_count += 1
                    # At most 2 * 11 + 10 + 6 bytes: a 1-byte length.
                    entry_length = len(ends) + _REWARD_VALUES.size + len(user_data)
                    before = ONE_BYTE_VARINTS[entry_length] + ends
                    entries.append((_RECEIVED_REWARD_TAG + before, variable, user_data))
                    lengths[receiver] += 2 + entry_length
                    if sender >= 0:
                        sent.setdefault(sender, []).append((_SENT_REWARD_TAG + before, variable, user_data))
                        lengths[sender] += 2 + entry_length

        # Messages: constant, each actor's `received_messages` then `sent_messages`.
        received_messages: dict[int, list[bytes]] = {}
        sent_messages: dict[int, list[bytes]] = {}
        for sender_name, receiver_name in message_shapes:
            # Exact names only, the environment and unknown names are -1. Both ends on both entries: the
            # reference left the owner's own index at 0, which the SDK reads (it would name actor 0);
            # clients that ignore it see no difference.
            receiver = index_by_name.get(receiver_name, -1)
            sender = index_by_name.get(sender_name, -1)
            message = sender_fields[sender] + receiver_fields[receiver]
            if payload_count:
                message += _PAYLOAD_TAG + varint(payload_count)
            payload_count += 1
            message = ONE_BYTE_VARINTS[len(message)] + message  # at most 2 * 11 + 6 bytes
            if receiver >= 0:
                received_messages.setdefault(receiver, []).append(_RECEIVED_MESSAGE_TAG + message)
                lengths[receiver] += 1 + len(message)
            if sender >= 0:
                sent_messages.setdefault(sender, []).append(_SENT_MESSAGE_TAG + message)
                lengths[sender] += 1 + len(message)

        # Actors targeted by the same rewards share their mean, a variable after the entries' values.
        mean_groups: dict[tuple[int, ...], int] = {}
        group_actors: dict[tuple[int, ...], list[int]] = {}
        means: dict[int, int] = {}
        for receiver, positions in targeting.items():
            group = tuple(positions)
            mean = mean_groups.get(group)
            if mean is None:
                mean = mean_groups[group] = value_count + len(mean_groups)
                group_actors[group] = []
            means[receiver] = mean
            group_actors[group].append(receiver)

        # The pieces, as pool indices: the header, the actor samples (tag, length, fields), the payloads.
        # Constant bytes are merged, and numbered after the variables, the header and payloads after them.
        variable_count = value_count + len(mean_groups)
        constants: list[bytes] = []
        pieces = [-1]  # the header's, numbered below
        constant = b""
        for actor, (body, encoded_body, length) in enumerate(
            zip(bodies, encoded_bodies, lengths, strict=True)
        ):
            if not length:  # nothing past `action`
                constant += encoded_body
                continue
            constant += _ACTOR_SAMPLE_TAG + varint(len(body) + length) + body
            mean = means.get(actor)
            if mean is not None:
                constant += _REWARD_TAG
                pieces += (variable_count + len(constants), mean)
                constants.append(constant)
                constant = b""
            for before, variable, after in (*received.get(actor, ()), *sent.get(actor, ())):
                constant += before
                pieces += (variable_count + len(constants), variable)
                constants.append(constant)
                constant = after
            constant += b"".join((*received_messages.get(actor, ()), *sent_messages.get(actor, ())))
        pieces.append(variable_count + len(constants))
        constants.append(constant)
        pieces[0] = variable_count + len(constants)
        pieces.append(variable_count + len(constants) + 1)
        return _Plan(
            tuple(constants),
            operator.itemgetter(*pieces),
            tuple(mean_groups),
            tuple(tuple(group_actors[group]) for group in mean_groups),
        )
