"""The Trial Datastore's rules: trials, ingestion of their samples, listing, replay and live reading.

Ingestion (the orchestrator's datalog, or AddSample) converts and serializes each sample, then
hands it to the `SampleBatcher`; its future resolves once the sample is committed, and only then
is it acknowledged. Readers replay a trial's stored samples in arrival order and follow it live
through the change feed, until the trial has ended (an ENDED sample) or its ingestion stream
closed, and they have every sample stored by then.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import TypeVar

from services.datastore import metrics
from services.datastore.batcher import SampleBatcher
from services.datastore.conversion import DatalogConverter
from services.datastore.ingestion import Ingestion
from services.datastore.leases import IngestionLeases
from services.datastore.model import NO_STATE, SampleRange, TrialCount, TrialRecord, TrialStatus
from services.datastore.sample_filter import SampleFilter
from services.datastore.store import TRIALS_KEY, DatastoreStore, samples_key
from shared.api import common_pb2, trial_datastore_pb2
from shared.byte_budget import ByteBudget
from shared.dependencies import Dependencies
from shared.errors import NotFound
from shared.handlers import fitting_count
from shared.logging import get_logger
from shared.notify import ChangeFeed
from shared.validation import MAX_INT64_POSITION, MiB, quoted

# Samples read per query while replaying: at most READ_BATCH rows, and `read_batch_bytes` (one
# sample at least; their sizes are read first).
READ_BATCH = 500
DEFAULT_READ_BATCH_BYTES = 8 * 1024 * 1024
# What every replaying reader together holds, samples read and not yet sent, is bounded by the
# replay budget (`replay_bytes`): past it readers wait their turn. A sample counts this many
# times over: as read, and as the reply that sends it.
DEFAULT_REPLAY_BYTES = 256 * 1024 * 1024
REPLAY_COPIES = 2
# The user id of trials ingested without a `user-id` header (the reference's constant).
DEFAULT_DATALOG_USER_ID = "log exporter server"
# A range of samples (RetrieveSampleRange): rows by default and at most, and its bytes, past
# which it ends early (one sample at least): it fits the 4 MiB reply clients accept.
RANGE_DEFAULT_COUNT = 100
RANGE_MAX_COUNT = 1000
RANGE_MAX_BYTES = 2 * MiB

log = get_logger("datastore.core")
R = TypeVar("R")


class TrialDatastore:
    def __init__(
        self,
        store: DatastoreStore,
        feed: ChangeFeed,
        batcher: SampleBatcher,
        leases: IngestionLeases,
        dependencies: Dependencies | None = None,
        *,
        read_batch_bytes: int = DEFAULT_READ_BATCH_BYTES,
        replay_bytes: int = DEFAULT_REPLAY_BYTES,
    ) -> None:
        self.store = store
        self.read_batch_bytes = read_batch_bytes
        self.replay_budget = ByteBudget(replay_bytes)
        self.feed = feed
        self.batcher = batcher
        self.leases = leases
        # RetrieveSamples streams open and RetrieveSampleRange calls under way (a metric).
        self.readers = 0
        # Streams (live readers, a waiting RetrieveTrials, a datalog being opened) ride out a
        # database outage; a unary call answers UNAVAILABLE at once.
        self.ride_out = (dependencies or Dependencies([])).ride_out

    # ---- trials ----

    async def add_trial(self, trial_id: str, user_id: str, params: common_pb2.TrialParams) -> None:
        await self._upsert(trial_id, user_id, params, reopen=False)

    async def _upsert(
        self, trial_id: str, user_id: str, params: common_pb2.TrialParams, *, reopen: bool
    ) -> TrialRecord:
        data = params.SerializeToString()
        upsert = functools.partial(
            self.store.upsert_trial,
            trial_id,
            user_id,
            data,
            params.properties,
            time.time_ns(),
            reopen=reopen,
            lease_until=self.leases.until,
            lease_holder=self.leases.holder,
        )
        # A datalog stream is opened by a trial that is starting: it waits for the database.
        seq = await (self.ride_out(upsert) if reopen else upsert())
        return TrialRecord(seq, trial_id, user_id, data, 0, NO_STATE, False, False)

    async def delete_trials(self, trial_ids: Sequence[str]) -> int:
        deleted = await self.store.delete_trials(trial_ids)
        if deleted:
            log.debug("trials deleted", count=len(deleted))
        return len(deleted)

    async def retrieve_trials(
        self,
        trial_ids: Sequence[str],
        properties: Mapping[str, str],
        timeout_ms: int,
        count: int,
        after: int,
        reply_size: Callable[[TrialRecord], int] = lambda _: 0,
    ) -> tuple[list[TrialRecord], int]:
        """Trials in creation order after the position `after`, at most `count` (0: all).

        With `timeout_ms`, waits up to that long for more matching trials until `count` is
        reached, or every requested trial was found. The next position is the last returned
        trial's when the count was reached, else the end of what was looked at. A reply holds as
        many trials as fit (`reply_size`: a trial's encoded size): the next position is then the
        last returned one's.
        """
        wanted_ids = list(dict.fromkeys(trial_ids))
        limit: int | None = count or None
        if wanted_ids and (limit is None or limit > len(wanted_ids)):
            limit = len(wanted_ids)  # return as soon as every requested trial is there
        deadline = time.monotonic() + timeout_ms / 1000
        found: list[TrialRecord] = []
        read = self.ride_out if timeout_ms else _at_once
        with self.feed.watch([TRIALS_KEY]) as watch:
            while True:
                # Reading the end first: trials created from now on come after it, for the next call.
                end = max(after, await read(self.store.last_trial_seq))
                remaining = None if limit is None else limit - len(found)
                batch = await read(
                    functools.partial(self.store.list_trials, after, end, wanted_ids, properties, remaining)
                )
                found.extend(batch)
                fit = fitting_count(map(reply_size, found))
                if fit < len(found):
                    return found[:fit], found[fit - 1].trial_seq
                if limit is not None and len(found) >= limit:
                    return found, found[-1].trial_seq
                after = end
                left = deadline - time.monotonic()
                if timeout_ms == 0 or left <= 0:
                    return found, end
                await watch.wait(left)

    async def trial_statuses(self, trial_ids: Sequence[str]) -> list[TrialStatus]:
        """The statuses of the trials that exist among `trial_ids`, in request order, once each."""
        wanted_ids = list(dict.fromkeys(trial_ids))
        found = await self.store.trial_statuses(wanted_ids)
        return [found[trial_id] for trial_id in wanted_ids if trial_id in found]

    async def trial_counts(self) -> list[TrialCount]:
        """How many trials stand each way (last state, ended, closed)."""
        return await self.ride_out(self.store.count_trials)

    async def sample_range(
        self, trial_id: str, first: int, count: int, tick: int | None = None, timeout_ms: int = 0
    ) -> SampleRange:
        """The trial's samples from position `first` on (with `tick`: from the first of them of
        that tick), `count` at most (0: RANGE_DEFAULT_COUNT) and RANGE_MAX_BYTES together unless
        one alone is larger. With `timeout_ms`, when there is none yet and the trial is not
        finished, waits up to that long for one (as `samples` follows a trial live)."""
        count = count or RANGE_DEFAULT_COUNT
        position = min(first, MAX_INT64_POSITION)  # past any trial's samples: none
        found = await self.ride_out(functools.partial(self.store.get_trials, [trial_id]))
        if trial_id not in found:
            raise NotFound(f'no trial "{quoted(trial_id)}" found')
        seq = found[trial_id].trial_seq
        deadline = time.monotonic() + timeout_ms / 1000
        self.readers += 1
        try:
            return await self._range_of(trial_id, seq, position, count, tick, deadline)
        finally:
            self.readers -= 1

    async def _range_of(
        self, trial_id: str, seq: int, position: int, count: int, tick: int | None, deadline: float
    ) -> SampleRange:
        # Watched before reading: a sample committed after the read wakes the wait.
        with self.feed.watch([samples_key(seq)]) as watch:
            while True:
                kept, start = await self._read_range(seq, position, count, tick)
                # Held until answered, in the replay budget: many ranges gathered at once (a
                # replay buffer catching up on hundreds of trials) wait their turn to read.
                gathered = sum(map(len, kept))
                self.replay_budget.add(gathered)
                try:
                    progress = await self.ride_out(functools.partial(self.store.progress, seq))
                finally:
                    self.replay_budget.release(gathered)
                if progress is None:
                    raise NotFound(f'trial "{quoted(trial_id)}" was deleted')
                # Samples read may have been stored after the count was: never fewer than were read.
                stored = max(progress.samples_count, start + len(kept) if kept else 0)
                finished = progress.ended or progress.closed
                left = deadline - time.monotonic()
                if kept or finished or left <= 0:
                    metrics.replayed_samples_total.inc(amount=len(kept))
                    return SampleRange(kept, start, stored, finished)
                position = start  # where the reading stopped (a tick searched for: so far)
                if position >= stored:  # else some came since the read: read again at once
                    await watch.wait(left)

    async def _read_range(
        self, seq: int, first: int, count: int, tick: int | None
    ) -> tuple[list[bytes], int]:
        """The samples `sample_range` answers, and the position of the first (none: where the
        reading stopped). Rows are read within the replay budget, in batches of RANGE_MAX_BYTES
        (one sample at least)."""
        kept: list[bytes] = []
        size, start, position = 0, first, first
        searching = tick is not None
        while True:
            sizes = await self.ride_out(
                functools.partial(self.store.sample_sizes, seq, position, RANGE_MAX_COUNT)
            )
            rows = fitting_count(sizes, RANGE_MAX_BYTES, overhead=0)
            batch_start = position
            if rows:
                replayed = self._replayed(seq, position, sizes[:rows])
                async with contextlib.aclosing(replayed):
                    async for data in replayed:
                        if searching:
                            if trial_datastore_pb2.StoredTrialSample.FromString(data).tick_id != tick:
                                position += 1
                                continue
                            searching, start = False, position
                        if len(kept) == count or (kept and size + len(data) > RANGE_MAX_BYTES):
                            return kept, start
                        kept.append(data)
                        size += len(data)
                        position += 1
            if kept and start == batch_start and rows < len(sizes):
                return kept, start  # all that fit from the range's start: the next cannot
            if rows == len(sizes) < RANGE_MAX_COUNT or len(kept) == count:
                return kept, start if kept else position

    # ---- ingestion ----

    async def open_datalog(
        self, trial_id: str, user_id: str, params: common_pb2.TrialParams, api: str
    ) -> Ingestion:
        """Start ingesting the orchestrator's datalog of a trial (created, or updated if it exists),
        received through the ingestion service `api` (DatalogSP or LogExporterSP)."""
        trial = await self._upsert(trial_id, user_id or DEFAULT_DATALOG_USER_ID, params, reopen=True)
        return Ingestion(self.batcher, self.leases, trial, DatalogConverter(trial_id, user_id, params), api)

    async def open_samples(self, trial_id: str) -> Ingestion:
        """Start adding stored samples to an existing trial (AddSample)."""
        found = await self.store.get_trials([trial_id])
        if trial_id not in found:
            raise NotFound(f'no trial "{quoted(trial_id)}" found')
        return Ingestion(self.batcher, self.leases, found[trial_id], None, metrics.ADD_SAMPLE_API)

    # ---- reading samples ----

    async def samples(
        self,
        trial_ids: Sequence[str],
        actor_names: Sequence[str],
        actor_classes: Sequence[str],
        actor_implementations: Sequence[str],
        fields: Sequence[int],
    ) -> AsyncIterator[bytes]:
        """Serialized StoredTrialSamples of the trials, stored ones then live ones, each trial's in
        order, until every trial has ended or its ingestion closed."""
        wanted_ids = list(dict.fromkeys(trial_ids))
        found = await self.ride_out(functools.partial(self.store.get_trials, wanted_ids))
        missing = [trial_id for trial_id in wanted_ids if trial_id not in found]
        if missing:
            raise NotFound(f'no trial "{quoted(missing[0])}" found')
        readers = [
            _TrialReader(
                found[trial_id],
                SampleFilter(
                    common_pb2.TrialParams.FromString(found[trial_id].params),
                    actor_names,
                    actor_classes,
                    actor_implementations,
                    fields,
                ),
            )
            for trial_id in wanted_ids
        ]
        self.readers += 1
        try:
            with self.feed.watch(samples_key(reader.trial.trial_seq) for reader in readers) as watch:
                while readers:
                    progressed = False
                    for reader in list(readers):
                        seq = reader.trial.trial_seq
                        sizes = await self.ride_out(
                            functools.partial(self.store.sample_sizes, seq, reader.next, READ_BATCH)
                        )
                        rows = fitting_count(sizes, self.read_batch_bytes, overhead=0)
                        if rows:
                            replayed = self._replayed(seq, reader.next, sizes[:rows])
                            async with contextlib.aclosing(replayed):  # its room given back at once
                                async for data in replayed:
                                    reader.next += 1
                                    yield reader.filtered(data)
                            metrics.replayed_samples_total.inc(amount=rows)
                        if rows < len(sizes) or len(sizes) == READ_BATCH:
                            progressed = True  # more follow at once
                            continue
                        progress = await self.ride_out(functools.partial(self.store.progress, seq))
                        if progress is None:
                            raise NotFound(f'trial "{quoted(reader.trial.trial_id)}" was deleted')
                        if reader.next < progress.samples_count:
                            progressed = True  # more arrived since the read
                        elif progress.ended or progress.closed:
                            if not progress.ended:
                                log.debug("trial ingestion was interrupted", trial_id=reader.trial.trial_id)
                            readers.remove(reader)
                    if readers and not progressed:
                        await watch.wait()
        finally:
            self.readers -= 1

    async def _replayed(self, trial_seq: int, first: int, sizes: list[int]) -> AsyncGenerator[bytes, None]:
        """The trial's samples from position `first` on, of these sizes, read once there is room
        for them in the replay budget (see REPLAY_COPIES); each gives its room back once the next
        is asked for, i.e. once it was sent."""
        held = REPLAY_COPIES * sum(sizes)
        await self.replay_budget.acquire(held)
        try:
            batch = await self.ride_out(
                functools.partial(self.store.read_samples, trial_seq, first, len(sizes))
            )
            batch.reverse()  # popped in order: a sample sent is no longer held here
            while batch:
                data = batch.pop()
                yield data
                sent = REPLAY_COPIES * len(data)
                del data
                self.replay_budget.release(sent)
                held -= sent
        finally:
            self.replay_budget.release(held)


async def _at_once(read: Callable[[], Awaitable[R]]) -> R:
    return await read()


class _TrialReader:
    def __init__(self, trial: TrialRecord, sample_filter: SampleFilter) -> None:
        self.trial = trial
        self.next = 0
        self._filter = None if sample_filter.keeps_everything else sample_filter

    def filtered(self, data: bytes) -> bytes:
        if self._filter is None:
            return data
        sample = trial_datastore_pb2.StoredTrialSample.FromString(data)
        self._filter.apply(sample)
        return sample.SerializeToString()
