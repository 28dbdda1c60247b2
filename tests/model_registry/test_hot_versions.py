"""The hot-version cache: loads reserve their size first, least recently used versions make room,
a version that cannot find room is left to streaming without evicting anything, and readers are
sent a version's bytes as its one load brings them in."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from services.model_registry.hot_versions import Fill, HotVersions


def chunks_of(*parts: bytes, gate: asyncio.Event | None = None) -> Fill:
    """A fill that writes `parts` one after the other, as a blob store's read_into does."""

    async def fill(buffer: memoryview, arrived: Callable[[int], None]) -> None:
        if gate is not None:
            await gate.wait()
        filled = 0
        for part in parts:
            buffer[filled : filled + len(part)] = part
            filled += len(part)
            arrived(filled)
            await asyncio.sleep(0)

    return fill


async def read(cache: HotVersions, key: str, size: int, fill: Fill) -> bytes | None:
    chunks = cache.chunks(key, size, fill, chunk_size=64)
    if chunks is None:
        return None
    return b"".join([bytes(chunk) async for chunk in chunks])


async def test_loads_come_out_of_the_budget_and_a_version_without_room_evicts_nothing() -> None:
    cache = HotVersions(400)
    assert await read(cache, "a", 30, chunks_of(b"a" * 30)) == b"a" * 30
    gate = asyncio.Event()
    loading = asyncio.create_task(read(cache, "b", 100, chunks_of(b"b" * 100, gate=gate)))
    await asyncio.sleep(0)
    # 100 being loaded + 350 do not fit in 400 however much is evicted: streamed, "a" kept.
    assert cache.accepts(100)
    assert cache.chunks("c", 350, chunks_of(b"c" * 350), 64) is None
    gate.set()
    assert await loading == b"b" * 100
    assert await read(cache, "a", 30, chunks_of(b"never read")) == b"a" * 30  # a hit
    # 300 fits once the least recently used versions ("b", then "a") make room.
    assert await read(cache, "d", 300, chunks_of(b"d" * 300)) == b"d" * 300
    assert await read(cache, "b", 100, chunks_of(b"x" * 100)) == b"x" * 100  # "b" was evicted: read again
    cache.forget(["d", "b"])
    assert await read(cache, "d", 300, chunks_of(b"e" * 300)) == b"e" * 300  # forgotten


async def test_readers_get_a_versions_first_bytes_before_its_load_ends() -> None:
    cache = HotVersions(400)
    second_part = asyncio.Event()
    loads = 0

    async def fill(buffer: memoryview, arrived: Callable[[int], None]) -> None:
        nonlocal loads
        loads += 1
        buffer[:50] = b"1" * 50
        arrived(50)
        await second_part.wait()
        buffer[50:] = b"2" * 50
        arrived(100)

    readers = [cache.chunks("v", 100, fill, 64) for _ in range(3)]
    firsts = [bytes(await anext(reader)) for reader in readers if reader is not None]
    assert firsts == [b"1" * 50] * 3  # while the rest is still on its way
    second_part.set()
    for reader in readers:
        assert reader is not None
        assert b"".join([bytes(chunk) async for chunk in reader]) == b"2" * 50
    assert loads == 1
    assert await read(cache, "v", 100, chunks_of(b"never read")) == b"1" * 50 + b"2" * 50


async def test_a_failed_load_fails_its_readers_and_keeps_nothing() -> None:
    cache = HotVersions(400)

    async def broken(buffer: memoryview, arrived: Callable[[int], None]) -> None:
        buffer[:10] = b"x" * 10
        arrived(10)
        raise ConnectionError("blob store away")

    with pytest.raises(ConnectionError):
        await read(cache, "v", 100, broken)
    assert await read(cache, "v", 100, chunks_of(b"y" * 100)) == b"y" * 100  # read anew


async def test_a_version_forgotten_while_it_loads_is_not_kept() -> None:
    cache = HotVersions(400)
    gate = asyncio.Event()
    reader = asyncio.create_task(read(cache, "v", 100, chunks_of(b"v" * 100, gate=gate)))
    await asyncio.sleep(0)
    cache.forget(["v"])  # its model was deleted meanwhile
    gate.set()
    assert await reader == b"v" * 100  # its reader still gets what it asked for
    assert await read(cache, "v", 100, chunks_of(b"w" * 100)) == b"w" * 100  # not kept
