"""What a service needs in order to serve (its database, its blob store), watched.

Each `Dependency` has a probe (e.g. `SELECT 1`), run every few seconds, and at once when a call
meets a failure that `shared.errors.classify` puts on a dependency (`suspect()`). While a probe
fails the dependency is away: the service is not ready (its `grpc.health.v1` status is
NOT_SERVING, so Kubernetes takes it out of its Service, see `shared.server`), one line is logged
when it goes away and one when it comes back, and it is probed often, so that service resumes
within about a second of its return. Metrics: `cogment_dependency_up` and
`cogment_dependency_changes_total` (shared.metrics).

Streams do not fail on an outage: `ride_out` retries what they were doing once the dependency is
back, for up to `outage_bound_s`; past that they fail with UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from shared import metrics
from shared.errors import Unavailable, classify
from shared.logging import get_logger
from shared.supervision import Supervised, backoff_delay

# Probes while everything is fine (a dependency can go away while no call uses it), and while a
# dependency is away (how soon its return is noticed).
PROBE_PERIOD_S = 2.0
PROBE_PERIOD_AWAY_S = 0.5
PROBE_TIMEOUT_S = 3.0
DEFAULT_OUTAGE_BOUND_S = 30.0

log = get_logger("shared.dependencies")
T = TypeVar("T")


class Dependency:
    """One dependency: a name for the logs, a probe, and what to do when it comes back (e.g. drop
    pooled connections opened before the outage)."""

    def __init__(
        self,
        name: str,
        probe: Callable[[], Awaitable[object]],
        on_return: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.name = name
        self.probe = probe
        self.on_return = on_return
        self.available = True
        self.away_since = 0.0


class Dependencies:
    """The dependencies of one service: whether it is ready, and riding out their outages."""

    def __init__(
        self,
        dependencies: Sequence[Dependency],
        outage_bound_s: float = DEFAULT_OUTAGE_BOUND_S,
        *,
        service: str = "",
    ) -> None:
        """`service`: the `service` label of the dependencies' metrics (its name)."""
        self.items = list(dependencies)
        self.outage_bound_s = outage_bound_s
        self.service = service
        self._suspects = {item.name: asyncio.Event() for item in self.items}
        self._changed = asyncio.Condition()
        self._listeners: list[Callable[[bool], Awaitable[None]]] = []
        self._watchers: list[Supervised] = []
        # When every dependency was last seen available again (monotonic), or first watched.
        self.ready_since = time.monotonic()

    @property
    def ready(self) -> bool:
        return all(item.available for item in self.items)

    def on_change(self, listener: Callable[[bool], Awaitable[None]]) -> None:
        """Call `listener(ready)` whenever readiness changes."""
        self._listeners.append(listener)

    def add(self, dependency: Dependency) -> None:
        """One more dependency (before `start`)."""
        self.items.append(dependency)
        self._suspects[dependency.name] = asyncio.Event()

    def start(self) -> None:
        for item in self.items:
            self._record(item, changed=False)
        self._watchers = [Supervised(f"probe-{item.name}", self._watcher(item)) for item in self.items]
        for watcher in self._watchers:
            watcher.start()

    async def stop(self) -> None:
        for watcher in self._watchers:
            await watcher.stop()

    def suspect(self) -> None:
        """A call met a dependency's failure: probe every available dependency now."""
        for suspect in self._suspects.values():
            suspect.set()

    async def ride_out(
        self, call: Callable[[], Awaitable[T]], *, on_held: Callable[[], object] | None = None
    ) -> T:
        """`call()`; if it fails because a dependency is away, again once it is back, for up to
        `outage_bound_s` (then UNAVAILABLE). Other failures are raised as they are. `on_held()`
        once, when the call is first held back by an outage."""
        first_failure: float | None = None
        attempts = 0
        while True:
            try:
                return await call()
            except Exception as error:
                if not isinstance(classify(error), Unavailable):
                    raise
                now = time.monotonic()
                first_failure = now if first_failure is None else first_failure
                left = first_failure + self.outage_bound_s - now
                if left <= 0:
                    raise Unavailable(
                        f"a dependency of the service was away for more than {self.outage_bound_s:g} s "
                        "(--outage_bound): retry"
                    ) from error
                attempts += 1
                if attempts == 1 and on_held is not None:
                    on_held()
                self.suspect()
                # Give the probes a moment to notice; then wait for readiness, not longer than
                # the bound, and never spin if the dependency answers probes but not this call.
                await asyncio.sleep(min(backoff_delay(attempts), left))
                await self.wait_ready(first_failure + self.outage_bound_s - time.monotonic())

    async def wait_ready(self, timeout_s: float) -> bool:
        """Whether every dependency is available, waiting up to `timeout_s` for it."""
        if timeout_s <= 0:
            return self.ready
        async with self._changed:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait_for(lambda: self.ready), timeout_s)
            return self.ready

    def _watcher(self, item: Dependency) -> Callable[[], Awaitable[None]]:
        async def watch() -> None:
            while True:
                try:
                    await asyncio.wait_for(item.probe(), PROBE_TIMEOUT_S)
                except Exception as error:
                    if item.available:
                        item.available, item.away_since = False, time.monotonic()
                        log.warning(
                            "dependency away", dependency=item.name, error=str(error) or type(error).__name__
                        )
                        self._record(item, changed=True)
                        await self._announce()
                else:
                    if not item.available:
                        if item.on_return is not None:
                            await item.on_return()
                        item.available = True
                        log.info(
                            "dependency back",
                            dependency=item.name,
                            away_s=round(time.monotonic() - item.away_since, 3),
                        )
                        self._record(item, changed=True)
                        await self._announce()
                suspect = self._suspects[item.name]
                if item.available:
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(suspect.wait(), PROBE_PERIOD_S)
                else:  # probed at its own pace, however many calls fail meanwhile
                    await asyncio.sleep(PROBE_PERIOD_AWAY_S)
                suspect.clear()

        return watch

    def _record(self, item: Dependency, *, changed: bool) -> None:
        dependency = metrics.dependency_label(item.name)
        metrics.dependency_up.labels(self.service, dependency).set(1 if item.available else 0)
        if changed:
            state = "up" if item.available else "down"
            metrics.dependency_changes_total.labels(self.service, dependency, state).inc()

    async def _announce(self) -> None:
        async with self._changed:
            self._changed.notify_all()
        ready = self.ready
        if ready:
            self.ready_since = time.monotonic()
        for listener in self._listeners:
            await listener(ready)
