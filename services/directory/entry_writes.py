"""Registrations written to the directory's tables in batches (see shared.group_commit).

Registrations that arrive while a batch is being written go in the next one, up to ADD_BATCH;
each is answered once its batch is written, or fails with it (a batch is written whole or not at
all; after an id collision, its registrations are written one by one). Where the database has a
statement for new entries (`NEW_ENTRIES_SQL`), new entries go in one statement per batch, and
permanent ones, whose upserts take a round trip each, go in batches of their own that new ones do
not wait for.
"""

from __future__ import annotations

import asyncio
import functools
import json
import secrets
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from sqlalchemy import insert
from sqlalchemy.exc import IntegrityError

from services.directory.entry_sql import NEW_ENTRIES_SQL
from services.directory.model import CHECK_LEASE_NS, MAX_SERVICE_ID, Registration, entry_keys
from shared.db import Database, Transaction
from shared.digest import pair_digest, sha256_hex
from shared.group_commit import GroupCommit
from shared.schema import directory_service_properties as properties_table
from shared.schema import directory_services as services
from shared.schema import directory_services_permanent_identity as permanent_identity

# Registrations written in one batch at most, and about this many bytes of properties.
ADD_BATCH = 256
ADD_BATCH_BYTES = 8 * 1024 * 1024
# A registration whose new id collided is tried again with fresh ids this many times at most.
ID_COLLISION_RETRIES = 3

# (service id, secret nonce, created) of a written registration.
Written = tuple[int, str, bool]


def canonical_properties(properties: dict[str, str]) -> str:
    return json.dumps(properties, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


class PendingAdd:
    """A registration waiting for its batch: a group commit source of one item."""

    def __init__(self, registration: Registration, token_digest: str, now_ns: int) -> None:
        self.registration = registration
        self.token_digest = token_digest
        self.now_ns = now_ns
        self.result: asyncio.Future[Written] = asyncio.get_running_loop().create_future()
        self.queued = False
        self.pending = 1
        self.pending_bytes = sum(len(name) + len(value) for name, value in registration.properties.items())
        self.dropped = False

    def take(self, limit: int) -> tuple[PendingAdd, int, int]:
        self.pending = 0
        return self, 1, self.pending_bytes

    def has_work(self) -> bool:
        return bool(self.pending)

    def settle(self, outcome: Written | Exception) -> None:
        if self.result.done():  # its caller was cancelled
            return
        if isinstance(outcome, Exception):
            self.result.set_exception(outcome)
        else:
            self.result.set_result(outcome)

    failed = settle


_Batch = list[tuple[PendingAdd, PendingAdd, int]]


class EntryWrites:
    def __init__(self, database: Database) -> None:
        self.db = database
        self._insert_new_sql = database.pick(NEW_ENTRIES_SQL)
        self._permanent_adds = self._group_commit("permanent-registration-writer", self._write_in_transaction)
        if self._insert_new_sql is None:
            self._new_adds = self._permanent_adds
        else:
            self._new_adds = self._group_commit("registration-writer", self._insert_new)

    def _group_commit(
        self, name: str, write: Callable[[list[PendingAdd]], Awaitable[list[Written]]]
    ) -> GroupCommit[PendingAdd, PendingAdd]:
        commit: GroupCommit[PendingAdd, PendingAdd] = GroupCommit(
            name, functools.partial(self._write_batch, write), max_items=ADD_BATCH, max_bytes=ADD_BATCH_BYTES
        )
        commit.start()
        return commit

    async def add(self, registration: Registration, token_digest: str, now_ns: int) -> Written:
        """Store a registration; returns (service id, secret nonce, created).

        A permanent registration whose token, type and full property map match a permanent
        entry updates that entry's endpoint in place (same id and nonce) instead.
        """
        pending = PendingAdd(registration, token_digest, now_ns)
        (self._permanent_adds if registration.permanent else self._new_adds).schedule(pending)
        return await pending.result

    async def _write_batch(
        self, write: Callable[[list[PendingAdd]], Awaitable[list[Written]]], batch: _Batch
    ) -> None:
        adds = [pending for pending, _, _ in batch]
        outcomes: list[Written | Exception]
        try:
            outcomes = list(await write(adds))
        except IntegrityError:
            # A service id collision (one chance in 2^63 per entry): redo them one by one, each
            # with fresh ids, so one collision does not fail the others.
            outcomes = []
            for pending in adds:
                try:
                    outcomes.append(await self._retried(write, pending))
                except Exception as error:
                    outcomes.append(error)
        except Exception as error:
            outcomes = [error for _ in adds]
        for pending, outcome in zip(adds, outcomes, strict=True):
            pending.settle(outcome)

    async def _retried(
        self, write: Callable[[list[PendingAdd]], Awaitable[list[Written]]], pending: PendingAdd
    ) -> Written:
        # Fresh ids each time; an integrity error that comes back is not a collision: it fails.
        for _ in range(ID_COLLISION_RETRIES):
            try:
                return (await write([pending]))[0]
            except IntegrityError:
                continue
        return (await write([pending]))[0]

    async def _write_in_transaction(self, batch: list[PendingAdd]) -> list[Written]:
        return await self.db.write(lambda transaction: self._write_adds(transaction, batch))

    def _write_adds(self, transaction: Transaction, batch: list[PendingAdd]) -> list[Written]:
        results: list[Written] = []
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

    async def _insert_new(self, batch: list[PendingAdd]) -> list[Written]:
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


def _property_rows(service_id: int, registration: Registration) -> list[dict[str, Any]]:
    return [
        {"service_id": service_id, "pair_digest": pair_digest(name, value), "name": name, "value": value}
        for name, value in registration.properties.items()
    ]


def _changed_entries(batch: Sequence[PendingAdd], results: Sequence[Written]) -> tuple[list[str], list[str]]:
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
