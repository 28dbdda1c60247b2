"""Group commit of ingested samples (see shared.group_commit): many streams' samples, one
transaction, at most one starting every `interval_s` (10 ms).

Each ingestion stream adds its samples to its own `IngestionBuffer`, which the group commit takes
them from. Buffers count what is committed: a stream acknowledges that many (an acknowledged sample
is durable). Bookkeeping is per buffer and per batch, not per sample: at thousands of samples a
second, per-sample futures would cost the event loop more than the conversion does.

What is received and not yet committed is bounded, per stream (`max_stream_samples`,
`max_stream_bytes`) and for the process (`max_in_flight_bytes`): past a bound, a stream reads no
further (`has_room`, `wait_for_room`) until commits make room, and gRPC flow control then holds
its sender back. A stream may go over by the one message it was reading when the bound was reached.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable

from services.datastore import metrics
from services.datastore.model import ENDED, NO_STATE, SampleAppend
from services.datastore.store import DatastoreStore
from shared.dependencies import Dependencies
from shared.errors import classify
from shared.group_commit import GroupCommit
from shared.logging import get_logger

DEFAULT_MAX_SAMPLES = 1000
DEFAULT_MAX_BYTES = 8 * 1024 * 1024
DEFAULT_MAX_STREAM_SAMPLES = 2000
DEFAULT_MAX_STREAM_BYTES = 32 * 1024 * 1024
DEFAULT_MAX_IN_FLIGHT_BYTES = 256 * 1024 * 1024
DEFAULT_INTERVAL_S = 0.01
# On shutdown, pending samples get this long to be written.
STOP_TIMEOUT_S = 5.0

log = get_logger("datastore.batcher")


class TrialMissing(Exception):
    """The trial was deleted while samples were on their way."""


class InFlightBytes:
    """Bytes received by every stream and not yet committed (nor failed), and the streams
    waiting for room."""

    def __init__(self) -> None:
        self.count = 0
        self._waiters: set[asyncio.Event] = set()

    def released(self, size: int) -> None:
        self.count -= size
        if size:
            for waiter in self._waiters:
                waiter.set()

    async def wait_for_room(self, woken: asyncio.Event) -> None:
        """Until something was committed or failed, by any stream (or `woken` was set)."""
        self._waiters.add(woken)
        try:
            await woken.wait()
        finally:
            self._waiters.discard(woken)
            woken.clear()


class IngestionBuffer:
    """One ingestion stream's samples on their way to the database (a group commit `Source`)."""

    def __init__(
        self,
        commit: GroupCommit[IngestionBuffer, SampleAppend],
        in_flight: InFlightBytes,
        trial_seq: int,
        api: str,
    ) -> None:
        self.trial_seq = trial_seq
        # The ingestion service the samples come through (the metrics' `api` label).
        self.api = api
        self._commit = commit
        self._process_in_flight = in_flight
        self._samples: list[bytes] = []
        # Per pending sample, the state it sets in its trial (NO_STATE: none).
        self._states: list[int] = []
        self._closing = False
        self._close_taken = False
        self.closed = False
        self.submitted = 0
        self.committed = 0
        # Bytes received and not yet committed (nor failed), and those not yet taken into a batch.
        self.in_flight_bytes = 0
        self.pending_bytes = 0
        self.failure: Exception | None = None
        # When the oldest pending sample arrived (time.monotonic), and the oldest sample of the
        # last take: how long the samples of a commit waited, measured once per stream and batch.
        self.arrived = 0.0
        self.taken_arrived = 0.0
        # Set whenever `committed`, `closed` or `failure` changes.
        self.progressed = asyncio.Event()
        self.queued = False

    @property
    def pending(self) -> int:
        """Samples received and not yet taken into a transaction."""
        return len(self._samples)

    @property
    def in_flight(self) -> int:
        return self.submitted - self.committed

    @property
    def dropped(self) -> bool:
        return self.failure is not None  # what it still holds must not be written after a gap

    def add(self, data: bytes, state: int) -> None:
        # Once per sample: counters updated in place rather than through calls.
        size = len(data)
        if not self._samples:
            self.arrived = time.monotonic()
        self._samples.append(data)
        self._states.append(state)
        self.submitted += 1
        self.in_flight_bytes += size
        self.pending_bytes += size
        self._process_in_flight.count += size
        if not self.queued:
            self._commit.schedule(self)

    def close(self) -> None:
        """After the samples added so far: the ingestion stream closed."""
        self._closing = True
        self._commit.schedule(self)

    def has_work(self) -> bool:
        return bool(self._samples) or (self._closing and not self._close_taken)

    def take(self, limit: int) -> tuple[SampleAppend, int, int]:
        """The next append (at most `limit` samples), its samples and its size in bytes."""
        if len(self._samples) <= limit:  # usually: everything pending, its lists handed over
            samples, states, size = self._samples, self._states, self.pending_bytes
            self._samples, self._states = [], []
        else:
            samples, states = self._samples[:limit], self._states[:limit]
            del self._samples[:limit], self._states[:limit]
            size = sum(map(len, samples))
        # Samples left pending arrived after the taken ones: `arrived` overstates their wait a little.
        self.taken_arrived = self.arrived
        last_state = next((state for state in reversed(states) if state != NO_STATE), None)
        close = self._closing and not self._samples
        self._close_taken = self._close_taken or close
        self.pending_bytes -= size
        return SampleAppend(self.trial_seq, samples, last_state, ENDED in states, close), len(samples), size

    def stored(self, append: SampleAppend, size: int) -> None:
        self.committed += len(append.samples)
        self.closed = self.closed or append.close
        self.in_flight_bytes -= size
        self._process_in_flight.released(size)
        self.progressed.set()

    def failed(self, error: Exception) -> None:
        self.failure = error
        # Nothing more of this stream is written: what it held no longer counts.
        self._process_in_flight.released(self.in_flight_bytes)
        self.in_flight_bytes = 0
        self.progressed.set()


class SampleBatcher:
    def __init__(
        self,
        store: DatastoreStore,
        dependencies: Dependencies | None = None,
        *,
        max_samples: int = DEFAULT_MAX_SAMPLES,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_stream_samples: int = DEFAULT_MAX_STREAM_SAMPLES,
        max_stream_bytes: int = DEFAULT_MAX_STREAM_BYTES,
        max_in_flight_bytes: int = DEFAULT_MAX_IN_FLIGHT_BYTES,
        interval_s: float = DEFAULT_INTERVAL_S,
    ) -> None:
        self._store = store
        self._dependencies = dependencies or Dependencies([])
        self.max_stream_samples = max_stream_samples
        self.max_stream_bytes = max_stream_bytes
        self.max_in_flight_bytes = max_in_flight_bytes
        self._in_flight = InFlightBytes()
        self._commit: GroupCommit[IngestionBuffer, SampleAppend] = GroupCommit(
            "sample-writer", self._write, max_items=max_samples, max_bytes=max_bytes, interval_s=interval_s
        )

    @property
    def in_flight_bytes(self) -> int:
        """Bytes received by every stream and not yet committed."""
        return self._in_flight.count

    def start(self) -> None:
        self._commit.start()

    async def stop(self) -> None:
        """Write what is pending (what cannot be written within STOP_TIMEOUT_S, e.g. during an
        outage, was never acknowledged), then stop."""
        await self._commit.stop(STOP_TIMEOUT_S)

    def open(self, trial_seq: int, api: str) -> IngestionBuffer:
        """The buffer of a new ingestion stream of the trial, through the ingestion service `api`
        (metrics.DATALOG_API, ...)."""
        return IngestionBuffer(self._commit, self._in_flight, trial_seq, api)

    def has_room(self, buffer: IngestionBuffer) -> bool:
        """Whether the stream of `buffer` may read another sample."""
        return (
            buffer.in_flight < self.max_stream_samples
            and buffer.in_flight_bytes < self.max_stream_bytes
            and self._in_flight.count < self.max_in_flight_bytes
        )

    async def wait_for_room(self, woken: asyncio.Event) -> None:
        """Until something was committed or failed, by any stream (or `woken` was set)."""
        await self._in_flight.wait_for_room(woken)

    async def _write(self, batch: list[tuple[IngestionBuffer, SampleAppend, int]]) -> None:
        appends = [append for _, append, _ in batch]
        attempts = 0

        def write_all() -> Awaitable[list[int | None]]:
            nonlocal attempts
            attempts += 1
            return self._store.append(appends)

        started = time.monotonic()
        try:
            # An outage is ridden out: the samples stay here and are written once the database is
            # back (their streams wait, unacknowledged), up to the outage bound.
            firsts = await self._dependencies.ride_out(write_all)
        except Exception as error:
            failure = classify(error)
            if failure is not None:  # no stream is at fault: each of them reports it
                log.warning("could not store samples", streams=len(batch), error=str(failure))
                for buffer, _, _ in batch:
                    buffer.failed(failure)
                return
            if len(batch) > 1:  # the transaction rolled back: find the append at fault
                for item in batch:
                    await self._write([item])
                return
            log.warning("could not store samples", trial_seq=batch[0][1].trial_seq, error=str(error))
            batch[0][0].failed(error)  # its stream reports it
            return
        finally:
            if attempts > 1:
                metrics.outage_held_batches_total.inc()
        now = time.monotonic()
        metrics.commit_duration_seconds.observe(now - started)
        metrics.commit_batch_samples.observe(sum(len(append.samples) for append in appends))
        for (buffer, append, size), first in zip(batch, firsts, strict=True):
            if first is None:
                buffer.failed(TrialMissing())
                continue
            buffer.stored(append, size)
            if append.samples:
                metrics.ingested_samples_total.inc(buffer.api, amount=len(append.samples))
                metrics.ingested_bytes_total.inc(buffer.api, amount=size)
                metrics.ack_wait_seconds.observe(now - buffer.taken_arrived)
