"""The model registry's blob stores, each contract test on all three: a local directory, S3 (SeaweedFS)
and memory."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import errno
import gc
import hashlib
import os
import random
import socket
import threading
import tracemalloc
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from minio import Minio

from services.model_registry.blobstore import (
    MIN_PART_SIZE,
    BlobNotFound,
    BlobStore,
    BlobStoreError,
    BlobStoreUnavailable,
    DigestMismatch,
    InvalidBlobKey,
    LocalBlobStore,
    MemoryBlobStore,
    S3BlobStore,
    local,
    memory,
    s3,
)
from shared.errors import ResourceExhausted, Unavailable, classify
from tests.fixtures.seaweedfs import SeaweedS3, new_bucket_name
from tests.helpers.digest import sha256_b64

PART = MIN_PART_SIZE  # the S3 store under test uses the smallest parts: fewer bytes per case
MiB = 1 << 20


@dataclass
class Harness:
    store: BlobStore
    # What the store holds besides committed blobs' bytes: files / objects / multipart uploads /
    # committed keys and uploads not committed.
    stored: Callable[[], list[str]]
    kind: str


def _local_stored(root: Path) -> list[str]:
    return sorted(str(path.relative_to(root)) for path in root.rglob("*") if not path.is_dir())


def _s3_stored(client: Minio, bucket: str) -> list[str]:
    objects = [f"object {o.object_name}" for o in client.list_objects(bucket, recursive=True)]
    uploads = [f"upload {u.object_name}" for u in client._list_multipart_uploads(bucket).uploads]
    return sorted(objects + uploads)


def _memory_stored(store: MemoryBlobStore) -> list[str]:
    return store.keys + ["incomplete upload"] * store.incomplete_uploads


def make_s3_store(server: SeaweedS3, bucket: str, **options: Any) -> S3BlobStore:
    options = {"part_size": PART, "upload_concurrency": 2, **options}
    return S3BlobStore(server.endpoint, server.access_key, server.secret_key, bucket, secure=False, **options)


@pytest.fixture(params=["local", "s3", "memory"])
async def harness(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Harness]:
    if request.param == "local":
        root = tmp_path / "blobs"
        store: BlobStore = LocalBlobStore(root)
        await store.start()
        yield Harness(store, lambda: _local_stored(root), "local")
    elif request.param == "memory":
        in_memory = MemoryBlobStore()
        store = in_memory
        await store.start()
        yield Harness(store, lambda: _memory_stored(in_memory), "memory")
    else:
        server: SeaweedS3 = request.getfixturevalue("seaweed_s3")
        bucket = new_bucket_name()
        store = make_s3_store(server, bucket)
        await store.start()  # creates the bucket
        client = Minio(server.endpoint, server.access_key, server.secret_key, secure=False)
        yield Harness(store, lambda: _s3_stored(client, bucket), "s3")
    await store.close()


def payload(size: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(size)


def split(data: bytes, sizes: list[int]) -> Iterator[bytes]:
    offset, i = 0, 0
    while offset < len(data):
        yield data[offset : offset + sizes[i % len(sizes)]]
        offset += sizes[i % len(sizes)]
        i += 1


async def put(store: BlobStore, key: str, data: bytes, sizes: list[int] | None = None) -> tuple[int, str]:
    upload = await store.open_upload(key)
    for chunk in split(data, sizes or [MiB]):
        await upload.write(chunk)
    return await upload.commit()


async def get_chunks(store: BlobStore, key: str, chunk_size: int) -> list[bytes]:
    return [chunk async for chunk in store.read(key, chunk_size)]


ODD_CHUNKS = [1, 7919, MiB + 3, 65537, 3 * MiB - 1]


@pytest.mark.parametrize(
    "size",
    [0, 1, PART, PART + 1, 3 * PART + 12345],
    ids=["empty", "one-byte", "one-part", "part-plus-one", "several-parts"],
)
async def test_round_trip(harness: Harness, size: int) -> None:
    store = harness.store
    data = payload(size, seed=size)
    key = f"versions/{size:x}/0001"
    assert await put(store, key, data, ODD_CHUNKS) == (size, sha256_b64(data))
    for chunk_size in (MiB + 7, 4096, max(size, 1)):
        chunks = await get_chunks(store, key, chunk_size)
        assert b"".join(chunks) == data
        assert all(len(chunk) == chunk_size for chunk in chunks[:-1])
        assert not chunks or 0 < len(chunks[-1]) <= chunk_size
    assert harness.stored() == ([f"object {key}"] if harness.kind == "s3" else [key])


async def test_concurrent_uploads(harness: Harness) -> None:
    datas = [payload(2 * PART + i * 1000, seed=i) for i in range(4)]
    results = await asyncio.gather(
        *(put(harness.store, f"m/{i}", d, [MiB // 3]) for i, d in enumerate(datas))
    )
    assert results == [(len(d), sha256_b64(d)) for d in datas]
    for i, data in enumerate(datas):
        assert b"".join(await get_chunks(harness.store, f"m/{i}", 2 * MiB)) == data


async def test_abort_leaves_nothing(harness: Harness) -> None:
    store = harness.store
    upload = await store.open_upload("versions/a/1")
    for chunk in split(payload(2 * PART + 5), [MiB + 1]):
        await upload.write(chunk)
    await upload.abort()
    await upload.abort()  # idempotent
    assert harness.stored() == []
    with pytest.raises(BlobNotFound):
        await get_chunks(store, "versions/a/1", MiB)
    with pytest.raises(BlobStoreError):
        await upload.write(b"more")
    with pytest.raises(BlobStoreError):
        await upload.commit()
    # Never written to.
    await (await store.open_upload("versions/a/2")).abort()
    assert harness.stored() == []


async def test_context_manager_aborts_unless_committed(harness: Harness) -> None:
    store = harness.store
    with pytest.raises(RuntimeError):
        async with await store.open_upload("k/1") as upload:
            await upload.write(payload(PART + 1))
            raise RuntimeError("the client went away")
    assert harness.stored() == []
    async with await store.open_upload("k/2") as upload:
        await upload.write(b"kept")
        assert await upload.commit() == (4, sha256_b64(b"kept"))
    await upload.abort()  # after a commit has returned: nothing happens
    assert b"".join(await get_chunks(store, "k/2", 10)) == b"kept"


async def test_failed_write_aborts_everything(harness: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    if harness.kind == "local":

        def fail(fd: int, pieces: list[bytes]) -> None:
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(local, "_write_all", fail)
    elif harness.kind == "memory":
        real_write = memory._MemoryUpload._write
        writes = 0

        async def fail_third(upload: memory._MemoryUpload, chunk: bytes) -> None:
            nonlocal writes
            writes += 1
            if writes == 3:  # with chunks held already
                raise MemoryError("out of memory")
            await real_write(upload, chunk)

        monkeypatch.setattr(memory._MemoryUpload, "_write", fail_third)
    else:
        assert isinstance(harness.store, S3BlobStore)
        client = harness.store._client
        real = client._upload_part

        def fail_second(*args: Any) -> str:
            if args[-1] == 2:
                raise OSError("connection reset")
            return str(real(*args))

        monkeypatch.setattr(client, "_upload_part", fail_second)
    upload = await harness.store.open_upload("versions/f/1")
    with pytest.raises(BlobStoreError):
        for chunk in split(payload(4 * PART), [MiB]):
            await upload.write(chunk)
        await upload.commit()
    await upload.abort()
    assert harness.stored() == []
    with pytest.raises(BlobNotFound):
        await get_chunks(harness.store, "versions/f/1", MiB)


@pytest.mark.parametrize("delay", [0.0, 0.005, 0.02, 0.1])
async def test_cancelled_upload_leaves_nothing(harness: Harness, delay: float) -> None:
    """The client goes away at any point (writing, waiting for a part, committing): after abort,
    nothing is stored, unless the commit had returned."""
    upload = await harness.store.open_upload("versions/z/1")
    data = payload(3 * PART + 1)

    async def send() -> None:
        for chunk in split(data, [MiB]):
            await upload.write(chunk)
        await upload.commit()

    task = asyncio.create_task(send())
    await asyncio.sleep(delay)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await upload.abort()
    if task.cancelled():
        assert harness.stored() == []
    else:  # finished before the cancellation: the blob stays
        assert b"".join(await get_chunks(harness.store, "versions/z/1", 4 * MiB)) == data


async def test_cancelled_commit_is_undone(harness: Harness) -> None:
    upload = await harness.store.open_upload("versions/z/2")
    for chunk in split(payload(2 * PART + 3), [MiB]):
        await upload.write(chunk)
    committing = asyncio.create_task(upload.commit())
    await asyncio.sleep(0)
    committing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await committing
    await upload.abort()  # the commit went on in the background: abort waits for it, then undoes it
    assert harness.stored() == []


async def test_delete_is_idempotent(harness: Harness) -> None:
    store = harness.store
    await put(store, "versions/d/1", b"x" * 100)
    await put(store, "versions/d/2", b"y")
    await store.delete("versions/d/1")
    await store.delete("versions/d/1")
    await store.delete("versions/never/written")
    with pytest.raises(BlobNotFound):
        await get_chunks(store, "versions/d/1", 10)
    assert b"".join(await get_chunks(store, "versions/d/2", 10)) == b"y"
    await store.delete("versions/d/2")
    assert harness.stored() == []  # local: emptied directories are pruned too


async def test_read_into_fills_a_buffer_of_the_blobs_size(harness: Harness) -> None:
    store = harness.store
    data = payload(3 * MiB + 5, seed=3)
    await put(store, "versions/into/1", data)
    buffer = bytearray(len(data))
    progress: list[int] = []
    await store.read_into("versions/into/1", memoryview(buffer), progress.append, chunk_size=MiB)
    assert bytes(buffer) == data
    assert progress == [MiB, 2 * MiB, 3 * MiB, 3 * MiB + 5]  # on the event loop, as parts arrive
    for wrong_size in (len(data) - 1, len(data) + 1):
        with pytest.raises(BlobStoreError, match="recorded"):
            await store.read_into(
                "versions/into/1", memoryview(bytearray(wrong_size)), progress.append, chunk_size=MiB
            )
    with pytest.raises(BlobNotFound):
        await store.read_into("versions/into/none", memoryview(bytearray(1)), progress.append, chunk_size=MiB)


async def test_missing_blob(harness: Harness) -> None:
    with pytest.raises(BlobNotFound):
        await get_chunks(harness.store, "versions/nothing/here", MiB)
    await put(harness.store, "versions/x/1", b"data")
    with pytest.raises(BlobNotFound):  # a "directory", not a blob
        await get_chunks(harness.store, "versions/x", MiB)


BAD_KEYS = [
    "",
    ".",
    "..",
    "../x",
    "a/../../b",
    "/abs",
    "a//b",
    "a/",
    "A",
    "a b",
    "a\x00b",
    "a\n",
    "é",
    ".incomplete/x",
    "a\\b",
    "x" * 600,
    "y" * 256,
]


@pytest.mark.parametrize("key", BAD_KEYS)
async def test_bad_keys_are_rejected(harness: Harness, key: str) -> None:
    store = harness.store
    with pytest.raises(InvalidBlobKey):
        await store.open_upload(key)
    with pytest.raises(InvalidBlobKey):
        store.read(key, MiB)
    with pytest.raises(InvalidBlobKey):
        await store.delete(key)
    assert harness.stored() == []


async def test_read_stopped_early(harness: Harness) -> None:
    store = harness.store
    data = payload(3 * PART)
    await put(store, "versions/r/1", data)
    for _ in range(3):  # the reader's file / connection is released every time
        chunks = store.read("versions/r/1", MiB)
        async with contextlib.aclosing(chunks):
            assert await anext(chunks) == data[:MiB]
    # An abandoned read: the consumer is cancelled while the next chunk is being fetched.
    consumer = asyncio.create_task(get_chunks(store, "versions/r/1", 1))
    await asyncio.sleep(0.05)
    consumer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await consumer
    assert b"".join(await get_chunks(store, "versions/r/1", 2 * MiB)) == data


async def test_cleanup_incomplete_removes_crashed_uploads(harness: Harness) -> None:
    store = harness.store
    # A crash: bytes written (on S3, a multipart upload with a part stored), then the upload is
    # dropped without commit or abort.
    crashed = await store.open_upload("versions/c/1")
    for chunk in split(payload(PART + MiB), [MiB]):
        await crashed.write(chunk)
    await crashed._settle()
    if isinstance(crashed, local._LocalUpload):
        os.close(crashed._fd)  # a dead process's file descriptor
    del crashed
    gc.collect()
    assert harness.stored() != []
    # In progress: left alone whatever its age.
    live = await store.open_upload("versions/c/2")
    for chunk in split(payload(PART + MiB, seed=2), [MiB]):
        await live.write(chunk)
    assert await store.cleanup_incomplete(older_than_s=3600) == 0
    assert await store.cleanup_incomplete(older_than_s=0) == 1
    assert await store.cleanup_incomplete(older_than_s=0) == 0
    size, _ = await live.commit()
    assert size == PART + MiB
    assert harness.stored() == (["object versions/c/2"] if harness.kind == "s3" else ["versions/c/2"])


async def test_local_start_failure(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"")
    store = LocalBlobStore(tmp_path / "file" / "blobs")
    with pytest.raises(BlobStoreError, match="cannot use directory"):
        await store.start()
    await store.close()


async def test_s3_wrong_credentials(seaweed_s3: SeaweedS3) -> None:
    store = S3BlobStore(
        seaweed_s3.endpoint, seaweed_s3.access_key, "not-the-secret", new_bucket_name(), secure=False
    )
    with pytest.raises(BlobStoreError, match="refused the credentials") as caught:
        await store.start()
    assert "SignatureDoesNotMatch" in str(caught.value) or "AccessDenied" in str(caught.value)
    await store.close()
    store = S3BlobStore(seaweed_s3.endpoint, "nobody", "nothing", new_bucket_name(), secure=False)
    with pytest.raises(BlobStoreError, match="refused the credentials"):
        await store.start()
    await store.close()


def no_credentials_around(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Nothing where S3 credentials are looked for (nor instance metadata, which is not 127.0.0.1)."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_ACCESS_KEY", "AWS_SECRET_ACCESS_KEY", "AWS_SECRET_KEY",
                 "AWS_SESSION_TOKEN", "MINIO_ACCESS_KEY", "MINIO_SECRET_KEY", "AWS_PROFILE",
                 "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
                 "AWS_CONTAINER_CREDENTIALS_FULL_URI"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials-file"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


async def test_s3_credentials_from_the_environment(
    seaweed_s3: SeaweedS3, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """No keys given: the AWS_* variables (as an S3 client on a pod with injected credentials)."""
    no_credentials_around(monkeypatch, tmp_path)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", seaweed_s3.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", seaweed_s3.secret_key)
    store = S3BlobStore(seaweed_s3.endpoint, None, None, new_bucket_name(), secure=False)
    try:
        await store.start()
        data = payload(PART + 1)
        assert await put(store, "versions/env/0001", data) == (len(data), sha256_b64(data))
        assert b"".join(await get_chunks(store, "versions/env/0001", MiB)) == data
    finally:
        await store.close()

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    store = S3BlobStore(seaweed_s3.endpoint, None, None, new_bucket_name(), secure=False)
    with pytest.raises(BlobStoreError, match="refused the credentials from the environment"):
        await store.start()
    await store.close()


async def test_s3_without_credentials_anywhere_says_where_they_are_looked_for(
    seaweed_s3: SeaweedS3, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    no_credentials_around(monkeypatch, tmp_path)
    store = S3BlobStore(seaweed_s3.endpoint, None, None, new_bucket_name(), secure=False)
    with pytest.raises(BlobStoreError, match="no S3 credentials: give --s3_access_key and --s3_secret_key"):
        await store.start()
    await store.close()
    with pytest.raises(BlobStoreError, match="access key and secret key go together"):
        S3BlobStore(seaweed_s3.endpoint, seaweed_s3.access_key, None, new_bucket_name(), secure=False)


async def test_s3_unreachable_endpoint() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed below: nothing listens there
    store = S3BlobStore(f"127.0.0.1:{port}", "a", "b", "some-bucket", secure=False)
    with pytest.raises(BlobStoreError, match=r"cannot reach S3 bucket 'some-bucket' at http://127\.0\.0\.1"):
        await store.start()
    await store.close()


async def test_s3_prefix_and_existing_bucket(seaweed_s3: SeaweedS3) -> None:
    bucket = new_bucket_name()
    first = make_s3_store(seaweed_s3, bucket, prefix="registry/")
    await first.start()
    await put(first, "versions/p/1", b"abc")
    second = make_s3_store(seaweed_s3, bucket, prefix="registry/")
    await second.start()  # the bucket exists already
    assert b"".join(await get_chunks(second, "versions/p/1", 2)) == b"abc"
    client = Minio(seaweed_s3.endpoint, seaweed_s3.access_key, seaweed_s3.secret_key, secure=False)
    assert _s3_stored(client, bucket) == ["object registry/versions/p/1"]
    # An incomplete upload outside the prefix is not the registry's.
    client._create_multipart_upload(bucket, "other/thing", {})
    assert await second.cleanup_incomplete(0) == 0
    for store in (first, second):
        await store.close()
    with pytest.raises(ValueError):
        make_s3_store(seaweed_s3, bucket, prefix="../")
    with pytest.raises(ValueError):
        make_s3_store(seaweed_s3, bucket, part_size=PART - 1)


async def test_s3_memory_is_bounded(seaweed_s3: SeaweedS3, monkeypatch: pytest.MonkeyPatch) -> None:
    """64 MiB through 5 MiB parts: the upload holds at most 1 + upload_concurrency part buffers
    (anonymous mappings, counted here) and next to nothing on the heap (traced); the read holds
    about two chunks. Nothing grows with the blob."""
    lock = threading.Lock()
    buffers = {"created": 0, "live": 0, "max_live": 0}

    def released() -> None:
        with lock:
            buffers["live"] -= 1

    def counted(size: int) -> Any:
        buffer = new_part_buffer(size)
        weakref.finalize(buffer, released)
        with lock:
            buffers["created"] += 1
            buffers["live"] += 1
            buffers["max_live"] = max(buffers["max_live"], buffers["live"])
        return buffer

    new_part_buffer = s3._new_part_buffer
    monkeypatch.setattr(s3, "_new_part_buffer", counted)
    store = make_s3_store(seaweed_s3, new_bucket_name(), upload_concurrency=2)
    await store.start()
    size = 64 * MiB
    block = payload(4 * MiB)
    expected = hashlib.sha256()
    for _ in range(size // len(block)):
        expected.update(block)
    tracemalloc.start()
    try:
        upload = await store.open_upload("versions/big/1")
        for i in range(size // MiB):
            # A fresh 1 MiB chunk each time, as a gRPC stream delivers them.
            offset = (i % 4) * MiB
            await upload.write(block[offset : offset + MiB])
        result = await upload.commit()
        _, upload_heap_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        got = hashlib.sha256()
        async for chunk in store.read("versions/big/1", 2 * MiB):
            got.update(chunk)
        _, read_heap_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    del upload
    gc.collect()
    await store.close()
    assert result == (size, base64.b64encode(expected.digest()).decode())
    assert got.digest() == expected.digest()
    assert buffers["created"] <= 3 and buffers["max_live"] <= 3, buffers
    assert buffers["live"] == 0, buffers  # all unmapped once the upload is over
    assert upload_heap_peak < 4 * MiB, f"upload heap peak {upload_heap_peak / MiB:.1f} MiB"
    assert read_heap_peak < 4 * 2 * MiB, f"read heap peak {read_heap_peak / MiB:.1f} MiB"


async def test_backend_failures_are_classified_for_every_service(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk under the local store is RESOURCE_EXHAUSTED, an unreachable S3 server
    UNAVAILABLE (shared.errors.classify, the one place statuses are decided)."""
    store = LocalBlobStore(tmp_path / "blobs")
    await store.start()

    def disk_full(fd: int, pieces: list[bytes]) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(local, "_write_all", disk_full)
    upload = await store.open_upload("versions/full/1")
    with pytest.raises(BlobStoreUnavailable) as full:
        await upload.write(payload(2 * MiB))
        await upload.commit()
    await upload.abort()
    assert isinstance(classify(full.value), ResourceExhausted)
    await store.close()

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed below: nothing listens there
    unreachable = S3BlobStore(f"127.0.0.1:{port}", "a", "b", "some-bucket", secure=False)
    with pytest.raises(BlobStoreUnavailable) as away:
        await get_chunks(unreachable, "versions/a/1", MiB)
    assert isinstance(classify(away.value), Unavailable)
    await unreachable.close()


@pytest.mark.parametrize("size", [1000, 2 * PART + 1], ids=["one-piece", "multipart"])
async def test_a_digest_mismatch_publishes_nothing(
    harness: Harness, monkeypatch: pytest.MonkeyPatch, size: int
) -> None:
    """The digest is checked before the blob is made visible: a rejected upload never becomes a
    file or an object, not even for a moment (the publishing step is never reached)."""
    published: list[str] = []
    if harness.kind == "local":
        monkeypatch.setattr(local._LocalUpload, "_publish", lambda upload: published.append(upload.key))
    elif harness.kind == "s3":
        assert isinstance(harness.store, S3BlobStore)
        if size > PART:
            monkeypatch.setattr(
                harness.store, "_complete_multipart", lambda *args: published.append("multipart")
            )
        else:  # (minio uploads parts through _put_object too)
            monkeypatch.setattr(
                harness.store._client, "_put_object", lambda *args: published.append("object")
            )
    data = payload(size)
    upload = await harness.store.open_upload("versions/mismatch/1")
    for chunk in split(data, [MiB]):
        await upload.write(chunk)
    with pytest.raises(DigestMismatch) as mismatch:
        await upload.commit(sha256_b64(b"something else"))
    assert mismatch.value.actual == sha256_b64(data)
    await upload.abort()
    assert published == []
    assert harness.stored() == []
    # The same bytes with their own digest are published.
    upload = await harness.store.open_upload("versions/mismatch/2")
    await upload.write(data)
    monkeypatch.undo()
    assert await upload.commit(sha256_b64(data)) == (size, sha256_b64(data))
    assert b"".join(await get_chunks(harness.store, "versions/mismatch/2", MiB)) == data
