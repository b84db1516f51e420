"""The affinity homes every router uses (R-6.5d): one table, made of what routers report.

Each report names the keys (their ring points, never their text) the router homed or sent to
their home since its previous report. The first home reported for a key is the one: it goes out
in a Change (`homes`), and every router that applies it sends the key there from then on, its own
placement replaced. A later report that homed the key elsewhere (a router that placed it before
the Change reached it) changes nothing but is told the table's home again. A home no router has
reported for HOME_IDLE_SECONDS, or whose replica no longer serves the model, is replaced by the
next one reported; at most HOMES_KEPT per model, the least recently reported forgotten first.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable, Mapping
from types import MappingProxyType

from llmgw.contracts.feed import HOME_IDLE_SECONDS, HOMES_KEPT
from llmgw.control.feed.changelog import ChangeLog

log = logging.getLogger(__name__)

EXPIRE_SECONDS = 1.0  # how often the homes gone idle are looked for


class HomeTable:
    """model -> ring point -> [replica id, when last reported], least recently reported first."""

    def __init__(self, changes: ChangeLog, clock: Callable[[], float]):
        self._changes = changes  # where a home set, told again or forgotten goes out
        self._clock = clock
        self._homes: dict[str, OrderedDict[int, list]] = {}

    def published(self) -> dict[str, Mapping[int, str]]:
        """model -> ring point -> replica id: what a snapshot's `homes` holds."""
        return {model: MappingProxyType({point: entry[0] for point, entry in table.items()})
                for model, table in self._homes.items() if table}

    def take(self, reported: Mapping[str, Mapping[int, str]], now: float) -> None:
        """Homes a router reports: the first home reported for a key stays while the key is live and
        its replica serves the model; a router that homed it elsewhere meanwhile is told the
        table's again. One Change for what is new, moved or told again."""
        changed: dict[str, dict[int, str | None]] = {}
        horizon = now - HOME_IDLE_SECONDS
        endpoints = self._changes.endpoints()
        for model, entries in reported.items():
            members = {e.replica_id for e in endpoints.get(model, ())}
            if not members:
                continue
            table = self._homes.get(model)
            if table is None:
                table = self._homes[model] = OrderedDict()
            for point, replica in entries.items():
                if replica not in members:
                    continue
                entry = table.get(point)
                if entry is None or entry[1] < horizon or entry[0] not in members:
                    table[point] = [replica, now]
                    changed.setdefault(model, {})[point] = replica
                else:
                    entry[1] = now
                    if entry[0] != replica:
                        changed.setdefault(model, {})[point] = entry[0]
                    table.move_to_end(point)
            while len(table) > HOMES_KEPT:
                changed.setdefault(model, {})[table.popitem(last=False)[0]] = None
        if changed:
            self._changes.emit(homes=changed)

    def expire(self) -> None:
        """Forget the homes no router has reported for HOME_IDLE_SECONDS, as routers do on their own."""
        horizon = self._clock() - HOME_IDLE_SECONDS
        forgotten: dict[str, dict[int, str | None]] = {}
        for model, table in list(self._homes.items()):
            while table:
                point, entry = next(iter(table.items()))
                if entry[1] >= horizon:
                    break
                table.popitem(last=False)
                forgotten.setdefault(model, {})[point] = None
            if not table:
                del self._homes[model]
        if forgotten:
            self._changes.emit(homes=forgotten)

    async def expire_forever(self) -> None:
        while True:
            await asyncio.sleep(EXPIRE_SECONDS)
            try:
                self.expire()
            except Exception:
                log.exception("forgetting the homes gone idle failed; they stay until the next pass")
