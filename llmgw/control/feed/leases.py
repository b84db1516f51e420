"""Each limited key's budget split among the routers (R-6.16): `split_leases`, and the demand it splits by.

Every LEASE_SECONDS each router heard recently gets a share of every limited key's limits, in
proportion to its recent demand for the key (`Report.asked`, the past counting half per
rebalance), each router keeping at least LEASE_FLOOR of it, so that one that has not asked yet
can admit a few. A Change carries the leases when the split changes. The shares of one key add
up to at most 1 (rounded down to hundredths), so routers together hold no more than the limit.

The bound on the total: while a new split travels, a router whose share grew fills at its new
pace, so the total runs ahead of the limit by at most the moved share's pace for the time the
change takes to reach every router; and a router that is not in the split yet (one that just
started) holds 1/N of each limit, N the routers in the last leases it got, the whole limit when
it got none, until the next split includes it (within LEASE_SECONDS of its first report). With a
single router there are no leases: it holds every limit whole. A router keeps the last leases
while the control plane is away. Requests at once are whole places: each router computes its part
of a key's concurrency from the same leases (llmgw.router.limits.split_places), so that the parts
add up to the limit (R-6.16b).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType

from llmgw.contracts.feed import KeyEntry, Lease
from llmgw.control.feed.changelog import ChangeLog
from llmgw.control.feed.routers import RouterTable

log = logging.getLogger(__name__)

LEASE_SECONDS = 1.0  # how often each limited key's budget is split again among the routers
LEASE_FLOOR = 0.05  # the share of a key's limits every recent router keeps (at most 1/routers)
DEMAND_HALF_LIFE = 1  # rebalances after which a router's past demand for a key counts half

NO_LEASES: Mapping[str, Mapping[str, Lease]] = MappingProxyType({})


def split_leases(routers: Sequence[str], keys: Iterable[KeyEntry], demand: Mapping[str, Mapping[str, float]],
                 floor: float = LEASE_FLOOR) -> Mapping[str, Mapping[str, Lease]]:
    """router id -> key id -> its share of the key's limits, for every limited key.

    `routers`: those heard recently, in a stable order; `demand`: router id -> key id -> its
    recent requests (a router or key absent: none). A key nobody asked for is split evenly; else
    each router gets `floor` (at most 1/routers) and the rest in proportion to its demand. A share
    is rounded down to hundredths and is at least 0.01. Fewer than two routers: no leases, the one
    router holds every limit whole."""
    if len(routers) < 2:
        return NO_LEASES
    floor = min(floor, 1 / len(routers))
    out: dict[str, dict[str, Lease]] = {r: {} for r in routers}
    for key in keys:
        if key.limits is None and not key.model_limits:
            continue
        wants = [demand.get(r, {}).get(key.id, 0.0) for r in routers]
        total = sum(wants)
        for router, want in zip(routers, wants):
            share = 1 / len(routers) if total <= 0 else floor + (1 - floor * len(routers)) * want / total
            out[router][key.id] = Lease(max(math.floor(share * 100) / 100, 0.01))
    return MappingProxyType({r: MappingProxyType(per_key) for r, per_key in out.items()})


class LeaseBook:
    """The routers' recent demand per key, and the last split published."""

    def __init__(self, changes: ChangeLog, routers: RouterTable):
        self._changes = changes  # the keys in force, and where a new split goes out
        self._routers = routers  # who was heard recently
        self._demand: dict[str, dict[str, float]] = {}  # router -> key id -> recent requests, decayed
        self._leases: Mapping[str, Mapping[str, Lease]] = NO_LEASES

    def note_asked(self, router: str, asked: Mapping[str, int]) -> None:
        """A router's requests per limited key since its previous report (`Report.asked`)."""
        demand = self._demand.setdefault(router, {})
        for key_id, count in asked.items():
            demand[key_id] = demand.get(key_id, 0.0) + count

    def rebalance(self) -> None:
        """Split every limited key's limits among the routers heard recently; a Change with
        `leases` when the split differs from the last one. Then past demand counts half less."""
        routers = self._routers.fresh_ids()
        for gone in self._demand.keys() - set(routers):
            del self._demand[gone]
        leases = split_leases(routers, self._changes.keys, self._demand)
        if leases != self._leases:
            self._leases = leases
            self._changes.emit(leases=leases)
        for demand in self._demand.values():
            for key_id in list(demand):
                demand[key_id] /= 2 ** (1 / DEMAND_HALF_LIFE)
                if demand[key_id] < 0.01:
                    del demand[key_id]

    async def rebalance_forever(self) -> None:
        while True:
            await asyncio.sleep(LEASE_SECONDS)
            try:
                self.rebalance()
            except Exception:
                log.exception("splitting the keys' limits among the routers failed; the last split stands")
