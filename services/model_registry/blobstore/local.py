"""Blobs as files in a local directory: the embedded default, under the data directory."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import secrets
import time
import weakref
from collections import deque
from collections.abc import Callable
from pathlib import Path

from services.model_registry.blobstore.base import (
    BlobNotFound,
    BlobStore,
    BlobStoreError,
    BlobUpload,
    MiB,
    _result,
    _Source,
    validate_key,
)

__all__ = ["INCOMPLETE_DIR", "LocalBlobStore"]

# Local uploads hand bytes to the writer thread in batches of this much: one thread hop per batch,
# not per (possibly tiny) chunk.
LOCAL_WRITE_BATCH = 1 * MiB
INCOMPLETE_DIR = ".incomplete"  # cannot clash with a key: keys have no "."
_TEMP_SUFFIX = ".part"


def _write_all(fd: int, pieces: list[bytes]) -> None:
    views = deque(memoryview(piece) for piece in pieces if piece)
    while views:
        # At most IOV_MAX (1024) buffers per call; writev may also write less than asked.
        written = os.writev(fd, [views[i] for i in range(min(len(views), 1024))])
        while written:
            head = views[0]
            if written >= len(head):
                written -= len(head)
                views.popleft()
            else:
                views[0] = head[written:]
                written = 0


def _fsync_directory(path: Path) -> None:
    # Makes a rename, creation or removal in the directory survive a power loss.
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _LocalUpload(BlobUpload):
    def __init__(self, store: LocalBlobStore, key: str, temp_path: Path, fd: int) -> None:
        super().__init__(key, store._executor)
        self._store = store
        self._temp_path = temp_path
        self._fd = fd
        self._pending: list[bytes] = []
        self._pending_size = 0
        self._writing: concurrent.futures.Future[None] | None = None
        self._publishing = False

    async def _write(self, chunk: bytes) -> None:
        self._pending.append(chunk)
        self._pending_size += len(chunk)
        if self._pending_size >= LOCAL_WRITE_BATCH:
            await self._hand_over()

    async def _hand_over(self) -> None:
        # One batch in the thread while the next one gathers: the disk overlaps the receiving.
        if self._writing is not None:
            await _result(self._writing)
            self._writing = None
        if self._pending:
            pieces, self._pending, self._pending_size = self._pending, [], 0
            self._writing = self._submit(self._write_pieces, pieces)

    def _write_pieces(self, pieces: list[bytes]) -> None:
        for piece in pieces:
            self._hasher.update(piece)
        _write_all(self._fd, pieces)

    async def _commit(self, check: Callable[[], None]) -> None:
        await self._hand_over()
        if self._writing is not None:
            await _result(self._writing)
            self._writing = None
        check()
        self._publishing = True
        await _result(self._submit(self._publish))
        self._store._active.pop(self._temp_path.name, None)

    def _publish(self) -> None:
        os.fsync(self._fd)
        self._close_fd()
        final = self._store._path(self.key)
        # Retried: a concurrent delete may prune the (then empty) directory just made.
        for attempt in range(5):
            self._store._make_directories(final.parent)
            try:
                os.replace(self._temp_path, final)
                break
            except FileNotFoundError:
                if attempt == 4 or not self._temp_path.exists():
                    raise
        _fsync_directory(final.parent)

    def _close_fd(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)

    async def _discard(self) -> None:
        self._pending = []
        await self._settle()
        await self._store._run(self._remove_files)
        self._store._active.pop(self._temp_path.name, None)

    def _remove_files(self) -> None:
        self._close_fd()
        self._temp_path.unlink(missing_ok=True)
        if self._publishing:  # the rename may have happened before the failure
            self._store._path(self.key).unlink(missing_ok=True)

    async def _remove_committed(self) -> None:
        await self._store.delete(self.key)


class LocalBlobStore(BlobStore):
    """Blobs as files under `root` (the key is the relative path). Uploads go to a temp file in
    `root/.incomplete/`, fsynced and renamed into place on commit."""

    def __init__(self, root: str | Path, *, max_threads: int = 8) -> None:
        super().__init__(max_threads, "blobstore-local")
        self.root = Path(root).absolute()
        self._incomplete = self.root / INCOMPLETE_DIR
        # Temp file name -> upload, for uploads in progress here (cleanup leaves them alone). Weak:
        # an upload dropped without commit or abort counts as crashed.
        self._active: weakref.WeakValueDictionary[str, _LocalUpload] = weakref.WeakValueDictionary()

    @property
    def description(self) -> str:
        return f"directory {str(self.root)!r}"

    async def start(self) -> None:
        def make() -> None:
            self._incomplete.mkdir(parents=True, exist_ok=True)
            probe = self._incomplete / f"probe-{secrets.token_hex(8)}"
            probe.touch()  # fail now, not at the first upload, if it is not writable
            probe.unlink()

        try:
            await self._run(make)
        except OSError as error:
            raise BlobStoreError(f"cannot use {self.description} for blobs: {error}") from error

    def _probe(self) -> None:
        self._incomplete.stat()

    def _path(self, key: str) -> Path:
        return self.root / validate_key(key)

    def _make_directories(self, directory: Path) -> None:
        missing: list[Path] = []
        while not directory.is_dir():
            missing.append(directory)
            directory = directory.parent
        for path in reversed(missing):
            with contextlib.suppress(FileExistsError):
                path.mkdir()
            _fsync_directory(path.parent)

    async def _open_upload(self, key: str) -> BlobUpload:
        name = f"{secrets.token_hex(16)}{_TEMP_SUFFIX}"
        path = self._incomplete / name
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        fd = await self._run(os.open, path, flags, 0o644)
        upload = _LocalUpload(self, key, path, fd)
        self._active[name] = upload
        return upload

    def _open_source(self, key: str) -> _Source:
        try:
            return open(self._path(key), "rb", buffering=0)  # closed by the reader
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise BlobNotFound(f"no blob {key!r} in {self.description}") from None

    def _delete(self, key: str) -> None:
        path = self._path(key)
        try:
            path.unlink()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return
        _fsync_directory(path.parent)
        # Prune directories left empty (one per model otherwise stays forever).
        directory = path.parent
        while directory != self.root:
            try:
                directory.rmdir()
            except OSError:
                break
            directory = directory.parent

    async def _cleanup_incomplete(self, older_than_s: float) -> int:
        return await self._run(self._remove_stale_temp_files, older_than_s, set(self._active.keys()))

    def _remove_stale_temp_files(self, older_than_s: float, active: set[str]) -> int:
        removed = 0
        now = time.time()
        try:
            entries = list(os.scandir(self._incomplete))
        except FileNotFoundError:
            return 0
        for entry in entries:
            if entry.name in active or not entry.name.endswith(_TEMP_SUFFIX):
                continue
            try:
                if now - entry.stat(follow_symlinks=False).st_mtime >= older_than_s:
                    os.unlink(entry.path)
                    removed += 1
            except FileNotFoundError:
                continue
        return removed
