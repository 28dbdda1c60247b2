"""The datalog workload of the seeded fault-schedule test (tests/shared/test_seeded_fault_schedule.py):
trials sent as the orchestrator sends them, followed live on another replica, and checked against
what was acknowledged once the faults are over."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from shared.api import common_pb2, datalog_pb2
from shared.api import trial_datastore_pb2 as ds
from tests.helpers.datastore import datalog_sample, read_samples, trial_params
from tests.helpers.fault_workload import CALL_TIMEOUT_S, RETRIED, RETRY_PAUSE_S, Findings, retried, status_of
from tests.helpers.running import RunningDatastore

# The orchestrator's pace: a few trials at a time, each sending this many samples a second.
TRIALS_AT_ONCE = 3
SAMPLES_PER_S = 15.0
TICKS = (30, 90)
# How long a live reader may take to end once its trial's last sample was acknowledged.
READER_END_S = 20.0


@dataclass
class TrialRun:
    """One trial sent through DatalogSP: ticks 0 to `ticks - 1`, the last one ENDED."""

    trial_id: str
    ticks: int
    acked: int = 0  # samples acknowledged: ticks 0 to acked - 1
    streams: int = 0
    stream_failures: list[str] = field(default_factory=list)
    # The ticks each live reader on the other replica got, in order (one reading per reader).
    readings: list[list[int]] = field(default_factory=list)
    reader_failures: list[str] = field(default_factory=list)
    reader: asyncio.Task[None] | None = None
    done: bool = False


class DatalogWorkload:
    """Trials through the `writer` replica's DatalogSP, TRIALS_AT_ONCE at a time, at the
    orchestrator's pace, each followed live by a RetrieveSamples reader on the `other` replica.

    A stream that fails is followed by a new stream for the same trial, which reopens it and goes on
    where the trial's stored samples end (a client that cannot know what a failed stream committed
    after its last acknowledgement reads it back): every tick is then stored exactly once, and an
    acknowledged sample missing from what is stored is a finding."""

    def __init__(
        self,
        writer: RunningDatastore,
        other: RunningDatastore,
        rng: random.Random,
        findings: Findings,
        prefix: str,
    ) -> None:
        self.writer = writer
        self.other = other
        self.rng = rng
        self.findings = findings
        self.log = findings.log
        self.prefix = prefix
        self.trials: list[TrialRun] = []

    @property
    def samples(self) -> int:
        return sum(trial.acked for trial in self.trials)

    async def run(self, stop: asyncio.Event) -> None:
        """Trials until `stop`; those under way then are finished."""

        async def slot() -> None:
            while not stop.is_set():
                trial = TrialRun(f"{self.prefix}-trial-{len(self.trials)}", self.rng.randint(*TICKS))
                self.trials.append(trial)
                await self._run_trial(trial)

        await asyncio.gather(*(slot() for _ in range(TRIALS_AT_ONCE)))

    async def _run_trial(self, trial: TrialRun) -> None:
        first = 0
        while first < trial.ticks:
            trial.streams += 1
            try:
                await self._stream(trial, first)
                break
            except grpc.aio.AioRpcError as error:
                trial.stream_failures.append(status_of(error))
                self.log(
                    f"datalog {trial.trial_id}: stream failed after {trial.acked} acks: {status_of(error)}"
                )
                if error.code() not in RETRIED:
                    self.findings.violation(f"datalog {trial.trial_id}: stream failed: {status_of(error)}")
                    return
            stored = await self._stored_count(trial)
            if stored is None:
                self.findings.violation(f"datalog {trial.trial_id}: its trial could not be read back")
                return
            if stored < trial.acked:
                self.findings.violation(
                    f"datalog {trial.trial_id}: {trial.acked} samples acknowledged, {stored} stored"
                )
            await asyncio.sleep(RETRY_PAUSE_S)
            first = max(stored, trial.acked)
        trial.done = trial.acked == trial.ticks
        if trial.reader is not None:
            try:
                await asyncio.wait_for(asyncio.shield(trial.reader), READER_END_S)
            except asyncio.TimeoutError:
                self.findings.violation(
                    f"datalog {trial.trial_id}: its live reader did not end {READER_END_S:g} s after "
                    f"the trial's last sample was acknowledged (it had {len(trial.readings)} readings)"
                )
                trial.reader.cancel()

    async def _stream(self, trial: TrialRun, first: int) -> None:
        """One RunTrialDatalog stream: the parameters, then ticks `first` on at the pace, until every
        sample is acknowledged."""
        queue: asyncio.Queue[datalog_pb2.RunTrialDatalogInput | None] = asyncio.Queue()

        async def requests() -> AsyncIterator[datalog_pb2.RunTrialDatalogInput]:
            while (request := await queue.get()) is not None:
                yield request

        sent = first

        async def send() -> None:
            nonlocal sent
            for tick in range(first, trial.ticks):
                await asyncio.sleep(1 / SAMPLES_PER_S)
                state = common_pb2.ENDED if tick == trial.ticks - 1 else common_pb2.RUNNING
                queue.put_nowait(datalog_pb2.RunTrialDatalogInput(sample=datalog_sample(tick, state)))
                sent = tick + 1

        call = self.writer.datalog.RunTrialDatalog(
            requests(), metadata=(("trial-id", trial.trial_id), ("user-id", "fault-schedule"))
        )
        queue.put_nowait(datalog_pb2.RunTrialDatalogInput(trial_params=trial_params()))
        sender: asyncio.Task[None] | None = None
        acks = 0
        try:
            async for _ in call:
                acks += 1
                if acks == 1:  # the trial is (re)opened: stored, readable
                    sender = asyncio.create_task(send())
                    if trial.reader is None:  # it follows the trial through every stream
                        trial.reader = asyncio.create_task(self._read_live(trial))
                    continue
                if first + acks - 1 > sent:
                    self.findings.violation(f"datalog {trial.trial_id}: more acknowledgements than samples")
                trial.acked = first + acks - 1
                if trial.acked == trial.ticks:
                    queue.put_nowait(None)  # done writing: the stream ends
        finally:
            if sender is not None:
                sender.cancel()
        if trial.acked != trial.ticks:
            self.findings.violation(
                f"datalog {trial.trial_id}: the stream ended OK with {trial.acked} of {trial.ticks} "
                "samples acknowledged"
            )

    async def _stored_count(self, trial: TrialRun) -> int | None:
        async def count() -> int:
            request = ds.RetrieveTrialsRequest(trial_ids=[trial.trial_id])
            reply = await self.writer.stub.RetrieveTrials(request, timeout=CALL_TIMEOUT_S)
            return sum(info.samples_count for info in reply.trial_infos)

        return await retried(count, trial.stream_failures)

    async def _read_live(self, trial: TrialRun) -> None:
        """Follow the trial on the other replica until its ENDED sample. A reading that ends before
        (the trial's stream failed, which closes the trial) is followed by another, once the trial
        is reopened."""
        request = ds.RetrieveSamplesRequest(trial_ids=[trial.trial_id])
        while True:
            reading: list[int] = []
            trial.readings.append(reading)
            try:
                async for reply in self.other.stub.RetrieveSamples(request):
                    reading.append(reply.trial_sample.tick_id)
            except grpc.aio.AioRpcError as error:
                trial.reader_failures.append(status_of(error))
                self.log(f"datalog {trial.trial_id}: live reader failed: {status_of(error)}")
                if error.code() not in RETRIED:
                    self.findings.violation(f"datalog {trial.trial_id}: live reader: {status_of(error)}")
                    return
            if reading and reading[-1] == trial.ticks - 1:
                return
            await asyncio.sleep(RETRY_PAUSE_S)

    async def check(self) -> None:
        """Every trial stored exactly as sent, in order, on both replicas; its count agrees; its live
        reader got exactly that."""
        for trial in self.trials:
            if not trial.done:  # not ended: a reader would wait for it
                self.findings.violation(
                    f"datalog {trial.trial_id}: given up with {trial.acked} of {trial.ticks} samples "
                    f"acknowledged after {trial.streams} streams ({trial.stream_failures})"
                )
                continue
            expected = list(range(trial.ticks))
            for name, replica in (("writer", self.writer), ("other", self.other)):
                stored = [sample.tick_id for sample in await read_samples(replica, [trial.trial_id])]
                if stored != expected:
                    self.findings.violation(
                        f"datalog {trial.trial_id}: the {name} replica stores ticks "
                        f"{describe_ticks(stored)}, {len(expected)} acknowledged (streams: "
                        f"{trial.streams}, failures: {trial.stream_failures})"
                    )
                reply = await replica.stub.RetrieveTrials(
                    ds.RetrieveTrialsRequest(trial_ids=[trial.trial_id])
                )
                counts = [info.samples_count for info in reply.trial_infos]
                if counts != [len(stored)]:
                    self.findings.violation(
                        f"datalog {trial.trial_id}: the {name} replica counts {counts} samples, "
                        f"{len(stored)} readable"
                    )
            for number, reading in enumerate(trial.readings):
                last = number == len(trial.readings) - 1
                if reading != expected[: len(reading)] or (last and reading != expected):
                    self.findings.violation(
                        f"datalog {trial.trial_id}: live reading {number + 1} of {len(trial.readings)} got "
                        f"ticks {describe_ticks(reading)}, {len(expected)} stored"
                    )


def describe_ticks(ticks: list[int]) -> str:
    """Ticks as runs (0-41, 40-89): a repeat or a gap shows."""
    runs: list[str] = []
    start = previous = None
    for tick in ticks:
        if previous is not None and tick == previous + 1:
            previous = tick
            continue
        if start is not None:
            runs.append(f"{start}-{previous}" if start != previous else str(start))
        start = previous = tick
    if start is not None:
        runs.append(f"{start}-{previous}" if start != previous else str(start))
    return "[" + ", ".join(runs) + "]"
