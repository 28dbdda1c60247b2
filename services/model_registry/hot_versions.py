"""A bounded in-memory cache of version data, for versions many actors download at once.

Versions are immutable and every upload has its own blob key, so cached bytes can never be
stale: the key is the blob key, and a version deleted or evicted from the registry is not looked
up any more (the registry resolves versions in the database first; this process also forgets
them at once). Memory is bounded by bytes: a version's bytes count in the budget from the moment
its load reserves them until it has left the cache (evicted, forgotten, or its load failed) and
its last reader is done with it. Only versions nobody is reading are evicted, least recently used
first, to make room; a version that finds no room, or is larger than a quarter of the budget, is
streamed from the blob store instead.

A version is read from the blob store once, by a load of its own, whatever the number of callers:
they are sent its bytes as they arrive (the first byte does not wait for the last), and a caller
that goes away does not stop the load for the others.
"""

from __future__ import annotations

import asyncio
import mmap
from collections import OrderedDict
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable

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


class _Version:
    """One version's bytes in memory: how much of them has arrived, how its load ended, and who is
    reading them."""

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
        self.readers = 0
        # Found by new readers (being loaded, or loaded); its bytes leave the budget once it is
        # not, and has no readers left.
        self.cached = True
        self.released = False

    @property
    def size(self) -> int:
        return len(self.buffer)

    def step(self) -> None:
        progressed, self.progressed = self.progressed, asyncio.Event()
        progressed.set()


class HotVersions:
    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.max_item_bytes = budget_bytes // 4
        self._items: OrderedDict[str, _Version] = OrderedDict()  # loaded, least recently used first
        self._loading: dict[str, _Version] = {}
        self._held_bytes = 0

    @property
    def held_bytes(self) -> int:
        """Bytes of the versions in memory: cached, being loaded, or still being read."""
        return self._held_bytes

    def accepts(self, size: int) -> bool:
        return 0 < size <= self.max_item_bytes

    def chunks(
        self, blob_key: str, size: int, fill: Fill, chunk_size: int
    ) -> AsyncGenerator[memoryview, None] | None:
        """The blob's bytes (`size` of them) in read-only chunks of at most `chunk_size`: from
        memory, from the load under way, or from a load started now with `fill`. None when
        there is no room to load it: stream it from the blob store. Iterate at once (the
        version is held for its reader from the first iteration on), and close when stopping
        early (`contextlib.aclosing`) so that it is released at once."""
        version = self._items.get(blob_key)
        if version is not None:
            self._items.move_to_end(blob_key)
            data_cache_hits_total.inc()
            return _read(version, chunk_size, self._reader_done)
        version = self._loading.get(blob_key)
        if version is not None:
            data_cache_hits_total.inc()
            return _read(version, chunk_size, self._reader_done)
        data_cache_misses_total.inc()
        if not self._reserve(size):
            return None
        version = self._loading[blob_key] = _Version(size)
        version.task = asyncio.get_running_loop().create_task(
            self._fill(blob_key, version, fill), name=f"hot-version-{blob_key}"
        )
        return _read(version, chunk_size, self._reader_done)

    async def _fill(self, blob_key: str, version: _Version, fill: Fill) -> None:
        def arrived(filled: int) -> None:
            version.filled = filled
            version.step()

        try:
            await fill(version.view, arrived)
        except BaseException as error:  # its readers fail with it (a cancellation included)
            version.error = error
            version.cached = False
            if not isinstance(error, asyncio.CancelledError):
                log.warning("could not load a version's data", blob_key=blob_key, error=str(error))
        else:
            if version.forgotten:  # deleted while it loaded: its readers finish, nothing is kept
                version.cached = False
            else:
                self._items[blob_key] = version
        finally:
            del self._loading[blob_key]
            self._release_if_unused(version)
            version.step()

    def forget(self, blob_keys: Iterable[str]) -> None:
        """These versions are gone (model deleted, version evicted): free their memory as soon
        as their current readers have them (a version being loaded, once its load ends)."""
        for blob_key in blob_keys:
            version = self._items.pop(blob_key, None)
            if version is not None:
                version.cached = False
                self._release_if_unused(version)
            version = self._loading.get(blob_key)
            if version is not None:
                version.forgotten = True

    def _reserve(self, size: int) -> bool:
        """Make room for `size` bytes, evicting the least recently used versions nobody is
        reading; False (and nothing evicted) when versions being loaded or read hold too much of
        the budget."""
        unused = [blob_key for blob_key, version in self._items.items() if not version.readers]
        room = self.budget_bytes - self._held_bytes
        if room + sum(self._items[blob_key].size for blob_key in unused) < size:
            return False
        for blob_key in unused:
            if room >= size:
                break
            evicted = self._items.pop(blob_key)
            evicted.cached = False
            self._release_if_unused(evicted)
            room += evicted.size
            data_cache_evictions_total.inc()
        self._held_bytes += size
        data_cache_bytes.set(self._held_bytes)
        return True

    def _reader_done(self, version: _Version) -> None:
        version.readers -= 1
        self._release_if_unused(version)

    def _release_if_unused(self, version: _Version) -> None:
        if not (version.cached or version.readers or version.released):
            version.released = True
            self._held_bytes -= version.size
            data_cache_bytes.set(self._held_bytes)


async def _read(
    version: _Version, chunk_size: int, done: Callable[[_Version], None]
) -> AsyncGenerator[memoryview, None]:
    """The version's bytes as they arrive (views of its buffer: what has arrived never changes),
    the version held for this reader until it ends."""
    version.readers += 1
    try:
        data = version.view.toreadonly()
        sent = 0
        while sent < len(data):
            progressed = version.progressed
            if sent < version.filled:
                end = min(version.filled, sent + chunk_size)
                yield data[sent:end]
                sent = end
            elif version.error is not None:
                raise version.error
            else:
                await progressed.wait()
    finally:
        done(version)
