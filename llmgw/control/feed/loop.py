"""The event loop the router feed lives on, and the one way into it from another thread."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import Any

log = logging.getLogger(__name__)


class FeedLoop:
    """The feed's event loop: where its change log, listeners and routers' table are touched, so
    that none of them takes a lock.

    `call` is the one crossing into it. The feed's inputs do not all come from the loop: the
    reconciler pushes endpoint tables and gives up replicas from its pass, a catalog swap calls
    back on whichever thread swapped it (an admin request's), a reload sets the gateway settings.
    Called on the loop's own thread, or before the loop is known (a publisher built and fed
    outside one, as tests do), `call` runs the function at once; from any other thread it queues
    it with `call_soon_threadsafe`, so that calls run in the order they were made and a Change is
    only ever made on the loop. Nothing comes back across: a caller that needs an answer reads it
    on its own side first (`FeedPublisher.abandon`).

    The loop is learned from the first `bind` or `call` made on it; `start` runs the feed's
    background work there, and `close` ends it."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: int | None = None
        self._tasks: list[asyncio.Task] = []

    def bind(self) -> None:
        """Remember the running loop, when called on one and none is known yet."""
        if self._loop is None:
            try:
                self._loop = asyncio.get_running_loop()
            except RuntimeError:
                return
            self._thread = threading.get_ident()

    def call(self, fn: Callable[..., None], *args: Any) -> None:
        """Run `fn(*args)` on the feed's loop: at once when this is its thread, else queued there."""
        self.bind()
        loop = self._loop
        if loop is not None and threading.get_ident() != self._thread and not loop.is_closed():
            loop.call_soon_threadsafe(fn, *args)
        else:
            fn(*args)

    def start(self, work: Callable[[], Coroutine[Any, Any, None]], name: str) -> None:
        """Run `work()` as a task of the loop until `close`; nothing when no loop is known."""
        if self._loop is not None:
            self._tasks.append(self._loop.create_task(work(), name=name))

    async def close(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
