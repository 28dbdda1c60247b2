"""One ingestion stream's samples on their way to the database, a group commit source (see
shared.group_commit and the batcher).

Buffers count what is committed: a stream acknowledges that many (an acknowledged sample is
durable). Bookkeeping is per buffer and per batch, not per sample: at thousands of samples a
second, per-sample futures would cost the event loop more than the conversion does.
"""

from __future__ import annotations

import asyncio
import secrets
import time

from services.datastore.model import ENDED, NO_STATE, SampleAppend
from shared.group_commit import GroupCommit


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
        # Identifies the stream's samples in the database (see SampleAppend).
        self.stream = secrets.randbits(63)
        self.submitted = 0
        self.taken = 0
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
        ended = ENDED in states
        append = SampleAppend(self.trial_seq, self.stream, self.taken, samples, last_state, ended, close)
        self.taken += len(samples)
        return append, len(samples), size

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
