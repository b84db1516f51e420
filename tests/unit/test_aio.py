"""cancel_and_wait ends tasks that swallow a cancellation, and never hides the caller's own."""

from __future__ import annotations

import asyncio

import pytest

from llmgw.aio import cancel_and_wait


async def test_a_task_that_swallows_the_first_cancellation_is_cancelled_again():
    swallowed = []

    async def stubborn():
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            swallowed.append(1)  # as asyncio.wait_for does when its call completes in that turn
        await asyncio.sleep(60)

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    # The bound is a hang guard only: a single cancel() would wait for the full minute.
    await asyncio.wait_for(cancel_and_wait(task), 30)
    assert swallowed == [1] and task.cancelled()


async def test_ended_tasks_and_their_errors_are_waited_for_not_raised():
    async def failing():
        raise ValueError("boom")

    failed = asyncio.create_task(failing())
    await asyncio.sleep(0)
    await cancel_and_wait(failed, None)
    assert isinstance(failed.exception(), ValueError)


async def test_the_callers_own_cancellation_propagates():
    give_up = asyncio.Event()

    async def holds_on():
        while not give_up.is_set():
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                pass  # swallowed until told to give up

    task = asyncio.create_task(holds_on())
    waiter = asyncio.create_task(cancel_and_wait(task))
    await asyncio.sleep(0.1)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    give_up.set()
    task.cancel()
    await asyncio.wait_for(task, 30)
