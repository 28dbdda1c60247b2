"""The replay samplers: uniform over what is stored, prioritized in proportion to p^alpha with
importance weights, FIFO oldest first."""

from __future__ import annotations

import numpy as np
import pytest

from services.datastore.client.samplers import FifoSampler, PrioritizedSampler, UniformSampler
from services.datastore.client.transition_store import TransitionStore


def filled(capacity: int, count: int) -> tuple[TransitionStore, np.ndarray, np.ndarray]:
    store = TransitionStore(capacity)
    added, removed = store.add({"reward": [float(key) for key in range(count)]})
    return store, added, removed


def test_uniform_draws_only_stored_transitions_evenly() -> None:
    store, _, removed = filled(100, 150)  # keys 50 to 149 stored
    slots, weights = UniformSampler().sample(store, 100_000, np.random.default_rng(0))
    keys = store.gather(slots)["keys"]
    assert keys.min() == 50 and keys.max() == 149 and list(removed) == list(range(50))
    counts = np.bincount(keys - 50)
    assert counts.min() > 850 and counts.max() < 1150  # 1,000 expected each
    assert np.all(weights == 1)


def test_prioritized_draws_in_proportion_to_priority_to_the_alpha() -> None:
    store, added, _ = filled(8, 4)
    sampler = PrioritizedSampler(8, alpha=0.5, beta=1.0)
    sampler.added(added)
    sampler.update(store, added, [1.0, 4.0, 9.0, 16.0])  # to the alpha 0.5: 1, 2, 3, 4
    slots, weights = sampler.sample(store, 100_000, np.random.default_rng(1))
    keys = store.gather(slots)["keys"]
    shares = np.bincount(keys, minlength=4) / len(keys)
    assert np.allclose(shares, [0.1, 0.2, 0.3, 0.4], atol=0.01)
    # Weights (N * P)^-beta over the batch's largest: key 0 (P = 0.1) weighs most.
    expected = (4 * np.array([0.1, 0.2, 0.3, 0.4])) ** -1.0
    assert np.allclose(weights, (expected / expected.max())[keys])


def test_prioritized_gives_new_transitions_the_largest_priority_and_forgets_removed_ones() -> None:
    store = TransitionStore(4)
    sampler = PrioritizedSampler(4, alpha=1.0)
    added, _ = store.add({"reward": [0.0, 1.0]})
    sampler.added(added)
    sampler.update(store, added, [5.0, 1.0])
    added, removed = store.add({"reward": [2.0, 3.0, 4.0]})  # key 0 removed
    sampler.removed(removed)
    sampler.added(added)
    sampler.update(store, [0], [100.0])  # removed since: skipped, its slot is key 4's
    slots, _ = sampler.sample(store, 10_000, np.random.default_rng(2))
    shares = np.bincount(store.gather(slots)["keys"], minlength=5) / 10_000
    # Keys 2, 3, 4 came in at the largest priority then (5); key 1 has 1: 5 + 5 + 5 + 1 = 16.
    assert shares[0] == 0
    assert np.allclose(shares[1:], [1 / 16, 5 / 16, 5 / 16, 5 / 16], atol=0.02)


def test_fifo_takes_the_oldest_once() -> None:
    store, _, _ = filled(10, 12)  # keys 2 to 11
    slots, _ = FifoSampler().sample(store, 4, np.random.default_rng(3))
    assert list(store.gather(slots)["keys"]) == [2, 3, 4, 5]
    assert FifoSampler.consumes


def test_bad_priorities_are_named() -> None:
    store, added, _ = filled(4, 2)
    sampler = PrioritizedSampler(4)
    sampler.added(added)
    with pytest.raises(ValueError, match="more than 0"):
        sampler.update(store, added, [1.0, 0.0])
    with pytest.raises(ValueError, match="2 keys but 1 priorities"):
        sampler.update(store, added, [1.0])
    with pytest.raises(ValueError, match="alpha"):
        PrioritizedSampler(4, alpha=-1)
