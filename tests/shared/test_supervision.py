"""Supervised background work: stopping it always ends it, and a failing step is retried; work
that must not stop half way runs to its end through its caller's cancellations."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import pytest

from shared.supervision import Periodic, cancel_and_wait, uninterrupted, within

# Far above what stopping takes; reaching it means the stop hung.
STOP_LIMIT_S = 5.0


async def ends(stopping: Coroutine[Any, Any, None]) -> None:
    """Run `stopping` and fail if it has not ended within STOP_LIMIT_S. Not `wait_for`: it would
    cancel a hung stop, and a stop that suppresses CancelledError would then seem to have ended."""
    task = asyncio.ensure_future(stopping)
    await asyncio.wait([task], timeout=STOP_LIMIT_S)
    assert task.done(), "it hung"
    task.result()


async def test_cancel_and_wait_ends_a_task_that_swallows_a_cancellation() -> None:
    swallowed = asyncio.Event()

    async def stubborn() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            swallowed.set()  # as asyncio.wait_for does on Python 3.11 when its result races the cancel
        await asyncio.sleep(3600)

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)  # it starts sleeping
    await ends(cancel_and_wait(task))
    assert swallowed.is_set()
    assert task.cancelled()


async def test_cancel_and_wait_raises_what_the_task_failed_with() -> None:
    async def failing() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            raise RuntimeError("failed while cancelled") from None

    task = asyncio.create_task(failing())
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="failed while cancelled"):
        await cancel_and_wait(task)


async def test_uninterrupted_work_ends_before_its_callers_cancellation_is_raised() -> None:
    release = asyncio.Event()
    finished: list[str] = []

    async def give_back() -> str:
        await release.wait()
        finished.append("given back")
        return "done"

    caller = asyncio.create_task(uninterrupted(give_back()))
    await asyncio.sleep(0)
    caller.cancel()
    await asyncio.sleep(0)
    caller.cancel()  # twice, as gRPC can
    await asyncio.sleep(0.01)
    assert not caller.done()
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert finished == ["given back"]
    assert await uninterrupted(give_back()) == "done"


async def test_uninterrupted_work_that_fails_raises_its_failure() -> None:
    async def failing() -> None:
        await asyncio.sleep(0)
        raise ConnectionError("server away")

    caller = asyncio.create_task(uninterrupted(failing()))
    await asyncio.sleep(0)
    caller.cancel()
    with pytest.raises(ConnectionError):
        await caller


async def test_a_cancellation_arriving_as_the_step_completes_is_not_swallowed() -> None:
    """`asyncio.wait_for` (Python 3.11) returned the step's result here."""
    step: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    caller = asyncio.create_task(within(step, 10))
    await asyncio.sleep(0)  # waiting for the step
    step.set_result(1)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller


async def test_a_step_that_outlasts_its_time_is_cancelled() -> None:
    step = asyncio.ensure_future(asyncio.sleep(3600))
    with pytest.raises(TimeoutError):
        await within(step, 0.01)
    await asyncio.gather(step, return_exceptions=True)
    assert step.cancelled()
    assert await within(asyncio.sleep(0, "done"), 1) == "done"


async def test_a_periodic_task_woken_as_it_is_stopped_stops() -> None:
    """The shutdown that hung: `wake()` then `stop()` in the same turn of the event loop. The
    wait for the wake-up completes as the cancellation arrives, and on Python 3.11 `wait_for`
    then returns instead of raising."""
    steps = 0
    ran = asyncio.Event()

    async def step() -> bool:
        nonlocal steps
        steps += 1
        ran.set()
        return False

    periodic = Periodic("test-periodic", step, period_s=3600)
    periodic.start()
    await asyncio.wait_for(ran.wait(), STOP_LIMIT_S)
    await asyncio.sleep(0)  # it waits for the period or a wake-up
    periodic.wake()
    await ends(periodic.stop())
    assert steps <= 2


async def test_a_failing_step_is_retried_until_it_succeeds() -> None:
    attempts = 0
    succeeded = asyncio.Event()

    async def step() -> bool:
        nonlocal attempts
        attempts += 1
        if attempts < 3:
            raise ConnectionError("the database is away")
        succeeded.set()
        return False

    periodic = Periodic("test-retried", step, period_s=3600)
    periodic.start()
    await asyncio.wait_for(succeeded.wait(), STOP_LIMIT_S)
    await ends(periodic.stop())
    assert attempts == 3


async def test_stopping_a_periodic_task_lets_the_step_under_way_finish() -> None:
    """Cancelled in the middle of a database call, a step would leave its pooled connection
    neither returned nor closed: stop() waits for it (a while at most), then cancels."""
    started, finished = asyncio.Event(), asyncio.Event()

    async def step() -> None:
        started.set()
        await asyncio.sleep(0.3)
        finished.set()

    periodic = Periodic("step", step, period_s=60)
    periodic.start()
    await asyncio.wait_for(started.wait(), 5)
    await periodic.stop()
    assert finished.is_set()
