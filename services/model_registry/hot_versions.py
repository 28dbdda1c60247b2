"""A bounded in-memory cache of version data, for versions many actors download at once.

Versions are immutable and every upload has its own blob key, so cached bytes can never be
stale: the key is the blob key, and a version deleted or evicted from the registry is not looked
up any more (the registry resolves versions in the database first). Memory is bounded by bytes;
versions larger than a quarter of the budget are always streamed from the blob store instead.
Concurrent first requests for one version share a single read of the blob.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable

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
        self._items: OrderedDict[str, bytes] = OrderedDict()
        self._size = 0
        self._loading: dict[str, asyncio.Future[bytes]] = {}

    def accepts(self, size: int) -> bool:
        return 0 < size <= self.max_item_bytes

    async def get(self, blob_key: str, load: Callable[[], AsyncIterator[bytes]]) -> bytes:
        """The blob's bytes, from memory or read once with `load` (shared by concurrent callers)."""
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
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._loading[blob_key] = future
        try:
            data = b"".join([chunk async for chunk in load()])
        except BaseException as error:
            future.set_exception(error)
            future.exception()  # retrieved: waiters get it, nobody else needs to
            raise
        finally:
            del self._loading[blob_key]
        future.set_result(data)
        self._keep(blob_key, data)
        return data

    def _keep(self, blob_key: str, data: bytes) -> None:
        self._items[blob_key] = data
        self._size += len(data)
        while self._size > self.budget_bytes:
            _, evicted = self._items.popitem(last=False)
            self._size -= len(evicted)
        cached_bytes.set(self._size)
