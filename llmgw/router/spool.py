"""A router process's report slot and its spool (R-10.1, R-10.8): reports kept on disk until the
control plane acknowledges them, each counted there once.

- `slots/N/` (in the state directory, llmgw.router.statedir): one per running router process,
  taken by an exclusive flock on `slots/N/lock` (the first free N) and held while it runs. A slot
  holds the router id (`router-id`; a new one when the spool is gone, as the spool is what
  remembers the id's seqs) and the report spool (`spool.ndjson`). A worker restarted while its
  predecessor still finishes streams finds the predecessor's slot locked and takes another: two
  processes never share a spool. Slots nobody holds (a killed process's) are swept by the feed
  client: their unacknowledged reports are delivered.
- `refused/ROUTER-SEQ.json` (the router id's `/` as `_`): a report the control plane refused as a
  whole (400 or 413: sending it again cannot succeed), kept with the refusal's reason for whoever
  looks into it (`set_aside`).

Each report is appended to the spool and fsynced before it is sent, and dropped from it when the
control plane acknowledges its seq; the control plane counts a (router, seq) once, so resending
after a restart of either side counts nothing twice. The spool stays small: a report that was
never handed to the network is merged with the next period's (`merge_reports`), keeping its seq;
only a report that may have reached the control plane keeps its own seq and content until it is
acknowledged. A merged report keeps the newest REQUESTS_PER_REPORT request-log records of the two
(R-6.20; those it drops are counted and logged once per outage), and a merge appends only the
records the newer report brought, on a line of their own, instead of the whole report again: a
long outage under load writes each record once (until a rewrite), and the file is rewritten once
its appended lines or bytes outgrow what is live.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import secrets
import socket
import time
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

from llmgw.contracts import routerauth
from llmgw.contracts.feed import (HOMES_PER_REPORT, FeedError, Report, UsageRow, from_wire, request_record_from_wire,
                                  request_record_to_wire, to_wire)
from llmgw.contracts.privatefiles import write_private
from llmgw.router.engine_figures import add as add_count
from llmgw.router.private import untrusted
from llmgw.router.requestlog import REQUESTS_PER_REPORT
from llmgw.router.statedir import FeedClientError, private_dir

log = logging.getLogger(__name__)

SLOTS_DIR = "slots"
ROUTER_ID_FILE = "router-id"
SPOOL_FILE = "spool.ndjson"
LOCK_FILE = "lock"
REFUSED_DIR = "refused"
SPOOL_COMPACT = 256  # spool lines beyond the live reports before the file is rewritten
SPOOL_COMPACT_BYTES = 16 * 1024**2  # bytes appended since the last rewrite before the file is rewritten

_dumps = partial(json.dumps, separators=(",", ":"))


# -- reports -------------------------------------------------------------------------------------


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
                   demand=tuple(dict.fromkeys((*older.demand, *newer.demand))), homes=homes,
                   requests=(older.requests + newer.requests)[-REQUESTS_PER_REPORT:])


@dataclass
class Spooled:
    """A report in the spool, until the control plane acknowledges it."""

    report: Report
    sent: bool  # handed to the network at least once: it may have been counted, so it stays as it is
    body: bytes | None = None  # its wire form, once made: the spool's line and the body sent are the same bytes

    def encoded(self) -> bytes:
        """The report's wire form as JSON (made once: its request-log records are the bulk of it)."""
        if self.body is None:
            self.body = _dumps(to_wire(self.report)).encode()
        return self.body


class Spool:
    """A slot's unacknowledged reports, on disk in `spool.ndjson` and in memory.

    The file is append-only between rewrites: each line a report (`to_wire`; a later line with the
    same seq replaces an earlier one), `{"acked": SEQ}`, or `{"records_of": SEQ, "requests": [...]}`:
    request-log records a merge added to report SEQ. Loading takes the newest of each seq above the
    highest acked, with every record the file holds for it in order (the newest
    REQUESTS_PER_REPORT); the next seq is above everything the file ever named, so a seq is never
    used twice for one router id."""

    def __init__(self, directory: Path, router_id: str):
        self.path = directory / SPOOL_FILE
        self.router_id = router_id
        self.pending: list[Spooled] = []
        self.acked = 0
        self.next_seq = 1
        self.records_dropped = 0  # request-log records merged reports could not keep
        self._dropping = False  # in a spell of such drops: logged once, until a report is acknowledged
        self._lines = 0
        self._appended = 0  # bytes appended since the file was last written whole

    def load(self) -> None:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return
        reports: dict[int, Report] = {}
        records: dict[int, list] = {}  # seq -> its request-log records, in the order the file has them
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
                if isinstance(document, dict) and set(document) == {"records_of", "requests"} \
                        and type(document["records_of"]) is int and type(document["requests"]) is list:
                    where = f"records_of {document['records_of']}"
                    added = [request_record_from_wire(r, f"{where}.requests[{i}]")
                             for i, r in enumerate(document["requests"])]
                    records.setdefault(document["records_of"], []).extend(added)
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
            if report.requests:
                records.setdefault(report.seq, []).extend(report.requests)
            top = max(top, report.seq)
        self.next_seq = max(top, self.acked) + 1
        for seq, kept in records.items():
            if seq in reports:
                reports[seq] = replace(reports[seq], requests=tuple(kept[-REQUESTS_PER_REPORT:]))
        self.pending = [Spooled(reports[s], True) for s in sorted(reports) if s > self.acked]
        if sum(1 for line in lines if line.strip()) != len(self.pending) + 1:
            self._rewrite()  # drop what is acknowledged or replaced, and anything unreadable
        else:
            self._lines = len(self.pending) + 1

    def _rewrite(self) -> None:
        lines = [_dumps({"acked": self.acked}).encode()] + [s.encoded() for s in self.pending]
        write_private(self.path, b"\n".join(lines) + b"\n")
        self._lines = len(lines)
        self._appended = 0

    def _append(self, lines: list[bytes], sync: bool) -> None:
        data = b"\n".join(lines) + b"\n"
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, data)
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        self._lines += len(lines)
        self._appended += len(data)

    def _outgrown(self) -> bool:
        return self._lines > 2 * len(self.pending) + SPOOL_COMPACT or self._appended > SPOOL_COMPACT_BYTES

    def add(self, fields: dict, now: float) -> Report:
        """Spool this period's report (fsynced): merged into the newest one when that was never sent."""
        report = Report(router=self.router_id, seq=self.next_seq, sent_at=now, **fields)
        last = self.pending[-1] if self.pending else None
        if last is not None and not last.sent:
            added = report.requests
            merged = merge_reports(last.report, report)
            self._count_dropped(len(last.report.requests) + len(added) - len(merged.requests))
            last.report, last.body = merged, None
            if self._outgrown():
                self._rewrite()  # a long outage appends a merged report per period: keep only the live ones
            else:
                # The merged report without its records (those of the older are in the file
                # already), then the newer's records: each record is written once.
                lines = [_dumps(to_wire(replace(merged, requests=()))).encode()]
                if added:
                    lines.append(_dumps({"records_of": merged.seq,
                                         "requests": [request_record_to_wire(r) for r in added]}).encode())
                self._append(lines, sync=True)
            return merged
        self.next_seq += 1
        entry = Spooled(report, False)
        self.pending.append(entry)
        if self._outgrown():
            self._rewrite()
        else:
            self._append([entry.encoded()], sync=True)
        return report

    def _count_dropped(self, dropped: int) -> None:
        if dropped <= 0:
            return
        self.records_dropped += dropped
        if not self._dropping:
            self._dropping = True
            log.warning("%s: the report waiting to be sent holds %d request-log records, the most one carries; "
                        "the oldest are dropped while the control plane does not take reports (%d so far)",
                        self.path, REQUESTS_PER_REPORT, self.records_dropped)

    def acknowledge(self, seq: int) -> None:
        """Drop every report up to `seq`. Not fsynced: an ack lost in a crash only resends."""
        self.acked = max(self.acked, seq)
        self.pending = [s for s in self.pending if s.report.seq > seq]
        self._dropping = False
        if self._outgrown():
            self._rewrite()
        else:
            self._append([_dumps({"acked": self.acked}).encode()], sync=False)


# -- slots ---------------------------------------------------------------------------------------


class Slot:
    """One `slots/N` directory, held by an exclusive flock on its lock file."""

    def __init__(self, directory: Path, fd: int, name: str | None = None):
        self.directory = directory
        self.fd = fd
        self.router_id = self._router_id(name)
        self.spool = Spool(directory, self.router_id)

    @classmethod
    def try_take(cls, directory: Path, name: str | None = None) -> Slot | None:
        private_dir(directory)
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


def take_slot(state_dir: Path, name: str | None = None) -> Slot:
    """The first slot of `state_dir` no other process holds, its router id under `name`."""
    slots = state_dir / SLOTS_DIR
    private_dir(slots)
    number = 0
    while True:
        slot = Slot.try_take(slots / str(number), name)
        if slot is not None:
            return slot
        number += 1


def count_refused(state_dir: Path) -> int:
    """Reports set aside in `state_dir`'s refused/ (R-10.8)."""
    directory = state_dir / REFUSED_DIR
    try:
        return sum(1 for p in directory.iterdir() if p.suffix == ".json")
    except FileNotFoundError:
        return 0


def set_aside(state_dir: Path, spool: Spool, report: Report, reason: str) -> tuple[Path, float]:
    """Keep a report the control plane refused as a whole in refused/ with its reason, and drop it
    from the spool; where it went and when. Blocks: call it off the loop."""
    directory = state_dir / REFUSED_DIR
    # Router ids are NAME/HOST-SLOT-RANDOM: the file name takes the id with '/' as '_'.
    path = directory / f"{report.router.replace('/', '_')}-{report.seq}.json"
    document = {"refused_at": time.time(), "reason": reason, "report": to_wire(report)}
    private_dir(directory)
    write_private(path, _dumps(document).encode() + b"\n")
    spool.acknowledge(report.seq)  # written first: a crash in between only sends it again
    return path, document["refused_at"]
