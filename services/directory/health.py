"""Health checking of registered services, as the reference does it, without blocking anyone.

Cogment gRPC services are asked `Status(["overall_load"])`, falling back to `Version` for services
that predate `Status`; OTHER_SERVICE and GRPC_SSL endpoints get a TCP connect check. Each check is
up to `rounds` attempts with doubling deadlines. Permanent entries and COGMENT endpoints are never
checked. The periodic checker runs in every replica and claims due entries from the database, so
the work is shared out rather than repeated.
"""

from __future__ import annotations

import asyncio
import contextlib
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
from shared.supervision import Periodic

GRPC_CHECK_TIMEOUT_S = 2.0
TCP_CHECK_TIMEOUT_S = 5.0
MAX_FAILED_CHECKS = 3
CLAIM_BATCH = 100
CONCURRENT_CHECKS = 64
TCP_PROBE = b"OPTIONS * HTTP/1.1\r\n\r\n"

log = get_logger("directory.health")
checks_total = Counter("cogment_directory_health_checks_total", "Health checks by outcome.", ["outcome"])
removals_total = Counter(
    "cogment_directory_removed_unhealthy_total", "Entries removed after failing their checks in a row."
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
    silent is listening, so it counts as healthy.
    """
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(target.endpoint.host, target.endpoint.port), timeout_s
        )
    except (OSError, asyncio.TimeoutError, UnicodeError, ValueError):
        return False
    try:
        writer.write(TCP_PROBE)
        await asyncio.wait_for(writer.drain(), timeout_s)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(reader.read(256), timeout_s)
        return True
    except OSError:
        return False
    finally:
        writer.close()
        with contextlib.suppress(OSError, asyncio.TimeoutError):
            await asyncio.wait_for(writer.wait_closed(), 1.0)


async def check(target: CheckTarget, rounds: int) -> CheckResult:
    """Up to `rounds` attempts, each with twice the previous deadline."""
    tcp = target.service_type == OTHER_SERVICE or target.endpoint.protocol == GRPC_SSL
    for attempt in range(rounds):
        if tcp:
            if await _tcp_probe(target, TCP_CHECK_TIMEOUT_S * 2**attempt):
                return CheckResult(True, None)
        else:
            try:
                load = await _grpc_probe(target, GRPC_CHECK_TIMEOUT_S * 2**attempt)
            except (ValueError, UnicodeError):  # an address grpc cannot even parse
                load = None
            if load is not None:
                return CheckResult(True, load)
    return CheckResult(False, UNSERVICEABLE)


class HealthChecker:
    """Claims due entries from the database, checks them, records the outcomes."""

    def __init__(
        self, store: DirectoryStore, interval_s: float, rounds: int = 3, poll_s: float = 1.0
    ) -> None:
        self._store = store
        self._interval_ns = int(interval_s * 1e9)
        self._rounds = rounds
        self._limit = asyncio.Semaphore(CONCURRENT_CHECKS)
        self._rounds_task = Periodic("directory-health-checker", self.check_due, min(poll_s, interval_s))
        self._first_checks: set[asyncio.Task[dict[int, CheckResult]]] = set()

    def start(self) -> None:
        self._rounds_task.start()

    async def first_check(self, target: CheckTarget, wait_s: float) -> None:
        """Check a new entry (claimed by this replica when it was stored), waiting at most
        `wait_s` for the outcome; the check goes on beyond that, in the background. Should this
        process die first, the claim expires and any replica's periodic checker takes it over."""
        task = asyncio.get_running_loop().create_task(
            self.check_now([target], self._rounds), name=f"first-check-{target.service_id}"
        )
        self._first_checks.add(task)
        task.add_done_callback(self._first_check_done)
        await asyncio.wait([task], timeout=wait_s)

    def _first_check_done(self, task: asyncio.Task[dict[int, CheckResult]]) -> None:
        self._first_checks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            # Not lost: the entry's claim expires and the periodic checker checks it.
            log.warning("could not record a first health check", error=str(task.exception()))

    async def stop(self) -> None:
        await self._rounds_task.stop()
        for task in list(self._first_checks):
            task.cancel()

    async def check_due(self) -> int:
        """Check one batch of due entries; returns how many were checked."""
        now = time.time_ns()
        targets = await self._store.claim_due_checks(now, CHECK_LEASE_NS, CLAIM_BATCH)
        if targets:
            await self.check_now(targets, self._rounds)
        return len(targets)

    async def check_now(self, targets: list[CheckTarget], rounds: int) -> dict[int, CheckResult]:
        async def bounded(target: CheckTarget) -> CheckResult:
            async with self._limit:
                return await check(target, rounds)

        results = await asyncio.gather(*(bounded(target) for target in targets))
        now = time.time_ns()
        removed = await self._store.record_checks(
            list(zip(targets, results, strict=True)), now, now + self._interval_ns, MAX_FAILED_CHECKS
        )
        for target, result in zip(targets, results, strict=True):
            checks_total.labels("healthy" if result.healthy else "failed").inc()
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
