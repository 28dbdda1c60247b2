"""Trials in and out of a datastore: exported to the reference's trial file
(`trial_file`) or to a Parquet training dataset (`dataset`), and imported from a trial file. The
command line's `export` and `import`, as a library; progress is told to callbacks (the bytes or
samples done since the last call).

    async with DatastoreClient("grpc://localhost:9003") as datastore:
        infos, counts = await datastore.sample_counts(["trial-1"])
        with open("trials.bin", "wb") as file:
            await export_samples(datastore, file_header_of(infos, counts), counts, TrialFileWriter(file))
        await export_dataset(datastore, infos, counts, Path("dataset"))  # pyarrow: the dataset extra
        with open("trials.bin", "rb") as file:
            imported = await import_trials(datastore, TrialFileReader(file), prefix="copy-")
"""

from __future__ import annotations

import asyncio
import contextlib
import shlex
import stat
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import grpc

try:
    from services.datastore.client import dataset
except ImportError:  # pyarrow: the `dataset` extra, which only Parquet exports need
    dataset = None  # type: ignore[assignment]
from services.datastore.client.api import DEFAULT_ENDPOINT, TRIAL_ID_METADATA_KEY, DatastoreClient, id_list
from services.datastore.client.trial_file import TrialFileError, TrialFileReader, TrialFileWriter, file_header
from shared.api import common_pb2, trial_datastore_pb2
from shared.channel import ClientTls
from shared.cli import tls_flags
from shared.client import DEFAULT_TIMEOUT_S, ClientError

DEFAULT_IMPORT_USER_ID = "cogment CLI"
# Samples read from an export file per hop to the reading thread.
IMPORT_BATCH = 100
# AddSample calls an import keeps open at once (one per trial; samples of trials interleave in a
# file): past it, the least recently used one is finished, and a new one opened if needed.
MAX_OPEN_ADD_SAMPLE_CALLS = 32
# Trials a failed import deletes per DeleteTrials call (the datastore takes 10,000).
DELETE_BATCH = 1000
# The command line that deletes trials (what a failed import that could not clean up suggests).
DELETE_COMMAND = ("cogment-aux", "client", "trial_datastore", "delete_trials")
# What a Parquet export reads first of each trial: its late rewards (`dataset`).
REWARD_FIELDS = (
    trial_datastore_pb2.STORED_TRIAL_SAMPLE_FIELD_REWARD,
    trial_datastore_pb2.STORED_TRIAL_SAMPLE_FIELD_RECEIVED_REWARDS,
)
# AddTrial failures after which the trial may exist all the same: the answer, not the call, was lost.
_ANSWER_MAY_BE_LOST = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.UNKNOWN,
    }
)
# Told how many more samples (or bytes) are done.
OnProgress = Callable[[int], None]


def _ignore(_count: int) -> None:
    pass


def file_header_of(
    infos: Mapping[str, trial_datastore_pb2.StoredTrialInfo], counts: Mapping[str, int]
) -> trial_datastore_pb2.TrialSamplesFileHeader:
    """The trial file's header of the trials `counts` exports."""
    return file_header({trial_id: infos[trial_id].params for trial_id in counts})


def require_dataset_extra() -> None:
    if dataset is None:
        raise ClientError(
            "Parquet exports (--format parquet) need pyarrow and numpy: pip install "
            "'cogment-aux[dataset]' (from a checkout: pip install -e '.[dataset]', or make install)"
        )


def remove_partial_file(path: Path) -> None:
    """Remove what a failed export wrote, unless the target is not a regular file (a pipe...)."""
    with contextlib.suppress(OSError):
        if stat.S_ISREG(path.lstat().st_mode):
            path.unlink()


async def export_samples(
    client: DatastoreClient,
    header: trial_datastore_pb2.TrialSamplesFileHeader,
    counts: Mapping[str, int],
    writer: TrialFileWriter,
    on_sample: OnProgress = _ignore,
) -> int:
    """Write the header, then the first `counts[trial]` samples of each trial; the number written."""
    writer.write_header(header)
    written = 0
    async with contextlib.aclosing(client.samples(counts)) as samples:
        async for sample in samples:
            writer.write_sample(sample)
            written += 1
            on_sample(1)
    return written


async def export_dataset(
    client: DatastoreClient,
    infos: Mapping[str, trial_datastore_pb2.StoredTrialInfo],
    counts: Mapping[str, int],
    directory: Path,
    on_sample: OnProgress = _ignore,
) -> tuple[int, int]:
    """Write the Parquet dataset of the first `counts[trial]` samples of each trial into
    `directory` (services.datastore.client.dataset); (samples read, step rows written). The files
    appear once complete; a failed export leaves none."""
    interrupted = await client.interrupted_trials(list(counts))
    await asyncio.to_thread(directory.mkdir, parents=True, exist_ok=True)
    steps = await asyncio.to_thread(dataset.StepsWriter, dataset.partial(directory / dataset.STEPS_FILE))
    trials: list[dataset.TrialSteps] = []
    completed = False
    try:
        for trial_id, count in counts.items():
            trials.append(
                await export_trial(client, infos[trial_id], count, steps, on_sample, trial_id in interrupted)
            )
        await asyncio.to_thread(steps.close)
        await asyncio.to_thread(
            dataset.write_trials, dataset.partial(directory / dataset.TRIALS_FILE), trials
        )
        await asyncio.to_thread(dataset.publish, directory)
        completed = True
    finally:
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
    on_sample: OnProgress,
    interrupted: bool = False,
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
        trial = dataset.TrialSteps(info.trial_id, info, dataset.LateRewards(), interrupted)
        stepper = dataset.TrialStepper(trial, steps, rewards_read_first=False)
        async with contextlib.aclosing(client.samples({info.trial_id: count})) as samples:
            async for sample in samples:
                stepper.add(sample)
                on_sample(1)
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

    trial = dataset.TrialSteps(info.trial_id, info, dataset.LateRewards(), interrupted)
    async with contextlib.aclosing(client.samples({info.trial_id: count}, REWARD_FIELDS)) as rewards:
        async for sample in rewards:
            trial.late.read(sample)
    stepper = dataset.TrialStepper(trial, steps, rewards_read_first=True)
    async with contextlib.aclosing(client.samples({info.trial_id: count})) as samples:
        async for sample in samples:
            stepper.add(sample)
            if trial.samples > counted:
                on_sample(1)
            if steps.full:
                await asyncio.to_thread(steps.flush)
    stepper.finish()
    if steps.full:
        await asyncio.to_thread(steps.flush)
    return trial


async def download_dataset(
    endpoint: str,
    trial_ids: Sequence[str],
    directory: Path,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    tls: ClientTls | None = None,
) -> tuple[int, int]:
    """`export --format parquet` as a library call (the training reader's source): the dataset of
    these trials, stored or live (cut where the call starts), written into `directory`;
    (samples read, step rows written). Failures raise ClientError, whose message says why, as
    the command line's would."""
    require_dataset_extra()
    async with DatastoreClient(endpoint, timeout_s, tls) as client:
        try:
            infos, counts = await client.sample_counts(trial_ids)
            return await export_dataset(client, infos, counts, directory)
        except grpc.aio.AioRpcError as error:
            raise ClientError(client.describe_rpc_error(error, "export")) from error


async def import_trials(
    client: DatastoreClient,
    reader: TrialFileReader,
    prefix: str = "",
    user_id: str = DEFAULT_IMPORT_USER_ID,
    on_bytes: OnProgress = _ignore,
    source: str = "the export file",
) -> dict[str, int]:
    """Create the trials of the file, their ids prefixed by `prefix` and owned by `user_id`, and
    add their samples; samples per imported trial id. Nothing is imported if one of the ids
    exists.

    An import that fails part-way (a truncated or malformed file, `source` unreadable, the
    datastore refusing or going away) deletes the trials it created, so that none is left
    half-imported (listed RUNNING forever, and in the way of the next attempt); the ClientError
    says so, or, when they could not be deleted, which trials are incomplete and the command
    that deletes them. Cancelled, it deletes them too, then raises CancelledError saying so.
    (AddTrial creates or updates: a trial of one of these ids created by someone else between the
    check and the import's AddTrial would be taken for the import's.)"""
    try:
        header = await asyncio.to_thread(reader.read_header)
    except TrialFileError as error:
        raise ClientError(str(error)) from None
    target_ids = [prefix + trial_id for trial_id in header.trial_params]
    existing = list(await client.trial_infos(target_ids))
    if existing:
        raise ClientError(
            f"trials {id_list(existing)} already exist in the target datastore, import aborted; "
            "import them under other ids with --prefix PREFIX"
        )

    importer = TrialImporter(client, header.trial_params, prefix, user_id)
    reported = reader.bytes_read
    on_bytes(reported)
    try:
        while True:
            samples = await asyncio.to_thread(reader.read_samples, IMPORT_BATCH)
            if not samples:
                break
            for sample in samples:
                await importer.add(sample)
            on_bytes(reader.bytes_read - reported)
            reported = reader.bytes_read
        await importer.finish()
    except (TrialFileError, ClientError, OSError, grpc.aio.AioRpcError) as error:
        importer.cancel()  # nothing more goes in: what is there is deleted
        if isinstance(error, grpc.aio.AioRpcError):
            cause = client.describe_rpc_error(error, "import")
        elif isinstance(error, OSError):
            cause = f"cannot read [{source}]: {error.strerror or error}"
        else:
            cause = str(error)
        raise ClientError(f"{cause}; {await _delete_to_the_end(client, importer.created)}") from None
    except asyncio.CancelledError:
        # Interrupted (Ctrl-C): the trials it created are deleted all the same, and the
        # cancellation goes on, carrying what became of them.
        importer.cancel()
        raise asyncio.CancelledError(await _delete_to_the_end(client, importer.created)) from None
    finally:
        importer.cancel()
    return importer.counts


async def _delete_to_the_end(client: DatastoreClient, created: Sequence[str]) -> str:
    """`_delete_created`, carried to its end even when the caller is cancelled meanwhile (Ctrl-C
    during the clean-up of a failure): then a CancelledError carries what became of the trials."""
    deletion = asyncio.ensure_future(_delete_created(client, created))
    try:
        return await asyncio.shield(deletion)
    except asyncio.CancelledError:
        raise asyncio.CancelledError(await deletion) from None


async def _delete_created(client: DatastoreClient, created: Sequence[str]) -> str:
    """Delete the trials a failed import created; what became of them, in words."""
    if not created:
        return "nothing was imported"
    for start in range(0, len(created), DELETE_BATCH):
        try:
            await client.stub.DeleteTrials(
                trial_datastore_pb2.DeleteTrialsRequest(trial_ids=created[start : start + DELETE_BATCH]),
                timeout=client.timeout_s,
            )
        except grpc.aio.AioRpcError as error:
            left = created[start:]  # each call deletes all of its trials, or none
            command = shlex.join([*DELETE_COMMAND, *_connection_flags(client), *left])
            return (
                f"the import's trials {id_list(left)} are incomplete, and could not be deleted "
                f"({client.describe_rpc_error(error, 'delete_trials')}): delete them with `{command}`"
            )
    if len(created) == 1:
        return "nothing was imported: the trial it had created was deleted"
    return f"nothing was imported: the {len(created)} trials it had created were deleted"


def _connection_flags(client: DatastoreClient) -> list[str]:
    """The command line's flags that reach the datastore `client` reaches."""
    endpoint = [] if client.endpoint == DEFAULT_ENDPOINT else ["--endpoint", client.endpoint.url]
    return [*endpoint, *tls_flags(client)]


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
        # Every trial id this import created, in order, and those whose AddTrial's answer was lost
        # (it may have created its trial all the same); not those the datastore refused.
        self.created: list[str] = []
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
        try:
            await self._client.stub.AddTrial(
                trial_datastore_pb2.AddTrialRequest(user_id=self._user_id, trial_params=params),
                metadata=((TRIAL_ID_METADATA_KEY, trial_id),),
                timeout=self._client.timeout_s,
            )
        except grpc.aio.AioRpcError as error:
            if error.code() in _ANSWER_MAY_BE_LOST:
                self.created.append(trial_id)
            raise
        except asyncio.CancelledError:
            self.created.append(trial_id)  # sent: it may have been created
            raise
        self.created.append(trial_id)
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
