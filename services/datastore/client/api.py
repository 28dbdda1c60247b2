"""The Trial Datastore's Python client: list, read and delete stored trials (the export and import
of trials are `services.datastore.client.transfer`, training batches `training`).

    async with DatastoreClient("grpc://localhost:9003") as datastore:
        reply = await datastore.list_trials(count=10)
        async for sample in datastore.read_samples(["trial-1"]):  # its samples stored so far
            ...
        deleted = await datastore.delete_trials(["trial-1"])
        interrupted = await datastore.interrupted_trials(["trial-1"])  # {"trial-1"} if it was

Failures are `ClientError`s or `grpc.aio.AioRpcError`s (`describe_rpc_error` says them in a
sentence).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Iterable, Mapping, Sequence

import grpc

from shared.api import (
    common_pb2,
    trial_datastore_pb2,
    trial_datastore_pb2_grpc,
    trial_samples_pb2,
    trial_samples_pb2_grpc,
    trial_status_pb2,
    trial_status_pb2_grpc,
)
from shared.channel import ClientTls
from shared.client import DEFAULT_TIMEOUT_S, ClientError, ServiceClient
from shared.endpoints import GrpcEndpoint
from shared.validation import utf8_size

DEFAULT_ENDPOINT = GrpcEndpoint("localhost", 9003)
TRIAL_ID_METADATA_KEY = "trial-id"
# Trial ids per RetrieveTrials call when looking trials up by id (as the reference).
TRIALS_PER_LOOKUP = 20
# Trial ids per RetrieveTrialStatuses call, and their bytes together: well under what the
# datastore accepts in one (10,000 ids, 3 MiB).
STATUSES_PER_CALL = 1000
STATUS_IDS_BYTES_PER_CALL = 1024 * 1024
# Stored samples can exceed gRPC's 4 MiB default (the datastore expands rewards and payloads).
MAX_RECEIVE_MESSAGE_BYTES = -1


def state_name(state: int) -> str:
    """A trial state's name (`RUNNING`...), or its number when it has none."""
    try:
        return common_pb2.TrialState.Name(state)  # type: ignore[arg-type]
    except ValueError:
        return str(state)


def id_list(trial_ids: Iterable[str]) -> str:
    return "[" + ", ".join(trial_ids) + "]"


class DatastoreClient(ServiceClient):
    """One datastore connection; every call fails at once if the datastore cannot be reached."""

    service = "trial datastore"
    grpc_service = "cogmentAPI.TrialDatastoreSP"
    default_endpoint = DEFAULT_ENDPOINT

    def __init__(
        self,
        endpoint: GrpcEndpoint | str = DEFAULT_ENDPOINT,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        tls: ClientTls | None = None,
    ) -> None:
        """`timeout_s` bounds each call, and each sample of a read; `tls`: see
        `shared.channel.ClientTls` (a `grpcs://` endpoint without it: the system's CAs)."""
        super().__init__(
            endpoint, timeout_s, tls, [("grpc.max_receive_message_length", MAX_RECEIVE_MESSAGE_BYTES)]
        )
        self.stub = trial_datastore_pb2_grpc.TrialDatastoreSPStub(self.channel)
        # The project's own extension (absent from the reference datastore).
        self.status_stub = trial_status_pb2_grpc.TrialStatusSPStub(self.channel)
        self.samples_stub = trial_samples_pb2_grpc.TrialSamplesSPStub(self.channel)

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

    async def trial_statuses(
        self, trial_ids: Sequence[str]
    ) -> dict[str, trial_status_pb2.TrialStatus] | None:
        """The statuses of the stored trials among `trial_ids`, by id: what the Cogment wire
        cannot say of them, whether they were interrupted above all. None when the datastore does
        not serve `cogment_aux.api.TrialStatusSP` (the reference's does not): the trials' states
        are then only what `StoredTrialInfo.last_state` says."""
        statuses: dict[str, trial_status_pb2.TrialStatus] = {}
        for chunk in _status_chunks(list(dict.fromkeys(trial_ids))):
            reply = await self.if_served(
                self.status_stub.RetrieveTrialStatuses(
                    trial_status_pb2.RetrieveTrialStatusesRequest(trial_ids=chunk), timeout=self.timeout_s
                )
            )
            if reply is None:
                return None
            statuses.update((status.trial_id, status) for status in reply.statuses)
        return statuses

    async def trial_counts(self) -> list[trial_status_pb2.TrialCount] | None:
        """How many trials are stored, by where they stand (last state, ended, closed,
        interrupted). None when the datastore does not serve `cogment_aux.api.TrialStatusSP`'s
        CountTrials (the reference's does not): listing every trial is then the only way."""
        reply = await self.if_served(
            self.status_stub.CountTrials(trial_status_pb2.CountTrialsRequest(), timeout=self.timeout_s)
        )
        return None if reply is None else list(reply.counts)

    async def sample_range(
        self, trial_id: str, first: int, count: int = 0, tick: int | None = None, *, wait_ms: int = 0
    ) -> trial_samples_pb2.RetrieveSampleRangeReply | None:
        """The trial's stored samples from position `first` on (in the order `samples` replays
        them; with `tick`, from the first of them of that tick, found by the datastore; `count`
        at most, 0: 100, fewer past 2 MiB), where they start, and how many the trial has. With
        `wait_ms`, when none is stored yet and the trial goes on, the datastore answers once one
        is, or after `wait_ms` with none; a reply without `finished` comes from a datastore that
        cannot wait. None when the datastore does not serve `cogment_aux.api.TrialSamplesSP` (the
        reference's does not): `samples` from the start is then the only way."""
        request = trial_samples_pb2.RetrieveSampleRangeRequest(
            trial_id=trial_id, first=first, count=count, timeout_ms=wait_ms
        )
        if tick is not None:
            request.tick = tick
        reply: trial_samples_pb2.RetrieveSampleRangeReply | None = await self.if_served(
            self.samples_stub.RetrieveSampleRange(request, timeout=self.timeout_s + wait_ms / 1000)
        )
        return reply

    async def interrupted_trials(self, trial_ids: Sequence[str]) -> set[str]:
        """Those of `trial_ids` whose ingestion stopped before they ended: they will not end by
        themselves, though the Cogment wire lists them with their last state (RUNNING, usually).
        Empty when the datastore cannot tell (see `trial_statuses`)."""
        statuses = await self.trial_statuses(trial_ids)
        return {trial_id for trial_id, status in (statuses or {}).items() if status.interrupted}

    async def list_trials(
        self, count: int = 10, handle: str = "", properties: Mapping[str, str] | None = None
    ) -> trial_datastore_pb2.RetrieveTrialsReply:
        """A page of stored trials in creation order, from `handle` (a previous page's
        `next_trial_handle`), those with all of `properties`."""
        reply: trial_datastore_pb2.RetrieveTrialsReply = await self.stub.RetrieveTrials(
            trial_datastore_pb2.RetrieveTrialsRequest(
                trials_count=count, trial_handle=handle, properties=properties or {}
            ),
            timeout=self.timeout_s,
        )
        return reply

    async def delete_trials(self, trial_ids: Sequence[str]) -> list[str]:
        """Delete these trials; those that were stored (the others are not an error)."""
        unique = list(dict.fromkeys(trial_ids))
        # DeleteTrials does not say which ids it found: ask first.
        stored = await self.trial_infos(unique)
        await self.stub.DeleteTrials(
            trial_datastore_pb2.DeleteTrialsRequest(trial_ids=unique), timeout=self.timeout_s
        )
        return [trial_id for trial_id in unique if trial_id in stored]

    async def sample_counts(
        self, trial_ids: Iterable[str]
    ) -> tuple[dict[str, trial_datastore_pb2.StoredTrialInfo], dict[str, int]]:
        """The trials, and how many samples each has now (samples added later to ongoing trials
        are not counted), trials without samples left out. A ClientError if one is unknown, or
        none has samples."""

        unique = list(dict.fromkeys(trial_ids))
        infos = await self.trial_infos(unique)
        missing = [trial_id for trial_id in unique if trial_id not in infos]
        if missing:
            raise ClientError(f"trials {id_list(missing)} not found")
        counts = {
            trial_id: infos[trial_id].samples_count for trial_id in unique if infos[trial_id].samples_count
        }
        if not counts:
            raise ClientError("no samples to export for selected trials")
        return infos, counts

    async def read_samples(
        self, trial_ids: Sequence[str]
    ) -> AsyncGenerator[trial_datastore_pb2.StoredTrialSample, None]:
        """The samples the trials have when the call starts, each trial's in order (ongoing
        trials are cut there); a ClientError if one is unknown."""
        _, counts = await self.sample_counts(trial_ids)
        async with contextlib.aclosing(self.samples(counts)) as samples:
            async for sample in samples:
                yield sample

    async def samples(
        self, counts: Mapping[str, int], fields: Sequence[int] = ()
    ) -> AsyncGenerator[trial_datastore_pb2.StoredTrialSample, None]:
        """The first `counts[trial]` samples of each trial, as the datastore sends them (`fields`:
        only these sample fields; none: all)."""
        remaining = dict(counts)
        request = trial_datastore_pb2.RetrieveSamplesRequest(
            trial_ids=list(counts),
            selected_sample_fields=fields,  # type: ignore[arg-type]
        )
        call = self.stub.RetrieveSamples(request)
        try:
            while remaining:
                reply = await self.within_timeout(call.read(), call)
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


def _status_chunks(trial_ids: Sequence[str]) -> Iterable[list[str]]:
    """`trial_ids` in runs of at most STATUSES_PER_CALL ids and STATUS_IDS_BYTES_PER_CALL bytes
    (an id larger than that alone)."""
    chunk: list[str] = []
    size = 0
    for trial_id in trial_ids:
        length = utf8_size(trial_id)
        if chunk and (len(chunk) == STATUSES_PER_CALL or size + length > STATUS_IDS_BYTES_PER_CALL):
            yield chunk
            chunk, size = [], 0
        chunk.append(trial_id)
        size += length
    if chunk:
        yield chunk
