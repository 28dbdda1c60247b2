"""Blobs held in memory only, for tests of the registry's rules without a directory or an S3 server:
nothing touches the disk or the network, and nothing outlives the process. Uploads, reads, sizes
and hashes go through the same base machinery as the other stores."""

from __future__ import annotations

import io
import itertools
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

from services.model_registry.blobstore.base import BlobNotFound, BlobStore, BlobUpload, _Source

__all__ = ["MemoryBlobStore"]


@dataclass
class _Held:
    """The chunks of an upload not committed yet, and when it last wrote: one that crashed goes
    stale from there, as a local temp file from its last write."""

    pieces: list[bytes] = field(default_factory=list)
    written_at: float = field(default_factory=time.monotonic)


class _MemoryUpload(BlobUpload):
    def __init__(self, store: MemoryBlobStore, key: str, upload_id: int) -> None:
        super().__init__(key, store._executor)
        self._store = store
        self._id = upload_id

    async def _write(self, chunk: bytes) -> None:
        # On the event loop: no file or network work, and the chunk is kept, not copied.
        held = self._store._incomplete[self._id]
        self._hasher.update(chunk)
        held.pieces.append(chunk)
        held.written_at = time.monotonic()

    async def _commit(self, check: Callable[[], None]) -> None:
        check()
        held = self._store._incomplete[self._id]
        self._store._blobs[self.key] = b"".join(held.pieces)
        del self._store._incomplete[self._id]

    async def _discard(self) -> None:
        # A commit publishes in one step, after the only thing that can fail: nothing else to undo.
        self._store._incomplete.pop(self._id, None)

    async def _remove_committed(self) -> None:
        self._store._blobs.pop(self.key, None)


class MemoryBlobStore(BlobStore):
    """Blobs as bytes in a dict. Uploads hold their chunks apart until commit; `keys` and
    `incomplete_uploads` show what the store holds."""

    def __init__(self, *, max_threads: int = 2) -> None:
        super().__init__(max_threads, "blobstore-memory")
        self._blobs: dict[str, bytes] = {}
        self._incomplete: dict[int, _Held] = {}
        self._ids = itertools.count(1)
        # Upload id -> upload, for uploads in progress (cleanup leaves them alone). Weak: an upload
        # dropped without commit or abort counts as crashed, its chunks stay until cleanup.
        self._active: weakref.WeakValueDictionary[int, _MemoryUpload] = weakref.WeakValueDictionary()

    @property
    def description(self) -> str:
        return "memory"

    @property
    def keys(self) -> list[str]:
        """The committed blobs' keys, sorted."""
        return sorted(self._blobs)

    @property
    def incomplete_uploads(self) -> int:
        """Uploads neither committed nor aborted: in progress, or dropped (a crash)."""
        return len(self._incomplete)

    async def start(self) -> None:
        """Nothing to create or reach."""

    def _probe(self) -> None:
        """Memory is always there."""

    async def _open_upload(self, key: str) -> BlobUpload:
        upload_id = next(self._ids)
        self._incomplete[upload_id] = _Held()
        upload = _MemoryUpload(self, key, upload_id)
        self._active[upload_id] = upload
        return upload

    def _open_source(self, key: str) -> _Source:
        try:
            return io.BytesIO(self._blobs[key])  # shares the bytes, no copy
        except KeyError:
            raise BlobNotFound(f"no blob {key!r} in {self.description}") from None

    def _delete(self, key: str) -> None:
        self._blobs.pop(key, None)

    async def _cleanup_incomplete(self, older_than_s: float) -> int:
        now = time.monotonic()
        stale = [
            upload_id
            for upload_id, held in self._incomplete.items()
            if upload_id not in self._active and now - held.written_at >= older_than_s
        ]
        for upload_id in stale:
            del self._incomplete[upload_id]
        return len(stale)
