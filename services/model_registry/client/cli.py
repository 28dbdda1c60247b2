"""`python -m services.model_registry.client <command> [flags]`: a command-line client of the
Model Registry (`ModelRegistrySP`).

Commands:
* `list_models` (alias `models`): every model, with its user data.
* `list_versions MODEL_ID` (alias `versions`): every version of a model: number, archived, size,
  SHA-256 (in hex, as `sha256sum` prints it, and in base64, as the API carries it; JSON output:
  `data_hash` and `data_hash_hex`), creation time, user data.
* `upload MODEL_ID FILE`: create a version of a model from a file (`--archived` / `--no-archived`,
  default archived; `--user_data name=value,...`; `--create_model` creates the model first when it
  does not exist). The data goes in 2 MiB chunks after a header carrying its size and SHA-256.
* `download MODEL_ID FILE [--version N]`: write the data of a version (default -1, the latest;
  -n is the n-th to last) to FILE, `-` for standard output. The size and SHA-256 are checked
  against the version info before the file appears (written next to FILE, then renamed).
* `delete_model MODEL_ID` (alias `delete`): delete a model and all its versions.

Flags shared by every command (before or after the command name):
`--endpoint` (`COGMENT_MODEL_REGISTRY_ENDPOINT`, default `grpc://localhost:9002`, alias
`--model_registry_endpoint`), `--timeout` (`COGMENT_CLIENT_TIMEOUT`, seconds or a Go-style
duration such as `30s`, `1m30s`, `500ms`; default 30 s) and `--console_output`
(`COGMENT_CLIENT_CONSOLE_OUTPUT`, `text` or `json`).

The timeout bounds each call; for uploads and downloads it bounds each chunk (a transfer may
take longer as long as it progresses). Calls fail at once when the registry cannot be reached.
Uploads and downloads show a progress bar on standard error when it is a terminal and the
transfer is large, or with `--progress` (`--progress=false` never shows it).

Exit codes: 0 success; 1 failure (registry unreachable, unknown model or version, data that does
not match its hash, file errors, other gRPC errors); 2 invalid flags or environment variables.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import hashlib
import json
import os
import sys
import tempfile
from collections.abc import Mapping
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import IO, Any, TextIO

import grpc

from shared.api import model_registry_pb2, model_registry_pb2_grpc
from shared.cli import (
    BYTES,
    CONSOLE_OUTPUT_OPTION,
    PROGRESS_OPTION,
    STDIO,
    ClientError,
    ClientProgram,
    Command,
    Context,
    Positional,
    Progress,
    ServiceClient,
    binary_stream,
    endpoint_arg,
    make_progress,
    properties_arg,
    timeout_option,
    to_json,
)
from shared.config import Option, parse_bool
from shared.endpoints import GrpcEndpoint

DEFAULT_ENDPOINT = GrpcEndpoint("localhost", 9002)
CHUNK_SIZE = 2 * 1024 * 1024  # upload chunks, as the SDK sends them
PAGE_SIZE = 100  # models / versions asked per call when listing
# Received messages may be larger than gRPC's 4 MiB default (a registry configured with larger
# chunks, as the reference's stale 5 MB documentation suggests).
MAX_RECEIVE_MESSAGE_BYTES = 64 * 1024 * 1024
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)

# ---- option value parsers ----


def version_arg(text: str) -> int:
    """A version number: n ≥ 1, or -n for the n-th to last (-1 = the latest)."""
    try:
        value = int(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid version {text!r}: expected a version number, or -1 for the latest"
        ) from None
    if value == 0 or not INT32_MIN <= value <= INT32_MAX:
        raise argparse.ArgumentTypeError(
            f"invalid version {text!r}: version numbers start at 1; -1 is the latest, -2 the one before"
        )
    return value


def model_id_arg(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("empty model id")
    return text


# ---- options ----

COMMON_OPTIONS: list[Option] = [
    Option(
        "endpoint",
        "the model registry gRPC endpoint URL",
        DEFAULT_ENDPOINT,
        "COGMENT_MODEL_REGISTRY_ENDPOINT",
        endpoint_arg,
        aliases=["model_registry_endpoint"],
    ),
    timeout_option(
        "timeout of each call (of each chunk for transfers), in seconds or as a duration (30s, 1m30s, 500ms)"
    ),
    CONSOLE_OUTPUT_OPTION,
]

UPLOAD_OPTIONS: list[Option] = [
    Option("archived", "archive the version (--no-archived: cache it only)", True, parse=parse_bool),
    Option("user_data", "user data of the version, as 'name=value,name2=value2'", {}, parse=properties_arg),
    Option("create_model", "create the model first if it does not exist", False, parse=parse_bool),
    PROGRESS_OPTION,
]
DOWNLOAD_OPTIONS: list[Option] = [
    Option("version", "version number; -1 is the latest, -2 the one before...", -1, parse=version_arg),
    PROGRESS_OPTION,
]


# ---- talking to the registry ----


class ModelRegistryClient(ServiceClient):
    """One registry connection; every call fails at once if the registry cannot be reached."""

    service = "model registry"

    def __init__(self, endpoint: GrpcEndpoint, timeout_s: float) -> None:
        super().__init__(
            endpoint, timeout_s, [("grpc.max_receive_message_length", MAX_RECEIVE_MESSAGE_BYTES)]
        )
        self.stub = model_registry_pb2_grpc.ModelRegistrySPStub(self.channel)

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
            reply = await self.stub.RetrieveModels(
                model_registry_pb2.RetrieveModelsRequest(model_ids=[model_id]), timeout=self.timeout_s
            )
        except grpc.aio.AioRpcError:
            return False
        return any(model.model_id == model_id for model in reply.model_infos)

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

    async def version_info(self, model_id: str, version: int) -> model_registry_pb2.ModelVersionInfo:
        try:
            reply = await self.stub.RetrieveVersionInfos(
                model_registry_pb2.RetrieveVersionInfosRequest(model_id=model_id, version_numbers=[version]),
                timeout=self.timeout_s,
            )
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.NOT_FOUND:
                raise await self.version_not_found(model_id, version) from None
            raise
        if not reply.version_infos:
            raise await self.version_not_found(model_id, version)
        info: model_registry_pb2.ModelVersionInfo = reply.version_infos[0]
        return info

    async def version_not_found(self, model_id: str, version: int) -> ClientError:
        if not await self.has_model(model_id):
            return ClientError(f"model [{model_id}] not found")
        if version == -1:
            return ClientError(f"model [{model_id}] has no version")
        return ClientError(f"version [{version}] of model [{model_id}] not found")


# ---- output ----


def iso_time(timestamp_ns: int) -> str:
    """ISO 8601 UTC time of a timestamp in nanoseconds since the Unix epoch (microsecond precision)."""
    try:
        moment = EPOCH + timedelta(microseconds=timestamp_ns // 1000)
    except OverflowError:
        return f"<invalid timestamp {timestamp_ns}>"
    return moment.isoformat().replace("+00:00", "Z")


def hash_hex(data_hash: str) -> str:
    """A version's hash, base64 as the API carries it, in hex as `sha256sum` prints it (the
    base64 text itself when it is not that of a SHA-256)."""
    try:
        digest = base64.b64decode(data_hash, validate=True)
    except ValueError:
        return data_hash
    return digest.hex() if len(digest) == hashlib.sha256().digest_size else data_hash


def version_json(info: model_registry_pb2.ModelVersionInfo) -> dict[str, Any]:
    return {
        **to_json(info),
        "data_hash_hex": hash_hex(info.data_hash),
        "creation_time": iso_time(info.creation_timestamp),
    }


def print_user_data(user_data: Mapping[str, str], out: TextIO) -> None:
    for name, value in sorted(user_data.items()):
        print(f"\t[{name}] = [{value}]", file=out)


def print_version(info: model_registry_pb2.ModelVersionInfo, out: TextIO) -> None:
    print(f"Version [{info.version_number}]", file=out)
    print(f"\tArchived [{str(info.archived).lower()}] Size [{info.data_size}]", file=out)
    print(f"\tSHA-256 hex [{hash_hex(info.data_hash)}] base64 [{info.data_hash}]", file=out)
    print(f"\tCreated [{iso_time(info.creation_timestamp)}]", file=out)
    print_user_data(info.user_data, out)


# ---- commands ----

RegistryContext = Context[ModelRegistryClient]


async def run_list_models(context: RegistryContext) -> None:
    models = await context.client.list_models()
    if context.json:
        print(json.dumps({"models": [to_json(model) for model in models]}), file=context.out)
        return
    print(f"[{len(models)}] Models found", file=context.out)
    for model in models:
        print(f"Model ID [{model.model_id}]", file=context.out)
        print_user_data(model.user_data, context.out)


async def run_list_versions(context: RegistryContext) -> None:
    model_id = context.values["model_id"]
    versions = await context.client.list_versions(model_id)
    if context.json:
        print(json.dumps({"versions": [version_json(version) for version in versions]}), file=context.out)
        return
    print(f"[{len(versions)}] Versions of model [{model_id}] found", file=context.out)
    for version in versions:
        print_version(version, context.out)


def file_digest(path: Path) -> tuple[int, str]:
    """Size and SHA-256 (base64 standard, padded) of a file."""
    digest = hashlib.sha256()
    size = 0
    with path.open("rb") as source:
        while chunk := source.read(CHUNK_SIZE):
            digest.update(chunk)
            size += len(chunk)
    return size, base64.b64encode(digest.digest()).decode("ascii")


async def run_upload(context: RegistryContext) -> None:
    client, values = context.client, context.values
    model_id: str = values["model_id"]
    path = Path(values["file"])
    try:
        size, data_hash = await asyncio.to_thread(file_digest, path)
        source = await asyncio.to_thread(path.open, "rb")
    except OSError as error:
        raise ClientError(f"cannot read [{path}]: {error.strerror or error}") from None

    with source:
        if values["create_model"] and not await client.has_model(model_id):
            await client.stub.CreateOrUpdateModel(
                model_registry_pb2.CreateOrUpdateModelRequest(
                    model_info=model_registry_pb2.ModelInfo(model_id=model_id)
                ),
                timeout=client.timeout_s,
            )
        header = model_registry_pb2.CreateVersionRequestChunk(
            header=model_registry_pb2.CreateVersionRequestChunk.Header(
                version_info=model_registry_pb2.ModelVersionInfo(
                    model_id=model_id,
                    archived=values["archived"],
                    data_size=size,
                    data_hash=data_hash,
                    user_data=values["user_data"],
                )
            )
        )
        progress = make_progress(f"Uploading {path.name}", size, BYTES, values, context.err)
        completed = False
        try:
            reply = await send_version(client, model_id, header, source, size, data_hash, progress)
            completed = True
        finally:
            progress.close(completed)

    info = reply.version_info
    if context.json:
        print(json.dumps(version_json(info)), file=context.out)
    else:
        print(f"Created version [{info.version_number}] of model [{info.model_id}]", file=context.out)
        print_version(info, context.out)


async def send_version(
    client: ModelRegistryClient,
    model_id: str,
    header: model_registry_pb2.CreateVersionRequestChunk,
    source: IO[bytes],
    size: int,
    data_hash: str,
    progress: Progress,
) -> model_registry_pb2.CreateVersionReply:
    """Stream the header then `size` bytes of `source` in 2 MiB chunks; the reply."""
    call = client.stub.CreateVersion()
    try:
        try:
            await client.within_timeout(call.write(header), call)
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
                await client.within_timeout(call.write(message), call)
                sent += len(chunk)
                progress.advance(len(chunk))
            if sent != size or base64.b64encode(digest.digest()).decode("ascii") != data_hash:
                call.cancel()
                raise ClientError("the file changed while it was being uploaded; no version was created")
            await client.within_timeout(call.done_writing(), call)
        except asyncio.InvalidStateError:
            pass  # the registry ended the call early: its status says why
        reply: model_registry_pb2.CreateVersionReply = await client.within_timeout(call, call)
        return reply
    except grpc.aio.AioRpcError as error:
        code = error.code()
        details = error.details() or ""
        if code == grpc.StatusCode.NOT_FOUND or (
            code == grpc.StatusCode.INTERNAL and f'no model "{model_id}" found' in details
        ):
            raise ClientError(f"model [{model_id}] not found (use --create_model to create it)") from None
        raise


async def run_download(context: RegistryContext) -> None:
    client, values = context.client, context.values
    model_id: str = values["model_id"]
    info = await client.version_info(model_id, values["version"])
    target: str = values["file"]
    label = f"Downloading version {info.version_number}"
    if target == STDIO:
        sink = binary_stream(context.out, "standard output")
        progress = make_progress(label, info.data_size, BYTES, values, context.err)
        completed = False
        try:
            await receive_version(client, info, sink, progress)
            completed = True
        finally:
            progress.close(completed)
            sink.flush()
        return

    path = Path(target)
    if await asyncio.to_thread(path.is_dir):
        raise ClientError(f"cannot write [{path}]: it is a directory")
    try:
        temporary = tempfile.NamedTemporaryFile(  # noqa: SIM115 (closed below, renamed on success)
            mode="wb", dir=path.parent, prefix=f".{path.name}.", suffix=".part", delete=False
        )
    except OSError as error:
        raise ClientError(f"cannot write [{path}]: {error.strerror or error}") from None
    # The temporary file is private (0600): give the target the usual permissions.
    with contextlib.suppress(OSError):
        os.chmod(temporary.fileno(), 0o666 & ~current_umask())
    progress = make_progress(label, info.data_size, BYTES, values, context.err)
    completed = False
    try:
        with temporary:
            await receive_version(client, info, temporary, progress)
            temporary.flush()
            os.fsync(temporary.fileno())
        os.replace(temporary.name, path)
        completed = True
    except OSError as error:
        raise ClientError(f"cannot write [{path}]: {error.strerror or error}") from None
    finally:
        progress.close(completed)
        if not completed:
            with contextlib.suppress(OSError):
                os.unlink(temporary.name)

    if context.json:
        print(json.dumps({**version_json(info), "file": str(path)}), file=context.out)
    else:
        print(
            f"Downloaded version [{info.version_number}] of model [{info.model_id}] "
            f"({info.data_size} bytes) to [{path}]",
            file=context.out,
        )


def current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


async def receive_version(
    client: ModelRegistryClient,
    info: model_registry_pb2.ModelVersionInfo,
    sink: IO[bytes],
    progress: Progress,
) -> None:
    """Write the data of the version `info` to `sink`; ClientError if its size or hash differ."""
    what = f"version [{info.version_number}] of model [{info.model_id}]"
    call = client.stub.RetrieveVersionData(
        model_registry_pb2.RetrieveVersionDataRequest(
            model_id=info.model_id, version_number=info.version_number
        )
    )
    digest = hashlib.sha256()
    received = 0
    try:
        while True:
            chunk = await client.within_timeout(call.read(), call)
            if chunk is grpc.aio.EOF:
                break
            assert isinstance(chunk, model_registry_pb2.RetrieveVersionDataReplyChunk)
            data = chunk.data_chunk
            received += len(data)
            if received > info.data_size:
                call.cancel()
                raise ClientError(
                    f"the data of {what} is larger than its size [{info.data_size}]; download discarded"
                )
            digest.update(data)
            await asyncio.to_thread(sink.write, data)
            progress.advance(len(data))
    except grpc.aio.AioRpcError as error:
        if error.code() == grpc.StatusCode.NOT_FOUND:
            raise ClientError(f"{what} not found") from None
        raise
    if received != info.data_size:
        raise ClientError(
            f"received {received} bytes of {what} instead of {info.data_size}; download discarded"
        )
    if base64.b64encode(digest.digest()).decode("ascii") != info.data_hash:
        raise ClientError(
            f"the data of {what} does not match its SHA-256: expected hex [{hash_hex(info.data_hash)}], "
            f"received hex [{digest.hexdigest()}]; download discarded"
        )


async def run_delete_model(context: RegistryContext) -> None:
    model_id = context.values["model_id"]
    try:
        await context.client.stub.DeleteModel(
            model_registry_pb2.DeleteModelRequest(model_id=model_id), timeout=context.client.timeout_s
        )
    except grpc.aio.AioRpcError as error:
        if error.code() == grpc.StatusCode.NOT_FOUND:
            raise ClientError(f"model [{model_id}] not found") from None
        raise
    if context.json:
        print(json.dumps({"model_id": model_id, "deleted": True}), file=context.out)
    else:
        print(f"Model [{model_id}] deleted", file=context.out)


def add_no_archived(parser: argparse.ArgumentParser) -> None:
    """`--no-archived`, the negation of `--archived` (which defaults to true)."""
    parser.add_argument(
        "--no-archived",
        "--no_archived",
        dest="archived",
        action="store_false",
        default=argparse.SUPPRESS,
        help="keep the version in the registry's cache only (not archived)",
    )


MODEL_ID = Positional("model_id", "id of the model", model_id_arg)
PROGRAM = ClientProgram(
    prog="python -m services.model_registry.client",
    description="Cogment Model Registry command-line client.",
    options=COMMON_OPTIONS,
    commands=[
        Command("list_models", "list the models and their user data", run_list_models, aliases=("models",)),
        Command(
            "list_versions",
            "list the versions of a model",
            run_list_versions,
            positionals=[MODEL_ID],
            aliases=("versions",),
        ),
        Command(
            "upload",
            "create a version of a model from a file",
            run_upload,
            UPLOAD_OPTIONS,
            [MODEL_ID, Positional("file", "file holding the data of the version")],
            add_arguments=add_no_archived,
        ),
        Command(
            "download",
            "write the data of a version of a model to a file",
            run_download,
            DOWNLOAD_OPTIONS,
            [MODEL_ID, Positional("file", f"file to write ('{STDIO}': standard output)")],
        ),
        Command(
            "delete_model",
            "delete a model and all its versions",
            run_delete_model,
            positionals=[MODEL_ID],
            aliases=("delete",),
        ),
    ],
    connect=lambda values: ModelRegistryClient(values["endpoint"], values["timeout"]),
)
main = PROGRAM.main


if __name__ == "__main__":
    sys.exit(main())
