"""The replay buffer's step store against a plain model: a queue that takes steps one at a time
and drops its oldest while over either capacity."""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.datastore.client.step_store import StepStore

# A step: an observation of 2 float32 (8 bytes), raw action bytes, a float64 reward.
FIXED_BYTES = 8 + 8


@st.composite
def runs(draw: st.DrawFn) -> tuple[int, int | None, list[list[int]]]:
    capacity = draw(st.integers(1, 12))
    capacity_bytes = draw(st.none() | st.integers(FIXED_BYTES + 12, 200))
    largest_action = 12 if capacity_bytes is None else capacity_bytes - FIXED_BYTES
    batches = draw(st.lists(st.lists(st.integers(0, largest_action), max_size=30), min_size=1, max_size=12))
    return capacity, capacity_bytes, batches


@settings(max_examples=300, deadline=None)
@given(runs())
def test_batches_are_stored_as_one_step_at_a_time_would_be(
    case: tuple[int, int | None, list[list[int]]],
) -> None:
    capacity, capacity_bytes, batches = case
    store = StepStore(capacity, capacity_bytes)
    model: deque[tuple[int, int]] = deque()  # (key, action length)
    next_key = 0
    for batch in batches:
        keys = list(range(next_key, next_key + len(batch)))
        rows = {
            "observation": [np.array([key, -key], np.float32) for key in keys],
            "action": [bytes([key % 256]) * length for key, length in zip(keys, batch, strict=True)],
            "reward": [float(key) for key in keys],
        }
        added, removed = store.add(rows)
        expected_removed = []
        for key, length in zip(keys, batch, strict=True):
            model.append((key, length))
            while len(model) > capacity or (
                capacity_bytes is not None and sum(FIXED_BYTES + n for _, n in model) > capacity_bytes
            ):
                expected_removed.append(model.popleft()[0])
        next_key += len(batch)
        assert list(added) == keys
        assert list(removed) == expected_removed
        assert len(store) == len(model)
        assert store.held_bytes == sum(FIXED_BYTES + n for _, n in model)
        stored = np.array([key for key, _ in model], np.int64)
        assert store.present(np.arange(next_key)).sum() == len(model)
        if len(model):
            got = store.gather(store.slots(stored))
            assert list(got["keys"]) == list(stored)
            assert list(got["reward"]) == [float(key) for key in stored]
            assert got["observation"].tolist() == [[key, -key] for key in stored]
            assert [len(action) for action in got["action"]] == [n for _, n in model]


def test_bad_input_is_named() -> None:
    with pytest.raises(ValueError, match="capacity must be"):
        StepStore(0)
    with pytest.raises(ValueError, match="capacity_bytes must be"):
        StepStore(10, 0)
    store = StepStore(10, capacity_bytes=100)
    with pytest.raises(ValueError, match=r"a step of 101 bytes is larger than capacity_bytes \(100\)"):
        store.add({"action": [b"x" * 101]})
    store.add({"action": [b"x"]})
    with pytest.raises(ValueError, match="columns"):
        store.add({"observation": [b"x"]})
    with pytest.raises(KeyError):
        store.slots([5])


def test_a_rejected_first_batch_leaves_the_columns_to_the_first_stored_one() -> None:
    store = StepStore(10, capacity_bytes=100)
    with pytest.raises(ValueError, match="larger than capacity_bytes"):
        store.add({"observation": [np.zeros(50, np.float32)]})  # 200 bytes
    with pytest.raises(ValueError, match="one value per step"):
        store.add({"observation": [np.zeros(2)], "reward": []})
    store.add({"observation": [np.zeros(3, np.int16)]})  # the first stored: int16 x 3
    assert store.column("observation").shape == (10, 3) and store.column("observation").dtype == np.int16
