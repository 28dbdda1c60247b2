"""The overview page: each service's state, and what the others' pages list, counted (entries,
models, trials by state); a service that is down leaves its counts out."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TypeVar

from services.console.directory_pages import DirectoryPages, Entries
from services.console.model import ServiceState
from services.console.model_pages import ModelPages
from services.console.sources import Unavailable
from services.console.trial_pages import INTERRUPTED, TrialPages
from services.datastore.client.api import state_name

# Trials per request when the console counts them all (the overview).
COUNT_PAGE = 1000
SERVICES = ("directory", "model_registry", "trial_datastore")
T = TypeVar("T")


async def _optional(step: Awaitable[T]) -> T | None:
    """What `step` gives, None when its service is down (the page shows that elsewhere)."""
    try:
        return await step
    except Unavailable:
        return None


@dataclass(frozen=True)
class Overview:
    services: list[ServiceState]
    entries: Entries | None
    models: int | None
    trials_by_state: dict[str, int] | None


class OverviewPage(TrialPages, ModelPages, DirectoryPages):
    """The rules of the overview, over the other pages' rules."""

    async def overview(self) -> Overview:
        states = await asyncio.gather(*(self.sources.state(name) for name in SERVICES))
        entries, models, trials = await asyncio.gather(
            _optional(self.entries()), _optional(self.models()), _optional(self._trial_counts())
        )
        return Overview(
            list(states),
            entries,
            None if models is None else len(models),
            trials,
        )

    async def _trial_counts(self) -> dict[str, int]:
        """How many trials are in each state (interrupted ones as such): counted by the
        datastore, or, by one without the count (a Cogment 2.x one), by listing every trial."""
        counted = await self.sources.datastore(lambda client: client.trial_counts())
        if counted is not None:
            by_state: dict[str, int] = {}
            for count in counted:
                state = INTERRUPTED if count.interrupted else state_name(count.last_state).lower()
                by_state[state] = by_state.get(state, 0) + count.trials
            return by_state
        counts: dict[str, int] = {}
        handle = ""
        while True:
            reply = await self._list(COUNT_PAGE, handle)
            states = await self._states(reply.trial_infos)
            for info in reply.trial_infos:
                state = states[info.trial_id]
                counts[state] = counts.get(state, 0) + 1
            if len(reply.trial_infos) < COUNT_PAGE:
                return counts
            handle = reply.next_trial_handle
