"""The directory's statements in each database's own SQL (`NEW_ENTRIES_SQL`, chosen once by the
store)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

from shared.schema import directory_service_properties as properties_table
from shared.schema import directory_services as services


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
        "SELECT count(*) FROM inserted"
    )


# The statement for a batch's new entries, from the service row's columns (None: the database has
# none, and they are written in a transaction with the others).
NEW_ENTRIES_SQL: dict[str, Callable[[tuple[str, ...]], str] | None] = {
    "postgresql": _postgresql_new_entries,
    "sqlite": None,
}
