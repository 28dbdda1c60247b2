"""The directory's page: the entries with their health and never their secrets, from the
directory's listing or, from a Cogment 2.x directory (no listing), the healthy ones found by
inquiries."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from services.console.model import EntryRow
from services.console.model_pages import utc_time
from services.console.sources import Sources
from services.directory.client.api import DirectoryClient
from shared.api import directory_entries_pb2, directory_pb2
from shared.endpoints import SERVICE_TYPES, service_type_name

# Directory entries the directory page lists at most (the newest), and per request.
MAX_ENTRIES = 10_000
ENTRIES_PAGE = 1000


@dataclass(frozen=True)
class Entries:
    rows: list[EntryRow]
    complete: bool  # False: more than MAX_ENTRIES, the newest shown
    with_health: bool  # False: a directory without the listing, its healthy entries by inquiry


class DirectoryPages:
    """The rules of the directory's page, over the directory's client."""

    sources: Sources

    async def entries(self) -> Entries:
        """Every entry the console's token sees with its health, the newest MAX_ENTRIES at most;
        from a Cogment 2.x directory (no listing), the healthy ones, found by inquiries. Never a
        secret."""
        rows: list[EntryRow] = []
        handle = ""
        while len(rows) < MAX_ENTRIES:
            page = min(ENTRIES_PAGE, MAX_ENTRIES - len(rows))
            reply = await self.sources.directory(
                functools.partial(DirectoryClient.list_entries, count=page, handle=handle)
            )
            if reply is None:
                return Entries(await self._inquired_entries(), complete=True, with_health=False)
            rows += [listed_entry_row(entry) for entry in reply.entries]
            handle = reply.next_handle
            if not handle:
                return Entries(rows, complete=True, with_health=True)
        more = await self.sources.directory(
            functools.partial(DirectoryClient.list_entries, count=1, handle=handle)
        )
        return Entries(rows, complete=not (more and more.entries), with_health=True)

    async def _inquired_entries(self) -> list[EntryRow]:
        """The healthy entries, by type (what inquiries answer)."""
        rows: dict[int, EntryRow] = {}
        for type_value in SERVICE_TYPES.values():
            request = directory_pb2.InquireRequest(details=directory_pb2.ServiceDetails(type=type_value))
            found = await self.sources.directory(functools.partial(DirectoryClient.inquire, request=request))
            for data in found:
                rows[data.service_id] = entry_row(data, "healthy")  # inquiries answer healthy entries only
        return sorted(rows.values(), key=lambda row: row.service_id)


def entry_row(
    data: directory_pb2.FullServiceData,
    health: str,
    registered: str = "",
    last_check: str = "",
    failed_checks: int = 0,
) -> EntryRow:
    endpoint = data.endpoint
    protocol = directory_pb2.ServiceEndpoint.Protocol.Name(endpoint.protocol).lower()
    return EntryRow(
        data.service_id,
        service_type_name(data.details.type),
        f"{protocol}://{endpoint.host}:{endpoint.port}",
        dict(data.details.properties),
        data.permanent,
        health,
        registered,
        last_check,
        failed_checks,
    )


HEALTH_NAMES = {
    directory_entries_pb2.ENTRY_HEALTH_NOT_CHECKED: "not checked",
    directory_entries_pb2.ENTRY_HEALTH_AWAITING_FIRST_CHECK: "awaiting its first check",
    directory_entries_pb2.ENTRY_HEALTH_HEALTHY: "healthy",
    directory_entries_pb2.ENTRY_HEALTH_FAILING: "failing",
}


def listed_entry_row(entry: directory_entries_pb2.DirectoryEntry) -> EntryRow:
    return entry_row(
        entry.data,
        HEALTH_NAMES.get(entry.health, "unknown"),
        registered=utc_time(entry.registered_at),
        last_check=utc_time(entry.last_check_at) if entry.last_check_at else "",
        failed_checks=entry.failed_checks,
    )
