"""Registrations written to the directory's tables in batches (see shared.group_commit).

Registrations that arrive while a batch is being written go in the next one, up to ADD_BATCH;
each is answered once its batch is written, or fails with it (a batch is written whole or not at
all; after an id collision, its registrations are written one by one). Where the database has a
statement for new entries (`NEW_ENTRIES_SQL`), new entries go in one statement per batch, and
permanent ones, whose upserts take a round trip each, go in batches of their own that new ones do
not wait for.

A write that fails as UNAVAILABLE (the database is away, or the connection broke after the COMMIT
was sent, so the batch may have committed) is not answered with the failure: the outage is ridden
out (`Dependencies.ride_out`, up to `--outage_bound`), then the batch's new entries are read back
by the service ids and secret nonces drawn for them before the first write. Found, the batch
committed, and they are answered as written; not found, the batch is written again with the same
ids. Permanent entries are upserts on their identity: written again, they find the entry the
first write made. A registration is therefore answered once, and a client does not retry into a
second entry (unless the database stays away past the bound: it is then told UNAVAILABLE).
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

from services.directory.entry_sql import NEW_ENTRIES_SQL, nonces_statement
from services.directory.model import CHECK_LEASE_NS, MAX_SERVICE_ID, Registration, entry_keys
from shared.db import Database, Transaction
from shared.dependencies import Dependencies
from shared.digest import pair_digest, sha256_hex
from shared.errors import Unavailable, classify
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
        self.result: asyncio.Future[Written] = asyncio.get_running_loop().create_future()
        self.queued = False
        self.pending = 1
        self.pending_bytes = sum(len(name) + len(value) for name, value in registration.properties.items())
        # Its row. A new entry's service id and secret nonce are drawn once, before the first
        # write: a write whose outcome is unknown is read back by them, and made again with them.
        self.row = _service_row(registration, token_digest, now_ns)
        # Every service id drawn for it: a permanent entry's upsert that returns one of them
        # created the entry, in this write or in one whose answer was lost.
        self.drawn_ids = {self.row["service_id"]}
        # What was written for it, once known.
        self.written: Written | None = None
        # Whether a write of it failed with its outcome unknown: it may have committed, or still
        # commit (a transaction the server finishes after the connection broke).
        self.uncertain = False

    @property
    def dropped(self) -> bool:
        """Its caller gave up (its client's deadline, a cancelled stream) before its batch took it:
        it is not written. Written, it would be an entry whose client, told nothing, registers
        again: two entries, and a secret nobody knows."""
        return self.result.cancelled()

    @property
    def may_draw_again(self) -> bool:
        """Whether it may be written with other ids. Not a new entry a write of which may still
        commit: with other ids, both could commit, as two entries; with the same ones, the
        second to come fails on the first's key."""
        return self.registration.permanent or not self.uncertain

    def draw_again(self) -> None:
        """A fresh service id and nonce: the last ones were another entry's, or (a permanent
        entry) may have been written already, which its upsert then finds."""
        assert self.may_draw_again, "a new entry that may be written keeps its ids"
        self.row = {**self.row, "service_id": _new_service_id(), "secret_nonce": _new_nonce()}
        self.drawn_ids.add(self.row["service_id"])

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
    def __init__(self, database: Database, dependencies: Dependencies | None = None) -> None:
        self.db = database
        self._dependencies = dependencies or Dependencies([])
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
        failures: dict[int, Exception] = {}
        try:
            await self._written(write, adds)
        except IntegrityError as collision:
            # A new service id was another entry's (one chance in 2^63 per entry), and none of
            # the batch's new entries committed (`_written` says so only then): redo those not
            # written one by one, each with fresh ids, so one collision does not fail the others.
            for index, pending in enumerate(adds):
                if pending.written is None:
                    try:
                        await self._retried(write, pending, collision)
                    except Exception as error:
                        failures[index] = error
        except Exception as error:
            failures = {index: error for index, pending in enumerate(adds) if pending.written is None}
        for index, pending in enumerate(adds):
            pending.settle(pending.written if pending.written is not None else failures[index])

    async def _retried(
        self,
        write: Callable[[list[PendingAdd]], Awaitable[list[Written]]],
        pending: PendingAdd,
        collision: IntegrityError,
    ) -> None:
        """Write `pending` alone with fresh ids after `collision`, up to ID_COLLISION_RETRIES
        times (a collision that comes back is not one: it fails), while it may be written with
        other ids (`may_draw_again`; else it fails with the collision)."""
        for attempt in range(ID_COLLISION_RETRIES + 1):
            if not pending.may_draw_again:
                raise collision
            pending.draw_again()
            try:
                await self._written(write, [pending])
                return
            except IntegrityError as again:
                if attempt == ID_COLLISION_RETRIES:
                    raise
                collision = again

    async def _written(
        self, write: Callable[[list[PendingAdd]], Awaitable[list[Written]]], adds: list[PendingAdd]
    ) -> None:
        """Write `adds`, each one's outcome kept in its `written`. After a failure that leaves
        the outcome unknown, the outage is ridden out, and what committed is read back before
        anything is written again, with the same ids. An IntegrityError is raised only when the
        read-back found none of their new entries: a key was another entry's."""
        try:
            await self._write(write, adds)
            return
        except Exception as error:
            if not isinstance(classify(error), Unavailable):
                raise
        for pending in adds:
            pending.uncertain = True
        await self._dependencies.ride_out(functools.partial(self._written_again, write, adds))

    async def _written_again(
        self, write: Callable[[list[PendingAdd]], Awaitable[list[Written]]], adds: list[PendingAdd]
    ) -> None:
        """One attempt after a write of `adds` whose outcome is unknown: what committed read
        back, the rest written again."""
        await self._read_back(adds)
        try:
            await self._write(write, adds, again=True)
        except IntegrityError:
            # Either a new id was another entry's, or the write whose outcome was unknown
            # committed after the read-back (the server finished it after the connection broke),
            # and its entries hold the ids: they tell which.
            if not await self._read_back(adds):
                raise
            await self._write(write, adds, again=True)

    async def _write(
        self,
        write: Callable[[list[PendingAdd]], Awaitable[list[Written]]],
        adds: list[PendingAdd],
        *,
        again: bool = False,
    ) -> None:
        """Write those of `adds` not known to be written. `again`: after an unknown outcome, a
        permanent entry gets a fresh id, so that its upsert tells whether the entry it returns
        was created for it (`drawn_ids`), and not only now."""
        unwritten = [pending for pending in adds if pending.written is None]
        if not unwritten:
            return
        if again:
            for pending in unwritten:
                if pending.registration.permanent:
                    pending.draw_again()
        for pending, written in zip(unwritten, await write(unwritten), strict=True):
            pending.written = written

    async def _read_back(self, adds: list[PendingAdd]) -> bool:
        """Whether the new entries of `adds` not known to be written committed, read back by
        their ids and nonces; if they did, each is known written. Every write of them since
        their first one wrote all of them with the same ids, whole or not at all: one found
        means they all committed (one missing now was removed since, by its health checks).
        One of their ids held by another entry means that none of those writes can commit:
        they may be drawn again (`may_draw_again`)."""
        new = [pending for pending in adds if pending.written is None and not pending.registration.permanent]
        if not new:
            return False
        rows = await self.db.fetch(
            nonces_statement(), {"ids": [pending.row["service_id"] for pending in new]}
        )
        nonces = {int(service_id): str(nonce) for service_id, nonce in rows}
        found = [nonces.get(pending.row["service_id"]) for pending in new]
        if any(nonce == pending.row["secret_nonce"] for pending, nonce in zip(new, found, strict=True)):
            for pending in new:
                pending.written = (int(pending.row["service_id"]), str(pending.row["secret_nonce"]), True)
            return True
        if any(nonce is not None for nonce in found):
            for pending in new:
                pending.uncertain = False
        return False

    async def _write_in_transaction(self, batch: list[PendingAdd]) -> list[Written]:
        return await self.db.write(lambda transaction: self._write_adds(transaction, batch))

    def _write_adds(self, transaction: Transaction, batch: list[PendingAdd]) -> list[Written]:
        results: list[Written] = []
        new_rows: list[dict[str, Any]] = []
        new_properties: list[dict[str, Any]] = []
        for pending in batch:
            row = pending.row
            if pending.registration.permanent:
                # One at a time, in order: a later identical registration updates this one.
                stored_id, stored_nonce = transaction.execute(self._upsert_permanent, row).one()
            else:
                new_rows.append(row)
                stored_id, stored_nonce = row["service_id"], row["secret_nonce"]
            if stored_id == row["service_id"]:  # inserted now
                new_properties += _property_rows(stored_id, pending.registration)
            results.append((int(stored_id), str(stored_nonce), stored_id in pending.drawn_ids))
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
        rows = [pending.row for pending in batch]
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
        "service_id": _new_service_id(),
        "registered_at": now_ns,
        "protocol": registration.endpoint.protocol,
        "host": registration.endpoint.host,
        "port": registration.endpoint.port,
        "service_type": registration.service_type,
        "properties": properties_json,
        "properties_digest": sha256_hex(properties_json),
        "permanent": registration.permanent,
        "token_digest": token_digest,
        "secret_nonce": _new_nonce(),
        "failed_checks": 0,
        "load": 0,
        "last_check_at": 0,
        "next_check_at": now_ns if registration.health_checked else None,
        # The replica that takes a registration checks it first: claimed by it from the start.
        "claimed_until": now_ns + CHECK_LEASE_NS if registration.health_checked else 0,
    }


def _new_service_id() -> int:
    return secrets.randbelow(MAX_SERVICE_ID) + 1


def _new_nonce() -> str:
    return secrets.token_hex(16)
