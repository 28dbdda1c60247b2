"""The contract every blob store keeps (`BlobStore`, `BlobUpload`, the errors, the key rules) and
the machinery they share: the size and SHA-256 of what is written, commit and abort that a cancelled
caller never leaves half done, reads one chunk ahead on the store's threads.

Stores stream: an upload is written chunk by chunk and a read yields chunk by chunk, so memory stays
bounded (a few chunks, or a few multipart parts on S3) whatever the size of the blob (the memory
store aside). An upload is invisible until it is committed; an aborted upload leaves no stored
bytes; an upload that never finished (the process crashed) leaves a temp file or an incomplete
multipart upload that `cleanup_incomplete` removes later.

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
import functools
import hashlib
import re
import threading
from collections.abc import AsyncGenerator, Callable, Iterator
from types import TracebackType
from typing import Any, Protocol, TypeVar

from services.model_registry.metrics import blob_operation, blob_operation_failures_total
from shared.errors import DependencyError
from shared.logging import get_logger

MiB = 1 << 20
MAX_KEY_LENGTH = 512
MAX_KEY_COMPONENT_LENGTH = 255  # NAME_MAX of common file systems
_KEY_PATTERN = re.compile(r"[0-9a-z_-]+(?:/[0-9a-z_-]+)*")

T = TypeVar("T")
log = get_logger("model_registry.blobstore")


class BlobStoreError(Exception):
    """The blob store failed (unreachable server, I/O error...) or was misused."""


class BlobNotFound(BlobStoreError):
    """No blob under this key."""


class BlobStoreUnavailable(BlobStoreError, DependencyError):
    """The backend could not serve the request (unreachable server, I/O error): callers answer
    UNAVAILABLE, or RESOURCE_EXHAUSTED when the cause is a full disk (see shared.errors)."""


class DigestMismatch(BlobStoreError):
    """The uploaded bytes are not the ones expected: the upload was aborted, nothing published."""

    def __init__(self, expected: str, actual: str) -> None:
        super().__init__(f"SHA-256 {actual} where {expected} was expected")
        self.expected = expected
        self.actual = actual


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


def _is_backend_failure(error: Exception) -> bool:
    """The file system's or the S3 client's failure (rather than a bug of ours)."""
    return isinstance(error, OSError) or type(error).__module__.split(".")[0] in ("minio", "urllib3")


@contextlib.contextmanager
def _backend_errors(action: str) -> Iterator[None]:
    """Backend failures (OSError, S3Error, urllib3 errors) surface as BlobStoreUnavailable,
    anything else (a bug) as BlobStoreError."""
    try:
        yield
    except BlobStoreError:
        raise
    except Exception as error:
        kind = BlobStoreUnavailable if _is_backend_failure(error) else BlobStoreError
        raise kind(f"{action}: {_describe(error)}") from error


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


def _fill(
    open_source: Callable[[str], _Source],
    key: str,
    buffer: memoryview,
    chunk_size: int,
    loop: asyncio.AbstractEventLoop,
    arrived: Callable[[int], None],
    stop: threading.Event,
) -> None:
    """(In a thread.) See `BlobStore.read_into`."""
    source = open_source(key)
    try:
        filled = 0
        while not stop.is_set():
            chunk = _read_exact(source, min(chunk_size, len(buffer) - filled) or 1)
            if not chunk:
                break
            if filled + len(chunk) > len(buffer):
                raise ValueError(f"blob {key!r} holds more than its recorded {len(buffer)} bytes")
            buffer[filled : filled + len(chunk)] = chunk
            filled += len(chunk)
            loop.call_soon_threadsafe(arrived, filled)
        if filled != len(buffer) and not stop.is_set():
            raise ValueError(f"blob {key!r} holds {filled} bytes, not its recorded {len(buffer)}")
    finally:
        source.close()


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
            with blob_operation("write"), _backend_errors(f"writing blob {self.key!r}"):
                await self._write(chunk)
        except BaseException:
            self._failed = True  # the stored bytes may now miss some: only abort is left
            raise
        self._size += len(chunk)

    async def commit(self, expected_digest: str = "") -> tuple[int, str]:
        """Make the blob durable and visible; returns (size, SHA-256 in standard padded base64).
        With `expected_digest`, bytes of another digest are never published: DigestMismatch.
        On failure everything written is removed before the error is raised."""
        if self._abort_task is not None:
            raise BlobStoreError(f"upload of {self.key!r} was aborted")
        if self._commit_task is None:
            if self._failed:
                await self.abort()
                raise BlobStoreError(f"upload of {self.key!r} failed earlier: aborted")
            self._commit_task = asyncio.ensure_future(self._commit_or_discard(expected_digest))
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
    async def _commit(self, check: Callable[[], None]) -> None:
        """Store what is left, then call `check()` (every byte has gone through the hasher by
        then; it raises when they are not the expected ones), then make the blob visible."""

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

    def _check_digest(self, expected: str) -> None:
        if expected:
            actual = _encode_digest(self._hasher)
            if actual != expected:
                raise DigestMismatch(expected, actual)

    async def _commit_or_discard(self, expected_digest: str) -> tuple[int, str]:
        try:
            with (
                blob_operation("commit", answers=(DigestMismatch,)),
                _backend_errors(f"committing blob {self.key!r}"),
            ):
                await self._commit(functools.partial(self._check_digest, expected_digest))
        except BaseException:
            await self._quietly(self._discard(), "removing a failed upload")
            raise
        return self._size, _encode_digest(self._hasher)

    async def _abort(self) -> None:
        with blob_operation("abort"):  # its failures are counted by _quietly
            await self._abort_or_remove()

    async def _abort_or_remove(self) -> None:
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
            blob_operation_failures_total.inc("abort")
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

    async def probe(self) -> None:
        """Raises if the store cannot be used right now (see shared.dependencies)."""
        with blob_operation("probe"), _backend_errors(f"reaching {self.description}"):
            await self._run(self._probe)

    @abc.abstractmethod
    def _probe(self) -> None:
        """(In a thread.) A cheap request that fails when the backend is away."""

    async def open_upload(self, key: str) -> BlobUpload:
        validate_key(key)
        with (
            blob_operation("open_upload"),
            _backend_errors(f"starting an upload of {key!r} to {self.description}"),
        ):
            return await self._open_upload(key)

    def read(self, key: str, chunk_size: int) -> AsyncGenerator[bytes, None]:
        """The blob in chunks of exactly `chunk_size` bytes, the last one shorter (nothing at all
        for an empty blob). Raises BlobNotFound (on first iteration) if there is no such blob.
        Close the iterator when stopping early (`contextlib.aclosing`) to release it at once."""
        validate_key(key)
        if chunk_size <= 0:
            raise ValueError(f"chunk size must be positive, not {chunk_size}")
        return self._read(key, chunk_size)

    async def read_into(
        self, key: str, buffer: memoryview, arrived: Callable[[int], None], *, chunk_size: int
    ) -> None:
        """Fill `buffer` with the blob, which must be exactly its size, read by one thread in
        chunks of `chunk_size` (no hop through the event loop per chunk); after each chunk,
        `arrived(bytes filled so far)` is called on the event loop. Raises BlobNotFound, or
        ValueError if the blob's size is not the buffer's."""
        validate_key(key)
        loop = asyncio.get_running_loop()
        stop = threading.Event()
        with (
            blob_operation("load", answers=(BlobNotFound,)),
            _backend_errors(f"reading blob {key!r} from {self.description}"),
        ):
            filling = self._executor.submit(
                _fill, self._open_source, key, buffer, chunk_size, loop, arrived, stop
            )
            try:
                await asyncio.wrap_future(filling)
            finally:
                stop.set()  # cancelled: the thread stops after its current chunk

    async def delete(self, key: str) -> None:
        """Remove the blob; nothing happens if there is none."""
        validate_key(key)
        with blob_operation("delete"), _backend_errors(f"deleting blob {key!r} from {self.description}"):
            await self._run(self._delete, key)

    async def cleanup_incomplete(self, older_than_s: float) -> int:
        """Remove what uploads that never finished (a crashed process) left behind, if older than
        `older_than_s` seconds; uploads in progress in this process are left alone. Returns how
        many were removed. Other processes' uploads look abandoned: keep the threshold above the
        longest upload (S3 dates an upload from its start; a local temp file from its last write)."""
        with (
            blob_operation("cleanup"),
            _backend_errors(f"cleaning up incomplete uploads in {self.description}"),
        ):
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

    async def _read(self, key: str, chunk_size: int) -> AsyncGenerator[bytes, None]:
        opening = self._executor.submit(self._open_source, key)
        try:
            with (
                blob_operation("read", answers=(BlobNotFound,)),
                _backend_errors(f"reading blob {key!r} from {self.description}"),
            ):
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
                with blob_operation("read"), _backend_errors(f"reading blob {key!r} from {self.description}"):
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
