"""The replay samplers: uniform over the ready transitions, prioritized in proportion to p^alpha
with importance weights, FIFO oldest first."""

from __future__ import annotations

import numpy as np
import pytest

from services.datastore.client.samplers import FifoSampler, PrioritizedSampler, UniformSampler
from services.datastore.client.step_store import StepStore


def filled(capacity: int, count: int) -> tuple[StepStore, np.ndarray, np.ndarray, np.ndarray]:
    """A store of `count` steps, every one ready but the latest (an episode's last)."""
    store = StepStore(capacity)
    added, removed = store.add({"reward": [float(key) for key in range(count)]})
    ready = np.zeros(capacity, dtype=bool)
    ready[store.slots(added[-len(store) : -1])] = True
    return store, added, removed, ready


def test_uniform_draws_only_ready_transitions_evenly() -> None:
    store, _, removed, ready = filled(100, 151)  # keys 51 to 150 stored, 150 not ready
    slots, weights = UniformSampler().sample(store, ready, int(ready.sum()), 99_000, np.random.default_rng(0))
    keys = store.gather(slots)["keys"]
    assert keys.min() == 51 and keys.max() == 149 and list(removed) == list(range(51))
    counts = np.bincount(keys - 51)
    assert counts.min() > 850 and counts.max() < 1150  # 1,000 expected each
    assert np.all(weights == 1)


def test_prioritized_draws_in_proportion_to_priority_to_the_alpha() -> None:
    store, added, _, ready = filled(8, 5)
    sampler = PrioritizedSampler(8, alpha=0.5, beta=1.0)
    sampler.became_ready(added[:4])
    sampler.update(store, ready, added[:4], [1.0, 4.0, 9.0, 16.0])  # to the alpha 0.5: 1, 2, 3, 4
    slots, weights = sampler.sample(store, ready, 4, 100_000, np.random.default_rng(1))
    keys = store.gather(slots)["keys"]
    shares = np.bincount(keys, minlength=4) / len(keys)
    assert np.allclose(shares, [0.1, 0.2, 0.3, 0.4], atol=0.01)
    # Weights (N * P)^-beta over the batch's largest: key 0 (P = 0.1) weighs most.
    expected = (4 * np.array([0.1, 0.2, 0.3, 0.4])) ** -1.0
    assert np.allclose(weights, (expected / expected.max())[keys])


def test_prioritized_gives_new_transitions_the_largest_priority_and_forgets_those_gone() -> None:
    store = StepStore(4)
    ready = np.ones(4, dtype=bool)
    sampler = PrioritizedSampler(4, alpha=1.0)
    added, _ = store.add({"reward": [0.0, 1.0]})
    sampler.became_ready(added)
    sampler.update(store, ready, added, [5.0, 1.0])
    added, removed = store.add({"reward": [2.0, 3.0, 4.0]})  # key 0 removed
    sampler.left(removed)
    sampler.became_ready(added)
    sampler.update(store, ready, [0], [100.0])  # gone since: skipped, its slot is key 4's
    slots, _ = sampler.sample(store, ready, 4, 10_000, np.random.default_rng(2))
    shares = np.bincount(store.gather(slots)["keys"], minlength=5) / 10_000
    # Keys 2, 3, 4 came in at the largest priority then (5); key 1 has 1: 5 + 5 + 5 + 1 = 16.
    assert shares[0] == 0
    assert np.allclose(shares[1:], [1 / 16, 5 / 16, 5 / 16, 5 / 16], atol=0.02)


def test_fifo_takes_the_oldest_ready_once() -> None:
    store, _, _, ready = filled(10, 12)  # keys 2 to 11, 11 not ready
    sampler = FifoSampler()
    sampler.became_ready(np.array([5, 2, 6, 4, 7, 3], dtype=np.int64))  # (live episodes interleave)
    sampler.left(np.array([2], dtype=np.int64))  # removed by the capacity
    slots, _ = sampler.sample(store, ready, 5, 4, np.random.default_rng(3))
    assert list(store.gather(slots)["keys"]) == [3, 4, 5, 6]
    slots, _ = sampler.sample(store, ready, 1, 4, np.random.default_rng(3))
    assert list(store.gather(slots)["keys"]) == [7]  # what is ready, up to the size asked for
    assert FifoSampler.consumes


def test_bad_priorities_are_named() -> None:
    store, added, _, ready = filled(4, 2)
    sampler = PrioritizedSampler(4)
    sampler.became_ready(added)
    with pytest.raises(ValueError, match="more than 0"):
        sampler.update(store, ready, added, [1.0, 0.0])
    with pytest.raises(ValueError, match="2 keys but 1 priorities"):
        sampler.update(store, ready, added, [1.0])
    with pytest.raises(ValueError, match="alpha"):
        PrioritizedSampler(4, alpha=-1)
