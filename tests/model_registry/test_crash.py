"""A kill -9 during an upload leaves the Model Registry consistent, on SQLite with local blobs and
on PostgreSQL with SeaweedFS (S3).

The registry runs as users run it (`python -m services.model_registry`). A client streams a
40 MB version slowly; once the server holds part of it (a temp file in the blob directory's
`.incomplete/`, or a multipart upload on S3), the server gets SIGKILL. Restarted on the same
database and blob store:
* the interrupted version is not visible, older versions and their data are intact, and the next
  upload takes the next number (no gap);
* the leftovers (the partial upload, and its `registry_blob_garbage` row recorded when the upload
  started) are still there: a running registry collects them only after STALE_UPLOAD_S (24 h), as
  they could be an upload in progress on another replica;
* collected deterministically (the registry's own `collect_garbage()` with its clock moved past
  STALE_UPLOAD_S, and the blob store's `cleanup_incomplete(0)`, in-process on the same storage
  once the service is stopped), they are gone, and nothing else is: every version row still has
  its blob, no blob is left without a version row, and a restarted registry serves it all.
"""

from __future__ import annotations

import asyncio
import secrets
import signal
import time
import types
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from sqlalchemy import select

import services.model_registry.core as registry_core
from services.model_registry.blobstore import BlobStore, LocalBlobStore, S3BlobStore
from services.model_registry.blobstore.local import INCOMPLETE_DIR
from services.model_registry.core import STALE_UPLOAD_S
from services.model_registry.service import ModelRegistryService, ModelRegistrySettings
from shared.api import model_registry_pb2 as mr
from shared.api import model_registry_pb2_grpc
from shared.db import Database
from shared.schema import registry_blob_garbage, registry_versions
from tests.helpers.digest import sha256_b64
from tests.helpers.eventually import eventually
from tests.helpers.services import RunningService, start_service

MiB = 1024 * 1024
UPLOAD_SIZE = 40 * MiB
UPLOAD_CHUNK = 1 * MiB
# The client sends a chunk, then waits this long: 40 MB take 4 s, the kill comes well before.
UPLOAD_PAUSE_S = 0.1
# Kill once the server holds this much of the upload (or, on S3, a multipart upload exists: once
# a first part of 8 MiB is filled).
KILL_AFTER = 6 * MiB
WAIT_S = 30.0


# ---- the two storage combinations ----


@dataclass
class Storage:
    """Where a registry keeps its state, and how to look at it from outside."""

    database_url: str
    args: list[str]
    make_blobs: Callable[[], BlobStore]
    partial_uploads: Callable[[], list[str]]  # temp files, or multipart upload ids
    stored_blobs: Callable[[], set[str]]  # committed blob keys
    cleanup: list[Callable[[], None]] = field(default_factory=list)


def local_storage(tmp_path: Path) -> Storage:
    database_url = f"sqlite+aiosqlite:///{tmp_path / 'registry.db'}"
    root = tmp_path / "blobs"

    def partial_uploads() -> list[str]:
        incomplete = root / INCOMPLETE_DIR
        return sorted(path.name for path in incomplete.iterdir()) if incomplete.is_dir() else []

    def stored_blobs() -> set[str]:
        return {
            path.relative_to(root).as_posix()
            for path in root.rglob("*")
            if path.is_file() and INCOMPLETE_DIR not in path.relative_to(root).parts
        }

    return Storage(
        database_url,
        ["--database_url", database_url, "--archive_dir", str(root)],
        lambda: LocalBlobStore(root),
        partial_uploads,
        stored_blobs,
    )


def s3_storage(postgres_url: str, s3: Any) -> Storage:
    from minio import Minio

    bucket = f"crash-{secrets.token_hex(6)}"
    client = Minio(s3.endpoint, access_key=s3.access_key, secret_key=s3.secret_key, secure=False)

    def partial_uploads() -> list[str]:
        if not client.bucket_exists(bucket):
            return []
        listing = client._list_multipart_uploads(bucket)
        return sorted(upload.upload_id or "" for upload in listing.uploads)

    def stored_blobs() -> set[str]:
        return {item.object_name or "" for item in client.list_objects(bucket, recursive=True)}

    def make_blobs() -> BlobStore:
        return S3BlobStore(s3.endpoint, s3.access_key, s3.secret_key, bucket, secure=False)

    args = [
        "--database_url", postgres_url,
        "--s3_endpoint", s3.endpoint, "--s3_access_key", s3.access_key, "--s3_secret_key", s3.secret_key,
        "--s3_secure=false", "--s3_bucket", bucket,
    ]  # fmt: skip
    return Storage(postgres_url, args, make_blobs, partial_uploads, stored_blobs)


@pytest.fixture(params=["sqlite-local", "postgresql-s3"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Storage:
    if request.param == "sqlite-local":
        return local_storage(tmp_path)
    return s3_storage(request.getfixturevalue("postgres_url"), request.getfixturevalue("seaweed_s3"))


@pytest.fixture
def processes() -> Iterator[list[RunningService]]:
    """Every registry process started by the test, stopped at the end whatever happens."""
    started: list[RunningService] = []
    yield started
    for service in started:
        service.stop()


def start_registry(storage: Storage, processes: list[RunningService], tmp_path: Path) -> RunningService:
    service = start_service("services.model_registry", storage.args, log_dir=tmp_path)
    processes.append(service)
    return service


# ---- client side ----


@asynccontextmanager
async def connect(service: RunningService) -> AsyncIterator[model_registry_pb2_grpc.ModelRegistrySPStub]:
    async with grpc.aio.insecure_channel(service.address) as channel:
        yield model_registry_pb2_grpc.ModelRegistrySPStub(channel)


def header(model_id: str, size: int, data_hash: str = "") -> mr.CreateVersionRequestChunk:
    info = mr.ModelVersionInfo(model_id=model_id, archived=True, data_size=size, data_hash=data_hash)
    return mr.CreateVersionRequestChunk(header=mr.CreateVersionRequestChunk.Header(version_info=info))


def body(data: bytes) -> mr.CreateVersionRequestChunk:
    return mr.CreateVersionRequestChunk(body=mr.CreateVersionRequestChunk.Body(data_chunk=data))


async def upload(stub: model_registry_pb2_grpc.ModelRegistrySPStub, model_id: str, data: bytes) -> int:
    async def messages() -> AsyncIterator[mr.CreateVersionRequestChunk]:
        yield header(model_id, len(data), sha256_b64(data))
        for start in range(0, len(data), 2 * MiB):
            yield body(data[start : start + 2 * MiB])

    reply = await stub.CreateVersion(messages(), timeout=WAIT_S)
    return int(reply.version_info.version_number)


async def version_numbers(stub: model_registry_pb2_grpc.ModelRegistrySPStub, model_id: str) -> list[int]:
    reply = await stub.RetrieveVersionInfos(mr.RetrieveVersionInfosRequest(model_id=model_id), timeout=WAIT_S)
    return [info.version_number for info in reply.version_infos]


async def version_data(
    stub: model_registry_pb2_grpc.ModelRegistrySPStub, model_id: str, number: int
) -> bytes:
    request = mr.RetrieveVersionDataRequest(model_id=model_id, version_number=number)
    return b"".join([reply.data_chunk async for reply in stub.RetrieveVersionData(request, timeout=WAIT_S)])


async def slow_upload(stub: model_registry_pb2_grpc.ModelRegistrySPStub, model_id: str) -> grpc.StatusCode:
    """Stream UPLOAD_SIZE bytes slowly; returns how the call ended."""
    call = stub.CreateVersion(timeout=120)
    chunk = secrets.token_bytes(UPLOAD_CHUNK)
    try:
        await call.write(header(model_id, UPLOAD_SIZE))
        for _ in range(UPLOAD_SIZE // UPLOAD_CHUNK):
            await call.write(body(chunk))
            await asyncio.sleep(UPLOAD_PAUSE_S)
        await call.done_writing()
        await call
    except grpc.aio.AioRpcError as error:
        return error.code()
    except asyncio.InvalidStateError:  # written to a call already over
        return await call.code()
    return grpc.StatusCode.OK


async def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    """`condition` (blocking: run in a thread) until it holds."""
    await eventually(lambda: asyncio.to_thread(condition), what, timeout_s, interval_s=0.02)


# ---- storage, seen from outside ----


async def garbage_keys(storage: Storage) -> list[str]:
    database = Database(storage.database_url)
    try:
        return sorted(row[0] for row in await database.fetch(select(registry_blob_garbage.c.blob_key)))
    finally:
        await database.close()


async def version_blob_keys(storage: Storage) -> set[str]:
    database = Database(storage.database_url)
    try:
        return {row[0] for row in await database.fetch(select(registry_versions.c.blob_key))}
    finally:
        await database.close()


def server_holds_part_of_the_upload(storage: Storage, tmp_dir: Path | None) -> Callable[[], bool]:
    """Local: the temp file holds KILL_AFTER bytes. S3: a multipart upload exists (its first part
    of DEFAULT_PART_SIZE is on its way)."""
    if tmp_dir is None:
        return lambda: bool(storage.partial_uploads())

    def check() -> bool:
        files = [tmp_dir / name for name in storage.partial_uploads()]
        return any(path.exists() and path.stat().st_size >= KILL_AFTER for path in files)

    return check


async def collect_abandoned_uploads(storage: Storage, monkeypatch: pytest.MonkeyPatch) -> tuple[int, int]:
    """What a registry's collector does once STALE_UPLOAD_S have passed, now: the registry's own
    `collect_garbage()` with the core's clock moved past STALE_UPLOAD_S (only the core's: the
    `time` it imported is replaced, not the module), then `cleanup_incomplete(0)` on the store."""
    later_ns = int((STALE_UPLOAD_S + 3600) * 1e9)
    clock = types.SimpleNamespace(time_ns=lambda: time.time_ns() + later_ns, time=time.time)
    database = Database(storage.database_url)
    blobs = storage.make_blobs()
    settings = ModelRegistrySettings.with_defaults()
    registry = ModelRegistryService(settings, database=database, blobs=blobs).registry
    try:
        await blobs.start()
        with monkeypatch.context() as patch:
            patch.setattr(registry_core, "time", clock)
            collected = await registry.collect_garbage()
        removed = await blobs.cleanup_incomplete(0)
        return collected, removed
    finally:
        await blobs.close()
        await database.close()


# ---- the test ----


async def test_kill_9_during_an_upload_leaves_the_registry_consistent(
    storage: Storage, processes: list[RunningService], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    local = isinstance(storage.make_blobs(), LocalBlobStore)
    incomplete_dir = tmp_path / "blobs" / INCOMPLETE_DIR if local else None
    model_id = "crash-model"
    first, second = b"version one", secrets.token_bytes(3 * MiB + 5)

    registry = await asyncio.to_thread(start_registry, storage, processes, tmp_path)
    async with connect(registry) as stub:
        await stub.CreateOrUpdateModel(
            mr.CreateOrUpdateModelRequest(model_info=mr.ModelInfo(model_id=model_id)), timeout=WAIT_S
        )
        assert await upload(stub, model_id, first) == 1
        assert await upload(stub, model_id, second) == 2
        assert storage.partial_uploads() == [] and await garbage_keys(storage) == []
        committed_blobs = await version_blob_keys(storage)

        uploading = asyncio.create_task(slow_upload(stub, model_id))
        await wait_for(
            server_holds_part_of_the_upload(storage, incomplete_dir), "the upload to reach the server"
        )
        assert not uploading.done(), "the upload ended before the kill"
        assert await asyncio.to_thread(registry.terminate, signal.SIGKILL) == -signal.SIGKILL
        code = await asyncio.wait_for(uploading, WAIT_S)
        assert code != grpc.StatusCode.OK, "the interrupted upload succeeded"

    # What the crash left: the partial upload and its garbage row (no version row).
    leftovers = storage.partial_uploads()
    assert len(leftovers) == 1, leftovers
    abandoned = await garbage_keys(storage)
    assert len(abandoned) == 1, abandoned
    assert await version_blob_keys(storage) == committed_blobs
    if local:
        assert incomplete_dir is not None and (incomplete_dir / leftovers[0]).stat().st_size >= KILL_AFTER

    # Restarted: nothing of the interrupted upload shows, everything else does, numbering goes on.
    registry = await asyncio.to_thread(start_registry, storage, processes, tmp_path)
    third = secrets.token_bytes(2 * MiB + 1)
    async with connect(registry) as stub:
        assert await version_numbers(stub, model_id) == [1, 2]
        assert await version_data(stub, model_id, 1) == first
        assert await version_data(stub, model_id, 2) == second
        assert await upload(stub, model_id, third) == 3
        assert await version_numbers(stub, model_id) == [1, 2, 3]
        updates = stub.VersionUpdate(mr.VersionUpdateRequest(model_id=model_id))
        assert (await asyncio.wait_for(updates.read(), WAIT_S)).version_info.version_number == 3
        updates.cancel()
    # A running registry leaves the leftovers alone before STALE_UPLOAD_S (they could be an upload
    # in progress on another replica): its collector ran at start, and they are still there.
    assert storage.partial_uploads() == leftovers
    assert await garbage_keys(storage) == abandoned
    registry.stop()

    # Collected now, deterministically: the leftovers go, and nothing else.
    collected, removed = await collect_abandoned_uploads(storage, monkeypatch)
    assert (collected, removed) == (1, 1)
    assert storage.partial_uploads() == []
    assert await garbage_keys(storage) == []
    version_blobs = await version_blob_keys(storage)
    assert len(version_blobs) == 3 and committed_blobs < version_blobs
    assert storage.stored_blobs() == version_blobs, "a blob without a version, or a version without its blob"

    # And a registry on the collected storage serves it all.
    registry = await asyncio.to_thread(start_registry, storage, processes, tmp_path)
    async with connect(registry) as stub:
        assert await version_numbers(stub, model_id) == [1, 2, 3]
        for number, data in ((1, first), (2, second), (3, third)):
            assert await version_data(stub, model_id, number) == data
        assert await upload(stub, model_id, b"four") == 4
