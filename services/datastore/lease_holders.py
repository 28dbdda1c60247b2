"""Whether the processes holding ingestion leases are gone, where every process that shares the
database runs on this host (SQLite: one file, one host).

Each datastore process holds an exclusive lock (flock) on a file of its own beside the database,
named by its lease-holder token, for as long as it lives: the kernel releases it when the process
ends, however it ends (kill -9 included). A holder whose file another process can lock, or whose
file is gone, is gone, and the trials it was ingesting are closed at once rather than when their
lease runs out: after a crash and a restart, their readers end at once instead of waiting out the
lease. PostgreSQL's replicas may run on several hosts, where a lock file proves nothing: there,
leases alone tell.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterable
from pathlib import Path


class HolderLocks:
    """The lock files of lease holders, in `directory`."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._held: int | None = None
        self._holder = ""

    @classmethod
    def beside(cls, database_file: str) -> HolderLocks:
        return cls(Path(f"{database_file}.lease-holders"))

    def hold(self, holder: str) -> None:
        """Lock `holder`'s file for as long as this process lives (or until `release`)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(self._path(holder), os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new random name: never held by another
        self._held, self._holder = fd, holder

    def release(self) -> None:
        if self._held is None:
            return
        with contextlib.suppress(FileNotFoundError):
            self._path(self._holder).unlink()
        os.close(self._held)
        self._held = None

    def gone(self, holders: Iterable[str]) -> list[str]:
        """The holders among `holders` whose process is gone (their files are removed). Blocking
        file calls: for a thread."""
        return [holder for holder in holders if holder != self._holder and self._is_gone(holder)]

    def _is_gone(self, holder: str) -> bool:
        try:
            fd = os.open(self._path(holder), os.O_RDWR)
        except FileNotFoundError:  # removed once found gone (or never made by a process of this kind)
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # its process holds it: alive
        else:
            self._path(holder).unlink(missing_ok=True)
            return True
        finally:
            os.close(fd)

    def _path(self, holder: str) -> Path:
        if not holder.isalnum():  # a token of ours: never a path
            raise ValueError(f"not a lease holder: {holder!r}")
        return self.directory / f"{holder}.lock"
