"""The sum tree against a brute-force reference: the running sum of the priorities, searched."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.datastore.client.sum_tree import SumTree


@st.composite
def updates(draw: st.DrawFn) -> tuple[int, list[tuple[list[int], list[int]]]]:
    capacity = draw(st.integers(1, 70))
    slot = st.integers(0, capacity - 1)
    # Integer priorities: every sum is exact, so the tree and the reference agree to the last bit.
    batch = st.lists(st.tuples(slot, st.integers(0, 1000)), min_size=1, max_size=20)
    steps = draw(st.lists(batch, min_size=1, max_size=8))
    return capacity, [([s for s, _ in step], [p for _, p in step]) for step in steps]


@settings(max_examples=300, deadline=None)
@given(updates(), st.lists(st.floats(0, 1, exclude_max=True), min_size=1, max_size=64))
def test_find_and_total_match_a_running_sum(
    case: tuple[int, list[tuple[list[int], list[int]]]], fractions: list[float]
) -> None:
    capacity, steps = case
    tree = SumTree(capacity)
    reference = np.zeros(capacity)
    for slots, priorities in steps:
        tree.set(slots, priorities)
        for slot, priority in zip(slots, priorities, strict=True):
            reference[slot] = priority  # the last of a repeated slot wins
    assert tree.total == reference.sum()
    assert list(tree.get(range(capacity))) == list(reference)
    if reference.sum() == 0:
        with pytest.raises(ValueError, match="nothing to find"):
            tree.find([0.0])
        return
    # Prefix sums halfway inside a unit: exact in floating point, never on a boundary.
    prefixes = np.floor(np.array(fractions) * reference.sum()) + 0.5
    expected = np.searchsorted(np.cumsum(reference), prefixes, side="right")
    assert list(tree.find(prefixes)) == list(expected)


def test_rounding_never_leads_to_a_slot_of_priority_zero() -> None:
    tree = SumTree(5)
    tree.set([0, 1, 2], [0.1, 0.2, 0.3])  # slots 3 and 4 empty
    found = tree.find(np.nextafter(tree.total, 0) + np.zeros(10))  # the largest prefix below the total
    assert set(found) == {2}


def test_bad_input_is_named() -> None:
    with pytest.raises(ValueError, match="capacity"):
        SumTree(0)
    tree = SumTree(4)
    with pytest.raises(IndexError, match="slots"):
        tree.set([4], [1.0])
    with pytest.raises(ValueError, match="priorities"):
        tree.set([0], [-1.0])
    with pytest.raises(ValueError, match="priorities"):
        tree.set([0], [float("nan")])
