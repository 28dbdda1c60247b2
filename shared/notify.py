"""Change notifications: wake the streams that follow rows when a write changes them.

Keys are short strings naming what changed (`trial:42`, `trials`). The database layer publishes
the keys of every commit (shared.db.changes); the feed subscribes, and wakes the waiters that
`watch()` those keys, who re-read the tables: a notification only says "look again", the rows
stay the truth. An idle waiter costs nothing: it is woken by a change of one of its keys, never by
a timer. Other processes' commits are heard through the database too: PostgreSQL's notifications
(while anyone in this process is hearing), or on SQLite a poll of the file for other processes'
commits, which wakes every waiter.

A `Follower` (an in-memory copy of rows, such as the directory's index) hears every change
instead: the keys of each commit, `changed(None)` when anything may have changed unheard, and
`lost()` as soon as the feed stops listening, so that it never serves what it holds as current
while other replicas' changes go unheard.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from types import TracebackType
from typing import Protocol

from shared.db import Database


class Follower(Protocol):
    """Told of every change, in this process's commits and (through the feed) other replicas'."""

    def changed(self, keys: list[str] | None) -> None:
        """`keys` changed; None: anything may have (listening began again, or another process
        committed to a shared SQLite file)."""

    def lost(self) -> None:
        """The feed stopped listening: other replicas' changes go unheard until `changed(None)`."""


class Watch:
    """Keys one waiter follows. `wait()` returns once any of them changed since the last `wait()`
    (or since the watch began), or after `timeout` seconds."""

    def __init__(self, feed: ChangeFeed, keys: Iterable[str]) -> None:
        self._feed = feed
        self.keys = frozenset(keys)
        self._changed = asyncio.Event()

    def _set(self) -> None:
        self._changed.set()

    async def wait(self, timeout: float | None = None) -> bool:
        """Whether a change was notified (False: the timeout passed first)."""
        if self._changed.is_set():
            self._changed.clear()
            return True
        try:
            await asyncio.wait_for(self._changed.wait(), timeout)
            notified = True
        except asyncio.TimeoutError:
            notified = False
        self._changed.clear()
        return notified

    def __enter__(self) -> Watch:
        return self

    def __exit__(
        self, _type: type[BaseException] | None, _error: BaseException | None, _tb: TracebackType | None
    ) -> None:
        self._feed._forget(self)


class ChangeFeed:
    """The subscriber of a database's changes (one per database), under `channel` between
    processes."""

    def __init__(self, database: Database, channel: str) -> None:
        self.database = database
        self.channel = channel
        self._watches: dict[str, set[Watch]] = {}
        self._followers: list[Follower] = []
        self._hearing = database.publish_to(channel, self)

    @property
    def listening(self) -> asyncio.Event:
        """Set once other processes' changes are heard (or could not be: retried meanwhile)."""
        return self._hearing.listening

    async def start(self) -> None:
        """Start hearing other processes' changes (on PostgreSQL, returns once the listening
        connection is open, or could not be: it is retried in the background)."""
        await self._hearing.start()

    async def stop(self) -> None:
        await self._hearing.stop()

    def follow(self, follower: Follower) -> None:
        """Tell `follower` of every change from now on (for the process's lifetime)."""
        self._followers.append(follower)
        self._hearing.wanted()

    def watch(self, keys: Iterable[str]) -> Watch:
        """Follow `keys` (use as a context manager, so the watch is forgotten)."""
        watch = Watch(self, keys)
        for key in watch.keys:
            self._watches.setdefault(key, set()).add(watch)
        self._hearing.wanted()
        return watch

    def _forget(self, watch: Watch) -> None:
        for key in watch.keys:
            watchers = self._watches.get(key)
            if watchers is not None:
                watchers.discard(watch)
                if not watchers:
                    del self._watches[key]

    @property
    def hearing(self) -> bool:
        """Whether anyone in this process needs other replicas' changes."""
        return bool(self._watches or self._followers)

    def changed(self, keys: list[str] | None) -> None:
        """Wake the watches of `keys` (None: every watch), and tell the followers."""
        if keys is None:
            for watchers in self._watches.values():
                for watch in watchers:
                    watch._set()
        else:
            for key in keys:
                for watch in self._watches.get(key, ()):
                    watch._set()
        for follower in self._followers:
            follower.changed(keys)

    def lost(self) -> None:
        for follower in self._followers:
            follower.lost()
