"""The trials list and a trial's page: paging newest first, what a trial's state is (interrupted
trials as such), and returns, added up from the rewards and kept once a trial has ended (they
do not change)."""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from services.console.curves import RewardTotals
from services.console.errors import NotFound
from services.console.model import ActorInfo, TrialRow
from services.console.sources import Sources
from services.datastore.client.api import DatastoreClient, state_name
from shared.api import common_pb2, trial_datastore_pb2
from shared.endpoints import format_properties

PAGE_SIZE = 50
# The trials list computes returns from at most this many samples per page; longer trials show
# theirs on their own page.
RETURNS_SAMPLE_BUDGET = 20_000
# Returns of ended trials are kept (they do not change): this many trials at most.
RETURNS_CACHE_TRIALS = 10_000
REWARD_FIELDS = [trial_datastore_pb2.STORED_TRIAL_SAMPLE_FIELD_REWARD]
INTERRUPTED = "interrupted"
# The trials list adds up the rewards of trials of at most this many samples (longer ones show
# their returns once their page was opened), and of this many samples per page in all.
RETURNS_TRIAL_SAMPLES = 5_000


@dataclass(frozen=True)
class TrialsPage:
    rows: list[TrialRow]
    older: int | None  # the `before` of the next page, None at the oldest
    newest: int


@dataclass(frozen=True)
class TrialDetail:
    row: TrialRow
    params: dict[str, object]
    running: bool


@dataclass
class ReturnsCache:
    """Each ended trial's returns by actor class, least recently used dropped first."""

    by_trial: OrderedDict[str, dict[str, float]] = field(default_factory=OrderedDict)

    def get(self, trial_id: str) -> dict[str, float] | None:
        found = self.by_trial.get(trial_id)
        if found is not None:
            self.by_trial.move_to_end(trial_id)
        return found

    def put(self, trial_id: str, returns: dict[str, float]) -> None:
        self.by_trial[trial_id] = returns
        while len(self.by_trial) > RETURNS_CACHE_TRIALS:
            self.by_trial.popitem(last=False)


def actors_of(info: trial_datastore_pb2.StoredTrialInfo) -> tuple[ActorInfo, ...]:
    return tuple(ActorInfo(a.name, a.actor_class, a.implementation) for a in info.params.actors)


def returns_by_class(actors: Sequence[ActorInfo], returns: Sequence[float]) -> dict[str, float]:
    by_class: dict[str, float] = {}
    for actor, value in zip(actors, returns, strict=False):
        by_class[actor.actor_class] = by_class.get(actor.actor_class, 0.0) + value
    return by_class


def params_view(params: common_pb2.TrialParams) -> dict[str, object]:
    """A trial's parameters as the page lists them (configs as their size: they are opaque)."""
    return {
        "max_steps": params.max_steps,
        "max_inactivity": params.max_inactivity,
        "nb_buffered_ticks": params.nb_buffered_ticks,
        "datalog": params.datalog.endpoint if params.HasField("datalog") else "",
        "environment": {
            "name": params.environment.name,
            "endpoint": params.environment.endpoint,
            "implementation": params.environment.implementation,
            "config": f"{len(params.environment.config.content)} bytes",
        },
        "actors": [
            {
                "name": actor.name,
                "class": actor.actor_class,
                "implementation": actor.implementation,
                "endpoint": actor.endpoint,
                "config": f"{len(actor.config.content)} bytes",
            }
            for actor in params.actors
        ],
        "properties": format_properties(params.properties),
    }


class TrialPages:
    """The rules of the trials list and of a trial's page, over the datastore's client."""

    sources: Sources
    _returns: ReturnsCache

    async def _list(
        self, count: int, handle: str, properties: Mapping[str, str] | None = None
    ) -> trial_datastore_pb2.RetrieveTrialsReply:
        reply: trial_datastore_pb2.RetrieveTrialsReply = await self.sources.datastore(
            lambda client: client.list_trials(count, handle, properties),
        )
        return reply

    async def _states(self, infos: Sequence[trial_datastore_pb2.StoredTrialInfo]) -> dict[str, str]:
        """Each trial's state as people call it: interrupted trials as such (the Cogment wire
        lists them with their last state)."""
        ids = [info.trial_id for info in infos]
        interrupted: set[str] = set()
        if ids:
            interrupted = await self.sources.datastore(lambda client: client.interrupted_trials(ids))
        return {
            info.trial_id: INTERRUPTED
            if info.trial_id in interrupted
            else state_name(info.last_state).lower()
            for info in infos
        }

    async def _last_position(self, properties: Mapping[str, str]) -> int:
        """The paging position of the newest trial: the smallest position after which none is
        listed (an exponential then a binary search, a few dozen one-trial requests)."""

        async def any_after(position: int) -> bool:
            return bool((await self._list(1, str(position), properties)).trial_infos)

        high = 1
        while await any_after(high):
            high *= 2
        low = high // 2 if high > 1 else 0
        if high == 1 and not await any_after(0):
            return 0
        while low + 1 < high:  # any_after(low) is true (or low == 0), any_after(high) is false
            middle = (low + high) // 2
            if await any_after(middle):
                low = middle
            else:
                high = middle
        return high

    async def trials(
        self, before: int | None, states: set[str], properties: Mapping[str, str], page_size: int = PAGE_SIZE
    ) -> TrialsPage:
        """The page of trials whose positions come just before `before` (None: the newest),
        newest first; with `states`, only trials in those states."""
        newest = await self._last_position(properties)
        end = newest if before is None else min(before, newest)
        start = max(0, end - page_size)
        reply = await self._list(page_size, str(start), properties) if end > 0 else None
        infos = list(reply.trial_infos) if reply is not None else []
        trial_states = await self._states(infos)
        rows = [
            TrialRow(
                info.trial_id,
                trial_states[info.trial_id],
                info.user_id,
                info.samples_count,
                actors_of(info),
                dict(info.params.properties),
            )
            for info in reversed(infos)
            if not states or trial_states[info.trial_id] in states
        ]
        rows = await self._with_returns(rows)
        return TrialsPage(rows, start if start > 0 else None, newest)

    async def _with_returns(self, rows: list[TrialRow]) -> list[TrialRow]:
        """Rows with their returns by actor class, within the page's sample budget."""
        budget = RETURNS_SAMPLE_BUDGET
        result = []
        for row in rows:
            returns = self._returns.get(row.trial_id)
            if returns is None and row.samples <= min(budget, RETURNS_TRIAL_SAMPLES):
                budget -= row.samples
                totals = RewardTotals(len(row.actors), 2)  # returns are exact in any number of slots
                await self._add_rewards(totals, row.trial_id, row.samples)
                returns = returns_by_class(row.actors, totals.returns())
                if row.state == "ended":
                    self._returns.put(row.trial_id, returns)
            result.append(TrialRow(**{**row.__dict__, "returns": returns or {}}))
        return result

    async def _add_rewards(self, totals: RewardTotals, trial_id: str, samples: int) -> None:
        """Add the rewards of the trial's first `samples` samples to `totals`."""
        if samples:

            async def read(client: DatastoreClient) -> None:
                async with contextlib.aclosing(client.samples({trial_id: samples}, REWARD_FIELDS)) as stream:
                    async for sample in stream:
                        totals.add(sample)

            await self.sources.datastore(read)

    async def trial_info(self, trial_id: str) -> trial_datastore_pb2.StoredTrialInfo:
        infos = await self.sources.datastore(lambda client: client.trial_infos([trial_id]))
        if trial_id not in infos:
            raise NotFound(f"no trial [{trial_id}]")
        info: trial_datastore_pb2.StoredTrialInfo = infos[trial_id]
        return info

    async def trial(self, trial_id: str) -> TrialDetail:
        """A trial's page at once: its curves come by `curve_snapshots` (a long trial takes a
        while to read)."""
        info = await self.trial_info(trial_id)
        state = (await self._states([info]))[trial_id]
        actors = actors_of(info)
        row = TrialRow(
            trial_id,
            state,
            info.user_id,
            info.samples_count,
            actors,
            dict(info.params.properties),
            returns=self._returns.get(trial_id) or {},
        )
        return TrialDetail(row, params_view(info.params), state == "running")
