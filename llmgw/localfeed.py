"""The router feed in one process (R-10.1): a FeedPublisher and a Router on one event loop.

`LocalFeed` applies what the publisher's listener yields to the router, and reports the router's
counts and state back every REPORT_SECONDS, at once when the router notes demand for an on-demand
model (R-6.8), and a last time on close, so the usage counted before a shutdown is written. The
router id is random per start and seqs count from 1: the publisher counts each report once. A
message the router could not apply is named in every report after it (R-10.10), as a fed router does.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time

from llmgw.aio import cancel_and_wait
from llmgw.contracts.feed import FeedError, Report, Unapplied
from llmgw.control.feed import FeedListener, FeedPublisher
from llmgw.router.feedstate import FedRouter

log = logging.getLogger(__name__)

REPORT_SECONDS = 0.5


class LocalFeed:
    def __init__(self, publisher: FeedPublisher, router: FedRouter, *, router_id: str | None = None,
                 interval: float = REPORT_SECONDS):
        self.publisher = publisher
        self.router = router
        self.router_id = router_id or f"local-{secrets.token_hex(6)}"
        router.router_id = self.router_id
        self.interval = interval
        self.seq = 0
        self._unapplied: Unapplied | None = None  # the last message the router could not apply
        self._listener: FeedListener = publisher.listen()
        self._report_now = asyncio.Event()
        self._reporting = asyncio.Lock()
        self._tasks: list[asyncio.Task] = []
        # With nobody to start a replica on demand, the router does not wait for one.
        router.on_demand = self._report_now.set if publisher.note_demand is not None else None
        router.feed_status = {"transport": "in-process", "router": self.router_id, "version": None}
        router.snapshot_age = lambda: 0.0  # in one process the router always holds the publisher's latest

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._follow(), name="local-feed-follow"),
                       asyncio.create_task(self._report_forever(), name="local-feed-report")]

    def pump(self) -> int:
        """Apply every message that is ready now, without waiting; returns how many."""
        count = 0
        while (message := self._listener.next_nowait()) is not None:
            self._apply(message)
            count += 1
        return count

    async def report(self) -> None:
        """One report of what the router counted and holds now, applied by the publisher."""
        async with self._reporting:  # seqs reach the publisher in order
            self.seq += 1
            report = Report(router=self.router_id, seq=self.seq, sent_at=time.time(), **self.router.report_fields(),
                            unapplied=self._unapplied)
            try:
                await self.publisher.apply_report(report)
            except Exception:
                log.exception("applying router report %d failed; its counts are lost", report.seq)

    async def close(self) -> None:
        for task in self._tasks:
            await cancel_and_wait(task)
        self._tasks = []
        self._listener.close()
        await self.report()

    def _apply(self, message) -> None:
        try:
            self.router.apply(message)
        except FeedError as exc:  # cannot happen in order on one loop; if it does, start over from a snapshot
            self._unapplied = Unapplied.of(message, exc, time.time())
            log.warning("router feed out of step (%s): taking the whole snapshot again", exc)
            self._listener.close()
            self._listener = self.publisher.listen()
            return
        except Exception as exc:
            self._unapplied = Unapplied.of(message, exc, time.time())
            raise
        snapshot = self.router.snapshot
        self.router.feed_status = {**(self.router.feed_status or {}),
                                   "version": None if snapshot is None else snapshot.version}

    async def _follow(self) -> None:
        while True:
            listener = self._listener
            async for message in listener:
                self._apply(message)
                if listener is not self._listener:
                    break
            if listener is self._listener:  # closed under us: done
                return

    async def _report_forever(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._report_now.wait(), self.interval)
            except asyncio.TimeoutError:
                pass
            self._report_now.clear()
            await self.report()
