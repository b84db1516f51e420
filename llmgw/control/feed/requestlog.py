"""The request log kept within `gateway.request_log.keep` (R-6.20), pruned on a timer of its own.

Records are written with the report that carries them (reports.py); deleting the old ones is kept
off that path: every PRUNE_EVERY seconds, in writes of at most PRUNE_CHUNK rows each, so a
report's write waits behind one chunk at most. Between two prunings the table can hold what
arrived meanwhile beyond `keep.records`.
"""

from __future__ import annotations

import asyncio
import logging
import time

from llmgw.config import RequestLogKeep
from llmgw.requestlog import PRUNE_CHUNK, prune_requests
from llmgw.store import Store

log = logging.getLogger(__name__)

PRUNE_EVERY = 5.0  # seconds between two prunings


class RequestLogPruner:
    """Deletes the records `keep` no longer keeps: older than its age, or past its count."""

    def __init__(self, store: Store, keep: RequestLogKeep):
        self._store = store
        self.keep = keep  # replaced on a reload (FeedPublisher.set_gateway)

    async def prune(self) -> int:
        """Prune now, a chunk per write until nothing is left to delete; returns how many went."""
        total = 0
        while True:
            keep, now = self.keep, time.time()
            deleted = await self._store.write(lambda db: prune_requests(db, now, keep.age, keep.records))
            total += deleted
            if deleted < PRUNE_CHUNK:
                return total

    async def prune_forever(self) -> None:
        while True:
            try:
                deleted = await self.prune()
                if deleted:
                    log.debug("request log: %d records past gateway.request_log.keep deleted", deleted)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("pruning the request log failed; trying again in %.0fs", PRUNE_EVERY)
            await asyncio.sleep(PRUNE_EVERY)
