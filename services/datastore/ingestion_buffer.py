"""One ingestion stream's samples on their way to the database, a group commit source (see
shared.group_commit and the batcher).

Buffers count what is committed: a stream acknowledges that many (an acknowledged sample is
durable). Bookkeeping is per buffer and per batch, not per sample: at thousands of samples a
second, per-sample futures would cost the event loop more than the conversion does.
"""

from __future__ import annotations

import asyncio
import math
import secrets
import time

from services.datastore.model import ENDED, NO_STATE, SampleAppend
from shared.byte_budget import ByteBudget
from shared.group_commit import GroupCommit

# How long a stream's largest sample is remembered as what a new stream's may be.
RECENT_S = 60.0
# A message being read is held about this many times over at once: as gRPC received it, parsed,
# and converted to its stored form (measured: a 57 MiB sample took a stream's process 200 MiB).
READ_COPIES = 3
# A read of room over IDLE_READ_BYTES still waiting for its message after IDLE_READ_S gives its
# room back: a client that is not sending large samples holds no other stream back (one it sends
# later goes over the budget, by itself). Smaller reads keep theirs (no timer per small sample).
IDLE_READ_S = 1.0
IDLE_READ_BYTES = 1024 * 1024


class InFlightBytes:
    """Bytes of samples that every ingestion stream together holds (received and not yet
    committed) or is reading, within one budget; and the size a new stream's next sample is
    expected at.

    gRPC receives a stream's next message only once the stream reads it (flow control holds it
    back until then), but does not tell its size beforehand: a stream acquires, before each read,
    READ_COPIES times the largest sample it sent so far; a new stream, the largest any stream
    sent lately (until one is seen, the largest message gRPC accepts). Only a sample larger than
    any its stream sent before (after one sample at least), or sent after an idle read gave its
    room back, can take the budget over, by itself.
    """

    def __init__(self, total: int, first_guess: int) -> None:
        self.budget = ByteBudget(total)
        self.new_stream_estimate = first_guess
        self._estimated_at = -math.inf

    def note_largest(self, size: int) -> None:
        """A stream's largest sample so far: new streams' estimate is the largest noted within
        RECENT_S (older ones are forgotten at the next note)."""
        now = time.monotonic()
        if size >= self.new_stream_estimate or now - self._estimated_at > RECENT_S:
            self.new_stream_estimate, self._estimated_at = size, now


class ReadRoom:
    """Room in the budget for one read (see IDLE_READ_S)."""

    def __init__(self, budget: ByteBudget, size: int) -> None:
        self._budget = budget
        self.size = size
        self._idle: asyncio.TimerHandle | None = None
        if size > IDLE_READ_BYTES:
            self._idle = asyncio.get_running_loop().call_later(IDLE_READ_S, self._lower)

    def _lower(self) -> None:
        self._idle = None
        self._budget.release(self.size)
        self.size = 0

    def release(self) -> None:
        if self._idle is not None:
            self._idle.cancel()
        self._budget.release(self.size)
        self.size = 0


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
        self._budget = in_flight.budget
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
        # The largest sample received (0: none yet), as large as the next one is expected.
        self.largest = 0
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

    async def acquire_read(self) -> ReadRoom:
        """Wait for room in the process's budget for the next sample, as large as expected (see
        InFlightBytes), to release once the sample is added (or the read ended)."""
        expected = self.largest or self._process_in_flight.new_stream_estimate
        size = READ_COPIES * expected
        await self._budget.acquire(size)
        return ReadRoom(self._budget, size)

    def add(self, data: bytes, state: int) -> None:
        # Once per sample: counter updates, and a call that does not wait.
        size = len(data)
        if not self._samples:
            self.arrived = time.monotonic()
        self._samples.append(data)
        self._states.append(state)
        self.submitted += 1
        self.in_flight_bytes += size
        self.pending_bytes += size
        self._budget.add(size)
        if size > self.largest:
            self.largest = size
            self._process_in_flight.note_largest(size)
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
        self._budget.release(size)
        self.progressed.set()

    def failed(self, error: Exception) -> None:
        self.failure = error
        # Nothing more of this stream is written: what it held no longer counts.
        self._budget.release(self.in_flight_bytes)
        self.in_flight_bytes = 0
        self.progressed.set()
