"""The router's side of the feed (R-10.1, R-10.2): fed by a control plane over a socket.

`FeedClient` reads the control plane's feed into a `Router` and sends the router's reports back.
Its disk state is the state directory's (llmgw.router.statedir: the last-known-good snapshot, the
rule for trusting what is kept there) and its slot's (llmgw.router.spool: the router id and the
report spool). At start the snapshot on disk is given to the router before anything is connected,
so a router whose control plane is away serves with what it was last told; the file is written
again at most once a second after a change, and on close.

Reports: each is spooled (fsynced) before it is sent and dropped when the control plane
acknowledges its seq. A report never handed to the network (the control plane unreachable, the
connection refused) is merged with the next period's. A report refused as a whole is set aside in
`refused/` (logged, counted in the feed status) and the next one goes on, so that one bad report
never holds back those after it; rows the control plane left out of a report it took are named in
its ack, logged and counted. A Snapshot or Change the router cannot apply (a gap, a field that does
not parse, a fault of the router) is named in every report after it, with why (`Report.unapplied`,
R-10.10), and the whole snapshot is asked for again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import ssl
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from llmgw.contracts import routerauth
from llmgw.contracts.addresses import is_loopback
from llmgw.contracts.backoff import backoff_delay
from llmgw.contracts.feed import Ack, Change, FeedError, Report, Snapshot, Unapplied, from_wire
from llmgw.router.spool import (SLOTS_DIR, SPOOL_FILE, Slot, Spool, Spooled, count_refused, set_aside,
                                take_slot)
from llmgw.router.statedir import (SNAPSHOT_FILE, FeedClientError, load_snapshot_file, private_dir,
                                   write_snapshot_file)
from llmgw.router.feedstate import FedRouter

log = logging.getLogger(__name__)

FEED_PATH = "/v1/feed"
REPORT_PATH = "/v1/feed/report"
CHALLENGE_PATH = routerauth.CHALLENGE_PATH
# A report answered with one of these is wrong in itself: sending it again cannot succeed.
SET_ASIDE_STATUSES = frozenset({400, 413})

REPORT_INTERVAL = 0.5  # seconds between reports
SNAPSHOT_EVERY = 1.0  # at most one snapshot file written per this many seconds
READ_TIMEOUT = 20.0  # a feed silent this long (the server sends a blank line every 5 s) is dead
CONNECT_TIMEOUT = 5.0
POST_TIMEOUT = 10.0
CLOSE_WAIT = 3.0  # seconds close() waits for its final report to be acknowledged
SWEEP_EVERY = 10.0  # seconds between looks for slots nobody holds
BACKOFF_BASE = 0.2
BACKOFF_CAP = 5.0
MAX_LINE = 512 * 1024 * 1024  # bytes of one feed line (a snapshot of a very large fleet)


@dataclass(frozen=True, slots=True)
class FeedTiming:
    """How often the client reports, writes its snapshot file and sweeps, and how it waits: the
    defaults are the router's; tests make them short."""

    report_interval: float = REPORT_INTERVAL  # seconds between reports
    snapshot_every: float = SNAPSHOT_EVERY  # at most one snapshot file written per this many seconds
    read_timeout: float = READ_TIMEOUT  # a feed silent this long is dead
    backoff_base: float = BACKOFF_BASE  # reconnects and report retries back off from here
    backoff_cap: float = BACKOFF_CAP  # to at most this
    sweep_every: float = SWEEP_EVERY  # seconds between looks for slots nobody holds


DEFAULT_TIMING = FeedTiming()


# -- where the control plane is ----------------------------------------------------------------


@dataclass(frozen=True)
class Control:
    """A parsed --control address: the base URL of the requests, and the Unix socket when local."""

    address: str
    base_url: str
    socket_path: str | None = None
    tls: bool = False


def parse_control(control: str) -> Control:
    """`unix:/path/feed.sock`, `https://HOST:PORT`, or `http://HOST:PORT` on loopback only."""
    if control.startswith("unix:"):
        path = control[len("unix:"):]
        if path.startswith("//"):
            path = path[2:]
        if not path:
            raise FeedClientError(f"{control!r}: write unix:/path/to/feed.sock")
        return Control(control, "http://localhost", socket_path=path)
    parsed = urllib.parse.urlsplit(control)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise FeedClientError(f"{control!r}: the control plane is unix:/path/feed.sock, https://HOST:PORT or "
                              "http://127.0.0.1:PORT")
    if parsed.path not in ("", "/") or parsed.query:
        raise FeedClientError(f"{control!r}: give the admin listener's address only (scheme, host, port)")
    if parsed.scheme == "http" and not is_loopback(parsed.hostname):
        raise FeedClientError(f"{control!r}: plain http is refused off this host, because the "
                              "engine keys of the feed would cross the network in clear; give the control plane's "
                              "admin listener a certificate (gateway.admin_tls) and use https://, with --ca FILE if "
                              "it is not signed by a public authority")
    return Control(control, f"{parsed.scheme}://{parsed.netloc}", tls=parsed.scheme == "https")


# -- the client --------------------------------------------------------------------------------


class FeedClient:
    """Feeds `router` from the control plane at `control` and reports back; see the module's docstring."""

    def __init__(self, router: FedRouter, control: str, credential: str | Callable[[], str], state_dir: Path, *,
                 ca: str | None = None, timing: FeedTiming = DEFAULT_TIMING):
        self.router = router
        self.control = parse_control(control)
        # The router's credential, read again for every exchange: a rotation replaces the file.
        self._credential: Callable[[], str] = (lambda: credential) if isinstance(credential, str) else credential
        self.state_dir = Path(state_dir)
        self.timing = timing
        self._ssl: ssl.SSLContext | bool = True
        if self.control.tls:
            try:
                self._ssl = ssl.create_default_context(cafile=os.path.expanduser(ca) if ca else None)
            except (OSError, ssl.SSLError) as exc:
                raise FeedClientError(f"cannot use --ca {ca}: {getattr(exc, 'strerror', None) or exc}") from None
        self.slot: Slot | None = None
        self._session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task] = []
        self._wake = asyncio.Event()
        self._snapshot_changed = asyncio.Event()
        self._live = False
        self._down_since: float | None = time.time()
        self._live_at: float | None = None  # when the feed last confirmed the router's snapshot
        # Why there is no feed, in words for /healthz: no address, no host, no upstream message.
        self._problem = "waiting for the control plane's first snapshot"
        self._warned = False
        self._post_attempt = 0
        self._post_after = 0.0
        self._swept_at = 0.0
        self._refused_slots: set[str] = set()  # slots another user could have written: said once
        self._closing = False
        self._set_aside = 0  # reports in refused/ (counted at start, then as they are set aside)
        self._rows_refused = 0  # rows the control plane left out of reports it took, since start
        self._last_refusal: dict | None = None
        # The last Snapshot or Change the router could not apply: every report says it.
        self._unapplied: Unapplied | None = None

    def __repr__(self) -> str:  # the credential stays out of tracebacks
        return f"FeedClient({self.control.address})"

    @property
    def router_id(self) -> str | None:
        return None if self.slot is None else self.slot.router_id

    @property
    def unacked(self) -> int:
        return 0 if self.slot is None else len(self.slot.spool.pending)

    # -- start and stop ------------------------------------------------------------------------

    async def start(self) -> None:
        """Take a slot, give the router the last-known-good snapshot, then run the feed and reports."""
        private_dir(self.state_dir)
        name = routerauth.credential_name(await asyncio.to_thread(self._credential))
        self.slot = await asyncio.to_thread(take_slot, self.state_dir, name)
        self.router.router_id = self.slot.router_id
        await asyncio.to_thread(self.slot.spool.load)
        self._set_aside = await asyncio.to_thread(count_refused, self.state_dir)
        path = self.state_dir / SNAPSHOT_FILE
        snapshot = await asyncio.to_thread(load_snapshot_file, path)
        if snapshot is not None:
            self.router.apply(snapshot)
            with contextlib.suppress(OSError):
                self._live_at = path.stat().st_mtime
            log.info("serving with the last-known-good snapshot %s/%d from %s until the control plane at %s "
                     "answers", snapshot.epoch, snapshot.version, path, self.control.address)
        self._update_status()
        self.router.snapshot_age = self._snapshot_age
        self.router.on_demand = self._wake.set
        self._swept_at = time.monotonic()  # a slot freed just now is likely a restarted worker's: not at once
        if self.control.socket_path is not None:
            connector = aiohttp.UnixConnector(path=self.control.socket_path)
        else:
            connector = aiohttp.TCPConnector(limit=4, ssl=self._ssl)
        self._session = aiohttp.ClientSession(connector=connector)
        self._tasks = [asyncio.create_task(self._feed_loop(), name="feed"),
                       asyncio.create_task(self._report_loop(), name="feed reports"),
                       asyncio.create_task(self._snapshot_loop(), name="feed snapshot file")]

    async def close(self) -> None:
        """Stop; send a final report (waiting at most CLOSE_WAIT), keep what is unacknowledged on disk."""
        self._closing = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self.router.on_demand == self._wake.set:
            self.router.on_demand = None
        if self.slot is not None:
            try:
                await self._spool_report()
                self._post_after = 0.0
                delivered = await asyncio.wait_for(self._deliver(self.slot.spool), CLOSE_WAIT)
            except (TimeoutError, OSError, aiohttp.ClientError):
                delivered = False
            if not delivered:
                log.info("final report not acknowledged; %d report(s) stay in %s for the next start",
                         self.unacked, self.slot.spool.path)
            if self._snapshot_changed.is_set():
                with contextlib.suppress(OSError):
                    await self._write_snapshot()
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self.slot is not None:
            self.slot.release()
            self.slot = None

    # -- the feed ------------------------------------------------------------------------------

    async def _feed_loop(self) -> None:
        attempt = 0
        while not self._closing:
            quiet = False
            try:
                await self._follow()
                reason = "the control plane ended the feed"
            except FeedError as exc:
                # A change that does not follow (or a line that does not parse): take the whole
                # snapshot again rather than guess, which a new connection starts with.
                log.warning("feed from %s: %s; reconnecting for a whole snapshot", self.control.address, exc)
                reason, quiet, attempt = str(exc), True, 0
            except _Refused as exc:
                reason = str(exc)
                self._problem = "the control plane refused this router's feed (see the router's log)"
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                reason = _describe(exc)
                self._problem = "the control plane is unreachable"
            except Exception:  # a fault of this side: say it, and keep serving with what the router has
                log.exception("router feed from %s failed; reconnecting", self.control.address)
                reason, quiet = "an error in this router (logged)", True
                self._problem = "an error in this router (see its log)"
            if self._live:
                attempt = 0
            self._lost(reason, quiet)
            await asyncio.sleep(backoff_delay(attempt, self.timing.backoff_base, self.timing.backoff_cap))
            attempt += 1

    # -- proving who is who (R-10.7) ------------------------------------------------------------

    async def _authorize(self, method: str, path: str) -> tuple[dict[str, str], str]:
        """The headers of one request, made only once the other side has proved it knows this
        router's credential, and the proof its answer must carry; see llmgw.contracts.routerauth."""
        try:
            credential = await asyncio.to_thread(self._credential)
            name, key = routerauth.credential_name(credential), routerauth.verifier(credential)
        except ValueError as exc:  # the file went missing or was replaced by something else
            raise _Refused(str(exc)) from None
        nonce = secrets.token_urlsafe(24)
        timeout = aiohttp.ClientTimeout(total=POST_TIMEOUT, sock_connect=CONNECT_TIMEOUT)
        async with self._session.post(self.control.base_url + CHALLENGE_PATH, json={"router": name, "nonce": nonce},
                                      timeout=timeout) as response:
            if response.status != 200:
                raise _Refused(await _refusal(response))
            try:
                document = await response.json(content_type=None)
                challenge, proofs = document["challenge"], document["proofs"]
            except (ValueError, KeyError, TypeError):
                challenge, proofs = None, None
        if not isinstance(challenge, str) or not isinstance(proofs, list):
            raise _Refused(f"{self.control.address} did not answer the challenge as a control plane does")
        expected = routerauth.server_proof(key, name, nonce, challenge)
        if not any(isinstance(p, str) and routerauth.same(p, expected) for p in proofs):
            raise _Refused(f"{self.control.address} did not prove that it knows router {name!r}'s credential: "
                           "it is not this router's control plane, or the credential was replaced there; "
                           "nothing was sent to it")
        proof = routerauth.router_proof(key, name, nonce, challenge, method, path)
        return ({"Authorization": routerauth.authorization(name, challenge, proof)},
                routerauth.answer_proof(key, name, nonce, challenge))

    def _check_answer(self, response: aiohttp.ClientResponse, expected: str) -> None:
        if not routerauth.same(response.headers.get(routerauth.PROOF_HEADER, ""), expected):
            raise _Refused(f"an answer from {self.control.address} without the control plane's proof; ignored")

    async def _follow(self) -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT, sock_read=self.timing.read_timeout)
        headers, answer = await self._authorize("GET", FEED_PATH)
        async with self._session.get(self.control.base_url + FEED_PATH, timeout=timeout,
                                     headers=headers) as response:
            if response.status != 200:
                raise _Refused(await _refusal(response))
            self._check_answer(response, answer)  # before any line is read
            parts: list[bytes] = []  # of a line not yet complete
            size = 0
            async for chunk in response.content.iter_any():
                self._live_at = time.time()  # a keep-alive or a message: the snapshot is current
                if b"\n" not in chunk:
                    parts.append(chunk)
                    size += len(chunk)
                    if size > MAX_LINE:
                        raise FeedError(f"a feed line longer than {MAX_LINE} bytes")
                    continue
                parts.append(chunk)
                *lines, rest = b"".join(parts).split(b"\n")
                parts, size = ([rest], len(rest)) if rest else ([], 0)
                for line in lines:
                    if line.strip():
                        self._apply(line)

    def _apply(self, line: bytes) -> None:
        document = message = None
        try:
            try:
                document = json.loads(line)
            except ValueError as exc:
                raise FeedError(f"a feed line is not JSON ({exc})") from None
            message = from_wire(document)
            if not isinstance(message, (Snapshot, Change)):
                raise FeedError(f"message.type: expected a snapshot or a change, got {document.get('type')!r}")
            self.router.apply(message)
        except Exception as exc:  # the feed loop takes the whole snapshot again; the reports say why
            self._unapplied = Unapplied.of(document if message is None else message, exc, time.time())
            raise
        self._snapshot_changed.set()
        if isinstance(message, Snapshot) and not self._live:
            self._live = True
            self._down_since = None
            if self._warned:
                log.info("router feed from %s is back (snapshot %s/%d)", self.control.address, message.epoch,
                         message.version)
                self._warned = False
            else:
                log.info("router feed from %s: snapshot %s/%d", self.control.address, message.epoch,
                         message.version)
            self._post_after = 0.0  # the control plane is back: deliver what waited at once
            self._wake.set()
        self._update_status()

    def _lost(self, reason: str, quiet: bool = False) -> None:
        if self._live or self._down_since is None:
            self._down_since = time.time()
        self._live = False
        if not self._warned and not quiet:
            self._warned = True
            snapshot = self.router.snapshot
            if snapshot is not None:
                log.warning("control plane at %s unreachable (%s): serving with the last-known-good snapshot "
                            "%s/%d; reports wait on disk", self.control.address, reason, snapshot.epoch,
                            snapshot.version)
            else:
                log.warning("control plane at %s unreachable (%s), and no snapshot yet: nothing to route until "
                            "it answers", self.control.address, reason)
        self._update_status()

    def _update_status(self) -> None:
        snapshot = self.router.snapshot
        now = time.time()
        about = None
        if snapshot is not None:
            about = {"epoch": snapshot.epoch, "version": snapshot.version,
                     "age_s": None if self._live_at is None else round(max(0.0, now - self._live_at), 3)}
        if self._live:
            state = "live"
        elif snapshot is not None:
            state = "last-known-good"
        else:
            state = "no-snapshot"
        # The control plane's address stays out: /healthz may show this to a client (the log and
        # the supervisor's status.json name it).
        self.router.feed_status = {"state": state, "since": None if self._live else self._down_since,
                                   "reason": None if snapshot is not None else self._problem,
                                   "snapshot": about, "unacked_reports": self.unacked,
                                   "router_id": self.router_id,
                                   # what the control plane refused (a whole report, rows of one)
                                   "refused_reports": self._set_aside, "refused_rows": self._rows_refused,
                                   "last_refusal": self._last_refusal}

    def _snapshot_age(self) -> float | None:
        """Seconds since the control plane last confirmed the router's snapshot; None: never."""
        return None if self._live_at is None else max(0.0, time.time() - self._live_at)

    # -- the snapshot file ---------------------------------------------------------------------

    async def _snapshot_loop(self) -> None:
        while not self._closing:
            await self._snapshot_changed.wait()
            try:
                await self._write_snapshot()
            except OSError as exc:
                log.warning("cannot write the last-known-good snapshot in %s: %s", self.state_dir, exc)
            except Exception:
                log.exception("router feed: writing the last-known-good snapshot failed")
            await asyncio.sleep(self.timing.snapshot_every)

    async def _write_snapshot(self) -> None:
        self._snapshot_changed.clear()
        snapshot = self.router.snapshot
        if snapshot is None:
            return
        await asyncio.to_thread(write_snapshot_file, self.state_dir / SNAPSHOT_FILE, snapshot)

    # -- reports -------------------------------------------------------------------------------

    async def _report_loop(self) -> None:
        while not self._closing:
            # Not wait_for: on Python 3.11 it can swallow a cancellation that races the event.
            waiter = asyncio.ensure_future(self._wake.wait())
            try:
                await asyncio.wait({waiter}, timeout=self.timing.report_interval)
            finally:
                waiter.cancel()
            self._wake.clear()
            try:
                await self._spool_report()
            except OSError as exc:  # kept in memory, sent all the same: better than holding it back
                log.warning("cannot write the report spool in %s: %s", self.slot.directory, exc)
            except Exception:
                log.exception("router feed: making a report failed")
            try:
                await self._deliver(self.slot.spool)
                if time.monotonic() - self._swept_at >= self.timing.sweep_every and self._post_attempt == 0:
                    self._swept_at = time.monotonic()
                    await self._sweep()
            except OSError as exc:
                log.warning("report spool in %s: %s", self.slot.directory, exc)
            except Exception:
                log.exception("router feed: delivering reports failed")
            self._update_status()

    async def _spool_report(self) -> None:
        fields = self.router.report_fields()
        if self._unapplied is not None:
            fields = {**fields, "unapplied": self._unapplied}
        await asyncio.to_thread(self.slot.spool.add, fields, time.time())

    async def _deliver(self, spool: Spool) -> bool:
        """Send `spool`'s reports oldest first until one is not acknowledged; True when none is left."""
        if time.monotonic() < self._post_after:
            return False
        while spool.pending:
            entry = spool.pending[0]
            try:
                ack = await self._post(entry)
            except _Refused as exc:
                if exc.status in SET_ASIDE_STATUSES:
                    await self._put_aside(spool, entry.report, str(exc))
                    continue  # the next report goes on
                self._post_failed(f"report {entry.report.seq} refused: {exc}", log.error)
                return False
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                self._post_failed(f"report {entry.report.seq} not acknowledged: {_describe(exc)}", log.debug)
                return False
            if ack.router != spool.router_id or ack.seq < entry.report.seq:
                self._post_failed(f"report {entry.report.seq} answered with ack {ack.router}/{ack.seq}", log.error)
                return False
            self._post_attempt = 0
            if ack.refused:
                self._rows_refused += len(ack.refused)
                self._last_refusal = {"seq": entry.report.seq, "at": time.time(), "rows": len(ack.refused),
                                      "reason": "; ".join(f"{r.message}" for r in ack.refused[:5])}
                log.warning("router feed: the control plane left %d row(s) out of report %d, the rest applied: %s",
                            len(ack.refused), entry.report.seq, self._last_refusal["reason"])
            await asyncio.to_thread(spool.acknowledge, ack.seq)
        return True

    async def _put_aside(self, spool: Spool, report: Report, reason: str) -> None:
        """Keep a report the control plane refused as a whole in refused/ and drop it from the spool."""
        path, at = await asyncio.to_thread(set_aside, self.state_dir, spool, report, reason)
        self._set_aside += 1
        self._last_refusal = {"seq": report.seq, "at": at, "rows": None, "reason": reason}
        log.error("router feed: report %d refused by the control plane (%s); set aside as %s, the next reports go on",
                  report.seq, reason, path)

    def _post_failed(self, message: str, say) -> None:
        (say if self._post_attempt == 0 else log.debug)("router feed: %s", message)  # once per failing spell
        self._post_after = time.monotonic() + backoff_delay(self._post_attempt, self.timing.backoff_base,
                                                            self.timing.backoff_cap)
        self._post_attempt += 1

    async def _post(self, entry: Spooled) -> Ack:
        timeout = aiohttp.ClientTimeout(total=POST_TIMEOUT, sock_connect=CONNECT_TIMEOUT)
        headers, answer = await self._authorize("POST", REPORT_PATH)  # a refusal here sent no report
        # As spooled, made once however often it is sent; a merged report's, off the loop (its
        # request-log records may be thousands).
        body = entry.body if entry.body is not None else await asyncio.to_thread(entry.encoded)
        try:
            # A connection that cannot be made sends nothing: that report may still be merged.
            async with self._session.post(self.control.base_url + REPORT_PATH, data=body, timeout=timeout,
                                          headers={"Content-Type": "application/json", **headers}) as response:
                entry.sent = True
                if response.status != 200:
                    if response.status in SET_ASIDE_STATUSES:
                        # Set aside only what the control plane itself refused (its proof is on the answer).
                        self._check_answer(response, answer)
                        raise _Refused(await _refusal(response), response.status)
                    raise _Refused(await _refusal(response))
                self._check_answer(response, answer)  # an ack nobody proved would drop the report
                document = await response.json(content_type=None)
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError):
            raise
        except BaseException:
            entry.sent = True
            raise
        try:
            ack = from_wire(document)
        except FeedError as exc:
            raise _Refused(f"the answer is not an ack: {exc}") from None
        if not isinstance(ack, Ack):
            raise _Refused(f"the answer is a {type(ack).__name__.lower()}, not an ack")
        return ack

    async def _sweep(self) -> None:
        """Deliver the reports of slots no process holds (a process that was killed)."""
        slots = self.state_dir / SLOTS_DIR
        try:
            names = sorted(p.name for p in slots.iterdir() if p.is_dir() and p != self.slot.directory)
        except FileNotFoundError:
            return
        for name in names:
            if not (slots / name / SPOOL_FILE).exists():
                continue
            try:
                orphan = await asyncio.to_thread(Slot.try_take, slots / name)
            except FeedClientError as exc:  # its reports are not this router's to deliver
                if name not in self._refused_slots:
                    self._refused_slots.add(name)
                    log.warning("%s; its reports are not delivered", exc)
                continue
            if orphan is None:
                continue  # a running process holds it
            try:
                await asyncio.to_thread(orphan.spool.load)
                if orphan.spool.pending:
                    count = len(orphan.spool.pending)
                    if await self._deliver(orphan.spool):
                        log.info("delivered %d report(s) of router %s, whose process is gone", count,
                                 orphan.router_id)
                    else:
                        return  # the control plane is away; the next sweep tries again
            finally:
                orphan.release()


class _Refused(Exception):
    """The control plane answered, but not with what was asked for (a wrong credential, a refusal);
    `status` is the HTTP status it answered with, None when the answer was not what it should be."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


async def _refusal(response: aiohttp.ClientResponse) -> str:
    try:
        document = await response.json(content_type=None)
        message = document["error"]["message"]
    except (ValueError, KeyError, TypeError, aiohttp.ClientError):
        message = response.reason or "no reason given"
    return f"{response.status}: {message}"


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    return str(exc) or type(exc).__name__

