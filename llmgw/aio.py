"""Small asyncio helpers shared by the fleet, the control plane and serve."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

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


async def in_daemon_thread(fn: Callable[[], object]):
    """`fn()` on a thread of its own that does not hold up the process's exit: opening the
    state database may wait up to its busy timeout for another command, and a SIGTERM meanwhile
    must still stop `serve` at once (the default executor is joined at exit)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(result, error) -> None:
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(result)

    def run() -> None:
        try:
            result, error = fn(), None
        except BaseException as exc:  # handed to the waiting coroutine
            result, error = None, exc
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop is gone: nobody is waiting any more
            pass

    threading.Thread(target=run, name="llmgw-start", daemon=True).start()
    return await future
