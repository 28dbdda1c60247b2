"""Recording the demo's trials into a Trial Datastore as the 2.x orchestrator logs trials: one
`DatalogSP.RunTrialDatalog` stream per trial, with the `trial-id` and `user-id` metadata, its
messages written as they are built and its acknowledgements read as they come (the orchestrator
reads them only to drain them; here they are counted, and a trial is recorded once each of its
messages is acknowledged, that is committed). Several trials are recorded at once.

A stream must make progress within the timeout while it waits for the datastore (a write held
back by flow control, an acknowledgement owed, the end of the stream): a datastore that stops
reading or acknowledging for longer fails the recording. One watchdog per stream checks it, so
that a write or a read costs no timer of its own (each sample takes two of them).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from services.datastore.client.api import TRIAL_ID_METADATA_KEY, DatastoreClient, id_list
from services.demo.orchestration import TrialCounts, TrialPlan
from shared.api import datalog_pb2, datalog_pb2_grpc
from shared.client import ClientError

USER_ID_METADATA_KEY = "user-id"


@dataclass(frozen=True)
class RecordedTrial:
    """A trial whose every datalog message the datastore acknowledged."""

    trial_id: str
    samples: int  # out-of-sync ones included
    ticks: int
    late_rewards: int
    messages: int


@dataclass
class _StreamState:
    """Where a trial's datalog stream is, shared by its writer, its reader and its watchdog."""

    last_progress: float  # the recorder's clock at the last write or acknowledgement
    # Whether each message written and not yet acknowledged is a tick's sample, oldest first.
    unacknowledged: deque[bool] = field(default_factory=deque)
    writing: bool = False  # a write waits for the datastore (flow control)
    finished_writing: bool = False  # the stream's end is owed
    stalled: bool = False  # the watchdog ended the stream

    @property
    def waiting(self) -> bool:
        """Whether the datastore owes the stream something."""
        return self.writing or bool(self.unacknowledged) or self.finished_writing


def _is_tick(message: datalog_pb2.RunTrialDatalogInput) -> bool:
    return message.WhichOneof("msg") == "sample" and not message.sample.info.out_of_sync


# Told how many more ticks were acknowledged (a progress bar's `advance`).
OnTicks = Callable[[int], None]


def _ignore(_count: int) -> None:
    pass


class DatalogRecorder:
    """Records trials through the datastore connection of `datastore`, as user `user_id`, pausing
    `tick_interval_s` after each tick's sample.

    `clock` (seconds; default: the event loop's time) is what a stream's progress is timed with,
    and `pause` (default: `asyncio.sleep`) how it waits between paced ticks: tests give their own."""

    def __init__(
        self,
        datastore: DatastoreClient,
        user_id: str,
        tick_interval_s: float = 0.0,
        *,
        clock: Callable[[], float] | None = None,
        pause: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.datastore = datastore
        self.user_id = user_id
        self.tick_interval_s = tick_interval_s
        self._clock = clock
        self._pause = pause
        self._stub = datalog_pb2_grpc.DatalogSPStub(datastore.channel)

    def _now(self) -> Callable[[], float]:
        """The clock, to call (within the event loop)."""
        return self._clock or asyncio.get_running_loop().time

    async def check_new(self, trial_ids: Sequence[str]) -> None:
        """A ClientError if one of `trial_ids` is stored already: its stream would add samples to
        that trial. (The first call to the datastore: it fails at once when it cannot be reached.)"""
        stored = await self.datastore.trial_infos(trial_ids)
        existing = [trial_id for trial_id in trial_ids if trial_id in stored]
        if existing:
            shown = id_list(existing[:5]) + (f" and {len(existing) - 5} more" if len(existing) > 5 else "")
            raise ClientError(
                f"trials {shown} already exist in the trial datastore at {self.datastore.endpoint}: "
                "choose another --trial_id_prefix"
            )

    async def record_all(
        self, plans: Iterable[TrialPlan], concurrency: int, on_ticks: OnTicks = _ignore
    ) -> list[RecordedTrial]:
        """Record the trials, `concurrency` at once, in the order given; stops at the first
        failure (the trials being recorded then are cut: their streams are cancelled)."""
        pending: Iterator[TrialPlan] = iter(plans)
        recorded: dict[str, RecordedTrial] = {}
        order: list[str] = []

        async def worker() -> None:
            for plan in pending:  # shared: each plan goes to one worker
                order.append(plan.trial_id)
                recorded[plan.trial_id] = await self.record(plan, on_ticks)

        workers = [asyncio.ensure_future(worker()) for _ in range(max(concurrency, 1))]
        try:
            done, _ = await asyncio.wait(workers, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                task.result()  # the first failure, if any
            await asyncio.gather(*workers)
        finally:
            for task in workers:
                task.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
        return [recorded[trial_id] for trial_id in order]

    async def record(self, plan: TrialPlan, on_ticks: OnTicks = _ignore) -> RecordedTrial:
        """Stream one trial's datalog and wait until the datastore acknowledged all of it;
        `on_ticks(1)` is told each tick's sample acknowledged."""
        counts = TrialCounts()
        call = self._stub.RunTrialDatalog(
            metadata=((TRIAL_ID_METADATA_KEY, plan.trial_id), (USER_ID_METADATA_KEY, self.user_id))
        )
        state = _StreamState(self._now()())
        writer = asyncio.ensure_future(self._write(call, plan, counts, state))
        reader = asyncio.ensure_future(self._read_acknowledgements(call, state, on_ticks))
        watchdog = asyncio.ensure_future(self._watch(call, state))
        try:
            await asyncio.wait([writer, reader], return_when=asyncio.FIRST_EXCEPTION)
            if state.stalled:
                raise ClientError(self.datastore.no_answer())
            # The datastore's own status says most: its error first, then the writer's.
            for task in (reader, writer):
                if task.done() and not task.cancelled() and task.exception() is not None:
                    await task
            written = await writer
            acknowledged = await reader
        except grpc.aio.AioRpcError as error:
            what = f"recording trial [{plan.trial_id}]"
            raise ClientError(self.datastore.describe_rpc_error(error, what)) from None
        finally:
            tasks: list[asyncio.Future[Any]] = [writer, reader, watchdog]
            for stopped in tasks:
                stopped.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            call.cancel()
        expected = counts.samples + 1  # the parameters, then the samples
        if acknowledged != expected or written != expected:
            raise ClientError(
                f"the trial datastore at {self.datastore.endpoint} ended the datalog stream of trial "
                f"[{plan.trial_id}] after acknowledging {acknowledged} of its {expected} messages"
            )
        return RecordedTrial(
            plan.trial_id, counts.samples, counts.ticks, counts.late_rewards, counts.messages
        )

    async def _write(
        self, call: grpc.aio.StreamStreamCall, plan: TrialPlan, counts: TrialCounts, state: _StreamState
    ) -> int:
        """Write the trial's messages, then close the writing side; how many were written (fewer
        than all when the datastore ended the stream first: its status says why)."""
        now = self._now()
        written = 0
        try:
            for message in plan.datalog_inputs(counts):
                tick = _is_tick(message)
                state.unacknowledged.append(tick)
                state.writing = True
                state.last_progress = now()
                await call.write(message)
                state.writing = False
                state.last_progress = now()
                written += 1
                if tick and self.tick_interval_s:
                    await self._pause(self.tick_interval_s)
            state.finished_writing = True
            state.last_progress = now()
            await call.done_writing()
        except asyncio.InvalidStateError:
            pass  # the stream ended
        return written

    async def _read_acknowledgements(
        self, call: grpc.aio.StreamStreamCall, state: _StreamState, on_ticks: OnTicks
    ) -> int:
        """Read acknowledgements until the datastore ends the stream; how many came (raises the
        stream's error)."""
        now = self._now()
        acknowledged = 0
        while await call.read() is not grpc.aio.EOF:
            acknowledged += 1
            state.last_progress = now()
            if state.unacknowledged and state.unacknowledged.popleft():
                on_ticks(1)
        return acknowledged

    async def _watch(self, call: grpc.aio.StreamStreamCall, state: _StreamState) -> None:
        """End the stream once the datastore has owed it something for longer than the timeout
        (waiting while nothing is owed, between paced ticks, is not a failure)."""
        now = self._now()
        timeout_s = self.datastore.timeout_s
        while True:
            await asyncio.sleep(timeout_s / 4)
            if state.waiting and now() - state.last_progress > timeout_s:
                state.stalled = True
                call.cancel()
                return
