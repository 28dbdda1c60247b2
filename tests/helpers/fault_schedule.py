"""A seeded schedule of network faults between the services and their PostgreSQL and S3, for the
robustness test of issue 29 (tests/shared/test_seeded_fault_schedule.py), in the spirit of etcd's
functional tester and Jepsen: faults drawn at random, and the outcome checked against what was
acknowledged.

The whole schedule is drawn from the seed before anything runs (when each fault starts, on which
proxy, what it is, how long it lasts), so that a seed replays the same faults whatever the timing of
the run; only which statement a lost answer meets depends on the timing. Each fault is logged with
its time as it starts and ends: a failure is read against these lines.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass

from tests.helpers.fault_proxy import FaultProxy

POSTGRESQL = "postgresql"
S3 = "s3"
# A new fault every 1 to 4 s, one at a time per proxy (a fault still on when the next one is due on
# the same proxy is followed at once by it: drawn with the durations, this is rare).
GAP_S = (1.0, 4.0)
DELAY_MS = (20, 300)
DELAY_FOR_S = (1.0, 3.0)
CUT_FOR_S = (0.5, 3.0)
BLACKHOLE_FOR_S = (0.5, 2.0)
# A lost answer not met by then is disarmed (the fault is then over; nothing was lost).
LOST_ANSWER_WAIT_S = 3.0
# What a lost answer is armed on: the datastore's sample batch and the trial a datalog stream
# (re)opens, the registry's version, the directory's entries (new ones a statement of their own,
# permanent ones a transaction). Inside a transaction block, the COMMIT's answer is the one lost. Not
# b"COMMIT" itself: SQLAlchemy's "BEGIN ISOLATION LEVEL READ COMMITTED" would match first, and its
# answer lost leaves the connection waiting for good (the proxy cuts only at the block's end).
LOST_MATCHES = (
    b"json_to_recordset",
    b"INSERT INTO datastore_trials",
    b"INSERT INTO registry_versions",
    b"INSERT INTO directory_services",
)
# PostgreSQL is what every service needs; S3 only the registry.
POSTGRESQL_SHARE = 0.65


class EventLog:
    """Lines stamped with the seconds since the run began, printed as they come (pytest shows them
    with a failure) and kept."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.lines: list[str] = []

    def now(self) -> float:
        return time.monotonic() - self.started

    def __call__(self, what: str) -> None:
        line = f"[{self.now():7.2f} s] {what}"
        self.lines.append(line)
        print(line, flush=True)


@dataclass(frozen=True)
class Fault:
    at_s: float  # after the schedule's start
    target: str  # POSTGRESQL or S3
    kind: str  # delay, cut, blackhole, lost
    for_s: float  # how long it lasts (a lost answer: how long it waits to be met, at most)
    delay_ms: int = 0
    match: bytes = b""

    def __str__(self) -> str:
        if self.kind == "delay":
            return f"{self.target}: delay {self.delay_ms} ms for {self.for_s:.2f} s"
        if self.kind == "lost":
            return f"{self.target}: lose the answer to the next {self.match.decode()!r}"
        return f"{self.target}: {self.kind} for {self.for_s:.2f} s"


def draw_schedule(seed: int, seconds: float) -> list[Fault]:
    """The faults of `seed` over `seconds`, in order of their start."""
    rng = random.Random(seed)
    faults: list[Fault] = []
    at = 0.0
    while True:
        at += rng.uniform(*GAP_S)
        if at >= seconds:
            return faults
        if rng.random() < POSTGRESQL_SHARE:
            kind = rng.choice(["delay", "cut", "blackhole", "lost"])
            target = POSTGRESQL
        else:
            kind = rng.choice(["delay", "cut", "blackhole"])
            target = S3
        if kind == "delay":
            fault = Fault(at, target, kind, rng.uniform(*DELAY_FOR_S), delay_ms=rng.randint(*DELAY_MS))
        elif kind == "cut":
            fault = Fault(at, target, kind, rng.uniform(*CUT_FOR_S))
        elif kind == "blackhole":
            fault = Fault(at, target, kind, rng.uniform(*BLACKHOLE_FOR_S))
        else:
            fault = Fault(at, target, kind, LOST_ANSWER_WAIT_S, match=rng.choice(LOST_MATCHES))
        faults.append(fault)


class FaultSchedule:
    """Runs the faults of a seed on the proxies (`run`), logging each; `ended` is when the last one
    ended (monotonic), every proxy restored."""

    def __init__(self, seed: int, seconds: float, proxies: dict[str, FaultProxy], log: EventLog) -> None:
        self.faults = draw_schedule(seed, seconds)
        self.seconds = seconds
        self.proxies = proxies
        self.log = log
        self.counts: Counter[str] = Counter()
        # Lost answers by outcome: committed, rolled back, not met.
        self.lost: Counter[str] = Counter()
        self.ended = 0.0

    async def run(self) -> None:
        started = time.monotonic()
        self.log(f"fault schedule: {len(self.faults)} faults over {self.seconds:g} s")
        on: dict[str, asyncio.Task[None]] = {}
        try:
            for fault in self.faults:
                await asyncio.sleep(max(0.0, started + fault.at_s - time.monotonic()))
                previous = on.get(fault.target)
                if previous is not None:
                    await previous
                on[fault.target] = asyncio.create_task(self._inject(fault))
            await asyncio.gather(*on.values())
        finally:
            for task in on.values():
                task.cancel()
            for proxy in self.proxies.values():
                proxy.restore()
            self.ended = time.monotonic()
        self.log("fault schedule: over, every proxy restored")

    async def _inject(self, fault: Fault) -> None:
        proxy = self.proxies[fault.target]
        self.counts[f"{fault.target} {fault.kind}"] += 1
        self.log(f"FAULT {fault}")
        if fault.kind == "lost":
            armed = proxy.arm_lost_commit(fault.match)
            try:
                committed = await armed.wait(fault.for_s)
            except TimeoutError as error:
                self.lost["not met" if not armed.matched else "not ended"] += 1
                self.log(f"FAULT {fault.target}: {error}")
                return
            outcome = "committed" if committed else "rolled back"
            self.lost[outcome] += 1
            self.log(f"FAULT {fault.target}: answer lost to {fault.match.decode()!r}, which {outcome}: cut")
            return
        if fault.kind == "delay":
            proxy.delay(fault.delay_ms / 1000)
        elif fault.kind == "cut":
            proxy.cut()
        else:
            proxy.blackhole()
        await asyncio.sleep(fault.for_s)
        proxy.restore()
        self.log(f"FAULT {fault.target}: restored")
