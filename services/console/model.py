"""The console's records: what its pages show, built from the services' answers."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ServiceState:
    """One service as the console reaches it: its endpoint, and its version or why it is down."""

    name: str
    endpoint: str
    version: str = ""
    error: str = ""

    @property
    def up(self) -> bool:
        return not self.error


@dataclass(frozen=True)
class ActorInfo:
    name: str
    actor_class: str
    implementation: str


@dataclass(frozen=True)
class TrialRow:
    """A trial of the list: its state (interrupted trials as such), its user, samples, actors,
    properties, and the return of each actor class (what its actors' rewards sum to)."""

    trial_id: str
    state: str
    user_id: str
    samples: int
    actors: tuple[ActorInfo, ...]
    properties: dict[str, str]
    returns: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Curve:
    """One actor's rewards as a chart draws them: per tick (or per bucket of ticks: its first
    tick, and the smallest and largest reward in it), and the cumulative return at its end."""

    actor: str
    ticks: list[int]
    reward_min: list[float]
    reward_max: list[float]
    returns: list[float]


@dataclass(frozen=True)
class Payload:
    """Bytes of a sample shown to a person: decoded fields when the console knows the message,
    else the size and the first bytes in hex."""

    size: int
    preview: str
    decoded: str = ""


@dataclass(frozen=True)
class RewardView:
    sender: str
    value: float
    confidence: float


@dataclass(frozen=True)
class MessageView:
    sender: str
    receiver: str
    payload: Payload


@dataclass(frozen=True)
class ActorTick:
    actor: str
    observation: Payload | None
    action: Payload | None
    reward: float | None
    rewards: list[RewardView]
    messages: list[MessageView]


@dataclass(frozen=True)
class TickView:
    """One tick of a trial as the sample inspector shows it."""

    tick: int
    timestamp: int
    state: str
    actors: list[ActorTick]


@dataclass(frozen=True)
class VersionRow:
    number: int
    created: str
    size: int
    sha256: str
    archived: bool
    user_data: dict[str, str]


@dataclass(frozen=True)
class EntryRow:
    """A directory entry, without its secret."""

    service_id: int
    type: str
    endpoint: str
    properties: dict[str, str]
    permanent: bool
    health: str  # healthy, failing, awaiting its first check, not checked
    registered: str = ""  # when, UTC; empty: unknown (a directory without the listing)
    last_check: str = ""  # when, UTC; empty: never, or unknown
    failed_checks: int = 0
