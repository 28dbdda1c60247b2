"""What each page shows, read from the services through `Sources`: `Console` puts the pages'
rules together (services.console.overview, trial_pages, inspector, model_pages, directory_pages)
and draws trials' reward curves, as many at once as the memory it has for them allows
(`--curves_bytes`). The transport (services.console.app) turns these into HTML, JSON and event
streams; a service that cannot answer raises `Unavailable`."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Iterator, Sequence
from dataclasses import asdict

import grpc

from services.console.curves import MAX_POINTS, RewardTotals
from services.console.decode import Decoders
from services.console.errors import Busy
from services.console.inspector import SampleInspector
from services.console.model import ActorInfo
from services.console.overview import OverviewPage
from services.console.sources import Sources
from services.console.trial_pages import REWARD_FIELDS, ReturnsCache, actors_of, returns_by_class
from services.datastore.client.api import DatastoreClient, state_name
from shared.api import trial_datastore_pb2

# Samples a curve's reader holds at most before they are added up (rewards only: a few dozen
# bytes each).
FOLLOW_QUEUE = 10_000
# Memory of one trial's curves while they are drawn (RewardTotals' slots): a 100,000-tick trial
# of up to 3 actors keeps one slot per tick.
TRIAL_CURVE_BYTES = 8 << 20
# What --curves_bytes is by default: the curves of 16 trials drawn at once.
DEFAULT_CURVES_BYTES = 16 * TRIAL_CURVE_BYTES
# Less than this left: a trial's curves wait for others to be drawn (Busy).
MIN_CURVE_BYTES = TRIAL_CURVE_BYTES // 8
# Seconds between two snapshots of a trial's curves while its samples are read.
SNAPSHOT_INTERVAL_S = 0.5


class CurveMemory:
    """The bytes of the curves being drawn, at most `limit`: each trial's takes
    TRIAL_CURVE_BYTES while its samples are added up."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    @contextlib.contextmanager
    def reserved(self) -> Iterator[int]:
        """TRIAL_CURVE_BYTES for one trial's curves (or all that is left, if less), or Busy."""
        size = min(TRIAL_CURVE_BYTES, self.limit - self.used)
        if size < MIN_CURVE_BYTES:
            raise Busy(
                f"the console is drawing {self.used // TRIAL_CURVE_BYTES} trials' curves already, as "
                "many as its memory for them allows (--curves_bytes): try again in a moment"
            )
        self.used += size
        try:
            yield size
        finally:
            self.used -= size


class Console(OverviewPage, SampleInspector):
    """The rules of the console's pages, over the services' clients."""

    def __init__(
        self, sources: Sources, decoders: Decoders, curves_bytes: int = DEFAULT_CURVES_BYTES
    ) -> None:
        self.sources = sources
        self.decoders = decoders
        self.curve_memory = CurveMemory(curves_bytes)
        self._returns = ReturnsCache()

    async def stored_curves(self, trial_id: str, max_points: int = MAX_POINTS) -> list[dict[str, object]]:
        """The curves of the samples the trial has now (a running trial is cut there)."""
        info = await self.trial_info(trial_id)
        actors = actors_of(info)
        with self.curve_memory.reserved() as budget:
            totals = RewardTotals.within(len(actors), budget)
            await self._add_rewards(totals, trial_id, info.samples_count)
            return [asdict(curve) for curve in totals.curves([a.name for a in actors], max_points)]

    async def curve_snapshots(
        self, trial_id: str, max_points: int = MAX_POINTS
    ) -> AsyncGenerator[dict[str, object], None]:
        """The trial's reward curves as its samples are read (stored ones, then those a running
        trial adds): a snapshot of every actor's downsampled curve each SNAPSHOT_INTERVAL_S while
        samples come, and a last one when the trial's stream ends ({"ticks", "curves",
        "returns" by actor class, "state", "done"})."""
        info = await self.trial_info(trial_id)
        actors = actors_of(info)
        names = [actor.name for actor in actors]
        with self.curve_memory.reserved() as budget:
            following = self._follow_curves(trial_id, info, actors, names, budget, max_points)
            async with contextlib.aclosing(following) as snapshots:  # its read ends with this page
                async for snapshot in snapshots:
                    yield snapshot

    async def _follow_curves(
        self,
        trial_id: str,
        info: trial_datastore_pb2.StoredTrialInfo,
        actors: Sequence[ActorInfo],
        names: Sequence[str],
        budget: int,
        max_points: int,
    ) -> AsyncGenerator[dict[str, object], None]:
        totals = RewardTotals.within(len(actors), budget)
        client = await self.sources.client("trial_datastore")
        assert isinstance(client, DatastoreClient)
        call = client.stub.RetrieveSamples(
            trial_datastore_pb2.RetrieveSamplesRequest(
                trial_ids=[trial_id], selected_sample_fields=REWARD_FIELDS
            )
        )
        arrived: asyncio.Queue[trial_datastore_pb2.StoredTrialSample | None] = asyncio.Queue(FOLLOW_QUEUE)

        async def pump() -> None:
            try:
                async for reply in call:
                    await arrived.put(reply.trial_sample)
            finally:
                await arrived.put(None)

        def snapshot(state: str, done: bool) -> dict[str, object]:
            returns = returns_by_class(actors, totals.returns())
            if done and state == "ended":
                self._returns.put(trial_id, returns)
            return {
                "ticks": totals.ticks,
                "curves": [asdict(curve) for curve in totals.curves(names, max_points)],
                "returns": returns,
                "state": state,
                "done": done,
            }

        pumping = asyncio.create_task(pump())
        state = state_name(info.last_state).lower()
        try:
            changed, done = True, False
            while not done:
                deadline = asyncio.get_running_loop().time() + SNAPSHOT_INTERVAL_S
                while not done:
                    left = deadline - asyncio.get_running_loop().time()
                    if left <= 0:
                        break
                    try:
                        sample = await asyncio.wait_for(arrived.get(), left)
                    except asyncio.TimeoutError:
                        break
                    if sample is None:
                        done = True
                        break
                    totals.add(sample)
                    state = state_name(sample.state).lower()
                    changed = True
                if changed or done:
                    yield snapshot(state, done)
                    changed = False
        finally:
            call.cancel()
            pumping.cancel()
            with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                await pumping
