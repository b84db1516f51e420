"""A stand-in router worker for the supervisor's tests: the real worker's mechanics (inherited
socket, readiness line, lifeline, drain on SIGTERM) around a trivial app.

    GET /pid                    -> this worker's pid
    GET /stream?chunks=N&every=S -> N chunks, one every S seconds ("streams in flight")
"""

from __future__ import annotations

import asyncio
import os

from aiohttp import web

from llmgw.router.worker import WorkerArgs, main


async def build(args: WorkerArgs):
    if os.environ.get("SLEEP_WORKER_FAIL"):
        raise RuntimeError(os.environ["SLEEP_WORKER_FAIL"])

    async def pid(_: web.Request) -> web.Response:
        return web.Response(text=str(os.getpid()))

    async def stream(request: web.Request) -> web.StreamResponse:
        chunks = int(request.query.get("chunks", "5"))
        every = float(request.query.get("every", "0.2"))
        response = web.StreamResponse()
        await response.prepare(request)
        for index in range(chunks):
            await response.write(f"{os.getpid()} {index}\n".encode())
            await asyncio.sleep(every)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_get("/pid", pid)
    app.router.add_get("/healthz", pid)
    app.router.add_get("/stream", stream)

    async def close() -> None:
        pass

    return app, close, None


if __name__ == "__main__":
    main(build)
