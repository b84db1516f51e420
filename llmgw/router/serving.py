"""Serving an aiohttp app until a stop: the grace for requests in flight (R-4.5, R-10.3)."""

from __future__ import annotations

import asyncio

from aiohttp import web

SHUTDOWN_GRACE = 15.0


def finish_requests_within(app: web.Application, grace: float) -> None:
    """On shutdown, give the requests in flight `grace` seconds in all, then cancel the rest.

    aiohttp alone waits its shutdown_timeout for a handler and then as long again before it
    cancels it, so one request waiting on an engine that went silent (a node cut off) held a
    SIGTERM for twice the grace, and a restart kept clients out that long (R-4.5).
    """
    handling: dict[asyncio.Task, web.Request] = {}

    @web.middleware
    async def track(request: web.Request, handler):
        task = asyncio.current_task()
        handling[task] = request
        try:
            return await handler(request)
        finally:
            handling.pop(task, None)

    async def finish(_: web.Application) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        while handling and loop.time() < deadline:
            await asyncio.wait(list(handling), timeout=deadline - loop.time())
        for request in list(handling.values()):
            request.task.cancel()  # what aiohttp does when the client hangs up

    app.middlewares.insert(0, track)
    app.on_shutdown.append(finish)
