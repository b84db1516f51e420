"""The request log in the state database (R-6.20): the records routers report, kept a while, read back filtered.

`add_requests` writes a report's records inside the transaction that counts the report
(llmgw/control/feed/reports.py), so they are taken once per (router, seq) like usage; a record
without a node gets its replica's head node as the control plane has it stored. `prune_requests`
deletes what `gateway.request_log.keep` no longer keeps, a chunk at a time, away from the reports'
path. `find_requests` answers `GET /api/requests`: newest first, or, given a cursor (`after`), the
records that came after it, oldest first, which is how `llmgw ctl requests --follow` follows.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter

import sqlite_utils

from llmgw.contracts.feed import REQUEST_RECORD_FIELDS, RequestRecord

DEFAULT_SHOWN = 50  # records an answer holds unless asked for another count
MOST_SHOWN = 1000  # the most one answer holds; a larger `n` is taken as this
DENSE = 5000  # records of a class of statuses past which the newest are found by time, not sorted
PRUNE_CHUNK = 1000  # rows one pruning write deletes at most (about 20 ms), so that reports wait little behind it

# Record field -> column. The record's `id` (its X-Request-Id) is `request_id`: the table's own
# `id` is the row's number, which only grows and which a follower's cursor names.
_COLUMNS = {name: "request_id" if name == "id" else name for name in REQUEST_RECORD_FIELDS}
_BOOLEANS = ("estimated", "stream")
_record_values = attrgetter(*REQUEST_RECORD_FIELDS)
_NODE = REQUEST_RECORD_FIELDS.index("node")
_INSERT = (f"INSERT INTO requests (router, {', '.join(_COLUMNS.values())}) "
           f"VALUES (?, {', '.join('?' * len(_COLUMNS))})")
_SELECT = "SELECT id, router, " + ", ".join(_COLUMNS.values()) + " FROM requests"
_NEWEST = "at DESC, id DESC"
_LOOKED_UP = 500  # replica ids one lookup of their nodes names at most


def add_requests(db: sqlite_utils.Database, router: str, records: Sequence[RequestRecord]) -> None:
    """Write `records` as reported by `router`; run it in the transaction that records the report's seq.

    A record without a node takes its replica's head node (rank 0) as the control plane stored
    it, looked up once per replica for the whole report."""
    unplaced = {r.replica for r in records if r.node is None and r.replica is not None}
    heads = _head_nodes(db, unplaced) if unplaced else {}
    rows = []
    for record in records:
        values = _record_values(record)
        if values[_NODE] is None and record.replica in heads:
            values = (*values[:_NODE], heads[record.replica], *values[_NODE + 1:])
        rows.append((router, *values))
    db.conn.executemany(_INSERT, rows)


def _head_nodes(db: sqlite_utils.Database, replicas: set[str]) -> dict[str, str]:
    """replica id -> its rank 0 shard's node, for those of `replicas` the store has."""
    found: dict[str, str] = {}
    names = sorted(replicas)
    for start in range(0, len(names), _LOOKED_UP):  # within SQLite's bound on a statement's parameters
        part = names[start:start + _LOOKED_UP]
        found.update(db.execute(f"SELECT replica_id, node FROM shards WHERE rank = 0 AND replica_id IN "
                                f"({', '.join('?' * len(part))})", part).fetchall())
    return found


def prune_requests(db: sqlite_utils.Database, now: float, age: float, keep: int, chunk: int = PRUNE_CHUNK) -> int:
    """Delete at most `chunk` records that are past `keep` (beyond the newest `keep` taken in) or
    older than `age` seconds at `now`; returns how many went. Both go by an index: the row id for
    the count, `at` for the age.

    Row ids are given in the order records are taken in and only grow, so the newest `keep` are
    those above the largest id minus `keep` (fewer where rows went by age in between)."""
    top = db.execute("SELECT MAX(id) FROM requests").fetchone()[0]
    if top is None:
        return 0
    deleted = db.execute("DELETE FROM requests WHERE id IN (SELECT id FROM requests WHERE id <= ? ORDER BY id "
                         "LIMIT ?)", [top - keep, chunk]).rowcount
    if deleted < chunk:
        deleted += db.execute("DELETE FROM requests WHERE id IN (SELECT id FROM requests WHERE at < ? LIMIT ?)",
                              [now - age, chunk - deleted]).rowcount
    return deleted


_STATUS_CLASS = re.compile(r"^([1-5])xx$", re.IGNORECASE)


def parse_status(text: str) -> tuple[int, int]:
    """The statuses `text` stands for, as an inclusive range: `503` is (503, 503), `5xx` (500, 599).
    ValueError naming what is understood otherwise."""
    text = text.strip()
    if text.isdigit() and 100 <= int(text) <= 599:
        return int(text), int(text)
    match = _STATUS_CLASS.match(text)
    if match:
        first = int(match.group(1)) * 100
        return first, first + 99
    raise ValueError(f"{text!r} is not a status: give one (503) or a class (5xx, 4xx)")


@dataclass(frozen=True)
class RequestQuery:
    """What `GET /api/requests` asks for: every filter given must hold (None: not filtered on)."""

    key: str | None = None  # the key's name
    model: str | None = None  # the model that served, or the name the client asked for (an alias)
    status: tuple[int, int] | None = None  # an inclusive range of statuses (parse_status)
    slower_than: float | None = None  # seconds: only requests that took longer
    n: int = DEFAULT_SHOWN  # at most this many records (at most MOST_SHOWN)
    after: int | None = None  # a cursor: only records taken in after it, oldest first; None: newest first


def find_requests(db: sqlite_utils.Database, query: RequestQuery) -> dict:
    """`{"requests": [...], "cursor": N}`: the records that match, each with every field of its
    RequestRecord (None where unknown), the router that reported it and its `row`. `cursor` is
    what to pass as `after` to get only what came later: the last record listed when a cursor
    asked for more than `n` fit, else the newest row taken in so far (0: none ever was), so
    records that did not match are not looked at again.

    Newest first goes by the time each request arrived, from the index of the filter (key,
    model, status) or of the time. A class of statuses is a range of the status index, whose
    records come out by status, not time: when it holds a few (under DENSE), they are sorted;
    when it holds many, the newest records are read by time until enough match. A cursor goes by
    row, from the rows after it only, which a follower asks for every second: its filters are kept
    off the indexes (a unary `+`)."""
    top = db.execute("SELECT seq FROM sqlite_sequence WHERE name = 'requests'").fetchone()
    top = top[0] if top is not None else 0
    n = max(0, min(query.n, MOST_SHOWN))
    following = query.after is not None
    mark = "+" if following else ""
    where, args = ["id <= ?"], [top]  # what was taken in by now, so that `cursor` covers exactly it
    if following:
        where.append("id > ?")
        args.append(query.after)
    if query.key is not None:
        where.append(f"{mark}key = ?")
        args.append(query.key)
    if query.status is not None:
        low, high = query.status
        dense = low != high and not following and db.execute(
            "SELECT COUNT(*) FROM (SELECT 1 FROM requests WHERE status BETWEEN ? AND ? LIMIT ?)",
            [low, high, DENSE]).fetchone()[0] >= DENSE
        where.append(f"{'+' if dense else mark}status BETWEEN ? AND ?")
        args += [low, high]
    if query.slower_than is not None:
        where.append("duration > ?")
        args.append(query.slower_than)
    if following:
        if query.model is not None:
            where.append("(+model = ? OR +asked = ?)")
            args += [query.model, query.model]
        sql, args = f"{_SELECT} WHERE {' AND '.join(where)} ORDER BY id LIMIT ?", [*args, n]
    elif query.model is None:
        sql, args = f"{_SELECT} WHERE {' AND '.join(where)} ORDER BY {_NEWEST} LIMIT ?", [*args, n]
    else:
        # The model's own records and those asked for by its name (an alias), each newest first
        # from its index, then merged: an OR would sort every record of the model.
        arm = f"SELECT * FROM ({_SELECT} WHERE {' AND '.join(where)} AND {{}} ORDER BY {_NEWEST} LIMIT ?)"
        sql = (f"{arm.format('model = ?')} UNION ALL {arm.format('asked = ? AND model IS NOT ?')} "
               f"ORDER BY {_NEWEST} LIMIT ?")
        args = [*args, query.model, n, *args, query.model, query.model, n, n]
    found = [_record(row) for row in db.execute(sql, args).fetchall()]
    last = top
    if following and n and len(found) == n:
        last = found[-1]["row"]  # more may match past it: the next call goes on from there
    return {"requests": found, "cursor": last}


def _record(row: tuple) -> dict:
    record = {"row": row[0], "router": row[1], **dict(zip(REQUEST_RECORD_FIELDS, row[2:]))}
    for name in _BOOLEANS:
        record[name] = bool(record[name])
    return record
