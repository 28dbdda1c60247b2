"""The Trial Datastore's vocabulary, shared by its gRPC layer, core, batcher and store."""

from __future__ import annotations

from dataclasses import dataclass

from shared.api import common_pb2

# A state that changes nothing in the trial (out-of-sync samples have none).
NO_STATE = common_pb2.UNKNOWN
ENDED = common_pb2.ENDED


@dataclass(frozen=True)
class TrialRecord:
    """A stored trial: `trial_seq` is its position in creation order, `params` serialized
    TrialParams; `ended` (an ENDED sample was stored) and `closed` (its ingestion stream closed)
    tell readers when to stop."""

    trial_seq: int
    trial_id: str
    user_id: str
    params: bytes
    samples_count: int
    last_state: int
    ended: bool
    closed: bool


@dataclass(frozen=True)
class TrialProgress:
    """How far a trial's ingestion got."""

    samples_count: int
    ended: bool
    closed: bool


@dataclass(frozen=True)
class SampleRange:
    """Serialized StoredTrialSamples of a trial from position `first` on; how many samples the
    trial had when they were read, and whether it was `finished` then (ended, or its ingestion
    closed: no sample follows those counted)."""

    samples: list[bytes]
    first: int
    samples_count: int
    finished: bool


@dataclass(frozen=True)
class TrialStatus:
    """Where a trial stands, beyond what the Cogment wire can say (`last_state` only)."""

    trial_id: str
    samples_count: int
    last_state: int
    ended: bool
    closed: bool

    @property
    def interrupted(self) -> bool:
        return interrupted(self.ended, self.closed)


@dataclass(frozen=True)
class TrialCount:
    """How many trials stand the same way."""

    last_state: int
    ended: bool
    closed: bool
    trials: int

    @property
    def interrupted(self) -> bool:
        return interrupted(self.ended, self.closed)


def interrupted(ended: bool, closed: bool) -> bool:
    """Its ingestion closed before an ENDED sample: a trial that will not end by itself (the wire
    still lists it with its last sample's state, RUNNING usually)."""
    return closed and not ended


@dataclass(frozen=True)
class SampleAppend:
    """Samples of one trial to store after its current ones, and what they change in the trial.

    `stream` and `position` make a second attempt recognisable: the trial records how many
    samples each stream stored, so samples a lost-answer attempt already stored are not stored
    again (see sample_sql)."""

    trial_seq: int
    # The ingestion stream's id (random, 63 bits) and how many of its samples came before these.
    stream: int
    position: int
    samples: list[bytes]
    # State of the last in-sync sample that has one; None leaves the trial's state alone.
    last_state: int | None = None
    ended: bool = False
    # The ingestion stream closed after these samples.
    close: bool = False
