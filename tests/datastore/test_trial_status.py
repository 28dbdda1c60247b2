"""The project's own `cogment_aux.api.TrialStatusSP`, served beside TrialDatastoreSP: what the
Cogment wire cannot say of a trial (interrupted above all), over real gRPC on SQLite and on
PostgreSQL. The wire itself is untouched: `RetrieveTrials` lists an interrupted trial as the
reference does, with its last sample's state."""

from __future__ import annotations

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from shared.api import common_pb2, datalog_pb2, trial_status_pb2, trial_status_pb2_grpc
from shared.db import IN_LIST_BATCH
from tests.helpers.datastore import (
    add_trial,
    datalog_inputs,
    datalog_sample,
    full_trial,
    list_trials,
    run_datalog,
    send_acknowledged,
    trial_params,
)
from tests.helpers.health import SERVING, health
from tests.helpers.running import DatastoreFactory, RunningDatastore

TRIAL_STATUS_SP = "cogment_aux.api.TrialStatusSP"


async def statuses(datastore: RunningDatastore, trial_ids: list[str]) -> list[trial_status_pb2.TrialStatus]:
    stub = trial_status_pb2_grpc.TrialStatusSPStub(datastore.channel)
    reply = await stub.RetrieveTrialStatuses(
        trial_status_pb2.RetrieveTrialStatusesRequest(trial_ids=trial_ids), timeout=10
    )
    return list(reply.statuses)


def summary(status: trial_status_pb2.TrialStatus) -> tuple[str, bool, bool, bool, int, int]:
    return (
        status.trial_id,
        status.ended,
        status.closed,
        status.interrupted,
        status.samples_count,
        status.last_state,
    )


async def test_an_interrupted_trial_is_told_apart_from_running_and_ended_ones(
    datastore: RunningDatastore,
) -> None:
    await run_datalog(datastore, "ended", full_trial(3))
    # The orchestrator's stream closed after two RUNNING samples: the trial will not end.
    await run_datalog(datastore, "interrupted", [datalog_sample(0), datalog_sample(1)])
    await add_trial(datastore, "added")  # AddTrial alone: no ingestion stream to close
    running = datastore.datalog.RunTrialDatalog(metadata=(("trial-id", "running"),))
    await send_acknowledged(running, datalog_inputs(trial_params(), [datalog_sample(0)]))

    found = await statuses(datastore, ["running", "unknown", "interrupted", "ended", "added", "ended"])

    RUNNING, ENDED, UNKNOWN = common_pb2.RUNNING, common_pb2.ENDED, common_pb2.UNKNOWN
    # Request order, each trial once, the unknown id absent.
    assert [summary(status) for status in found] == [
        ("running", False, False, False, 1, RUNNING),
        ("interrupted", False, True, True, 2, RUNNING),
        ("ended", True, True, False, 3, ENDED),
        ("added", False, False, False, 0, UNKNOWN),
    ]
    # The Cogment wire lists it as the reference does: its last sample's state.
    [info] = (await list_trials(datastore, trial_ids=["interrupted"])).trial_infos
    assert info.last_state == RUNNING and info.samples_count == 2

    await running.done_writing()
    assert await running.read() == grpc.aio.EOF
    assert await running.code() == grpc.StatusCode.OK
    [closed] = await statuses(datastore, ["running"])
    assert (closed.closed, closed.interrupted) == (True, True)


async def test_trials_are_counted_by_where_they_stand(datastore: RunningDatastore) -> None:
    stub = trial_status_pb2_grpc.TrialStatusSPStub(datastore.channel)

    async def counts() -> set[tuple[int, bool, bool, bool, int]]:
        reply = await stub.CountTrials(trial_status_pb2.CountTrialsRequest(), timeout=10)
        return {(c.last_state, c.ended, c.closed, c.interrupted, c.trials) for c in reply.counts}

    assert await counts() == set()
    for trial_id in ("ended-1", "ended-2"):
        await run_datalog(datastore, trial_id, full_trial(3))
    await run_datalog(datastore, "interrupted", [datalog_sample(0)])
    await add_trial(datastore, "added")
    running = datastore.datalog.RunTrialDatalog(metadata=(("trial-id", "running"),))
    await send_acknowledged(running, datalog_inputs(trial_params(), [datalog_sample(0)]))
    RUNNING, ENDED, UNKNOWN = common_pb2.RUNNING, common_pb2.ENDED, common_pb2.UNKNOWN
    assert await counts() == {
        (ENDED, True, True, False, 2),
        (RUNNING, False, True, True, 1),
        (RUNNING, False, False, False, 1),
        (UNKNOWN, False, False, False, 1),
    }
    await running.done_writing()
    assert await running.read() == grpc.aio.EOF
    assert (RUNNING, False, True, True, 2) in await counts()  # closed before it ended


async def test_a_new_datalog_stream_reopens_an_interrupted_trial(datastore: RunningDatastore) -> None:
    await run_datalog(datastore, "resumed", [datalog_sample(0)])
    [before] = await statuses(datastore, ["resumed"])
    assert before.interrupted

    call = datastore.datalog.RunTrialDatalog(metadata=(("trial-id", "resumed"),))
    await send_acknowledged(call, datalog_inputs(trial_params(), [datalog_sample(1)]))
    [reopened] = await statuses(datastore, ["resumed"])
    assert (reopened.closed, reopened.interrupted, reopened.samples_count) == (False, False, 2)

    await send_acknowledged(
        call, [datalog_pb2.RunTrialDatalogInput(sample=datalog_sample(2, common_pb2.ENDED))]
    )
    await call.done_writing()
    assert await call.read() == grpc.aio.EOF
    assert await call.code() == grpc.StatusCode.OK
    [ended] = await statuses(datastore, ["resumed"])
    assert (ended.ended, ended.closed, ended.interrupted) == (True, True, False)


async def test_long_id_lists_are_answered_whole(datastore: RunningDatastore) -> None:
    """More ids than one SQL statement takes: every existing trial is found, in request order."""
    existing = [f"trial-{index}" for index in (0, IN_LIST_BATCH - 1, IN_LIST_BATCH, 2 * IN_LIST_BATCH + 7)]
    for trial_id in existing:
        await run_datalog(datastore, trial_id, [datalog_sample(0)])
    asked = [f"trial-{index}" for index in reversed(range(2 * IN_LIST_BATCH + 10))]
    found = await statuses(datastore, asked)
    assert [status.trial_id for status in found] == list(reversed(existing))
    assert all(status.interrupted for status in found)


async def test_empty_and_strange_ids_are_simply_absent(datastore: RunningDatastore) -> None:
    assert await statuses(datastore, []) == []
    assert await statuses(datastore, ["", "nul\x00id", "é" * 1000]) == []


@pytest.mark.parametrize(
    ("trial_ids", "limit"),
    [
        (["t"] * 10_001, "MAX_LISTED_ITEMS"),
        ([f"{index}".ljust(400 * 1024, "x") for index in range(8)], "MAX_STATUS_IDS_BYTES"),
    ],
    ids=["count", "bytes"],
)
async def test_requests_over_a_limit_are_refused_naming_it(
    datastore: RunningDatastore, trial_ids: list[str], limit: str
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await statuses(datastore, trial_ids)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert limit in (refused.value.details() or "")


async def test_it_is_health_checked_and_reflected_like_the_others(
    datastore_factory: DatastoreFactory,
) -> None:
    async with datastore_factory("--grpc_reflection") as datastore:
        assert await health(datastore.channel, TRIAL_STATUS_SP) == SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(datastore.channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        [reply] = [reply async for reply in stub.ServerReflectionInfo(iter([request]), timeout=5)]
        names = {service.name for service in reply.list_services_response.service}
        assert {TRIAL_STATUS_SP, "cogmentAPI.TrialDatastoreSP"} <= names
