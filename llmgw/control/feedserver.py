"""The router feed over HTTP (R-10.1): the control plane's side of the socket.

Two handlers, mounted on the admin listener (TCP, TLS when `gateway.admin_tls` is set) and on the
state directory's `feed.sock` (0600, for routers on this host):

- `GET /v1/feed`: a stream of newline-delimited JSON, one `to_wire(message)` per line: first a
  `Snapshot`, then each `Change` in order, a `Snapshot` again when this router fell behind. A
  blank line every `keepalive` seconds lets both sides notice a peer that is gone (a write to a
  closed connection fails here; the router's read times out there).
- `POST /v1/feed/report`: one `Report`; the answer is the publisher's `Ack`. A row of it that
  does not parse (a negative count, one above `MAX_COUNT`, a wrong type) is left out and named in
  the Ack's `refused`, the rest applied; only a report wrong as a whole (not JSON, not a report,
  its router, seq or sent_at, a part of the wrong shape) is a 400, which the router sets aside
  rather than sending it again (R-10.8).

Both require the admin token as `Authorization: Bearer`, compared in constant time. Whole wire
documents are never logged: they hold engine keys and key hashes.
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import json
import logging
import os
from collections import OrderedDict
from functools import partial
from pathlib import Path
from typing import Any, Protocol

from aiohttp import web

from llmgw.contracts.feed import Ack, FeedError, Refusal, Report, read_report, to_wire

log = logging.getLogger(__name__)

FEED_PATH = "/v1/feed"
REPORT_PATH = "/v1/feed/report"
FEED_SOCKET = "feed.sock"
KEEPALIVE = 5.0  # seconds between blank lines on a quiet feed
MAX_REPORT = 8 * 1024 * 1024  # bytes of one report's body
SHUTDOWN_GRACE = 5.0
_ENCODED_KEPT = 32  # messages whose encoded line is kept, so N routers cost one encoding each

_dumps = partial(json.dumps, separators=(",", ":"))


class Publisher(Protocol):
    """What the server needs of the control plane's feed publisher (llmgw.control.feed)."""

    async def ready(self) -> None: ...
    def listen(self) -> Any: ...
    async def apply_report(self, report: Report, refused: tuple[Refusal, ...] = ()) -> Ack: ...
    def report_refused(self, router: str | None, reason: str) -> None: ...


def _error(status: int, message: str, code: str, headers: dict | None = None) -> web.Response:
    return web.json_response({"error": {"message": message, "code": code, "problems": []}}, status=status,
                             headers=headers, dumps=_dumps)


class FeedServer:
    """The feed's handlers for one publisher; `mount` them on any aiohttp application."""

    def __init__(self, publisher: Publisher, token: str, *, keepalive: float = KEEPALIVE,
                 max_report: int = MAX_REPORT):
        self.publisher = publisher
        self._token = token.encode()
        self.keepalive = keepalive
        self.max_report = max_report
        self._streams: set[asyncio.Task] = set()
        self._encoded: OrderedDict[int, tuple[object, bytes]] = OrderedDict()

    def __repr__(self) -> str:  # the token stays out of tracebacks
        return f"FeedServer({len(self._streams)} streams)"

    def mount(self, app: web.Application) -> None:
        """Add the two routes to `app`, and end the feed streams when it shuts down."""
        app.add_routes([web.get(FEED_PATH, self.feed), web.post(REPORT_PATH, self.report)])
        app.on_shutdown.append(self._end_streams)

    def app(self) -> web.Application:
        """An application holding only the feed, for the Unix socket."""
        app = web.Application(client_max_size=self.max_report)
        self.mount(app)
        return app

    @property
    def streams(self) -> int:
        """Routers connected to the feed now."""
        return len(self._streams)

    def _refused(self, request: web.Request) -> web.Response | None:
        scheme, _, value = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), self._token):
            return None
        return _error(401, "missing or wrong admin token: the router feed needs 'Authorization: Bearer <token>' "
                           "with the token from the admin-token file of the control plane's state directory",
                      "unauthorized", headers={"WWW-Authenticate": "Bearer"})

    def _line(self, message: object) -> bytes:
        """The wire line of `message`; every listener gets the same objects, so encode each once."""
        kept = self._encoded.get(id(message))
        if kept is not None and kept[0] is message:
            return kept[1]
        line = _dumps(to_wire(message)).encode() + b"\n"
        self._encoded[id(message)] = (message, line)
        while len(self._encoded) > _ENCODED_KEPT:
            self._encoded.popitem(last=False)
        return line

    async def feed(self, request: web.Request) -> web.StreamResponse:
        refused = self._refused(request)
        if refused is not None:
            return refused
        task = asyncio.current_task()
        self._streams.add(task)
        try:
            await self.publisher.ready()
        except asyncio.CancelledError:
            self._streams.discard(task)
            return web.Response(status=503)
        listener = self.publisher.listen()
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson", "Cache-Control": "no-store"})
        peer = request.remote or "unix socket"
        log.info("router feed: %s connected (%d connected)", peer, len(self._streams))
        pending: asyncio.Future | None = None
        try:
            await response.prepare(request)
            while True:
                if pending is None:
                    pending = asyncio.ensure_future(anext(listener))
                done, _ = await asyncio.wait({pending}, timeout=self.keepalive)
                if not done:
                    await response.write(b"\n")  # fails once the router is gone
                    continue
                try:
                    message = pending.result()
                except StopAsyncIteration:
                    break
                pending = None
                await response.write(self._line(message))
        except (asyncio.CancelledError, ConnectionError):
            pass  # the router left, or this listener is shutting down: end the stream quietly
        finally:
            self._streams.discard(task)
            if pending is not None and not pending.done():
                pending.cancel()
                await asyncio.gather(pending, return_exceptions=True)
            closed = listener.close()
            if inspect.isawaitable(closed):
                await closed
            log.info("router feed: %s disconnected (%d connected)", peer, len(self._streams))
        return response

    async def report(self, request: web.Request) -> web.Response:
        refused = self._refused(request)
        if refused is not None:
            return refused
        too_big = _error(413, f"a report is at most {self.max_report} bytes", "too_large")
        if request.content_length is not None and request.content_length > self.max_report:
            return too_big
        body = bytearray()
        async for chunk in request.content.iter_any():
            body += chunk
            if len(body) > self.max_report:
                return too_big
        try:
            document = json.loads(body)
        except ValueError as exc:
            return self._bad_report(None, f"the report is not JSON: {exc}")
        try:
            report, refused = read_report(document)
        except FeedError as exc:
            router = document.get("router") if isinstance(document, dict) else None
            return self._bad_report(router if isinstance(router, str) else None, str(exc))
        if refused:
            log.warning("router feed: report %d of router %s: %d row(s) left out, the rest applied: %s",
                        report.seq, report.router, len(refused),
                        "; ".join(r.message for r in refused[:5]) + ("; ..." if len(refused) > 5 else ""))
        await self.publisher.ready()
        ack = await self.publisher.apply_report(report, refused)
        return web.json_response(to_wire(ack), dumps=_dumps)

    def _bad_report(self, router: str | None, reason: str) -> web.Response:
        """A report refused as a whole: said in the log and to the publisher, a 400 to the router."""
        log.warning("router feed: a report of router %s refused: %s", router or "(unnamed)", reason)
        self.publisher.report_refused(router, reason)
        return _error(400, reason, "bad_report")

    async def _end_streams(self, app: web.Application) -> None:
        """A feed never ends by itself: end the streams so that shutdown does not wait for them."""
        for task in list(self._streams):
            task.cancel()


class FeedSocket:
    """The feed on a Unix socket of the state directory: routers on this host connect here."""

    def __init__(self, runner: web.AppRunner, path: Path, inode: int):
        self.runner = runner
        self.path = path
        self._inode = inode

    async def close(self) -> None:
        await self.runner.cleanup()
        try:  # only the socket this run made: a newer one belongs to another run
            if os.lstat(self.path).st_ino == self._inode:
                os.unlink(self.path)
        except FileNotFoundError:
            pass


async def listen_unix(server: FeedServer, path: Path, *, shutdown_timeout: float = SHUTDOWN_GRACE) -> FeedSocket:
    """Serve the feed on the Unix socket `path` (0600), replacing one a previous run left behind.

    The state directory is 0700 and the socket 0600: only its owner reaches it. The token is
    still required, as on the admin listener. OSError when the socket cannot be made."""
    runner = web.AppRunner(server.app(), access_log=None, shutdown_timeout=shutdown_timeout)
    await runner.setup()
    try:
        await web.UnixSite(runner, str(path)).start()
        os.chmod(path, 0o600)
        inode = os.lstat(path).st_ino
    except BaseException:
        await runner.cleanup()
        raise
    log.info("router feed listening on %s", path)
    return FeedSocket(runner, path, inode)

