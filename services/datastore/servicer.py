"""The Trial Datastore's gRPC layer: TrialDatastoreSP, the two datalog ingestion services, and the
project's own TrialStatusSP (what the Cogment wire cannot say of a trial).

`DatalogSP` (bidirectional, what the 2.x orchestrator calls) and `LogExporterSP` (client stream,
the API reference's name) share one ingestion: the first message holds the trial parameters, the
next ones samples. DatalogSP acknowledges each message once it is committed; LogExporterSP replies
once everything is.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc

from services.datastore.core import TrialDatastore
from services.datastore.ingestion import Ingestion
from services.datastore.metrics import DATALOG_API, LOG_EXPORTER_API
from services.datastore.model import TrialRecord, TrialStatus
from shared.api import common_pb2, datalog_pb2, trial_datastore_pb2, trial_samples_pb2, trial_status_pb2
from shared.errors import InvalidArgument
from shared.handlers import add_servicer, field_one_frame, pre_encoded
from shared.observer import DRAIN_LIMIT_S
from shared.runtime import ServiceRuntime, VersionStatusMixin
from shared.validation import utf8_size

# StoredTrialInfo.samples_count is 32-bit.
MAX_SAMPLES_COUNT = 2**32 - 1
# Every DatalogSP acknowledgement is this same empty message.
ACKNOWLEDGEMENT = datalog_pb2.RunTrialDatalogOutput()

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


def _stored_sample(request: trial_datastore_pb2.AddSampleRequest) -> trial_datastore_pb2.StoredTrialSample:
    if not request.HasField("trial_sample"):
        raise InvalidArgument("AddSampleRequest without a trial_sample")
    return request.trial_sample


def add_servicers(server: grpc.aio.Server, datastore: TrialDatastore, runtime: ServiceRuntime) -> None:
    """Serve the datastore's gRPC services on `server`."""
    add_servicer(
        server,
        trial_datastore_pb2.DESCRIPTOR.services_by_name["TrialDatastoreSP"],
        TrialDatastoreServicer(datastore, runtime),
        response_serializers={"RetrieveSamples": pre_encoded},
    )
    add_servicer(
        server,
        trial_status_pb2.DESCRIPTOR.services_by_name["TrialStatusSP"],
        TrialStatusServicer(datastore),
    )
    add_servicer(
        server,
        trial_samples_pb2.DESCRIPTOR.services_by_name["TrialSamplesSP"],
        TrialSamplesServicer(datastore),
    )
    ingestion = DatalogIngestion(datastore)
    add_servicer(
        server, datalog_pb2.DESCRIPTOR.services_by_name["DatalogSP"], DatalogServicer(ingestion, runtime)
    )
    add_servicer(
        server,
        datalog_pb2.DESCRIPTOR.services_by_name["LogExporterSP"],
        LogExporterServicer(ingestion, runtime),
    )


class TrialDatastoreServicer(VersionStatusMixin):
    def __init__(self, datastore: TrialDatastore, runtime: ServiceRuntime) -> None:
        self.datastore = datastore
        self.runtime = runtime

    async def RetrieveTrials(
        self, request: trial_datastore_pb2.RetrieveTrialsRequest, context: Any
    ) -> trial_datastore_pb2.RetrieveTrialsReply:
        records, handle = await self.datastore.retrieve_trials(
            list(request.trial_ids),
            dict(request.properties),
            request.timeout,
            request.trials_count,
            request.trial_handle,
            trial_info_size,
        )
        return trial_datastore_pb2.RetrieveTrialsReply(
            trial_infos=[trial_info_message(record) for record in records], next_trial_handle=handle
        )

    async def RetrieveSamples(
        self, request: trial_datastore_pb2.RetrieveSamplesRequest, context: Any
    ) -> AsyncIterator[bytes]:
        """Yields encoded RetrieveSampleReply messages: stored samples go out without re-encoding."""
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
        await self.datastore.add_trial(_single_trial_id(context), request.user_id, request.trial_params)
        return trial_datastore_pb2.AddTrialReply()

    async def AddSample(
        self, request_iterator: AsyncIterator[trial_datastore_pb2.AddSampleRequest], context: Any
    ) -> trial_datastore_pb2.AddSamplesReply:
        ingestion = await self.datastore.open_samples(_single_trial_id(context))
        async for _ in ingestion.ingest_stored(request_iterator, _stored_sample, DRAIN_LIMIT_S):
            pass
        return trial_datastore_pb2.AddSamplesReply()

    async def DeleteTrials(
        self, request: trial_datastore_pb2.DeleteTrialsRequest, context: Any
    ) -> trial_datastore_pb2.DeleteTrialsReply:
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
    ) -> trial_samples_pb2.RetrieveSampleRangeReply:
        tick = request.tick if request.HasField("tick") else None
        samples, first, count = await self.datastore.sample_range(
            request.trial_id, request.first, request.count, tick
        )
        return trial_samples_pb2.RetrieveSampleRangeReply(
            samples=[trial_datastore_pb2.StoredTrialSample.FromString(data) for data in samples],
            samples_count=count,
            first=first,
        )


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
        opening = asyncio.ensure_future(
            self.datastore.open_datalog(ids[0], users[0] if users else "", first.trial_params, api)
        )
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
