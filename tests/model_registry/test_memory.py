"""Memory bounded by settings, not by what clients do, measured on a real registry process's RSS:
whole versions loaded into the hot cache come out of its budget (`--data_cache_bytes`), and a
deleted model's versions leave memory at once."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc

from shared.api import model_registry_pb2 as mr
from shared.api import model_registry_pb2_grpc
from tests.helpers.digest import sha256_b64
from tests.helpers.services import rss_bytes, start_service

MiB = 1024 * 1024
VERSION_BYTES = 60 * MiB
VERSIONS = 10
CACHE_BYTES = 256 * MiB
CHUNK = 2 * MiB
# Above the budget: the versions being streamed (a few chunks each) and gRPC's own buffers.
MARGIN_BYTES = 128 * MiB


async def test_concurrent_cold_downloads_stay_within_the_cache_budget(tmp_path: Path) -> None:
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
            idle = rss_bytes(service.process.pid)
            peak = idle
            done = False

            async def watch_rss() -> None:
                nonlocal peak
                while not done:
                    peak = max(peak, rss_bytes(service.process.pid))
                    await asyncio.sleep(0.01)

            async def download(index: int) -> int:
                request = mr.RetrieveVersionDataRequest(model_id=f"m{index}", version_number=1)
                received = 0
                async for chunk in stub.RetrieveVersionData(request):
                    assert chunk.data_chunk[:1] == bytes([index])
                    received += len(chunk.data_chunk)
                return received

            watcher = asyncio.create_task(watch_rss())
            sizes = await asyncio.gather(*(download(index) for index in range(VERSIONS)))
            done = True
            await watcher
            assert sizes == [VERSION_BYTES] * VERSIONS
            growth = peak - idle
            print(f"model registry: peak RSS grew {growth / MiB:.0f} MiB for {VERSIONS} cold 60 MiB versions")
            assert growth < CACHE_BYTES + MARGIN_BYTES, f"RSS grew {growth / MiB:.0f} MiB"

            # Deleting the models frees their cached versions at once.
            before = rss_bytes(service.process.pid)
            for index in range(VERSIONS):
                await stub.DeleteModel(mr.DeleteModelRequest(model_id=f"m{index}"))
            freed = before - rss_bytes(service.process.pid)
            print(f"model registry: deleting the models freed {freed / MiB:.0f} MiB")
            assert freed > CACHE_BYTES // 2, f"only {freed / MiB:.0f} MiB freed"
