"""The directory's in-memory index of its entries: inquiries are answered from it, without a
database round trip, while it is current.

It is loaded at start and kept current from the change feed: every write to an entry marks the
key `entry:<id>` (`DirectoryStore`), and the index re-reads the rows of the ids it hears of, in
one task, one query per burst. Re-reading in one task makes it move forward only: each read sees
the database at least as new as the one before, so an entry deleted and re-read is never brought
back by an older read.

Consistency (see the README's "Directory consistency"):
- on the replica that took a write, a `Register` or `Deregister` answer comes once the index
  holds it (`caught_up`): read-your-writes;
- other replicas hear of it through PostgreSQL's notifications, a few milliseconds later;
- the index is current only while the feed listens: from the moment the listening connection
  fails (`lost`) until it listens again and the index has been reloaded, inquiries are answered
  from the database instead, never from an index that may have missed changes.

`cogment_directory_index_lag_seconds` measures, per pass of the applier, the time from hearing of
the oldest change it applies to the index holding it. The time from another replica's commit to
its notification arriving (or, on a shared SQLite file, to the next poll finding it: 0.5 s at
most) is not in it: no clock of this replica saw that commit.
"""

from __future__ import annotations

import asyncio
import itertools
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol, TypeVar

from services.directory.entry_sql import IndexRow
from services.directory.model import ALL_ENTRIES_KEY, ENTRY_KEY_PREFIX, UNKNOWN_SERVICE, Entry, Inquiry
from services.directory.store import DirectoryStore
from shared.load import UNSERVICEABLE
from shared.logging import get_logger
from shared.metrics import PlainHistogram
from shared.supervision import Supervised

# Ids re-read per query; beyond this many pending ids, the whole index is reloaded instead.
REREAD_CHUNK = 500
RELOAD_ABOVE = 20_000
# Matches handed out per page (the servicer encodes a page at a time).
PAGE_ENTRIES = 1000

log = get_logger("directory.index")
lag_seconds = PlainHistogram(
    "cogment_directory_index_lag_seconds",
    "Time from hearing of a change (notification, own commit, poll of a shared SQLite file) to "
    "the in-memory index holding it.",
)

# Generations of every index of the process: a change draws the next, so no two states of any
# index (a reloaded one included) share one.
_GENERATIONS = itertools.count(1)


@dataclass(frozen=True)
class _Indexed:
    entry: Entry
    token_digest: str
    visible: bool


class EntryIndex:
    """Entries by id, by token, by (token, type) and by property pair, and the inquiries'
    matching rules on them (those of the store's SQL: see `DirectoryStore.find`)."""

    def __init__(self) -> None:
        self._entries: dict[int, _Indexed] = {}
        self._by_token: dict[str, set[int]] = {}
        self._by_token_type: dict[tuple[str, int], set[int]] = {}
        self._by_pair: dict[tuple[str, str], set[int]] = {}
        # Changes with every change of the entries: answers found at one generation hold until it
        # changes (see `Directory.answer_stamp`).
        self.generation = next(_GENERATIONS)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, service_id: int) -> bool:
        return service_id in self._entries

    def put(self, row: IndexRow) -> None:
        service_id = row.entry.service_id
        token_digest = sys.intern(row.token_digest)  # a few tokens, one copy each
        indexed = _Indexed(row.entry, token_digest, row.visible)
        earlier = self._entries.get(service_id)
        if earlier is not None and _answered_alike(earlier, indexed):
            # A health-check result that changes nothing an answer holds (its load and check
            # times are used only when answers are not remembered): same place, same generation.
            self._entries[service_id] = indexed
            return
        self.discard(service_id)
        self.generation = next(_GENERATIONS)
        self._entries[service_id] = indexed
        self._by_token.setdefault(token_digest, set()).add(service_id)
        self._by_token_type.setdefault((token_digest, row.entry.service_type), set()).add(service_id)
        for pair in row.entry.properties.items():
            self._by_pair.setdefault(pair, set()).add(service_id)

    def discard(self, service_id: int) -> None:
        indexed = self._entries.pop(service_id, None)
        if indexed is None:
            return
        self.generation = next(_GENERATIONS)
        entry = indexed.entry
        _remove(self._by_token, indexed.token_digest, service_id)
        _remove(self._by_token_type, (indexed.token_digest, entry.service_type), service_id)
        for pair in entry.properties.items():
            _remove(self._by_pair, pair, service_id)

    def matches(self, inquiry: Inquiry, token_digest: str) -> list[Entry]:
        """The visible entries an inquiry matches with this token, most recent first. The entries
        are the index's own: callers must not change them."""
        if inquiry.service_id is not None:
            indexed = self._entries.get(inquiry.service_id)
            if indexed is None or not indexed.visible or indexed.token_digest != token_digest:
                return []
            return [indexed.entry]
        typed = inquiry.service_type != UNKNOWN_SERVICE
        candidates = (
            self._by_token_type.get((token_digest, inquiry.service_type))
            if typed
            else self._by_token.get(token_digest)
        )
        if not candidates:
            return []
        properties = inquiry.properties
        for pair in properties.items():  # start from the smallest set
            holders = self._by_pair.get(pair)
            if not holders:
                return []
            if len(holders) < len(candidates):
                candidates = holders
        found: list[Entry] = []
        entries = self._entries
        for service_id in candidates:
            indexed = entries[service_id]
            entry = indexed.entry
            if (
                indexed.visible
                and indexed.token_digest == token_digest
                and (not typed or entry.service_type == inquiry.service_type)
                and all(entry.properties.get(name) == value for name, value in properties.items())
            ):
                found.append(entry)
        found.sort(key=lambda entry: (entry.registered_at, entry.service_id), reverse=True)
        return found


def _answered_alike(one: _Indexed, other: _Indexed) -> bool:
    """Whether an inquiry's answer (which entries, in which order, and their replies) is the
    same with either record of an entry."""
    a, b = one.entry, other.entry
    return (
        one.visible == other.visible
        and one.token_digest == other.token_digest
        and a.endpoint == b.endpoint
        and a.service_type == b.service_type
        and a.properties == b.properties
        and a.permanent == b.permanent
        and a.registered_at == b.registered_at
    )


K = TypeVar("K")


def _release(waiters: list[asyncio.Future[None]]) -> None:
    for waiter in waiters:
        if not waiter.done():
            waiter.set_result(None)


def _remove(index: dict[K, set[int]], key: K, service_id: int) -> None:
    ids = index.get(key)
    if ids is not None:
        ids.discard(service_id)
        if not ids:
            del index[key]


class EntrySource(Protocol):
    """Where inquiries are answered from: the index while it is current, else the store."""

    def find(self, inquiry: Inquiry, token_digest: str) -> AsyncIterator[list[Entry]]:
        """The visible matches with this token, most recent first, in pages."""

    async def lowest_load(self, inquiry: Inquiry, token_digest: str) -> int | None:
        """The lowest load of the serviceable matches (None: there is none)."""


class FollowedIndex:
    """The index kept current from the change feed (a `shared.notify.Follower`), by one
    supervised task that re-reads what changed."""

    def __init__(self, store: DirectoryStore, *, listening: bool) -> None:
        """`listening`: whether the feed hears every change from the start (SQLite: the commits
        of this process, and other processes' by polling); on PostgreSQL it does once it has
        said `changed(None)`."""
        self.index = EntryIndex()
        self._store = store
        self._listening = listening
        self._reload = True
        self._pending: set[int] = set()
        # New entries put in as written (`put_new`) during a reload, which may have read their
        # part of the table before they were committed: the reload keeps them.
        self._new: dict[int, IndexRow] = {}
        self._reloading = False
        # Callers of `caught_up`, released once what was pending when they came is applied.
        self._waiters: list[asyncio.Future[None]] = []
        self._work = asyncio.Event()
        self._work.set()
        # When the oldest change not yet applied was heard of (monotonic), for `lag_seconds`.
        self._heard_at: float | None = None
        # Whether the index holds every change the feed told of: reloaded since it listens.
        self.current = False
        self._applier = Supervised("directory-index", self._apply_forever)

    def start(self) -> None:
        self._applier.start()

    async def stop(self) -> None:
        await self._applier.stop()
        self._release_waiters()

    # ---- EntrySource ----

    async def find(self, inquiry: Inquiry, token_digest: str) -> AsyncIterator[list[Entry]]:
        matches = self.index.matches(inquiry, token_digest)
        for start in range(0, len(matches), PAGE_ENTRIES):
            yield matches[start : start + PAGE_ENTRIES]

    async def lowest_load(self, inquiry: Inquiry, token_digest: str) -> int | None:
        matches = self.index.matches(inquiry, token_digest)
        return min((entry.load for entry in matches if entry.load < UNSERVICEABLE), default=None)

    # ---- shared.notify.Follower ----

    def changed(self, keys: list[str] | None) -> None:
        if self._heard_at is None:
            self._heard_at = time.monotonic()
        if keys is None:
            self._listening = True
            self._reload = True
        else:
            for key in keys:
                if key.startswith(ENTRY_KEY_PREFIX):
                    self._pending.add(int(key[len(ENTRY_KEY_PREFIX) :]))
                elif key == ALL_ENTRIES_KEY:
                    self._reload = True
        self._work.set()

    def lost(self) -> None:
        if self.current:
            log.warning("the change feed stopped listening: inquiries are answered from the database")
        self._listening = False
        self.current = False

    # ---- read-your-writes ----

    async def caught_up(self) -> None:
        """Return once every change heard so far is in the index (at once when the index is not
        current: inquiries go to the database then)."""
        if not self.current:
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        self._work.set()
        await waiter

    def _release_waiters(self) -> None:
        waiters, self._waiters = self._waiters, []
        _release(waiters)

    def put_new(self, row: IndexRow) -> None:
        """A new entry this replica just committed, put in as written: only for an entry nobody
        else can have changed since, which the store does not mark as changed here (see
        Directory.register and DirectoryStore.add)."""
        if self._reloading:
            # The reload under way (the first load, say) may have read its rows before: it keeps
            # the entry. A reload still to come reads it.
            self._new[row.entry.service_id] = row
        if self.current:
            self.index.put(row)

    # ---- the applier ----

    async def _apply_forever(self) -> None:
        try:
            while True:
                await self._work.wait()
                self._work.clear()
                # Those who came before this pass: what they wait for is pending by now.
                waiters, self._waiters = self._waiters, []
                heard_at, self._heard_at = self._heard_at, None
                try:
                    await self._apply_pending()
                except Exception:
                    self._heard_at = heard_at  # not applied: still waiting since then
                    raise
                finally:
                    _release(waiters)
                if heard_at is not None:
                    lag_seconds.observe(time.monotonic() - heard_at)
        except Exception:
            # The database is away (or a bug): answer from the database until a reload succeeds.
            self.current = False
            self._reload = True
            self._work.set()
            self._release_waiters()
            raise

    async def _apply_pending(self) -> None:
        if self._reload or len(self._pending) > RELOAD_ABOVE:
            await self._reload_all()
        while self._pending:
            ids = list(self._pending)[:REREAD_CHUNK]
            self._pending.difference_update(ids)
            rows = {row.entry.service_id: row for row in await self._store.index_rows(ids)}
            for service_id in ids:
                row = rows.get(service_id)
                if row is None:
                    self.index.discard(service_id)
                else:
                    self.index.put(row)

    async def _reload_all(self) -> None:
        self._reload = False
        listening = self._listening
        # What was committed before now, the reload reads; what commits from now on is pending
        # again, or put in as new.
        self._pending.clear()
        self._new.clear()
        fresh = EntryIndex()
        self._reloading = True
        try:
            async for rows in self._store.all_index_rows():
                for row in rows:
                    fresh.put(row)
        finally:
            self._reloading = False
        for service_id, row in self._new.items():
            if service_id not in fresh and service_id not in self._pending:  # not since removed
                fresh.put(row)
        self._new.clear()
        fresh.generation = next(_GENERATIONS)  # newer than any state of the index it replaces
        self.index = fresh
        # Current only if the feed listened all along: a change during the reload may have
        # been missed otherwise (`lost` then cleared `_listening`, and a new reload is due).
        was_current = self.current
        self.current = listening and self._listening and not self._reload
        if self.current and not was_current:
            log.info("inquiries are answered from memory", entries=len(fresh))
