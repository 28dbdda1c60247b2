"""Where model version data lives: a blob store, either a local directory (the embedded default,
under the data directory) or a bucket on any S3-compatible server (through the `minio` client).

Both stream: an upload is written chunk by chunk and a read yields chunk by chunk, so memory stays
bounded (a few chunks, or a few multipart parts on S3) whatever the size of the blob. An upload is
invisible until it is committed; an aborted upload leaves no stored bytes; an upload that never
finished (the process crashed) leaves a temp file or an incomplete multipart upload that
`cleanup_incomplete` removes later.

All file and network work runs on the store's own thread pool, never on the event loop (and never
on the loop's default executor, which a few slow uploads could otherwise fill).

Keys are made by the registry (e.g. `versions/<hex>/<hex>`), never from user input; they are still
checked (lower-case letters, digits, `_`, `-`, separated by `/`), so no key can leave the store.
"""

from __future__ import annotations

import abc
import asyncio
import base64
import concurrent.futures
import contextlib
import hashlib
import mmap
import os
import re
import secrets
import threading
import time
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

from shared.logging import get_logger

if TYPE_CHECKING:
    import urllib3
    from minio import Minio

__all__ = [
    "DEFAULT_PART_SIZE",
    "MIN_PART_SIZE",
    "BlobNotFound",
    "BlobStore",
    "BlobStoreError",
    "BlobUpload",
    "InvalidBlobKey",
    "LocalBlobStore",
    "S3BlobStore",
    "validate_key",
]

MiB = 1 << 20
# S3 refuses multipart parts under 5 MiB (except the last one).
MIN_PART_SIZE = 5 * MiB
DEFAULT_PART_SIZE = 8 * MiB
MAX_PARTS = 10_000  # S3's limit: 8 MiB parts allow blobs up to 78 GiB
# Parts being uploaded at once per upload, besides the one filling: overlaps the network with
# receiving, and bounds memory to (1 + this) parts per upload.
DEFAULT_UPLOAD_CONCURRENCY = 2
# Local uploads hand bytes to the writer thread in batches of this much: one thread hop per batch,
# not per (possibly tiny) chunk.
LOCAL_WRITE_BATCH = 1 * MiB
MAX_KEY_LENGTH = 512
MAX_KEY_COMPONENT_LENGTH = 255  # NAME_MAX of common file systems
INCOMPLETE_DIR = ".incomplete"  # cannot clash with a key: keys have no "."
_TEMP_SUFFIX = ".part"
_KEY_PATTERN = re.compile(r"[0-9a-z_-]+(?:/[0-9a-z_-]+)*")
# S3 error codes meaning the server did not accept who we claim to be.
_CREDENTIAL_ERRORS = frozenset(
    {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken"}
)

T = TypeVar("T")
log = get_logger("model_registry.blobstore")


class BlobStoreError(Exception):
    """The blob store failed (unreachable server, I/O error...) or was misused."""


class BlobNotFound(BlobStoreError):
    """No blob under this key."""


class InvalidBlobKey(BlobStoreError, ValueError):
    """The key is not one the registry makes: it could name something outside the store."""


def validate_key(key: str) -> str:
    if (
        not isinstance(key, str)
        or len(key) > MAX_KEY_LENGTH
        or not _KEY_PATTERN.fullmatch(key)
        or any(len(part) > MAX_KEY_COMPONENT_LENGTH for part in key.split("/"))
    ):
        raise InvalidBlobKey(
            f"invalid blob key {key!r}: expected [0-9a-z_-] words separated by '/', "
            f"at most {MAX_KEY_LENGTH} characters"
        )
    return key


def _describe(error: BaseException) -> str:
    code = getattr(error, "code", None)  # minio's S3Error
    if isinstance(code, str):
        return f"{code}: {getattr(error, 'message', None) or error}"
    return str(error) or type(error).__name__


@contextlib.contextmanager
def _backend_errors(action: str) -> Iterator[None]:
    """Backend failures (OSError, S3Error, urllib3 errors) surface as BlobStoreError."""
    try:
        yield
    except BlobStoreError:
        raise
    except Exception as error:
        raise BlobStoreError(f"{action}: {_describe(error)}") from error


def _encode_digest(hasher: Any) -> str:
    return base64.b64encode(hasher.digest()).decode("ascii")


async def _result(future: concurrent.futures.Future[T]) -> T:
    return await asyncio.wrap_future(future)


class _Source(Protocol):
    def read(self, size: int, /) -> bytes: ...

    def close(self) -> None: ...


def _read_exact(source: _Source, size: int) -> bytes:
    """`size` bytes, or fewer only at the end of the data (b"" when it is over)."""
    first = source.read(size)
    if not first or len(first) == size:
        return first or b""
    pieces = [first]
    got = len(first)
    while got < size:
        more = source.read(size - got)
        if not more:
            break
        pieces.append(more)
        got += len(more)
    return b"".join(pieces)


def _close_after(future: concurrent.futures.Future[Any] | None, source: _Source) -> None:
    # A source is not thread-safe: close it only once its outstanding read is over.
    if future is not None:
        concurrent.futures.wait([future])
    try:
        source.close()
    except Exception as error:
        log.debug("closing a blob reader failed", error=_describe(error))


def _close_when_opened(future: concurrent.futures.Future[_Source]) -> None:
    # For an open abandoned while its thread was still opening: close what it opens.
    if not future.cancelled() and future.exception() is None:
        future.result().close()


class BlobUpload(abc.ABC):
    """One blob being written: `write` chunks of any size, then `commit` or `abort`.

    Nothing is visible under the key before `commit` returns. `abort` removes everything written
    (it is idempotent, safe after any failure, and does nothing once `commit` has returned). Used as
    an async context manager, an upload not committed by the end of the block is aborted.
    Writes must not overlap (await each one): awaiting them is the backpressure.
    """

    def __init__(self, key: str, executor: concurrent.futures.ThreadPoolExecutor) -> None:
        self.key = key
        self._executor = executor
        # Only ever updated by one thread at a time, in the order of the bytes.
        self._hasher = hashlib.sha256()
        self._size = 0
        self._failed = False
        self._work: list[concurrent.futures.Future[Any]] = []
        # Commit and abort run as tasks the caller awaits through a shield: cancelling the caller
        # (the client went away) never leaves them half done.
        self._commit_task: asyncio.Future[tuple[int, str]] | None = None
        self._abort_task: asyncio.Future[None] | None = None
        self._commit_returned = False

    @property
    def size(self) -> int:
        """Bytes written so far."""
        return self._size

    async def write(self, chunk: bytes) -> None:
        if self._commit_task is not None or self._abort_task is not None:
            raise BlobStoreError(f"upload of {self.key!r} is already committed or aborted")
        if self._failed:
            raise BlobStoreError(f"upload of {self.key!r} failed earlier: abort it")
        if not chunk:
            return
        if not isinstance(chunk, bytes):
            chunk = bytes(chunk)  # a mutable buffer may change after this returns: keep a copy
        try:
            with _backend_errors(f"writing blob {self.key!r}"):
                await self._write(chunk)
        except BaseException:
            self._failed = True  # the stored bytes may now miss some: only abort is left
            raise
        self._size += len(chunk)

    async def commit(self) -> tuple[int, str]:
        """Make the blob durable and visible; returns (size, SHA-256 in standard padded base64).
        On failure everything written is removed before the error is raised."""
        if self._abort_task is not None:
            raise BlobStoreError(f"upload of {self.key!r} was aborted")
        if self._commit_task is None:
            if self._failed:
                await self.abort()
                raise BlobStoreError(f"upload of {self.key!r} failed earlier: aborted")
            self._commit_task = asyncio.ensure_future(self._commit_or_discard())
        result = await asyncio.shield(self._commit_task)
        self._commit_returned = True
        return result

    async def abort(self) -> None:
        if self._abort_task is None:
            self._abort_task = asyncio.ensure_future(self._abort())
        await asyncio.shield(self._abort_task)

    async def __aenter__(self) -> BlobUpload:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if not self._commit_returned:
            await self.abort()

    # -- for the implementations ---------------------------------------------------------------

    @abc.abstractmethod
    async def _write(self, chunk: bytes) -> None: ...

    @abc.abstractmethod
    async def _commit(self) -> None:
        """Store what is left, make the blob visible; every byte has gone through the hasher."""

    @abc.abstractmethod
    async def _discard(self) -> None:
        """Remove everything this upload stored, including a blob published by a failed commit."""

    @abc.abstractmethod
    async def _remove_committed(self) -> None:
        """Delete the blob of a commit whose caller never saw it succeed (it was cancelled)."""

    def _submit(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        future = self._executor.submit(fn, *args)
        self._work = [work for work in self._work if not work.done()]
        self._work.append(future)
        return future

    async def _settle(self) -> None:
        """Wait until no thread works for this upload any more (whatever their outcome)."""
        waiting = [asyncio.wrap_future(work) for work in self._work if not work.done()]
        if waiting:
            await asyncio.wait(waiting)
            for future in waiting:
                if not future.cancelled():
                    future.exception()  # retrieved here: reported by whoever awaited the work
        self._work.clear()

    async def _commit_or_discard(self) -> tuple[int, str]:
        try:
            with _backend_errors(f"committing blob {self.key!r}"):
                await self._commit()
        except BaseException:
            await self._quietly(self._discard(), "removing a failed upload")
            raise
        return self._size, _encode_digest(self._hasher)

    async def _abort(self) -> None:
        if self._commit_task is None:
            await self._quietly(self._discard(), "aborting an upload")
            return
        await asyncio.wait([self._commit_task])
        if self._commit_task.cancelled() or self._commit_task.exception() is not None:
            return  # a failed commit has removed everything already
        if not self._commit_returned:
            await self._quietly(self._remove_committed(), "removing an interrupted commit")

    async def _quietly(self, work: Any, action: str) -> None:
        # Runs in error paths: its own failure must not hide the first one. Leftovers are for
        # cleanup_incomplete (or are unreferenced objects, harmless but for their space).
        try:
            await work
        except Exception as error:
            log.warning(f"{action} failed", key=self.key, error=_describe(error))


class BlobStore(abc.ABC):
    """Blobs under registry-made keys; every method is safe to call from the event loop."""

    def __init__(self, max_threads: int, thread_name: str) -> None:
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=max_threads, thread_name_prefix=thread_name
        )

    @property
    @abc.abstractmethod
    def description(self) -> str:
        """Where the blobs are, for logs (no secrets)."""

    @abc.abstractmethod
    async def start(self) -> None:
        """Create the directory / bucket if missing; raise a BlobStoreError saying what is wrong
        (unreachable server, rejected credentials...) if the store cannot be used."""

    async def open_upload(self, key: str) -> BlobUpload:
        validate_key(key)
        with _backend_errors(f"starting an upload of {key!r} to {self.description}"):
            return await self._open_upload(key)

    def read(self, key: str, chunk_size: int) -> AsyncIterator[bytes]:
        """The blob in chunks of exactly `chunk_size` bytes, the last one shorter (nothing at all
        for an empty blob). Raises BlobNotFound (on first iteration) if there is no such blob.
        Close the iterator when stopping early (`contextlib.aclosing`) to release it at once."""
        validate_key(key)
        if chunk_size <= 0:
            raise ValueError(f"chunk size must be positive, not {chunk_size}")
        return self._read(key, chunk_size)

    async def delete(self, key: str) -> None:
        """Remove the blob; nothing happens if there is none."""
        validate_key(key)
        with _backend_errors(f"deleting blob {key!r} from {self.description}"):
            await self._run(self._delete, key)

    async def cleanup_incomplete(self, older_than_s: float) -> int:
        """Remove what uploads that never finished (a crashed process) left behind, if older than
        `older_than_s` seconds; uploads in progress in this process are left alone. Returns how
        many were removed. Other processes' uploads look abandoned: keep the threshold above the
        longest upload (S3 dates an upload from its start; a local temp file from its last write)."""
        with _backend_errors(f"cleaning up incomplete uploads in {self.description}"):
            return await self._cleanup_incomplete(older_than_s)

    async def close(self) -> None:
        await asyncio.to_thread(self._executor.shutdown)

    # -- for the implementations ---------------------------------------------------------------

    @abc.abstractmethod
    async def _open_upload(self, key: str) -> BlobUpload: ...

    @abc.abstractmethod
    def _open_source(self, key: str) -> _Source:
        """(In a thread.) A reader of the blob; raises BlobNotFound."""

    @abc.abstractmethod
    def _delete(self, key: str) -> None:
        """(In a thread.)"""

    @abc.abstractmethod
    async def _cleanup_incomplete(self, older_than_s: float) -> int: ...

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await _result(self._executor.submit(fn, *args))

    async def _read(self, key: str, chunk_size: int) -> AsyncIterator[bytes]:
        opening = self._executor.submit(self._open_source, key)
        try:
            with _backend_errors(f"reading blob {key!r} from {self.description}"):
                source = await _result(opening)
        except asyncio.CancelledError:
            opening.add_done_callback(_close_when_opened)
            raise
        # The thread reads one chunk ahead: reading chunk N+1 overlaps the consumer sending chunk
        # N, and no more than two chunks are held.
        ahead: concurrent.futures.Future[bytes] | None
        ahead = self._executor.submit(_read_exact, source, chunk_size)
        try:
            while ahead is not None:
                with _backend_errors(f"reading blob {key!r} from {self.description}"):
                    chunk = await _result(ahead)
                ahead = None
                if len(chunk) == chunk_size:
                    ahead = self._executor.submit(_read_exact, source, chunk_size)
                if chunk:
                    yield chunk
        finally:
            try:
                self._executor.submit(_close_after, ahead, source)
            except RuntimeError:  # the store is closed: no thread left to wait on
                source.close()


# -- local directory -------------------------------------------------------------------------------


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

    async def _commit(self) -> None:
        await self._hand_over()
        if self._writing is not None:
            await _result(self._writing)
            self._writing = None
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


# -- S3 --------------------------------------------------------------------------------------------


class _S3Source:
    def __init__(self, response: urllib3.BaseHTTPResponse) -> None:
        self._response = response
        self._drained = False

    def read(self, size: int, /) -> bytes:
        data = self._response.read(size)
        if not data:
            self._drained = True
        return data

    def close(self) -> None:
        # A fully read response gives its connection back to the pool; one abandoned midway must
        # drop it (reading the rest could mean gigabytes).
        if not self._drained:
            self._response.close()
        self._response.release_conn()


def _new_part_buffer(size: int) -> mmap.mmap:
    # An anonymous mapping rather than heap memory: unmapped as soon as the last reference goes,
    # so a finished upload's buffers go back to the system instead of bloating the allocator.
    return mmap.mmap(-1, size)


class _S3Upload(BlobUpload):
    """Chunks are copied into part-sized buffers; each full buffer is uploaded by a thread as a
    multipart part once more data follows (so the last part is never empty), with at most
    `upload_concurrency` parts in flight. A blob that fits in one part goes up in one PUT."""

    def __init__(self, store: S3BlobStore, key: str) -> None:
        super().__init__(key, store._executor)
        self._store = store
        self._name = store._object_name(key)
        self._part_size = store.part_size
        self._buffer: mmap.mmap | None = None
        self._fill = 0
        self._spare: list[mmap.mmap] = []  # buffers of finished parts, reused
        self._upload_id: str | None = None
        self._creating: concurrent.futures.Future[str] | None = None
        self._in_flight: deque[tuple[int, mmap.mmap, concurrent.futures.Future[str]]] = deque()
        self._done_parts: list[tuple[int, str]] = []
        self._last_hashed: threading.Event | None = None
        self._completing = False

    async def _write(self, chunk: bytes) -> None:
        view = memoryview(chunk).cast("B")
        while view:
            if self._buffer is None:
                self._buffer = self._spare.pop() if self._spare else _new_part_buffer(self._part_size)
                self._fill = 0
            elif self._fill == self._part_size:
                await self._send_buffer()
                continue
            taken = min(len(view), self._part_size - self._fill)
            self._buffer[self._fill : self._fill + taken] = view[:taken]
            self._fill += taken
            view = view[taken:]

    async def _send_buffer(self) -> None:
        buffer, fill = self._buffer, self._fill
        assert buffer is not None and fill > 0
        if self._upload_id is None:
            self._creating = self._submit(self._store._create_multipart, self._name)
            self._upload_id = await _result(self._creating)
            self._store._uploads[self._upload_id] = self
        while len(self._in_flight) >= self._store.upload_concurrency:
            await self._finish_oldest_part()
        number = len(self._done_parts) + len(self._in_flight) + 1
        if number > MAX_PARTS:
            raise BlobStoreError(
                f"blob {self.key!r} exceeds {MAX_PARTS} parts of {self._part_size} bytes: raise the part size"
            )
        hashed = threading.Event()
        part = self._submit(self._upload_part, number, memoryview(buffer)[:fill], self._last_hashed, hashed)
        # Also on cancellation before it ran: the next part must never wait forever.
        part.add_done_callback(lambda _: hashed.set())
        self._last_hashed = hashed
        self._in_flight.append((number, buffer, part))
        self._buffer, self._fill = None, 0

    async def _finish_oldest_part(self) -> None:
        number, buffer, part = self._in_flight[0]
        etag = await _result(part)
        self._in_flight.popleft()
        self._done_parts.append((number, etag))
        self._spare.append(buffer)

    def _hash_in_order(
        self, data: memoryview, after: threading.Event | None, hashed: threading.Event
    ) -> None:
        # Parts upload in parallel but the digest needs the bytes in order: each part's thread
        # waits for the previous part to be hashed (parts are submitted in order, FIFO).
        try:
            if after is not None:
                after.wait()
            self._hasher.update(data)
        finally:
            hashed.set()

    def _upload_part(
        self, number: int, data: memoryview, after: threading.Event | None, hashed: threading.Event
    ) -> str:
        self._hash_in_order(data, after, hashed)
        assert self._upload_id is not None
        # urllib3 sends any bytes-like body as is: no copy of the part.
        body = cast(bytes, data)
        return self._store._client._upload_part(
            self._store.bucket,
            self._name,
            body,
            None,
            self._upload_id,
            number,
        )

    def _put_whole(self, data: memoryview) -> None:
        self._hasher.update(data)
        self._store._client._put_object(
            self._store.bucket, self._name, cast(bytes, data), {"Content-Type": "application/octet-stream"}
        )

    async def _commit(self) -> None:
        if self._upload_id is None:
            data = memoryview(self._buffer)[: self._fill] if self._buffer is not None else memoryview(b"")
            await _result(self._submit(self._put_whole, data))
        else:
            await self._send_buffer()  # the last part: parts are only sent once more data follows
            while self._in_flight:
                await self._finish_oldest_part()
            self._completing = True
            complete = self._store._complete_multipart
            await _result(self._submit(complete, self._name, self._upload_id, self._done_parts))
            self._store._uploads.pop(self._upload_id, None)
        self._release_buffers()

    def _release_buffers(self) -> None:
        self._buffer, self._fill, self._spare = None, 0, []

    async def _discard(self) -> None:
        await self._settle()
        self._in_flight.clear()
        self._release_buffers()
        upload_id = self._upload_id
        creating = self._creating
        if upload_id is None and creating is not None and not creating.cancelled():
            # Created, but the write waiting for it was cancelled before it learnt the id.
            upload_id = creating.result() if creating.exception() is None else None
        if upload_id is not None:
            await self._store._run(self._store._abort_multipart, self._name, upload_id)
            self._store._uploads.pop(upload_id, None)
        if self._completing:  # the server may have completed it before the failure reached us
            await self._store._run(self._store._delete, self.key)

    async def _remove_committed(self) -> None:
        await self._store.delete(self.key)


class S3BlobStore(BlobStore):
    """Blobs as objects `prefix + key` in `bucket` on an S3-compatible server.

    `endpoint` is `host:port` (TLS when `secure`; `cert_check=False` skips certificate checks; CA
    certificates from `ca_file`, else $SSL_CERT_FILE, else certifi's). Give the registry its own
    bucket or prefix: `cleanup_incomplete` aborts every old incomplete upload under the prefix.
    """

    def __init__(
        self,
        endpoint: str,
        access_key: str | None,
        secret_key: str | None,
        bucket: str,
        *,
        secure: bool = True,
        region: str | None = None,
        prefix: str = "",
        session_token: str | None = None,
        part_size: int = DEFAULT_PART_SIZE,
        upload_concurrency: int = DEFAULT_UPLOAD_CONCURRENCY,
        cert_check: bool = True,
        ca_file: str | None = None,
        connect_timeout_s: float = 10.0,
        read_timeout_s: float = 300.0,
        max_threads: int = 32,
    ) -> None:
        # Imported here: only S3 deployments need minio.
        import certifi
        import urllib3
        from minio import Minio

        if part_size < MIN_PART_SIZE:
            raise ValueError(f"part size must be at least {MIN_PART_SIZE} bytes (S3's minimum)")
        if upload_concurrency < 1:
            raise ValueError("upload concurrency must be at least 1")
        if prefix and not (prefix.endswith("/") and _KEY_PATTERN.fullmatch(prefix[:-1])):
            raise ValueError(f"invalid prefix {prefix!r}: expected [0-9a-z_-] words, each ending with '/'")
        super().__init__(max_threads, "blobstore-s3")
        self.endpoint = endpoint
        self.bucket = bucket
        self.prefix = prefix
        self.secure = secure
        self.part_size = part_size
        self.upload_concurrency = upload_concurrency
        self._region = region
        # Our own pool: one connection per thread (minio's default keeps 10 and discards extras).
        self._http = urllib3.PoolManager(
            timeout=urllib3.Timeout(connect=connect_timeout_s, read=read_timeout_s),
            maxsize=max_threads,
            cert_reqs="CERT_REQUIRED" if cert_check else "CERT_NONE",
            ca_certs=ca_file or os.environ.get("SSL_CERT_FILE") or certifi.where(),
            # Few retries: a wrong endpoint must fail start() in about a second, not minutes.
            retries=urllib3.Retry(total=3, backoff_factor=0.2, status_forcelist=[500, 502, 503, 504]),
        )
        try:
            self._client: Minio = Minio(
                endpoint,
                access_key=access_key,
                secret_key=secret_key,
                session_token=session_token,
                secure=secure,
                region=region,
                http_client=self._http,
            )
        except ValueError as error:
            raise BlobStoreError(f"invalid S3 endpoint {endpoint!r}: {error}") from error
        # Upload id -> upload, for uploads in progress here (cleanup leaves them alone). Weak: an
        # upload dropped without commit or abort counts as crashed.
        self._uploads: weakref.WeakValueDictionary[str, _S3Upload] = weakref.WeakValueDictionary()

    @property
    def description(self) -> str:
        scheme = "https" if self.secure else "http"
        return f"S3 bucket {self.bucket!r} at {scheme}://{self.endpoint}"

    async def start(self) -> None:
        from minio.error import S3Error

        try:
            await self._run(self._ensure_bucket)
        except S3Error as error:
            if error.code in _CREDENTIAL_ERRORS:
                raise BlobStoreError(
                    f"{self.description} refused the credentials ({_describe(error)}): "
                    "check the access key, the secret key and their rights on the bucket"
                ) from error
            raise BlobStoreError(f"cannot use {self.description}: {_describe(error)}") from error
        except ValueError as error:  # minio checks bucket names locally
            raise BlobStoreError(f"cannot use {self.description}: {error}") from error
        except Exception as error:  # urllib3's MaxRetryError (connection refused, TLS...), OSError
            raise BlobStoreError(f"cannot reach {self.description}: {_describe(error)}") from error

    async def close(self) -> None:
        await super().close()
        self._http.clear()

    def _object_name(self, key: str) -> str:
        return self.prefix + validate_key(key)

    def _ensure_bucket(self) -> None:
        from minio.error import S3Error

        if self._client.bucket_exists(self.bucket):
            return
        try:
            self._client.make_bucket(self.bucket, location=self._region)
        except S3Error as error:
            if error.code != "BucketAlreadyOwnedByYou":  # another replica made it meanwhile
                raise

    async def _open_upload(self, key: str) -> BlobUpload:
        return _S3Upload(self, key)

    def _create_multipart(self, name: str) -> str:
        headers: dict[str, str | list[str] | tuple[str]] = {"Content-Type": "application/octet-stream"}
        return self._client._create_multipart_upload(self.bucket, name, headers)

    def _complete_multipart(self, name: str, upload_id: str, parts: list[tuple[int, str]]) -> None:
        from minio.datatypes import Part

        listed = [Part(number, etag) for number, etag in sorted(parts)]
        self._client._complete_multipart_upload(self.bucket, name, upload_id, listed)

    def _abort_multipart(self, name: str, upload_id: str) -> None:
        from minio.error import S3Error

        try:
            self._client._abort_multipart_upload(self.bucket, name, upload_id)
        except S3Error as error:
            if error.code != "NoSuchUpload":
                raise

    def _open_source(self, key: str) -> _Source:
        from minio.error import S3Error

        try:
            response = self._client.get_object(self.bucket, self._object_name(key))
        except S3Error as error:
            if error.code == "NoSuchKey":
                raise BlobNotFound(f"no blob {key!r} in {self.description}") from None
            raise
        return _S3Source(response)

    def _delete(self, key: str) -> None:
        self._client.remove_object(self.bucket, self._object_name(key))

    async def _cleanup_incomplete(self, older_than_s: float) -> int:
        return await self._run(self._abort_stale_uploads, older_than_s, set(self._uploads.keys()))

    def _abort_stale_uploads(self, older_than_s: float, active: set[str]) -> int:
        removed = 0
        now = datetime.now(timezone.utc)
        key_marker: str | None = None
        upload_id_marker: str | None = None
        while True:
            listing = self._client._list_multipart_uploads(
                self.bucket,
                prefix=self.prefix or None,
                key_marker=key_marker,
                upload_id_marker=upload_id_marker,
            )
            for upload in listing.uploads:
                if upload.upload_id is None or upload.upload_id in active:
                    continue
                started = upload.initiated_time
                if started is not None and (now - started).total_seconds() < older_than_s:
                    continue
                self._abort_multipart(upload.object_name, upload.upload_id)
                removed += 1
            if not listing.is_truncated or not listing.uploads:
                return removed
            # From the last entry: minio 7.2 does not parse NextUploadIdMarker.
            key_marker, upload_id_marker = listing.uploads[-1].object_name, listing.uploads[-1].upload_id
