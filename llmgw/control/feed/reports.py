"""Routers' reports taken in (R-10.1, R-10.8): counted once, their state handed on, refusals counted.

A report's counted parts (usage, key use, the request log's records, R-6.20) are written in one
transaction of the store's writer that also records the report's seq per router (`router_seq`), so
a report sent twice, or again after a restart, is counted once; its state parts go to the routers'
table, its homes to the home table, its demand per key to the lease book, and the on-demand
models asked for to the reconciler (R-6.8) — all only when its seq is above the router's last.
What the feed server left out of a report, and reports it refused whole, are counted per router
for operators.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import sqlite_utils

from llmgw.contracts.feed import Ack, Refusal, Report
from llmgw.control.feed.homes import HomeTable
from llmgw.control.feed.leases import LeaseBook
from llmgw.control.feed.routers import RouterTable
from llmgw.keys import record_key_use
from llmgw.requestlog import add_requests
from llmgw.store import Store, add_usage

log = logging.getLogger(__name__)

SEQ_RETENTION_SECONDS = 7 * 86400  # a router id not heard from for this long is forgotten
REFUSALS_KEPT = 256  # routers whose refused reports and rows are counted for operators


def apply_counted(db: sqlite_utils.Database, report: Report, now: float) -> bool:
    """Write a report's usage, key use and request records and record its seq, unless that router's
    seq is already at or past it; False then (counted before). Runs in one transaction of the store's writer."""
    row = db.execute("SELECT seq FROM router_seq WHERE router = ?", [report.router]).fetchone()
    if row is not None and report.seq <= row[0]:
        return False
    if report.usage:
        add_usage(db, [(u.bucket, u.key_id, u.model, u.requests, u.prompt_tokens, u.completion_tokens,
                        u.estimated_tokens, u.unmetered, u.via) for u in report.usage])
    if report.key_use:
        record_key_use(db, dict(report.key_use))
    if report.requests:
        add_requests(db, report.router, report.requests)
    db.execute("INSERT INTO router_seq (router, seq, updated_at) VALUES (?, ?, ?) ON CONFLICT (router) "
               "DO UPDATE SET seq = excluded.seq, updated_at = excluded.updated_at", [report.router, report.seq, now])
    db.execute("DELETE FROM router_seq WHERE updated_at < ?", [now - SEQ_RETENTION_SECONDS])
    return True


class ReportIntake:
    """Where every report goes first."""

    def __init__(self, store: Store, routers: RouterTable, homes: HomeTable, leases: LeaseBook,
                 note_demand: Callable[[str], None] | None):
        self._store = store
        self._routers = routers
        self._homes = homes
        self._leases = leases
        self._note_demand = note_demand  # the reconciler's: an on-demand model was asked for
        # router id -> reports refused whole, rows left out, the last reason
        self._refusals: dict[str, dict] = {}

    async def apply_report(self, report: Report, refused: tuple[Refusal, ...] = ()) -> Ack:
        """Count a report's usage and records once per (router, seq) and take its state; the Ack says it is applied.

        `refused`: the rows the feed server left out of it (R-10.8), counted per router for
        operators and handed back in the Ack."""
        now = time.time()
        if refused:
            self._note_refusal(report.router, rows=len(refused), reason=refused[-1].message)
        if report.usage or report.key_use or report.requests:
            await self._store.write(lambda db: apply_counted(db, report, now))
        heard = self._routers.take(report)
        if heard is not None:  # a late repeat does not set the state back
            if report.homes:
                self._homes.take(report.homes, heard)
            if report.asked:
                self._leases.note_asked(report.router, report.asked)
            if report.demand and self._note_demand is not None:
                for model in report.demand:
                    try:
                        self._note_demand(model)
                    except Exception:
                        log.exception("noting demand for on-demand model %s failed", model)
        return Ack(router=report.router, seq=report.seq, refused=refused)

    def report_refused(self, router: str | None, reason: str) -> None:
        """A report refused as a whole (R-10.8): counted for its router, when it names one."""
        if router is not None:
            self._note_refusal(router, reports=1, reason=reason)

    def refusals(self) -> dict[str, dict]:
        """router id -> {"reports", "rows", "last"}: what was refused of its reports, a copy."""
        return {router: dict(counts) for router, counts in self._refusals.items()}

    def _note_refusal(self, router: str, *, reports: int = 0, rows: int = 0, reason: str) -> None:
        counts = self._refusals.get(router)
        if counts is None:
            if len(self._refusals) >= REFUSALS_KEPT:  # a router id is any text: keep the table bounded
                del self._refusals[next(iter(self._refusals))]
            counts = self._refusals[router] = {"reports": 0, "rows": 0, "last": None}
        counts["reports"] += reports
        counts["rows"] += rows
        counts["last"] = reason
