"""The directory's statements: those of the read paths, built once per shape, the rows they read,
and the statement for new entries in each database's own SQL (`NEW_ENTRIES_SQL`, chosen once by
the writer)."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import ColumnElement, Integer, Select, and_, bindparam, func, or_, select, tuple_

from services.directory.model import Endpoint, Entry
from shared import property_match
from shared.db.dialect import PUBLISHED
from shared.load import UNSERVICEABLE
from shared.schema import directory_service_properties as properties_table
from shared.schema import directory_services as services

# Choosing the driving property of an inquiry: counts are capped (an exact count of a common
# property costs a scan).
PROPERTY_COUNT_CAP = 100
AFTER_EVERYTHING = 2**63 - 1  # registered_at and service_id are both below it
ENTRY_COLUMNS = (
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


MOST_RECENT_FIRST = (services.c.registered_at.desc(), services.c.service_id.desc())


# An entry of a health-checked kind is answered only once a check has passed (unchecked kinds:
# `next_check_at` is NULL). A failed check hides it too (`failed_checks`).
VISIBLE = (
    services.c.failed_checks == 0,
    or_(services.c.next_check_at.is_(None), services.c.last_check_at > 0),
)


# The same rule, as a value the in-memory index keeps per entry.
_IS_VISIBLE = and_(*VISIBLE)
_INDEX_COLUMNS = (*ENTRY_COLUMNS, services.c.token_digest, _IS_VISIBLE)


@dataclass(frozen=True)
class IndexRow:
    """What the in-memory index keeps of an entry."""

    entry: Entry
    token_digest: str
    visible: bool


def index_row(row: Sequence[Any]) -> IndexRow:
    return IndexRow(entry_from_row(row[:-2]), row[-2], bool(row[-1]))


def entry_from_row(row: Sequence[Any]) -> Entry:
    """An entry from a row of ENTRY_COLUMNS (by position: Database.fetch gives plain rows)."""
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


@functools.cache
def capped_counts_statement() -> Select[Any]:
    """How many entries have each inquired property, counting at most PROPERTY_COUNT_CAP."""
    return property_match.capped_counts(properties_table, PROPERTY_COUNT_CAP)


@functools.cache
def by_id_statement() -> Select[Any]:
    return select(*ENTRY_COLUMNS).where(
        services.c.service_id == bindparam("service_id"),
        services.c.token_digest == bindparam("token"),
        *VISIBLE,
    )


@functools.cache
def listing_statement() -> Select[Any]:
    """Every entry of a token, healthy or not, most recently registered first, after a position."""
    position = tuple_(services.c.registered_at, services.c.service_id)
    return (
        select(*ENTRY_COLUMNS)
        .where(
            services.c.token_digest == bindparam("token"),
            position < tuple_(bindparam("before_at"), bindparam("before_id")),
        )
        .order_by(services.c.registered_at.desc(), services.c.service_id.desc())
        .limit(bindparam("rows", type_=Integer))
    )


@functools.cache
def index_rows_statement() -> Select[Any]:
    return select(*_INDEX_COLUMNS).where(services.c.service_id.in_(bindparam("ids", expanding=True)))


@functools.cache
def nonces_statement() -> Select[Any]:
    """The secret nonces of the entries of these ids that exist: whether a write whose outcome
    was unknown committed (see EntryWrites)."""
    return select(services.c.service_id, services.c.secret_nonce).where(
        services.c.service_id.in_(bindparam("ids", expanding=True))
    )


@functools.cache
def load_page_statement() -> Select[Any]:
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
    conditions: list[ColumnElement[bool]] = [*VISIBLE]
    if properties == 0:
        conditions.append(services.c.token_digest == bindparam("token"))
        if typed:
            conditions.append(services.c.service_type == bindparam("service_type"))
        return select(*ENTRY_COLUMNS).where(*conditions)
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
        select(*ENTRY_COLUMNS)
        .select_from(candidates.join(services, candidates.c.service_id == services.c.service_id))
        .where(*conditions)
    )


@functools.cache
def page_statement(typed: bool, properties: int) -> Select[Any]:
    """A page of the matches, most recent first, from the position after (`before_at`,
    `before_id`), at most `rows`."""
    position = tuple_(services.c.registered_at, services.c.service_id)
    return (
        _matching_statement(typed, properties)
        .where(position < tuple_(bindparam("before_at"), bindparam("before_id")))
        .order_by(*MOST_RECENT_FIRST)
        .limit(bindparam("rows", type_=Integer))
    )


@functools.cache
def lowest_load_statement(typed: bool, properties: int) -> Select[Any]:
    """The lowest load of the serviceable matches (None: there is none)."""
    matches = _matching_statement(typed, properties).subquery()
    return select(func.min(matches.c.load)).where(matches.c.load < UNSERVICEABLE)


@functools.cache
def _postgresql_new_entries(service_columns: tuple[str, ...]) -> str:
    """A batch's new (not permanent) entries and their properties in one statement, its own
    transaction: one round trip on the database's direct connection, where a transaction took four
    through the event loop. Each set of rows comes as one JSON parameter (`services`,
    `properties`): an executemany costs the client a statement's work per row."""

    def rows(table: str, columns: Sequence[str], parameter: str) -> str:
        names = ", ".join(columns)
        return (
            f"INSERT INTO {table} ({names}) SELECT {names} "
            f"FROM jsonb_populate_recordset(NULL::{table}, %({parameter})s::jsonb)"
        )

    property_columns = [column.name for column in properties_table.columns]
    # Data-modifying CTEs always run, whatever the main query reads.
    return (
        f"WITH inserted AS ({rows(services.name, service_columns, 'services')} RETURNING 1), "
        f"described AS ({rows(properties_table.name, property_columns, 'properties')}) "
        f"SELECT count(*) FROM inserted {PUBLISHED}"
    )


# The statement for a batch's new entries, from the service row's columns (None: the database has
# none, and they are written in a transaction with the others).
NEW_ENTRIES_SQL: dict[str, Callable[[tuple[str, ...]], str] | None] = {
    "postgresql": _postgresql_new_entries,
    "sqlite": None,
}
