"""How the demo's datalog streams end when the datastore misbehaves (`services.demo.recording`),
against a stand-in datastore: one that stops acknowledging, one that fails a stream. Either way
the run fails with one line saying so, and no stream is left open."""

from __future__ import annotations

import asyncio
import io
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from services.datastore.client.api import DatastoreClient
from services.demo.cli import main
from services.demo.orchestration import TrialPlan, players_of
from services.demo.publishing import DEFAULT_MODEL_ID, local_policies
from services.demo.recording import DatalogRecorder
from shared.api import datalog_pb2, trial_datastore_pb2

SKIP_OTHERS = ["--model_registry_endpoint", "", "--directory_endpoint", ""]


class StandInDatastore:
    """Stores nothing; acknowledges the first `acknowledged` messages of each datalog stream,
    then reads on in silence and ends it (`hang`: never), or fails it with `fail_with` once it has
    read the rest (as the real services do: grpc's asyncio client, still writing when its call is
    rejected, would otherwise report `INTERNAL: Internal error from Core`)."""

    def __init__(
        self, acknowledged: int, fail_with: grpc.StatusCode | None = None, hang: bool = False
    ) -> None:
        self.acknowledged = acknowledged
        self.fail_with = fail_with
        self.hang = hang
        self.streams = 0
        self.closed = 0
        self.changed = asyncio.Event()

    async def RetrieveTrials(
        self, request: trial_datastore_pb2.RetrieveTrialsRequest, context: Any
    ) -> trial_datastore_pb2.RetrieveTrialsReply:
        return trial_datastore_pb2.RetrieveTrialsReply()

    async def RunTrialDatalog(
        self, request_iterator: AsyncIterator[datalog_pb2.RunTrialDatalogInput], context: Any
    ) -> AsyncIterator[datalog_pb2.RunTrialDatalogOutput]:
        self.streams += 1
        try:
            received = 0
            async for _ in request_iterator:
                received += 1
                if received <= self.acknowledged:
                    yield datalog_pb2.RunTrialDatalogOutput()
            if self.fail_with is not None:
                await context.abort(self.fail_with, "the stand-in refuses this sample")
            if self.hang:
                await asyncio.Event().wait()  # until the client goes
        finally:
            self.closed += 1
            self.changed.set()


async def serve(servicer: StandInDatastore) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    retrieve_trials = grpc.unary_unary_rpc_method_handler(
        servicer.RetrieveTrials,
        request_deserializer=trial_datastore_pb2.RetrieveTrialsRequest.FromString,
        response_serializer=trial_datastore_pb2.RetrieveTrialsReply.SerializeToString,
    )
    datalog = grpc.stream_stream_rpc_method_handler(
        servicer.RunTrialDatalog,
        request_deserializer=datalog_pb2.RunTrialDatalogInput.FromString,
        response_serializer=datalog_pb2.RunTrialDatalogOutput.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "cogmentAPI.TrialDatastoreSP", {"RetrieveTrials": retrieve_trials}
            ),
            grpc.method_handlers_generic_handler("cogmentAPI.DatalogSP", {"RunTrialDatalog": datalog}),
        )
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


async def run(port: int, *flags: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    argv = ["--trial_datastore_endpoint", f"grpc://127.0.0.1:{port}", *SKIP_OTHERS, *flags]
    code = await asyncio.to_thread(main, argv, "cogment-aux demo", {}, out, err)
    return code, out.getvalue(), err.getvalue()


async def wait_closed(servicer: StandInDatastore) -> None:
    """Until every stream the stand-in got has ended (the demo left none open)."""

    async def closed() -> None:
        while servicer.closed < servicer.streams:
            servicer.changed.clear()
            await servicer.changed.wait()

    await asyncio.wait_for(closed(), 10)


async def test_a_datastore_that_stops_acknowledging_fails_the_run() -> None:
    servicer = StandInDatastore(acknowledged=5, hang=True)
    server, port = await serve(servicer)
    try:
        code, out, err = await run(port, "--trials", "2", "--ticks", "20", "--timeout", "0.4")
        assert (code, out) == (1, "")
        assert err == f"Error: the trial datastore at grpc://127.0.0.1:{port} did not answer within 0.4 s\n"
        await wait_closed(servicer)
    finally:
        await server.stop(None)


async def test_a_stream_ended_before_every_acknowledgement_fails_the_run() -> None:
    servicer = StandInDatastore(acknowledged=5)
    server, port = await serve(servicer)
    try:
        code, out, err = await run(port, "--trials", "1", "--ticks", "20", "--seed", "1")
        assert (code, out) == (1, "")
        assert err.startswith(
            f"Error: the trial datastore at grpc://127.0.0.1:{port} ended the datalog stream of trial "
        )
        assert " after acknowledging 5 of its " in err and err.count("\n") == 1
    finally:
        await server.stop(None)


@pytest.mark.parametrize("acknowledged", [0, 3])
async def test_a_failed_stream_fails_the_run_with_its_status(acknowledged: int) -> None:
    servicer = StandInDatastore(acknowledged, grpc.StatusCode.INVALID_ARGUMENT)
    server, port = await serve(servicer)
    try:
        code, out, err = await run(port, "--trials", "3", "--ticks", "20", "--concurrency", "2")
        assert (code, out) == (1, "")
        (line,) = err.splitlines()
        assert line.startswith("Error: recording trial [demo-")
        assert line.endswith(
            f"failed: INVALID_ARGUMENT: the stand-in refuses this sample "
            f"(trial datastore grpc://127.0.0.1:{port})"
        )
        await wait_closed(servicer)
        assert servicer.streams <= 2  # the run stops at the first failure
    finally:
        await server.stop(None)


class StoppedClock:
    """A recorder's clock that stands still but when a test moves it on: a slow machine's delays
    never show on it."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_paced_ticks_wait_without_failing() -> None:
    """Waiting between paced ticks, nothing owed, is no stall, even far past the timeout. Each
    pause waits for its tick's acknowledgement (nothing is owed then), moves the recorder's clock
    on by the tick interval, 100 times the timeout, and lets the watchdog look (it does every
    quarter of the timeout)."""
    servicer = StandInDatastore(acknowledged=10**6)
    server, port = await serve(servicer)
    datastore = DatastoreClient(f"grpc://127.0.0.1:{port}", timeout_s=0.2)
    clock = StoppedClock()
    acknowledged = asyncio.Semaphore(0)
    pauses = 0

    def on_ticks(count: int) -> None:
        for _ in range(count):
            acknowledged.release()

    async def pause(seconds: float) -> None:
        nonlocal pauses
        await acknowledged.acquire()  # the tick's sample acknowledged: nothing is owed
        clock.now += seconds
        pauses += 1
        await asyncio.sleep(0.2)  # the watchdog's turn

    recorder = DatalogRecorder(datastore, "u", tick_interval_s=20.0, clock=clock, pause=pause)
    plan = TrialPlan("paced", 1, 3, players_of(0, 2, local_policies(DEFAULT_MODEL_ID)))
    try:
        recorded = await recorder.record(plan, on_ticks)
        assert (recorded.ticks, pauses, clock.now) == (3, 3, 60.0)
        await wait_closed(servicer)
    finally:
        await datastore.close()
        await server.stop(None)
