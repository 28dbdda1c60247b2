"""The clients of the seeded fault-schedule test (tests/shared/test_seeded_fault_schedule.py): each
workload drives one service as its real clients do while the faults run, records what was
acknowledged to it, and checks afterwards that exactly that is stored.

A call that fails with UNAVAILABLE or DEADLINE_EXCEEDED is retried, as a client does; any other
status is a finding. What each workload finds wrong goes to the shared `Findings`; a finding is
logged when it is made, so that it can be read against the faults' lines.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import grpc

from shared.api import directory_pb2
from shared.api import model_registry_pb2 as mr
from tests.helpers.digest import sha256_b64
from tests.helpers.eventually import eventually
from tests.helpers.fault_schedule import EventLog
from tests.helpers.health import SERVING, health
from tests.helpers.registry import upload_messages
from tests.helpers.running import RunningDirectory, RunningRegistry

T = TypeVar("T")

RETRIED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
# How long the follower may take to get the last version once the uploads stopped.
FOLLOWER_CATCH_UP_S = 10.0
# A read's deadline. A write's is longer than the services' --outage_bound (20 s): a service riding
# an outage out answers it first (OK, or UNAVAILABLE past the bound), and a client's retry then never
# races a first attempt still being written (which the protocol gives no way to tell apart), so that
# a write made twice is the service's doing. A write still unanswered then hangs: a finding of its own.
CALL_TIMEOUT_S = 10.0
WRITE_TIMEOUT_S = 30.0
# How long a client keeps retrying a call before it gives up (a call given up is not acknowledged:
# reported, never a finding by itself).
GIVE_UP_S = 40.0
RETRY_PAUSE_S = 0.3


class Findings:
    """What went wrong, in the order it was found."""

    def __init__(self, log: EventLog) -> None:
        self.log = log
        self.violations: list[str] = []

    def violation(self, what: str) -> None:
        self.violations.append(what)
        self.log(f"VIOLATION {what}")


def status_of(error: grpc.aio.AioRpcError) -> str:
    return f"{error.code().name}: {error.details()}"


async def retried(call: Callable[[], Awaitable[T]], failures: list[str]) -> T | None:
    """`call()`, again after UNAVAILABLE or DEADLINE_EXCEEDED (each failure's status appended to
    `failures`), for up to GIVE_UP_S; None once given up. Other statuses are raised."""
    started = time.monotonic()
    while True:
        try:
            return await call()
        except grpc.aio.AioRpcError as error:
            if error.code() not in RETRIED:
                raise
            failures.append(status_of(error))
            if time.monotonic() - started > GIVE_UP_S:
                return None
            await asyncio.sleep(RETRY_PAUSE_S)


class HealthWatch:
    """The grpc.health.v1 status of each service, polled; each change logged. A health call that
    fails is a finding: the process serves health whatever its dependencies."""

    PERIOD_S = 0.25

    def __init__(self, channels: dict[str, grpc.aio.Channel], findings: Findings) -> None:
        self.channels = channels
        self.findings = findings
        self.statuses: dict[str, int | None] = dict.fromkeys(channels)
        self.changes = 0

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await asyncio.gather(*(self._poll(name) for name in self.channels))
            await asyncio.sleep(self.PERIOD_S)

    async def _poll(self, name: str) -> None:
        try:
            status: int | None = await health(self.channels[name])
        except grpc.aio.AioRpcError as error:
            self.findings.violation(f"health of {name}: {status_of(error)}")
            status = None
        if status != self.statuses[name]:
            self.findings.log(f"health {name}: {'SERVING' if status == SERVING else status}")
            self.statuses[name] = status
            self.changes += 1

    async def serving_after(self, since: float, timeout_s: float) -> dict[str, float]:
        """Seconds from `since` (monotonic) until each service answered SERVING (each polled every
        50 ms); a service not SERVING within `timeout_s` is missing."""
        back: dict[str, float] = {}
        deadline = since + timeout_s
        while len(back) < len(self.channels) and time.monotonic() < deadline:
            for name, channel in self.channels.items():
                if name not in back:
                    try:
                        if await health(channel) == SERVING:
                            back[name] = time.monotonic() - since
                    except grpc.aio.AioRpcError:
                        pass
            await asyncio.sleep(0.05)
        return back


@dataclass
class Upload:
    """One version's data, uploaded (CreateVersion with its size and hash) until acknowledged."""

    index: int
    size: int
    digest: str  # base64 SHA-256, as the registry reports it
    number: int | None = None  # once acknowledged
    failures: list[str] = field(default_factory=list)


class RegistryWorkload:
    """Versions of one model uploaded one after the other, each retried with the same data until
    acknowledged; downloads of acknowledged versions; a VersionUpdate follower."""

    SIZES = (16 * 1024, 2 * 1024 * 1024)
    PAUSE_S = (0.2, 0.8)

    def __init__(
        self, registry: RunningRegistry, rng: random.Random, findings: Findings, model_id: str
    ) -> None:
        self.registry = registry
        self.rng = rng
        self.findings = findings
        self.log = findings.log
        self.model_id = model_id
        self.uploads: list[Upload] = []
        self.downloads = 0
        self.failed_downloads = 0
        # The numbers each VersionUpdate stream got, in order (one list per stream).
        self.followed: list[list[int]] = []
        self._unfollow = asyncio.Event()
        self._follower: asyncio.Task[None] | None = None

    @property
    def acknowledged(self) -> list[Upload]:
        return [upload for upload in self.uploads if upload.number is not None]

    async def start(self) -> None:
        """The model and its follower, before any fault (the follower runs until `check`)."""
        info = mr.ModelInfo(model_id=self.model_id)
        await self.registry.stub.CreateOrUpdateModel(mr.CreateOrUpdateModelRequest(model_info=info))
        self._follower = asyncio.create_task(self._follow(self._unfollow))

    async def run(self, stop: asyncio.Event) -> None:
        await asyncio.gather(self._upload_all(stop), self._download_all(stop))

    async def _upload_all(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            data = self.rng.randbytes(self.rng.randint(*self.SIZES))
            upload = Upload(len(self.uploads), len(data), sha256_b64(data))
            self.uploads.append(upload)

            async def create(data: bytes = data) -> mr.CreateVersionReply:
                messages = upload_messages(self.model_id, data)

                async def requests() -> AsyncIterator[mr.CreateVersionRequestChunk]:
                    for message in messages:
                        yield message

                reply: mr.CreateVersionReply = await self.registry.stub.CreateVersion(
                    requests(), timeout=WRITE_TIMEOUT_S
                )
                return reply

            try:
                reply = await retried(create, upload.failures)
            except grpc.aio.AioRpcError as error:
                self.findings.violation(f"registry: upload {upload.index} refused: {status_of(error)}")
                continue
            if upload.failures:
                self.log(
                    f"registry: upload {upload.index} failed {len(upload.failures)} times: {upload.failures}"
                )
            if reply is None:
                self.log(f"registry: upload {upload.index} given up")
                continue
            info = reply.version_info
            upload.number = info.version_number
            if (info.data_size, info.data_hash) != (upload.size, upload.digest):
                self.findings.violation(f"registry: upload {upload.index} acknowledged as {info}")
            await asyncio.sleep(self.rng.uniform(*self.PAUSE_S))

    async def _download_all(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await asyncio.sleep(self.rng.uniform(*self.PAUSE_S))
            if not self.acknowledged:
                continue
            upload = self.rng.choice(self.acknowledged)
            assert upload.number is not None
            try:
                data = await download(self.registry, self.model_id, upload.number, CALL_TIMEOUT_S)
            except grpc.aio.AioRpcError as error:
                if error.code() not in RETRIED:
                    self.findings.violation(
                        f"registry: download of version {upload.number}: {status_of(error)}"
                    )
                self.failed_downloads += 1
                continue
            self.downloads += 1
            if (len(data), sha256_b64(data)) != (upload.size, upload.digest):
                self.findings.violation(f"registry: version {upload.number} downloaded with other data")

    async def _follow(self, stop: asyncio.Event) -> None:
        request = mr.VersionUpdateRequest(model_id=self.model_id)
        while not stop.is_set():
            numbers: list[int] = []
            self.followed.append(numbers)
            call = self.registry.stub.VersionUpdate(request)
            stopping = asyncio.create_task(stop.wait())
            try:
                async for reply in _until(call, stopping):
                    numbers.append(reply.version_info.version_number)
            except grpc.aio.AioRpcError as error:
                self.log(f"registry: VersionUpdate failed: {status_of(error)}")
                if error.code() not in RETRIED:
                    self.findings.violation(f"registry: VersionUpdate: {status_of(error)}")
                    return
                await asyncio.sleep(RETRY_PAUSE_S)
            finally:
                call.cancel()
                stopping.cancel()

    async def check(self) -> None:
        """Every acknowledged version listed as acknowledged; every listed version downloads whole,
        of its listed size and hash; no data twice; a follower saw every version after its first."""
        reply = await self.registry.stub.RetrieveVersionInfos(
            mr.RetrieveVersionInfosRequest(model_id=self.model_id), timeout=CALL_TIMEOUT_S
        )
        listed = {info.version_number: info for info in reply.version_infos}
        by_digest = {upload.digest: upload for upload in self.uploads}
        numbers_of: dict[str, list[int]] = {}
        for number, info in sorted(listed.items()):
            numbers_of.setdefault(info.data_hash, []).append(number)
            data = await download(self.registry, self.model_id, number, CALL_TIMEOUT_S)
            if (len(data), sha256_b64(data)) != (info.data_size, info.data_hash):
                self.findings.violation(f"registry: version {number} listed as {info}, downloads otherwise")
            if info.data_hash not in by_digest:
                self.findings.violation(f"registry: version {number} holds data nobody uploaded")
        for digest, numbers in numbers_of.items():
            if len(numbers) > 1 and digest in by_digest:
                upload = by_digest[digest]
                self.findings.violation(
                    f"registry: the data of upload {upload.index} is versions {numbers} (acknowledged as "
                    f"{upload.number}, after failures {upload.failures})"
                )
        for upload in self.acknowledged:
            info = listed.get(upload.number or 0)
            if info is None or info.data_hash != upload.digest:
                self.findings.violation(
                    f"registry: acknowledged version {upload.number} is not listed as made"
                )
        await self._check_follower(max(listed, default=0))

    async def _check_follower(self, latest: int) -> None:
        """A VersionUpdate stream sends the latest version, then every newer one; the last stream
        gets to the latest version."""

        def caught_up() -> bool:
            return bool(self.followed and self.followed[-1] and self.followed[-1][-1] == latest)

        try:
            await eventually(caught_up, "the follower to get the latest version", FOLLOWER_CATCH_UP_S)
        except AssertionError:
            self.findings.violation(f"registry: the follower got {self.followed}, the latest is {latest}")
        self._unfollow.set()
        if self._follower is not None:
            await self._follower
        for numbers in self.followed:
            if numbers and numbers != list(range(numbers[0], numbers[0] + len(numbers))):
                self.findings.violation(f"registry: a VersionUpdate stream got {numbers}")


async def _until(call: AsyncIterator[T], stopping: asyncio.Task[bool]) -> AsyncIterator[T]:
    """The items of `call` until `stopping` is done."""
    iterator = call.__aiter__()
    while True:
        item = asyncio.ensure_future(anext(iterator))
        await asyncio.wait([item, stopping], return_when=asyncio.FIRST_COMPLETED)
        if not item.done():
            item.cancel()
            return
        try:
            yield item.result()
        except StopAsyncIteration:
            return


async def download(registry: RunningRegistry, model_id: str, number: int, timeout_s: float) -> bytes:
    request = mr.RetrieveVersionDataRequest(model_id=model_id, version_number=number)
    call = registry.stub.RetrieveVersionData(request, timeout=timeout_s)
    return b"".join([chunk.data_chunk async for chunk in call])


@dataclass
class Registered:
    """One registration (unique by its property), registered until acknowledged."""

    index: int
    key: str
    permanent: bool
    service_id: int | None = None
    secret: str = ""
    failures: list[str] = field(default_factory=list)
    # Deregistration: asked (a failure of which leaves it unknown), then acknowledged.
    deregistering: bool = False
    deregistered: bool = False


class DirectoryWorkload:
    """Registrations (some permanent), inquiries of acknowledged ones by their property, and
    deregistration of some of them."""

    PAUSE_S = (0.1, 0.4)
    PERMANENT_SHARE = 0.25
    DEREGISTERED_SHARE = 0.25
    PROPERTY = "fault-schedule"

    def __init__(
        self, directory: RunningDirectory, rng: random.Random, findings: Findings, prefix: str
    ) -> None:
        self.directory = directory
        self.rng = rng
        self.findings = findings
        self.log = findings.log
        self.prefix = prefix
        self.entries: list[Registered] = []
        self.inquiries = 0
        self.odd_inquiries: list[str] = []

    @property
    def acknowledged(self) -> list[Registered]:
        return [entry for entry in self.entries if entry.service_id is not None]

    async def run(self, stop: asyncio.Event) -> None:
        await asyncio.gather(self._register_all(stop), self._inquire_all(stop))

    def _request(self, entry: Registered) -> directory_pb2.RegisterRequest:
        return directory_pb2.RegisterRequest(
            endpoint=directory_pb2.ServiceEndpoint(
                protocol=directory_pb2.ServiceEndpoint.COGMENT, host="fault-schedule", port=1 + entry.index
            ),
            details=directory_pb2.ServiceDetails(
                type=directory_pb2.ACTOR_SERVICE, properties={self.PROPERTY: entry.key}
            ),
            permanent=entry.permanent,
        )

    async def _register_all(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            index = len(self.entries)
            entry = Registered(index, f"{self.prefix}-{index}", self.rng.random() < self.PERMANENT_SHARE)
            self.entries.append(entry)
            request = self._request(entry)

            async def register(
                request: directory_pb2.RegisterRequest = request,
            ) -> list[directory_pb2.RegisterReply]:
                return [
                    reply
                    async for reply in self.directory.stub.Register(_one(request), timeout=WRITE_TIMEOUT_S)
                ]

            try:
                replies = await retried(register, entry.failures)
            except grpc.aio.AioRpcError as error:
                self.findings.violation(f"directory: registration {entry.key}: {status_of(error)}")
                continue
            if entry.failures:
                self.log(
                    f"directory: registration {entry.key} failed {len(entry.failures)} times: "
                    f"{entry.failures}"
                )
            if replies is None:
                self.log(f"directory: registration {entry.key} given up")
            elif [reply.status for reply in replies] != [directory_pb2.RegisterReply.OK]:
                self.findings.violation(f"directory: registration {entry.key} answered {replies}")
            else:
                entry.service_id, entry.secret = replies[0].service_id, replies[0].secret
            await asyncio.sleep(self.rng.uniform(*self.PAUSE_S))

    async def _inquire_all(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await asyncio.sleep(self.rng.uniform(*self.PAUSE_S))
            standing = [entry for entry in self.acknowledged if not entry.deregistering]
            if not standing:
                continue
            entry = self.rng.choice(standing)
            if self.rng.random() < self.DEREGISTERED_SHARE:
                await self._deregister(entry)
                continue
            try:
                found = await self._inquire(entry)
            except grpc.aio.AioRpcError as error:
                if error.code() not in RETRIED:
                    self.findings.violation(f"directory: inquiry of {entry.key}: {status_of(error)}")
                continue
            self.inquiries += 1
            if found != [entry.service_id] and not entry.deregistering:
                # Said, not a finding by itself: the check after the faults is.
                self.odd_inquiries.append(f"{entry.key} (id {entry.service_id}) inquired as {found}")
                self.log(f"directory: {entry.key} (id {entry.service_id}) inquired as {found}")

    async def _inquire(self, entry: Registered) -> list[int]:
        details = directory_pb2.ServiceDetails(
            type=directory_pb2.ACTOR_SERVICE, properties={self.PROPERTY: entry.key}
        )
        call = self.directory.stub.Inquire(
            directory_pb2.InquireRequest(details=details), timeout=CALL_TIMEOUT_S
        )
        return [reply.data.service_id async for reply in call]

    async def _deregister(self, entry: Registered) -> None:
        entry.deregistering = True
        assert entry.service_id is not None
        request = directory_pb2.DeregisterRequest(service_id=entry.service_id, secret=entry.secret)
        failures: list[str] = []

        async def deregister() -> list[directory_pb2.DeregisterReply]:
            return [
                reply
                async for reply in self.directory.stub.Deregister(_one(request), timeout=WRITE_TIMEOUT_S)
            ]

        try:
            replies = await retried(deregister, failures)
        except grpc.aio.AioRpcError as error:
            self.findings.violation(f"directory: deregistration of {entry.key}: {status_of(error)}")
            return
        if replies is None:
            self.log(f"directory: deregistration of {entry.key} given up ({failures})")
            return
        ok = [reply.status for reply in replies] == [directory_pb2.DeregisterReply.OK]
        # A retry after a failure whose outcome is unknown may find it gone: the check says.
        if not ok and not failures:
            self.findings.violation(f"directory: deregistration of {entry.key} answered {replies}")
        entry.deregistered = ok or bool(failures)

    async def check(self) -> None:
        """Every acknowledged registration inquirable, once, by its property, unless deregistered;
        none of those given up there twice."""
        for entry in self.entries:
            found = await self._inquire(entry)
            expected: list[int]
            if entry.deregistered:
                expected = []
            elif entry.service_id is not None and not entry.deregistering:
                expected = [entry.service_id]
            else:  # given up, or its deregistration given up: there once at most
                expected = found[:1]
            if found != expected:
                self.findings.violation(
                    f"directory: {'permanent ' if entry.permanent else ''}registration {entry.key} "
                    f"(acknowledged as {entry.service_id}, deregistered: {entry.deregistered}, after "
                    f"failures {entry.failures}) is inquired as {found}"
                )


async def _one(item: T) -> AsyncIterator[T]:
    yield item
