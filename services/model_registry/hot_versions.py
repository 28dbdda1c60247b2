"""A bounded in-memory cache of version data, for versions many actors download at once.

Versions are immutable and every upload has its own blob key, so cached bytes can never be
stale: the key is the blob key, and a version deleted or evicted from the registry is not looked
up any more (the registry resolves versions in the database first; this process also forgets
them at once). Memory is bounded by bytes, versions being loaded included: a load reserves its
size in the budget first (least recently used versions make room), and a version that finds no
room, or is larger than a quarter of the budget, is streamed from the blob store instead.

A version is read from the blob store once, by a load of its own, whatever the number of callers:
they are sent its bytes as they arrive (the first byte does not wait for the last), and a caller
that goes away does not stop the load for the others.
"""

from __future__ import annotations

import asyncio
import mmap
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable

from services.model_registry.metrics import (
    data_cache_bytes,
    data_cache_evictions_total,
    data_cache_hits_total,
    data_cache_misses_total,
)
from shared.logging import get_logger

log = get_logger("model_registry.hot_versions")

# Fills a buffer with a version's data, calling back with how much has arrived after each part
# (see BlobStore.read_into).
Fill = Callable[[memoryview, Callable[[int], None]], Awaitable[None]]


class _Load:
    """One version being read into memory: how much of it has arrived, and how it ended."""

    def __init__(self, size: int) -> None:
        # An anonymous mapping: its pages are zeroed as the data reaches them (a bytearray is
        # zeroed whole first, 30 ms for 50 MiB before the first byte is read), and unmapped once
        # the last view goes.
        self.buffer = mmap.mmap(-1, size)
        self.view = memoryview(self.buffer)
        self.filled = 0
        self.error: BaseException | None = None
        self.forgotten = False
        # Held here: the event loop keeps only a weak reference to a running task.
        self.task: asyncio.Task[None] | None = None
        # Replaced at each step: a reader takes the current one before looking at `filled`.
        self.progressed = asyncio.Event()

    def step(self) -> None:
        progressed, self.progressed = self.progressed, asyncio.Event()
        progressed.set()


class HotVersions:
    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.max_item_bytes = budget_bytes // 4
        self._items: OrderedDict[str, memoryview] = OrderedDict()
        # Bytes held: cached versions, and the sizes reserved by versions being loaded (of which
        # `_loading_bytes`).
        self._size = 0
        self._loading_bytes = 0
        self._loading: dict[str, _Load] = {}

    def accepts(self, size: int) -> bool:
        return 0 < size <= self.max_item_bytes

    def chunks(
        self, blob_key: str, size: int, fill: Fill, chunk_size: int
    ) -> AsyncIterator[memoryview] | None:
        """The blob's bytes (`size` of them) in read-only chunks of at most `chunk_size`: from
        memory, from the load under way, or from a load started now with `fill`. None when
        there is no room to load it: stream it from the blob store."""
        data = self._items.get(blob_key)
        if data is not None:
            self._items.move_to_end(blob_key)
            data_cache_hits_total.inc()
            return _slices(data, chunk_size)
        loading = self._loading.get(blob_key)
        if loading is not None:
            data_cache_hits_total.inc()
            return _following(loading, chunk_size)
        data_cache_misses_total.inc()
        if not self._reserve(size):
            return None
        loading = self._loading[blob_key] = _Load(size)
        loading.task = asyncio.get_running_loop().create_task(
            self._fill(blob_key, loading, fill), name=f"hot-version-{blob_key}"
        )
        return _following(loading, chunk_size)

    async def _fill(self, blob_key: str, loading: _Load, fill: Fill) -> None:
        size = len(loading.buffer)

        def arrived(filled: int) -> None:
            loading.filled = filled
            loading.step()

        try:
            await fill(loading.view, arrived)
        except BaseException as error:  # its readers fail with it (a cancellation included)
            loading.error = error
            self._release(size)
            if not isinstance(error, asyncio.CancelledError):
                log.warning("could not load a version's data", blob_key=blob_key, error=str(error))
        else:
            if loading.forgotten:  # deleted while it loaded: its readers finish, nothing is kept
                self._release(size)
            else:
                self._items[blob_key] = loading.view.toreadonly()  # its reservation becomes its place
        finally:
            del self._loading[blob_key]
            self._loading_bytes -= size
            data_cache_bytes.set(self._size)
            loading.step()

    def forget(self, blob_keys: Iterable[str]) -> None:
        """These versions are gone (model deleted, version evicted): free their memory now (a
        version being loaded, once its current readers have it)."""
        for blob_key in blob_keys:
            data = self._items.pop(blob_key, None)
            if data is not None:
                self._release(len(data))
            loading = self._loading.get(blob_key)
            if loading is not None:
                loading.forgotten = True

    def _reserve(self, size: int) -> bool:
        """Make room for `size` bytes, evicting the least recently used versions; False (and
        nothing evicted) when versions being loaded hold too much of the budget."""
        if self._loading_bytes + size > self.budget_bytes:
            return False
        while self._size + size > self.budget_bytes:
            _, evicted = self._items.popitem(last=False)
            self._size -= len(evicted)
            data_cache_evictions_total.inc()
        self._size += size
        self._loading_bytes += size
        data_cache_bytes.set(self._size)
        return True

    def _release(self, size: int) -> None:
        self._size -= size
        data_cache_bytes.set(self._size)


async def _slices(data: memoryview, chunk_size: int) -> AsyncIterator[memoryview]:
    for start in range(0, len(data), chunk_size):
        yield data[start : start + chunk_size]


async def _following(loading: _Load, chunk_size: int) -> AsyncIterator[memoryview]:
    """The bytes of a load as they arrive (views of its buffer: what has arrived never changes)."""
    data = loading.view.toreadonly()
    sent = 0
    while sent < len(data):
        progressed = loading.progressed
        if sent < loading.filled:
            end = min(loading.filled, sent + chunk_size)
            yield data[sent:end]
            sent = end
        elif loading.error is not None:
            raise loading.error
        else:
            await progressed.wait()
