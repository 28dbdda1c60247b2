"""The model registry command-line client, run as users run it
(`python -m services.model_registry.client`), against a small in-memory fake of `ModelRegistrySP`
served over real gRPC from a background thread."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from shared.api import model_registry_pb2 as pb
from shared.api import model_registry_pb2_grpc as pb_grpc
from tests.helpers.digest import sha256_b64
from tests.helpers.services import PROJECT_ROOT, clean_environment

CHUNK = 2 * 1024 * 1024
PAGE = 100


@dataclass
class StoredVersion:
    info: pb.ModelVersionInfo
    data: bytes


@dataclass
class FakeRegistry(pb_grpc.ModelRegistrySPServicer):  # type: ignore[misc]
    """Just enough of the reference registry's behaviour (docs/compatibility.md#model-registry)."""

    models: dict[str, pb.ModelInfo] = field(default_factory=dict)
    versions: dict[str, dict[int, StoredVersion]] = field(default_factory=dict)
    # (model id, version number) → "flip" (same size, other bytes) or "truncate".
    corrupt: dict[tuple[str, int], str] = field(default_factory=dict)
    headers: list[pb.ModelVersionInfo] = field(default_factory=list)
    chunk_sizes: list[list[int]] = field(default_factory=list)
    calls: list[tuple[str, Any]] = field(default_factory=list)

    def reset(self) -> None:
        for collection in (self.models, self.versions, self.corrupt):
            collection.clear()
        for journal in (self.headers, self.chunk_sizes, self.calls):
            journal.clear()

    def add_model(self, model_id: str, **user_data: str) -> None:
        self.models[model_id] = pb.ModelInfo(model_id=model_id, user_data=user_data)
        self.versions.setdefault(model_id, {})

    def add_version(self, model_id: str, data: bytes, archived: bool = True) -> pb.ModelVersionInfo:
        versions = self.versions[model_id]
        number = max(versions, default=0) + 1
        info = pb.ModelVersionInfo(
            model_id=model_id,
            version_number=number,
            creation_timestamp=time.time_ns(),
            archived=archived,
            data_hash=sha256_b64(data),
            data_size=len(data),
        )
        versions[number] = StoredVersion(info, data)
        return info

    async def _known(self, model_id: str, context: grpc.aio.ServicerContext) -> dict[int, StoredVersion]:
        if model_id not in self.models:
            await context.abort(grpc.StatusCode.NOT_FOUND, f'no model "{model_id}" found')
        return self.versions[model_id]

    async def _resolve(self, model_id: str, number: int, context: grpc.aio.ServicerContext) -> StoredVersion:
        versions = await self._known(model_id, context)
        if number < 0:
            number = max(versions, default=0) + number + 1
        if number not in versions:
            await context.abort(grpc.StatusCode.NOT_FOUND, f'no version "{number}" for model "{model_id}"')
        return versions[number]

    async def CreateOrUpdateModel(
        self, request: pb.CreateOrUpdateModelRequest, context: grpc.aio.ServicerContext
    ) -> pb.CreateOrUpdateModelReply:
        self.calls.append(("CreateOrUpdateModel", request))
        self.add_model(request.model_info.model_id, **dict(request.model_info.user_data))
        return pb.CreateOrUpdateModelReply()

    async def DeleteModel(
        self, request: pb.DeleteModelRequest, context: grpc.aio.ServicerContext
    ) -> pb.DeleteModelReply:
        await self._known(request.model_id, context)
        del self.models[request.model_id], self.versions[request.model_id]
        return pb.DeleteModelReply()

    async def RetrieveModels(
        self, request: pb.RetrieveModelsRequest, context: grpc.aio.ServicerContext
    ) -> pb.RetrieveModelsReply:
        self.calls.append(("RetrieveModels", request))
        offset = int(request.model_handle or "0")
        ids = list(request.model_ids) or sorted(self.models)
        for model_id in ids:
            await self._known(model_id, context)
        page = ids[offset : offset + request.models_count] if request.models_count else ids[offset:]
        return pb.RetrieveModelsReply(
            model_infos=[self.models[model_id] for model_id in page],
            next_model_handle=str(offset + len(page)),
        )

    async def CreateVersion(
        self, request_iterator: AsyncIterator[pb.CreateVersionRequestChunk], context: grpc.aio.ServicerContext
    ) -> pb.CreateVersionReply:
        header: pb.ModelVersionInfo | None = None
        sizes: list[int] = []
        data = bytearray()
        async for chunk in request_iterator:
            if header is None:
                if not chunk.HasField("header"):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "first chunk is not a header")
                header = chunk.header.version_info
                self.headers.append(header)
            else:
                if not chunk.HasField("body"):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "later chunk is not a body")
                sizes.append(len(chunk.body.data_chunk))
                data += chunk.body.data_chunk
        if header is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "empty request")
        assert header is not None
        self.chunk_sizes.append(sizes)
        if len(data) != header.data_size:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "size mismatch")
        if header.data_hash and header.data_hash != sha256_b64(bytes(data)):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "hash mismatch")
        if header.model_id not in self.models:
            await context.abort(
                grpc.StatusCode.INTERNAL,
                f'unexpected error while creating a version for model "{header.model_id}": '
                f'no model "{header.model_id}" found',
            )
        info = self.add_version(header.model_id, bytes(data), header.archived)
        info.user_data.update(header.user_data)
        return pb.CreateVersionReply(version_info=info)

    async def RetrieveVersionInfos(
        self, request: pb.RetrieveVersionInfosRequest, context: grpc.aio.ServicerContext
    ) -> pb.RetrieveVersionInfosReply:
        self.calls.append(("RetrieveVersionInfos", request))
        versions = await self._known(request.model_id, context)
        if request.version_numbers:
            infos = [
                (await self._resolve(request.model_id, n, context)).info for n in request.version_numbers
            ]
            return pb.RetrieveVersionInfosReply(
                version_infos=infos, next_version_handle=str(infos[-1].version_number + 1)
            )
        start = max(int(request.version_handle or "0"), 1)
        numbers = sorted(n for n in versions if n >= start)
        if request.versions_count:
            numbers = numbers[: request.versions_count]
        return pb.RetrieveVersionInfosReply(
            version_infos=[versions[n].info for n in numbers],
            next_version_handle=str(numbers[-1] + 1) if numbers else request.version_handle or "0",
        )

    async def Version(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "not in the fake")

    async def Status(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "not in the fake")

    async def VersionUpdate(
        self, request: Any, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.VersionUpdateReply]:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "not in the fake")
        yield pb.VersionUpdateReply()

    async def RetrieveVersionData(
        self, request: pb.RetrieveVersionDataRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.RetrieveVersionDataReplyChunk]:
        version = await self._resolve(request.model_id, request.version_number, context)
        data = version.data
        corruption = self.corrupt.get((request.model_id, version.info.version_number))
        if corruption == "flip":
            data = bytes([data[0] ^ 0xFF]) + data[1:]
        elif corruption == "truncate":
            data = data[:-1]
        if not data:
            yield pb.RetrieveVersionDataReplyChunk(data_chunk=b"")
        for start in range(0, len(data), CHUNK):
            yield pb.RetrieveVersionDataReplyChunk(data_chunk=data[start : start + CHUNK])


@dataclass
class Registry:
    fake: FakeRegistry
    port: int

    @property
    def endpoint(self) -> str:
        return f"grpc://127.0.0.1:{self.port}"

    def calls(self, name: str) -> list[Any]:
        return [request for called, request in self.fake.calls if called == name]


@pytest.fixture(scope="module")
def registry_server() -> Iterator[Registry]:
    fake = FakeRegistry()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start() -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server()
        pb_grpc.add_ModelRegistrySPServicer_to_server(fake, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    server, port = asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    try:
        yield Registry(fake, port)
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(None), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


@pytest.fixture
def registry(registry_server: Registry) -> Registry:
    registry_server.fake.reset()
    return registry_server


def run_client(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[bytes]:
    environment = clean_environment(env)
    result = subprocess.run(
        [sys.executable, "-m", "services.model_registry.client", *args],
        cwd=PROJECT_ROOT,
        env=environment,
        capture_output=True,
        timeout=30,
    )
    assert b"Traceback" not in result.stderr, result.stderr.decode()
    return result


def ok(registry: Registry, *args: str) -> str:
    result = run_client(*args, "--endpoint", registry.endpoint)
    assert result.returncode == 0, result.stderr.decode()
    return result.stdout.decode()


def fails(registry: Registry, *args: str) -> str:
    """The error message of a command that must exit with 1."""
    result = run_client(*args, "--endpoint", registry.endpoint)
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert result.stdout == b""
    return result.stderr.decode().strip()


def unique() -> str:
    return "model-" + uuid.uuid4().hex[:8]


def test_upload_download_round_trip(registry: Registry, tmp_path: Path) -> None:
    data = os.urandom(5 * 1024 * 1024 + 123)
    source = tmp_path / "model.bin"
    source.write_bytes(data)
    model = unique()

    out = ok(registry, "upload", model, str(source), "--create_model", "--user_data", "a=1, b = 2")
    assert out.splitlines()[0] == f"Created version [1] of model [{model}]"
    assert f"SHA-256 hex [{hashlib.sha256(data).hexdigest()}] base64 [{sha256_b64(data)}]" in out
    assert f"Size [{len(data)}]" in out
    assert "Archived [true]" in out
    assert "\t[a] = [1]" in out and "\t[b] = [2]" in out
    assert [request.model_ids for request in registry.calls("RetrieveModels")] == [[model]]
    assert len(registry.calls("CreateOrUpdateModel")) == 1
    header = registry.fake.headers[-1]
    assert (header.model_id, header.data_size, header.data_hash) == (model, len(data), sha256_b64(data))
    assert header.archived and dict(header.user_data) == {"a": "1", "b": "2"}
    assert registry.fake.chunk_sizes[-1] == [CHUNK, CHUNK, len(data) - 2 * CHUNK]

    # The model exists now: --create_model leaves it alone.
    second = data[::-1]
    source.write_bytes(second)
    upload = ["upload", model, str(source), "--no-archived", "--create_model", "--console_output", "json"]
    reply = json.loads(ok(registry, *upload))
    assert reply["version_number"] == 2 and reply["archived"] is False
    assert reply["data_hash"] == sha256_b64(second) and reply["data_size"] == str(len(second))
    assert len(registry.calls("CreateOrUpdateModel")) == 1

    target = tmp_path / "out" / "latest.bin"
    target.parent.mkdir()
    out = ok(registry, "download", model, str(target))
    assert out.strip() == f"Downloaded version [2] of model [{model}] ({len(second)} bytes) to [{target}]"
    assert target.read_bytes() == second
    assert target.stat().st_mode & 0o777 == 0o666 & ~current_umask()
    ok(registry, "download", model, str(target), "--version", "1")  # replaces the file
    assert target.read_bytes() == data
    reply = json.loads(ok(registry, "download", model, str(target), "--version=-1", "--console_output=json"))
    assert reply["version_number"] == 2 and reply["file"] == str(target)
    assert target.read_bytes() == second
    assert sorted(path.name for path in target.parent.iterdir()) == ["latest.bin"]

    result = run_client("download", model, "-", "--version", "-2", "--endpoint", registry.endpoint)
    assert result.returncode == 0, result.stderr
    assert result.stdout == data


def current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def test_empty_version(registry: Registry, tmp_path: Path) -> None:
    model = unique()
    registry.fake.add_model(model)
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    assert "Created version [1]" in ok(registry, "upload", model, str(empty))
    assert registry.fake.chunk_sizes[-1] == []
    assert registry.fake.headers[-1].data_hash == sha256_b64(b"")
    target = tmp_path / "copy"
    ok(registry, "download", model, str(target))
    assert target.read_bytes() == b""


@pytest.mark.parametrize("corruption", ["flip", "truncate"])
def test_corrupted_download_leaves_no_file(registry: Registry, tmp_path: Path, corruption: str) -> None:
    model = unique()
    registry.fake.add_model(model)
    registry.fake.add_version(model, os.urandom(3 * 1024 * 1024))
    registry.fake.corrupt[(model, 1)] = corruption
    target = tmp_path / "model.bin"
    message = fails(registry, "download", model, str(target))
    expected = "does not match its SHA-256: expected hex [" if corruption == "flip" else "instead of"
    assert message.startswith("Error: ") and expected in message, message
    assert "download discarded" in message
    assert list(tmp_path.iterdir()) == []


def test_progress_bar(registry: Registry, tmp_path: Path) -> None:
    model = unique()
    source = tmp_path / "model.bin"
    source.write_bytes(os.urandom(5 * 1024 * 1024))
    result = run_client(
        "upload", model, str(source), "--create_model", "--progress", "--console_output", "json",
        "--endpoint", registry.endpoint,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["version_number"] == 1
    progress = result.stderr.decode()
    assert progress.startswith("\rUploading model.bin [") and progress.endswith("\n")
    assert "100.0% 5.0/5.0 MiB" in progress.rsplit("\r", 1)[-1]

    result = run_client("download", model, "-", "--progress", "--endpoint", registry.endpoint)
    assert result.returncode == 0 and len(result.stdout) == 5 * 1024 * 1024
    assert "100.0%" in result.stderr.decode()
    # Not a terminal: no progress bar unless asked.
    result = run_client("download", model, str(tmp_path / "copy"), "--endpoint", registry.endpoint)
    assert result.returncode == 0 and result.stderr == b""


def test_list_models(registry: Registry) -> None:
    assert ok(registry, "list_models").splitlines() == ["[0] Models found"]
    ids = [f"m{number:03d}" for number in range(250)]
    for model_id in ids:
        registry.fake.add_model(model_id, owner=model_id.upper())
    registry.fake.calls.clear()

    lines = ok(registry, "models").splitlines()
    assert lines[0] == "[250] Models found"
    assert lines[1:5] == ["Model ID [m000]", "\t[owner] = [M000]", "Model ID [m001]", "\t[owner] = [M001]"]
    requests = registry.calls("RetrieveModels")
    assert [(r.models_count, r.model_handle) for r in requests] == [(PAGE, ""), (PAGE, "100"), (PAGE, "200")]

    listed = json.loads(ok(registry, "list_models", "--console_output", "json"))["models"]
    assert [model["model_id"] for model in listed] == ids
    assert listed[7]["user_data"] == {"owner": "M007"}


def test_list_versions(registry: Registry) -> None:
    model = unique()
    registry.fake.add_model(model)
    assert ok(registry, "list_versions", model).splitlines() == [f"[0] Versions of model [{model}] found"]
    first = registry.fake.add_version(model, b"first")
    first.user_data["step"] = "10"
    registry.fake.add_version(model, b"second", archived=False)

    lines = ok(registry, "versions", model).splitlines()
    assert lines[0] == f"[2] Versions of model [{model}] found"
    assert lines[1:4] == [
        "Version [1]",
        "\tArchived [true] Size [5]",
        f"\tSHA-256 hex [{hashlib.sha256(b'first').hexdigest()}] base64 [{sha256_b64(b'first')}]",
    ]
    assert lines[4].startswith("\tCreated [20") and lines[4].endswith("Z]")
    assert lines[5:7] == ["\t[step] = [10]", "Version [2]"]
    assert lines[7:9] == [
        "\tArchived [false] Size [6]",
        f"\tSHA-256 hex [{hashlib.sha256(b'second').hexdigest()}] base64 [{sha256_b64(b'second')}]",
    ]

    listed = json.loads(ok(registry, "list_versions", model, "--console_output", "json"))["versions"]
    assert [(v["version_number"], v["archived"], v["user_data"]) for v in listed] == [
        (1, True, {"step": "10"}),
        (2, False, {}),
    ]
    assert [v["data_hash_hex"] for v in listed] == [
        hashlib.sha256(d).hexdigest() for d in (b"first", b"second")
    ]
    assert listed[0]["creation_time"].endswith("Z") and listed[0]["data_size"] == "5"

    for _ in range(203):
        registry.fake.add_version(model, b"x")
    registry.fake.calls.clear()
    listed = json.loads(ok(registry, "versions", model, "--console_output", "json"))["versions"]
    assert [v["version_number"] for v in listed] == list(range(1, 206))
    requests = registry.calls("RetrieveVersionInfos")
    pages = [(request.versions_count, request.version_handle) for request in requests]
    assert pages == [(PAGE, ""), (PAGE, "101"), (PAGE, "201")]


def test_delete_and_unknown_models(registry: Registry, tmp_path: Path) -> None:
    model = unique()
    registry.fake.add_model(model)
    registry.fake.add_version(model, b"data")
    assert ok(registry, "delete_model", model).strip() == f"Model [{model}] deleted"
    assert model not in registry.fake.models
    assert fails(registry, "delete", model) == f"Error: model [{model}] not found"
    assert fails(registry, "list_versions", model) == f"Error: model [{model}] not found"
    target = tmp_path / "model.bin"
    assert fails(registry, "download", model, str(target)) == f"Error: model [{model}] not found"
    source = tmp_path / "source.bin"
    source.write_bytes(b"data")
    assert fails(registry, "upload", model, str(source)) == (
        f"Error: model [{model}] not found (use --create_model, or create_model=True, to create it)"
    )

    registry.fake.add_model(model)
    assert fails(registry, "download", model, str(target)) == f"Error: model [{model}] has no version"
    registry.fake.add_version(model, b"data")
    assert fails(registry, "download", model, str(target), "--version", "7") == (
        f"Error: version [7] of model [{model}] not found"
    )
    assert fails(registry, "download", model, str(target), "--version", "-2") == (
        f"Error: version [-2] of model [{model}] not found"
    )
    assert not target.exists()
    json_delete = json.loads(ok(registry, "delete_model", model, "--console_output", "json"))
    assert json_delete == {"model_id": model, "deleted": True}


def test_file_errors(registry: Registry, tmp_path: Path) -> None:
    model = unique()
    registry.fake.add_model(model)
    registry.fake.add_version(model, b"data")
    missing = tmp_path / "missing.bin"
    assert fails(registry, "upload", model, str(missing)) == (
        f"Error: cannot read [{missing}]: No such file or directory"
    )
    assert registry.fake.headers == []
    target = tmp_path / "nowhere" / "model.bin"
    assert fails(registry, "download", model, str(target)) == (
        f"Error: cannot write [{target}]: No such file or directory"
    )
    message = fails(registry, "download", model, str(tmp_path))
    assert message == f"Error: cannot write [{tmp_path}]: it is a directory"


@pytest.mark.parametrize(
    "args",
    [
        ["list_models"],
        ["list_versions", "m"],
        ["upload", "m", __file__],
        ["upload", "m", __file__, "--create_model"],
        ["download", "m", "-"],
        ["delete_model", "m"],
    ],
)
def test_unreachable_registry(closed_port: int, args: list[str]) -> None:
    started = time.monotonic()
    result = run_client(*args, "--endpoint", f"grpc://127.0.0.1:{closed_port}")
    assert result.returncode == 1
    assert result.stdout == b""
    message = result.stderr.decode()
    expected = f"Error: cannot reach the model registry at grpc://127.0.0.1:{closed_port}"
    assert message.startswith(expected), message
    assert time.monotonic() - started < 10


def test_endpoint_and_timeout_from_environment(registry: Registry) -> None:
    registry.fake.add_model("from-env")
    env = {
        "COGMENT_MODEL_REGISTRY_ENDPOINT": registry.endpoint,
        "COGMENT_CLIENT_TIMEOUT": "1m30s",
        "COGMENT_CLIENT_CONSOLE_OUTPUT": "JSON",
    }
    result = run_client("list_models", env=env)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"models": [{"model_id": "from-env", "user_data": {}}]}


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["nope"], {}, "invalid choice"),
        ([], {}, "required"),
        (["upload", "m"], {}, "the following arguments are required: file"),
        (["download", "m", "f", "--version", "0"], {}, "version numbers start at 1"),
        (["download", "m", "f", "--version", "latest"], {}, "invalid version"),
        (["list_versions", ""], {}, "empty model id"),
        (["upload", "m", "f", "--archived=maybe"], {}, "expected a boolean"),
        (["upload", "m", "f", "--user_data", "a=b=c"], {}, "more than one '='"),
        (["--endpoint", "http://localhost:9002", "list_models"], {}, "unexpected scheme"),
        (["list_models", "--timeout", "soon"], {}, "invalid duration"),
        (["list_models", "--console_output", "yaml"], {}, "invalid choice"),
        (["list_models"], {"COGMENT_CLIENT_CONSOLE_OUTPUT": "xml"}, "COGMENT_CLIENT_CONSOLE_OUTPUT"),
        (["models"], {"COGMENT_MODEL_REGISTRY_ENDPOINT": "localhost"}, "COGMENT_MODEL_REGISTRY_ENDPOINT"),
        (["list_models"], {"COGMENT_CLIENT_TIMEOUT": "-3s"}, "COGMENT_CLIENT_TIMEOUT"),
        (["delete_model", "m", "--version", "1"], {}, "unrecognized arguments"),
    ],
)
def test_bad_flags(args: list[str], env: dict[str, str], message: str) -> None:
    result = run_client(*args, env=env)
    assert result.returncode == 2
    assert message in result.stderr.decode(), result.stderr
    assert result.stdout == b""
