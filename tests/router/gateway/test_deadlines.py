"""Deadlines (router/gateway/deadlines.py): past-due tasks are cancelled and told apart from
cancellations of any other cause."""

from __future__ import annotations

import asyncio

import pytest

from router.gateway.deadlines import Deadlines


async def test_a_task_past_its_deadline_is_cancelled_and_told_so() -> None:
    deadlines = Deadlines(period_s=0.01)

    async def slow() -> str:
        task = deadlines.enter(0.02)
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            assert deadlines.expired(task)
            return "expired"
        finally:
            deadlines.leave(task)
        return "finished"

    async def quick() -> str:
        task = deadlines.enter(5)
        try:
            await asyncio.sleep(0.05)
        finally:
            deadlines.leave(task)
        return "finished"

    assert await asyncio.wait_for(asyncio.gather(slow(), quick()), 2) == ["expired", "finished"]
    await deadlines.close()


async def test_other_cancellations_are_not_taken_for_a_deadline() -> None:
    deadlines = Deadlines(period_s=0.01)
    seen: list[bool] = []

    async def waits() -> None:
        task = deadlines.enter(5)
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            seen.append(deadlines.expired(task))
            raise
        finally:
            deadlines.leave(task)

    task = asyncio.ensure_future(waits())
    await asyncio.sleep(0.02)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert seen == [False]
    await deadlines.close()
