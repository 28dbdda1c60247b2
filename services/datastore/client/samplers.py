"""Which stored transitions a replay buffer's batch takes: uniformly, in proportion to their
priorities (prioritized replay, Schaul et al. 2016), or oldest first (a FIFO queue).

A sampler is told the keys the store added and removed, and picks slots of a `TransitionStore`
with their importance weights (1 but for the prioritized sampler).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import numpy.typing as npt

from services.datastore.client.sum_tree import SumTree
from services.datastore.client.transition_store import Keys, TransitionStore

Slots = npt.NDArray[np.int64]
Weights = npt.NDArray[np.float64]


class Sampler(Protocol):
    # Whether a transition sampled leaves the buffer (a queue).
    consumes: bool

    def added(self, keys: Keys) -> None: ...

    def removed(self, keys: Keys) -> None: ...

    def sample(
        self, store: TransitionStore, count: int, rng: np.random.Generator
    ) -> tuple[Slots, Weights]: ...


class UniformSampler:
    consumes = False

    def added(self, keys: Keys) -> None:
        pass

    def removed(self, keys: Keys) -> None:
        pass

    def sample(self, store: TransitionStore, count: int, rng: np.random.Generator) -> tuple[Slots, Weights]:
        # The stored keys are the `len(store)` latest: one draw of offsets, no bookkeeping.
        keys = store.oldest_key + rng.integers(0, len(store), count)
        return keys % store.capacity, np.ones(count)


class FifoSampler:
    """The oldest transitions, each once: they leave the buffer as they are sampled."""

    consumes = True

    def added(self, keys: Keys) -> None:
        pass

    def removed(self, keys: Keys) -> None:
        pass

    def sample(self, store: TransitionStore, count: int, rng: np.random.Generator) -> tuple[Slots, Weights]:
        keys = store.oldest_key + np.arange(min(count, len(store)), dtype=np.int64)
        return keys % store.capacity, np.ones(len(keys))


class PrioritizedSampler:
    """Proportional prioritized replay: a transition is sampled with probability p^alpha / sum,
    weighted (N * P)^-beta / the batch's largest weight; new transitions get the largest
    priority seen so far (1 at first), so that each is sampled soon."""

    consumes = False

    def __init__(self, capacity: int, alpha: float = 0.6, beta: float = 0.4) -> None:
        if not alpha >= 0:
            raise ValueError(f"alpha must be 0 or more, not {alpha}")
        if not beta >= 0:
            raise ValueError(f"beta must be 0 or more, not {beta}")
        self.alpha = alpha
        self.beta = beta
        self.max_priority = 1.0
        self._tree = SumTree(capacity)

    def added(self, keys: Keys) -> None:
        self._tree.set(keys % self._tree.capacity, self.max_priority**self.alpha)

    def removed(self, keys: Keys) -> None:
        self._tree.set(keys % self._tree.capacity, 0.0)

    def update(self, store: TransitionStore, keys: npt.ArrayLike, priorities: npt.ArrayLike) -> None:
        """New priorities (more than 0) for these transitions; keys no longer stored are skipped
        (removed since they were sampled)."""
        checked_keys = np.array(keys, dtype=np.int64, ndmin=1)
        values = np.array(priorities, dtype=np.float64, ndmin=1)
        if checked_keys.shape != values.shape:
            raise ValueError(f"{len(checked_keys)} keys but {len(values)} priorities")
        if not np.all(np.isfinite(values)) or np.any(values <= 0):
            raise ValueError("priorities must be finite and more than 0")
        present = store.present(checked_keys)
        self._tree.set(checked_keys[present] % store.capacity, values[present] ** self.alpha)
        if present.any():
            self.max_priority = max(self.max_priority, float(values[present].max()))

    def sample(self, store: TransitionStore, count: int, rng: np.random.Generator) -> tuple[Slots, Weights]:
        total = self._tree.total
        # Stratified: one draw in each of `count` equal parts of the total, spread over the tree.
        prefixes = (np.arange(count) + rng.random(count)) * (total / count)
        slots = self._tree.find(np.minimum(prefixes, np.nextafter(total, 0)))
        probabilities = self._tree.get(slots) / total
        weights = (len(store) * probabilities) ** -self.beta
        return slots, weights / weights.max()
