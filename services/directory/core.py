"""The directory's rules: who may see and remove what, permanent entries, ordering and load
balancing. Requests arrive here already validated by the gRPC layer."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import hashlib
import hmac
import random
import time
from collections.abc import AsyncIterator

from prometheus_client import Counter

from services.directory.entry_sql import IndexRow
from services.directory.health import HealthChecker
from services.directory.index import EntrySource, FollowedIndex
from services.directory.model import COGMENT, CheckTarget, Entry, Inquiry, Registration
from services.directory.store import DirectoryStore
from shared.digest import sha256_hex
from shared.errors import NotFound, PermissionDenied
from shared.load import UNSERVICEABLE
from shared.logging import get_logger
from shared.metrics import PlainCounter

# A result checked this recently is reused by `check_on_inquire` (as in the reference).
RECENT_CHECK_NS = 100_000_000
# How long Register waits for a new entry's first health check.
DEFAULT_FIRST_CHECK_WAIT_S = 1.0
# Tokens whose digests are remembered at most (all are forgotten past it), and the longest
# remembered: 4,096 tokens of 256 characters at most.
TOKEN_DIGESTS_REMEMBERED = 4096
REMEMBERED_TOKEN_CHARS = 256
# Load balancing keeps entries within this much of the least loaded one.
ACCEPTABLE_LOAD_RANGE = 10

log = get_logger("directory.core")
registrations_total = Counter(
    "cogment_directory_registrations_total", "Registrations by outcome.", ["outcome"]
)
deregistrations_total = Counter(
    "cogment_directory_deregistrations_total", "Deregistrations by outcome.", ["outcome"]
)
# Inquiries are the hot path: a plain count (see shared.metrics).
inquiries_total = PlainCounter(
    "cogment_directory_inquiries_total",
    "Inquiries answered, by where from (memory: the index; remembered: a remembered answer; "
    "database) and whether they found entries.",
    ["source", "outcome"],
)


def keyed_digest(key: bytes, token_digest: str) -> str:
    """What a token is stored and compared as: HMAC-SHA256 of its SHA-256 (hex), so that a copy of
    the database cannot be searched for weak tokens, and earlier releases' unkeyed digests could
    be converted in place (DirectoryStore.key_token_digests)."""
    return hmac.new(key, token_digest.encode("ascii"), hashlib.sha256).hexdigest()


def derive_secret(key: bytes, service_id: int, nonce: str) -> str:
    """The secret of an entry: 256 bits, URL-safe, never stored (only its nonce is)."""
    mac = hmac.new(key, f"{service_id}:{nonce}".encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(mac).rstrip(b"=").decode("ascii")


class Directory:
    def __init__(
        self,
        store: DirectoryStore,
        checker: HealthChecker,
        secret_key: bytes,
        *,
        force_permanent: bool = False,
        load_balancing: bool = False,
        check_on_inquire: bool = False,
        registration_lag_s: int = 0,
        first_check_wait_s: float = DEFAULT_FIRST_CHECK_WAIT_S,
        index: FollowedIndex | None = None,
    ) -> None:
        """`index`: inquiries are answered from it while it is current, else from the store."""
        self._store = store
        self._index = index
        self._checker = checker
        self._secret_key = secret_key
        self.force_permanent = force_permanent
        self.load_balancing = load_balancing
        self.check_on_inquire = check_on_inquire
        self.registration_lag_s = registration_lag_s
        self.first_check_wait_s = first_check_wait_s
        self._token_digests: dict[str, str] = {}

    async def register(self, registration: Registration, token: str) -> tuple[int, str]:
        """Store the registration; returns (service id, secret). The first health check of a
        checked kind is waited for at most `first_check_wait_s`."""
        if self.force_permanent and not registration.permanent:
            registration = Registration(
                registration.endpoint, registration.service_type, registration.properties, permanent=True
            )
        token_digest = self._token_digest(token)
        registered_at = time.time_ns()
        service_id, nonce, created = await self._store.add(registration, token_digest, registered_at)
        registrations_total.labels("created" if created else "updated").inc()
        log.debug(
            "registered",
            service_id=service_id,
            type=registration.service_type,
            host=registration.endpoint.host,
            port=registration.endpoint.port,
            permanent=registration.permanent,
            updated_in_place=not created,
        )
        if registration.health_checked:
            # Hidden until a check passes: a live service is inquirable once Register returns,
            # and an endpoint that does not answer is never handed out.
            target = CheckTarget(service_id, registration.endpoint, registration.service_type, 0, 0)
            await self._checker.first_check(target, self.first_check_wait_s)
            await self._caught_up()
        elif created and not registration.permanent and self._index is not None:
            # A new entry nothing else can have changed yet (its id is not out, nobody checks
            # it): into the index as written, without reading it back.
            entry = Entry(
                service_id,
                registration.endpoint,
                registration.service_type,
                registration.properties,
                permanent=False,
                registered_at=registered_at,
            )
            self._index.put_new(IndexRow(entry, token_digest, visible=True))
        else:
            await self._caught_up()  # a permanent entry, maybe changed in place by others too
        return service_id, derive_secret(self._secret_key, service_id, nonce)

    async def _caught_up(self) -> None:
        """Read-your-writes: what this replica wrote is in its index before the answer goes out."""
        if self._index is not None:
            await self._index.caught_up()

    def _token_digest(self, token: str) -> str:
        # Every call digests its token: remembered, as clients are few and reuse theirs (short
        # ones only: a client may send megabytes as a token).
        digest = self._token_digests.get(token)
        if digest is None:
            digest = keyed_digest(self._secret_key, sha256_hex(token))
            if len(token) <= REMEMBERED_TOKEN_CHARS:
                if len(self._token_digests) >= TOKEN_DIGESTS_REMEMBERED:
                    self._token_digests.clear()
                self._token_digests[token] = digest
        return digest

    async def deregister(self, service_id: int, secret: str, token: str) -> None:
        credentials = await self._store.credentials(service_id)
        if credentials is None:
            deregistrations_total.labels("unknown").inc()
            raise NotFound(
                f"Failed to deregister service ID [{service_id}]: Unknown service ID [{service_id}]"
            )
        token_digest, nonce = credentials
        expected = derive_secret(self._secret_key, service_id, nonce)
        token_ok = hmac.compare_digest(token_digest, self._token_digest(token))
        secret_ok = hmac.compare_digest(expected.encode(), secret.encode("utf-8", "surrogatepass"))
        if not (token_ok and secret_ok):
            deregistrations_total.labels("refused").inc()
            raise PermissionDenied(f"Failed to deregister service ID [{service_id}]: Authentication failure")
        await self._store.remove(service_id)
        await self._caught_up()
        deregistrations_total.labels("removed").inc()
        log.debug("deregistered", service_id=service_id)

    async def inquire(self, inquiry: Inquiry, token: str) -> AsyncIterator[list[Entry]]:
        """Healthy matching entries visible with `token`, in pages: most recent first, or load
        balanced (each page shuffled). With a registration lag, an inquiry that finds nothing
        looks again every second for that many seconds."""
        token_digest = self._token_digest(token)
        if not inquiry.can_match:
            inquiries_total.inc(self._source_name(), "none")
            return  # nothing to wait for: the registration lag does not apply
        for attempt in range(self.registration_lag_s + 1):
            if attempt:
                await asyncio.sleep(1.0)
            source: EntrySource = self._store
            if self._index is not None and self._index.current:
                source = self._index
            lowest: int | None = None
            if self.load_balancing and inquiry.service_id is None:
                lowest = await source.lowest_load(inquiry, token_digest)
                if lowest is None:
                    continue
            found = False
            async for matches in source.find(inquiry, token_digest):
                page = await self._recheck(matches) if self.check_on_inquire else matches
                if self.load_balancing:
                    page = self._balance(page, lowest)
                if page:
                    found = True
                    yield page
            if found:
                inquiries_total.inc(self._source_name(source), "found")
                return
        inquiries_total.inc(self._source_name(), "none")

    async def list_entries(self, token: str, rows: int, before: tuple[int, int] | None) -> list[Entry]:
        """Up to `rows` entries visible with `token`, healthy or not (inquiries answer only the
        healthy ones), most recently registered first, registered before `before`
        (registered_at, service_id; None: from the newest). Read from the database: a listing
        is rare, and the in-memory index is shaped for inquiries."""
        return await self._store.list_entries(self._token_digest(token), rows, before)

    def _source_name(self, source: EntrySource | None = None) -> str:
        """The `source` label of an inquiry answered from `source` (None: where one would be)."""
        if source is None:
            current = self._index is not None and self._index.current
            return "memory" if current else "database"
        return "database" if source is self._store else "memory"

    def answer_stamp(self) -> int | None:
        """What the answers to inquiries depend on, as a number that changes when they may: an
        answer `inquire` found holds for as long as this is unchanged. None while answers are not
        a function of the index alone (answered from the database, load balanced, or rechecked).
        Stamps only grow."""
        if self._index is None or not self._index.current or self.load_balancing or self.check_on_inquire:
            return None
        return self._index.index.generation

    async def _recheck(self, entries: list[Entry]) -> list[Entry]:
        now = time.time_ns()
        stale = [
            entry
            for entry in entries
            if not entry.permanent
            and entry.endpoint.protocol != COGMENT
            and now - entry.last_check_at > RECENT_CHECK_NS
        ]
        if not stale:
            return entries
        targets = [
            CheckTarget(e.service_id, e.endpoint, e.service_type, e.failed_checks, e.load) for e in stale
        ]
        results = await self._checker.check_now(targets)
        kept = []
        for entry in entries:
            result = results.get(entry.service_id)
            if result is None:
                kept.append(entry)
            elif result.healthy:
                # A new entry: those of the index are shared by every inquiry.
                kept.append(entry if result.load is None else dataclasses.replace(entry, load=result.load))
        return kept

    @staticmethod
    def _balance(entries: list[Entry], lowest: int | None) -> list[Entry]:
        """Least loaded first: drop unserviceable entries (load 255), keep those within
        ACCEPTABLE_LOAD_RANGE of the lowest load of all the matches (`lowest`; None: of these
        entries), and shuffle them to spread the work."""
        serviceable = [entry for entry in entries if entry.load < UNSERVICEABLE]
        if not serviceable:
            return []
        if lowest is None:
            lowest = min(entry.load for entry in serviceable)
        kept = [entry for entry in serviceable if entry.load <= lowest + ACCEPTABLE_LOAD_RANGE]
        random.shuffle(kept)
        return kept
