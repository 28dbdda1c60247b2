"""The registry's local blob store on a full disk: RESOURCE_EXHAUSTED, nothing partial left, and
uploads work again once space is freed."""

from __future__ import annotations

import secrets
from pathlib import Path

import grpc
import pytest

from shared.api import model_registry_pb2 as mr
from tests.helpers.registry import download, numbers, upload
from tests.helpers.running import make_registry_factory

BALLAST_BYTES = 8 * 1024 * 1024


async def test_a_full_disk_is_resource_exhausted_and_leaves_nothing(
    small_volume: Path, tmp_path: Path
) -> None:
    blobs = small_volume / "blobs"
    ballast = small_volume / "ballast"
    ballast.write_bytes(bytes(BALLAST_BYTES))
    storage = [
        "--database_url",
        f"sqlite+aiosqlite:///{tmp_path / 'registry.db'}",
        "--archive_dir",
        str(blobs),
    ]
    async with make_registry_factory(*storage)() as registry:
        await registry.stub.CreateOrUpdateModel(
            mr.CreateOrUpdateModelRequest(model_info=mr.ModelInfo(model_id="m"))
        )
        small = secrets.token_bytes(1024 * 1024)
        assert await upload(registry, "m", small) == 1
        with pytest.raises(grpc.aio.AioRpcError) as full:
            await upload(registry, "m", secrets.token_bytes(10 * 1024 * 1024))
        assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, full.value.details()
        assert await numbers(registry, "m") == [1]
        # The refused upload's bytes are gone: only the stored version's file is left.
        assert sorted(path.stat().st_size for path in blobs.rglob("*") if path.is_file()) == [len(small)]

        ballast.unlink()
        again = secrets.token_bytes(4 * 1024 * 1024)
        assert await upload(registry, "m", again) == 2
        assert await download(registry, "m", 2) == again
