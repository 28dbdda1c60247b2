"""Bytes held in memory by many holders together, within one budget: admission by bytes.

A holder `acquire`s what it is about to hold and waits its turn while the budget is full, first
come, first served (so that a large request is not overtaken forever by small ones). A request
larger than the whole budget is admitted alone, once nothing else is held: it is never refused.
What turns out to be held beyond what was acquired (a message larger than expected, already in
memory) is `add`ed without waiting: the budget then runs over until it is released.
"""

from __future__ import annotations

import asyncio
from collections import deque


class ByteBudget:
    def __init__(self, total: int) -> None:
        self.total = total
        self.held = 0
        self._waiting: deque[tuple[int, asyncio.Future[None]]] = deque()

    @property
    def waiting(self) -> int:
        """Requests waiting for room."""
        return len(self._waiting)

    def _fits(self, size: int) -> bool:
        return self.held + size <= self.total or self.held == 0

    async def acquire(self, size: int) -> None:
        """Hold `size` more bytes, once there is room and every earlier request was served."""
        if not self._waiting and self._fits(size):
            self.held += size
            return
        granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (size, granted)
        self._waiting.append(entry)
        try:
            await granted
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled():
                self.release(size)  # granted as its waiter was cancelled: given back
            else:
                if entry in self._waiting:  # (`_admit` drops a cancelled request it comes to)
                    self._waiting.remove(entry)
                self._admit()  # the next ones may fit where this one did not
            raise

    def add(self, size: int) -> None:
        """Count `size` more bytes held, already in memory: no waiting, even past the total."""
        self.held += size

    def release(self, size: int) -> None:
        self.held -= size
        self._admit()

    def _admit(self) -> None:
        while self._waiting:
            size, granted = self._waiting[0]
            if not granted.done() and not self._fits(size):
                return
            self._waiting.popleft()
            if not granted.done():
                self.held += size
                granted.set_result(None)
