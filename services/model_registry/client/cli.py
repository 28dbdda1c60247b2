"""`cogment-aux client model_registry <command> [flags]` (or `python -m
services.model_registry.client`): a command-line client of the Model Registry (`ModelRegistrySP`),
over `services.model_registry.client.api`.

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
`--model_registry_endpoint`), the TLS flags (`--tls_ca`, `--tls_cert`, `--tls_key`: `shared.cli`),
`--timeout` (`COGMENT_CLIENT_TIMEOUT`, seconds or a Go-style
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
import json
from collections.abc import Mapping
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, TextIO

from services.model_registry.client.api import DEFAULT_ENDPOINT, ModelRegistryClient, hash_hex
from shared.api import model_registry_pb2
from shared.cli import (
    BYTES,
    CONSOLE_OUTPUT_OPTION,
    PROGRESS_OPTION,
    STDIO,
    ClientProgram,
    Command,
    Context,
    Positional,
    binary_stream,
    endpoint_arg,
    make_progress,
    properties_arg,
    timeout_option,
    tls_of,
    to_json,
)
from shared.client import ClientError
from shared.config import Option, parse_bool

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


# ---- output ----


def iso_time(timestamp_ns: int) -> str:
    """ISO 8601 UTC time of a timestamp in nanoseconds since the Unix epoch (microsecond precision)."""
    try:
        moment = EPOCH + timedelta(microseconds=timestamp_ns // 1000)
    except OverflowError:
        return f"<invalid timestamp {timestamp_ns}>"
    return moment.isoformat().replace("+00:00", "Z")


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


async def run_upload(context: RegistryContext) -> None:
    values = context.values
    path = Path(values["file"])
    try:
        size = (await asyncio.to_thread(path.stat)).st_size
    except OSError as error:
        raise ClientError(f"cannot read [{path}]: {error.strerror or error}") from None
    progress = make_progress(f"Uploading {path.name}", size, BYTES, values, context.err)
    completed = False
    try:
        info = await context.client.publish_version(
            values["model_id"],
            path,
            archived=values["archived"],
            user_data=values["user_data"],
            create_model=values["create_model"],
            on_bytes=progress.advance,
        )
        completed = True
    finally:
        progress.close(completed)
    if context.json:
        print(json.dumps(version_json(info)), file=context.out)
    else:
        print(f"Created version [{info.version_number}] of model [{info.model_id}]", file=context.out)
        print_version(info, context.out)


async def run_download(context: RegistryContext) -> None:
    client, values = context.client, context.values
    model_id: str = values["model_id"]
    target: str = values["file"]
    info = await client.version_info(model_id, values["version"])
    label = f"Downloading version {info.version_number}"
    progress = make_progress(label, info.data_size, BYTES, values, context.err)
    completed = False
    try:
        if target == STDIO:
            sink = binary_stream(context.out, "standard output")
            try:
                await client.receive_version(info, sink, progress.advance)
            finally:
                sink.flush()
        else:
            await client.download_version(model_id, target, info.version_number, progress.advance)
        completed = True
    finally:
        progress.close(completed)
    if target == STDIO:
        return
    if context.json:
        print(json.dumps({**version_json(info), "file": target}), file=context.out)
    else:
        print(
            f"Downloaded version [{info.version_number}] of model [{info.model_id}] "
            f"({info.data_size} bytes) to [{target}]",
            file=context.out,
        )


async def run_delete_model(context: RegistryContext) -> None:
    model_id = context.values["model_id"]
    await context.client.delete_model(model_id)
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
    connect=lambda values: ModelRegistryClient(values["endpoint"], values["timeout"], tls_of(values)),
)
main = PROGRAM.main
