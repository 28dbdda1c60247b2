"""One ingestion stream of one trial, from the wire's samples to their acknowledgement.

Each sample is converted and serialized, then handed to the `SampleBatcher`, and acknowledged
once committed. A datalog (the orchestrator's) holds the trial's lease while it is open and
closes the trial when it ends; samples added to a trial (AddSample) do neither.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from services.datastore import metrics
from services.datastore.batcher import SampleBatcher, TrialMissing
from services.datastore.conversion import DatalogConverter
from services.datastore.leases import IngestionLeases
from services.datastore.model import ENDED, NO_STATE, TrialRecord
from shared.api import common_pb2, datalog_pb2, trial_datastore_pb2
from shared.errors import NotFound
from shared.logging import get_logger
from shared.supervision import cancel_and_wait
from shared.validation import quoted

KNOWN_STATES = frozenset(common_pb2.TrialState.values())

log = get_logger("datastore.ingestion")
R = TypeVar("R")


def _stored_state(state: int, out_of_sync: bool = False) -> int:
    """The state a sample sets in its trial: out-of-sync samples (late rewards of past ticks,
    with no state) set none, nor do numbers that are no TrialState (kept in the sample as sent),
    and nothing un-ends a trial (see DatastoreStore.append)."""
    return NO_STATE if out_of_sync or state not in KNOWN_STATES else state


class Ingestion:
    """One ingestion stream of one trial: a datalog (the orchestrator's, which closes the trial
    when it ends, and holds its lease meanwhile), or stored samples added to a trial (AddSample,
    which neither closes nor leases it)."""

    def __init__(
        self,
        batcher: SampleBatcher,
        leases: IngestionLeases,
        trial: TrialRecord,
        converter: DatalogConverter | None,
        api: str,
    ) -> None:
        """`api`: the ingestion service the samples come through (metrics.DATALOG_API, ...)."""
        self.trial = trial
        self._converter = converter
        self._batcher = batcher
        self._buffer = batcher.open(trial.trial_seq, api)
        self._saw_ended = trial.ended
        # (tick id, timestamp) of this stream's first sample with a state, and of its ENDED sample:
        # the trial's length and duration for the metrics.
        self._first: tuple[int, int] | None = None
        self._ended: tuple[int, int] | None = None
        self._leases = leases
        if converter is not None:
            self._leases.hold(trial.trial_seq)
            metrics.trials_started_total.inc()

    def ingest_datalog(
        self,
        requests: AsyncIterator[R],
        sample_of: Callable[[R], datalog_pb2.DatalogSample],
        drain_s: float,
    ) -> AsyncIterator[int]:
        """Store the orchestrator's samples (`sample_of` each request); yields how many more were
        committed, in order, as they are. After a failure, what still comes is read and dropped
        for up to `drain_s`, before the failure is raised."""
        return self._acknowledged(requests, lambda request: self._datalog(sample_of(request)), drain_s)

    def ingest_stored(
        self,
        requests: AsyncIterator[R],
        sample_of: Callable[[R], trial_datastore_pb2.StoredTrialSample],
        drain_s: float,
    ) -> AsyncIterator[int]:
        """Store samples already in the stored form (AddSample); as `ingest_datalog`."""
        return self._acknowledged(requests, lambda request: self._stored(sample_of(request)), drain_s)

    async def _acknowledged(
        self, requests: AsyncIterator[R], add: Callable[[R], None], drain_s: float
    ) -> AsyncIterator[int]:
        # Reading runs ahead of the commits (that is what lets many samples share a transaction),
        # within the batcher's bounds on what is in flight.
        buffer = self._buffer
        batcher = self._batcher
        read_failure: list[Exception] = []
        reading = True
        dropping = False

        async def read() -> None:
            nonlocal reading
            try:
                while True:
                    # gRPC receives the next message only once it is read: room for it comes first.
                    read_room = await buffer.acquire_read()
                    try:
                        request = await anext(requests, None)
                        if request is None:
                            return
                        if not dropping:  # the call failed: what still comes is read only to be dropped
                            add(request)
                        del request  # converted: not held while the stream waits
                    finally:
                        read_room.release()
                    while not batcher.has_room(buffer) and buffer.failure is None and not dropping:
                        await room.wait()
                        room.clear()
            except Exception as error:  # a bad sample, or the stream broke: after what came before
                read_failure.append(error)
            finally:
                reading = False
                buffer.progressed.set()

        room = asyncio.Event()
        reader = asyncio.get_running_loop().create_task(read(), name=f"ingest-{self.trial.trial_seq}")
        acknowledged = 0
        try:
            while True:
                await buffer.progressed.wait()
                buffer.progressed.clear()
                room.set()
                if buffer.failure is not None:
                    raise self._failure(buffer.failure)
                committed = buffer.committed  # once: more may commit while the acks go out
                if committed > acknowledged:
                    yield committed - acknowledged
                    acknowledged = committed
                if not reading and acknowledged == buffer.submitted:
                    if read_failure:
                        raise read_failure[0]
                    return
        except Exception:
            # A client still writing may be told another status than this error (the transport
            # drains what is left of a failed call's stream, which a reader cancelled mid-read
            # would leave nothing to drain): the reader goes on, dropping what comes, until the
            # client stops writing.
            dropping = True
            room.set()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(reader), drain_s)
            raise
        finally:
            await cancel_and_wait(reader)

    def _failure(self, error: Exception) -> Exception:
        """What the stream ends with: the database's failure (away, full), the trial's deletion,
        or a bug (INTERNAL)."""
        if isinstance(error, TrialMissing):
            return NotFound(f'trial "{quoted(self.trial.trial_id)}" was deleted')
        return error

    def _datalog(self, sample: datalog_pb2.DatalogSample) -> None:
        assert self._converter is not None
        data, state = self._converter.convert_to_bytes(sample)
        info = sample.info
        state = _stored_state(state, info.out_of_sync)
        if state != NO_STATE and self._first is None:
            self._first = (info.tick_id, info.timestamp)
        if state == ENDED:
            self._ended = (info.tick_id, info.timestamp)
        self._add(data, state)

    def _stored(self, sample: trial_datastore_pb2.StoredTrialSample) -> None:
        self._add(sample.SerializeToString(), _stored_state(sample.state))

    def _add(self, data: bytes, state: int) -> None:
        self._saw_ended = self._saw_ended or state == ENDED
        self._buffer.add(data, state)

    async def close(self) -> None:
        """The datalog stream closed: live readers stop once they have every sample."""
        if not self._saw_ended:
            log.warning(
                "trial ingestion closed before the trial ended: it is marked interrupted",
                trial_id=self.trial.trial_id,
            )
        buffer = self._buffer
        buffer.close()
        try:
            while not buffer.closed and buffer.failure is None:
                await buffer.progressed.wait()
                buffer.progressed.clear()
        finally:
            # Not renewed any more: if the close could not be written, the lease closes the trial.
            self._leases.release(self.trial.trial_seq)
        if buffer.closed:
            self._count_closed()

    def _count_closed(self) -> None:
        """The metrics of a datalog stream whose close is stored; an ENDED sample it stored adds
        the trial's figures (its actors' returns, its length and duration)."""
        if not self._saw_ended:
            metrics.trials_interrupted_total.inc()
            return
        metrics.trials_ended_total.inc()
        if self._converter is None or self._first is None or self._ended is None:
            return  # the trial had ended before this stream
        labels = metrics.actor_class_labels
        actors = common_pb2.TrialParams.FromString(self.trial.params).actors
        for actor, actor_return in zip(actors, self._converter.returns, strict=True):
            metrics.trial_return.observe(actor_return, labels.label(actor.actor_class))
        (first_tick, first_ns), (ended_tick, ended_ns) = self._first, self._ended
        metrics.trial_ticks.observe(max(ended_tick - first_tick + 1, 0))
        metrics.trial_duration_seconds.observe(max(ended_ns - first_ns, 0) / 1e9)
