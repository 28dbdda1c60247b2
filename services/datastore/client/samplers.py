"""Which transitions a replay buffer's batch takes: uniformly, in proportion to their priorities
(prioritized replay, Schaul et al. 2016), or oldest first (a FIFO queue).

The buffer holds steps in a `StepStore` ring; a step is a transition once it can be sampled
(`ready`, one flag per slot: its next step came, and its n-step window). A sampler is told which
keys became ready and which stopped being so (removed, or consumed by a FIFO), and picks slots of
ready transitions with their importance weights (1 but for the prioritized sampler).
"""

from __future__ import annotations

import heapq

import numpy as np
import numpy.typing as npt

from services.datastore.client.step_store import Keys, StepStore
from services.datastore.client.sum_tree import SumTree

Slots = npt.NDArray[np.int64]
Weights = npt.NDArray[np.float64]
Ready = npt.NDArray[np.bool_]


class Sampler:
    """Picks slots of ready transitions; told which keys became ready and which left (the
    uniform and FIFO samplers need not know)."""

    # Whether a transition sampled leaves the buffer (a queue).
    consumes = False

    def became_ready(self, keys: Keys) -> None:
        pass

    def left(self, keys: Keys) -> None:
        pass

    def sample(
        self, store: StepStore, ready: Ready, ready_count: int, count: int, rng: np.random.Generator
    ) -> tuple[Slots, Weights]:
        raise NotImplementedError


class UniformSampler(Sampler):
    def sample(
        self, store: StepStore, ready: Ready, ready_count: int, count: int, rng: np.random.Generator
    ) -> tuple[Slots, Weights]:
        # Draws over the stored steps, those not ready drawn again: most steps are transitions
        # (all but each live episode's latest few), so this stays a few vector operations.
        slots = np.empty(count, dtype=np.int64)
        missing = np.arange(count)
        while missing.size:
            drawn = (store.oldest_key + rng.integers(0, len(store), missing.size)) % store.capacity
            hit = ready[drawn]
            slots[missing[hit]] = drawn[hit]
            missing = missing[~hit]
        return slots, np.ones(count)


class FifoSampler(Sampler):
    """The oldest ready transitions, each once: they leave the buffer as they are sampled.

    A heap of the keys that became ready, not a scan of the ring: live episodes interleave, so a
    step can become ready after younger ones were sampled, and consumed steps stay in the ring
    until the capacity removes them."""

    consumes = True

    def __init__(self) -> None:
        self._queue: list[int] = []

    def became_ready(self, keys: Keys) -> None:
        for key in keys.tolist():
            heapq.heappush(self._queue, key)

    def left(self, keys: Keys) -> None:
        # Removed by the capacity: the oldest keys, at the front (those sampled were taken off).
        gone = set(keys.tolist())
        while self._queue and self._queue[0] in gone:
            heapq.heappop(self._queue)

    def sample(
        self, store: StepStore, ready: Ready, ready_count: int, count: int, rng: np.random.Generator
    ) -> tuple[Slots, Weights]:
        oldest = [heapq.heappop(self._queue) for _ in range(min(count, len(self._queue)))]
        return np.array(oldest, dtype=np.int64) % store.capacity, np.ones(len(oldest))


class PrioritizedSampler(Sampler):
    """Proportional prioritized replay: a transition is sampled with probability p^alpha / sum,
    weighted (N * P)^-beta / the batch's largest weight; a new transition gets the largest
    priority given so far (1 at first), so that each is sampled soon."""

    def __init__(self, capacity: int, alpha: float = 0.6, beta: float = 0.4) -> None:
        if not alpha >= 0:
            raise ValueError(f"alpha must be 0 or more, not {alpha}")
        if not beta >= 0:
            raise ValueError(f"beta must be 0 or more, not {beta}")
        self.alpha = alpha
        self.beta = beta
        self.max_priority = 1.0
        self._tree = SumTree(capacity)

    def became_ready(self, keys: Keys) -> None:
        self._tree.set(keys % self._tree.capacity, self.max_priority**self.alpha)

    def left(self, keys: Keys) -> None:
        self._tree.set(keys % self._tree.capacity, 0.0)

    def update(self, store: StepStore, ready: Ready, keys: npt.ArrayLike, priorities: npt.ArrayLike) -> None:
        """New priorities (more than 0) for these transitions; keys no longer in the buffer are
        skipped (removed since they were sampled)."""
        # asarray: np.array(..., ndmin=1) warns on a torch tensor's `__array__` (no `copy`).
        checked_keys = np.atleast_1d(np.asarray(keys, dtype=np.int64))
        values = np.atleast_1d(np.asarray(priorities, dtype=np.float64))
        if checked_keys.shape != values.shape:
            raise ValueError(f"{len(checked_keys)} keys but {len(values)} priorities")
        if not np.all(np.isfinite(values)) or np.any(values <= 0):
            raise ValueError("priorities must be finite and more than 0")
        kept = store.present(checked_keys)
        kept[kept] = ready[checked_keys[kept] % store.capacity]
        self._tree.set(checked_keys[kept] % store.capacity, values[kept] ** self.alpha)
        if kept.any():
            self.max_priority = max(self.max_priority, float(values[kept].max()))

    def sample(
        self, store: StepStore, ready: Ready, ready_count: int, count: int, rng: np.random.Generator
    ) -> tuple[Slots, Weights]:
        total = self._tree.total
        # Stratified: one draw in each of `count` equal parts of the total, spread over the tree.
        prefixes = (np.arange(count) + rng.random(count)) * (total / count)
        slots = self._tree.find(np.minimum(prefixes, np.nextafter(total, 0)))
        probabilities = self._tree.get(slots) / total
        weights = (ready_count * probabilities) ** -self.beta
        return slots, weights / weights.max()
