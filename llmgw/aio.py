"""Small asyncio helpers shared by the fleet and the control plane."""

from __future__ import annotations

import asyncio

RECANCEL_EVERY = 0.5  # seconds between cancellations of a task that has not ended yet


async def cancel_and_wait(*tasks: asyncio.Task | None) -> None:
    """Cancel the tasks and wait until each has finished; their exceptions are not re-raised.

    A task can swallow a cancellation without meaning to: before Python 3.12, `asyncio.wait_for`
    returns its result instead of raising when the awaited call completes in the same turn as the
    cancellation. Such a task then waits on, and a single cancel() would leave this waiting for
    ever (a link's supervisor that had just connected, say). So a task still running is cancelled
    again every RECANCEL_EVERY seconds until it ends. A cancellation of the caller itself is not
    swallowed: it propagates from here."""
    live = [t for t in tasks if t is not None]
    for task in live:
        task.cancel()
    pending = {t for t in live if not t.done()}
    while pending:
        _, pending = await asyncio.wait(pending, timeout=RECANCEL_EVERY)
        for task in pending:
            task.cancel()
    for task in live:
        if not task.cancelled():
            task.exception()  # retrieved: an ended task's error is not logged as never retrieved
