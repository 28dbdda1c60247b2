"""Ingestion leases: trials whose ingesting process died are closed, as interrupted.

A stream that closes, even on an error, closes its trial, and live readers of the trial then stop
once they have every sample. A process killed with its streams closes nothing: while a stream is
open, its process renews the trial's lease (a deadline in the trial's row) every third of
`lease_s`; every replica, the restarted process among them, closes the trials whose lease
expired. A new datalog stream for the trial reopens it, as after any close. Where the database has one host,
a holder known to be gone (see lease_holders) has its trials closed at once.

A stream rides a database outage out for up to the outage bound, its samples held. An outage seen
by every replica delays every sweep (below); one that only the ingesting process sees (its network
to the database) does not, so its leases must outlive the bound: a lease renewed a third of it
before the outage began still holds after two thirds of it, hence `check_outage_bound`. Once the
database is back, leases are renewed at once.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections import Counter

from services.datastore import metrics
from services.datastore.lease_holders import HolderLocks
from services.datastore.store import DatastoreStore
from shared.dependencies import Dependencies
from shared.errors import StartupError
from shared.logging import get_logger
from shared.supervision import Periodic

DEFAULT_LEASE_S = 45.0
# The part of a lease that outlives an outage that began just before a renewal was due.
LEASE_LEFT_AFTER_A_RENEWAL_PERIOD = 2 / 3

log = get_logger("datastore.leases")


def check_outage_bound(lease_s: float, outage_bound_s: float) -> None:
    """Refuse an outage bound that a lease would not outlive (see above)."""
    longest = lease_s * LEASE_LEFT_AFTER_A_RENEWAL_PERIOD
    if outage_bound_s > longest + 1e-9:  # 0.4 s of a 0.6 s lease is two thirds
        raise StartupError(
            f"--outage_bound ({outage_bound_s:g} s) must be at most two thirds of --ingestion_lease "
            f"({lease_s:g} s): a replica could otherwise close a trial whose stream is still riding "
            f"an outage out; lower --outage_bound to {longest:g} or raise --ingestion_lease to "
            f"{outage_bound_s / LEASE_LEFT_AFTER_A_RENEWAL_PERIOD:g}"
        )


class IngestionLeases:
    def __init__(
        self,
        store: DatastoreStore,
        lease_s: float = DEFAULT_LEASE_S,
        dependencies: Dependencies | None = None,
        holder_locks: HolderLocks | None = None,
    ) -> None:
        self._store = store
        # This process, in the trials' rows.
        self.holder = secrets.token_hex(16)
        self._holder_locks = holder_locks
        self.lease_ns = int(lease_s * 1e9)
        self._renew_s = lease_s / 3
        self._dependencies = dependencies or Dependencies([])
        # Open ingestion streams here, by trial.
        self._open: Counter[int] = Counter()
        self._keeper = Periodic("trial-leases", self._renew_and_sweep, self._renew_s)

    def start(self) -> None:
        if self._holder_locks is not None:
            self._holder_locks.hold(self.holder)
        self._keeper.start()
        self._dependencies.on_change(self._renew_on_return)

    async def _renew_on_return(self, ready: bool) -> None:
        if ready:
            self._keeper.wake()

    async def stop(self) -> None:
        await self._keeper.stop()
        if self._holder_locks is not None:
            self._holder_locks.release()

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
            await self._store.renew_leases(list(self._open), self.until(), self.holder)
        if self._holder_locks is not None:
            holders = await self._store.lease_holders()
            gone = await asyncio.to_thread(self._holder_locks.gone, holders)
            if gone:
                self._closed(await self._store.close_held_by(gone))
        # After a database outage, leases of live streams may have run out while no one could
        # renew them: their owners get two renewal periods to renew before any sweep.
        if time.monotonic() - self._dependencies.ready_since < 2 * self._renew_s:
            return
        self._closed(await self._store.close_expired(time.time_ns()))

    def _closed(self, trial_seqs: list[int]) -> None:
        metrics.lease_closures_total.inc(amount=len(trial_seqs))
        for trial_seq in trial_seqs:
            log.warning("trial closed as interrupted: its ingesting process is gone", trial_seq=trial_seq)
