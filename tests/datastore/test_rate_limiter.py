"""The replay rate limiter over long random runs: the samples-per-insert ratio stays within its
error buffer, nothing samples before the minimum size, and inserts and samples never both wait."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.datastore.client.rate_limiter import RateLimiter


@st.composite
def limiters(draw: st.DrawFn) -> RateLimiter:
    min_size = draw(st.integers(1, 50))
    ratio = draw(st.floats(0.1, 10, allow_nan=False))
    error_buffer = draw(st.floats(max(1.0, ratio), 3 * max(1.0, ratio) + 300, allow_nan=False))
    return RateLimiter(min_size, ratio, error_buffer)


@settings(max_examples=200, deadline=None)
@given(
    limiters(),
    st.lists(st.tuples(st.booleans(), st.integers(1, 1000)), min_size=1, max_size=2000),
    st.booleans(),
)
def test_the_ratio_stays_within_its_error_buffer(
    limiter: RateLimiter, steps: list[tuple[bool, int]], fifo: bool
) -> None:
    """`fifo`: what is sampled leaves (a queue), so the size can fall back under min_size, where
    inserts always go."""
    assert limiter.samples_per_insert is not None and limiter.error_buffer is not None
    offset = limiter.samples_per_insert * limiter.min_size
    low, high = offset - limiter.error_buffer, offset + limiter.error_buffer
    largest = limiter.largest_batch()
    assert largest is not None and largest >= 1
    for insert, size in steps:
        batch = 1 + size % largest
        held = limiter.why_held(batch)
        # Never both waiting: a sample of one can go whenever an insert cannot.
        assert limiter.can_insert() or limiter.why_held(1) is None
        room = limiter.insert_room()
        assert room is not None and (room > 0) == limiter.can_insert()
        if insert and room:
            limiter.inserted(1 + size % room)  # as many as the room, at most
            # Under min_size inserts always go (Reverb's rule): past the ratio only up to it.
            assert limiter.size <= limiter.min_size or limiter.diff <= high + 1e-9
        elif held is None:
            assert limiter.size >= limiter.min_size
            limiter.sampled(batch)
            if fifo:
                limiter.removed(min(batch, limiter.size))
            assert limiter.diff >= low - 1e-9
    # The largest batch is always sampled in time: fill until inserts wait, then it goes.
    while limiter.can_insert():
        limiter.inserted()
    assert limiter.why_held(largest) is None or limiter.size < limiter.min_size


def test_min_size_alone_holds_samples_back_until_reached() -> None:
    limiter = RateLimiter(min_size=3)
    assert limiter.largest_batch() is None and limiter.can_insert()
    limiter.inserted(2)
    assert limiter.why_held(1) == "min_size"
    limiter.inserted()
    assert limiter.why_held(1000) is None
    limiter.removed(1)  # capacity took one out: below the minimum again
    assert limiter.why_held(1) == "min_size"


def test_bad_settings_are_named() -> None:
    with pytest.raises(ValueError, match="min_size"):
        RateLimiter(min_size=0)
    with pytest.raises(ValueError, match="error_buffer needs"):
        RateLimiter(error_buffer=2.0)
    with pytest.raises(ValueError, match="needs an error_buffer"):
        RateLimiter(samples_per_insert=2.0)
    with pytest.raises(ValueError, match="samples_per_insert must be more than 0"):
        RateLimiter(samples_per_insert=0.0, error_buffer=1.0)
    with pytest.raises(ValueError, match=r"error_buffer must be at least max\(1, samples_per_insert\) = 4.0"):
        RateLimiter(samples_per_insert=4.0, error_buffer=3.0)
