"""Steps in memory for a replay buffer: preallocated numpy columns, a ring of `capacity`
slots, the oldest removed first when the slots or `capacity_bytes` run out.

Each step gets a key, counting up from 0 in insertion order: its slot is the key modulo the
capacity, and a key whose slot holds another key was removed. The columns take their shape and
dtype from the first step added (raw bytes: an object column).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

Keys = npt.NDArray[np.int64]


class StepStore:
    def __init__(self, capacity: int, capacity_bytes: int | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1 step, not {capacity}")
        if capacity_bytes is not None and capacity_bytes < 1:
            raise ValueError(f"capacity_bytes must be at least 1, not {capacity_bytes}")
        self.capacity = capacity
        self.capacity_bytes = capacity_bytes
        self._columns: dict[str, npt.NDArray[Any]] = {}
        self._keys = np.full(capacity, -1, dtype=np.int64)
        self._sizes = np.zeros(capacity, dtype=np.int64)
        self.count = 0
        self.next_key = 0
        self.held_bytes = 0

    def __len__(self) -> int:
        return self.count

    @property
    def oldest_key(self) -> int:
        return self.next_key - self.count

    def add(self, rows: Mapping[str, Sequence[Any] | npt.NDArray[Any]]) -> tuple[Keys, Keys]:
        """Add steps (one value per column, per step): their keys, and the keys of the steps
        removed to make room, oldest first (of a batch that does not fit, its first steps are
        among them)."""
        names = sorted(rows)
        if self._columns and names != sorted(self._columns):
            raise ValueError(f"steps have the columns {sorted(self._columns)}, not {names}")
        lengths = {len(rows[name]) for name in names}
        if len(lengths) != 1:
            raise ValueError("every column needs one value per step")
        (length,) = lengths
        if not length:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        # The first steps stored set the columns' types: not a batch rejected below.
        columns = self._columns or {name: _column(rows[name][0], self.capacity) for name in names}
        values = {name: _values(name, columns[name], rows[name]) for name in names}
        sizes = sum((_sizes(column) for column in values.values()), np.zeros(length, np.int64))
        if self.capacity_bytes is not None and sizes.max() > self.capacity_bytes:
            raise ValueError(
                f"a step of {int(sizes.max())} bytes is larger than capacity_bytes ({self.capacity_bytes})"
            )
        self._columns = columns
        # Of a batch that does not fit even alone, the first are removed as the later ones come:
        # every stored step too, since they are older.
        kept = min(length, self.capacity)
        if self.capacity_bytes is not None:
            kept = min(kept, int(np.searchsorted(np.cumsum(sizes[::-1]), self.capacity_bytes, "right")))
        if kept < length:
            removed = self.remove_oldest(self.count)
            skipped = np.arange(self.next_key, self.next_key + length - kept, dtype=np.int64)
            self.next_key += length - kept
            values = {name: column[length - kept :] for name, column in values.items()}
            keys = self._add_chunk(values, sizes[length - kept :])
            return np.concatenate((skipped, keys)), np.concatenate((removed, skipped))
        removed = self._make_room(sizes)
        return self._add_chunk(values, sizes), removed

    def _add_chunk(self, values: Mapping[str, npt.NDArray[Any]], sizes: npt.NDArray[np.int64]) -> Keys:
        keys = np.arange(self.next_key, self.next_key + len(sizes), dtype=np.int64)
        slots = keys % self.capacity
        for name, column in values.items():
            self._columns[name][slots] = column
        self._keys[slots] = keys
        self._sizes[slots] = sizes
        self.held_bytes += int(sizes.sum())
        self.count += len(sizes)
        self.next_key += len(sizes)
        return keys

    def _make_room(self, sizes: npt.NDArray[np.int64]) -> Keys:
        """Remove the oldest steps until `sizes` (at most `capacity` of them) fit: slots,
        and bytes if bounded."""
        remove = max(0, self.count + len(sizes) - self.capacity)
        if self.capacity_bytes is not None:
            first_kept = (self.oldest_key + np.arange(remove, dtype=np.int64)) % self.capacity
            excess = self.held_bytes - int(self._sizes[first_kept].sum())
            excess += int(sizes.sum()) - self.capacity_bytes
            window = 64
            while excess > 0:  # the oldest left, in growing windows: amortised, not the whole ring
                window = min(window, self.count - remove)  # > 0: the batch fits an empty store
                slots = (self.oldest_key + remove + np.arange(window)) % self.capacity
                freed = np.cumsum(self._sizes[slots])
                enough = np.nonzero(freed >= excess)[0]
                if enough.size:
                    remove += int(enough[0]) + 1
                    break
                remove += window
                excess -= int(freed[-1])
                window *= 2
        return self.remove_oldest(remove)

    def remove_oldest(self, count: int) -> Keys:
        """Remove the `count` oldest steps: their keys."""
        if not count:
            return np.zeros(0, np.int64)
        keys = np.arange(self.oldest_key, self.oldest_key + count, dtype=np.int64)
        slots = keys % self.capacity
        self.held_bytes -= int(self._sizes[slots].sum())
        self._sizes[slots] = 0
        self._keys[slots] = -1
        for column in self._columns.values():
            if column.dtype == object:
                column[slots] = None  # their bytes are freed now, not when the slot is reused
        self.count -= count
        return keys

    def present(self, keys: npt.ArrayLike) -> npt.NDArray[np.bool_]:
        checked = np.asarray(keys, dtype=np.int64)
        present: npt.NDArray[np.bool_] = (checked >= 0) & (self._keys[checked % self.capacity] == checked)
        return present

    def slots(self, keys: npt.ArrayLike) -> npt.NDArray[np.int64]:
        """The slots of stored steps' keys (KeyError for a key removed or never added)."""
        checked = np.asarray(keys, dtype=np.int64)
        if not np.all(self.present(checked)):
            raise KeyError("keys of steps no longer (or never) in the buffer")
        return checked % self.capacity

    def column(self, name: str) -> npt.NDArray[Any]:
        """A column's array, by slot (the buffer's own view: not a copy)."""
        return self._columns[name]

    def nbytes(self) -> int:
        """Bytes of its arrays (of an object column, its pointers: the values are Python objects)."""
        return sum(array.nbytes for array in (*self._columns.values(), self._keys, self._sizes))

    def keys_at(self, slots: npt.NDArray[np.int64]) -> Keys:
        return self._keys[slots]

    def gather(self, slots: npt.NDArray[np.int64]) -> dict[str, npt.NDArray[Any]]:
        """The columns' values at these slots (copies), and their keys."""
        gathered = {name: column[slots] for name, column in self._columns.items()}
        gathered["keys"] = self._keys[slots]
        return gathered


def _column(first: Any, capacity: int) -> npt.NDArray[Any]:
    """A column for values like `first`: an object column for bytes, text (numpy's fixed-width
    strings would cut longer ones) and None; else an array of its shape and dtype."""
    value = None if first is None or isinstance(first, bytes | bytearray | memoryview) else np.asarray(first)
    if value is None or value.dtype.kind in "USO":
        return np.empty(capacity, dtype=object)
    return np.zeros((capacity, *value.shape), dtype=value.dtype)


def _values(
    name: str, column: npt.NDArray[Any], values: Sequence[Any] | npt.NDArray[Any]
) -> npt.NDArray[Any]:
    """`values` as an array to store in `column`: one conversion for numbers, not one per step."""
    if column.dtype == object:
        converted = np.empty(len(values), dtype=object)
        for row, value in enumerate(values):  # (assigned whole: numpy would unpack sequences)
            converted[row] = value
        return converted
    try:
        converted = np.asarray(values, dtype=column.dtype)
    except (TypeError, ValueError) as error:
        first = f"{column.dtype}, shape {column.shape[1:]}"
        raise ValueError(f"{name}: values unlike the first step's ({first}): {error}") from error
    if converted.shape[1:] != column.shape[1:]:
        raise ValueError(
            f"{name}: values of shape {converted.shape[1:]}, the first step's {column.shape[1:]}"
        )
    return converted


def _sizes(values: npt.NDArray[Any]) -> npt.NDArray[np.int64]:
    """Each step's bytes in a column's values (of an object column, its bytes)."""
    if values.dtype == object:
        return np.fromiter((_size(value) for value in values), np.int64, len(values))
    return np.full(len(values), values[0].nbytes if len(values) else 0, np.int64)


def _size(value: Any) -> int:
    if isinstance(value, bytes | bytearray | memoryview):
        return len(value)
    if value is None:
        return 0
    return int(np.asarray(value).nbytes)
