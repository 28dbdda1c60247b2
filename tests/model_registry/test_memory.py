"""Memory bounded by settings, not by what clients do, measured on a real registry process's RSS:
whole versions loaded into the hot cache come out of its budget (`--data_cache_bytes`) for as long
as a download still reads them, and a deleted model's versions leave memory at once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import grpc

from shared.api import model_registry_pb2 as mr
from shared.api import model_registry_pb2_grpc
from tests.helpers.digest import sha256_b64
from tests.helpers.services import RunningService, rss_bytes, start_service

MiB = 1024 * 1024
VERSION_BYTES = 60 * MiB
VERSIONS = 10
CACHE_BYTES = 256 * MiB
CHUNK = 2 * MiB
# Above the budget: the versions being streamed (a few chunks each) and gRPC's own buffers.
MARGIN_BYTES = 128 * MiB


@asynccontextmanager
async def registry_with_versions(
    tmp_path: Path,
) -> AsyncIterator[tuple[RunningService, model_registry_pb2_grpc.ModelRegistrySPStub]]:
    """A registry holding models m0..m9, each with one archived version of VERSION_BYTES bytes
    (all of them `index`), none of them in memory yet."""
    args = ["--data_dir", str(tmp_path), "--log_level", "info", "--data_cache_bytes", str(CACHE_BYTES)]
    with await asyncio.to_thread(start_service, "services.model_registry", args, log_dir=tmp_path) as service:
        async with grpc.aio.insecure_channel(service.address) as channel:
            stub = model_registry_pb2_grpc.ModelRegistrySPStub(channel)
            for index in range(VERSIONS):
                model_id = f"m{index}"
                await stub.CreateOrUpdateModel(
                    mr.CreateOrUpdateModelRequest(model_info=mr.ModelInfo(model_id=model_id))
                )
                data = bytes([index]) * VERSION_BYTES
                info = mr.ModelVersionInfo(
                    model_id=model_id, archived=True, data_size=len(data), data_hash=sha256_b64(data)
                )
                messages = [
                    mr.CreateVersionRequestChunk(
                        header=mr.CreateVersionRequestChunk.Header(version_info=info)
                    )
                ]
                messages += [
                    mr.CreateVersionRequestChunk(
                        body=mr.CreateVersionRequestChunk.Body(data_chunk=data[i : i + CHUNK])
                    )
                    for i in range(0, len(data), CHUNK)
                ]
                await stub.CreateVersion(iter(messages))
            await asyncio.sleep(1.0)
            yield service, stub


class PeakRss:
    """The highest RSS of a process while watched, sampled every 10 ms."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = rss_bytes(pid)
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> PeakRss:
        self._task = asyncio.create_task(self._watch())
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self._task is not None
        self._task.cancel()
        self.peak = max(self.peak, rss_bytes(self.pid))

    async def _watch(self) -> None:
        while True:
            self.peak = max(self.peak, rss_bytes(self.pid))
            await asyncio.sleep(0.01)


async def download(
    stub: model_registry_pb2_grpc.ModelRegistrySPStub, index: int, go_on: asyncio.Event | None = None
) -> int:
    """Version 1 of model m{index}, checked; with `go_on`, the first chunk is read and the rest
    only once it is set (a slow reader)."""
    request = mr.RetrieveVersionDataRequest(model_id=f"m{index}", version_number=1)
    received = 0
    async for chunk in stub.RetrieveVersionData(request):
        assert chunk.data_chunk[:1] == bytes([index])
        received += len(chunk.data_chunk)
        if go_on is not None:
            await go_on.wait()
    return received


async def test_concurrent_cold_downloads_stay_within_the_cache_budget(tmp_path: Path) -> None:
    async with registry_with_versions(tmp_path) as (service, stub):
        idle = rss_bytes(service.process.pid)
        async with PeakRss(service.process.pid) as rss:
            sizes = await asyncio.gather(*(download(stub, index) for index in range(VERSIONS)))
        assert sizes == [VERSION_BYTES] * VERSIONS
        growth = rss.peak - idle
        print(f"model registry: peak RSS grew {growth / MiB:.0f} MiB for {VERSIONS} cold 60 MiB versions")
        assert growth < CACHE_BYTES + MARGIN_BYTES, f"RSS grew {growth / MiB:.0f} MiB"

        # Deleting the models frees their cached versions at once.
        before = rss_bytes(service.process.pid)
        for index in range(VERSIONS):
            await stub.DeleteModel(mr.DeleteModelRequest(model_id=f"m{index}"))
        freed = before - rss_bytes(service.process.pid)
        print(f"model registry: deleting the models freed {freed / MiB:.0f} MiB")
        assert freed > CACHE_BYTES // 2, f"only {freed / MiB:.0f} MiB freed"


async def test_versions_slow_readers_hold_are_not_evicted_past_the_budget(tmp_path: Path) -> None:
    # Each download starts once the previous version is loaded, and then stalls: a version that
    # made room by evicting one still being sent would map all ten (600 MiB).
    async with registry_with_versions(tmp_path) as (service, stub):
        idle = rss_bytes(service.process.pid)
        go_on = asyncio.Event()
        async with PeakRss(service.process.pid) as rss:
            downloads = []
            for index in range(VERSIONS):
                downloads.append(asyncio.create_task(download(stub, index, go_on)))
                await asyncio.sleep(0.5)
            go_on.set()
            sizes = await asyncio.gather(*downloads)
        assert sizes == [VERSION_BYTES] * VERSIONS
        growth = rss.peak - idle
        print(f"model registry: peak RSS grew {growth / MiB:.0f} MiB for {VERSIONS} stalled 60 MiB downloads")
        assert growth < CACHE_BYTES + MARGIN_BYTES, f"RSS grew {growth / MiB:.0f} MiB"
