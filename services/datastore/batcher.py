"""Group commit of ingested samples (see shared.group_commit): many streams' samples, one
transaction, at most one starting every `interval_s` (10 ms).

Each ingestion stream adds its samples to its own `IngestionBuffer`, which the group commit takes
them from; the batcher writes each batch and tells every buffer what of it was committed.

What is received and not yet committed is bounded, per stream (`max_stream_samples`,
`max_stream_bytes`, checked by `has_room` after each sample: a stream may go over by that one)
and for the process, with what streams are reading (`max_in_flight_bytes`, acquired before each
read: see InFlightBytes). Past a bound, a stream reads no further until commits make room, and
gRPC flow control then holds its sender back.
"""

from __future__ import annotations

import itertools
import time

from services.datastore import metrics
from services.datastore.ingestion_buffer import InFlightBytes, IngestionBuffer
from services.datastore.model import SampleAppend
from services.datastore.store import DatastoreStore
from shared.dependencies import Dependencies
from shared.errors import classify
from shared.group_commit import GroupCommit
from shared.logging import get_logger
from shared.validation import MAX_RECEIVE_MESSAGE_BYTES

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
        self._in_flight = InFlightBytes(max_in_flight_bytes, MAX_RECEIVE_MESSAGE_BYTES)
        self._commit: GroupCommit[IngestionBuffer, SampleAppend] = GroupCommit(
            "sample-writer", self._write, max_items=max_samples, max_bytes=max_bytes, interval_s=interval_s
        )

    @property
    def in_flight_bytes(self) -> int:
        """Bytes received by every stream and not yet committed, or acquired for a read."""
        return self._in_flight.budget.held

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
        """Whether the stream of `buffer` is within its own bounds (the process's are acquired,
        IngestionBuffer.acquire_read)."""
        return buffer.in_flight < self.max_stream_samples and buffer.in_flight_bytes < self.max_stream_bytes

    async def _write(self, batch: list[tuple[IngestionBuffer, SampleAppend, int]]) -> None:
        appends = [append for _, append, _ in batch]
        started = time.monotonic()
        try:
            # An outage is ridden out: the samples stay here and are written once the database is
            # back (their streams wait, unacknowledged), up to the outage bound. An attempt that
            # failed may have committed (its answer lost): the next ones are retries.
            attempts = itertools.count()
            firsts = await self._dependencies.ride_out(
                lambda: self._store.append(appends, retry=next(attempts) > 0),
                on_held=metrics.outage_held_batches_total.inc,
            )
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
