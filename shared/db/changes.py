"""What a commit publishes: the change-feed keys it changed.

Keys are short strings naming what changed (`trial:42`, `trials`). The database layer that
commits a change publishes its keys: to this process's subscriber once the transaction committed
(or once its outcome is unknown: a COMMIT whose answer was lost may have committed, and other
replicas then hear of it, so this one looks again too), and on PostgreSQL to every other replica,
as notifications sent inside the transaction (delivered at commit, never for a rollback).
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable
from typing import Protocol

# PostgreSQL refuses payloads of 8000 bytes or more.
MAX_PAYLOAD = 7000
# Begins the last key of a payload, naming the process that sent it.
ORIGIN_MARK = "@"


class Subscriber(Protocol):
    """Hears every change to a database: this process's commits and other processes' (see
    shared.notify.ChangeFeed)."""

    @property
    def hearing(self) -> bool:
        """Whether it needs other processes' changes now (PostgreSQL listens only then)."""

    def changed(self, keys: list[str] | None) -> None:
        """`keys` changed; None: anything may have (listening began again, or another process
        committed to a shared SQLite file)."""

    def lost(self) -> None:
        """Other processes' changes go unheard until the next `changed(None)`."""


class Publication:
    """Where a database's commits are told: a channel between processes, and this process's
    subscriber."""

    def __init__(self, channel: str, subscriber: Subscriber) -> None:
        self.channel = channel
        self.subscriber = subscriber
        # Ends this process's payloads: its own notifications come back to it, and are skipped
        # (its subscriber was told once the change committed).
        self.origin = f"{ORIGIN_MARK}{secrets.token_hex(8)}"

    def payloads(self, keys: Iterable[str]) -> list[str]:
        """The notification payloads telling of `keys`: comma-joined keys, split under
        PostgreSQL's payload limit, each ending with this process's origin (a key nobody
        watches: releases that do not know it ignore it)."""
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

    def received(self, payload: str) -> list[str] | None:
        """The keys a notification tells of; None if this process sent it."""
        keys = payload.split(",")
        if keys[-1].startswith(ORIGIN_MARK):
            if keys[-1] == self.origin:
                return None
            keys.pop()
        return keys
