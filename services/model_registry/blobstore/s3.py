"""Blobs as objects in a bucket on any S3-compatible server, through the `minio` client (imported
only by S3 deployments)."""

from __future__ import annotations

import concurrent.futures
import mmap
import os
import threading
import weakref
from collections import deque
from collections.abc import Callable
from datetime import datetime, timezone
from typing import TYPE_CHECKING, cast

from services.model_registry.blobstore.base import (
    _KEY_PATTERN,
    BlobNotFound,
    BlobStore,
    BlobStoreError,
    BlobStoreUnavailable,
    BlobUpload,
    MiB,
    _describe,
    _result,
    _Source,
    validate_key,
)

if TYPE_CHECKING:
    import urllib3
    from minio import Minio
    from minio.credentials.credentials import Credentials
    from minio.credentials.providers import Provider

__all__ = ["DEFAULT_PART_SIZE", "DEFAULT_UPLOAD_CONCURRENCY", "MIN_PART_SIZE", "S3BlobStore"]

# S3 refuses multipart parts under 5 MiB (except the last one).
MIN_PART_SIZE = 5 * MiB
DEFAULT_PART_SIZE = 8 * MiB
MAX_PARTS = 10_000  # S3's limit: 8 MiB parts allow blobs up to 78 GiB
# Parts being uploaded at once per upload, besides the one filling: overlaps the network with
# receiving, and bounds memory to (1 + this) parts per upload.
DEFAULT_UPLOAD_CONCURRENCY = 2
# S3 error codes meaning the server did not accept who we claim to be.
_CREDENTIAL_ERRORS = frozenset(
    {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken"}
)


NO_CREDENTIALS = (
    "no S3 credentials: give --s3_access_key and --s3_secret_key, or set AWS_ACCESS_KEY_ID and "
    "AWS_SECRET_ACCESS_KEY, or an AWS shared credentials file, or give the pod or instance a role"
)


class _NoCredentials(OSError):
    """No credentials where they are looked for. An OSError, as an unreachable server is: the
    place they come from may come back (a token file mounted, a role attached)."""


def _credentials_provider(
    access_key: str | None, secret_key: str | None, session_token: str | None, http: urllib3.PoolManager
) -> Provider:
    """The keys when given; otherwise the first credentials found where AWS's SDKs look: the
    AWS_* (or MINIO_*) environment variables, the shared credentials file, then the role of the
    pod or instance (web identity token, ECS container credentials, EC2 instance metadata; not
    the metadata when AWS_EC2_METADATA_DISABLED=true)."""
    from minio.credentials.providers import (
        AWSConfigProvider,
        ChainedProvider,
        EnvAWSProvider,
        EnvMinioProvider,
        IamAwsProvider,
        Provider,
        StaticProvider,
    )

    if access_key or secret_key:
        if not (access_key and secret_key):
            raise BlobStoreError("an S3 access key and secret key go together: give both, or neither")
        return StaticProvider(access_key, secret_key, session_token)
    providers: list[Provider] = [EnvAWSProvider(), EnvMinioProvider(), AWSConfigProvider()]
    role_sources = (
        "AWS_WEB_IDENTITY_TOKEN_FILE",
        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
        "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    )
    metadata_disabled = os.environ.get("AWS_EC2_METADATA_DISABLED", "").strip().lower() == "true"
    if not metadata_disabled or any(os.environ.get(name) for name in role_sources):
        providers.append(IamAwsProvider(http_client=http))
    chain = ChainedProvider(providers)
    # The store's threads ask for credentials on every request: one fetches (or renews) them,
    # the others wait and take the same.
    lock = threading.Lock()

    class FirstFound(Provider):
        def retrieve(self) -> Credentials:
            with lock:
                try:
                    return chain.retrieve()
                except ValueError:  # found nowhere
                    raise _NoCredentials(NO_CREDENTIALS) from None
                except Exception as error:  # the role's endpoint did not answer
                    # Its kind only: the request that failed may carry the pod's identity token.
                    raise _NoCredentials(
                        "could not get S3 credentials from the role of the pod or instance "
                        f"({type(error).__name__})"
                    ) from None

    return FirstFound()


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

    def _put_whole(self, data: memoryview, check: Callable[[], None]) -> None:
        self._hasher.update(data)
        check()
        self._store._client._put_object(
            self._store.bucket, self._name, cast(bytes, data), {"Content-Type": "application/octet-stream"}
        )

    async def _commit(self, check: Callable[[], None]) -> None:
        if self._upload_id is None:
            data = memoryview(self._buffer)[: self._fill] if self._buffer is not None else memoryview(b"")
            await _result(self._submit(self._put_whole, data, check))
        else:
            await self._send_buffer()  # the last part: parts are only sent once more data follows
            while self._in_flight:
                await self._finish_oldest_part()
            check()  # before completing: a multipart upload aborted leaves no object
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
        # The longest silence between two reads of an answer: an S3 server that says nothing for
        # this long is gone (a stuck proxy, a frozen host), and downloads sharing its load of a
        # version (see hot_versions) wait that long before one tries again.
        read_timeout_s: float = 20.0,
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
        ca_certs = ca_file or os.environ.get("SSL_CERT_FILE") or certifi.where()
        # Our own pool: one connection per thread (minio's default keeps 10 and discards extras).
        self._http = urllib3.PoolManager(
            timeout=urllib3.Timeout(connect=connect_timeout_s, read=read_timeout_s),
            maxsize=max_threads,
            cert_reqs="CERT_REQUIRED" if cert_check else "CERT_NONE",
            ca_certs=ca_certs,
            # Few retries: a wrong endpoint must fail start() in about a second, not minutes.
            retries=urllib3.Retry(total=3, backoff_factor=0.2, status_forcelist=[500, 502, 503, 504]),
        )
        # The role's endpoints (instance metadata, STS) answer at once where they exist: outside
        # a cloud, finding none must not hold start-up for minutes.
        role_http = urllib3.PoolManager(
            timeout=urllib3.Timeout(connect=1.0, read=5.0),
            cert_reqs="CERT_REQUIRED" if cert_check else "CERT_NONE",
            ca_certs=ca_certs,
            retries=urllib3.Retry(total=1, backoff_factor=0.2),
        )
        credentials = _credentials_provider(access_key, secret_key, session_token, role_http)
        self._keys_given = bool(access_key)
        try:
            self._client: Minio = Minio(
                endpoint, credentials=credentials, secure=secure, region=region, http_client=self._http
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

    @property
    def credentials_source(self) -> str:
        return "the keys given" if self._keys_given else "the environment or the role of the pod or instance"

    async def start(self) -> None:
        from minio.error import S3Error

        try:
            await self._run(self._ensure_bucket)
        except _NoCredentials as error:
            raise BlobStoreError(f"cannot use {self.description}: {error}") from error
        except S3Error as error:
            if error.code in _CREDENTIAL_ERRORS:
                raise BlobStoreError(
                    f"{self.description} refused the credentials from {self.credentials_source} "
                    f"({_describe(error)}): check the access key, the secret key and their rights on "
                    "the bucket"
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

    def _probe(self) -> None:
        if not self._client.bucket_exists(self.bucket):
            raise BlobStoreUnavailable(f"{self.description}: the bucket does not exist (any more)")

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
