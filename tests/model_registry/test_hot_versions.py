"""The hot-version cache: loads reserve their size first, least recently used versions nobody is
reading make room, a version that cannot find room is left to streaming without evicting anything,
readers are sent a version's bytes as its one load brings them in, and a version's bytes count
in the budget until it has left the cache and its last reader is done."""

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
        for index, part in enumerate(parts):
            if index:
                await asyncio.sleep(0)
            buffer[filled : filled + len(part)] = part
            filled += len(part)
            arrived(filled)

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


async def test_a_version_being_read_is_not_evicted_and_counts_until_its_reader_is_done() -> None:
    cache = HotVersions(1000)
    for key in "abcd":
        assert await read(cache, key, 250, chunks_of(key.encode() * 250)) == key.encode() * 250
    slow = cache.chunks("a", 250, chunks_of(b"never read"), 64)
    assert slow is not None
    assert bytes(await anext(slow)) == b"a" * 64  # a download of "a" under way
    for key in "bcd":
        assert await read(cache, key, 250, chunks_of(b"never read")) == key.encode() * 250
    # "a" is the least recently used, but being read: "b" makes room.
    assert await read(cache, "e", 250, chunks_of(b"e" * 250)) == b"e" * 250
    assert await read(cache, "a", 250, chunks_of(b"never read")) == b"a" * 250
    assert await read(cache, "b", 250, chunks_of(b"x" * 250)) == b"x" * 250  # "b" was evicted
    assert cache.held_bytes == 1000
    # A forgotten version's bytes stay counted while its download goes on, and leave with it.
    cache.forget(["a"])
    assert cache.held_bytes == 1000
    assert b"".join([bytes(chunk) async for chunk in slow]) == b"a" * 186
    assert cache.held_bytes == 750


async def test_a_reader_that_stops_early_releases_its_version() -> None:
    cache = HotVersions(400)
    assert await read(cache, "a", 300, chunks_of(b"a" * 300)) == b"a" * 300
    reader = cache.chunks("a", 300, chunks_of(b"never read"), 64)
    assert reader is not None
    await anext(reader)
    assert cache.chunks("b", 150, chunks_of(b"b" * 150), 64) is None  # "a" is being read
    await reader.aclose()
    assert await read(cache, "b", 150, chunks_of(b"b" * 150)) == b"b" * 150  # "a" evicted now
    assert cache.held_bytes == 150
