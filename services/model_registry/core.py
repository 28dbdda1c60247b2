"""The Model Registry's rules: models, immutable numbered versions and their data.

Metadata lives in SQL (`RegistryStore`), version data in a blob store. A version becomes visible
only once its data is fully stored: the blob is uploaded first (recorded as garbage until then,
so a crash leaves it to the collector), then one transaction gives it the model's next number
and forgets the garbage record. That commit rides an outage out, and is made again when its
answer was lost: it is idempotent by the upload's blob key, so a version ends up made once or
not at all, and its blob is garbage exactly while no version holds it.
Transient (non-archived) versions are kept up to `cache_max_items`, least recently used evicted
first; archived versions are never evicted. Blobs of deleted and evicted versions are collected
after a grace period, so downloads already under way finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import secrets
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TypeVar

from services.model_registry import metrics
from services.model_registry.blobstore import BlobStore, BlobStoreError, DigestMismatch
from services.model_registry.hot_versions import HotVersions
from services.model_registry.model import ModelInfo, VersionHeader, VersionInfo, VersionRecord
from services.model_registry.store import RegistryStore, model_changes_key, model_key
from shared.dependencies import Dependencies
from shared.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied
from shared.handlers import fitting_count
from shared.logging import get_logger
from shared.notify import ChangeFeed
from shared.supervision import FailureStreak, Periodic, cancel_and_wait
from shared.validation import MAX_INT32_POSITION, quoted

# Downloads of a deleted or evicted version get this long to finish before its blob goes.
GARBAGE_GRACE_S = 60.0
# An upload still unfinished after this long was abandoned (its process died): collect it.
STALE_UPLOAD_S = 24 * 3600.0
GARBAGE_PERIOD_S = 10.0
GARBAGE_BATCH = 100

log = get_logger("model_registry.core")
T = TypeVar("T")
# The encoded size of an item in a reply (see shared.handlers.fitting_count).
ReplySize = Callable[[T], int]


def _unsized(_item: object) -> int:
    return 0


# Offsets, numbers and counts beyond this are past the end of anything stored (and would overflow
# a 32-bit SQL integer): they are clamped to it.
MAX_POSITION = MAX_INT32_POSITION


def clamp_count(count: int) -> int | None:
    """A requested number of items: 0 means no limit."""
    return min(count, MAX_POSITION) or None


class SizeMismatch(InvalidArgument):
    """An upload's data is not of the size its header announced."""


class HashMismatch(InvalidArgument):
    """An upload's data is not of the SHA-256 its header announced."""


def refusal_reason(error: BaseException) -> str | None:
    """Why an upload (CreateVersion) that failed with `error` was refused (a `reason` of
    metrics.refused_uploads_total), or None if it was not: the registry failed, not the client
    (an outage, a full disk, a bug), or the client went away."""
    if isinstance(error, SizeMismatch):
        return metrics.REFUSED_SIZE
    if isinstance(error, HashMismatch):
        return metrics.REFUSED_HASH
    if isinstance(error, NotFound):  # the only thing an upload names is its model
        return metrics.REFUSED_UNKNOWN_MODEL
    if isinstance(error, InvalidArgument | PermissionDenied | FailedPrecondition):
        return metrics.REFUSED_OTHER
    return None


class ModelRegistry:
    def __init__(
        self,
        store: RegistryStore,
        feed: ChangeFeed,
        blobs: BlobStore,
        *,
        cache_max_items: int,
        chunk_size: int,
        data_cache_bytes: int = 0,
        dependencies: Dependencies | None = None,
    ) -> None:
        self._store = store
        self._feed = feed
        self._blobs = blobs
        self.cache_max_items = cache_max_items
        self.chunk_size = chunk_size
        self._hot = HotVersions(data_cache_bytes)
        self._dependencies = dependencies or Dependencies([])
        self._watches: dict[str, _ModelWatch] = {}
        self._collector = Periodic("registry-garbage-collector", self._collect_step, GARBAGE_PERIOD_S)

    def start(self) -> None:
        self._collector.start()

    @property
    def version_update_streams(self) -> int:
        """VersionUpdate streams open here."""
        return sum(watch.streams for watch in self._watches.values())

    async def stop(self) -> None:
        await self._collector.stop()

    # ---- models ----

    async def create_or_update_model(self, model_id: str, user_data: dict[str, str]) -> None:
        await self._store.upsert_model(model_id, user_data, time.time_ns())

    async def delete_model(self, model_id: str) -> None:
        blob_keys = await self._store.delete_model(model_id, _after(GARBAGE_GRACE_S))
        if blob_keys is None:
            raise NotFound(f'no model "{quoted(model_id)}" found')
        self._hot.forget(blob_keys)
        log.info("model deleted", model_id=model_id)

    async def retrieve_models(
        self, model_ids: Sequence[str], count: int, offset: int, reply_size: ReplySize[ModelInfo] = _unsized
    ) -> tuple[list[ModelInfo], int]:
        """Models from position `offset`, at most `count` (0: all), and as many as fit one reply
        (`reply_size`: an item's encoded size); the position after them."""
        limit = clamp_count(count)
        if not model_ids:
            models = await self._store.list_models(offset, limit)
        else:
            wanted = list(model_ids[offset : None if limit is None else offset + limit])
            found = await self._store.get_models(wanted)
            missing = [model_id for model_id in wanted if model_id not in found]
            if missing:
                raise NotFound(f'no model "{quoted(missing[0])}" found')
            models = [found[model_id] for model_id in wanted]
        models = models[: fitting_count(map(reply_size, models))]
        return models, offset + len(models)

    # ---- versions ----

    async def create_version(self, header: VersionHeader, chunks: AsyncIterator[bytes]) -> VersionInfo:
        """Store the data streamed in `chunks` as the model's next version."""
        if not await self._store.get_models([header.model_id]):
            raise NotFound(f'no model "{quoted(header.model_id)}" found')
        blob_key = f"versions/{model_key(header.model_id)}/{secrets.token_hex(16)}"
        await self._store.record_upload(blob_key, _after(STALE_UPLOAD_S))
        upload = await self._blobs.open_upload(blob_key)
        received = 0
        try:
            async with upload:  # aborted (no stored bytes) unless committed
                async for chunk in chunks:
                    received += len(chunk)
                    if received > header.data_size:
                        raise SizeMismatch(
                            f"received more data than expected: expected {header.data_size} bytes, "
                            f"received at least {received} bytes"
                        )
                    await upload.write(chunk)
                if received != header.data_size:
                    raise SizeMismatch(
                        "stream ended while having not received the expected data, "
                        f"expected {header.data_size} bytes, received {received} bytes"
                    )
                try:
                    # Checked before the blob is published: rejected data never becomes an object.
                    size, data_hash = await upload.commit(header.data_hash)
                except DigestMismatch as mismatch:
                    raise HashMismatch(
                        "received data did not match the expected hash, expected "
                        f'"{quoted(header.data_hash)}", received "{mismatch.actual}"'
                    ) from None
        finally:
            metrics.received_bytes_total.inc(amount=received)
        now = time.time_ns()
        # Ridden out: the commit is made again once the database is back, also when its answer
        # was lost and the version may exist (the commit is idempotent by blob key), so the
        # client is told one outcome, and never retries into a second version of its data.
        info = await self._dependencies.ride_out(
            functools.partial(
                self._store.commit_version,
                header.model_id,
                blob_key,
                archived=header.archived,
                data_hash=data_hash,
                data_size=size,
                user_data=header.user_data,
                creation_timestamp=header.creation_timestamp or now,
                now_ns=now,
            )
        )
        if info is None:  # the model was deleted meanwhile; the blob is collected as garbage
            raise NotFound(f'no model "{quoted(header.model_id)}" found')
        metrics.versions_created_total.inc("true" if info.archived else "false")
        log.debug("version created", model_id=info.model_id, version=info.version_number, size=size)
        if not info.archived:
            await self._evict_transient()
        return info

    async def _evict_transient(self) -> None:
        # The version is stored: a failure here must not fail its upload (the collector retries).
        try:
            await self.evict_transient()
        except Exception as error:
            log.warning("could not evict transient versions, will retry", error=str(error))

    async def evict_transient(self) -> None:
        """Evict the transient versions beyond `cache_max_items`, least recently used first."""
        evicted = await self._store.evict_transient(self.cache_max_items, _after(GARBAGE_GRACE_S))
        if evicted:
            self._hot.forget(blob_key for _, _, blob_key in evicted)
            log.debug(
                "transient versions evicted", versions=[(model_id, number) for model_id, number, _ in evicted]
            )

    async def resolve(self, model_id: str, number: int) -> VersionRecord:
        """The version `number` of the model: -1 is the latest, -n the n-th to last."""
        latest = await self._store.latest_number(model_id)
        if latest is None:
            raise NotFound(f'no model "{quoted(model_id)}" found')
        wanted = _absolute(number, latest)
        record = await self._store.get_version(model_id, wanted) if wanted > 0 else None
        if record is None:
            raise NotFound(f'no version "{number}" for model "{quoted(model_id)}" found')
        return record

    async def retrieve_version_infos(
        self,
        model_id: str,
        numbers: Sequence[int],
        count: int,
        start: int,
        reply_size: ReplySize[VersionInfo] = _unsized,
    ) -> tuple[list[VersionInfo], int]:
        """Versions from position `start`, at most `count` (0: all), as many as fit one reply;
        the position after them."""
        limit = clamp_count(count)
        if numbers:
            # As the reference: the handle is an offset into the requested numbers.
            wanted = numbers[start : None if limit is None else start + limit]
            latest = await self._store.latest_number(model_id)
            if latest is None:
                raise NotFound(f'no model "{quoted(model_id)}" found')
            # All looked up at once.
            absolute = [_absolute(number, latest) for number in wanted]
            found = await self._store.get_versions(model_id, [number for number in absolute if number > 0])
            infos = []
            for number, version in zip(wanted, absolute, strict=True):
                info = found.get(version)
                if info is None:
                    raise NotFound(f'no version "{number}" for model "{quoted(model_id)}" found')
                infos.append(info)
        else:
            if await self._store.latest_number(model_id) is None:
                raise NotFound(f'no model "{quoted(model_id)}" found')
            infos = await self._store.list_versions(model_id, max(start, 1), limit)
        infos = infos[: fitting_count(map(reply_size, infos))]
        return infos, infos[-1].version_number + 1 if infos else start

    async def version_data(self, record: VersionRecord) -> AsyncIterator[bytes | memoryview]:
        """The version's data in chunks of `chunk_size` (one empty chunk for no data); chunks
        of a version in memory are views of it, not copies."""
        if not record.info.archived:
            await self._store.touch(record.info.model_id, record.info.version_number, time.time_ns())
        if self._hot.accepts(record.info.data_size):
            hot = self._hot.chunks(
                record.blob_key,
                record.info.data_size,
                functools.partial(self._blobs.read_into, record.blob_key, chunk_size=self.chunk_size),
                self.chunk_size,
            )
            if hot is not None:
                sent = 0
                try:
                    async with contextlib.aclosing(hot):
                        async for view in hot:
                            sent += len(view)
                            yield view
                finally:
                    metrics.sent_bytes_total.inc(amount=sent)
                return
        sent = 0
        try:
            async with contextlib.aclosing(self._blobs.read(record.blob_key, self.chunk_size)) as chunks:
                async for chunk in chunks:
                    sent += len(chunk)
                    yield chunk
        finally:
            metrics.sent_bytes_total.inc(amount=sent)
        if not sent:
            yield b""

    async def version_updates(self, model_id: str) -> AsyncIterator[VersionInfo]:
        """The latest version at once (if any), then every newer one, until the caller stops.

        One watch per model serves every stream of this process: the change feed wakes
        it when a version is created or the model deleted, here or through another replica
        (PostgreSQL LISTEN/NOTIFY). It stops with its last stream.
        """
        if await self._store.latest_number(model_id) is None:
            raise NotFound(f"unknown model id [{quoted(model_id)}]")
        watch = self._watches.get(model_id)
        if watch is None:
            watch = self._watches[model_id] = _ModelWatch(
                self._store, self._feed, self._dependencies, model_id
            )
        watch.streams += 1
        try:
            sent = 0
            while True:
                async with watch.changed:
                    await watch.changed.wait_for(functools.partial(watch.has_news, sent))
                    latest = watch.latest
                if latest is None:
                    return  # the model was deleted
                for number in range(sent + 1, latest + 1) if sent else [latest]:
                    record = await self._dependencies.ride_out(
                        functools.partial(self._store.get_version, model_id, number)
                    )
                    if record is not None:  # evicted or deleted meanwhile: skipped
                        yield record.info
                sent = latest
        finally:
            watch.streams -= 1
            if watch.streams == 0:
                del self._watches[model_id]
                await watch.stop()

    # ---- garbage ----

    async def collect_garbage(self) -> int:
        """Delete the blobs whose time has come; returns how many."""
        keys = await self._store.take_garbage(time.time_ns(), GARBAGE_BATCH)
        failed = []
        for key in keys:
            try:
                await self._blobs.delete(key)
            except BlobStoreError as error:
                log.warning("could not delete a blob, will retry", key=key, error=str(error))
                failed.append(key)
        if failed:
            await self._store.return_garbage(failed, _after(GARBAGE_PERIOD_S * 6))
        return len(keys) - len(failed)

    async def _collect_step(self) -> bool:
        """One round of the collector: blobs whose time has come, uploads abandoned by a crash,
        and evictions a failure left undone. True while there is more garbage than a batch."""
        if await self.collect_garbage() >= GARBAGE_BATCH:
            return True
        await self._blobs.cleanup_incomplete(STALE_UPLOAD_S)
        await self.evict_transient()
        return False


class _ModelWatch:
    """The latest version number of one model, kept current for the streams that follow it."""

    def __init__(
        self, store: RegistryStore, feed: ChangeFeed, dependencies: Dependencies, model_id: str
    ) -> None:
        self.store = store
        self.feed = feed
        self.dependencies = dependencies
        self.model_id = model_id
        self.latest: int | None = 0
        self.changed = asyncio.Condition()
        self.streams = 0
        self._task = asyncio.get_running_loop().create_task(self._follow(), name=f"version-watch-{model_id}")

    async def _follow(self) -> None:
        # Watching before reading: a version committed in between still wakes the loop.
        streak = FailureStreak("following a model's versions", model_id=self.model_id)
        with self.feed.watch([model_changes_key(self.model_id)]) as changes:
            while True:
                try:
                    latest = await self.store.latest_number(self.model_id)
                except Exception as error:  # keep following: the streams ride the outage out
                    self.dependencies.suspect()
                    await changes.wait(streak.failed(error))
                    continue
                streak.succeeded()
                if latest != self.latest:
                    async with self.changed:
                        self.latest = latest
                        self.changed.notify_all()
                if latest is None:
                    return
                await changes.wait()

    def has_news(self, sent: int) -> bool:
        """Whether a stream that sent version `sent` has something new to say."""
        return self.latest is None or self.latest > sent

    async def stop(self) -> None:
        await cancel_and_wait(self._task)


def _absolute(number: int, latest: int) -> int:
    """The version number that `number` names: -1 is the latest, -n the n-th to last."""
    return latest + number + 1 if number < 0 else number


def _after(seconds: float) -> int:
    return time.time_ns() + int(seconds * 1e9)
