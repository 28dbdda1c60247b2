"""Background work that never dies silently, and never leaves a service half-alive.

`Supervised` runs a coroutine function as a task and starts it again when it fails; `Periodic`
runs a step every period (or at once when woken) and keeps going when a step fails. Either way a
streak of failures is logged once when it starts (with its cause; a bug's traceback once) and once
when it ends (`FailureStreak`), and retries back off, doubling up to BACKOFF_MAX_S.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from shared.errors import classify
from shared.logging import get_logger

BACKOFF_INITIAL_S = 0.1
BACKOFF_MAX_S = 5.0
# A periodic step under way gets this long to finish when its task stops.
STEP_STOP_S = 2.0
RECANCEL_PERIOD_S = 0.1

log = get_logger("shared.supervision")

T = TypeVar("T")


def backoff_delay(failures: int) -> float:
    """Seconds to wait after the `failures`-th failure in a row (1, 2, ...)."""
    return min(BACKOFF_INITIAL_S * float(2 ** max(failures - 1, 0)), BACKOFF_MAX_S)


async def cancel_and_wait(task: asyncio.Task[Any]) -> None:
    """Cancel `task` and wait until it has ended; raises what it failed with, if it failed.

    Cancelled again until it ends: on Python 3.11 and older, `asyncio.wait_for` returns the inner
    result instead of raising when the cancellation arrives just as that result does, so a task
    looping around `wait_for` can swallow one cancellation. One cancel, then waiting, hung a
    service's shutdown for good (about one immediate shutdown in twenty on PostgreSQL)."""
    while not task.done():
        task.cancel()
        await asyncio.wait([task], timeout=RECANCEL_PERIOD_S)
    if not task.cancelled():
        task.result()


async def uninterrupted(work: Awaitable[T]) -> T:
    """`work`'s result, `work` run to its end even when the caller is cancelled meanwhile (a
    resource taken or given back must not be left half way); that cancellation is raised once
    `work` has succeeded (what it failed with, if it failed)."""
    task = asyncio.ensure_future(work)
    cancelled: asyncio.CancelledError | None = None
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError as error:
            if task.done():
                break
            cancelled = error
    if cancelled is not None:
        raise cancelled
    return task.result()


async def within(step: Awaitable[T], timeout_s: float) -> T:
    """`step`'s result, or TimeoutError (`step` cancelled) once `timeout_s` have passed. Unlike
    `asyncio.wait_for` on Python 3.11 and older, which returns the result when the caller's
    cancellation arrives just as `step` completes, it never swallows a cancellation (Ctrl-C
    during an import was lost so, and the import then waited for its input forever)."""
    task = asyncio.ensure_future(step)
    try:
        await asyncio.wait([task], timeout=timeout_s)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if not task.done():
        task.cancel()
        raise TimeoutError(f"not done within {timeout_s:g} s")
    return task.result()


class FailureStreak:
    """Failures of one piece of work in a row: logged when the streak starts and when it ends,
    not once per failure."""

    def __init__(self, what: str, **fields: Any) -> None:
        self.what = what
        self.fields = fields
        self.failures = 0
        self._since = 0.0

    def failed(self, error: BaseException) -> float:
        """Count a failure; returns how long to wait before the next try."""
        self.failures += 1
        if self.failures == 1:
            self._since = time.monotonic()
            # A dependency's failure is expected in operation: its message says enough. Anything
            # else is a bug, whose traceback is wanted once.
            bug = classify(error) is None
            log.warning(
                f"{self.what} failed, retrying",
                error=str(error) or type(error).__name__,
                exc_info=error if bug else None,
                **self.fields,
            )
        return backoff_delay(self.failures)

    def succeeded(self) -> None:
        if self.failures:
            log.info(
                f"{self.what} works again",
                failures=self.failures,
                seconds=round(time.monotonic() - self._since, 3),
                **self.fields,
            )
            self.failures = 0


class Supervised:
    """`work()` as a task, started again (after a backoff) whenever it fails."""

    def __init__(self, name: str, work: Callable[[], Awaitable[None]]) -> None:
        self.name = name
        self._work = work
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=self.name)

    async def join(self) -> None:
        """Wait until `work` returned (it is not started again after it returned)."""
        if self._task is not None:
            await asyncio.shield(self._task)

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None

    async def _run(self) -> None:
        streak = FailureStreak(self.name)
        while True:
            started = time.monotonic()
            try:
                await self._work()
                return
            except Exception as error:
                if time.monotonic() - started > BACKOFF_MAX_S:
                    streak = FailureStreak(self.name)  # it ran a while: a new streak begins
                await asyncio.sleep(streak.failed(error))


class Periodic(Supervised):
    """`step()` every `period_s`, or at once after `wake()`; a step that returns True (more to
    do: any true value) is run again at once. A failing step is retried with backoff."""

    def __init__(self, name: str, step: Callable[[], Awaitable[object]], period_s: float) -> None:
        super().__init__(name, self._loop)
        self._step = step
        self.period_s = period_s
        self._woken = asyncio.Event()
        # Clear while a step runs.
        self._between_steps = asyncio.Event()
        self._between_steps.set()

    async def stop(self) -> None:
        """After the step under way, if any, for STEP_STOP_S at most: cancelled in the middle of a
        database call, a step leaves its pooled connection neither returned nor closed."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._between_steps.wait(), STEP_STOP_S)
        await super().stop()

    def wake(self) -> None:
        self._woken.set()

    async def _loop(self) -> None:
        streak = FailureStreak(self.name)
        while True:
            self._between_steps.clear()
            try:
                while await self._step():
                    pass
            except Exception as error:
                delay = streak.failed(error)
            else:
                streak.succeeded()
                delay = self.period_s
            finally:
                self._between_steps.set()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._woken.wait(), delay)
            self._woken.clear()
