"""SIGTERM handling of the client listener: in-flight requests get the grace, in all (R-4.5)."""

from __future__ import annotations

import asyncio
import time

import aiohttp
from aiohttp import web

from llmgw.router.listener import Listener

GRACE = 1.0
AIOHTTP_TIMEOUT = 10.0  # aiohttp alone would wait this long, then as long again


async def test_shutdown_lets_requests_finish_and_cancels_the_rest_at_the_grace():
    began = asyncio.Event()
    cancelled = asyncio.Event()

    async def slow(request: web.BaseRequest) -> web.Response:
        began.set()
        await asyncio.sleep(GRACE / 4)
        return web.Response(text="done")

    async def stuck(request: web.BaseRequest) -> web.Response:  # waits on an engine that went silent
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return web.Response(text="never")

    async def handle(request: web.BaseRequest) -> web.Response:
        return await (slow if request.path == "/slow" else stuck)(request)

    async def nothing() -> None:
        pass

    runner = Listener(handle, nothing, nothing).runner(GRACE)  # the router's listener, as a worker runs it
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = "http://%s:%d" % runner.addresses[0][:2]
    async with aiohttp.ClientSession() as session:
        async def get(path: str):
            try:
                async with session.get(url + path) as response:
                    return response.status, await response.text()
            except aiohttp.ClientError as exc:
                return None, type(exc).__name__

        stuck_answer = asyncio.create_task(get("/stuck"))
        slow_answer = asyncio.create_task(get("/slow"))
        await asyncio.wait_for(began.wait(), 10)
        started = time.monotonic()
        await runner.cleanup()
        took = time.monotonic() - started
        assert await slow_answer == (200, "done")  # finished within the grace
        assert (await stuck_answer)[0] is None  # cut, not answered
    assert cancelled.is_set()
    assert GRACE <= took < AIOHTTP_TIMEOUT
