"""The keys in force, read again every KEY_REFRESH_SECONDS (R-10.1), so that `llmgw keys create`
and `llmgw keys revoke` reach the routers without a restart."""

from __future__ import annotations

import asyncio
import logging

from llmgw.control.feed.changelog import ChangeLog
from llmgw.keys import key_entries
from llmgw.store import Store

log = logging.getLogger(__name__)

KEY_REFRESH_SECONDS = 2.0


class KeyRefresh:
    """Reads the keys off the loop (the store's reader) and hands them to the change log."""

    def __init__(self, store: Store, changes: ChangeLog):
        self._store = store
        self._changes = changes

    async def refresh(self) -> None:
        """Read the keys in force; a Change with `keys` when they differ."""
        try:
            keys = await self._store.read(key_entries)
        except Exception as exc:  # a locked or briefly unreadable database: keep the keys we have
            log.warning("could not reload API keys (keeping the %d loaded): %s", len(self._changes.keys), exc)
            return
        self._changes.set_keys(keys)

    async def refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(KEY_REFRESH_SECONDS)
            await self.refresh()
