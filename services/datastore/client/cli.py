"""`cogment-aux client trial_datastore <command> [flags]` (or `python -m
services.datastore.client`): a command-line client of the Trial Datastore (`TrialDatastoreSP`), the
reference's `cogment client datastore`, over `services.datastore.client.api` and `.transfer`.

Commands:
* `list_trials` (alias `list`): a page of stored trials, in creation order: `--count` (default 10),
  `--properties name=value,...` (trials having them all), `--from HANDLE` (where a previous page
  ended: the caption of the table gives the next handle). A trial whose ingestion stopped before
  it ended shows as INTERRUPTED (JSON: `"interrupted": true`), which the Cogment wire cannot say:
  the datastore's own TrialStatusSP tells; against one without it (the reference's), the state is
  the wire's.
* `delete_trials ID...` (alias `delete`): delete trials, saying how many were stored and which ids
  were not (not an error).
* `export ID... [--file PATH] [--format cogment|parquet]`: write the samples of trials to a trial
  export file (format in `services.datastore.client.trial_file`); standard output without `--file` or
  with `--file -` (refused when standard output is a terminal: the export is binary). Trials
  without samples are left out; ongoing trials are cut at the samples they had when the export
  started. `--format parquet` writes a training dataset into the directory
  `--file` names instead (`services.datastore.client.dataset`).
* `import [--file PATH] [--prefix P] [--user_id U]`: create the trials of an export file (standard
  input without `--file` or with `--file -`) with ids prefixed by P, owned by U (default
  `cogment CLI`), and add their samples. Nothing is imported if one of these ids exists. An import
  that fails part-way deletes the trials it created (or says which are left, and how to delete
  them).

Fixed reference defects: `export` and `import` really use standard output / input when no file
is given, an export replaces the file instead of overwriting its start, unknown trial ids fail
the export before anything is written, and the import reader accepts short reads (pipes).

Flags shared by every command (before or after the command name):
`--endpoint` (`COGMENT_TRIAL_DATASTORE_ENDPOINT`, default `grpc://localhost:9003`), `--timeout`
(`COGMENT_CLIENT_TIMEOUT`, seconds or a Go-style duration such as `30s`, `1m30s`, `500ms`;
default 30 s), `--console_output` (`COGMENT_CLIENT_CONSOLE_OUTPUT`, `text` or `json`) and the TLS
flags (`--tls_ca`, `--tls_cert`, `--tls_key`: `shared.cli`).

The timeout bounds each call; for exports and imports it bounds each sample (a transfer may take
longer as long as it progresses). Calls fail at once when the datastore cannot be reached.
Exports and imports show a progress bar on standard error when it is a terminal and the transfer
is large, or with `--progress` (`--progress=false` never shows it); an import from a pipe has no
known size, hence no progress bar.

Exit codes: 0 success; 1 failure (datastore unreachable, unknown trials, existing trials on
import, malformed export file, file errors, other gRPC errors); 2 invalid flags or environment
variables.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import stat
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO, TextIO

from services.datastore.client.api import DEFAULT_ENDPOINT, DatastoreClient, id_list, state_name
from services.datastore.client.transfer import (
    DEFAULT_IMPORT_USER_ID,
    export_dataset,
    export_samples,
    file_header_of,
    import_trials,
    remove_partial_file,
    require_dataset_extra,
)
from services.datastore.client.trial_file import TrialFileReader, TrialFileWriter
from shared.api import trial_datastore_pb2
from shared.cli import (
    BYTES,
    CONSOLE_OUTPUT_OPTION,
    PROGRESS_OPTION,
    STDIO,
    ClientProgram,
    Command,
    Context,
    Positional,
    Progress,
    ProgressUnit,
    binary_stream,
    endpoint_arg,
    make_progress,
    properties_arg,
    timeout_option,
    tls_of,
    to_json,
)
from shared.client import ClientError
from shared.config import Option

# Automatic progress bars only for exports of at least this many samples.
PROGRESS_MIN_SAMPLES = 10_000
WRITE_BUFFER_BYTES = 1024 * 1024
MAX_UINT32 = 2**32 - 1
# Export formats: the reference's trial file, or a directory of Parquet files.
TRIAL_FILE_FORMAT = "cogment"
PARQUET_FORMAT = "parquet"
# What the trials table shows for a trial that will not end (not a `cogmentAPI.TrialState`).
INTERRUPTED = "INTERRUPTED"

# ---- option value parsers ----


def count_arg(text: str) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        value = 0
    if not 0 < value <= MAX_UINT32:
        raise argparse.ArgumentTypeError(f"invalid count {text!r}: expected a strictly positive number")
    return value


# ---- options ----

COMMON_OPTIONS: list[Option] = [
    Option(
        "endpoint",
        "the trial datastore gRPC endpoint URL",
        DEFAULT_ENDPOINT,
        "COGMENT_TRIAL_DATASTORE_ENDPOINT",
        endpoint_arg,
    ),
    timeout_option(
        "timeout of each call (of each sample for exports and imports), in seconds or as a duration "
        "(30s, 1m30s, 500ms)"
    ),
    CONSOLE_OUTPUT_OPTION,
]

LIST_OPTIONS: list[Option] = [
    Option("count", "maximum number of trials to retrieve", 10, parse=count_arg),
    Option("properties", "trial properties the trials must have, as 'name=value,name2=value2'", {},
           parse=properties_arg),
    Option("from", "handle of the first trial to retrieve (the next trial handle of a previous list)", ""),
]  # fmt: skip
EXPORT_OPTIONS: list[Option] = [
    Option(
        "file",
        f"file to write (default or '{STDIO}': standard output); with --format {PARQUET_FORMAT}, "
        "the directory to write the dataset's files into (created if need be)",
        "",
    ),
    Option(
        "format",
        f"'{TRIAL_FILE_FORMAT}': the reference's trial export file; '{PARQUET_FORMAT}': a training "
        "dataset, steps.parquet and trials.parquet (README: Trials as training data)",
        TRIAL_FILE_FORMAT,
        parse=str.lower,
        choices=[TRIAL_FILE_FORMAT, PARQUET_FORMAT],
    ),
    PROGRESS_OPTION,
]
IMPORT_OPTIONS: list[Option] = [
    Option("file", f"export file to read (default or '{STDIO}': standard input)", ""),
    Option("prefix", "prefix added to the ids of the imported trials", ""),
    Option("user_id", "user id of the imported trials", DEFAULT_IMPORT_USER_ID),
    PROGRESS_OPTION,
]


# ---- progress bar ----

SAMPLES = ProgressUnit(lambda done, total, rate: f"{done}/{total} samples {rate:.0f}/s", PROGRESS_MIN_SAMPLES)


# ---- output ----


def print_trials(
    reply: trial_datastore_pb2.RetrieveTrialsReply, interrupted: set[str], handle: str, out: TextIO
) -> None:
    """The reference's table of trials, and its caption with the next handle; the `interrupted`
    ones' state is INTERRUPTED."""
    headers = ["TRIAL ID", "USER ID", "STATE", "SAMPLES", "ACTORS", "PROPERTIES"]
    numeric = {3, 4}
    rows = [
        [
            info.trial_id,
            info.user_id,
            INTERRUPTED if info.trial_id in interrupted else state_name(info.last_state),
            str(info.samples_count),
            str(len(info.params.actors)),
            ",".join(f"{name}={value}" for name, value in sorted(info.params.properties.items())),
        ]
        for info in reply.trial_infos
    ]
    widths = [max(len(cell) for cell in column) for column in zip(headers, *rows, strict=True)]
    for row in [headers, *rows]:
        cells = [
            cell.rjust(width) if index in numeric and row is not headers else cell.ljust(width)
            for index, (cell, width) in enumerate(zip(row, widths, strict=True))
        ]
        print("  ".join(cells).rstrip(), file=out)
    origin = f" from <{handle}>" if handle else ""
    print(
        f"{len(rows)} trials retrieved{origin}, next trial handle is <{reply.next_trial_handle}>",
        file=out,
    )


# ---- commands ----

DatastoreContext = Context[DatastoreClient]


async def run_list_trials(context: DatastoreContext) -> None:
    values = context.values
    reply = await context.client.list_trials(values["count"], values["from"], values["properties"])
    interrupted = await context.client.interrupted_trials([info.trial_id for info in reply.trial_infos])
    if context.json:
        output = to_json(reply)
        for info in output["trial_infos"]:
            info["interrupted"] = info["trial_id"] in interrupted
        print(json.dumps(output), file=context.out)
    else:
        print_trials(reply, interrupted, values["from"], context.out)


async def run_delete_trials(context: DatastoreContext) -> None:
    trial_ids = list(dict.fromkeys(context.values["trial_ids"]))
    # The count is of trials deleted (the reference counted every id given).
    deleted = await context.client.delete_trials(trial_ids)
    missing = [trial_id for trial_id in trial_ids if trial_id not in deleted]
    message = f"{len(deleted)} {'trial' if len(deleted) == 1 else 'trials'} deleted"
    if missing:
        message += f"; not stored: {id_list(missing)}"
    if context.json:
        reply = {"message": message, "trial_ids": trial_ids, "deleted": deleted, "not_stored": missing}
        print(json.dumps(reply), file=context.out)
    else:
        print(message, file=context.out)


async def run_export(context: DatastoreContext) -> None:
    client, values = context.client, context.values
    if values["format"] == PARQUET_FORMAT:
        require_dataset_extra()
        if values["file"] in ("", STDIO):
            raise ClientError(f"--format {PARQUET_FORMAT} writes a directory: give it with --file")
    elif values["file"] in ("", STDIO) and context.out.isatty():
        # Bytes that would garble the terminal, and that nobody can use there.
        raise ClientError("the export is binary: give --file PATH, or redirect standard output")
    infos, counts = await client.sample_counts(values["trial_ids"])
    progress = make_progress(
        f"Exporting {len(counts)} trials", sum(counts.values()), SAMPLES, values, context.err
    )
    target: str = values["file"]
    if values["format"] == PARQUET_FORMAT:
        await run_dataset_export(context, infos, counts, target, progress)
        return
    header = file_header_of(infos, counts)
    if target in ("", STDIO):
        sink = binary_stream(context.out, "standard output")
        completed = False
        try:
            await export_samples(client, header, counts, TrialFileWriter(sink), progress.advance)
            sink.flush()
            completed = True
        except OSError as error:
            raise ClientError(f"cannot write to standard output: {error.strerror or error}") from None
        finally:
            progress.close(completed)
        return

    path = Path(target)
    try:
        file = await asyncio.to_thread(path.open, "wb", WRITE_BUFFER_BYTES)
    except OSError as error:
        raise ClientError(f"cannot write [{path}]: {error.strerror or error}") from None
    writer = TrialFileWriter(file)
    completed = False
    try:
        with file:
            samples = await export_samples(client, header, counts, writer, progress.advance)
        completed = True
    except OSError as error:
        raise ClientError(f"cannot write [{path}]: {error.strerror or error}") from None
    finally:
        progress.close(completed)
        if not completed:
            remove_partial_file(path)

    message = (
        f'{len(counts)} trials exported to "{path}" ({samples} samples, {writer.bytes_written} bytes written)'
    )
    if context.json:
        output = {
            "bytes": writer.bytes_written,
            "message": message,
            "trial_ids": list(counts),
            "filepath": str(path),
            "samples_count": samples,
        }
        print(json.dumps(output), file=context.out)
    else:
        print(message, file=context.out)


async def run_dataset_export(
    context: DatastoreContext,
    infos: Mapping[str, trial_datastore_pb2.StoredTrialInfo],
    counts: Mapping[str, int],
    target: str,
    progress: Progress,
) -> None:
    directory = Path(target)
    completed = False
    try:
        samples, rows = await export_dataset(context.client, infos, counts, directory, progress.advance)
        completed = True
    except OSError as error:
        raise ClientError(f"cannot write [{directory}]: {error.strerror or error}") from None
    finally:
        progress.close(completed)
    message = f'{len(counts)} trials exported to "{directory}" ({samples} samples, {rows} step rows)'
    if context.json:
        output = {
            "message": message,
            "trial_ids": list(counts),
            "directory": str(directory),
            "samples_count": samples,
            "step_rows": rows,
        }
        print(json.dumps(output), file=context.out)
    else:
        print(message, file=context.out)


async def run_import(context: DatastoreContext) -> None:
    values = context.values
    target: str = values["file"]
    if target in ("", STDIO):
        source: BinaryIO = binary_stream(sys.stdin, "standard input")
        name = "stdin"
        closing: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    else:
        path = Path(target)
        try:
            source = await asyncio.to_thread(path.open, "rb")
        except OSError as error:
            raise ClientError(f"cannot read [{path}]: {error.strerror or error}") from None
        name = str(path)
        closing = source

    with closing:
        size = input_size(source)
        # No bar when the size is unknown (a pipe): there would be no total to show.
        progress = (
            make_progress("Importing", size, BYTES, values, context.err)
            if size
            else Progress("", 0, None, BYTES)
        )
        completed = False
        try:
            counts = await import_trials(
                context.client,
                TrialFileReader(source),
                values["prefix"],
                values["user_id"],
                progress.advance,
                source=name,
            )
            completed = True
        except OSError as error:
            raise ClientError(f"cannot read [{name}]: {error.strerror or error}") from None
        except asyncio.CancelledError as interrupted:
            progress.close(completed)
            print(f"Interrupted: {interrupted}" if interrupted.args else "Interrupted", file=context.err)
            raise
        finally:
            progress.close(completed)

    samples = sum(counts.values())
    message = f'{len(counts)} trials imported ({samples} samples) from "{name}"'
    if context.json:
        output = {
            "message": message,
            "samples_count": samples,
            "trials": [{"trial_id": trial_id, "samples_count": count} for trial_id, count in counts.items()],
            "filepath": name,
        }
        print(json.dumps(output), file=context.out)
    else:
        print(message, file=context.out)


def input_size(source: BinaryIO) -> int:
    """Bytes left to read in `source` if it is a regular file, else 0."""
    try:
        status = os.fstat(source.fileno())
        return max(status.st_size - source.tell(), 0) if stat.S_ISREG(status.st_mode) else 0
    except (OSError, ValueError):
        return 0


TRIAL_IDS = Positional("trial_ids", "ids of the trials", nargs="+", metavar="TRIAL_ID")
PROGRAM = ClientProgram(
    prog="python -m services.datastore.client",
    description="Cogment Trial Datastore command-line client.",
    options=COMMON_OPTIONS,
    commands=[
        Command("list_trials", "list the stored trials", run_list_trials, LIST_OPTIONS, aliases=("list",)),
        Command(
            "delete_trials",
            "delete stored trials",
            run_delete_trials,
            positionals=[TRIAL_IDS],
            aliases=("delete",),
        ),
        Command("export", "export the samples of trials to a file", run_export, EXPORT_OPTIONS, [TRIAL_IDS]),
        Command("import", "import the trials and samples of an export file", run_import, IMPORT_OPTIONS),
    ],
    connect=lambda values: DatastoreClient(values["endpoint"], values["timeout"], tls_of(values)),
)
main = PROGRAM.main
