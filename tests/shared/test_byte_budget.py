"""The byte budget: first come, first served; a request larger than the budget admitted alone;
a waiter cancelled, granted or not, leaves the count right."""

from __future__ import annotations

import asyncio

from shared.byte_budget import ByteBudget


async def _settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


async def test_waiters_are_served_in_order_and_a_large_one_is_not_overtaken() -> None:
    budget = ByteBudget(100)
    await budget.acquire(60)
    large = asyncio.create_task(budget.acquire(80))
    await _settle()
    small = asyncio.create_task(budget.acquire(10))  # would fit, but comes after the large one
    await _settle()
    assert not large.done() and not small.done() and budget.waiting == 2
    budget.release(60)
    await _settle()
    assert large.done() and small.done() and budget.held == 90


async def test_a_request_larger_than_the_budget_is_admitted_alone() -> None:
    budget = ByteBudget(100)
    await budget.acquire(500)  # nothing held: admitted
    waiting = asyncio.create_task(budget.acquire(1))
    await _settle()
    assert not waiting.done()
    budget.release(500)
    await _settle()
    assert waiting.done() and budget.held == 1


async def test_added_bytes_go_over_and_hold_back_waiters() -> None:
    budget = ByteBudget(100)
    budget.add(150)  # already in memory: counted without waiting
    waiting = asyncio.create_task(budget.acquire(1))
    await _settle()
    assert not waiting.done()
    budget.release(60)
    await _settle()
    assert waiting.done() and budget.held == 91


async def test_cancelled_waiters_leave_the_count_right() -> None:
    budget = ByteBudget(100)
    await budget.acquire(100)
    first = asyncio.create_task(budget.acquire(50))
    second = asyncio.create_task(budget.acquire(50))
    await _settle()
    first.cancel()  # while waiting: the one after it is served in its place
    budget.release(50)
    await _settle()
    assert first.cancelled() and second.done() and budget.held == 100
    granted = asyncio.create_task(budget.acquire(50))
    await _settle()
    budget.release(50)  # grants it...
    granted.cancel()  # ...as it is cancelled: given back
    await asyncio.gather(granted, return_exceptions=True)
    assert budget.held == 50 and budget.waiting == 0
