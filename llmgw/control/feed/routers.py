"""The routers as they report themselves (R-10.1): each one's latest state, and what the
reconciler and the admin read of them all.

A report's state parts (requests in flight, last use, engine loads, counters, the snapshot it
routes with, the last message it could not apply) replace what that router said before. Only the
routers heard within STALE_SECONDS count in the sums: one silent longer may be gone, and its last
figures with it. Staleness is judged by this side's clock when the report arrived, not the router's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from llmgw.contracts.feed import EngineLoad, Report, RouterCounters, Unapplied
from llmgw.control.feed.changelog import ChangeLog

STALE_SECONDS = 10.0  # routers report about every 0.5 s: one silent this long no longer counts
FORGET_SECONDS = 3600.0  # the state of a router silent this long is dropped from memory (its seq stays)


@dataclass
class _RouterState:
    seq: int
    heard: float  # the clock's time the report arrived: staleness is judged by our clock, not the router's
    report: Report
    # The last Snapshot or Change it could not apply, kept when a later report names
    # none (a router that restarted under the same id has forgotten it; operators have not).
    unapplied: Unapplied | None


class RouterTable:
    """Each router's latest report, and the sums over those heard recently."""

    def __init__(self, changes: ChangeLog, clock: Callable[[], float]):
        self._changes = changes  # the versions routers catch up with
        self._clock = clock
        self._routers: dict[str, _RouterState] = {}

    def take(self, report: Report) -> float | None:
        """Take a report's state; the clock's time it was heard, or None for a late repeat (a seq
        at or below the router's last), which does not set its state back."""
        previous = self._routers.get(report.router)
        if previous is not None and report.seq <= previous.seq:
            return None
        heard = self._clock()
        if previous is None:  # a new router id (a router restarted): forget those long silent
            for router, state in list(self._routers.items()):
                if state.heard < heard - FORGET_SECONDS:
                    del self._routers[router]
        unapplied = report.unapplied or (previous.unapplied if previous is not None else None)
        self._routers[report.router] = _RouterState(report.seq, heard, report, unapplied)
        return heard

    def fresh_ids(self) -> list[str]:
        """The ids of the routers heard within STALE_SECONDS, sorted."""
        return sorted(router for router, state in self._routers.items() if state.heard >= self._horizon())

    def take_last_used(self) -> dict[str, float]:
        """replica id -> unix time of its last request over every router; never used: absent (R-7.1)."""
        out: dict[str, float] = {}
        for state in self._routers.values():
            for replica_id, when in state.report.last_used.items():
                if when > out.get(replica_id, 0.0):
                    out[replica_id] = when
        return out

    def outstanding(self, replica_id: str) -> int:
        """Requests in flight to a replica, summed over the routers that reported recently.

        A drain waits for this to be 0 (R-4.2). Right after the change that takes a replica's
        last endpoint away, a router may still be routing with the version before it, and its
        latest report was made before it saw the change: a 0 in it says nothing about requests it
        is sending now. So until every recently heard router has reported with a snapshot at or
        after that change, the replica counts as still having at least one request in flight.
        """
        fresh = self._fresh()
        count = sum(state.report.inflight.get(replica_id, 0) for state in fresh)
        removed = self._changes.removed_in(replica_id)
        if removed is not None:
            if any(not self._caught_up(state.report, removed) for state in fresh):
                return max(count, 1)
            if count == 0:
                self._changes.seen_gone(replica_id)
        return count

    def adapter_use(self) -> dict[str, dict[str, tuple[int, float]]]:
        """replica id -> adapter -> (requests in flight, unix time of the last), over the routers
        heard recently (R-8.8): the in-flight counts summed, the latest last use."""
        out: dict[str, dict[str, tuple[int, float]]] = {}
        for state in self._fresh():
            for replica_id, per in state.report.adapter_use.items():
                mine = out.setdefault(replica_id, {})
                for adapter, (count, last) in per.items():
                    before = mine.get(adapter, (0, 0.0))
                    mine[adapter] = (before[0] + count, max(before[1], last))
        return out

    def adapter_quiet(self, replica_id: str, adapter: str, version: int | None) -> bool:
        """Whether no router heard recently can be sending requests of `adapter` to the replica:
        each routes with the endpoint table of `version` or later (the one that took the adapter
        off the replica) and reports none in flight there (R-8.8)."""
        for state in self._fresh():
            if version is not None and not self._caught_up(state.report, version):
                return False
            if state.report.adapter_use.get(replica_id, {}).get(adapter, (0, 0.0))[0] > 0:
                return False
        return True

    def reported_in_flight(self, replica_id: str) -> int | None:
        """Requests in flight to a replica as the routers heard recently report them, for operators
        to read; None when no router has reported within the staleness limit (unknown, not 0)."""
        fresh = self._fresh()
        if not fresh:
            return None
        return sum(state.report.inflight.get(replica_id, 0) for state in fresh)

    def engine_load(self, replica_id: str) -> EngineLoad | None:
        """The latest engine load reading of a replica among the routers heard recently, None when unknown."""
        best = None
        for state in self._fresh():
            load = state.report.engine_load.get(replica_id)
            if load is not None and (best is None or (load.at or 0.0) > (best.at or 0.0)):
                best = load
        return best

    def counters(self) -> list[RouterCounters]:
        """Each router's latest request counters, for /metrics (R-9.7)."""
        return [state.report.counters for state in list(self._routers.values()) if state.report.counters is not None]

    def listing(self, refusals: Mapping[str, dict]) -> list[dict]:
        """The routers for operators: id, seconds since the last report, whether it went silent past
        the staleness limit, the snapshot version it routes with (and whether that is the current
        one), the last message it could not apply (R-10.10), its requests in flight, and what the
        control plane refused of its reports (`refusals`, router id -> counts, R-10.8). A router
        all of whose reports were refused is listed from `refusals` alone."""
        now, current = self._clock(), self._changes.current()
        out = []
        for router_id, state in sorted(self._routers.items()):
            snapshot = state.report.snapshot
            out.append({
                "router": router_id, "reported_ago": max(0.0, now - state.heard),
                "stale": now - state.heard > STALE_SECONDS,
                "snapshot": None if snapshot is None else {"epoch": snapshot[0], "version": snapshot[1]},
                "current": (current is not None and snapshot is not None
                            and snapshot == (current.epoch, current.version)),
                "unapplied": _unapplied(state.unapplied),
                "in_flight": sum(state.report.inflight.values()),
                "refused": refusals.get(router_id),
            })
        for router_id in sorted(refusals.keys() - self._routers.keys()):  # every report refused
            out.append({"router": router_id, "reported_ago": None, "stale": True, "snapshot": None, "current": False,
                        "unapplied": None, "in_flight": None, "refused": refusals[router_id]})
        return out

    def _horizon(self) -> float:
        return self._clock() - STALE_SECONDS

    def _fresh(self) -> list[_RouterState]:
        horizon = self._horizon()
        return [state for state in self._routers.values() if state.heard >= horizon]

    def _caught_up(self, report: Report, version: int) -> bool:
        if report.snapshot is None:
            return True  # a router with no snapshot routes nothing
        epoch, seen = report.snapshot
        return epoch == self._changes.epoch and seen >= version


def _unapplied(unapplied: Unapplied | None) -> dict | None:
    if unapplied is None:
        return None
    return {"epoch": unapplied.epoch, "version": unapplied.version, "reason": unapplied.reason, "at": unapplied.at}
