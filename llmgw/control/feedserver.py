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

Both take router credentials only, never the admin token (R-10.7), through the exchange of
llmgw.contracts.routerauth: `POST /v1/feed/challenge` first, then the request with the router's
proof; the answer carries the control plane's. A router's streams end when its credential is
revoked or the grace of the one it used runs out, and a report is refused unless its router id is
under the credential's name. Whole wire documents are never logged: they hold engine keys and key
hashes.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import os
import secrets
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Protocol

from aiohttp import web

from llmgw.contracts import routerauth
from llmgw.contracts.feed import Ack, FeedError, Refusal, Report, read_report, to_wire

log = logging.getLogger(__name__)

FEED_PATH = "/v1/feed"
REPORT_PATH = "/v1/feed/report"
CHALLENGE_PATH = routerauth.CHALLENGE_PATH
FEED_SOCKET = "feed.sock"
KEEPALIVE = 5.0  # seconds between blank lines on a quiet feed
MAX_REPORT = 8 * 1024 * 1024  # bytes of one report's body
SHUTDOWN_GRACE = 5.0
_ENCODED_KEPT = 32  # messages whose encoded line is kept, so N routers cost one encoding each
CHALLENGE_TTL = 30.0  # seconds a challenge may wait for the request it is for
MAX_CHALLENGES = 4096  # challenges outstanding; asking needs no credential, so the oldest go first
MAX_NONCE = 128  # characters of a router's nonce

_dumps = partial(json.dumps, separators=(",", ":"))


class Publisher(Protocol):
    """What the server needs of the control plane's feed publisher (llmgw.control.feed)."""

    async def ready(self) -> None: ...
    def listen(self) -> Any: ...
    async def apply_report(self, report: Report, refused: tuple[Refusal, ...] = ()) -> Ack: ...
    def report_refused(self, router: str | None, reason: str) -> None: ...


class Credentials(Protocol):
    """The router credentials the feed accepts (llmgw.routers.Verifiers)."""

    def accepted(self, name: str) -> Sequence[bytes]: ...


@dataclass(frozen=True)
class _Challenge:
    name: str
    nonce: str
    expires: float  # time.monotonic()


@dataclass(frozen=True)
class _Caller:
    """A router that proved its credential for this one request."""

    name: str
    key: bytes
    proof: str  # for the answer's X-Llmgw-Proof


def _error(status: int, message: str, code: str, headers: dict | None = None) -> web.Response:
    return web.json_response({"error": {"message": message, "code": code, "problems": []}}, status=status,
                             headers=headers, dumps=_dumps)


def _unauthorized(message: str) -> web.Response:
    return _error(401, message, "unauthorized", headers={"WWW-Authenticate": routerauth.SCHEME})


class FeedServer:
    """The feed's handlers for one publisher; `mount` them on any aiohttp application."""

    def __init__(self, publisher: Publisher, credentials: Credentials, *, keepalive: float = KEEPALIVE,
                 max_report: int = MAX_REPORT):
        self.publisher = publisher
        self.credentials = credentials
        self.keepalive = keepalive
        self.max_report = max_report
        self._streams: dict[asyncio.Task, _Caller] = {}
        self._challenges: OrderedDict[str, _Challenge] = OrderedDict()
        self._encoded: OrderedDict[int, tuple[object, bytes]] = OrderedDict()

    def __repr__(self) -> str:  # verifiers stay out of tracebacks
        return f"FeedServer({len(self._streams)} streams)"

    def mount(self, app: web.Application) -> None:
        """Add the three routes to `app`, and end the feed streams when it shuts down."""
        app.add_routes([web.post(CHALLENGE_PATH, self.challenge), web.get(FEED_PATH, self.feed),
                        web.post(REPORT_PATH, self.report)])
        app.on_shutdown.append(self._end_streams)

    def app(self) -> web.Application:
        """An application holding only the feed, for the Unix socket."""
        app = web.Application(client_max_size=self.max_report)
        self.mount(app)
        return app

    paths = frozenset({CHALLENGE_PATH, FEED_PATH, REPORT_PATH})  # they check router credentials themselves

    @property
    def streams(self) -> int:
        """Routers connected to the feed now."""
        return len(self._streams)

    def recheck(self) -> None:
        """End the streams of routers whose credential is no longer accepted (revoked, rotated)."""
        for task, caller in list(self._streams.items()):
            if not self._still_accepted(caller):
                task.cancel()

    def _still_accepted(self, caller: _Caller) -> bool:
        return caller.key in self.credentials.accepted(caller.name)

    async def challenge(self, request: web.Request) -> web.Response:
        """Step 1 of the exchange: a single-use challenge, and proofs that this side knows the verifier."""
        try:
            document = await request.json()
            name, nonce = document["router"], document["nonce"]
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            return _error(400, 'send {"router": NAME, "nonce": TEXT} as JSON', "bad_challenge")
        if not isinstance(name, str) or not isinstance(nonce, str) or not 16 <= len(nonce) <= MAX_NONCE:
            return _error(400, f"router must be a name and nonce 16 to {MAX_NONCE} characters", "bad_challenge")
        keys = self.credentials.accepted(name) if routerauth.valid_name(name) else ()
        if not keys:
            return _unauthorized(f"no router credential named {name!r} is in force (never added, or revoked); "
                                 f"make one with `llmgw ctl routers add {name}` on the control plane")
        now = time.monotonic()
        while self._challenges and (len(self._challenges) >= MAX_CHALLENGES
                                    or next(iter(self._challenges.values())).expires < now):
            self._challenges.popitem(last=False)
        challenge = secrets.token_urlsafe(24)
        self._challenges[challenge] = _Challenge(name, nonce, now + CHALLENGE_TTL)
        proofs = [routerauth.server_proof(key, name, nonce, challenge) for key in keys]
        return web.json_response({"challenge": challenge, "proofs": proofs}, dumps=_dumps)

    def _authenticate(self, request: web.Request) -> _Caller | web.Response:
        header = request.headers.get("Authorization", "")
        if header.partition(" ")[0].lower() == "bearer":
            return _unauthorized("the router feed takes a router credential, not the admin token: make one "
                                 "with `llmgw ctl routers add NAME` and give it to the router with "
                                 "--credential-file")
        parsed = routerauth.parse_authorization(header)
        if parsed is None:
            return _unauthorized(f"the router feed needs 'Authorization: {routerauth.SCHEME} NAME:CHALLENGE:PROOF' "
                                 f"after POST {CHALLENGE_PATH}; `llmgw router` does this with its credential")
        name, challenge, proof = parsed
        issued = self._challenges.pop(challenge, None)  # single use, whatever the outcome
        if issued is None or issued.name != name or issued.expires < time.monotonic():
            return _unauthorized("unknown, used or expired challenge: ask for a new one")
        for key in self.credentials.accepted(name):
            expected = routerauth.router_proof(key, name, issued.nonce, challenge, request.method, request.path)
            if routerauth.same(proof, expected):
                return _Caller(name, key, routerauth.answer_proof(key, name, issued.nonce, challenge))
        return _unauthorized(f"wrong proof for router {name!r}: its credential is not the one in force "
                             "(revoked, or rotated and past its grace)")

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
        caller = self._authenticate(request)
        if isinstance(caller, web.Response):
            return caller
        task = asyncio.current_task()
        self._streams[task] = caller
        try:
            await self.publisher.ready()
        except asyncio.CancelledError:
            self._streams.pop(task, None)
            return web.Response(status=503)
        listener = self.publisher.listen()
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson", "Cache-Control": "no-store",
                                               routerauth.PROOF_HEADER: caller.proof})
        peer = f"router {caller.name} ({request.remote or 'unix socket'})"
        log.info("router feed: %s connected (%d connected)", peer, len(self._streams))
        pending: asyncio.Future | None = None
        try:
            await response.prepare(request)
            while True:
                if pending is None:
                    pending = asyncio.ensure_future(anext(listener))
                done, _ = await asyncio.wait({pending}, timeout=self.keepalive)
                if not self._still_accepted(caller):  # a rotation's grace ran out
                    log.info("router feed: %s: its credential is no longer accepted; stream ended", peer)
                    break
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
            self._streams.pop(task, None)
            if pending is not None and not pending.done():
                pending.cancel()
                await asyncio.gather(pending, return_exceptions=True)
            closed = listener.close()
            if inspect.isawaitable(closed):
                await closed
            log.info("router feed: %s disconnected (%d connected)", peer, len(self._streams))
        return response

    async def report(self, request: web.Request) -> web.Response:
        caller = self._authenticate(request)
        if isinstance(caller, web.Response):
            return caller
        # Refusals carry the control plane's proof too: a router sets aside only a report that the
        # control plane itself refused, never one a squatter answered 400.
        proven = {routerauth.PROOF_HEADER: caller.proof}
        too_big = _error(413, f"a report is at most {self.max_report} bytes", "too_large", proven)
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
            return self._bad_report(caller.name, f"the report is not JSON: {exc}", proven)
        try:
            report, refused = read_report(document)
        except FeedError as exc:
            router = document.get("router") if isinstance(document, dict) else None
            if not isinstance(router, str) or routerauth.router_of(router) != caller.name:
                router = caller.name  # the refusal is the caller's, whatever the report claims
            return self._bad_report(router, str(exc), proven)
        if routerauth.router_of(report.router) != caller.name:
            # Router ids are NAME/...: a router cannot write usage or seqs under another's ids.
            return _error(403, f"report.router {report.router!r} is not one of router {caller.name!r}'s ids "
                               f"({caller.name}/...)", "wrong_router")
        if refused:
            log.warning("router feed: report %d of router %s: %d row(s) left out, the rest applied: %s",
                        report.seq, report.router, len(refused),
                        "; ".join(r.message for r in refused[:5]) + ("; ..." if len(refused) > 5 else ""))
        await self.publisher.ready()
        ack = await self.publisher.apply_report(report, refused)
        return web.json_response(to_wire(ack), dumps=_dumps, headers={routerauth.PROOF_HEADER: caller.proof})

    def _bad_report(self, router: str, reason: str, headers: dict) -> web.Response:
        """A report refused as a whole: said in the log and to the publisher, a 400 to the router."""
        log.warning("router feed: a report of router %s refused: %s", router, reason)
        self.publisher.report_refused(router, reason)
        return _error(400, reason, "bad_report", headers)

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

    The state directory is 0700 and the socket 0600: only its owner reaches it. A router
    credential is still required, as on the admin listener. OSError when the socket cannot be made."""
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

