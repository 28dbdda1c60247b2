"""The ingestion's statements, in each database's own SQL (`SAMPLE_SQL`, chosen once by the store).

They run on the driver's cursor: SQLAlchemy's work per execution cost more than the database's
own. A batch on a cursor is four statements whatever its size (each statement is a hand-off of
the GIL on SQLite's writer thread): the trials' counts, every sample, every trial's update, every
stream's position. Sample numbers are taken from the counts read first, so the trials must stay
locked from that read on: SQLite's write transaction locks the database (BEGIN IMMEDIATE),
PostgreSQL's rows are locked by the read (FOR UPDATE, in trial order).

Appends are idempotent: each says which stream it comes from and how many of that stream's
samples came before it, and each batch records, per stream, how many it stored. A batch tried
again after an attempt whose outcome is unknown (its COMMIT's answer lost) is `verified`: the
positions are read once the trials are locked, so that a previous attempt's commit, even one that
landed while this attempt waited for the lock, is seen, and only what it did not store is stored.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from services.datastore.model import SampleAppend
from shared.db.dialect import PUBLISHED
from shared.schema import datastore_ingestion_streams as streams
from shared.schema import datastore_samples as samples
from shared.schema import datastore_trials as trials


@dataclass(frozen=True)
class SampleSql:
    # Reads (trial_seq, samples_count) of the trials bound as one parameter, locked.
    lock_counts: str
    # Reads (trial_seq, stream_id, appended) of the same trials' streams.
    read_positions: str
    # That parameter, from the sorted trial seqs: no cap on their number.
    trial_seqs: Callable[[list[int]], Any]
    # Parameters: added, last state (or NULL), ended, close, close, trial_seq.
    bump_trial: str
    # Parameters: trial_seq, sample_seq, data.
    insert_samples: str
    # Parameters: trial_seq, stream_id, appended.
    record_position: str
    # A whole batch whose appends are each of a different trial, in one statement (parameters:
    # `appends`, a JSON list, and `data`, every sample in order), returning (trial_seq, first);
    # None: batches go through the cursor.
    append_batch: str | None

    def append(
        self, cursor: Any, appends: Sequence[SampleAppend], *, verify: bool = False
    ) -> list[int | None]:
        """The appends, in order, on a driver cursor inside a transaction: per append, the number
        its first sample stored now got, or None if its trial no longer exists. `verify`: samples
        that a previous attempt stored (per their streams' recorded positions) are not stored again."""
        trial_seqs = self.trial_seqs(sorted({append.trial_seq for append in appends}))
        cursor.execute(self.lock_counts, (trial_seqs,))
        counts = {int(seq): int(count) for seq, count in cursor.fetchall()}
        # Per (trial, stream): how many of the stream's samples the trial holds.
        stored: dict[tuple[int, int], int] = {}
        if verify:
            cursor.execute(self.read_positions, (trial_seqs,))
            stored = {(int(seq), int(stream)): int(appended) for seq, stream, appended in cursor.fetchall()}
        recorded: dict[tuple[int, int], int] = {}
        firsts: list[int | None] = []
        rows: list[tuple[int, int, bytes]] = []
        bumps: list[tuple[int, int | None, bool, bool, bool, int]] = []
        for append in appends:
            seq = append.trial_seq
            first = counts.get(seq)
            firsts.append(first)
            if first is None:  # deleted: its samples are dropped
                continue
            stream = (seq, append.stream)
            done = min(len(append.samples), max(0, stored.get(stream, append.position) - append.position))
            new = append.samples[done:]
            stored[stream] = recorded[stream] = append.position + len(append.samples)
            counts[seq] = first + len(new)
            rows.extend((seq, first + index, data) for index, data in enumerate(new))
            bumps.append((len(new), append.last_state, append.ended, append.close, append.close, seq))
        if rows:
            cursor.executemany(self.insert_samples, rows)
        if bumps:
            cursor.executemany(self.bump_trial, bumps)
            positions = [(seq, stream, appended) for (seq, stream), appended in recorded.items()]
            cursor.executemany(self.record_position, positions)
        return firsts


def _cursor_statements(mark: str) -> dict[str, str]:
    return {
        "bump_trial": (
            f"UPDATE {trials.name} SET samples_count = samples_count + {mark}, "
            f"last_state = COALESCE({mark}, last_state), ended = (ended OR {mark}), "
            f"closed = (closed OR {mark}), lease_until = CASE WHEN {mark} THEN 0 ELSE lease_until END "
            f"WHERE trial_seq = {mark}"
        ),
        "insert_samples": (
            f"INSERT INTO {samples.name} (trial_seq, sample_seq, data) VALUES ({mark}, {mark}, {mark})"
        ),
        "record_position": (
            f"INSERT INTO {streams.name} (trial_seq, stream_id, appended) VALUES ({mark}, {mark}, {mark}) "
            "ON CONFLICT (trial_seq, stream_id) DO UPDATE SET appended = excluded.appended"
        ),
    }


# One round trip on PostgreSQL's direct connection (only the batcher's one task writes samples):
# every trial's UPDATE, the samples numbered from the counts it returns, every stream's position,
# and the database's publication of what changed (PUBLISHED). It does not verify (a first attempt
# has nothing to verify; retries go through the cursor). The appends come as one
# JSON text, not an array per field: the driver's Python code that adapts a list cost more per
# statement than the rest of the batch's way there.
_POSTGRESQL_APPEND_BATCH = f"""
    WITH batch AS (
        SELECT *, CAST(sum(added) OVER (ORDER BY batch_order) - added AS bigint) AS data_offset
        FROM ROWS FROM (
            json_to_recordset(%(appends)s::json)
                AS (trial_seq bigint, stream bigint, position bigint, added bigint, last_state smallint,
                    ended boolean, close boolean)
        ) WITH ORDINALITY AS b (trial_seq, stream, position, added, last_state, ended, close, batch_order)
    ), bumped AS (
        UPDATE {trials.name} AS t SET
            samples_count = t.samples_count + b.added,
            last_state = COALESCE(b.last_state, t.last_state),
            ended = (t.ended OR b.ended),
            closed = (t.closed OR b.close),
            lease_until = CASE WHEN b.close THEN 0 ELSE t.lease_until END
        FROM batch AS b WHERE t.trial_seq = b.trial_seq
        RETURNING t.trial_seq, t.samples_count - b.added AS first, b.added, b.data_offset,
            b.stream, b.position
    ), positioned AS (
        INSERT INTO {streams.name} (trial_seq, stream_id, appended)
        SELECT trial_seq, stream, position + added FROM bumped
        ON CONFLICT (trial_seq, stream_id) DO UPDATE SET appended = excluded.appended
    ), inserted AS (
        -- The data array holds the samples of every append, one append after the other.
        INSERT INTO {samples.name} (trial_seq, sample_seq, data)
        SELECT bumped.trial_seq, bumped.first + k.i - 1, d.data
        FROM bumped CROSS JOIN LATERAL generate_series(1, bumped.added) AS k (i)
        JOIN unnest(%(data)b::bytea[]) WITH ORDINALITY AS d (data, position)
            ON d.position = bumped.data_offset + k.i
    )
    SELECT bumped.trial_seq, bumped.first FROM bumped {PUBLISHED}
    """

SAMPLE_SQL = {
    "postgresql": SampleSql(
        lock_counts=(
            f"SELECT trial_seq, samples_count FROM {trials.name} WHERE trial_seq = ANY(%s) "
            "ORDER BY trial_seq FOR UPDATE"
        ),
        read_positions=f"SELECT trial_seq, stream_id, appended FROM {streams.name} WHERE trial_seq = ANY(%s)",
        trial_seqs=lambda seqs: seqs,
        append_batch=_POSTGRESQL_APPEND_BATCH,
        **_cursor_statements("%s"),
    ),
    "sqlite": SampleSql(
        lock_counts=(
            f"SELECT trial_seq, samples_count FROM {trials.name} "
            "WHERE trial_seq IN (SELECT value FROM json_each(?))"
        ),
        read_positions=(
            f"SELECT trial_seq, stream_id, appended FROM {streams.name} "
            "WHERE trial_seq IN (SELECT value FROM json_each(?))"
        ),
        trial_seqs=json.dumps,
        append_batch=None,
        **_cursor_statements("?"),
    ),
}
