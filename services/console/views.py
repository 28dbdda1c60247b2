"""What each page shows, read from the services through `Sources`: the rules of the console
(paging newest first, what a trial's state is, returns, curves, the inspector's tick, what of a
directory entry may be shown). The transport (services.console.app) turns these into HTML, JSON
and event streams; a service that cannot answer raises `Unavailable`."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import functools
from collections import OrderedDict
from collections.abc import AsyncGenerator, Awaitable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TypeVar

import grpc

from services.console.curves import MAX_POINTS, RewardTotals
from services.console.decode import Decoders
from services.console.model import (
    ActorInfo,
    ActorTick,
    EntryRow,
    MessageView,
    RewardView,
    ServiceState,
    TickView,
    TrialRow,
    VersionRow,
)
from services.console.sources import Sources, Unavailable
from services.datastore.client.api import DatastoreClient, state_name
from services.directory.client.api import DirectoryClient
from services.model_registry.client.api import hash_hex
from shared.api import (
    common_pb2,
    directory_entries_pb2,
    directory_pb2,
    model_registry_pb2,
    trial_datastore_pb2,
)
from shared.endpoints import SERVICE_TYPES, format_properties, service_type_name

PAGE_SIZE = 50
# Trials per request when the console counts them all (the overview).
COUNT_PAGE = 1000
# The trials list computes returns from at most this many samples per page; longer trials show
# theirs on their own page.
RETURNS_SAMPLE_BUDGET = 20_000
# Returns of ended trials are kept (they do not change): this many trials at most.
RETURNS_CACHE_TRIALS = 10_000
REWARD_FIELDS = [trial_datastore_pb2.STORED_TRIAL_SAMPLE_FIELD_REWARD]
INTERRUPTED = "interrupted"
# Samples a curve's reader holds at most before they are added up (rewards only: a few dozen
# bytes each).
FOLLOW_QUEUE = 10_000
# Memory of one trial's curves while they are drawn (RewardTotals' slots): a 100,000-tick trial
# of up to 3 actors keeps one slot per tick.
TRIAL_CURVE_BYTES = 8 << 20
# What --curves_bytes is by default: the curves of 16 trials drawn at once.
DEFAULT_CURVES_BYTES = 16 * TRIAL_CURVE_BYTES
# Less than this left: a trial's curves wait for others to be drawn (Busy).
MIN_CURVE_BYTES = TRIAL_CURVE_BYTES // 8
# Seconds between two snapshots of a trial's curves while its samples are read.
SNAPSHOT_INTERVAL_S = 0.5
# The trials list adds up the rewards of trials of at most this many samples (longer ones show
# their returns once their page was opened), and of this many samples per page in all.
RETURNS_TRIAL_SAMPLES = 5_000
ENVIRONMENT = "environment"
# Directory entries the directory page lists at most (the newest), and per request.
MAX_ENTRIES = 10_000
ENTRIES_PAGE = 1000
SERVICES = ("directory", "model_registry", "trial_datastore")
T = TypeVar("T")


async def _optional(step: Awaitable[T]) -> T | None:
    """What `step` gives, None when its service is down (the page shows that elsewhere)."""
    try:
        return await step
    except Unavailable:
        return None


class NotFound(Exception):
    """What the address names does not exist: the page is a 404."""


class Busy(Exception):
    """The console draws as many curves as its memory allows: try again in a moment (a 503)."""


class CurveMemory:
    """The bytes of the curves being drawn, at most `limit`: each trial's takes
    TRIAL_CURVE_BYTES while its samples are added up."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    @contextlib.contextmanager
    def reserved(self) -> Iterator[int]:
        """TRIAL_CURVE_BYTES for one trial's curves (or all that is left, if less), or Busy."""
        size = min(TRIAL_CURVE_BYTES, self.limit - self.used)
        if size < MIN_CURVE_BYTES:
            raise Busy(
                f"the console is drawing {self.used // TRIAL_CURVE_BYTES} trials' curves already, as "
                "many as its memory for them allows (--curves_bytes): try again in a moment"
            )
        self.used += size
        try:
            yield size
        finally:
            self.used -= size


@dataclass(frozen=True)
class Entries:
    rows: list[EntryRow]
    complete: bool  # False: more than MAX_ENTRIES, the newest shown
    with_health: bool  # False: a directory without the listing, its healthy entries by inquiry


@dataclass(frozen=True)
class Overview:
    services: list[ServiceState]
    entries: Entries | None
    models: int | None
    trials_by_state: dict[str, int] | None


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
class _ReturnsCache:
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


class Console:
    """The rules of the console's pages, over the services' clients."""

    def __init__(
        self, sources: Sources, decoders: Decoders, curves_bytes: int = DEFAULT_CURVES_BYTES
    ) -> None:
        self.sources = sources
        self.decoders = decoders
        self.curve_memory = CurveMemory(curves_bytes)
        self._returns = _ReturnsCache()

    # ---- overview ----

    async def overview(self) -> Overview:
        states = await asyncio.gather(*(self.sources.state(name) for name in SERVICES))
        entries, models, trials = await asyncio.gather(
            _optional(self.entries()), _optional(self.models()), _optional(self._trial_counts())
        )
        return Overview(
            list(states),
            entries,
            None if models is None else len(models),
            trials,
        )

    async def _trial_counts(self) -> dict[str, int]:
        """How many trials are in each state (interrupted ones as such): counted by the
        datastore, or, by one without the count (a Cogment 2.x one), by listing every trial."""
        counted = await self.sources.datastore(lambda client: client.trial_counts())
        if counted is not None:
            by_state: dict[str, int] = {}
            for count in counted:
                state = INTERRUPTED if count.interrupted else state_name(count.last_state).lower()
                by_state[state] = by_state.get(state, 0) + count.trials
            return by_state
        counts: dict[str, int] = {}
        handle = ""
        while True:
            reply = await self._list(COUNT_PAGE, handle)
            states = await self._states(reply.trial_infos)
            for info in reply.trial_infos:
                state = states[info.trial_id]
                counts[state] = counts.get(state, 0) + 1
            if len(reply.trial_infos) < COUNT_PAGE:
                return counts
            handle = reply.next_trial_handle

    # ---- trials ----

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

    async def stored_curves(self, trial_id: str, max_points: int = MAX_POINTS) -> list[dict[str, object]]:
        """The curves of the samples the trial has now (a running trial is cut there)."""
        info = await self.trial_info(trial_id)
        actors = actors_of(info)
        with self.curve_memory.reserved() as budget:
            totals = RewardTotals.within(len(actors), budget)
            await self._add_rewards(totals, trial_id, info.samples_count)
            return [asdict(curve) for curve in totals.curves([a.name for a in actors], max_points)]

    async def curve_snapshots(
        self, trial_id: str, max_points: int = MAX_POINTS
    ) -> AsyncGenerator[dict[str, object], None]:
        """The trial's reward curves as its samples are read (stored ones, then those a running
        trial adds): a snapshot of every actor's downsampled curve each SNAPSHOT_INTERVAL_S while
        samples come, and a last one when the trial's stream ends ({"ticks", "curves",
        "returns" by actor class, "state", "done"})."""
        info = await self.trial_info(trial_id)
        actors = actors_of(info)
        names = [actor.name for actor in actors]
        with self.curve_memory.reserved() as budget:
            following = self._follow_curves(trial_id, info, actors, names, budget, max_points)
            async with contextlib.aclosing(following) as snapshots:  # its read ends with this page
                async for snapshot in snapshots:
                    yield snapshot

    async def _follow_curves(
        self,
        trial_id: str,
        info: trial_datastore_pb2.StoredTrialInfo,
        actors: Sequence[ActorInfo],
        names: Sequence[str],
        budget: int,
        max_points: int,
    ) -> AsyncGenerator[dict[str, object], None]:
        totals = RewardTotals.within(len(actors), budget)
        client = await self.sources.client("trial_datastore")
        assert isinstance(client, DatastoreClient)
        call = client.stub.RetrieveSamples(
            trial_datastore_pb2.RetrieveSamplesRequest(
                trial_ids=[trial_id], selected_sample_fields=REWARD_FIELDS
            )
        )
        arrived: asyncio.Queue[trial_datastore_pb2.StoredTrialSample | None] = asyncio.Queue(FOLLOW_QUEUE)

        async def pump() -> None:
            try:
                async for reply in call:
                    await arrived.put(reply.trial_sample)
            finally:
                await arrived.put(None)

        def snapshot(state: str, done: bool) -> dict[str, object]:
            returns = returns_by_class(actors, totals.returns())
            if done and state == "ended":
                self._returns.put(trial_id, returns)
            return {
                "ticks": totals.ticks,
                "curves": [asdict(curve) for curve in totals.curves(names, max_points)],
                "returns": returns,
                "state": state,
                "done": done,
            }

        pumping = asyncio.create_task(pump())
        state = state_name(info.last_state).lower()
        try:
            changed, done = True, False
            while not done:
                deadline = asyncio.get_running_loop().time() + SNAPSHOT_INTERVAL_S
                while not done:
                    left = deadline - asyncio.get_running_loop().time()
                    if left <= 0:
                        break
                    try:
                        sample = await asyncio.wait_for(arrived.get(), left)
                    except asyncio.TimeoutError:
                        break
                    if sample is None:
                        done = True
                        break
                    totals.add(sample)
                    state = state_name(sample.state).lower()
                    changed = True
                if changed or done:
                    yield snapshot(state, done)
                    changed = False
        finally:
            call.cancel()
            pumping.cancel()
            with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                await pumping

    async def tick(self, trial_id: str, tick: int) -> TickView:
        """The trial's sample of `tick` (its first: late rewards of that tick come in later
        samples)."""
        info = await self.trial_info(trial_id)
        actors = actors_of(info)
        sample = None
        if info.samples_count:
            sample = await self._sample_of_tick(trial_id, tick, info.samples_count)
        if sample is None:
            raise NotFound(f"trial [{trial_id}] has no tick [{tick}]")
        return self.tick_view(sample, actors)

    async def _sample_of_tick(
        self, trial_id: str, tick: int, samples: int
    ) -> trial_datastore_pb2.StoredTrialSample | None:
        """The first sample of `tick` in arrival order (late samples of a tick come after it),
        found by the datastore (its own TrialSamplesSP), else by reading the trial from its start
        (a Cogment 2.x datastore)."""
        reply = await self.sources.datastore(lambda client: client.sample_range(trial_id, 0, 1, tick))
        if reply is None:
            return await self._scanned_sample_of_tick(trial_id, tick, samples)
        return reply.samples[0] if reply.samples else None

    async def _scanned_sample_of_tick(
        self, trial_id: str, tick: int, samples: int
    ) -> trial_datastore_pb2.StoredTrialSample | None:
        """The first sample of `tick`, reading the trial from its start."""

        async def find(client: DatastoreClient) -> trial_datastore_pb2.StoredTrialSample | None:
            async with contextlib.aclosing(client.samples({trial_id: samples})) as stream:
                async for sample in stream:
                    if sample.tick_id == tick:
                        return sample
            return None

        return await self.sources.datastore(find)

    def tick_view(
        self, sample: trial_datastore_pb2.StoredTrialSample, actors: Sequence[ActorInfo]
    ) -> TickView:
        def name(index: int) -> str:
            return actors[index].name if 0 <= index < len(actors) else ENVIRONMENT

        def payload(index: int, actor_class: str, kind: str) -> object:
            data = sample.payloads[index] if index < len(sample.payloads) else b""
            return self.decoders.payload(data, actor_class, kind)

        views = []
        for actor_sample in sample.actor_samples:
            actor_class = actors[actor_sample.actor].actor_class if actor_sample.actor < len(actors) else ""
            views.append(
                ActorTick(
                    name(actor_sample.actor),
                    payload(actor_sample.observation, actor_class, "observation")  # type: ignore[arg-type]
                    if actor_sample.HasField("observation")
                    else None,
                    payload(actor_sample.action, actor_class, "action")  # type: ignore[arg-type]
                    if actor_sample.HasField("action")
                    else None,
                    actor_sample.reward if actor_sample.HasField("reward") else None,
                    [
                        RewardView(name(r.sender), r.reward, r.confidence)
                        for r in actor_sample.received_rewards
                    ],
                    [
                        MessageView(name(m.sender), name(m.receiver), payload(m.payload, "", "message"))  # type: ignore[arg-type]
                        for m in actor_sample.received_messages
                    ],
                )
            )
        return TickView(sample.tick_id, sample.timestamp, state_name(sample.state).lower(), views)

    # ---- models ----

    async def models(self) -> list[model_registry_pb2.ModelInfo]:
        models: list[model_registry_pb2.ModelInfo] = await self.sources.registry(
            lambda client: client.list_models(),
        )
        return models

    async def versions(self, model_id: str) -> list[VersionRow]:
        if not await self.sources.registry(lambda c: c.model_exists(model_id)):
            raise NotFound(f"no model [{model_id}]")
        infos = await self.sources.registry(lambda c: c.list_versions(model_id))
        return [version_row(info) for info in reversed(infos)]

    async def version(self, model_id: str, number: int) -> model_registry_pb2.ModelVersionInfo:
        try:
            info: model_registry_pb2.ModelVersionInfo = await self.sources.registry(
                lambda c: c.version_info(model_id, number),
            )
        except Unavailable as error:
            if "not found" in str(error):
                raise NotFound(f"no version [{number}] of model [{model_id}]") from None
            raise
        return info

    # ---- directory ----

    async def entries(self) -> Entries:
        """Every entry the console's token sees with its health, the newest MAX_ENTRIES at most;
        from a Cogment 2.x directory (no listing), the healthy ones, found by inquiries. Never a
        secret."""
        rows: list[EntryRow] = []
        handle = ""
        while len(rows) < MAX_ENTRIES:
            page = min(ENTRIES_PAGE, MAX_ENTRIES - len(rows))
            reply = await self.sources.directory(
                functools.partial(DirectoryClient.list_entries, count=page, handle=handle)
            )
            if reply is None:
                return Entries(await self._inquired_entries(), complete=True, with_health=False)
            rows += [listed_entry_row(entry) for entry in reply.entries]
            handle = reply.next_handle
            if not handle:
                return Entries(rows, complete=True, with_health=True)
        more = await self.sources.directory(
            functools.partial(DirectoryClient.list_entries, count=1, handle=handle)
        )
        return Entries(rows, complete=not (more and more.entries), with_health=True)

    async def _inquired_entries(self) -> list[EntryRow]:
        """The healthy entries, by type (what inquiries answer)."""
        rows: dict[int, EntryRow] = {}
        for type_value in SERVICE_TYPES.values():
            request = directory_pb2.InquireRequest(details=directory_pb2.ServiceDetails(type=type_value))
            found = await self.sources.directory(functools.partial(DirectoryClient.inquire, request=request))
            for data in found:
                rows[data.service_id] = entry_row(data, "healthy")  # inquiries answer healthy entries only
        return sorted(rows.values(), key=lambda row: row.service_id)


def version_row(info: model_registry_pb2.ModelVersionInfo) -> VersionRow:
    return VersionRow(
        info.version_number,
        utc_time(info.creation_timestamp),
        info.data_size,
        hash_hex(info.data_hash),
        info.archived,
        dict(info.user_data),
    )


def entry_row(
    data: directory_pb2.FullServiceData,
    health: str,
    registered: str = "",
    last_check: str = "",
    failed_checks: int = 0,
) -> EntryRow:
    endpoint = data.endpoint
    protocol = directory_pb2.ServiceEndpoint.Protocol.Name(endpoint.protocol).lower()
    return EntryRow(
        data.service_id,
        service_type_name(data.details.type),
        f"{protocol}://{endpoint.host}:{endpoint.port}",
        dict(data.details.properties),
        data.permanent,
        health,
        registered,
        last_check,
        failed_checks,
    )


HEALTH_NAMES = {
    directory_entries_pb2.ENTRY_HEALTH_NOT_CHECKED: "not checked",
    directory_entries_pb2.ENTRY_HEALTH_AWAITING_FIRST_CHECK: "awaiting its first check",
    directory_entries_pb2.ENTRY_HEALTH_HEALTHY: "healthy",
    directory_entries_pb2.ENTRY_HEALTH_FAILING: "failing",
}


def listed_entry_row(entry: directory_entries_pb2.DirectoryEntry) -> EntryRow:
    return entry_row(
        entry.data,
        HEALTH_NAMES.get(entry.health, "unknown"),
        registered=utc_time(entry.registered_at),
        last_check=utc_time(entry.last_check_at) if entry.last_check_at else "",
        failed_checks=entry.failed_checks,
    )


def utc_time(nanoseconds: int) -> str:
    moment = datetime.datetime.fromtimestamp(nanoseconds / 1e9, datetime.timezone.utc)
    return moment.strftime("%Y-%m-%d %H:%M:%S UTC")
