"""SQL storage of directory entries. Every piece of directory state lives here, so several
replicas on one database serve the same directory."""

from __future__ import annotations

import asyncio
import functools
import json
import secrets
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from sqlalchemy import (
    ColumnElement,
    Integer,
    Select,
    and_,
    bindparam,
    delete,
    func,
    insert,
    or_,
    select,
    text,
    tuple_,
    update,
)
from sqlalchemy.exc import IntegrityError

from services.directory.entry_sql import NEW_ENTRIES_SQL
from services.directory.model import (
    CHECK_LEASE_NS,
    MAX_SERVICE_ID,
    UNKNOWN_SERVICE,
    CheckResult,
    CheckTarget,
    Endpoint,
    Entry,
    Inquiry,
    Registration,
)
from shared import property_match
from shared.db import Database, Transaction
from shared.digest import pair_digest, sha256_hex
from shared.load import UNSERVICEABLE
from shared.schema import directory_service_properties as properties_table
from shared.schema import directory_services as services
from shared.schema import directory_services_permanent_identity as permanent_identity
from shared.schema import directory_settings as settings

SECRET_KEY_SETTING = "secret_key"
# Token digests are keyed (HMAC) once this setting says so (see key_token_digests).
TOKEN_DIGESTS_SETTING = "token_digests"
KEYED_TOKEN_DIGESTS = "hmac-sha256"
# Registrations written in one batch at most (group commit).
ADD_BATCH = 256
# A registration whose new id collided is tried again with fresh ids this many times at most.
ID_COLLISION_RETRIES = 3
# Choosing the driving property of an inquiry: counts are capped (an exact count of a common
# property costs a scan) and kept for a while, in a bounded cache.
PROPERTY_COUNT_CAP = 100
PROPERTY_COUNT_TTL_S = 30.0
PROPERTY_COUNT_CACHE_SIZE = 10_000
_MOST_RECENT_FIRST = (services.c.registered_at.desc(), services.c.service_id.desc())
# Inquiries are answered in pages (see DirectoryStore.find): most answer within the first.
PAGE_FIRST_ROWS = 16
PAGE_MAX_ROWS = 1000
PAGE_BYTES = 4 * 1024 * 1024
# Rows per query when the in-memory index loads every entry.
LOAD_PAGE_ROWS = 5000
# The change-feed key of one entry, and of every entry (a change to all of them): the in-memory
# index (services.directory.index) re-reads the entries it hears of.
ENTRY_KEY_PREFIX = "entry:"
ALL_ENTRIES_KEY = "entries"
_AFTER_EVERYTHING = 2**63 - 1  # registered_at and service_id are both below it
_ENTRY_COLUMNS = (
    services.c.service_id,
    services.c.protocol,
    services.c.host,
    services.c.port,
    services.c.service_type,
    services.c.properties,
    services.c.permanent,
    services.c.registered_at,
    services.c.load,
    services.c.failed_checks,
    services.c.last_check_at,
)


def entry_keys(service_ids: Iterable[int]) -> list[str]:
    return [f"{ENTRY_KEY_PREFIX}{service_id}" for service_id in service_ids]


def canonical_properties(properties: dict[str, str]) -> str:
    return json.dumps(properties, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


# An entry of a health-checked kind is answered only once a check has passed (unchecked kinds:
# `next_check_at` is NULL). A failed check hides it too (`failed_checks`).
_VISIBLE = (
    services.c.failed_checks == 0,
    or_(services.c.next_check_at.is_(None), services.c.last_check_at > 0),
)


# The same rule, as a value the in-memory index keeps per entry.
_IS_VISIBLE = and_(*_VISIBLE)
_INDEX_COLUMNS = (*_ENTRY_COLUMNS, services.c.token_digest, _IS_VISIBLE)


@dataclass(frozen=True)
class IndexRow:
    """What the in-memory index keeps of an entry."""

    entry: Entry
    token_digest: str
    visible: bool


def _index_row(row: Sequence[Any]) -> IndexRow:
    return IndexRow(_entry(row[:-2]), row[-2], bool(row[-1]))


def _property_rows(service_id: int, registration: Registration) -> list[dict[str, Any]]:
    return [
        {"service_id": service_id, "pair_digest": pair_digest(name, value), "name": name, "value": value}
        for name, value in registration.properties.items()
    ]


def _changed_entries(
    batch: Sequence[_PendingAdd], results: Sequence[tuple[int, str, bool]]
) -> tuple[list[str], list[str]]:
    """The change-feed keys of what a batch wrote: those this replica's index reads back, and
    those only the other replicas do (a new entry of an unchecked kind goes into this replica's
    index as written: Directory.register)."""
    read_back: list[int] = []
    elsewhere: list[int] = []
    for pending, (service_id, _, created) in zip(batch, results, strict=True):
        registration = pending.registration
        read_here = registration.permanent or registration.health_checked or not created
        (read_back if read_here else elsewhere).append(service_id)
    return entry_keys(read_back), entry_keys(elsewhere)


def _service_row(registration: Registration, token_digest: str, now_ns: int) -> dict[str, Any]:
    properties_json = canonical_properties(registration.properties)
    return {
        "service_id": secrets.randbelow(MAX_SERVICE_ID) + 1,
        "registered_at": now_ns,
        "protocol": registration.endpoint.protocol,
        "host": registration.endpoint.host,
        "port": registration.endpoint.port,
        "service_type": registration.service_type,
        "properties": properties_json,
        "properties_digest": sha256_hex(properties_json),
        "permanent": registration.permanent,
        "token_digest": token_digest,
        "secret_nonce": secrets.token_hex(16),
        "failed_checks": 0,
        "load": 0,
        "last_check_at": 0,
        "next_check_at": now_ns if registration.health_checked else None,
        # The replica that takes a registration checks it first: claimed by it from the start.
        "claimed_until": now_ns + CHECK_LEASE_NS if registration.health_checked else 0,
    }


@functools.cache
def _capped_counts_statement() -> Select[Any]:
    """How many entries have each inquired property, counting at most PROPERTY_COUNT_CAP."""
    return property_match.capped_counts(properties_table, PROPERTY_COUNT_CAP)


@functools.cache
def _by_id_statement() -> Select[Any]:
    return select(*_ENTRY_COLUMNS).where(
        services.c.service_id == bindparam("service_id"),
        services.c.token_digest == bindparam("token"),
        *_VISIBLE,
    )


@functools.cache
def _listing_statement() -> Select[Any]:
    """Every entry of a token, healthy or not, most recently registered first, after a position."""
    position = tuple_(services.c.registered_at, services.c.service_id)
    return (
        select(*_ENTRY_COLUMNS)
        .where(
            services.c.token_digest == bindparam("token"),
            position < tuple_(bindparam("before_at"), bindparam("before_id")),
        )
        .order_by(services.c.registered_at.desc(), services.c.service_id.desc())
        .limit(bindparam("rows", type_=Integer))
    )


@functools.cache
def _index_rows_statement() -> Select[Any]:
    return select(*_INDEX_COLUMNS).where(services.c.service_id.in_(bindparam("ids", expanding=True)))


@functools.cache
def _load_page_statement() -> Select[Any]:
    return (
        select(*_INDEX_COLUMNS)
        .where(services.c.service_id > bindparam("after"))
        .order_by(services.c.service_id)
        .limit(bindparam("rows", type_=Integer))
    )


@functools.cache
def _matching_statement(typed: bool, properties: int) -> Select[Any]:
    """The entries an inquiry by details matches, of one shape (built once: only the parameters
    change, whatever the number of properties inquired); unordered. `properties`: how many are
    inquired, 0, 1, or 2 for two or more."""
    conditions: list[ColumnElement[bool]] = [*_VISIBLE]
    if properties == 0:
        conditions.append(services.c.token_digest == bindparam("token"))
        if typed:
            conditions.append(services.c.service_type == bindparam("service_type"))
        return select(*_ENTRY_COLUMNS).where(*conditions)
    # Drive from the property index with the rarest inquired property (parameter `driving`); the
    # candidates are then checked for every inquired property. The planners must not drive from
    # the (token, type) index instead, which would visit every entry of the type: on PostgreSQL
    # the candidates are a MATERIALIZED CTE (a plan fence, whatever the table statistics say, e.g.
    # right after a bulk load); on SQLite, which inlines the CTE, wrapping token and type in
    # coalesce() keeps their index out of the running.
    candidates = (
        select(properties_table.c.service_id)
        .where(properties_table.c.pair_digest == bindparam("driving"))
        .cte("candidates")
        .prefix_with("MATERIALIZED", dialect="postgresql")
    )
    conditions.append(func.coalesce(services.c.token_digest, "") == bindparam("token"))
    if typed:
        conditions.append(func.coalesce(services.c.service_type, 0) == bindparam("service_type"))
    if properties > 1:
        conditions.append(property_match.includes_every_pair(properties_table, services.c.service_id))
    return (
        select(*_ENTRY_COLUMNS)
        .select_from(candidates.join(services, candidates.c.service_id == services.c.service_id))
        .where(*conditions)
    )


@functools.cache
def _page_statement(typed: bool, properties: int) -> Select[Any]:
    """A page of the matches, most recent first, from the position after (`before_at`,
    `before_id`), at most `rows`."""
    position = tuple_(services.c.registered_at, services.c.service_id)
    return (
        _matching_statement(typed, properties)
        .where(position < tuple_(bindparam("before_at"), bindparam("before_id")))
        .order_by(*_MOST_RECENT_FIRST)
        .limit(bindparam("rows", type_=Integer))
    )


@functools.cache
def _lowest_load_statement(typed: bool, properties: int) -> Select[Any]:
    """The lowest load of the serviceable matches (None: there is none)."""
    matches = _matching_statement(typed, properties).subquery()
    return select(func.min(matches.c.load)).where(matches.c.load < UNSERVICEABLE)


K = TypeVar("K")


def _remember(cache: OrderedDict[K, tuple[float, float]], key: K, value: tuple[float, float]) -> None:
    cache[key] = value
    cache.move_to_end(key)
    while len(cache) > PROPERTY_COUNT_CACHE_SIZE:
        cache.popitem(last=False)


@dataclass
class _PendingAdd:
    registration: Registration
    token_digest: str
    now_ns: int
    result: asyncio.Future[tuple[int, str, bool]]


# Writes a batch of registrations; their (service id, secret nonce, created), in order.
_BatchWrite = Callable[[list[_PendingAdd]], Awaitable[list[tuple[int, str, bool]]]]


class _GroupCommit:
    """Registrations written in batches: those that arrive while a batch is being written go in
    the next one, up to ADD_BATCH; each registration is answered once its batch is written, or
    fails with it (a batch is written whole or not at all; after an id collision, its
    registrations are written one by one)."""

    def __init__(self, write: _BatchWrite) -> None:
        self._write = write
        self._pending: list[_PendingAdd] = []
        self._writer: asyncio.Task[None] | None = None

    async def add(self, pending: _PendingAdd) -> tuple[int, str, bool]:
        self._pending.append(pending)
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._write_pending())
        return await pending.result

    async def _write_pending(self) -> None:
        while self._pending:
            batch, self._pending = self._pending[:ADD_BATCH], self._pending[ADD_BATCH:]
            results: list[tuple[int, str, bool] | BaseException]
            try:
                results = list(await self._write(batch))
            except IntegrityError:
                # A service id collision (one chance in 2^63 per entry): redo them one by one,
                # each with fresh ids, so one collision does not fail the others.
                results = []
                for pending in batch:
                    try:
                        results.append(await self._retried(pending))
                    except Exception as error:
                        results.append(error)
            except Exception as error:
                results = [error for _ in batch]
            for pending, result in zip(batch, results, strict=True):
                if pending.result.done():
                    continue
                if isinstance(result, BaseException):
                    pending.result.set_exception(result)
                else:
                    pending.result.set_result(result)

    async def _retried(self, pending: _PendingAdd) -> tuple[int, str, bool]:
        # Fresh ids each time; an integrity error that comes back is not a collision: it fails.
        for _ in range(ID_COLLISION_RETRIES):
            try:
                return (await self._write([pending]))[0]
            except IntegrityError:
                continue
        return (await self._write([pending]))[0]


def _entry(row: Sequence[Any]) -> Entry:
    """An entry from a row of _ENTRY_COLUMNS (by position: Database.fetch gives plain rows)."""
    (
        service_id,
        protocol,
        host,
        port,
        service_type,
        properties,
        permanent,
        registered_at,
        load,
        failed,
        checked,
    ) = row
    return Entry(
        service_id=service_id,
        endpoint=Endpoint(protocol, host, port),
        service_type=service_type,
        properties=json.loads(properties),
        permanent=bool(permanent),
        registered_at=registered_at,
        load=load,
        failed_checks=failed,
        last_check_at=checked,
    )


class DirectoryStore:
    def __init__(self, database: Database) -> None:
        """Every change to an entry says so (its key: `entry_keys`; see shared.notify)."""
        self.db = database
        # New entries in one statement, where the database has one: permanent ones, whose
        # upserts take a round trip each, then go in batches of their own.
        self._insert_new_sql = database.by_dialect(NEW_ENTRIES_SQL)
        if self._insert_new_sql is None:
            self._new_adds = self._permanent_adds = _GroupCommit(self._write_in_transaction)
        else:
            self._new_adds = _GroupCommit(self._insert_new)
            self._permanent_adds = _GroupCommit(self._write_in_transaction)
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

    async def add(self, registration: Registration, token_digest: str, now_ns: int) -> tuple[int, str, bool]:
        """Store a registration; returns (service id, secret nonce, created).

        A permanent registration whose token, type and full property map match a permanent
        entry updates that entry's endpoint in place (same id and nonce) instead.

        Registrations arriving while a batch is being written are written together in the next
        one (group commit: `_GroupCommit`). On PostgreSQL, new entries go in one statement each
        batch (`_insert_new`), apart from permanent ones, whose upserts (a round trip each) they do
        not wait for.
        """
        pending = _PendingAdd(registration, token_digest, now_ns, asyncio.get_running_loop().create_future())
        adds = self._permanent_adds if registration.permanent else self._new_adds
        return await adds.add(pending)

    async def _write_in_transaction(self, batch: list[_PendingAdd]) -> list[tuple[int, str, bool]]:
        return await self.db.write(lambda transaction: self._write_adds(transaction, batch))

    def _write_adds(self, transaction: Transaction, batch: list[_PendingAdd]) -> list[tuple[int, str, bool]]:
        results: list[tuple[int, str, bool]] = []
        new_rows: list[dict[str, Any]] = []
        new_properties: list[dict[str, Any]] = []
        for pending in batch:
            row = _service_row(pending.registration, pending.token_digest, pending.now_ns)
            if pending.registration.permanent:
                # One at a time, in order: a later identical registration updates this one.
                stored_id, stored_nonce = transaction.execute(self._upsert_permanent, row).one()
            else:
                new_rows.append(row)
                stored_id, stored_nonce = row["service_id"], row["secret_nonce"]
            created = stored_id == row["service_id"]
            if created:
                new_properties += _property_rows(stored_id, pending.registration)
            results.append((int(stored_id), str(stored_nonce), created))
        if new_rows:
            transaction.execute(insert(services), new_rows)
        if new_properties:
            transaction.execute(insert(properties_table), new_properties)
        read_back, elsewhere = _changed_entries(batch, results)
        transaction.changed(read_back, elsewhere=elsewhere)
        return results

    async def _insert_new(self, batch: list[_PendingAdd]) -> list[tuple[int, str, bool]]:
        """New entries (none permanent) in one statement (`NEW_ENTRIES_SQL`)."""
        assert self._insert_new_sql is not None
        rows = [_service_row(pending.registration, pending.token_digest, pending.now_ns) for pending in batch]
        properties = [
            row for pending, entry in zip(batch, rows, strict=True)
            for row in _property_rows(entry["service_id"], pending.registration)
        ]  # fmt: skip
        results = [(int(row["service_id"]), str(row["secret_nonce"]), True) for row in rows]
        read_back, elsewhere = _changed_entries(batch, results)
        await self.db.write_statement(
            self._insert_new_sql(tuple(rows[0])),
            {"services": json.dumps(rows), "properties": json.dumps(properties)},
            read_back,
            elsewhere=elsewhere,
        )
        return results

    @functools.cached_property
    def _upsert_permanent(self) -> Any:
        """Insert a permanent entry, or update the permanent entry with the same identity."""
        statement = self.db.insert(services)
        return statement.on_conflict_do_update(
            **self.db.conflict_target(permanent_identity),
            set_={
                "protocol": statement.excluded.protocol,
                "host": statement.excluded.host,
                "port": statement.excluded.port,
                "failed_checks": 0,
                "load": 0,
            },
        ).returning(services.c.service_id, services.c.secret_nonce)

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
                yield [_entry(row) for row in await self.db.fetch(_by_id_statement(), by_id)]
            return
        shape, parameters = await self._details(inquiry, token_digest)
        parameters.update(before_at=_AFTER_EVERYTHING, before_id=_AFTER_EVERYTHING, rows=PAGE_FIRST_ROWS)
        while True:
            rows = await self.db.fetch(_page_statement(*shape), parameters)
            if rows:
                yield [_entry(row) for row in rows]
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
        before_at, before_id = before or (_AFTER_EVERYTHING, _AFTER_EVERYTHING)
        parameters = {"token": token_digest, "before_at": before_at, "before_id": before_id, "rows": rows}
        return [_entry(row) for row in await self.db.fetch(_listing_statement(), parameters)]

    async def index_rows(self, service_ids: Sequence[int]) -> list[IndexRow]:
        """The entries of these ids that exist, as the in-memory index keeps them."""
        rows = await self.db.fetch(_index_rows_statement(), {"ids": list(service_ids)})
        return [_index_row(row) for row in rows]

    async def all_index_rows(self) -> AsyncIterator[list[IndexRow]]:
        """Every entry, as the in-memory index keeps them, in pages of LOAD_PAGE_ROWS."""
        after = 0
        while True:
            rows = await self.db.fetch(_load_page_statement(), {"after": after, "rows": LOAD_PAGE_ROWS})
            if rows:
                yield [_index_row(row) for row in rows]
            if len(rows) < LOAD_PAGE_ROWS:
                return
            after = rows[-1][0]

    async def lowest_load(self, inquiry: Inquiry, token_digest: str) -> int | None:
        """The lowest load among the serviceable entries an inquiry by details matches."""
        shape, parameters = await self._details(inquiry, token_digest)
        ((lowest,),) = await self.db.fetch(_lowest_load_statement(*shape), parameters)
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
            statement = _capped_counts_statement()
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
        """Have PostgreSQL re-read the directory tables' statistics (its plans depend on them)."""
        await self.db.fetch(text(f"ANALYZE {services.name}, {properties_table.name}"))

    async def claim_due_checks(
        self, now_ns: int, lease_ns: int, limit: int, *, failing: bool = False
    ) -> list[CheckTarget]:
        """Take up to `limit` entries due for a health check, for `lease_ns`: of those that
        passed their last check, or (`failing`) of those that failed it.

        On PostgreSQL, SKIP LOCKED lets replicas claim disjoint entries at the same time; an
        entry stays claimed until its lease expires, so a crashed replica's claims are taken over.
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
