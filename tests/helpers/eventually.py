"""Waiting in tests for something to become true, instead of sleeping a guessed while: the
condition is polled until it holds, and a timeout fails the test naming what never happened."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


async def eventually(
    condition: Callable[[], Awaitable[T] | T],
    what: str = "the condition",
    timeout_s: float = 10.0,
    interval_s: float = 0.05,
) -> T:
    """The first truthy value of `condition()` (a plain or a coroutine function), polled every
    `interval_s`; an AssertionError naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout_s:g} s waiting for {what}"
        await asyncio.sleep(interval_s)


def wait_until(
    condition: Callable[[], T], what: str = "the condition", timeout_s: float = 10.0, interval_s: float = 0.05
) -> T:
    """`eventually` for code outside an event loop: blocks while polling."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout_s:g} s waiting for {what}"
        time.sleep(interval_s)
