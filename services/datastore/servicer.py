"""The Trial Datastore's gRPC layer: TrialDatastoreSP, the two datalog ingestion services, and the
project's own TrialStatusSP (what the Cogment wire cannot say of a trial) and TrialSamplesSP. It
checks every request, then hands the core what it asked for in the core's terms.

`DatalogSP` (bidirectional, what the 2.x orchestrator calls) and `LogExporterSP` (client stream,
the API reference's name) share one ingestion: the first message holds the trial parameters, the
next ones samples. DatalogSP acknowledges each message once it is committed; LogExporterSP replies
once everything is.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from services.datastore.core import RANGE_MAX_COUNT, TrialDatastore
from services.datastore.ingestion import Ingestion
from services.datastore.metrics import DATALOG_API, LOG_EXPORTER_API
from services.datastore.model import SampleRange, TrialRecord, TrialStatus
from shared.api import common_pb2, datalog_pb2, trial_datastore_pb2, trial_samples_pb2, trial_status_pb2
from shared.errors import InvalidArgument
from shared.handlers import add_servicer, field_one_frame, pre_encoded, varint
from shared.observer import DRAIN_LIMIT_S
from shared.runtime import ServiceRuntime, VersionStatusMixin
from shared.validation import (
    MAX_INT64_POSITION,
    MAX_TRIAL_PARAMS_BYTES,
    MiB,
    checked_id,
    checked_list,
    checked_name_size,
    checked_properties,
    checked_size,
    checked_text,
    parse_handle,
    utf8_size,
)

# StoredTrialInfo.samples_count is 32-bit.
MAX_SAMPLES_COUNT = 2**32 - 1
# The ids of one status request, together: their statuses (an id and about 30 bytes each, for
# MAX_LISTED_ITEMS ids at most) then fit the 4 MiB reply clients accept.
MAX_STATUS_IDS_BYTES = 3 * MiB
# Every DatalogSP acknowledgement is this same empty message.
ACKNOWLEDGEMENT = datalog_pb2.RunTrialDatalogOutput()
# RetrieveSampleRangeReply's fields' tags (field number << 3 | wire type: 2 bytes, 0 varint).
_SAMPLES_TAG, _SAMPLES_COUNT_TAG, _FIRST_TAG, _FINISHED_TAG = b"\x0a", b"\x10", b"\x18", b"\x20"

DatalogInput = datalog_pb2.RunTrialDatalogInput | datalog_pb2.LogExporterSampleRequest


def _header_values(context: Any, key: str) -> list[str]:
    return [value for name, value in (context.invocation_metadata() or ()) if name == key]


def _single_trial_id(context: Any) -> str:
    values = _header_values(context, "trial-id")
    if len(values) != 1:
        raise InvalidArgument(
            "Missing expected 'trial-id' header metadata defining the id of the trial to add"
            if not values
            else f"Expected exactly one 'trial-id' header metadata, got {len(values)}"
        )
    return values[0]


def trial_info_message(record: TrialRecord) -> trial_datastore_pb2.StoredTrialInfo:
    return trial_datastore_pb2.StoredTrialInfo(
        trial_id=record.trial_id,
        last_state=record.last_state,  # type: ignore[arg-type]
        user_id=record.user_id,
        samples_count=min(record.samples_count, MAX_SAMPLES_COUNT),
        params=common_pb2.TrialParams.FromString(record.params),
    )


def trial_status_message(status: TrialStatus) -> trial_status_pb2.TrialStatus:
    return trial_status_pb2.TrialStatus(
        trial_id=status.trial_id,
        ended=status.ended,
        closed=status.closed,
        interrupted=status.interrupted,
        samples_count=status.samples_count,
        last_state=status.last_state,  # type: ignore[arg-type]
    )


def trial_info_size(record: TrialRecord) -> int:
    """The encoded size of `trial_info_message(record)`, at most, without parsing its parameters:
    they are re-encoded as stored (the tags, lengths and numbers take 32 bytes at most)."""
    return utf8_size(record.trial_id) + utf8_size(record.user_id) + len(record.params) + 32


def _datalog_sample(request: DatalogInput) -> datalog_pb2.DatalogSample:
    if request.WhichOneof("msg") != "sample":
        raise InvalidArgument('body message is not of type "cogment.DatalogSample"')
    return request.sample


def _stored_sample(
    trial_id: str, request: trial_datastore_pb2.AddSampleRequest
) -> trial_datastore_pb2.StoredTrialSample:
    """The sample of an AddSample request to the trial `trial_id`, its trial id filled in."""
    if not request.HasField("trial_sample"):
        raise InvalidArgument("AddSampleRequest without a trial_sample")
    sample = request.trial_sample
    if sample.trial_id and sample.trial_id != trial_id:
        raise InvalidArgument(
            "'AddSampleRequest.TrialSample.trial_id' should be left undefined or should match the "
            "header metadata 'trial-id'"
        )
    sample.trial_id = trial_id
    checked_name_size(sample.user_id, "user id")
    checked_text(sample.user_id, "user ids")
    return sample


def _check_trial(trial_id: str, user_id: str, params: common_pb2.TrialParams) -> None:
    """What a trial created or reopened (AddTrial, a datalog) must be."""
    checked_id(trial_id, "trial id")
    checked_name_size(user_id, "user id")
    checked_text(user_id, "user ids")
    checked_properties(params.properties, "trial properties")
    size = params.ByteSize()
    checked_size(size, "trial parameters bytes", MAX_TRIAL_PARAMS_BYTES, "MAX_TRIAL_PARAMS_BYTES")


def add_servicers(server: grpc.aio.Server, datastore: TrialDatastore, runtime: ServiceRuntime) -> list[str]:
    """Serve the datastore's gRPC services on `server`; their full names."""
    ingestion = DatalogIngestion(datastore)
    stored_replies: dict[str, Callable[[Any], bytes]] = {"RetrieveSamples": pre_encoded}
    range_replies: dict[str, Callable[[Any], bytes]] = {"RetrieveSampleRange": pre_encoded}
    served: list[tuple[Any, str, object, dict[str, Callable[[Any], bytes]]]] = [
        (trial_datastore_pb2, "TrialDatastoreSP", TrialDatastoreServicer(datastore, runtime), stored_replies),
        (trial_status_pb2, "TrialStatusSP", TrialStatusServicer(datastore), {}),
        (trial_samples_pb2, "TrialSamplesSP", TrialSamplesServicer(datastore), range_replies),
        (datalog_pb2, "DatalogSP", DatalogServicer(ingestion, runtime), {}),
        (datalog_pb2, "LogExporterSP", LogExporterServicer(ingestion, runtime), {}),
    ]
    return [
        add_servicer(server, module.DESCRIPTOR.services_by_name[name], servicer, serializers)
        for module, name, servicer, serializers in served
    ]


class TrialDatastoreServicer(VersionStatusMixin):
    def __init__(self, datastore: TrialDatastore, runtime: ServiceRuntime) -> None:
        self.datastore = datastore
        self.runtime = runtime

    async def RetrieveTrials(
        self, request: trial_datastore_pb2.RetrieveTrialsRequest, context: Any
    ) -> trial_datastore_pb2.RetrieveTrialsReply:
        checked_list(request.trial_ids, "trial_ids")
        checked_properties(request.properties, "properties")
        # trial_seq is a signed 64-bit column.
        after = parse_handle(request.trial_handle, "trial_handle", MAX_INT64_POSITION)
        records, end = await self.datastore.retrieve_trials(
            list(request.trial_ids),
            dict(request.properties),
            request.timeout,
            request.trials_count,
            after,
            trial_info_size,
        )
        return trial_datastore_pb2.RetrieveTrialsReply(
            trial_infos=[trial_info_message(record) for record in records], next_trial_handle=str(end)
        )

    async def RetrieveSamples(
        self, request: trial_datastore_pb2.RetrieveSamplesRequest, context: Any
    ) -> AsyncIterator[bytes]:
        """Yields encoded RetrieveSampleReply messages: stored samples go out without re-encoding."""
        checked_list(request.trial_ids, "trial_ids")
        async for data in self.datastore.samples(
            list(request.trial_ids),
            list(request.actor_names),
            list(request.actor_classes),
            list(request.actor_implementations),
            list(request.selected_sample_fields),
        ):
            yield field_one_frame(data)

    async def AddTrial(
        self, request: trial_datastore_pb2.AddTrialRequest, context: Any
    ) -> trial_datastore_pb2.AddTrialReply:
        trial_id = _single_trial_id(context)
        _check_trial(trial_id, request.user_id, request.trial_params)
        await self.datastore.add_trial(trial_id, request.user_id, request.trial_params)
        return trial_datastore_pb2.AddTrialReply()

    async def AddSample(
        self, request_iterator: AsyncIterator[trial_datastore_pb2.AddSampleRequest], context: Any
    ) -> trial_datastore_pb2.AddSamplesReply:
        trial_id = checked_id(_single_trial_id(context), "trial id")
        ingestion = await self.datastore.open_samples(trial_id)
        sample_of = functools.partial(_stored_sample, trial_id)
        async for _ in ingestion.ingest_stored(request_iterator, sample_of, DRAIN_LIMIT_S):
            pass
        return trial_datastore_pb2.AddSamplesReply()

    async def DeleteTrials(
        self, request: trial_datastore_pb2.DeleteTrialsRequest, context: Any
    ) -> trial_datastore_pb2.DeleteTrialsReply:
        checked_list(request.trial_ids, "trial_ids")
        await self.datastore.delete_trials(list(request.trial_ids))
        return trial_datastore_pb2.DeleteTrialsReply()


class TrialStatusServicer:
    """The project's own extension (`cogment_aux.api.TrialStatusSP`): what the Cogment wire cannot
    say of a trial, an interrupted one above all (see `trial_status.proto`)."""

    def __init__(self, datastore: TrialDatastore) -> None:
        self.datastore = datastore

    async def RetrieveTrialStatuses(
        self, request: trial_status_pb2.RetrieveTrialStatusesRequest, context: Any
    ) -> trial_status_pb2.RetrieveTrialStatusesReply:
        checked_list(request.trial_ids, "trial_ids")
        checked_size(
            sum(utf8_size(trial_id) for trial_id in request.trial_ids),
            "trial ids bytes",
            MAX_STATUS_IDS_BYTES,
            "MAX_STATUS_IDS_BYTES",
        )
        statuses = await self.datastore.trial_statuses(list(request.trial_ids))
        return trial_status_pb2.RetrieveTrialStatusesReply(
            statuses=[trial_status_message(status) for status in statuses]
        )

    async def CountTrials(
        self, request: trial_status_pb2.CountTrialsRequest, context: Any
    ) -> trial_status_pb2.CountTrialsReply:
        counts = await self.datastore.trial_counts()
        return trial_status_pb2.CountTrialsReply(
            counts=[
                trial_status_pb2.TrialCount(
                    last_state=count.last_state,  # type: ignore[arg-type]
                    ended=count.ended,
                    closed=count.closed,
                    interrupted=count.interrupted,
                    trials=count.trials,
                )
                for count in counts
            ]
        )


class TrialSamplesServicer:
    """The project's own extension (`cogment_aux.api.TrialSamplesSP`): a range of a trial's
    samples by position, for tools that show one tick of a long trial (see `trial_samples.proto`)."""

    def __init__(self, datastore: TrialDatastore) -> None:
        self.datastore = datastore

    async def RetrieveSampleRange(
        self, request: trial_samples_pb2.RetrieveSampleRangeRequest, context: Any
    ) -> bytes:
        if request.count > RANGE_MAX_COUNT:
            raise InvalidArgument(f"count [{request.count}] is over {RANGE_MAX_COUNT}")
        trial_id = checked_id(request.trial_id, "trial id")
        tick = request.tick if request.HasField("tick") else None
        found = await self.datastore.sample_range(
            trial_id, request.first, request.count, tick, request.timeout_ms
        )
        return range_reply(found)


def range_reply(found: SampleRange) -> bytes:
    """`RetrieveSampleRangeReply` encoded around the stored samples, as they are (see
    `field_one_frame`): decoding a thousand of them to encode them again cost more than reading
    them. `finished` is always there (its presence tells the datastore can wait)."""
    parts: list[bytes] = []
    for data in found.samples:
        parts += (_SAMPLES_TAG + varint(len(data)), data)
    parts += (
        _SAMPLES_COUNT_TAG + varint(found.samples_count),
        _FIRST_TAG + varint(found.first),
        _FINISHED_TAG + (b"\x01" if found.finished else b"\x00"),
    )
    return b"".join(parts)


class DatalogIngestion:
    """RunTrialDatalog of both ingestion services: yields how many more input messages are
    committed, as they are (the trial parameters count as one)."""

    def __init__(self, datastore: TrialDatastore) -> None:
        self.datastore = datastore

    async def run(self, requests: AsyncIterator[DatalogInput], context: Any, api: str) -> AsyncIterator[int]:
        """`api`: the service called (the metrics' label)."""
        ids = _header_values(context, "trial-id")
        if not ids:
            raise InvalidArgument('DatalogServer.RunTrialDatalog: missing required header "trial-id"')
        users = _header_values(context, "user-id")
        first = await anext(requests, None)
        if first is None:
            return  # nothing was sent: nothing to do
        if first.WhichOneof("msg") != "trial_params":
            raise InvalidArgument(
                'DatalogServer.RunTrialDatalog: initial message is not of type "cogment.TrialParams"'
            )
        user_id = users[0] if users else ""
        _check_trial(ids[0], user_id, first.trial_params)
        opening = asyncio.ensure_future(self.datastore.open_datalog(ids[0], user_id, first.trial_params, api))
        try:
            ingestion: Ingestion = await asyncio.shield(opening)
        except asyncio.CancelledError:
            # The trial may be (re)opened all the same: close it, or its readers wait forever.
            with contextlib.suppress(Exception):
                await (await opening).close()
            raise
        try:
            yield 1
            async for committed in ingestion.ingest_datalog(requests, _datalog_sample, DRAIN_LIMIT_S):
                yield committed
        finally:
            await ingestion.close()


class DatalogServicer(VersionStatusMixin):
    def __init__(self, ingestion: DatalogIngestion, runtime: ServiceRuntime) -> None:
        self.ingestion = ingestion
        self.runtime = runtime

    async def RunTrialDatalog(
        self, request_iterator: AsyncIterator[datalog_pb2.RunTrialDatalogInput], context: Any
    ) -> AsyncIterator[datalog_pb2.RunTrialDatalogOutput]:
        async for committed in self.ingestion.run(request_iterator, context, DATALOG_API):
            for _ in range(committed):
                yield ACKNOWLEDGEMENT


class LogExporterServicer(VersionStatusMixin):
    def __init__(self, ingestion: DatalogIngestion, runtime: ServiceRuntime) -> None:
        self.ingestion = ingestion
        self.runtime = runtime

    async def RunTrialDatalog(
        self, request_iterator: AsyncIterator[datalog_pb2.LogExporterSampleRequest], context: Any
    ) -> datalog_pb2.LogExporterSampleReply:
        async for _ in self.ingestion.run(request_iterator, context, LOG_EXPORTER_API):
            pass
        return datalog_pb2.LogExporterSampleReply()
