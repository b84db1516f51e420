"""A stand-in router worker for the supervisor's tests: the real worker's mechanics (inherited
socket, readiness line, lifeline, drain on SIGTERM) around a trivial handler on the router's listener.

    GET /pid                    -> this worker's pid
    GET /stream?chunks=N&every=S -> N chunks, one every S seconds ("streams in flight")
"""

from __future__ import annotations

import asyncio
import os

from aiohttp import web

from llmgw.router.listener import Listener
from llmgw.router.worker import WorkerArgs, main


async def build(args: WorkerArgs):
    if os.environ.get("SLEEP_WORKER_FAIL"):
        raise RuntimeError(os.environ["SLEEP_WORKER_FAIL"])

    async def pid(_: web.BaseRequest) -> web.Response:
        return web.Response(text=str(os.getpid()))

    async def stream(request: web.BaseRequest) -> web.StreamResponse:
        chunks = int(request.query.get("chunks", "5"))
        every = float(request.query.get("every", "0.2"))
        response = web.StreamResponse()
        await response.prepare(request)
        for index in range(chunks):
            await response.write(f"{os.getpid()} {index}\n".encode())
            await asyncio.sleep(every)
        await response.write_eof()
        return response

    async def handle(request: web.BaseRequest) -> web.StreamResponse:
        if request.path in ("/pid", "/healthz"):
            return await pid(request)
        if request.path == "/stream":
            return await stream(request)
        return web.Response(status=404)

    async def nothing() -> None:
        pass

    return Listener(handle, nothing, nothing), nothing, None


if __name__ == "__main__":
    main(build)
