"""Health checking of registered services, as the reference does it, without blocking anyone.

Cogment gRPC services are asked `Status(["overall_load"])`, falling back to `Version` for services
that predate `Status`; OTHER_SERVICE and GRPC_SSL endpoints get a TCP connect check. A check is one
attempt with a deadline: a failed check hides the entry at once, and it is removed after
MAX_FAILED_CHECKS failures in a row (one per interval). Permanent entries and COGMENT endpoints are
never checked. The periodic checker runs in every replica and claims due entries from the
database, so the work is shared out rather than repeated.

Each entry is checked and recorded on its own (no batch waits for its slowest member), within a
number of concurrent checks per replica; entries that failed their last check have slots of their
own, so endpoints that accept connections and never answer cannot hold up the checks of healthy
ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time

import grpc
from prometheus_client import Counter

from services.directory.model import (
    CHECK_LEASE_NS,
    GRPC_SERVICE_BY_TYPE,
    GRPC_SSL,
    OTHER_SERVICE,
    CheckResult,
    CheckTarget,
)
from services.directory.store import DirectoryStore
from shared.api import common_pb2
from shared.endpoints import format_host
from shared.load import UNSERVICEABLE
from shared.logging import get_logger
from shared.metrics import PlainHistogram
from shared.supervision import Periodic

GRPC_CHECK_TIMEOUT_S = 2.0
TCP_CHECK_TIMEOUT_S = 5.0
MAX_FAILED_CHECKS = 3
# Concurrent checks per replica: of entries healthy at their last check, and of those that failed it.
HEALTHY_SLOTS = 64
FAILING_SLOTS = 16
TCP_PROBE = b"OPTIONS * HTTP/1.1\r\n\r\n"

log = get_logger("directory.health")
checks_total = Counter("cogment_directory_health_checks_total", "Health checks by outcome.", ["outcome"])
removals_total = Counter(
    "cogment_directory_removed_unhealthy_total", "Entries removed after failing their checks in a row."
)
check_seconds = PlainHistogram(
    "cogment_directory_health_check_seconds",
    "Time a health check took (its timeout at most), by outcome.",
    ["outcome"],
)


def parse_load(text: str | None) -> int:
    """`overall_load` as an unsigned 8-bit decimal; absent or unparsable reads as 0 (healthy)."""
    if text is None or not text.isdecimal():
        return 0
    value = int(text)
    return value if value <= UNSERVICEABLE else 0


async def _grpc_probe(target: CheckTarget, timeout_s: float) -> int | None:
    """The load read from Status (or 0 from Version), or None when the service does not answer."""
    service = GRPC_SERVICE_BY_TYPE[target.service_type]
    address = f"{format_host(target.endpoint.host)}:{target.endpoint.port}"
    async with grpc.aio.insecure_channel(address) as channel:
        status = channel.unary_unary(
            f"/cogmentAPI.{service}/Status",
            request_serializer=common_pb2.StatusRequest.SerializeToString,
            response_deserializer=common_pb2.StatusReply.FromString,
        )
        try:
            reply = await status(common_pb2.StatusRequest(names=["overall_load"]), timeout=timeout_s)
            return parse_load(reply.statuses.get("overall_load"))
        except grpc.aio.AioRpcError:
            pass
        version = channel.unary_unary(
            f"/cogmentAPI.{service}/Version",
            request_serializer=common_pb2.VersionRequest.SerializeToString,
            response_deserializer=common_pb2.VersionInfo.FromString,
        )
        try:
            await version(common_pb2.VersionRequest(), timeout=timeout_s / 2)
            return 0
        except grpc.aio.AioRpcError:
            return None


async def _tcp_probe(target: CheckTarget, timeout_s: float) -> bool:
    """Connect, send a harmless request line and read: any answer or EOF is healthy.

    Unlike the reference, the read has a deadline; a peer that accepts the connection but stays
    silent is listening, so it counts as healthy, and so does one that resets what it accepted (a
    server shedding load closes connections at once: it is there all the same).
    """
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(target.endpoint.host, target.endpoint.port), timeout_s
        )
    except (OSError, asyncio.TimeoutError, UnicodeError, ValueError):
        return False
    try:
        # The connection was accepted: an answer, EOF, silence or a reset, something listens there.
        with contextlib.suppress(OSError, asyncio.TimeoutError):
            writer.write(TCP_PROBE)
            await asyncio.wait_for(writer.drain(), timeout_s)
            await asyncio.wait_for(reader.read(256), timeout_s)
    finally:
        writer.close()
        with contextlib.suppress(OSError, asyncio.TimeoutError):
            await asyncio.wait_for(writer.wait_closed(), 1.0)
    return True


async def check(target: CheckTarget) -> CheckResult:
    """One attempt, within its deadline (the gRPC check's Version fallback included)."""
    if target.service_type == OTHER_SERVICE or target.endpoint.protocol == GRPC_SSL:
        return CheckResult(True, None) if await _tcp_probe(target, TCP_CHECK_TIMEOUT_S) else _FAILED
    try:
        load = await _grpc_probe(target, GRPC_CHECK_TIMEOUT_S)
    except (ValueError, UnicodeError):  # an address grpc cannot even parse
        load = None
    return _FAILED if load is None else CheckResult(True, load)


_FAILED = CheckResult(False, UNSERVICEABLE)


async def _timed_check(target: CheckTarget) -> CheckResult:
    started = time.perf_counter()
    result = await check(target)
    check_seconds.observe(time.perf_counter() - started, _outcome(result))
    return result


def _outcome(result: CheckResult) -> str:
    return "healthy" if result.healthy else "failed"


_Check = asyncio.Task[dict[int, CheckResult]]


class HealthChecker:
    """Claims due entries from the database, checks each, records each outcome."""

    def __init__(self, store: DirectoryStore, interval_s: float, poll_s: float = 1.0) -> None:
        self._store = store
        self._interval_ns = int(interval_s * 1e9)
        # Checks under way, by whether their entry failed its last check.
        self._running: dict[bool, set[_Check]] = {False: set(), True: set()}
        self._rounds_task = Periodic("directory-health-checker", self.check_due, min(poll_s, interval_s))
        self._first_checks: set[_Check] = set()

    def start(self) -> None:
        self._rounds_task.start()

    async def first_check(self, target: CheckTarget, wait_s: float) -> None:
        """Check a new entry (claimed by this replica when it was stored), waiting at most
        `wait_s` for the outcome; the check goes on beyond that, in the background. Should this
        process die first, the claim expires and any replica's periodic checker takes it over."""
        task = asyncio.get_running_loop().create_task(
            self.check_now([target]), name=f"first-check-{target.service_id}"
        )
        self._first_checks.add(task)
        task.add_done_callback(self._first_check_done)
        await asyncio.wait([task], timeout=wait_s)

    def _first_check_done(self, task: _Check) -> None:
        self._first_checks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            # Not lost: the entry's claim expires and the periodic checker checks it.
            log.warning("could not record a first health check", error=str(task.exception()))

    async def stop(self) -> None:
        await self._rounds_task.stop()
        for task in [*self._first_checks, *self._running[False], *self._running[True]]:
            task.cancel()

    async def check_due(self) -> bool:
        """Start checking the due entries there are free slots for; True when a pool filled its
        free slots (more may be due: look again once one is free, `_check_done` wakes us)."""
        now = time.time_ns()
        more = False
        for failing, slots in ((False, HEALTHY_SLOTS), (True, FAILING_SLOTS)):
            running = self._running[failing]
            free = slots - len(running)
            if free <= 0:
                continue
            targets = await self._store.claim_due_checks(now, CHECK_LEASE_NS, free, failing=failing)
            more = more or len(targets) == free
            for target in targets:
                task = asyncio.get_running_loop().create_task(
                    self.check_now([target]), name=f"health-check-{target.service_id}"
                )
                running.add(task)
                task.add_done_callback(functools.partial(self._check_done, running))
        return more

    def _check_done(
        self, running: set[asyncio.Task[dict[int, CheckResult]]], task: asyncio.Task[dict[int, CheckResult]]
    ) -> None:
        running.discard(task)
        if not task.cancelled() and task.exception() is not None:
            # Not lost: the entry's claim expires and it is checked again.
            log.warning("could not record a health check", error=str(task.exception()))
        self._rounds_task.wake()  # a slot is free

    async def check_now(self, targets: list[CheckTarget]) -> dict[int, CheckResult]:
        results = await asyncio.gather(*(_timed_check(target) for target in targets))
        now = time.time_ns()
        removed = await self._store.record_checks(
            list(zip(targets, results, strict=True)), now, now + self._interval_ns, MAX_FAILED_CHECKS
        )
        for target, result in zip(targets, results, strict=True):
            checks_total.labels(_outcome(result)).inc()
            if not result.healthy:
                log.info(
                    "health check failed",
                    service_id=target.service_id,
                    host=target.endpoint.host,
                    port=target.endpoint.port,
                    removed=target.service_id in removed,
                )
        removals_total.inc(len(removed))
        return {target.service_id: result for target, result in zip(targets, results, strict=True)}
