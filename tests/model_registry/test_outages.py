"""The registry through outages of its database (PostgreSQL) and of its blob store (SeaweedFS):
honest statuses meanwhile, readiness NOT_SERVING and back, VersionUpdate carrying on, nothing
partial visible, and service resumed by itself."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Sequence

import grpc
import pytest

from shared.api import model_registry_pb2 as mr
from tests.fixtures.postgres import PostgresCluster, ProxiedDatabase, new_database_name
from tests.fixtures.seaweedfs import SeaweedS3, new_bucket_name
from tests.helpers.health import NOT_SERVING, SERVING, health, wait_for_health
from tests.helpers.registry import UPLOAD_CHUNK, WAIT_S, download, numbers, upload
from tests.helpers.running import make_registry_factory

OUTAGE_S = 2.0


async def expect_status(code: grpc.StatusCode, call: object) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await call  # type: ignore[misc]
    assert failed.value.code() == code, failed.value.details()


async def first_success(attempt: object, calls: Sequence[object] = ()) -> float:
    """Seconds until `attempt()` (a coroutine function) succeeds."""
    started = time.monotonic()
    while True:
        try:
            await attempt()  # type: ignore[operator]
            return time.monotonic() - started
        except grpc.aio.AioRpcError as error:
            assert error.code() == grpc.StatusCode.UNAVAILABLE, error.details()
            assert time.monotonic() - started < WAIT_S, "never served again"
            await asyncio.sleep(0.02)


async def test_postgresql_outage(faulty_postgres: PostgresCluster, tmp_path: object) -> None:
    url = faulty_postgres.create_database(new_database_name())
    start = make_registry_factory("--database_url", url, "--archive_dir", str(tmp_path))
    async with start("--outage_bound", "30") as registry:
        await registry.stub.CreateOrUpdateModel(
            mr.CreateOrUpdateModelRequest(model_info=mr.ModelInfo(model_id="m"))
        )
        first = secrets.token_bytes(3 * UPLOAD_CHUNK)
        assert await upload(registry, "m", first) == 1
        updates = registry.stub.VersionUpdate(mr.VersionUpdateRequest(model_id="m"))
        assert (await asyncio.wait_for(updates.read(), WAIT_S)).version_info.version_number == 1

        faulty_postgres.pause()
        await wait_for_health(registry.channel, NOT_SERVING)
        assert await health(registry.channel, "liveness") == SERVING
        await expect_status(
            grpc.StatusCode.UNAVAILABLE, upload(registry, "m", secrets.token_bytes(UPLOAD_CHUNK))
        )
        await expect_status(grpc.StatusCode.UNAVAILABLE, download(registry, "m", 1))
        await asyncio.sleep(OUTAGE_S)

        faulty_postgres.resume()
        second = secrets.token_bytes(2 * UPLOAD_CHUNK)
        recovered_s = await first_success(lambda: upload(registry, "m", second))
        print(f"model registry: first upload {recovered_s:.3f} s after PostgreSQL came back")
        await wait_for_health(registry.channel, SERVING)
        # VersionUpdate carried on through the outage: the new version, once, and nothing else.
        assert (await asyncio.wait_for(updates.read(), WAIT_S)).version_info.version_number == 2
        assert await numbers(registry, "m") == [1, 2]  # the refused upload left no version, no gap
        assert await download(registry, "m", 2) == second
        updates.cancel()


async def test_blob_store_outage(faulty_seaweed_s3: SeaweedS3, tmp_path: object) -> None:
    server = faulty_seaweed_s3
    storage = [
        "--database_url",
        f"sqlite+aiosqlite:///{tmp_path}/registry.db",
        "--s3_endpoint",
        server.endpoint,
        "--s3_bucket",
        new_bucket_name(),
        "--s3_access_key",
        server.access_key,
        "--s3_secret_key",
        server.secret_key,
        "--s3_secure",
        "false",
    ]
    # No hot-version cache: every download reads the blob store.
    async with make_registry_factory(*storage)("--data_cache_bytes", "0") as registry:
        await registry.stub.CreateOrUpdateModel(
            mr.CreateOrUpdateModelRequest(model_info=mr.ModelInfo(model_id="m"))
        )
        first = secrets.token_bytes(3 * UPLOAD_CHUNK)
        assert await upload(registry, "m", first) == 1

        server.pause()
        await wait_for_health(registry.channel, NOT_SERVING)
        await expect_status(
            grpc.StatusCode.UNAVAILABLE, upload(registry, "m", secrets.token_bytes(UPLOAD_CHUNK))
        )
        await expect_status(grpc.StatusCode.UNAVAILABLE, download(registry, "m", 1))
        assert await numbers(registry, "m") == [1]  # metadata still answers; nothing partial

        server.resume()
        recovered_s = await first_success(lambda: download(registry, "m", 1))
        print(f"model registry: first download {recovered_s:.3f} s after SeaweedFS came back")
        await wait_for_health(registry.channel, SERVING)
        second = secrets.token_bytes(2 * UPLOAD_CHUNK)
        assert await upload(registry, "m", second) == 2
        assert await download(registry, "m", 1) == first
        assert await download(registry, "m", 2) == second


async def test_a_version_whose_commit_answer_was_lost_on_the_wire_is_made_once(
    proxied_database: ProxiedDatabase, tmp_path: object
) -> None:
    """PostgreSQL committed the version, the connection broke before its answer came back (the
    fault proxy): the registry rides it out, makes the commit again, finds the version made, and
    the client is told of that one version."""
    start = make_registry_factory("--database_url", proxied_database.url, "--archive_dir", str(tmp_path))
    async with start() as registry:
        await registry.stub.CreateOrUpdateModel(
            mr.CreateOrUpdateModelRequest(model_info=mr.ModelInfo(model_id="m"))
        )
        data = secrets.token_bytes(3 * UPLOAD_CHUNK)
        lost = proxied_database.proxy.arm_lost_commit(b"INSERT INTO registry_versions")
        assert await upload(registry, "m", data) == 1
        assert await lost.wait(WAIT_S), "the version was rolled back, not committed"
        assert await numbers(registry, "m") == [1]
        assert await download(registry, "m", 1) == data
        assert await upload(registry, "m", data[:10]) == 2  # numbering goes on, gap-free
