"""When a replay buffer may take more transitions and when it may be sampled, with Reverb's
semantics (`reverb.rate_limiters`): a minimum size before any sample, and optionally a
samples-per-insert ratio kept within an error buffer.

With a ratio, `diff = inserts * samples_per_insert - samples` stays within
`[offset - error_buffer, offset + error_buffer]`, `offset = samples_per_insert * min_size`: an
insert that would take it over waits for samples (here: the feed puts no more steps in, its
samples stay stored), a sample that would take it under waits for inserts. A batch of n
transitions counts as n samples.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class RateLimiter:
    min_size: int = 1
    samples_per_insert: float | None = None
    error_buffer: float | None = None
    inserts: int = 0
    samples: int = 0
    # Transitions removed (capacity): the buffer's size is inserts - removals.
    removals: int = 0

    def __post_init__(self) -> None:
        if self.min_size < 1:
            raise ValueError(f"min_size must be at least 1, not {self.min_size}")
        if self.samples_per_insert is None:
            if self.error_buffer is not None:
                raise ValueError("error_buffer needs samples_per_insert")
            return
        if not self.samples_per_insert > 0 or not math.isfinite(self.samples_per_insert):
            raise ValueError(f"samples_per_insert must be more than 0, not {self.samples_per_insert}")
        if self.error_buffer is None:
            raise ValueError("samples_per_insert needs an error_buffer (Reverb's SampleToInsertRatio)")
        # Reverb's own check: less, and an insert and a sample could each wait for the other.
        if self.error_buffer < max(1.0, self.samples_per_insert):
            raise ValueError(
                f"error_buffer must be at least max(1, samples_per_insert) = "
                f"{max(1.0, self.samples_per_insert)}, not {self.error_buffer}"
            )

    @property
    def diff(self) -> float:
        assert self.samples_per_insert is not None
        return self.inserts * self.samples_per_insert - self.samples

    @property
    def _bounds(self) -> tuple[float, float]:
        assert self.samples_per_insert is not None and self.error_buffer is not None
        offset = self.samples_per_insert * self.min_size
        return offset - self.error_buffer, offset + self.error_buffer

    @property
    def size(self) -> int:
        return self.inserts - self.removals

    def largest_batch(self) -> int | None:
        """The largest batch sure to be sampled in time (None: any): inserts stop with diff just
        over `high - samples_per_insert`, and a larger batch would wait for inserts that wait
        for it."""
        if self.samples_per_insert is None:
            return None
        low, high = self._bounds
        return math.floor(high - self.samples_per_insert - low)

    def can_insert(self) -> bool:
        return self.insert_room() != 0

    def insert_room(self) -> int | None:
        """How many inserts may come now (None: any number)."""
        if self.samples_per_insert is None:
            return None
        # Up to min_size always (Reverb's rule): a FIFO's samples remove transitions, and a
        # buffer under min_size whose ratio held inserts back would wait for ever.
        ratio = math.floor((self._bounds[1] - self.diff) / self.samples_per_insert)
        return max(0, ratio, self.min_size - self.size)

    def why_held(self, count: int) -> str | None:
        """Why a sample of `count` must wait: "min_size" or "samples_per_insert" (None: it
        need not)."""
        if self.size < self.min_size:
            return "min_size"
        if self.samples_per_insert is not None and self.diff - count < self._bounds[0]:
            return "samples_per_insert"
        return None

    def largest_insert_room(self) -> int | None:
        """The most inserts the ratio ever lets in at once (None: any number), from its lowest
        diff: what a writer can wait for."""
        if self.samples_per_insert is None:
            return None
        low, high = self._bounds
        return max(1, math.floor((high - low) / self.samples_per_insert), self.min_size)

    def inserted(self, count: int = 1) -> None:
        self.inserts += count

    def removed(self, count: int) -> None:
        self.removals += count

    def sampled(self, count: int) -> None:
        self.samples += count
