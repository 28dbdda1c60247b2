"""The Model Registry's own metrics over real gRPC: counters agree with the data moved, the
versions created and the uploads refused; the number of series stays bounded whatever models
clients create."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from services.model_registry.blobstore import BlobNotFound
from services.model_registry.metrics import BLOB_OPERATIONS, blob_operation
from shared.api import model_registry_pb2 as mr
from tests.helpers.digest import sha256_b64
from tests.helpers.eventually import eventually
from tests.helpers.exposed_metrics import delta, exposed, value
from tests.helpers.registry import as_stream, chunks, create_model, create_version, version_data
from tests.helpers.running import RunningRegistry, make_registry_factory

P = "cogment_model_registry_"


@pytest.fixture
async def registry(tmp_path: Path) -> AsyncIterator[RunningRegistry]:
    """On SQLite and the local blob store only: what is counted does not depend on them."""
    factory = make_registry_factory(
        "--database_url", f"sqlite+aiosqlite:///{tmp_path / 'registry.db'}",
        "--archive_dir", str(tmp_path / "blobs"),
    )  # fmt: skip
    async with factory() as running:
        yield running


async def refused(r: RunningRegistry, messages: list[mr.CreateVersionRequestChunk]) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await r.stub.CreateVersion(as_stream(messages))  # type: ignore[arg-type]
    code: grpc.StatusCode = error.value.code()
    return code


async def test_counters_agree_with_versions_data_and_refusals(registry: RunningRegistry) -> None:
    await create_model(registry, "m")
    archived = secrets.token_bytes(3 * 1024 * 1024 + 5)  # two chunks
    transient = b"transient data"
    before = exposed(P)
    await create_version(registry, "m", archived, hash_=sha256_b64(archived))
    await create_version(registry, "m", transient, archived=False)
    assert b"".join(await version_data(registry, "m", 1)) == archived  # loaded into memory
    assert b"".join(await version_data(registry, "m", 1)) == archived  # from memory
    assert b"".join(await version_data(registry, "m", 2)) == transient
    created = exposed(P)

    assert delta(before, created, P + "received_bytes_total") == len(archived) + len(transient)
    assert delta(before, created, P + "sent_bytes_total") == 2 * len(archived) + len(transient)
    assert delta(before, created, P + "versions_created_total", archived="true") == 1
    assert delta(before, created, P + "versions_created_total", archived="false") == 1
    assert delta(before, created, P + "data_cache_misses_total") == 2
    assert delta(before, created, P + "data_cache_hits_total") == 1
    assert value(created, P + "data_cache_bytes") == len(archived) + len(transient)
    operations = {operation: dict(operation=operation) for operation in BLOB_OPERATIONS}
    assert delta(before, created, P + "blob_operation_duration_seconds_count", **operations["commit"]) == 2
    assert delta(before, created, P + "blob_operation_duration_seconds_count", **operations["write"]) == 3
    assert delta(before, created, P + "blob_operation_duration_seconds_count", **operations["load"]) == 2
    for operation in BLOB_OPERATIONS:
        assert delta(before, created, P + "blob_operation_failures_total", operation=operation) == 0

    data = b"some data"
    bad_hash = chunks("m", data, hash_=sha256_b64(b"other data"))
    assert await refused(registry, bad_hash) == grpc.StatusCode.INVALID_ARGUMENT
    assert await refused(registry, chunks("m", data, size=len(data) + 1)) == grpc.StatusCode.INVALID_ARGUMENT
    assert await refused(registry, chunks("m", data, size=len(data) - 1)) == grpc.StatusCode.INVALID_ARGUMENT
    assert await refused(registry, chunks("nope", data)) == grpc.StatusCode.NOT_FOUND
    assert await refused(registry, chunks("m", data)[1:]) == grpc.StatusCode.INVALID_ARGUMENT  # body first
    after = exposed(P)

    def refusals(reason: str) -> float:
        return delta(created, after, P + "refused_uploads_total", reason=reason)

    assert [refusals(reason) for reason in ("hash", "size", "unknown_model", "other")] == [1, 2, 1, 1]
    assert delta(created, after, P + "versions_created_total", archived="true") == 0
    # Bytes of refused uploads were received all the same (the one of an unknown model never read).
    assert delta(created, after, P + "received_bytes_total") == 3 * len(data)
    assert delta(created, after, P + "blob_operation_duration_seconds_count", operation="abort") == 3


async def test_version_update_streams_are_counted_while_open(registry: RunningRegistry) -> None:
    await create_model(registry, "w")
    await create_version(registry, "w", b"v1")
    streams = [registry.stub.VersionUpdate(mr.VersionUpdateRequest(model_id="w")) for _ in range(3)]
    for stream in streams:
        assert (await stream.read()).version_info.version_number == 1
    assert value(exposed(P), P + "version_update_streams") == 3
    for stream in streams:
        stream.cancel()
    # The server sees the cancellations as they come.
    await eventually(lambda: value(exposed(P), P + "version_update_streams") == 0, "the streams to close", 5)


async def test_series_stay_bounded_whatever_models_clients_create(registry: RunningRegistry) -> None:
    async def one_model(index: int) -> None:
        model_id = f"model-{index}"
        await create_model(registry, model_id)
        await create_version(registry, model_id, model_id.encode(), archived=index % 2 == 0)
        assert b"".join(await version_data(registry, model_id, -1)) == model_id.encode()

    for index in range(20):
        await one_model(index)
    early = exposed(P)
    for start in range(20, 300, 20):
        await asyncio.gather(*(one_model(index) for index in range(start, start + 20)))
    after = exposed(P)
    assert delta(early, after, P + "versions_created_total", archived="true") == 140
    assert set(after) == set(early)  # 280 more models: not one series more


def test_blob_operations_count_failures_but_not_answers() -> None:
    before = exposed(P)
    with pytest.raises(OSError), blob_operation("delete"):
        raise OSError("disk gone")
    with pytest.raises(BlobNotFound), blob_operation("delete", answers=(BlobNotFound,)):
        raise BlobNotFound("no such blob")
    after = exposed(P)
    assert delta(before, after, P + "blob_operation_failures_total", operation="delete") == 1
    assert delta(before, after, P + "blob_operation_duration_seconds_count", operation="delete") == 2
