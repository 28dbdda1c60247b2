"""A bounded in-memory cache of version data, for versions many actors download at once.

Versions are immutable and every upload has its own blob key, so cached bytes can never be
stale: the key is the blob key, and a version deleted or evicted from the registry is not looked
up any more (the registry resolves versions in the database first; this process also forgets
them at once). Memory is bounded by bytes, versions being loaded included: a load reserves its
size in the budget first (least recently used versions make room), and a version that finds no
room, or is larger than a quarter of the budget, is streamed from the blob store instead.
Concurrent first requests for one version share a single read of the blob.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterable

from prometheus_client import Counter, Gauge

hits_total = Counter("cogment_model_registry_data_cache_hits_total", "Version data served from memory.")
misses_total = Counter(
    "cogment_model_registry_data_cache_misses_total", "Version data read from the blob store."
)
cached_bytes = Gauge("cogment_model_registry_data_cache_bytes", "Bytes of version data held in memory.")


class HotVersions:
    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.max_item_bytes = budget_bytes // 4
        self._items: OrderedDict[str, memoryview] = OrderedDict()
        # Bytes held: cached versions, and the sizes reserved by versions being loaded (of which
        # `_loading_bytes`).
        self._size = 0
        self._loading_bytes = 0
        self._loading: dict[str, asyncio.Future[memoryview]] = {}

    def accepts(self, size: int) -> bool:
        return 0 < size <= self.max_item_bytes

    async def get(
        self, blob_key: str, size: int, load: Callable[[], AsyncIterator[bytes]]
    ) -> memoryview | None:
        """The blob's bytes (`size` of them, read-only), from memory or read once with `load`
        (shared by concurrent callers); None when there is no room to load it: stream it."""
        data = self._items.get(blob_key)
        if data is not None:
            self._items.move_to_end(blob_key)
            hits_total.inc()
            return data
        pending = self._loading.get(blob_key)
        if pending is not None:
            hits_total.inc()
            return await asyncio.shield(pending)
        misses_total.inc()
        if not self._reserve(size):
            return None
        future: asyncio.Future[memoryview] = asyncio.get_running_loop().create_future()
        self._loading[blob_key] = future
        try:
            data = await _read_into(bytearray(size), load())
        except BaseException as error:
            self._release(size)
            future.set_exception(error)
            future.exception()  # retrieved: waiters get it, nobody else needs to
            raise
        finally:
            del self._loading[blob_key]
            self._loading_bytes -= size
        future.set_result(data)
        self._items[blob_key] = data  # its reservation becomes its place
        cached_bytes.set(self._size)
        return data

    def forget(self, blob_keys: Iterable[str]) -> None:
        """These versions are gone (model deleted, version evicted): free their memory now."""
        for blob_key in blob_keys:
            data = self._items.pop(blob_key, None)
            if data is not None:
                self._release(len(data))

    def _reserve(self, size: int) -> bool:
        """Make room for `size` bytes, evicting the least recently used versions; False (and
        nothing evicted) when versions being loaded hold too much of the budget."""
        if self._loading_bytes + size > self.budget_bytes:
            return False
        while self._size + size > self.budget_bytes:
            _, evicted = self._items.popitem(last=False)
            self._size -= len(evicted)
        self._size += size
        self._loading_bytes += size
        cached_bytes.set(self._size)
        return True

    def _release(self, size: int) -> None:
        self._size -= size
        cached_bytes.set(self._size)


async def _read_into(buffer: bytearray, chunks: AsyncIterator[bytes]) -> memoryview:
    """The chunks, copied into `buffer` as they come (joining a list of them would hold the
    version twice), as a read-only view."""
    view = memoryview(buffer)
    filled = 0
    async for chunk in chunks:
        if filled + len(chunk) > len(buffer):
            raise ValueError(f"the blob holds more than its recorded {len(buffer)} bytes")
        view[filled : filled + len(chunk)] = chunk
        filled += len(chunk)
    if filled != len(buffer):
        raise ValueError(f"the blob holds {filled} bytes, not its recorded {len(buffer)}")
    return view.toreadonly()
