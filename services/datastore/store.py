"""SQL storage of the Trial Datastore: trials, their properties and their samples.

Samples are stored serialized (`StoredTrialSample` bytes) in arrival order per trial, and the
trial row keeps what reads need without counting or scanning: `samples_count`, `last_state` and
whether the trial ended or its ingestion closed. Every write says what it changed (`trial:<seq>`
for samples and deletions, `trials` for created or updated trials), so live readers in every
replica look again (see shared.notify).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sqlalchemy import (
    Boolean,
    Integer,
    and_,
    bindparam,
    case,
    delete,
    false,
    func,
    insert,
    select,
    update,
)
from sqlalchemy.sql.elements import ColumnElement

from services.datastore.model import SampleAppend, TrialCount, TrialProgress, TrialRecord, TrialStatus
from services.datastore.sample_sql import SAMPLE_SQL
from shared import property_match
from shared.db import Database, Transaction, in_batches
from shared.digest import pair_digest, sha256_hex
from shared.schema import datastore_samples as samples
from shared.schema import datastore_trial_properties as properties
from shared.schema import datastore_trials as trials

TRIALS_KEY = "trials"


def trial_key(trial_id: str) -> str:
    """What trials are keyed by (see shared.digest)."""
    return sha256_hex(trial_id)


def samples_key(trial_seq: int) -> str:
    """The change-feed key of a trial's samples (and of its deletion)."""
    return f"trial:{trial_seq}"


_TRIAL_COLUMNS = (
    trials.c.trial_seq,
    trials.c.trial_id,
    trials.c.user_id,
    trials.c.params,
    trials.c.samples_count,
    trials.c.last_state,
    trials.c.ended,
    trials.c.closed,
)


def _trial_record(row: Sequence[Any]) -> TrialRecord:
    seq, trial_id, user_id, params, count, state, ended, closed = row
    return TrialRecord(
        int(seq), trial_id, user_id, bytes(params), int(count), int(state), bool(ended), bool(closed)
    )


# Hot statements, built once.
_GET_TRIALS = select(*_TRIAL_COLUMNS).where(trials.c.trial_key.in_(bindparam("keys", expanding=True)))
# What a status needs, without the parameters (up to 1 MiB a trial).
_GET_STATUSES = select(
    trials.c.trial_id, trials.c.samples_count, trials.c.last_state, trials.c.ended, trials.c.closed
).where(trials.c.trial_key.in_(bindparam("keys", expanding=True)))
_PROGRESS = select(trials.c.samples_count, trials.c.ended, trials.c.closed).where(
    trials.c.trial_seq == bindparam("seq")
)
_READ_SAMPLES = (
    select(samples.c.data)
    .where(samples.c.trial_seq == bindparam("seq"), samples.c.sample_seq >= bindparam("first"))
    .order_by(samples.c.sample_seq)
    .limit(bindparam("limit", type_=Integer))
)
# length() of a blob (bytea) reads its size from SQLite's record (PostgreSQL's value header):
# the data itself is not read.
_SAMPLE_SIZES = (
    select(func.length(samples.c.data))
    .where(samples.c.trial_seq == bindparam("seq"), samples.c.sample_seq >= bindparam("first"))
    .order_by(samples.c.sample_seq)
    .limit(bindparam("limit", type_=Integer))
)
_LAST_SEQ = select(func.max(trials.c.trial_seq))
_COUNT_TRIALS = select(trials.c.last_state, trials.c.ended, trials.c.closed, func.count()).group_by(
    trials.c.last_state, trials.c.ended, trials.c.closed
)
# A closed trial keeps no lease (a renewal racing its stream's close must not re-arm one).
_RENEW_LEASES = update(trials).where(
    trials.c.trial_seq.in_(bindparam("seqs", expanding=True)), trials.c.closed == false()
)
_CLOSE_EXPIRED = (
    update(trials)
    .where(trials.c.lease_until > 0, trials.c.lease_until < bindparam("now"))
    .values(closed=True, lease_until=0)
    .returning(trials.c.trial_seq)
)
_LEASE_HOLDERS = select(trials.c.lease_holder).where(trials.c.lease_until > 0).distinct()
_CLOSE_HELD_BY = (
    update(trials)
    .where(trials.c.lease_until > 0, trials.c.lease_holder.in_(bindparam("holders", expanding=True)))
    .values(closed=True, lease_until=0)
    .returning(trials.c.trial_seq)
)
_DELETE_PROPERTIES = delete(properties).where(properties.c.trial_seq == bindparam("seq"))
_INSERT_PROPERTIES = insert(properties)


class DatastoreStore:
    def __init__(self, database: Database) -> None:
        self.db = database
        self._sql = database.pick(SAMPLE_SQL)
        upsert = database.insert(trials)
        # `reopen`: a new ingestion stream starts, live readers wait for it again.
        self._upsert_trial = upsert.on_conflict_do_update(
            index_elements=[trials.c.trial_key],
            set_={
                "trial_id": upsert.excluded.trial_id,
                "user_id": upsert.excluded.user_id,
                "params": upsert.excluded.params,
                "closed": and_(trials.c.closed, ~bindparam("reopen", type_=Boolean)),
                "lease_until": case(
                    (bindparam("reopen", type_=Boolean), upsert.excluded.lease_until),
                    else_=trials.c.lease_until,
                ),
                "lease_holder": case(
                    (bindparam("reopen", type_=Boolean), upsert.excluded.lease_holder),
                    else_=trials.c.lease_holder,
                ),
            },
        ).returning(trials.c.trial_seq)

    # ---- trials ----

    async def upsert_trial(
        self,
        trial_id: str,
        user_id: str,
        params: bytes,
        trial_properties: Mapping[str, str],
        now_ns: int,
        *,
        reopen: bool = False,
        lease_until: Callable[[], int] = lambda: 0,
        lease_holder: str = "",
    ) -> int:
        """Create the trial, or replace its user id and parameters (keeping its samples).
        Returns its `trial_seq`. `reopen`: an ingestion stream starts, and `lease_holder` holds
        the trial's lease until `lease_until()` (ns, taken when the write is made)."""
        row = {
            "trial_key": trial_key(trial_id),
            "trial_id": trial_id,
            "user_id": user_id,
            "params": params,
            "created_at": now_ns,
            "samples_count": 0,
            "last_state": 0,
            "ended": False,
            "closed": False,
            "lease_until": 0,
            "lease_holder": lease_holder if reopen else "",
            "reopen": reopen,
        }
        digests = sorted({pair_digest(name, value) for name, value in trial_properties.items()})

        def write(transaction: Transaction) -> int:
            if reopen:
                row["lease_until"] = lease_until()
            seq = int(transaction.execute(self._upsert_trial, row).scalar_one())
            transaction.execute(_DELETE_PROPERTIES, {"seq": seq})
            if digests:
                transaction.execute(
                    _INSERT_PROPERTIES, [{"trial_seq": seq, "pair_digest": digest} for digest in digests]
                )
            transaction.changed([TRIALS_KEY, samples_key(seq)])
            return seq

        return await self.db.write(write)

    async def get_trials(self, trial_ids: Sequence[str]) -> dict[str, TrialRecord]:
        found: dict[str, TrialRecord] = {}
        keys = list(dict.fromkeys(trial_key(trial_id) for trial_id in trial_ids))
        for batch in in_batches(keys):
            rows = await self.db.fetch(_GET_TRIALS, {"keys": batch})
            for row in rows:
                record = _trial_record(row)
                found[record.trial_id] = record
        return found

    async def trial_statuses(self, trial_ids: Sequence[str]) -> dict[str, TrialStatus]:
        """The statuses of the trials that exist among `trial_ids`, by id: one query per
        IN_LIST_BATCH ids."""
        found: dict[str, TrialStatus] = {}
        keys = list(dict.fromkeys(trial_key(trial_id) for trial_id in trial_ids))
        for batch in in_batches(keys):
            for trial_id, count, state, ended, closed in await self.db.fetch(_GET_STATUSES, {"keys": batch}):
                found[trial_id] = TrialStatus(trial_id, int(count), int(state), bool(ended), bool(closed))
        return found

    async def count_trials(self) -> list[TrialCount]:
        """How many trials stand each way (one scan of the trials, none of their samples)."""
        rows = await self.db.fetch(_COUNT_TRIALS)
        return [
            TrialCount(int(state), bool(ended), bool(closed), int(count))
            for state, ended, closed, count in rows
        ]

    async def last_trial_seq(self) -> int:
        rows = await self.db.fetch(_LAST_SEQ)
        return int(rows[0][0] or 0)

    async def list_trials(
        self,
        after_seq: int,
        up_to_seq: int,
        trial_ids: Sequence[str],
        trial_properties: Mapping[str, str],
        limit: int | None,
    ) -> list[TrialRecord]:
        """Trials in creation order with `after_seq < trial_seq <= up_to_seq`, among `trial_ids`
        (any if empty) whose properties include `trial_properties`."""
        conditions: list[ColumnElement[bool]] = [
            trials.c.trial_seq > after_seq,
            trials.c.trial_seq <= up_to_seq,
        ]
        parameters: dict[str, Any] = {}
        if trial_properties:
            conditions.append(property_match.includes_every_pair(properties, trials.c.trial_seq))
            parameters = property_match.parameters(trial_properties)
        statement = select(*_TRIAL_COLUMNS).where(*conditions).order_by(trials.c.trial_seq)
        if not trial_ids:
            rows = await self.db.fetch(statement if limit is None else statement.limit(limit), parameters)
            return [_trial_record(row) for row in rows]
        keys = list(dict.fromkeys(trial_key(trial_id) for trial_id in trial_ids))
        found: list[TrialRecord] = []
        for batch in in_batches(keys):
            chunk = statement.where(trials.c.trial_key.in_(batch))
            found.extend(_trial_record(row) for row in await self.db.fetch(chunk, parameters))
        found.sort(key=lambda record: record.trial_seq)
        return found if limit is None else found[:limit]

    async def delete_trials(self, trial_ids: Sequence[str]) -> list[int]:
        """Delete the trials (with their samples) in one transaction; unknown ids are ignored.
        Returns the `trial_seq` of those deleted."""
        keys = list(dict.fromkeys(trial_key(trial_id) for trial_id in trial_ids))

        def write(transaction: Transaction) -> list[int]:
            deleted: list[int] = []
            for batch in in_batches(keys):
                statement = delete(trials).where(trials.c.trial_key.in_(batch)).returning(trials.c.trial_seq)
                deleted.extend(int(seq) for seq in transaction.execute(statement).scalars())
            transaction.changed(samples_key(seq) for seq in deleted)
            return deleted

        return await self.db.write(write)

    # ---- samples ----

    async def append(self, appends: Sequence[SampleAppend], *, retry: bool = False) -> list[int | None]:
        """Store every append in one transaction. Returns, per append, the number its first stored
        sample got in the trial, or None if the trial no longer exists (its samples are dropped).
        `retry`: an earlier attempt at the same appends may have committed (its outcome is
        unknown); what it stored is not stored again."""
        seqs = [append.trial_seq for append in appends]
        keys = [samples_key(seq) for seq in dict.fromkeys(seqs)]
        if retry or self._sql.append_batch is None or len(keys) < len(appends):
            work = functools.partial(self._sql.append, appends=appends, verify=retry)
            return await self.db.write_on_cursor(work, keys)
        rows = await self.db.write_statement(
            self._sql.append_batch,
            {
                "appends": json.dumps(
                    [
                        {
                            "trial_seq": append.trial_seq,
                            "stream": append.stream,
                            "position": append.position,
                            "added": len(append.samples),
                            "last_state": append.last_state,
                            "ended": append.ended,
                            "close": append.close,
                        }
                        for append in appends
                    ]
                ),
                "data": [data for append in appends for data in append.samples],
            },
            keys,
        )
        firsts = {int(seq): int(first) for seq, first in rows}
        return [firsts.get(seq) for seq in seqs]

    async def renew_leases(self, trial_seqs: Sequence[int], until_ns: int, holder: str) -> None:
        """The ingestion streams of these trials are still open in the process `holder`: hold
        their leases."""
        statement = _RENEW_LEASES.values(lease_until=until_ns, lease_holder=holder)
        seqs = list(trial_seqs)

        def write(transaction: Transaction) -> None:
            for batch in in_batches(seqs):
                transaction.execute(statement, {"seqs": batch})

        await self.db.write(write)

    async def close_expired(self, now_ns: int) -> list[int]:
        """Close the trials whose lease expired (their ingesting process died): returns their seqs."""

        def write(transaction: Transaction) -> list[int]:
            closed = [int(seq) for seq in transaction.execute(_CLOSE_EXPIRED, {"now": now_ns}).scalars()]
            transaction.changed(samples_key(seq) for seq in closed)
            return closed

        return await self.db.write(write)

    async def lease_holders(self) -> list[str]:
        """The holders of leases in force (or run out, not yet closed)."""
        return [str(holder) for (holder,) in await self.db.fetch(_LEASE_HOLDERS)]

    async def close_held_by(self, holders: Sequence[str]) -> list[int]:
        """Close the leased trials of these holders (their processes are gone): returns their seqs."""
        holders = list(holders)

        def write(transaction: Transaction) -> list[int]:
            closed: list[int] = []
            for batch in in_batches(holders):
                closed += [
                    int(seq) for seq in transaction.execute(_CLOSE_HELD_BY, {"holders": batch}).scalars()
                ]
            transaction.changed(samples_key(seq) for seq in closed)
            return closed

        return await self.db.write(write)

    async def sample_sizes(self, trial_seq: int, first: int, limit: int) -> list[int]:
        """The sizes of the samples `read_samples` would read, without reading them."""
        rows = await self.db.fetch(_SAMPLE_SIZES, {"seq": trial_seq, "first": first, "limit": limit})
        return [int(row[0]) for row in rows]

    async def read_samples(self, trial_seq: int, first: int, limit: int) -> list[bytes]:
        rows = await self.db.fetch(_READ_SAMPLES, {"seq": trial_seq, "first": first, "limit": limit})
        return [bytes(row[0]) for row in rows]

    async def progress(self, trial_seq: int) -> TrialProgress | None:
        """How far the trial got; None if it was deleted."""
        rows = await self.db.fetch(_PROGRESS, {"seq": trial_seq})
        if not rows:
            return None
        count, ended, closed = rows[0]
        return TrialProgress(int(count), bool(ended), bool(closed))
