"""The router's side of the feed (R-10.1, R-10.2): fed by a control plane over a socket, with disk state.

`FeedClient` reads the control plane's feed into a `Router` and sends the router's reports back.
What it keeps on disk, in its state directory (0700; files 0600, written atomically):

- `snapshot.json`: the router's latest snapshot (`to_wire`), written at most once a second after
  a change and on close. At start it is given to the router before anything is connected, so a
  router whose control plane is away serves with what it was last told (last-known-good). A file
  that does not parse is set aside as `snapshot.json.bad` and not used.
- `slots/N/`: one per running router process, taken by an exclusive flock on `slots/N/lock`
  (the first free N) and held while it runs. A slot holds the router id (`router-id`; a new one
  when the spool is gone, as the spool is what remembers the id's seqs) and the report spool
  (`spool.ndjson`). A worker restarted while its predecessor still finishes streams
  finds the predecessor's slot locked and takes another: two processes never share a spool.
  Slots nobody holds (a killed process's) are swept: their unacknowledged reports are delivered.
- `refused/ROUTER-SEQ.json` (the router id's `/` as `_`): a report the control plane refused as a
  whole (400 or 413: sending it again cannot succeed), kept with the refusal's reason for whoever looks into it (R-10.8).

Every directory and file here is used only when it is this user's and nobody else may write it
(`private.untrusted`, R-10.9): a planted snapshot would route clients, a planted spool would
count usage. A state directory or slot that is not is refused (the worker does not start, saying
why); a snapshot file that is not is left unused, with the reason in the log.

Reports: each is appended to the spool and fsynced before it is sent, and dropped from it when the
control plane acknowledges its seq; the control plane counts a (router, seq) once, so resending
after a restart of either side counts nothing twice. The spool stays small: a report that was
never handed to the network (the control plane unreachable, the connection refused) is not sent
by then, so the next period's report is merged into it, keeping its seq. Only a report that may
have reached the control plane keeps its own seq and content until it is acknowledged. A report
refused as a whole is set aside in `refused/` (logged, counted in the feed status) and the next
one goes on, so that one bad report never holds back those after it; rows the control plane left
out of a report it took are named in its ack, logged and counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import secrets
import socket
import ssl
import time
import urllib.parse
from dataclasses import dataclass, replace
from functools import partial
from collections.abc import Callable
from pathlib import Path

import aiohttp

from llmgw.contracts.errors import Category, LlmgwError
from llmgw.contracts import routerauth
from llmgw.contracts.addresses import is_loopback
from llmgw.contracts.backoff import backoff_delay
from llmgw.contracts.feed import (HOMES_PER_REPORT, Ack, Change, FeedError, Report, Snapshot, UsageRow, from_wire,
                                  to_wire)
from llmgw.contracts.privatefiles import write_private
from llmgw.router.private import untrusted
from llmgw.router.engine_figures import add as add_count
from llmgw.router.feedstate import FedRouter

log = logging.getLogger(__name__)

FEED_PATH = "/v1/feed"
REPORT_PATH = "/v1/feed/report"
CHALLENGE_PATH = routerauth.CHALLENGE_PATH
SNAPSHOT_FILE = "snapshot.json"
SLOTS_DIR = "slots"
ROUTER_ID_FILE = "router-id"
SPOOL_FILE = "spool.ndjson"
LOCK_FILE = "lock"
REFUSED_DIR = "refused"
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
SPOOL_COMPACT = 256  # spool lines beyond the live reports before the file is rewritten

_dumps = partial(json.dumps, separators=(",", ":"))


class FeedClientError(LlmgwError, ValueError):
    """A --control address or state directory this client cannot use, with what to do."""

    category = Category.PROTOCOL


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


# -- files -------------------------------------------------------------------------------------


def _private_dir(path: Path) -> None:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    problem = untrusted(path)
    if problem is not None:
        raise FeedClientError(f"refusing the router state directory: {problem}")
    os.chmod(path, 0o700)


def load_snapshot_file(path: Path) -> Snapshot | None:
    """The snapshot kept in `path`, or None when there is none or it does not parse (then it is
    renamed `*.bad` and the reason logged: a router starts without it rather than with a guess).
    One that another user owns or may write is not read (R-10.9)."""
    problem = untrusted(path)
    if problem is not None:
        log.warning("not using the last-known-good snapshot: %s; starting without it", problem)
        return None
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("cannot read the last-known-good snapshot %s (%s); starting without it", path, exc.strerror)
        return None
    try:
        message = from_wire(json.loads(text))
        if not isinstance(message, Snapshot):
            raise FeedError(f"message.type: expected a snapshot, got {type(message).__name__.lower()}")
    except (ValueError, FeedError) as exc:  # json.JSONDecodeError is a ValueError
        bad = path.with_name(path.name + ".bad")
        with contextlib.suppress(OSError):
            os.replace(path, bad)
        log.warning("the last-known-good snapshot %s is not usable (%s); set aside as %s, starting without it",
                    path, exc, bad.name)
        return None
    return message


# -- reports -----------------------------------------------------------------------------------


def merge_reports(older: Report, newer: Report) -> Report:
    """One report saying what both say: counted parts added, state parts the newer's, under the
    older's seq. Only for a report that was never sent: one that may have been counted keeps its seq."""
    usage: dict[tuple[int, str, str], list[int]] = {}
    for row in (*older.usage, *newer.usage):
        counts = usage.setdefault((row.bucket, row.key_id, row.model), [0, 0, 0, 0, 0])
        # saturating: a row never exceeds MAX_COUNT
        for i, value in enumerate((row.requests, row.prompt_tokens, row.completion_tokens, row.estimated_tokens,
                                   row.unmetered)):
            counts[i] = add_count(counts[i], value)
    key_use = dict(older.key_use)
    for key, at in newer.key_use.items():
        key_use[key] = max(at, key_use.get(key, at))
    last_used = dict(older.last_used)
    for replica, at in newer.last_used.items():
        last_used[replica] = max(at, last_used.get(replica, at))
    homes = {model: dict(entries) for model, entries in older.homes.items()}
    for model, entries in newer.homes.items():
        homes.setdefault(model, {}).update(entries)
    if sum(map(len, homes.values())) > HOMES_PER_REPORT:  # the newer alone: homes are a hint, not a count
        homes = dict(newer.homes)
    return replace(newer, seq=older.seq,
                   usage=tuple(UsageRow(b, k, m, *counts) for (b, k, m), counts in usage.items()),
                   key_use=key_use, last_used=last_used,
                   demand=tuple(dict.fromkeys((*older.demand, *newer.demand))), homes=homes)


@dataclass
class _Spooled:
    report: Report
    sent: bool  # handed to the network at least once: it may have been counted, so it stays as it is


class Spool:
    """A slot's unacknowledged reports, on disk in `spool.ndjson` and in memory.

    The file is append-only between rewrites: each line a report (`to_wire`; a later line with the
    same seq replaces an earlier one) or `{"acked": SEQ}`. Loading takes the newest of each seq
    above the highest acked; the next seq is above everything the file ever named, so a seq is
    never used twice for one router id."""

    def __init__(self, directory: Path, router_id: str):
        self.path = directory / SPOOL_FILE
        self.router_id = router_id
        self.pending: list[_Spooled] = []
        self.acked = 0
        self.next_seq = 1
        self._lines = 0

    def load(self) -> None:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return
        reports: dict[int, Report] = {}
        top = 0
        lines = data.split(b"\n")
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                document = json.loads(line)
                if isinstance(document, dict) and set(document) == {"acked"} and type(document["acked"]) is int:
                    self.acked = max(self.acked, document["acked"])
                    continue
                report = from_wire(document)
                if not isinstance(report, Report):
                    raise FeedError("message.type: expected a report")
            except (ValueError, FeedError) as exc:
                if number >= len(lines) - 1:  # the last line, cut short by a crash while it was written
                    log.warning("%s: line %d is incomplete (%s); ignored", self.path, number, exc)
                else:
                    log.warning("%s: line %d is not a report (%s); ignored", self.path, number, exc)
                continue
            if report.router != self.router_id:
                log.warning("%s: line %d is router %s's, not this slot's %s; ignored", self.path, number,
                            report.router, self.router_id)
                continue
            reports[report.seq] = report
            top = max(top, report.seq)
        self.next_seq = max(top, self.acked) + 1
        self.pending = [_Spooled(reports[s], True) for s in sorted(reports) if s > self.acked]
        if sum(1 for line in lines if line.strip()) != len(self.pending) + 1:
            self._rewrite()  # drop what is acknowledged or replaced, and anything unreadable
        else:
            self._lines = len(self.pending) + 1

    def _rewrite(self) -> None:
        lines = [_dumps({"acked": self.acked})] + [_dumps(to_wire(s.report)) for s in self.pending]
        write_private(self.path, ("\n".join(lines) + "\n").encode())
        self._lines = len(lines)

    def _append(self, document: dict, sync: bool) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, _dumps(document).encode() + b"\n")
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        self._lines += 1

    def add(self, fields: dict, now: float) -> Report:
        """Spool this period's report (fsynced): merged into the newest one when that was never sent."""
        report = Report(router=self.router_id, seq=self.next_seq, sent_at=now, **fields)
        if self.pending and not self.pending[-1].sent:
            report = merge_reports(self.pending[-1].report, report)
            self.pending[-1].report = report
        else:
            self.next_seq += 1
            self.pending.append(_Spooled(report, False))
        if self._lines > len(self.pending) + SPOOL_COMPACT:
            self._rewrite()  # a long outage appends a merged report per period: keep only the live ones
        else:
            self._append(to_wire(report), sync=True)
        return report

    def acknowledge(self, seq: int) -> None:
        """Drop every report up to `seq`. Not fsynced: an ack lost in a crash only resends."""
        self.acked = max(self.acked, seq)
        self.pending = [s for s in self.pending if s.report.seq > seq]
        if self._lines > len(self.pending) + SPOOL_COMPACT:
            self._rewrite()
        else:
            self._append({"acked": self.acked}, sync=False)


class _Slot:
    """One `slots/N` directory, held by an exclusive flock on its lock file."""

    def __init__(self, directory: Path, fd: int, name: str | None = None):
        self.directory = directory
        self.fd = fd
        self.router_id = self._router_id(name)
        self.spool = Spool(directory, self.router_id)

    @classmethod
    def try_take(cls, directory: Path, name: str | None = None) -> _Slot | None:
        _private_dir(directory)
        for file in (LOCK_FILE, ROUTER_ID_FILE, SPOOL_FILE):
            problem = untrusted(directory / file)
            if problem is not None:
                raise FeedClientError(f"refusing the report slot {directory}: {problem}")
        fd = os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        try:
            return cls(directory, fd, name)
        except BaseException:
            os.close(fd)
            raise

    def _router_id(self, name: str | None) -> str:
        """The slot's router id, `NAME/HOST-SLOT-RANDOM`: the control plane takes reports only
        under the name of the credential they came with (R-10.7). `name` None: keep whatever the
        slot has (a swept slot's reports are delivered under their own id)."""
        path = self.directory / ROUTER_ID_FILE
        # The spool remembers the id's highest seq; without it a seq could be used twice, and the
        # control plane would take the second report for the first. So no spool, a new id.
        if (self.directory / SPOOL_FILE).exists():
            with contextlib.suppress(FileNotFoundError):
                value = path.read_text().strip()
                if value and (name is None or routerauth.router_of(value) == name):
                    return value
        value = f"{name or 'router'}/{socket.gethostname()}-{self.directory.name}-{secrets.token_hex(4)}"
        write_private(path, value.encode() + b"\n")
        return value

    def release(self) -> None:
        os.close(self.fd)  # closing the descriptor releases the flock


def take_slot(state_dir: Path, name: str | None = None) -> _Slot:
    """The first slot of `state_dir` no other process holds, its router id under `name`."""
    slots = state_dir / SLOTS_DIR
    _private_dir(slots)
    number = 0
    while True:
        slot = _Slot.try_take(slots / str(number), name)
        if slot is not None:
            return slot
        number += 1


# -- the client --------------------------------------------------------------------------------


class FeedClient:
    """Feeds `router` from the control plane at `control` and reports back; see the module's docstring."""

    def __init__(self, router: FedRouter, control: str, credential: str | Callable[[], str], state_dir: Path, *,
                 ca: str | None = None,
                 report_interval: float = REPORT_INTERVAL, snapshot_every: float = SNAPSHOT_EVERY,
                 read_timeout: float = READ_TIMEOUT, backoff_base: float = BACKOFF_BASE,
                 backoff_cap: float = BACKOFF_CAP, sweep_every: float = SWEEP_EVERY):
        self.router = router
        self.control = parse_control(control)
        # The router's credential, read again for every exchange: a rotation replaces the file.
        self._credential: Callable[[], str] = (lambda: credential) if isinstance(credential, str) else credential
        self.state_dir = Path(state_dir)
        self.report_interval = report_interval
        self.snapshot_every = snapshot_every
        self.read_timeout = read_timeout
        self.backoff_base = backoff_base
        self.backoff_cap = backoff_cap
        self.sweep_every = sweep_every
        self._ssl: ssl.SSLContext | bool = True
        if self.control.tls:
            try:
                self._ssl = ssl.create_default_context(cafile=os.path.expanduser(ca) if ca else None)
            except (OSError, ssl.SSLError) as exc:
                raise FeedClientError(f"cannot use --ca {ca}: {getattr(exc, 'strerror', None) or exc}") from None
        self.slot: _Slot | None = None
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
        _private_dir(self.state_dir)
        name = routerauth.credential_name(await asyncio.to_thread(self._credential))
        self.slot = await asyncio.to_thread(take_slot, self.state_dir, name)
        self.router.router_id = self.slot.router_id
        await asyncio.to_thread(self.slot.spool.load)
        self._set_aside = await asyncio.to_thread(_count_refused, self.state_dir / REFUSED_DIR)
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
            await asyncio.sleep(backoff_delay(attempt, self.backoff_base, self.backoff_cap))
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
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT, sock_read=self.read_timeout)
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
        try:
            document = json.loads(line)
        except ValueError as exc:
            raise FeedError(f"a feed line is not JSON ({exc})") from None
        message = from_wire(document)
        if not isinstance(message, (Snapshot, Change)):
            raise FeedError(f"message.type: expected a snapshot or a change, got {document.get('type')!r}")
        self.router.apply(message)
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
            await asyncio.sleep(self.snapshot_every)

    async def _write_snapshot(self) -> None:
        self._snapshot_changed.clear()
        snapshot = self.router.snapshot
        if snapshot is None:
            return
        data = _dumps(to_wire(snapshot)).encode()
        await asyncio.to_thread(write_private, self.state_dir / SNAPSHOT_FILE, data)

    # -- reports -------------------------------------------------------------------------------

    async def _report_loop(self) -> None:
        while not self._closing:
            # Not wait_for: on Python 3.11 it can swallow a cancellation that races the event.
            waiter = asyncio.ensure_future(self._wake.wait())
            try:
                await asyncio.wait({waiter}, timeout=self.report_interval)
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
                if time.monotonic() - self._swept_at >= self.sweep_every and self._post_attempt == 0:
                    self._swept_at = time.monotonic()
                    await self._sweep()
            except OSError as exc:
                log.warning("report spool in %s: %s", self.slot.directory, exc)
            except Exception:
                log.exception("router feed: delivering reports failed")
            self._update_status()

    async def _spool_report(self) -> None:
        fields = self.router.report_fields()
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
        directory = self.state_dir / REFUSED_DIR
        # Router ids are NAME/HOST-SLOT-RANDOM: the file name takes the id with '/' as '_'.
        path = directory / f"{report.router.replace('/', '_')}-{report.seq}.json"
        document = {"refused_at": time.time(), "reason": reason, "report": to_wire(report)}

        def keep() -> None:
            _private_dir(directory)
            write_private(path, _dumps(document).encode() + b"\n")
            spool.acknowledge(report.seq)  # written first: a crash in between only sends it again

        await asyncio.to_thread(keep)
        self._set_aside += 1
        self._last_refusal = {"seq": report.seq, "at": document["refused_at"], "rows": None, "reason": reason}
        log.error("router feed: report %d refused by the control plane (%s); set aside as %s, the next reports go on",
                  report.seq, reason, path)

    def _post_failed(self, message: str, say) -> None:
        (say if self._post_attempt == 0 else log.debug)("router feed: %s", message)  # once per failing spell
        self._post_after = time.monotonic() + backoff_delay(self._post_attempt, self.backoff_base, self.backoff_cap)
        self._post_attempt += 1

    async def _post(self, entry: _Spooled) -> Ack:
        timeout = aiohttp.ClientTimeout(total=POST_TIMEOUT, sock_connect=CONNECT_TIMEOUT)
        body = _dumps(to_wire(entry.report)).encode()
        headers, answer = await self._authorize("POST", REPORT_PATH)  # a refusal here sent no report
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
                orphan = await asyncio.to_thread(_Slot.try_take, slots / name)
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


def _count_refused(directory: Path) -> int:
    try:
        return sum(1 for p in directory.iterdir() if p.suffix == ".json")
    except FileNotFoundError:
        return 0


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    return str(exc) or type(exc).__name__

