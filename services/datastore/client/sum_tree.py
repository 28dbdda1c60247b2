"""A sum tree: the priorities of a replay buffer's slots, and the slot a prefix sum of them falls
in, in O(log n) per slot and vectorised over a batch (prioritized replay's proportional
sampling, Schaul et al. 2016).

The tree is an implicit binary heap in one array: node 1 is the root, node i's children are 2i
and 2i + 1, and the leaves (one per slot, padded to a power of two with zeros) follow the inner
nodes. Every inner node holds the sum of its children.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

Slots = npt.ArrayLike


class SumTree:
    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, not {capacity}")
        self.capacity = capacity
        self._depth = (capacity - 1).bit_length()
        self._leaves = 1 << self._depth
        self._nodes = np.zeros(2 * self._leaves, dtype=np.float64)

    @property
    def total(self) -> float:
        """The sum of every priority."""
        return float(self._nodes[1])

    def get(self, slots: Slots) -> npt.NDArray[np.float64]:
        return self._nodes[self._leaves + self._checked_slots(slots)]

    def set(self, slots: Slots, priorities: npt.ArrayLike) -> None:
        """Set the slots' priorities (finite, 0 or more; a slot given twice takes its last one)."""
        checked = self._checked_slots(slots)
        values = np.broadcast_to(np.asarray(priorities, dtype=np.float64), checked.shape)
        if not np.all(np.isfinite(values)) or np.any(values < 0):
            raise ValueError("priorities must be finite and 0 or more")
        self._nodes[self._leaves + checked] = values  # numpy: the last of repeated indices wins
        nodes = np.unique((self._leaves + checked) // 2)
        # Level by level, each parent from its two children: repeated slots cannot double-count.
        while nodes.size:
            self._nodes[nodes] = self._nodes[2 * nodes] + self._nodes[2 * nodes + 1]
            nodes = np.unique(nodes[nodes > 1] // 2)

    def find(self, prefix_sums: npt.ArrayLike) -> npt.NDArray[np.int64]:
        """For each prefix sum in [0, total), the slot it falls in: slot i for sums from the
        priorities of the slots before it up to that plus its own. Never a slot of priority 0
        (rounding cannot lead into an empty subtree); `total` must be more than 0."""
        if self.total <= 0:
            raise ValueError("every priority is 0: there is nothing to find")
        remaining = np.array(prefix_sums, dtype=np.float64, ndmin=1)
        nodes = np.ones(remaining.shape, dtype=np.int64)
        for _ in range(self._depth):
            left = 2 * nodes
            left_sums = self._nodes[left]
            right = (remaining >= left_sums) & (self._nodes[left + 1] > 0)
            remaining -= np.where(right, left_sums, 0.0)
            nodes = left + right
        return nodes - self._leaves

    def _checked_slots(self, slots: Slots) -> npt.NDArray[np.int64]:
        checked = np.array(slots, dtype=np.int64, ndmin=1)
        if checked.size and (checked.min() < 0 or checked.max() >= self.capacity):
            raise IndexError(f"slots must be from 0 to {self.capacity - 1}")
        return checked
