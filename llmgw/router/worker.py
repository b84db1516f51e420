"""A router worker: one process serving the client API on the listening socket its supervisor
hands it (R-10.3).

    python -m llmgw.router.worker --slot N --listen-fd FD [...] --ready-fd FD --lifeline-fd FD \
        --control unix:PATH [--credential-file FILE] --state-dir DIR [--ca FILE]

The supervisor (llmgw.router.supervisor) keeps the listening socket open for its whole life, so
connections that arrive while this process starts or stops wait in the socket's queue for the
next worker rather than being refused. So a worker accepts as soon as it can, snapshot or not: a
router without a snapshot answers at once (`/healthz` 503 with the reason, API requests a 503
`not_ready` with Retry-After) instead of leaving connections queued (R-10.2). On the readiness
pipe it writes `ready` when it serves with a snapshot, or `listening` when it accepts without one
and then `ready` once the first comes; `error: WHY` when it cannot serve. On SIGTERM (or when the lifeline pipe from the
supervisor reaches end of file: the supervisor is gone) it stops accepting, answers what comes on
connections already open with `Connection: close`, gives the requests in flight SHUTDOWN_GRACE to
finish, closes what the app opened and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from aiohttp.web import SockSite

from llmgw.router.listener import Listener, ListenerRunner
from llmgw.router.serving import SHUTDOWN_GRACE

log = logging.getLogger("llmgw.router.worker")

# After it stops accepting, a worker keeps idle keep-alive connections this long, so a client
# that sends on one meanwhile gets its answer (with `Connection: close`) instead of a reset.
IDLE_LINGER = 1.0
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s"


@dataclass(frozen=True)
class WorkerArgs:
    slot: int
    listen_fds: tuple[int, ...]
    ready_fd: int | None
    lifeline_fd: int | None
    control: str
    credential_file: Path | None  # None: LLMGW_ROUTER_CREDENTIAL
    state_dir: Path
    ca: Path | None


Closer = Callable[[], Awaitable[None]]
# Resolves once the app holds what it routes with (the router: its first snapshot).
Fed = Callable[[], Awaitable[None]]
# What a worker serves: a listener built from its arguments, what to close after it stopped, and
# what to wait for before it says `ready` (None: it is ready once it accepts).
AppBuilder = Callable[[WorkerArgs], Awaitable[tuple[Listener, Closer, Fed | None]]]


def parse_args(argv: list[str]) -> WorkerArgs:
    parser = argparse.ArgumentParser(prog="llmgw.router.worker", description="One router worker (R-10.3).")
    parser.add_argument("--slot", type=int, required=True)
    parser.add_argument("--listen-fd", type=int, action="append", required=True)
    parser.add_argument("--ready-fd", type=int)
    parser.add_argument("--lifeline-fd", type=int)
    parser.add_argument("--control", required=True)
    parser.add_argument("--credential-file", type=Path)
    parser.add_argument("--state-dir", type=Path, required=True)
    parser.add_argument("--ca", type=Path)
    ns = parser.parse_args(argv)
    return WorkerArgs(ns.slot, tuple(ns.listen_fd), ns.ready_fd, ns.lifeline_fd, ns.control, ns.credential_file,
                      ns.state_dir, ns.ca)


class Readiness:
    """The lines a worker owes its supervisor: `listening` (not final), then `ready` or `error: WHY`,
    after which the pipe is closed."""

    def __init__(self, fd: int | None):
        self._fd = fd

    def say(self, line: str, final: bool = True) -> None:
        if self._fd is None:
            return
        try:
            os.write(self._fd, (line.replace("\n", " ") + "\n").encode())
        except OSError:  # the supervisor stopped waiting: nothing to tell
            final = True
        if final:
            os.close(self._fd)
            self._fd = None


async def run_worker(args: WorkerArgs, build: AppBuilder) -> int:
    """Serve `build(args)`'s listener on the inherited sockets until SIGTERM/SIGINT or the lifeline's end."""
    loop = asyncio.get_running_loop()
    ready = Readiness(args.ready_fd)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if args.lifeline_fd is not None:
        _watch_lifeline(loop, args.lifeline_fd, stop)
    building = asyncio.ensure_future(build(args))
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait([building, stopping], return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if not building.done():  # stopped while it builds the app (reads its state)
        building.cancel()
        await asyncio.gather(building, return_exceptions=True)
        log.info("worker %d stopped before it served", args.slot)
        return 0
    try:
        listener, close, fed = building.result()
    except Exception as exc:  # told to the supervisor, which logs it and retries with backoff
        log.error("worker %d cannot start: %s", args.slot, exc, exc_info=log.isEnabledFor(logging.DEBUG))
        ready.say(f"error: {exc}")
        return 1
    runner = listener.runner(SHUTDOWN_GRACE)  # its stop gives the requests in flight SHUTDOWN_GRACE
    try:
        await runner.setup()
        for fd in args.listen_fds:
            sock = socket.socket(fileno=fd)
            sock.setblocking(False)
            await SockSite(runner, sock).start()
    except Exception as exc:
        log.exception("worker %d cannot serve", args.slot)
        ready.say(f"error: {exc}")
        await runner.cleanup()
        await close()
        return 1
    feeding = None
    if fed is None:
        ready.say("ready")
        log.info("worker %d serving", args.slot)
    else:
        ready.say("listening", final=False)
        log.info("worker %d listening; it answers 503 until it holds a snapshot", args.slot)
        feeding = asyncio.ensure_future(_say_ready_when(fed, ready, args.slot))
    await stop.wait()
    if feeding is not None:
        feeding.cancel()
        await asyncio.gather(feeding, return_exceptions=True)
    listener.draining = True  # each answer closes its connection: the client's next goes to a worker that stays
    log.info("worker %d stopping: no new connections; requests in flight get up to %.0fs", args.slot,
             SHUTDOWN_GRACE)
    for site in list(runner.sites):
        await site.stop()  # closes this process's copy only: the supervisor's stays open
    await _linger(runner)
    await runner.cleanup()
    await close()
    log.info("worker %d stopped", args.slot)
    return 0


async def _say_ready_when(fed: Fed, ready: Readiness, slot: int) -> None:
    await fed()
    ready.say("ready")
    log.info("worker %d serving", slot)


def _watch_lifeline(loop: asyncio.AbstractEventLoop, fd: int, stop: asyncio.Event) -> None:
    os.set_blocking(fd, False)

    def readable() -> None:
        try:
            data = os.read(fd, 64)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:  # only the supervisor holds the write end: it is gone
            loop.remove_reader(fd)
            if not stop.is_set():
                log.warning("the router supervisor is gone: this worker stops")
                stop.set()

    loop.add_reader(fd, readable)


async def _linger(runner: ListenerRunner) -> None:
    server = runner.server
    loop = asyncio.get_running_loop()
    deadline = loop.time() + IDLE_LINGER
    while server is not None and server.connections and loop.time() < deadline:
        await asyncio.sleep(0.05)


def main(build: AppBuilder, argv: list[str] | None = None) -> None:
    logging.basicConfig(level=os.environ.get("LLMGW_LOG_LEVEL", "INFO").upper(), format=LOG_FORMAT)
    args = parse_args(sys.argv[1:] if argv is None else argv)
    sys.exit(asyncio.run(run_worker(args, build)))


async def build_router(args: WorkerArgs) -> tuple[Listener, Closer, Fed | None]:
    """The router fed over the feed, with the last-known-good snapshot from disk when there is one;
    without, it is served all the same and says `ready` once the control plane's first comes (R-10.2)."""
    from llmgw.router.app import Router
    from llmgw.router import credential
    from llmgw.router.feedclient import FeedClient

    router = Router()
    client = FeedClient(router.feed, args.control, credential.source(args.credential_file), args.state_dir,
                        ca=str(args.ca) if args.ca else None)
    await client.start()

    async def fed() -> None:
        while router.snapshot is None:
            await asyncio.sleep(0.05)

    async def close() -> None:
        await client.close()  # its final report: what the requests just finished counted
        await router.close()

    return router.listener, close, None if router.snapshot is not None else fed


if __name__ == "__main__":
    main(build_router)
