"""The sample inspector: one tick of a trial, each actor's observation, action, rewards and
messages, its payloads decoded by `Decoders` when the console knows their messages."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

from services.console.decode import Decoders
from services.console.errors import NotFound
from services.console.model import ActorInfo, ActorTick, MessageView, RewardView, TickView
from services.console.trial_pages import TrialPages, actors_of
from services.datastore.client.api import DatastoreClient, state_name
from shared.api import trial_datastore_pb2

ENVIRONMENT = "environment"


class SampleInspector(TrialPages):
    """The rules of the inspector's tick, over the datastore's client."""

    decoders: Decoders

    async def tick(self, trial_id: str, tick: int) -> TickView:
        """The trial's sample of `tick` (its first: late rewards of that tick come in later
        samples)."""
        info = await self.trial_info(trial_id)
        actors = actors_of(info)
        sample = None
        if info.samples_count:
            sample = await self._sample_of_tick(trial_id, tick, info.samples_count)
        if sample is None:
            raise NotFound(f"trial [{trial_id}] has no tick [{tick}]")
        return self.tick_view(sample, actors)

    async def _sample_of_tick(
        self, trial_id: str, tick: int, samples: int
    ) -> trial_datastore_pb2.StoredTrialSample | None:
        """The first sample of `tick` in arrival order (late samples of a tick come after it),
        found by the datastore (its own TrialSamplesSP), else by reading the trial from its start
        (a Cogment 2.x datastore)."""
        reply = await self.sources.datastore(lambda client: client.sample_range(trial_id, 0, 1, tick))
        if reply is None:
            return await self._scanned_sample_of_tick(trial_id, tick, samples)
        return reply.samples[0] if reply.samples else None

    async def _scanned_sample_of_tick(
        self, trial_id: str, tick: int, samples: int
    ) -> trial_datastore_pb2.StoredTrialSample | None:
        """The first sample of `tick`, reading the trial from its start."""

        async def find(client: DatastoreClient) -> trial_datastore_pb2.StoredTrialSample | None:
            async with contextlib.aclosing(client.samples({trial_id: samples})) as stream:
                async for sample in stream:
                    if sample.tick_id == tick:
                        return sample
            return None

        return await self.sources.datastore(find)

    def tick_view(
        self, sample: trial_datastore_pb2.StoredTrialSample, actors: Sequence[ActorInfo]
    ) -> TickView:
        def name(index: int) -> str:
            return actors[index].name if 0 <= index < len(actors) else ENVIRONMENT

        def payload(index: int, actor_class: str, kind: str) -> object:
            data = sample.payloads[index] if index < len(sample.payloads) else b""
            return self.decoders.payload(data, actor_class, kind)

        views = []
        for actor_sample in sample.actor_samples:
            actor_class = actors[actor_sample.actor].actor_class if actor_sample.actor < len(actors) else ""
            views.append(
                ActorTick(
                    name(actor_sample.actor),
                    payload(actor_sample.observation, actor_class, "observation")  # type: ignore[arg-type]
                    if actor_sample.HasField("observation")
                    else None,
                    payload(actor_sample.action, actor_class, "action")  # type: ignore[arg-type]
                    if actor_sample.HasField("action")
                    else None,
                    actor_sample.reward if actor_sample.HasField("reward") else None,
                    [
                        RewardView(name(r.sender), r.reward, r.confidence)
                        for r in actor_sample.received_rewards
                    ],
                    [
                        MessageView(name(m.sender), name(m.receiver), payload(m.payload, "", "message"))  # type: ignore[arg-type]
                        for m in actor_sample.received_messages
                    ],
                )
            )
        return TickView(sample.tick_id, sample.timestamp, state_name(sample.state).lower(), views)
