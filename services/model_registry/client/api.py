"""The Model Registry's Python client: models, and their versions published and fetched with
their size and SHA-256 checked.

    async with ModelRegistryClient("grpc://localhost:9002") as registry:
        await registry.create_model("policy", {"env": "demo"})
        info = await registry.publish_version("policy", b"...weights...", user_data={"step": "100"})
        info, data = await registry.retrieve_version("policy")  # the latest; -2 the one before
        await registry.download_version("policy", "policy.bin", version=info.version_number)
        async for info in registry.follow_versions("policy"):  # the latest, then every new one
            ...

`publish_version` takes bytes, a file's path or a binary file object (read once to hash it, then
again to send it; one that cannot seek is copied to a temporary file first). Fetched data is
checked against the version's size and hash: a mismatch is a `ClientError` and nothing is
returned or written. Failures are `ClientError`s or `grpc.aio.AioRpcError`s (`describe_rpc_error`
says them in a sentence).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import io
import os
import secrets
import tempfile
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import IO

import grpc

from shared.api import model_registry_pb2, model_registry_pb2_grpc
from shared.channel import ClientTls
from shared.client import DEFAULT_TIMEOUT_S, ClientError, ServiceClient
from shared.endpoints import GrpcEndpoint

DEFAULT_ENDPOINT = GrpcEndpoint("localhost", 9002)
CHUNK_SIZE = 2 * 1024 * 1024  # upload chunks, as the SDK sends them
PAGE_SIZE = 100  # models / versions asked per call when listing
# Received messages may be larger than gRPC's 4 MiB default (a registry configured with larger
# chunks, as the reference's stale 5 MB documentation suggests).
MAX_RECEIVE_MESSAGE_BYTES = 64 * 1024 * 1024
# Data of a version to publish: bytes, a file's path, or a binary file object.
VersionData = bytes | str | os.PathLike[str] | IO[bytes]
# Told the bytes sent or received since it was last called (a progress bar's `advance`).
OnBytes = Callable[[int], None]


def _ignore(_count: int) -> None:
    pass


def hash_hex(data_hash: str) -> str:
    """A version's hash, base64 as the API carries it, in hex as `sha256sum` prints it (the
    base64 text itself when it is not that of a SHA-256)."""
    try:
        digest = base64.b64decode(data_hash, validate=True)
    except ValueError:
        return data_hash
    return digest.hex() if len(digest) == hashlib.sha256().digest_size else data_hash


def stream_digest(source: IO[bytes]) -> tuple[int, str]:
    """Size and SHA-256 (base64 standard, padded) of what is left to read in `source`."""
    digest = hashlib.sha256()
    size = 0
    while chunk := source.read(CHUNK_SIZE):
        digest.update(chunk)
        size += len(chunk)
    return size, base64.b64encode(digest.digest()).decode("ascii")


def _seekable_copy(source: IO[bytes]) -> IO[bytes]:
    """`source`, or a temporary copy of what is left in it when it cannot seek (a pipe)."""
    with contextlib.suppress(OSError, ValueError):
        if source.seekable():
            return source
    copy = tempfile.TemporaryFile()  # noqa: SIM115 (returned: the caller closes it)
    while chunk := source.read(CHUNK_SIZE):
        copy.write(chunk)
    copy.seek(0)
    return copy


class ModelRegistryClient(ServiceClient):
    """One registry connection; every call fails at once if the registry cannot be reached, and
    each call (each chunk of a transfer) within `timeout_s`."""

    service = "model registry"
    grpc_service = "cogmentAPI.ModelRegistrySP"
    default_endpoint = DEFAULT_ENDPOINT

    def __init__(
        self,
        endpoint: GrpcEndpoint | str = DEFAULT_ENDPOINT,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        tls: ClientTls | None = None,
    ) -> None:
        """`tls`: see `shared.channel.ClientTls` (a `grpcs://` endpoint without it: the system's
        CAs)."""
        super().__init__(
            endpoint, timeout_s, tls, [("grpc.max_receive_message_length", MAX_RECEIVE_MESSAGE_BYTES)]
        )
        self.stub = model_registry_pb2_grpc.ModelRegistrySPStub(self.channel)

    # ---- models ----

    async def list_models(self) -> list[model_registry_pb2.ModelInfo]:
        models: list[model_registry_pb2.ModelInfo] = []
        handle = ""
        while True:
            reply = await self.stub.RetrieveModels(
                model_registry_pb2.RetrieveModelsRequest(models_count=PAGE_SIZE, model_handle=handle),
                timeout=self.timeout_s,
            )
            models.extend(reply.model_infos)
            # The handle is not an end marker (the reference always returns offset + count).
            if len(reply.model_infos) < PAGE_SIZE or reply.next_model_handle in ("", handle):
                return models
            handle = reply.next_model_handle

    async def has_model(self, model_id: str) -> bool:
        """Whether the model exists; any error means it does not (as in the SDK)."""
        try:
            return await self.model_exists(model_id)
        except grpc.aio.AioRpcError:
            return False

    async def model_exists(self, model_id: str) -> bool:
        """Whether the model exists: False when the registry answers NOT_FOUND; any other failure
        is raised (a registry that cannot answer is not one without the model)."""
        try:
            reply = await self.stub.RetrieveModels(
                model_registry_pb2.RetrieveModelsRequest(model_ids=[model_id]), timeout=self.timeout_s
            )
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.NOT_FOUND:
                return False
            raise
        return any(model.model_id == model_id for model in reply.model_infos)

    async def create_model(self, model_id: str, user_data: Mapping[str, str] | None = None) -> None:
        """Create the model, or replace its user data if it exists."""
        await self.stub.CreateOrUpdateModel(
            model_registry_pb2.CreateOrUpdateModelRequest(
                model_info=model_registry_pb2.ModelInfo(model_id=model_id, user_data=user_data or {})
            ),
            timeout=self.timeout_s,
        )

    async def delete_model(self, model_id: str) -> None:
        """Delete the model and all its versions; a ClientError if there is no such model."""
        try:
            await self.stub.DeleteModel(
                model_registry_pb2.DeleteModelRequest(model_id=model_id), timeout=self.timeout_s
            )
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.NOT_FOUND:
                raise ClientError(f"model [{model_id}] not found") from None
            raise

    # ---- versions' information ----

    async def list_versions(self, model_id: str) -> list[model_registry_pb2.ModelVersionInfo]:
        versions: list[model_registry_pb2.ModelVersionInfo] = []
        handle = ""
        while True:
            try:
                reply = await self.stub.RetrieveVersionInfos(
                    model_registry_pb2.RetrieveVersionInfosRequest(
                        model_id=model_id, versions_count=PAGE_SIZE, version_handle=handle
                    ),
                    timeout=self.timeout_s,
                )
            except grpc.aio.AioRpcError as error:
                if error.code() == grpc.StatusCode.NOT_FOUND:
                    raise ClientError(f"model [{model_id}] not found") from None
                raise
            versions.extend(reply.version_infos)
            if len(reply.version_infos) < PAGE_SIZE or reply.next_version_handle in ("", handle):
                return versions
            handle = reply.next_version_handle

    async def version_info(self, model_id: str, version: int = -1) -> model_registry_pb2.ModelVersionInfo:
        """The version `version` of the model: n ≥ 1, or -n for the n-th to last (-1: the latest)."""
        try:
            reply = await self.stub.RetrieveVersionInfos(
                model_registry_pb2.RetrieveVersionInfosRequest(model_id=model_id, version_numbers=[version]),
                timeout=self.timeout_s,
            )
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.NOT_FOUND:
                raise await self._version_not_found(model_id, version) from None
            raise
        if not reply.version_infos:
            raise await self._version_not_found(model_id, version)
        info: model_registry_pb2.ModelVersionInfo = reply.version_infos[0]
        return info

    async def _version_not_found(self, model_id: str, version: int) -> ClientError:
        if not await self.has_model(model_id):
            return ClientError(f"model [{model_id}] not found")
        if version == -1:
            return ClientError(f"model [{model_id}] has no version")
        return ClientError(f"version [{version}] of model [{model_id}] not found")

    async def follow_versions(self, model_id: str) -> AsyncIterator[model_registry_pb2.ModelVersionInfo]:
        """The model's latest version at once (if it has one), then each new one as it is
        published, until the caller stops iterating. Not bounded by the timeout."""
        call = self.stub.VersionUpdate(model_registry_pb2.VersionUpdateRequest(model_id=model_id))
        try:
            async for reply in call:
                yield reply.version_info
        finally:
            call.cancel()

    # ---- publishing ----

    async def publish_version(
        self,
        model_id: str,
        data: VersionData,
        *,
        archived: bool = True,
        user_data: Mapping[str, str] | None = None,
        create_model: bool = False,
        on_bytes: OnBytes = _ignore,
    ) -> model_registry_pb2.ModelVersionInfo:
        """Create the model's next version from `data`; its info, with its number. Archived
        versions are kept; others may be evicted by the registry's cache policy. `create_model`:
        create the model first if it does not exist."""
        if create_model and not await self.has_model(model_id):
            await self.create_model(model_id)
        if isinstance(data, bytes):
            return await self._publish(model_id, io.BytesIO(data), archived, user_data, on_bytes)
        if isinstance(data, (str, os.PathLike)):
            path = Path(data)
            try:
                source = await asyncio.to_thread(path.open, "rb")
            except OSError as error:
                raise ClientError(f"cannot read [{path}]: {error.strerror or error}") from None
            with source:
                return await self._publish(model_id, source, archived, user_data, on_bytes)
        seekable = await asyncio.to_thread(_seekable_copy, data)
        try:
            return await self._publish(model_id, seekable, archived, user_data, on_bytes)
        finally:
            if seekable is not data:
                seekable.close()

    async def _publish(
        self,
        model_id: str,
        source: IO[bytes],
        archived: bool,
        user_data: Mapping[str, str] | None,
        on_bytes: OnBytes,
    ) -> model_registry_pb2.ModelVersionInfo:
        start = await asyncio.to_thread(source.tell)
        size, data_hash = await asyncio.to_thread(stream_digest, source)
        await asyncio.to_thread(source.seek, start)
        header = model_registry_pb2.CreateVersionRequestChunk(
            header=model_registry_pb2.CreateVersionRequestChunk.Header(
                version_info=model_registry_pb2.ModelVersionInfo(
                    model_id=model_id,
                    archived=archived,
                    data_size=size,
                    data_hash=data_hash,
                    user_data=user_data or {},
                )
            )
        )
        try:
            reply = await self._send_version(header, source, size, data_hash, on_bytes)
        except grpc.aio.AioRpcError as error:
            code = error.code()
            details = error.details() or ""
            if code == grpc.StatusCode.NOT_FOUND or (
                code == grpc.StatusCode.INTERNAL and f'no model "{model_id}" found' in details
            ):
                raise ClientError(
                    f"model [{model_id}] not found (use --create_model, or create_model=True, to create it)"
                ) from None
            raise
        info: model_registry_pb2.ModelVersionInfo = reply.version_info
        return info

    async def _send_version(
        self,
        header: model_registry_pb2.CreateVersionRequestChunk,
        source: IO[bytes],
        size: int,
        data_hash: str,
        on_bytes: OnBytes,
    ) -> model_registry_pb2.CreateVersionReply:
        """Stream the header then `size` bytes of `source` in 2 MiB chunks; the reply."""
        call = self.stub.CreateVersion()
        try:
            try:
                await self.within_timeout(call.write(header), call)
                digest = hashlib.sha256()
                sent = 0
                while sent < size:
                    chunk = await asyncio.to_thread(source.read, min(CHUNK_SIZE, size - sent))
                    if not chunk:
                        break
                    digest.update(chunk)
                    message = model_registry_pb2.CreateVersionRequestChunk(
                        body=model_registry_pb2.CreateVersionRequestChunk.Body(data_chunk=chunk)
                    )
                    await self.within_timeout(call.write(message), call)
                    sent += len(chunk)
                    on_bytes(len(chunk))
                if sent != size or base64.b64encode(digest.digest()).decode("ascii") != data_hash:
                    raise ClientError("the data changed while it was being uploaded; no version was created")
                await self.within_timeout(call.done_writing(), call)
            except asyncio.InvalidStateError:
                pass  # the registry ended the call early: its status says why
            reply: model_registry_pb2.CreateVersionReply = await self.within_timeout(call, call)
        except BaseException:
            call.cancel()  # the source failed, or the caller gave up: no upload is left half-done
            raise
        return reply

    # ---- fetching ----

    async def retrieve_version(
        self, model_id: str, version: int = -1
    ) -> tuple[model_registry_pb2.ModelVersionInfo, bytes]:
        """A version's info and data (in memory), checked against its size and hash."""
        info = await self.version_info(model_id, version)
        sink = io.BytesIO()
        await self.receive_version(info, sink)
        return info, sink.getvalue()

    async def download_version(
        self, model_id: str, path: str | os.PathLike[str], version: int = -1, on_bytes: OnBytes = _ignore
    ) -> model_registry_pb2.ModelVersionInfo:
        """Write a version's data to the file `path`; its info. The file appears only once the
        data matched its size and hash (written beside it, then renamed)."""
        info = await self.version_info(model_id, version)
        target = Path(path)
        if await asyncio.to_thread(target.is_dir):
            raise ClientError(f"cannot write [{target}]: it is a directory")
        try:
            temporary, partial = await asyncio.to_thread(_new_file_beside, target)
        except OSError as error:
            raise ClientError(f"cannot write [{target}]: {error.strerror or error}") from None
        completed = False
        try:
            with temporary:
                await self.receive_version(info, temporary, on_bytes)
                temporary.flush()
                await asyncio.to_thread(os.fsync, temporary.fileno())
            os.replace(partial, target)
            completed = True
        except OSError as error:
            raise ClientError(f"cannot write [{target}]: {error.strerror or error}") from None
        finally:
            if not completed:
                with contextlib.suppress(OSError):
                    os.unlink(partial)
        return info

    async def receive_version(
        self, info: model_registry_pb2.ModelVersionInfo, sink: IO[bytes], on_bytes: OnBytes = _ignore
    ) -> None:
        """Write the data of the version `info` to `sink`; ClientError if its size or hash differ
        (what was written to `sink` is then to be discarded)."""
        async with contextlib.aclosing(self.version_chunks(info)) as chunks:
            async for data in chunks:
                await asyncio.to_thread(sink.write, data)
                on_bytes(len(data))

    async def version_chunks(self, info: model_registry_pb2.ModelVersionInfo) -> AsyncGenerator[bytes, None]:
        """The data of the version `info`, in the chunks the registry sends; a ClientError, after
        the last chunk, if its size or hash differ (what came is then to be discarded)."""
        what = f"version [{info.version_number}] of model [{info.model_id}]"
        call = self.stub.RetrieveVersionData(
            model_registry_pb2.RetrieveVersionDataRequest(
                model_id=info.model_id, version_number=info.version_number
            )
        )
        digest = hashlib.sha256()
        received = 0
        try:
            while True:
                chunk = await self.within_timeout(call.read(), call)
                if chunk is grpc.aio.EOF:
                    break
                assert isinstance(chunk, model_registry_pb2.RetrieveVersionDataReplyChunk)
                data = chunk.data_chunk
                received += len(data)
                if received > info.data_size:
                    raise ClientError(
                        f"the data of {what} is larger than its size [{info.data_size}]; download discarded"
                    )
                digest.update(data)
                yield data
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.NOT_FOUND:
                raise ClientError(f"{what} not found") from None
            raise
        finally:
            call.cancel()  # a failed write or a caller that gave up: stop the download (once done, a no-op)
        if received != info.data_size:
            raise ClientError(
                f"received {received} bytes of {what} instead of {info.data_size}; download discarded"
            )
        if base64.b64encode(digest.digest()).decode("ascii") != info.data_hash:
            raise ClientError(
                f"the data of {what} does not match its SHA-256: expected hex [{hash_hex(info.data_hash)}], "
                f"received hex [{digest.hexdigest()}]; download discarded"
            )


def _new_file_beside(target: Path) -> tuple[IO[bytes], Path]:
    """A new file, opened for writing, beside `target` (`.<name>.<random>.part`), with the
    permissions a new file gets there: 0666 less the umask, which `tempfile` would not give."""
    while True:
        partial = target.with_name(f".{target.name}.{secrets.token_hex(6)}.part")
        try:
            descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            continue
        return os.fdopen(descriptor, "wb"), partial
