"""Small asyncio helpers shared by the fleet and the control plane."""

from __future__ import annotations

import asyncio


async def cancel_and_wait(*tasks: asyncio.Task | None) -> None:
    """Cancel the tasks and wait until each has finished; their exceptions are not re-raised."""
    live = [t for t in tasks if t is not None]
    for task in live:
        task.cancel()
    for task in live:
        try:
            await task
        except (asyncio.CancelledError, Exception):
            pass
