"""The hot-version cache's budget: loads reserve their size first, least recently used versions
make room, and a version that cannot find room is left to streaming without evicting anything."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from services.model_registry.hot_versions import HotVersions


def chunks_of(data: bytes, gate: asyncio.Event | None = None) -> Callable[[], AsyncIterator[bytes]]:
    async def load() -> AsyncIterator[bytes]:
        if gate is not None:
            await gate.wait()
        yield data

    return load


async def test_loads_come_out_of_the_budget_and_a_version_without_room_evicts_nothing() -> None:
    cache = HotVersions(400)
    assert bytes(await cache.get("a", 30, chunks_of(b"a" * 30)) or b"") == b"a" * 30
    gate = asyncio.Event()
    loading = asyncio.create_task(cache.get("b", 100, chunks_of(b"b" * 100, gate)))
    await asyncio.sleep(0)
    # 100 being loaded + 350 do not fit in 400 however much is evicted: streamed, "a" kept.
    assert cache.accepts(100)
    assert await cache.get("c", 350, chunks_of(b"c" * 350)) is None
    gate.set()
    assert bytes(await loading or b"") == b"b" * 100
    assert bytes(await cache.get("a", 30, chunks_of(b"never read")) or b"") == b"a" * 30  # a hit
    # 300 fits once the least recently used versions ("b", then "a") make room.
    assert bytes(await cache.get("d", 300, chunks_of(b"d" * 300)) or b"") == b"d" * 300
    assert await cache.get("b", 100, chunks_of(b"x" * 100)) is not None  # "b" was evicted: read again
    cache.forget(["d", "b"])
    assert bytes(await cache.get("d", 300, chunks_of(b"e" * 300)) or b"") == b"e" * 300  # forgotten
