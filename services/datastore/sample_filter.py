"""The Trial Datastore's filtering of stored samples, kept pure (no I/O) so it is easy to test and cheap.

`SampleFilter` is what `RetrieveSamples` keeps of a stored sample for the requested actors and fields; it
keeps `payloads` index-stable so the indices inside the kept fields stay valid.

It follows the reference datastore (`docs/compatibility.md#sample-filter`). (`conversion.py` makes the stored
samples.)
"""

from __future__ import annotations

from collections.abc import Sequence

from shared.api import common_pb2, trial_datastore_pb2

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
    """What RetrieveSamples keeps of one trial's samples (docs/compatibility.md#sample-filter).

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
