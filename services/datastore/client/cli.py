"""`python -m services.datastore.client <command> [flags]`: a command-line client of the Trial
Datastore (`TrialDatastoreSP`), the reference's `cogment client datastore`.

Commands:
* `list_trials` (alias `list`): a page of stored trials, in creation order: `--count` (default 10),
  `--properties name=value,...` (trials having them all), `--from HANDLE` (where a previous page
  ended: the caption of the table gives the next handle).
* `delete_trials ID...` (alias `delete`): delete trials, saying how many were stored and which ids
  were not (not an error).
* `export ID... [--file PATH] [--format cogment|parquet]`: write the samples of trials to a trial
  export file (format in `services.datastore.trial_file`); standard output without `--file` or
  with `--file -`. Trials without samples are left out; ongoing trials are cut at the samples they
  had when the export started. `--format parquet` writes a training dataset into the directory
  `--file` names instead (`services.datastore.dataset`).
* `import [--file PATH] [--prefix P] [--user_id U]`: create the trials of an export file (standard
  input without `--file` or with `--file -`) with ids prefixed by P, owned by U (default
  `cogment CLI`), and add their samples. Nothing is imported if one of these ids exists.

Fixed reference defects: `export` and `import` really use standard output / input when no file
is given, an export replaces the file instead of overwriting its start, unknown trial ids fail
the export before anything is written, and the import reader accepts short reads (pipes).

Flags shared by every command (before or after the command name):
`--endpoint` (`COGMENT_TRIAL_DATASTORE_ENDPOINT`, default `grpc://localhost:9003`), `--timeout`
(`COGMENT_CLIENT_TIMEOUT`, seconds or a Go-style duration such as `30s`, `1m30s`, `500ms`;
default 30 s) and `--console_output` (`COGMENT_CLIENT_CONSOLE_OUTPUT`, `text` or `json`).

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
from collections import OrderedDict
from collections.abc import AsyncGenerator, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO, TextIO

import grpc

try:
    from services.datastore import dataset
except ImportError:  # pyarrow: the `dataset` extra, which only `--format parquet` needs
    dataset = None  # type: ignore[assignment]
from services.datastore.trial_file import TrialFileError, TrialFileReader, TrialFileWriter, file_header
from shared.api import common_pb2, trial_datastore_pb2, trial_datastore_pb2_grpc
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
    ProgressUnit,
    ServiceClient,
    Values,
    binary_stream,
    endpoint_arg,
    make_progress,
    properties_arg,
    timeout_option,
    to_json,
)
from shared.config import Option
from shared.endpoints import GrpcEndpoint, parse_grpc_endpoint

DEFAULT_ENDPOINT = GrpcEndpoint("localhost", 9003)
DEFAULT_IMPORT_USER_ID = "cogment CLI"
TRIAL_ID_METADATA_KEY = "trial-id"
# Trial ids per RetrieveTrials call when looking trials up by id (as the reference).
TRIALS_PER_LOOKUP = 20
# Samples read from an export file per hop to the reading thread.
IMPORT_BATCH = 100
# AddSample calls an import keeps open at once (one per trial; samples of trials interleave in a
# file): past it, the least recently used one is finished, and a new one opened if needed.
MAX_OPEN_ADD_SAMPLE_CALLS = 32
# Automatic progress bars only for exports of at least this many samples.
PROGRESS_MIN_SAMPLES = 10_000
WRITE_BUFFER_BYTES = 1024 * 1024
# Stored samples can exceed gRPC's 4 MiB default (the datastore expands rewards and payloads).
MAX_RECEIVE_MESSAGE_BYTES = -1
MAX_UINT32 = 2**32 - 1
# What a Parquet export reads first of each trial: its late rewards (services.datastore.dataset).
REWARD_FIELDS = (
    trial_datastore_pb2.STORED_TRIAL_SAMPLE_FIELD_REWARD,
    trial_datastore_pb2.STORED_TRIAL_SAMPLE_FIELD_RECEIVED_REWARDS,
)
# Export formats: the reference's trial file, or a directory of Parquet files.
TRIAL_FILE_FORMAT = "cogment"
PARQUET_FORMAT = "parquet"

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


# ---- talking to the datastore ----


class DatastoreClient(ServiceClient):
    """One datastore connection; every call fails at once if the datastore cannot be reached."""

    service = "trial datastore"

    def __init__(self, endpoint: GrpcEndpoint, timeout_s: float) -> None:
        super().__init__(
            endpoint, timeout_s, [("grpc.max_receive_message_length", MAX_RECEIVE_MESSAGE_BYTES)]
        )
        self.stub = trial_datastore_pb2_grpc.TrialDatastoreSPStub(self.channel)

    async def trial_infos(self, trial_ids: Sequence[str]) -> dict[str, trial_datastore_pb2.StoredTrialInfo]:
        """The stored trials among `trial_ids`, by id."""
        infos: dict[str, trial_datastore_pb2.StoredTrialInfo] = {}
        for start in range(0, len(trial_ids), TRIALS_PER_LOOKUP):
            reply = await self.stub.RetrieveTrials(
                trial_datastore_pb2.RetrieveTrialsRequest(
                    trial_ids=trial_ids[start : start + TRIALS_PER_LOOKUP]
                ),
                timeout=self.timeout_s,
            )
            infos.update((info.trial_id, info) for info in reply.trial_infos)
        return infos


# ---- output ----


def id_list(trial_ids: Iterable[str]) -> str:
    return "[" + ", ".join(trial_ids) + "]"


def state_name(state: int) -> str:
    try:
        return common_pb2.TrialState.Name(state)  # type: ignore[arg-type]
    except ValueError:
        return str(state)


def print_trials(reply: trial_datastore_pb2.RetrieveTrialsReply, handle: str, out: TextIO) -> None:
    """The reference's table of trials, and its caption with the next handle."""
    headers = ["TRIAL ID", "USER ID", "STATE", "SAMPLES", "ACTORS", "PROPERTIES"]
    numeric = {3, 4}
    rows = [
        [
            info.trial_id,
            info.user_id,
            state_name(info.last_state),
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
    client, values = context.client, context.values
    reply = await client.stub.RetrieveTrials(
        trial_datastore_pb2.RetrieveTrialsRequest(
            trials_count=values["count"], trial_handle=values["from"], properties=values["properties"]
        ),
        timeout=client.timeout_s,
    )
    if context.json:
        print(json.dumps(to_json(reply)), file=context.out)
    else:
        print_trials(reply, values["from"], context.out)


async def run_delete_trials(context: DatastoreContext) -> None:
    client = context.client
    trial_ids = list(dict.fromkeys(context.values["trial_ids"]))
    # DeleteTrials does not say which ids it found: ask first, so that the count is of trials
    # deleted (the reference counted every id given).
    stored = await client.trial_infos(trial_ids)
    await client.stub.DeleteTrials(
        trial_datastore_pb2.DeleteTrialsRequest(trial_ids=trial_ids), timeout=client.timeout_s
    )
    deleted = [trial_id for trial_id in trial_ids if trial_id in stored]
    missing = [trial_id for trial_id in trial_ids if trial_id not in stored]
    message = f"{len(deleted)} {'trial' if len(deleted) == 1 else 'trials'} deleted"
    if missing:
        message += f"; not stored: {id_list(missing)}"
    if context.json:
        reply = {"message": message, "trial_ids": trial_ids, "deleted": deleted, "not_stored": missing}
        print(json.dumps(reply), file=context.out)
    else:
        print(message, file=context.out)


def require_dataset_extra() -> None:
    if dataset is None:
        raise ClientError(
            f"--format {PARQUET_FORMAT} needs pyarrow and numpy: pip install 'cogment-aux[dataset]' "
            "(make install has them)"
        )


async def run_export(context: DatastoreContext) -> None:
    client, values = context.client, context.values
    if values["format"] == PARQUET_FORMAT:
        require_dataset_extra()
    infos, counts = await export_selection(client, values["trial_ids"])
    progress = make_progress(
        f"Exporting {len(counts)} trials", sum(counts.values()), SAMPLES, values, context.err
    )
    target: str = values["file"]
    if values["format"] == PARQUET_FORMAT:
        await run_dataset_export(context, infos, counts, target, progress)
        return
    header = file_header({trial_id: infos[trial_id].params for trial_id in counts})
    if target in ("", STDIO):
        sink = binary_stream(context.out, "standard output")
        try:
            await export_samples(client, header, counts, TrialFileWriter(sink), progress)
            sink.flush()
        except OSError as error:
            raise ClientError(f"cannot write to standard output: {error.strerror or error}") from None
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
            samples = await export_samples(client, header, counts, writer, progress)
        completed = True
    except OSError as error:
        raise ClientError(f"cannot write [{path}]: {error.strerror or error}") from None
    finally:
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
    if target in ("", STDIO):
        raise ClientError(f"--format {PARQUET_FORMAT} writes a directory: give it with --file")
    directory = Path(target)
    try:
        samples, rows = await export_dataset(context.client, infos, counts, directory, progress)
    except OSError as error:
        raise ClientError(f"cannot write [{directory}]: {error.strerror or error}") from None
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


async def export_selection(
    client: DatastoreClient, trial_ids: Iterable[str]
) -> tuple[dict[str, trial_datastore_pb2.StoredTrialInfo], dict[str, int]]:
    """The trials to export, and how many samples of each: those they have now (samples added
    later to ongoing trials are not exported), trials without samples left out. A ClientError if
    one is unknown, or none has samples."""
    unique = list(dict.fromkeys(trial_ids))
    infos = await client.trial_infos(unique)
    missing = [trial_id for trial_id in unique if trial_id not in infos]
    if missing:
        raise ClientError(f"trials {id_list(missing)} not found")
    counts = {trial_id: infos[trial_id].samples_count for trial_id in unique if infos[trial_id].samples_count}
    if not counts:
        raise ClientError("no samples to export for selected trials")
    return infos, counts


async def download_dataset(
    endpoint: str, trial_ids: Sequence[str], directory: Path, timeout_s: float = 30.0
) -> tuple[int, int]:
    """`export --format parquet` as a library call (the training reader's source): the dataset of
    these trials, stored or live (cut where the call starts), written into `directory`;
    (samples read, step rows written). Failures raise ClientError, whose message says why, as
    the command line's would."""
    require_dataset_extra()
    try:
        address = parse_grpc_endpoint(endpoint)
    except ValueError as error:
        raise ClientError(str(error)) from None
    client = DatastoreClient(address, timeout_s)
    try:
        infos, counts = await export_selection(client, trial_ids)
        progress = Progress("", sum(counts.values()), None, SAMPLES)
        return await export_dataset(client, infos, counts, directory, progress)
    except grpc.aio.AioRpcError as error:
        raise ClientError(client.describe_rpc_error(error, "export")) from error
    finally:
        await client.close()


def remove_partial_file(path: Path) -> None:
    """Remove what a failed export wrote, unless the target is not a regular file (a pipe...)."""
    with contextlib.suppress(OSError):
        if stat.S_ISREG(path.lstat().st_mode):
            path.unlink()


async def counted_samples(
    client: DatastoreClient, counts: Mapping[str, int], fields: Sequence[int] = ()
) -> AsyncGenerator[trial_datastore_pb2.StoredTrialSample, None]:
    """The first `counts[trial]` samples of each trial, as the datastore sends them (`fields`:
    only these sample fields; none: all)."""
    remaining = dict(counts)
    request = trial_datastore_pb2.RetrieveSamplesRequest(
        trial_ids=list(counts),
        selected_sample_fields=fields,  # type: ignore[arg-type]
    )
    call = client.stub.RetrieveSamples(request)
    try:
        while remaining:
            reply = await client.within_timeout(call.read(), call)
            if reply is grpc.aio.EOF:
                return  # every trial ended, with fewer samples than the datastore counted
            assert isinstance(reply, trial_datastore_pb2.RetrieveSampleReply)
            sample = reply.trial_sample
            left = remaining.get(sample.trial_id, 0)
            if not left:
                continue
            if left == 1:
                del remaining[sample.trial_id]
            else:
                remaining[sample.trial_id] = left - 1
            yield sample
    finally:
        call.cancel()  # ongoing trials: stop following them


async def export_samples(
    client: DatastoreClient,
    header: trial_datastore_pb2.TrialSamplesFileHeader,
    counts: Mapping[str, int],
    writer: TrialFileWriter,
    progress: Progress,
) -> int:
    """Write the header, then the first `counts[trial]` samples of each trial; the number written."""
    writer.write_header(header)
    written = 0
    completed = False
    try:
        async with contextlib.aclosing(counted_samples(client, counts)) as samples:
            async for sample in samples:
                writer.write_sample(sample)
                written += 1
                progress.advance(1)
        completed = True
    finally:
        progress.close(completed)
    return written


async def export_dataset(
    client: DatastoreClient,
    infos: Mapping[str, trial_datastore_pb2.StoredTrialInfo],
    counts: Mapping[str, int],
    directory: Path,
    progress: Progress,
) -> tuple[int, int]:
    """Write the Parquet dataset of the first `counts[trial]` samples of each trial into
    `directory` (services.datastore.dataset); (samples read, step rows written). The files
    appear once complete; a failed export leaves none."""
    await asyncio.to_thread(directory.mkdir, parents=True, exist_ok=True)
    steps = await asyncio.to_thread(dataset.StepsWriter, dataset.partial(directory / dataset.STEPS_FILE))
    trials: list[dataset.TrialSteps] = []
    completed = False
    try:
        for trial_id, count in counts.items():
            trials.append(await export_trial(client, infos[trial_id], count, steps, progress))
        await asyncio.to_thread(steps.close)
        await asyncio.to_thread(
            dataset.write_trials, dataset.partial(directory / dataset.TRIALS_FILE), trials
        )
        await asyncio.to_thread(dataset.publish, directory)
        completed = True
    finally:
        progress.close(completed)
        if not completed:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(steps.close)
            for name in (dataset.STEPS_FILE, dataset.TRIALS_FILE):
                remove_partial_file(dataset.partial(directory / name))
    return sum(trial.samples for trial in trials), steps.rows


async def export_trial(
    client: DatastoreClient,
    info: trial_datastore_pb2.StoredTrialInfo,
    count: int,
    steps: dataset.StepsWriter,
    progress: Progress,
) -> dataset.TrialSteps:
    """The rows of the first `count` samples of a trial: in one pass when they fit in a row group
    (late rewards folded into the rows held), the row group being filled written first if they
    would not fit beside its rows; otherwise, or when its payloads outgrow the row group's bytes
    half-way, in two passes, rewards then samples."""
    rows = count * len(info.params.actors)  # at most: late samples make no rows
    if steps.held_rows and steps.held_rows + rows > dataset.ROW_GROUP_ROWS:
        await asyncio.to_thread(steps.flush)
    counted = 0  # samples the progress bar counted already
    if rows <= dataset.ROW_GROUP_ROWS:
        start = steps.held_rows
        trial = dataset.TrialSteps(info.trial_id, info, dataset.LateRewards())
        stepper = dataset.TrialStepper(trial, steps, rewards_read_first=False)
        async with contextlib.aclosing(counted_samples(client, {info.trial_id: count})) as samples:
            async for sample in samples:
                stepper.add(sample)
                progress.advance(1)
                if steps.full:
                    break
            else:
                stepper.finish()
                if steps.full:
                    await asyncio.to_thread(steps.flush)
                return trial
        # Its payloads outgrew the row group: write the rows of earlier trials, read it twice.
        counted = trial.samples
        steps.rollback(start)
        await asyncio.to_thread(steps.flush)

    trial = dataset.TrialSteps(info.trial_id, info, dataset.LateRewards())
    async with contextlib.aclosing(counted_samples(client, {info.trial_id: count}, REWARD_FIELDS)) as rewards:
        async for sample in rewards:
            trial.late.read(sample)
    stepper = dataset.TrialStepper(trial, steps, rewards_read_first=True)
    async with contextlib.aclosing(counted_samples(client, {info.trial_id: count})) as samples:
        async for sample in samples:
            stepper.add(sample)
            if trial.samples > counted:
                progress.advance(1)
            if steps.full:
                await asyncio.to_thread(steps.flush)
    stepper.finish()
    if steps.full:
        await asyncio.to_thread(steps.flush)
    return trial


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
        try:
            counts = await import_trials(context.client, TrialFileReader(source), values, progress)
        except OSError as error:
            raise ClientError(f"cannot read [{name}]: {error.strerror or error}") from None

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


async def import_trials(
    client: DatastoreClient, reader: TrialFileReader, values: Values, progress: Progress
) -> dict[str, int]:
    """Create the trials of the file and add their samples; samples per imported trial id."""
    try:
        header = await asyncio.to_thread(reader.read_header)
    except TrialFileError as error:
        raise ClientError(str(error)) from None
    prefix: str = values["prefix"]
    target_ids = [prefix + trial_id for trial_id in header.trial_params]
    existing = list(await client.trial_infos(target_ids))
    if existing:
        raise ClientError(f"trials {id_list(existing)} already exist in target datastore, import aborted")

    importer = TrialImporter(client, header.trial_params, prefix, values["user_id"])
    completed = False
    reported = reader.bytes_read
    progress.advance(reported)
    try:
        while True:
            try:
                samples = await asyncio.to_thread(reader.read_samples, IMPORT_BATCH)
            except TrialFileError as error:
                await importer.finish()  # what came before the error is imported
                raise ClientError(f"{error}; the samples before it were imported") from None
            if not samples:
                break
            for sample in samples:
                await importer.add(sample)
            progress.advance(reader.bytes_read - reported)
            reported = reader.bytes_read
        await importer.finish()
        completed = True
    finally:
        importer.cancel()
        progress.close(completed)
    return importer.counts


class TrialImporter:
    """Adds the samples of an export file to the datastore: creates each trial at its first
    sample, then streams its samples through an AddSample call of its own."""

    def __init__(
        self,
        client: DatastoreClient,
        params: Mapping[str, common_pb2.TrialParams],
        prefix: str,
        user_id: str,
    ) -> None:
        self._client = client
        self._params = params
        self._prefix = prefix
        self._user_id = user_id
        self.counts: dict[str, int] = {}  # imported trial id → samples added
        self._calls: OrderedDict[str, grpc.aio.StreamUnaryCall] = OrderedDict()  # least recent first

    async def add(self, sample: trial_datastore_pb2.StoredTrialSample) -> None:
        trial_id = self._prefix + sample.trial_id
        if trial_id not in self.counts:
            await self._create(sample.trial_id, trial_id)
        call = await self._call(trial_id)
        sample.ClearField("trial_id")  # the datastore sets it from the call's `trial-id`
        try:
            await self._client.within_timeout(
                call.write(trial_datastore_pb2.AddSampleRequest(trial_sample=sample)), call
            )
        except asyncio.InvalidStateError:
            # The datastore ended the call early: its status says why.
            await self._client.within_timeout(call, call)
            raise ClientError(f"the datastore stopped accepting the samples of trial [{trial_id}]") from None
        self.counts[trial_id] += 1

    async def _create(self, file_trial_id: str, trial_id: str) -> None:
        params = self._params.get(file_trial_id)
        if params is None:
            raise ClientError(
                f"read a sample of trial [{file_trial_id}], whose parameters are missing from the file"
            )
        await self._client.stub.AddTrial(
            trial_datastore_pb2.AddTrialRequest(user_id=self._user_id, trial_params=params),
            metadata=((TRIAL_ID_METADATA_KEY, trial_id),),
            timeout=self._client.timeout_s,
        )
        self.counts[trial_id] = 0

    async def _call(self, trial_id: str) -> grpc.aio.StreamUnaryCall:
        call = self._calls.get(trial_id)
        if call is not None:
            self._calls.move_to_end(trial_id)
            return call
        if len(self._calls) >= MAX_OPEN_ADD_SAMPLE_CALLS:
            _, oldest = self._calls.popitem(last=False)
            await self._finish(oldest)
        call = self._client.stub.AddSample(metadata=((TRIAL_ID_METADATA_KEY, trial_id),))
        self._calls[trial_id] = call
        return call

    async def _finish(self, call: grpc.aio.StreamUnaryCall) -> None:
        """End the call; it replies once every sample is stored."""
        with contextlib.suppress(asyncio.InvalidStateError):  # ended early: its status says why
            await self._client.within_timeout(call.done_writing(), call)
        await self._client.within_timeout(call, call)

    async def finish(self) -> None:
        while self._calls:
            _, call = self._calls.popitem(last=False)
            await self._finish(call)

    def cancel(self) -> None:
        """Abandon the calls still open (after an error)."""
        for call in self._calls.values():
            call.cancel()
        self._calls.clear()


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
    connect=lambda values: DatastoreClient(values["endpoint"], values["timeout"]),
)
main = PROGRAM.main


if __name__ == "__main__":
    sys.exit(main())
