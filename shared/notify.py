"""Change notifications: wake the streams that follow rows when a write changes them.

Keys are short strings naming what changed (`trial:42`, `trials`). A writer calls `notify()`
inside its transaction and `wake()` once it has committed. Waiters `watch()` keys and re-read
the tables when woken: a notification only says "look again", the rows stay the truth. An idle
waiter costs nothing: it is woken by a change of one of its keys, never by a timer.

On PostgreSQL `notify()` is a `pg_notify` (delivered to every listening replica at commit,
never for a rolled-back transaction) and one connection per process LISTENs on the channel while
the process has watches, so streams follow writes made through other replicas; a replica with no
watch is not told of every other replica's commits. That connection is checked every few
seconds, and re-established after a failure; since notifications sent while it did not listen
are lost, every waiter is woken once it listens (again). SQLite has no notifications between
processes: the local wake-up serves this process, and one task per process watches the file for
commits of other processes sharing it (`Database.foreign_commits`), waking every waiter when
there was one.

A `Follower` (an in-memory copy of rows, such as the directory's index) hears every change
instead: the keys of each commit, `changed(None)` when anything may have changed unheard, and
`lost()` as soon as the feed stops listening, so that it never serves what it holds as current
while other replicas' changes go unheard.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import Iterable
from types import TracebackType
from typing import Any, Protocol

import psycopg
from sqlalchemy import text
from sqlalchemy.engine import Connection

from shared.db import CONNECT_TIMEOUT_S, Database
from shared.supervision import FailureStreak, Periodic, cancel_and_wait

# PostgreSQL refuses payloads of 8000 bytes or more.
MAX_PAYLOAD = 7000
# How often this process looks for other processes' commits to a shared SQLite file.
SQLITE_POLL_PERIOD_S = 0.5
MAX_RECONNECT_DELAY_S = 0.5
# How long the listening connection may stay silent before it is checked: a connection the network
# dropped without a word would otherwise leave every waiter asleep.
LISTEN_CHECK_PERIOD_S = 5.0
# Begins the last key of a payload, naming the process that sent it.
ORIGIN_MARK = "@"


_NOTIFY = text("SELECT pg_notify(:channel, :payload)")


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
    def __init__(self, database: Database, channel: str) -> None:
        self.database = database
        self.channel = channel
        self._watches: dict[str, set[Watch]] = {}
        self._followers: list[Follower] = []
        self._listener: asyncio.Task[None] | None = None
        self._foreign_commits = Periodic(
            f"watching {channel} for other processes' commits",
            self._look_for_foreign_commits,
            SQLITE_POLL_PERIOD_S,
        )
        self._seen_commits: int | None = None
        # Ends this process's payloads: its own notifications come back to it, and are skipped
        # (its watchers and followers were told once the change committed, by `wake`).
        self.origin = f"{ORIGIN_MARK}{secrets.token_hex(8)}"
        self.listening = asyncio.Event()
        # Set when a watch begins: the listener LISTENs only while there are watches.
        self._watched = asyncio.Event()

    async def start(self) -> None:
        """Start following other processes' changes (on PostgreSQL, returns once the listening
        connection is open, or could not be: it is retried in the background)."""
        if not self.database.is_postgresql:
            self._foreign_commits.start()
            self.listening.set()
            return
        self._listener = asyncio.get_running_loop().create_task(self._listen(), name=f"listen-{self.channel}")
        await self.listening.wait()

    async def stop(self) -> None:
        await self._foreign_commits.stop()
        if self._listener is not None:
            await cancel_and_wait(self._listener)
            self._listener = None

    async def _look_for_foreign_commits(self) -> None:
        # Looked at even with no watch: a watch that begins between a commit and the next look
        # must still be woken by it.
        seen = await self.database.foreign_commits()
        if self._seen_commits is not None and seen != self._seen_commits:
            self._wake_all()
        self._seen_commits = seen

    def follow(self, follower: Follower) -> None:
        """Tell `follower` of every change from now on (for the process's lifetime)."""
        self._followers.append(follower)
        self._watched.set()

    def watch(self, keys: Iterable[str]) -> Watch:
        """Follow `keys` (use as a context manager, so the watch is forgotten)."""
        watch = Watch(self, keys)
        for key in watch.keys:
            self._watches.setdefault(key, set()).add(watch)
        self._watched.set()
        return watch

    def _forget(self, watch: Watch) -> None:
        for key in watch.keys:
            watchers = self._watches.get(key)
            if watchers is not None:
                watchers.discard(watch)
                if not watchers:
                    del self._watches[key]

    def wake(self, keys: Iterable[str]) -> None:
        """Wake this process's watches of `keys`, and tell its followers (call after the change
        committed)."""
        keys = list(keys)
        for key in keys:
            for watch in self._watches.get(key, ()):
                watch._set()
        for follower in self._followers:
            follower.changed(keys)

    def _wake_all(self) -> None:
        for watchers in self._watches.values():
            for watch in watchers:
                watch._set()
        for follower in self._followers:
            follower.changed(None)

    def _lost(self) -> None:
        for follower in self._followers:
            follower.lost()

    @property
    def _heard(self) -> bool:
        """Whether anyone in this process needs other replicas' changes."""
        return bool(self._watches or self._followers)

    def notify(self, connection: Connection, keys: Iterable[str]) -> None:
        """Tell the other replicas, from inside the writing transaction (PostgreSQL only)."""
        if not self.database.is_postgresql:
            return
        for payload in self.payloads(keys):
            connection.execute(_NOTIFY, {"channel": self.channel, "payload": payload})

    def payloads(self, keys: Iterable[str]) -> list[str]:
        """The `pg_notify` payloads telling of `keys` (also for a statement that notifies itself):
        comma-joined keys, split under PostgreSQL's payload limit, each ending with this
        process's origin (a key nobody watches: releases that do not know it ignore it)."""
        payloads: list[str] = []
        batch: list[str] = []
        size = len(self.origin) + 1
        for key in dict.fromkeys(keys):
            if batch and size + len(key) + 1 > MAX_PAYLOAD:
                payloads.append(",".join([*batch, self.origin]))
                batch, size = [], len(self.origin) + 1
            batch.append(key)
            size += len(key) + 1
        if batch:
            payloads.append(",".join([*batch, self.origin]))
        return payloads

    async def _listen(self) -> None:
        conninfo = self.database.driver_conninfo
        streak = FailureStreak("listening for changes", channel=self.channel)
        while True:
            try:
                connect = psycopg.AsyncConnection.connect(
                    conninfo, autocommit=True, connect_timeout=CONNECT_TIMEOUT_S
                )
                async with await connect as connection:
                    if streak.failures:
                        streak.succeeded()
                    self.listening.set()
                    await self._follow(connection)
            except (psycopg.Error, OSError, asyncio.TimeoutError) as error:
                self._lost()
                # Retried often: until it is back, other replicas' writes reach readers late.
                delay = min(streak.failed(error), MAX_RECONNECT_DELAY_S)
                self.listening.set()  # start-up must not hang on an unreachable database
                await asyncio.sleep(delay)

    async def _follow(self, connection: psycopg.AsyncConnection[Any]) -> None:
        """LISTEN while this process has watches, and only then: every replica's commits notify
        every listening replica, which costs each of them CPU for every commit. Listening begins
        after a watch may have read the tables, so every watch is woken then (as after a lost
        connection: what was notified meanwhile was missed). The connection is checked whenever it
        stayed silent for LISTEN_CHECK_PERIOD_S."""
        listening = False
        while True:
            self._watched.clear()  # before looking: a watch that begins from now on sets it
            if not self._heard:
                if listening:
                    await connection.execute(f'UNLISTEN "{self.channel}"')
                    listening = False
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._watched.wait(), LISTEN_CHECK_PERIOD_S)
                if not self._heard:
                    await asyncio.wait_for(connection.execute("SELECT 1"), CONNECT_TIMEOUT_S)
                    continue
            if not listening:
                await connection.execute(f'LISTEN "{self.channel}"')
                listening = True
                self._wake_all()
            silent = True
            async with contextlib.aclosing(
                connection.notifies(timeout=LISTEN_CHECK_PERIOD_S)
            ) as notifications:
                async for notification in notifications:
                    silent = False
                    keys = notification.payload.split(",")
                    if keys[-1].startswith(ORIGIN_MARK):
                        if keys[-1] == self.origin:
                            continue
                        keys.pop()
                    self.wake(keys)
                    if not self._heard:
                        break
            if silent:
                await asyncio.wait_for(connection.execute("SELECT 1"), CONNECT_TIMEOUT_S)
