"""Choosing an endpoint: least outstanding requests, ties round-robin (R-6.5), ejection (R-6.6).

Runs on the event loop only, on every request: plain attributes and integer counters, no locks.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence

from llmgw.router.endpoints import Endpoint

EJECT_SECONDS = 5.0  # long enough to stop hammering a dead engine, short enough to notice it is back


class Upstream:
    """The router's live view of one endpoint: what is in flight to it and whether it is ejected."""

    __slots__ = ("endpoint", "replica_id", "model", "outstanding", "ejected_until", "headers",
                 "stream_headers")

    def __init__(self, endpoint: Endpoint):
        self.endpoint = endpoint
        self.replica_id = endpoint.replica_id
        self.model = endpoint.model
        self.outstanding = 0
        self.ejected_until = 0.0
        # Built once: the request path reuses these mappings for every request to this endpoint.
        headers = {"Content-Type": "application/json"}
        if endpoint.api_key:
            headers["Authorization"] = "Bearer " + endpoint.api_key
        self.headers = headers
        self.stream_headers = {**headers, "Accept": "text/event-stream"}

    def __repr__(self) -> str:
        return f"Upstream({self.replica_id} {self.endpoint.url} outstanding={self.outstanding})"


class Pool:
    __slots__ = ("members", "next")

    def __init__(self, members: list[Upstream]):
        self.members = members
        self.next = 0


class Balancer:
    """Endpoints per model and the choice among them."""

    def __init__(self, eject_seconds: float = EJECT_SECONDS):
        self.eject_seconds = eject_seconds
        self._pools: dict[str, Pool] = {}
        self._by_replica: dict[str, list[Upstream]] = {}
        self._retired: list[Upstream] = []  # taken off the lists with requests still in flight
        self._last_used: dict[str, float] = {}  # replica_id -> time.monotonic() of the last acquire

    def replace(self, endpoints: Mapping[str, Sequence[Endpoint]]) -> None:
        """Install a full new set of endpoints; an endpoint that stays keeps its counters and ejection."""
        previous = {(up.replica_id, up.endpoint.url, up.endpoint.api_key): up
                    for pool in self._pools.values() for up in pool.members}
        pools = {}
        for model, members in endpoints.items():
            ups = []
            for endpoint in members:
                up = previous.get((endpoint.replica_id, endpoint.url, endpoint.api_key))
                if up is None or up.endpoint.model != endpoint.model:
                    up = Upstream(endpoint)
                ups.append(up)
            pools[model] = Pool(ups)
        self._pools = pools
        by_replica: dict[str, list[Upstream]] = {}
        for pool in pools.values():
            for up in pool.members:
                by_replica.setdefault(up.replica_id, []).append(up)
        self._by_replica = by_replica
        kept = {id(up) for members in by_replica.values() for up in members}
        self._retired = [up for up in [*self._retired, *previous.values()]
                         if up.outstanding > 0 and id(up) not in kept]
        alive = set(by_replica)
        self._last_used = {rid: t for rid, t in self._last_used.items() if rid in alive}

    def endpoints(self, model: str) -> list[Upstream]:
        pool = self._pools.get(model)
        return list(pool.members) if pool is not None else []

    def has_endpoints(self, model: str) -> bool:
        pool = self._pools.get(model)
        return pool is not None and bool(pool.members)

    def acquire(self, model: str, now: float, exclude: Iterable[Upstream] = (),
                include_ejected: bool = False) -> Upstream | None:
        """The endpoint with the fewest requests in flight (ties: round-robin), now counted as busy.

        Ejected endpoints and those in `exclude` (already tried by this request) are skipped,
        unless `include_ejected` asks for a last resort when every endpoint is ejected.
        """
        pool = self._pools.get(model)
        if pool is None:
            return None
        members = pool.members
        count = len(members)
        if count == 0:
            return None
        start = pool.next
        pool.next = start + 1 if start + 1 < count else 0
        best = None
        for offset in range(count):
            index = start + offset
            up = members[index if index < count else index - count]
            if (up.ejected_until > now and not include_ejected) or (exclude and up in exclude):
                continue
            if best is None or up.outstanding < best.outstanding:
                best = up
        if best is not None:
            best.outstanding += 1
            self._last_used[best.replica_id] = now  # noted on the request path, cheaply
        return best

    def acquire_replica(self, replica_id: str, model: str, now: float) -> Upstream | None:
        """That replica's endpoint for `model` (ejected or not: no other replica would do), now counted as busy."""
        for up in self._by_replica.get(replica_id, ()):
            if up.model == model:
                up.outstanding += 1
                self._last_used[replica_id] = now
                return up
        return None

    @staticmethod
    def release(up: Upstream) -> None:
        up.outstanding -= 1

    def eject(self, up: Upstream, now: float) -> None:
        up.ejected_until = now + self.eject_seconds

    def outstanding(self, replica_id: str) -> int:
        """Requests in flight to a replica, including after it was taken off the lists (drain)."""
        return sum(up.outstanding for up in self._by_replica.get(replica_id, ())) + \
            sum(up.outstanding for up in self._retired if up.replica_id == replica_id)

    def outstanding_by_model(self) -> dict[str, int]:
        return {model: sum(up.outstanding for up in pool.members) for model, pool in self._pools.items()}

    def last_used(self) -> dict[str, float]:
        """replica_id -> unix time of the last request sent to it; never-used replicas are absent."""
        offset = time.time() - time.monotonic()
        return {rid: t + offset for rid, t in self._last_used.items()}
