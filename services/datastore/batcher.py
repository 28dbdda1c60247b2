"""Group commit of ingested samples: many streams' samples, one transaction.

Every ingestion stream of the process submits its samples here and gets a future that resolves
once they are committed (the acknowledgement waits for it: an acknowledged sample is durable).
One task writes: while a transaction runs, new submissions queue; the next transaction takes
them all, up to `max_samples` samples or `max_bytes` bytes. Batches are therefore bounded in size,
and a sample waits at most for the transaction under way plus its own. Submissions are written
in the order they came, so each trial's samples keep their order.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field

from services.datastore.store import DatastoreStore, SampleAppend
from shared.logging import get_logger

DEFAULT_MAX_SAMPLES = 1000
DEFAULT_MAX_BYTES = 8 * 1024 * 1024

log = get_logger("datastore.batcher")


@dataclass
class _Submission:
    append: SampleAppend
    size: int
    # True once stored; False if the trial no longer exists.
    done: asyncio.Future[bool] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class SampleBatcher:
    def __init__(
        self,
        store: DatastoreStore,
        *,
        max_samples: int = DEFAULT_MAX_SAMPLES,
        max_bytes: int = DEFAULT_MAX_BYTES,
    ) -> None:
        self._store = store
        self.max_samples = max_samples
        self.max_bytes = max_bytes
        self._pending: deque[_Submission] = deque()
        self._ready = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._write_forever(), name="sample-batcher")

    async def stop(self) -> None:
        """Write what is pending, then stop."""
        if self._task is None:
            return
        self._stopping = True
        self._ready.set()
        await self._task
        self._task = None

    def submit(self, append: SampleAppend) -> asyncio.Future[bool]:
        """Queue `append`; the future says whether it was stored (False: unknown trial), or
        raises the database error that prevented it."""
        submission = _Submission(append, sum(len(data) for data in append.samples))
        self._pending.append(submission)
        self._ready.set()
        return submission.done

    def _take_batch(self) -> list[_Submission]:
        batch: list[_Submission] = []
        samples = size = 0
        while self._pending:
            head = self._pending[0]
            # A single oversized submission still goes, on its own.
            too_many = samples + len(head.append.samples) > self.max_samples
            if batch and (too_many or size + head.size > self.max_bytes):
                break
            batch.append(self._pending.popleft())
            samples += len(head.append.samples)
            size += head.size
        return batch

    async def _write_forever(self) -> None:
        while True:
            await self._ready.wait()
            self._ready.clear()
            while self._pending:
                await self._write(self._take_batch())
            if self._stopping:
                return

    async def _write(self, batch: list[_Submission]) -> None:
        appends = _merged(batch)
        try:
            firsts = await self._store.append(appends)
        except Exception as error:  # the streams that submitted report it; later batches retry
            log.warning("could not store a batch of samples", samples=len(batch), error=str(error))
            for submission in batch:
                if not submission.done.done():
                    submission.done.set_exception(error)
            return
        stored = {append.trial_seq: first is not None for append, first in zip(appends, firsts, strict=True)}
        for submission in batch:
            if not submission.done.done():
                submission.done.set_result(stored[submission.append.trial_seq])


def _merged(batch: list[_Submission]) -> list[SampleAppend]:
    """One append per trial, its submissions' samples in order (fewer statements per batch)."""
    merged: dict[int, SampleAppend] = {}
    for submission in batch:
        append = submission.append
        into = merged.get(append.trial_seq)
        if into is None:
            merged[append.trial_seq] = SampleAppend(
                append.trial_seq, list(append.samples), append.last_state, append.ended, append.close
            )
            continue
        into.samples.extend(append.samples)
        if append.last_state is not None:
            into.last_state = append.last_state
        into.ended = into.ended or append.ended
        into.close = into.close or append.close
    return list(merged.values())
