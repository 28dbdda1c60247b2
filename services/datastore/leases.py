"""Ingestion leases: trials whose ingesting process died are closed, as interrupted.

A stream that closes, even on an error, closes its trial, and live readers of the trial then stop
once they have every sample. A process killed with its streams closes nothing: while a stream is
open, its process renews the trial's lease (a deadline in the trial's row) every third of
`lease_s`; every replica, the restarted process among them, closes the trials whose lease
expired. A new datalog stream for the trial reopens it, as after any close.
"""

from __future__ import annotations

import time
from collections import Counter

from services.datastore import metrics
from services.datastore.store import DatastoreStore
from shared.dependencies import Dependencies
from shared.logging import get_logger
from shared.supervision import Periodic

DEFAULT_LEASE_S = 30.0

log = get_logger("datastore.leases")


class IngestionLeases:
    def __init__(
        self,
        store: DatastoreStore,
        lease_s: float = DEFAULT_LEASE_S,
        dependencies: Dependencies | None = None,
    ) -> None:
        self._store = store
        self.lease_ns = int(lease_s * 1e9)
        self._renew_s = lease_s / 3
        self._dependencies = dependencies or Dependencies([])
        # Open ingestion streams here, by trial.
        self._open: Counter[int] = Counter()
        self._keeper = Periodic("trial-leases", self._renew_and_sweep, self._renew_s)

    def start(self) -> None:
        self._keeper.start()

    async def stop(self) -> None:
        await self._keeper.stop()

    def until(self) -> int:
        """The deadline of a lease taken or renewed now."""
        return time.time_ns() + self.lease_ns

    @property
    def streams(self) -> int:
        """Ingestion streams open here."""
        return sum(self._open.values())

    def hold(self, trial_seq: int) -> None:
        """An ingestion stream of the trial opened here."""
        self._open[trial_seq] += 1

    def release(self, trial_seq: int) -> None:
        """That stream closed (its trial closed with it)."""
        self._open[trial_seq] -= 1
        if self._open[trial_seq] <= 0:
            del self._open[trial_seq]

    async def _renew_and_sweep(self) -> None:
        if self._open:
            await self._store.renew_leases(list(self._open), self.until())
        # After a database outage, leases of live streams may have run out while no one could
        # renew them: their owners get two renewal periods to renew before any sweep.
        if time.monotonic() - self._dependencies.ready_since < 2 * self._renew_s:
            return
        closed = await self._store.close_expired(time.time_ns())
        metrics.lease_closures_total.inc(amount=len(closed))
        for trial_seq in closed:
            log.warning("trial closed as interrupted: its ingesting process is gone", trial_seq=trial_seq)
