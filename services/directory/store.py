"""SQL storage of directory entries. Every piece of directory state lives here, so several
replicas on one database serve the same directory."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, TypeVar

from sqlalchemy import delete, func, select, text, update

from services.directory.entry_sql import (
    AFTER_EVERYTHING,
    IndexRow,
    by_id_statement,
    capped_counts_statement,
    entry_from_row,
    index_row,
    index_rows_statement,
    listing_statement,
    load_page_statement,
    lowest_load_statement,
    page_statement,
)
from services.directory.entry_writes import EntryWrites, Written
from services.directory.model import (
    ALL_ENTRIES_KEY,
    MAX_SERVICE_ID,
    UNKNOWN_SERVICE,
    CheckResult,
    CheckTarget,
    Endpoint,
    Entry,
    Inquiry,
    Registration,
    entry_keys,
)
from shared import property_match
from shared.db import Database, Transaction
from shared.dependencies import Dependencies
from shared.digest import pair_digest
from shared.schema import directory_service_properties as properties_table
from shared.schema import directory_services as services
from shared.schema import directory_settings as settings

SECRET_KEY_SETTING = "secret_key"
# Token digests are keyed (HMAC) once this setting says so (see key_token_digests).
TOKEN_DIGESTS_SETTING = "token_digests"
KEYED_TOKEN_DIGESTS = "hmac-sha256"
# Choosing the driving property of an inquiry: capped counts (PROPERTY_COUNT_CAP) are kept for a
# while, in a bounded cache.
PROPERTY_COUNT_TTL_S = 30.0
PROPERTY_COUNT_CACHE_SIZE = 10_000
# Inquiries are answered in pages (see DirectoryStore.find): most answer within the first.
PAGE_FIRST_ROWS = 16
PAGE_MAX_ROWS = 1000
PAGE_BYTES = 4 * 1024 * 1024
# Rows per query when the in-memory index loads every entry.
LOAD_PAGE_ROWS = 5000
K = TypeVar("K")


def _remember(cache: OrderedDict[K, tuple[float, float]], key: K, value: tuple[float, float]) -> None:
    cache[key] = value
    cache.move_to_end(key)
    while len(cache) > PROPERTY_COUNT_CACHE_SIZE:
        cache.popitem(last=False)


class DirectoryStore:
    def __init__(self, database: Database, dependencies: Dependencies | None = None) -> None:
        """Every change to an entry says so (its key: `entry_keys`; see shared.notify).
        `dependencies`: those whose outages registrations ride out (see EntryWrites)."""
        self.db = database
        self._writes = EntryWrites(database, dependencies)
        # Capped entry counts, with their monotonic expiry: per (name, value), and the last one
        # seen per name (the typical count of the name's values).
        self._pair_counts: OrderedDict[tuple[str, str], tuple[float, float]] = OrderedDict()
        self._name_counts: OrderedDict[str, tuple[float, float]] = OrderedDict()

    async def stored_secret_key(self) -> str | None:
        """The key kept in the database (earlier releases kept it there; see secret_key.py)."""
        rows = await self.db.fetch(select(settings.c.value).where(settings.c.name == SECRET_KEY_SETTING))
        return str(rows[0][0]) if rows else None

    async def create_stored_secret_key(self, candidate: str) -> str:
        """Keep `candidate` in the database unless a key is there already; the key kept."""
        insert_once = (
            self.db.insert(settings).values(name=SECRET_KEY_SETTING, value=candidate).on_conflict_do_nothing()
        )

        def write(transaction: Transaction) -> Any:
            transaction.execute(insert_once)
            return transaction.connection.scalar(
                select(settings.c.value).where(settings.c.name == SECRET_KEY_SETTING)
            )

        return str(await self.db.write(write))

    async def forget_stored_secret_key(self) -> None:
        statement = delete(settings).where(settings.c.name == SECRET_KEY_SETTING)
        await self.db.write(lambda transaction: transaction.execute(statement))

    async def key_token_digests(self, keyed: Callable[[str], str]) -> int:
        """Once per database: replace the unkeyed token digests of earlier releases (SHA-256 of
        the token) by `keyed(digest)`; returns how many tokens were converted. The marker row is
        inserted in the same transaction, so one replica converts and the others wait for it."""
        mark = (
            self.db.insert(settings)
            .values(name=TOKEN_DIGESTS_SETTING, value=KEYED_TOKEN_DIGESTS)
            .on_conflict_do_nothing()
            .returning(settings.c.name)
        )

        def write(transaction: Transaction) -> int:
            if transaction.execute(mark).first() is None:
                return 0  # converted already
            digests = transaction.connection.scalars(select(services.c.token_digest).distinct()).all()
            for digest in digests:
                transaction.execute(
                    update(services)
                    .where(services.c.token_digest == digest)
                    .values(token_digest=keyed(digest))
                )
            transaction.changed([ALL_ENTRIES_KEY])
            return len(digests)

        return await self.db.write(write)

    async def add(self, registration: Registration, token_digest: str, now_ns: int) -> Written:
        """Store a registration (in a batch with others: EntryWrites); returns (service id,
        secret nonce, created).

        A permanent registration whose token, type and full property map match a permanent
        entry updates that entry's endpoint in place (same id and nonce) instead.
        """
        return await self._writes.add(registration, token_digest, now_ns)

    async def credentials(self, service_id: int) -> tuple[str, str] | None:
        """(token digest, secret nonce) of an entry, or None when there is no such entry."""
        if not 0 < service_id <= MAX_SERVICE_ID:
            return None
        rows = await self.db.fetch(
            select(services.c.token_digest, services.c.secret_nonce).where(
                services.c.service_id == service_id
            )
        )
        return (rows[0][0], rows[0][1]) if rows else None

    async def remove(self, service_id: int) -> bool:
        statement = delete(services).where(services.c.service_id == service_id)

        def write(transaction: Transaction) -> bool:
            removed = bool(transaction.execute(statement).rowcount)
            if removed:
                transaction.changed(entry_keys([service_id]))
            return removed

        return await self.db.write(write)

    async def find(self, inquiry: Inquiry, token_digest: str) -> AsyncIterator[list[Entry]]:
        """Healthy entries visible with this token that match the inquiry, most recent first, in
        pages: a wide inquiry holds one page at a time, and other calls' reads run between its
        pages. A page has PAGE_FIRST_ROWS rows, the next ones about PAGE_BYTES (sized from the
        previous page's entries)."""
        if inquiry.service_id is not None:
            if 0 < inquiry.service_id <= MAX_SERVICE_ID:
                by_id = {"token": token_digest, "service_id": inquiry.service_id}
                yield [entry_from_row(row) for row in await self.db.fetch(by_id_statement(), by_id)]
            return
        shape, parameters = await self._details(inquiry, token_digest)
        parameters.update(before_at=AFTER_EVERYTHING, before_id=AFTER_EVERYTHING, rows=PAGE_FIRST_ROWS)
        while True:
            rows = await self.db.fetch(page_statement(*shape), parameters)
            if rows:
                yield [entry_from_row(row) for row in rows]
            if len(rows) < parameters["rows"]:
                return
            last = rows[-1]
            page_bytes = sum(len(row[5]) + len(row[2]) for row in rows)  # properties and host
            parameters.update(
                before_at=last[7],
                before_id=last[0],
                rows=max(1, min(PAGE_MAX_ROWS, PAGE_BYTES * len(rows) // max(page_bytes, 1))),
            )
            del rows, last  # one page held at a time

    async def list_entries(
        self, token_digest: str, rows: int, before: tuple[int, int] | None = None
    ) -> list[Entry]:
        """Up to `rows` entries of the token, healthy or not, most recently registered first,
        registered before `before` (registered_at, service_id); None: from the newest."""
        before_at, before_id = before or (AFTER_EVERYTHING, AFTER_EVERYTHING)
        parameters = {"token": token_digest, "before_at": before_at, "before_id": before_id, "rows": rows}
        return [entry_from_row(row) for row in await self.db.fetch(listing_statement(), parameters)]

    async def index_rows(self, service_ids: Sequence[int]) -> list[IndexRow]:
        """The entries of these ids that exist, as the in-memory index keeps them."""
        rows = await self.db.fetch(index_rows_statement(), {"ids": list(service_ids)})
        return [index_row(row) for row in rows]

    async def all_index_rows(self) -> AsyncIterator[list[IndexRow]]:
        """Every entry, as the in-memory index keeps them, in pages of LOAD_PAGE_ROWS."""
        after = 0
        while True:
            rows = await self.db.fetch(load_page_statement(), {"after": after, "rows": LOAD_PAGE_ROWS})
            if rows:
                yield [index_row(row) for row in rows]
            if len(rows) < LOAD_PAGE_ROWS:
                return
            after = rows[-1][0]

    async def lowest_load(self, inquiry: Inquiry, token_digest: str) -> int | None:
        """The lowest load among the serviceable entries an inquiry by details matches."""
        shape, parameters = await self._details(inquiry, token_digest)
        ((lowest,),) = await self.db.fetch(lowest_load_statement(*shape), parameters)
        return None if lowest is None else int(lowest)

    async def _details(self, inquiry: Inquiry, token_digest: str) -> tuple[tuple[bool, int], dict[str, Any]]:
        """The statement shape and parameters of an inquiry by details."""
        parameters: dict[str, Any] = {"token": token_digest, "service_type": inquiry.service_type}
        if inquiry.properties:
            parameters.update(property_match.parameters(inquiry.properties))
            parameters["driving"] = pair_digest(*await self._rarest(inquiry.properties))
        # 0, 1 or 2 properties and more: one needs no check beyond the driving property.
        inquired = min(len(inquiry.properties), 2)
        shape = (inquiry.service_type != UNKNOWN_SERVICE, inquired)
        return shape, parameters

    async def _rarest(self, properties: dict[str, str]) -> tuple[str, str]:
        """The inquired property with the fewest entries.

        Counts only choose the query plan, never the result, so estimates do: a recent capped
        count of the (name, value) pair, else the typical count of the name's values (most names
        are either identifying, like `__implementation`, or shared, like `__version`). The
        database is asked only about names without a recent estimate.
        """
        pairs = sorted(properties.items())
        if len(pairs) == 1:
            return pairs[0]
        now = time.monotonic()

        def estimate(pair: tuple[str, str]) -> float | None:
            exact = self._pair_counts.get(pair)
            if exact is not None and exact[1] >= now:
                return exact[0]
            typical = self._name_counts.get(pair[0])
            return typical[0] if typical is not None and typical[1] >= now else None

        unknown = {pair_digest(*pair): pair for pair in pairs if estimate(pair) is None}
        if unknown:
            statement = capped_counts_statement()
            counts = await self.db.fetch(statement, property_match.parameters(dict(unknown.values())))
            expiry = now + PROPERTY_COUNT_TTL_S
            for digest, count in counts:
                name, value = unknown[digest]
                _remember(self._pair_counts, (name, value), (float(count), expiry))
                _remember(self._name_counts, name, (float(count), expiry))
        return min(pairs, key=lambda pair: estimate(pair) or 0.0)

    async def count(self) -> int:
        (row,) = await self.db.fetch(select(func.count()).select_from(services))
        return int(row[0])

    async def count_by_type(self) -> dict[tuple[int, bool], int]:
        """Entries by (service type, whether their last check failed); absent pairs have none."""
        failed = services.c.failed_checks > 0
        rows = await self.db.fetch(
            select(services.c.service_type, failed, func.count()).group_by(services.c.service_type, failed)
        )
        return {(int(row[0]), bool(row[1])): int(row[2]) for row in rows}

    async def refresh_statistics(self) -> None:
        """Have the database re-read the directory tables' statistics (its plans depend on them)."""
        for table in (services, properties_table):
            await self.db.fetch(text(f"ANALYZE {table.name}"))

    async def claim_due_checks(
        self, now_ns: int, lease_ns: int, limit: int, *, failing: bool = False
    ) -> list[CheckTarget]:
        """Take up to `limit` entries due for a health check, for `lease_ns`: of those that
        passed their last check, or (`failing`) of those that failed it.

        SKIP LOCKED lets replicas claim disjoint entries at the same time; an entry stays claimed
        until its lease expires, so a crashed replica's claims are taken over.
        """
        is_due = (
            services.c.next_check_at <= now_ns,
            services.c.claimed_until < now_ns,
            services.c.failed_checks > 0 if failing else services.c.failed_checks == 0,
        )
        # A read first: most polls find nothing due, and need not take the write lock for that.
        if not await self.db.fetch(select(services.c.service_id).where(*is_due).limit(1)):
            return []
        due = (
            select(services.c.service_id)
            .where(*is_due)
            .order_by(services.c.next_check_at)
            .limit(limit)
            .with_for_update(skip_locked=True)
        )
        statement = (
            update(services)
            .where(services.c.service_id.in_(due.scalar_subquery()))
            .values(claimed_until=now_ns + lease_ns)
            .returning(
                services.c.service_id,
                services.c.protocol,
                services.c.host,
                services.c.port,
                services.c.service_type,
                services.c.failed_checks,
                services.c.load,
            )
        )
        rows = await self.db.write(lambda transaction: transaction.execute(statement).all())
        return [
            CheckTarget(
                row.service_id,
                Endpoint(row.protocol, row.host, row.port),
                row.service_type,
                row.failed_checks,
                row.load,
            )
            for row in rows
        ]

    async def record_checks(
        self,
        results: Sequence[tuple[CheckTarget, CheckResult]],
        now_ns: int,
        next_check_ns: int,
        max_failed_checks: int,
    ) -> list[int]:
        """Store check outcomes and release the claims; returns the ids removed for failing
        `max_failed_checks` checks in a row."""

        def write(transaction: Transaction) -> list[int]:
            removed: list[int] = []
            for target, result in results:
                values: dict[str, Any] = {
                    "last_check_at": now_ns,
                    "next_check_at": next_check_ns,
                    "claimed_until": 0,
                }
                if result.healthy:
                    values["failed_checks"] = 0
                    if result.load is not None:
                        values["load"] = result.load
                else:
                    # Counted in SQL: two checks of one entry (periodic and at inquiry) may overlap.
                    values["failed_checks"] = services.c.failed_checks + 1
                    values["load"] = 255
                failed = transaction.connection.scalar(
                    update(services)
                    .where(services.c.service_id == target.service_id)
                    .values(values)
                    .returning(services.c.failed_checks)
                )
                if failed is not None and failed >= max_failed_checks:
                    transaction.execute(delete(services).where(services.c.service_id == target.service_id))
                    removed.append(target.service_id)
            transaction.changed(entry_keys(target.service_id for target, _ in results))
            return removed

        return await self.db.write(write)
