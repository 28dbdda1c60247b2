"""Group commit: many writers' work, one transaction.

Writers queue *sources*: an ingestion stream's buffer of samples, a pending registration. One
task takes what the queued sources hold, up to `max_items` items and about `max_bytes` bytes, and
writes it as one batch; what arrives while a batch is written goes into the next one. Batches are
therefore bounded in size, and an item waits at most for the batch under way, the interval (below)
and its own batch. A source's items are taken in order and one batch is written at a time, so each
source's items keep their order; a source with more than a batch's share goes back to the end of
the queue, after the others' turn.

Batches start at most every `interval_s` (unless a full batch waits, or the group commit is
stopping): a steady flow of items (a few hundred a second over many streams) would otherwise be
committed one by one, each transaction's fixed cost (CPU in the database and here, a page or more
written) paid per item. An item arriving after a quiet spell is written at once.

The writing task runs while sources are queued (once started), and ends when none is: an idle
group commit holds no task. `write` handles the outcome of each batch (it tells each source); a
failure it raises is a bug, logged, and fails the batch's sources, while the group commit goes on
with the next batch.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, Generic, Protocol, TypeVar

from shared.logging import get_logger
from shared.supervision import cancel_and_wait

log = get_logger("shared.group_commit")

Taken = TypeVar("Taken", covariant=True)


class Source(Protocol[Taken]):
    """Work waiting to be written, taken in order."""

    # Whether it is in the group commit's queue (the group commit sets it).
    queued: bool

    @property
    def pending(self) -> int:
        """Items waiting, not yet taken."""

    @property
    def pending_bytes(self) -> int: ...

    @property
    def dropped(self) -> bool:
        """Whether what it still holds must not be written any more (it failed)."""

    def take(self, limit: int) -> tuple[Taken, int, int]:
        """The next work (at most `limit` items), its items and its size in bytes."""

    def has_work(self) -> bool: ...

    def failed(self, error: Exception) -> None: ...


S = TypeVar("S", bound=Source[Any])
W = TypeVar("W")


class GroupCommit(Generic[S, W]):
    """Batches of the work `W` taken from sources `S`; `write` gets each batch: every source with
    the work taken from it and that work's size in bytes."""

    def __init__(
        self,
        name: str,
        write: Callable[[list[tuple[S, W, int]]], Awaitable[None]],
        *,
        max_items: int,
        max_bytes: int,
        interval_s: float = 0.0,
    ) -> None:
        self.name = name
        self._write = write
        self.max_items = max_items
        self.max_bytes = max_bytes
        self.interval_s = interval_s
        # When the last batch started (the event loop's time).
        self._last_start = -interval_s
        self._queue: deque[S] = deque()
        self._writer: asyncio.Task[None] | None = None
        self._started = False
        self._stopping = False

    def start(self) -> None:
        """Write from now on (what was queued before, too)."""
        self._started = True
        self._stopping = False
        self._write_soon()

    def schedule(self, source: S) -> None:
        """Queue `source` for the next batches, unless it is queued already."""
        if not source.queued:
            source.queued = True
            self._queue.append(source)
            self._write_soon()

    def _write_soon(self) -> None:
        if self._started and self._queue and (self._writer is None or self._writer.done()):
            self._writer = asyncio.get_running_loop().create_task(self._write_queued(), name=self.name)

    async def stop(self, timeout_s: float) -> None:
        """Write what is queued, without pacing, for up to `timeout_s` (what is not written by
        then was never acknowledged), then stop."""
        self._stopping = True
        writer = self._writer
        self._started = False
        if writer is None:
            return
        with contextlib.suppress(asyncio.TimeoutError, Exception):
            await asyncio.wait_for(asyncio.shield(writer), timeout_s)
        await cancel_and_wait(writer)

    async def _write_queued(self) -> None:
        while self._queue:
            await self._pace()
            batch = self._take_batch()
            if not batch:  # every queued source had failed
                continue
            try:
                await self._write(batch)
            except Exception as error:  # a bug: this batch's sources fail, the others go on
                log.error("could not write a batch", group_commit=self.name, exc_info=error)
                for source, _, _ in batch:
                    source.failed(error)

    async def _pace(self) -> None:
        """Wait until `interval_s` after the previous batch started, unless a full batch waits
        or the group commit is stopping. Not cut short by what arrives meanwhile: it is at most
        one interval."""
        loop = asyncio.get_running_loop()
        wait = self._last_start + self.interval_s - loop.time()
        if wait > 0 and not self._stopping and not self._full_batch_waits():
            await asyncio.sleep(wait)
        self._last_start = loop.time()

    def _full_batch_waits(self) -> bool:
        items = sum(source.pending for source in self._queue)
        size = sum(source.pending_bytes for source in self._queue)
        return items >= self.max_items or size >= self.max_bytes

    def _take_batch(self) -> list[tuple[S, W, int]]:
        batch: list[tuple[S, W, int]] = []
        items = size = 0
        while self._queue and items < self.max_items and size < self.max_bytes:
            source = self._queue.popleft()
            if source.dropped:
                source.queued = False
                continue
            try:
                work, work_items, work_size = source.take(self.max_items - items)
            except Exception as error:  # a bug: its source fails, rather than stall unwritten
                log.error("could not take work", group_commit=self.name, exc_info=error)
                source.queued = False
                source.failed(error)
                continue
            batch.append((source, work, work_size))
            items += work_items
            size += work_size
            if source.has_work():
                self._queue.append(source)  # the rest in a later batch, after the others' turn
            else:
                source.queued = False
        return batch
