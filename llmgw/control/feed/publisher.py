"""The control plane's side of the router feed (R-10.1..R-10.4): `FeedPublisher`.

The publisher holds what routing needs, as one versioned `Snapshot`: the catalog's models (engine
kind, served name, routing policy, on-demand, fallback chain), the endpoint lists (those the
reconciler pushes and the static ones of the catalog, R-6.10), the keys in force (read off the
loop every couple of seconds, so `llmgw keys create/revoke` apply without a restart), the
gateway settings routers read and the secret that seals their Responses ids (R-6.14). Each decision after that is one `Change` with only what changed,
handed to every listener in order; a listener that falls behind gets a fresh snapshot instead.

Each limited key's budget is split among the routers heard recently (R-6.16): every LEASE_SECONDS
the publisher gives each router a share of every limited key's limits, in proportion to its recent
demand for the key (`Report.asked`, the past counting half per rebalance), each router keeping
at least LEASE_FLOOR of it, so that one that has not asked yet can admit a few. A Change carries
the leases when the split changes. The shares of one key add up to at most 1 (rounded down to
hundredths), so routers together hold no more than the limit. The bound on the total: while a new
split travels, a router whose share grew fills at its new pace, so the total runs ahead of the limit
by at most the moved share's pace for the time the change takes to reach every router; and a router
that is not in the split yet (one that just started) holds 1/N of each limit, N the routers in the
last leases it got, the whole limit when it got none, until the next split includes it (within
LEASE_SECONDS of its first report). With a single router there are no leases: it holds every limit
whole. A router keeps the last leases while the control plane is away. Requests at once are
whole places: each router computes its part of a key's concurrency from the same leases
(llmgw.router.limits.split_places), so that the parts add up to the limit (R-6.16b).

Routers answer with `Report`s. Their counted parts (usage, key use) are written in one
transaction that also records the report's seq per router, so a report sent twice is counted
once (R-10.3); their state parts (requests in flight, last use, engine load) replace what the
router said before and make up what the reconciler and the admin read: `take_last_used`,
`outstanding`, `engine_load`.

Routers agree on affinity homes through the publisher (R-6.5d): each report names the keys (their
ring points, never their text) the router homed or sent to their home since its previous report.
The first home reported for a key is the one: it goes out in a Change (`homes`), and every router
that applies it sends the key there from then on, its own placement replaced. A later report
that homed the key elsewhere (a router that placed it before the Change reached it) changes
nothing but is told the table's home again. A home no router has reported for HOME_IDLE_SECONDS,
or whose replica no longer serves the model, is replaced by the next one reported; at most
HOMES_KEPT per model, the least recently reported forgotten first.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import secrets
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import sqlite_utils

from llmgw.catalog import Catalog, CatalogHolder
from llmgw.config import GatewayConfig, runtime_key_env_problem
from llmgw.contracts.endpoints import STATIC_PREFIX, Endpoint
from llmgw.contracts.feed import (HOME_IDLE_SECONDS, HOMES_KEPT, Ack, Change, EngineLoad, GatewaySettings, KeyEntry,
                                  Lease, Refusal, Report, RoutedModel, RouterCounters, Snapshot)
from llmgw.engines import VLLM, LlamaServer, SGLang
from llmgw.keys import key_entries, record_key_use
from llmgw.store import Store, add_usage

log = logging.getLogger(__name__)

KEY_REFRESH_SECONDS = 2.0
LISTENER_QUEUE = 1000  # changes a listener may fall behind by before it gets a snapshot instead
STALE_SECONDS = 10.0  # routers report about every 0.5 s: one silent this long no longer counts
SEQ_RETENTION_SECONDS = 7 * 86400  # a router id not heard from for this long is forgotten
FORGET_SECONDS = 3600.0  # the state of a router silent this long is dropped from memory (its seq stays)
REFUSALS_KEPT = 256  # routers whose refused reports and rows are counted for operators

LEASE_SECONDS = 1.0  # how often each limited key's budget is split again among the routers
LEASE_FLOOR = 0.05  # the share of a key's limits every recent router keeps (at most 1/routers)
DEMAND_HALF_LIFE = 1  # rebalances after which a router's past demand for a key counts half

_ENGINE_KINDS = {VLLM: "vllm", SGLang: "sglang", LlamaServer: "llama-server"}


def static_endpoints(catalog: Catalog) -> dict[str, list[Endpoint]]:
    """Endpoints of the models that declare `endpoints:` (R-6.10): served with no replica.

    Keys come from the environment variable each endpoint names; a variable that is not set is
    reported once and the endpoint is used without a key (the engine will refuse it if it wants one).
    A model added at runtime reads only `LLMGW_ENDPOINT_KEY_*` variables (config.RUNTIME_KEY_ENV_PREFIX).
    """
    out: dict[str, list[Endpoint]] = {}
    for model in catalog.models.values():
        if not model.static:
            continue
        endpoints = []
        for index, static in enumerate(model.config.endpoints or ()):
            key = None
            refused = model.declared_in != "file" and runtime_key_env_problem(static.api_key_env)
            if refused:  # stored before the rule: never read the variable, say so
                log.warning("model %s: endpoint %s is used without a key: %s", model.name,
                            static.url, refused)
            elif static.api_key_env:
                key = os.environ.get(static.api_key_env)
                if key is None:
                    log.warning("model %s: endpoint %s names api_key_env %s, which is not set",
                                model.name, static.url, static.api_key_env)
            endpoints.append(Endpoint(replica_id=f"{STATIC_PREFIX}{model.name}:{index}", model=model.name,
                                      url=static.root, api_key=key))
        out[model.name] = endpoints
    return out


def routed_models(catalog: Catalog) -> Mapping[str, RoutedModel]:
    """The catalog's models as routers see them."""
    return MappingProxyType({
        name: RoutedModel(name=name, engine=_ENGINE_KINDS.get(type(model.engine)) if model.engine else None,
                          served_name=model.config.served_name, routing=model.config.routing,
                          on_demand=model.on_demand, fallbacks=tuple(catalog.fallback_chain(name)),
                          concurrency=model.profile.concurrency if model.profile is not None else None,
                          background_responses=model.config.background_responses,
                          responses_store=model.profile is not None and model.profile.responses_store)
        for name, model in catalog.models.items()})


def gateway_settings(gateway: GatewayConfig) -> GatewaySettings:
    return GatewaySettings(max_body=int(gateway.max_body), request_timeout=float(gateway.request_timeout),
                           on_demand_wait=float(gateway.on_demand_wait), queue_wait=float(gateway.queue_wait),
                           max_waiting_per_key=gateway.max_waiting_per_key, max_answer=int(gateway.max_answer))


# -- applying reports: one write per report --------------------------------------------------------

def apply_counted(db: sqlite_utils.Database, report: Report, now: float) -> bool:
    """Write a report's usage and key use and record its seq, unless that router's seq is already
    at or past it; False then (counted before). Runs in one transaction of the store's writer."""
    row = db.execute("SELECT seq FROM router_seq WHERE router = ?", [report.router]).fetchone()
    if row is not None and report.seq <= row[0]:
        return False
    if report.usage:
        add_usage(db, [(u.bucket, u.key_id, u.model, u.requests, u.prompt_tokens, u.completion_tokens,
                        u.estimated_tokens, u.unmetered) for u in report.usage])
    if report.key_use:
        record_key_use(db, dict(report.key_use))
    db.execute("INSERT INTO router_seq (router, seq, updated_at) VALUES (?, ?, ?) ON CONFLICT (router) "
               "DO UPDATE SET seq = excluded.seq, updated_at = excluded.updated_at", [report.router, report.seq, now])
    db.execute("DELETE FROM router_seq WHERE updated_at < ?", [now - SEQ_RETENTION_SECONDS])
    return True


@dataclass
class _RouterState:
    seq: int
    heard: float  # time.monotonic() the report arrived: staleness is judged by our clock, not the router's
    report: Report


class FeedListener:
    """One subscriber: `async for message in listener` yields the current Snapshot, then each Change.

    A listener more than LISTENER_QUEUE changes behind drops them and gets a fresh snapshot next."""

    def __init__(self, publisher: FeedPublisher, limit: int = LISTENER_QUEUE):
        self._publisher = publisher
        self._limit = limit
        self._queue: deque[Change] = deque()
        self._resync = True  # the next message is the whole snapshot
        self._wake = asyncio.Event()
        self._closed = False
        self.resyncs = 0  # snapshots sent because the listener fell behind

    def _push(self, change: Change) -> None:
        if self._resync:
            return  # the snapshot it will get holds this change
        if len(self._queue) >= self._limit:
            self._queue.clear()
            self._resync = True
            self.resyncs += 1
        else:
            self._queue.append(change)
        self._wake.set()

    def _notify(self) -> None:
        self._wake.set()

    def next_nowait(self) -> Snapshot | Change | None:
        """The next message if one is ready, else None (callers that cannot await)."""
        if self._closed:
            return None
        if self._resync:
            current = self._publisher.current()
            if current is None:
                return None
            self._resync = False
            self._queue.clear()
            return current
        return self._queue.popleft() if self._queue else None

    def __aiter__(self) -> FeedListener:
        return self

    async def __anext__(self) -> Snapshot | Change:
        while True:
            if self._closed:
                raise StopAsyncIteration
            message = self.next_nowait()
            if message is not None:
                return message
            self._wake.clear()
            await self._wake.wait()

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        self._publisher._listeners.discard(self)


class FeedPublisher:
    """The router feed's source of truth, on the control plane's event loop."""

    def __init__(self, holder: CatalogHolder, store: Store, gateway: GatewayConfig, *, epoch: str | None = None,
                 note_demand: Callable[[str], None] | None = None, clock: Callable[[], float] = time.monotonic,
                 response_secret: str | None = None):
        self.holder = holder
        # Seals the Responses ids routers hand out: the state directory's, so ids outlive a
        # restart; without one (tests), one for this publisher's life.
        self._response_secret = response_secret or secrets.token_hex(32)
        self.store = store
        self.epoch = epoch or secrets.token_hex(8)
        self.note_demand = note_demand  # the reconciler's: an on-demand model was asked for
        self._clock = clock  # when reports arrive, for staleness
        self._gateway = gateway_settings(gateway)
        self._models = routed_models(holder.current)
        self._static = _lists(static_endpoints(holder.current))
        self._pushed: dict[str, tuple[Endpoint, ...]] = {}
        self._keys: tuple[KeyEntry, ...] = store.read_sync(key_entries)
        self._snapshot: Snapshot | None = None
        self._ready = asyncio.Event()
        self._listeners: set[FeedListener] = set()
        self._routers: dict[str, _RouterState] = {}
        # router id -> reports refused whole, rows left out, the last reason
        self._refusals: dict[str, dict] = {}
        # replica id -> the version whose change took its last endpoint away (see outstanding())
        self._removed_at: dict[str, int] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._refresh: asyncio.Task | None = None
        self._lease_task: asyncio.Task | None = None
        self._demand: dict[str, dict[str, float]] = {}  # router -> key id -> recent requests, decayed
        self._leases: Mapping[str, Mapping[str, Lease]] = MappingProxyType({})
        # The homes every router uses (R-6.5d): model -> ring point -> [replica id, when last
        # reported], least recently reported first. What the snapshot's `homes` publishes.
        self._homes: dict[str, OrderedDict[int, list]] = {}
        self._closed = False
        holder.subscribe(self._catalog_changed)

    # -- what the control plane calls ---------------------------------------------------------------

    def set_endpoints(self, table: Mapping[str, Sequence[Endpoint]]) -> None:
        """Replace every pushed endpoint list (static ones stay, R-6.10): a Change with only the
        models whose lists changed, or nothing when none did."""
        pushed = {model: tuple(members) for model, members in table.items()}
        self._on_loop(lambda: self._set_pushed(pushed))

    def set_gateway(self, gateway: GatewayConfig) -> None:
        """New gateway settings: a Change with `gateway` when what routers read changed."""
        settings = gateway_settings(gateway)
        self._on_loop(lambda: self._set_gateway(settings))

    def abandon(self, replica_id: str) -> int:
        """Routers stop waiting on a replica the control plane gave up. Returns the requests in
        flight to it as last reported, -1 when no router has reported recently (unknown)."""
        fresh = self._fresh()
        self._on_loop(lambda: self._emit(abandon=(replica_id,)))
        if not fresh:
            return -1
        return sum(state.report.inflight.get(replica_id, 0) for state in fresh)

    def mark_ready(self) -> None:
        """The first endpoints are in (adoption has pushed them): publish version 1."""
        if self._snapshot is not None:
            return
        self._remember_loop()
        homes = {model: MappingProxyType({point: entry[0] for point, entry in table.items()})
                 for model, table in self._homes.items() if table}
        self._snapshot = Snapshot(epoch=self.epoch, version=1, models=self._models,
                                  endpoints=MappingProxyType(self._merged()), keys=self._keys, gateway=self._gateway,
                                  homes=MappingProxyType(homes), response_secret=self._response_secret)
        self._ready.set()
        for listener in list(self._listeners):
            listener._notify()
        if self._refresh is None and self._loop is not None:
            self._refresh = self._loop.create_task(self._refresh_keys_forever(), name="feed-keys")
            self._lease_task = self._loop.create_task(self._rebalance_forever(), name="feed-leases")

    async def ready(self) -> None:
        await self._ready.wait()

    def current(self) -> Snapshot | None:
        return self._snapshot

    def listen(self) -> FeedListener:
        listener = FeedListener(self)
        if self._closed:
            listener._closed = True
        else:
            self._listeners.add(listener)
        return listener

    def router_counters(self) -> list[RouterCounters]:
        """Each router's latest request counters, for /metrics (R-9.7)."""
        return [state.report.counters for state in list(self._routers.values()) if state.report.counters is not None]

    async def apply_report(self, report: Report, refused: tuple[Refusal, ...] = ()) -> Ack:
        """Count a report's usage once per (router, seq) and take its state; the Ack says it is applied.

        `refused`: the rows the feed server left out of it (R-10.8), counted per router for
        operators and handed back in the Ack."""
        now = time.time()
        if refused:
            self._note_refusal(report.router, rows=len(refused), reason=refused[-1].message)
        if report.usage or report.key_use:
            await self.store.write(lambda db: apply_counted(db, report, now))
        previous = self._routers.get(report.router)
        if previous is None or report.seq > previous.seq:  # a late repeat does not set the state back
            heard = self._clock()
            if previous is None:  # a new router id (a router restarted): forget those long silent
                for router, state in list(self._routers.items()):
                    if state.heard < heard - FORGET_SECONDS:
                        del self._routers[router]
            self._routers[report.router] = _RouterState(report.seq, heard, report)
            if report.homes:
                self._take_homes(report.homes, heard)
            if report.asked:
                demand = self._demand.setdefault(report.router, {})
                for key_id, count in report.asked.items():
                    demand[key_id] = demand.get(key_id, 0.0) + count
            if report.demand and self.note_demand is not None:
                for model in report.demand:
                    try:
                        self.note_demand(model)
                    except Exception:
                        log.exception("noting demand for on-demand model %s failed", model)
        return Ack(router=report.router, seq=report.seq, refused=refused)

    def report_refused(self, router: str | None, reason: str) -> None:
        """A report refused as a whole (R-10.8): counted for its router, when it names one."""
        if router is not None:
            self._note_refusal(router, reports=1, reason=reason)

    def _note_refusal(self, router: str, *, reports: int = 0, rows: int = 0, reason: str) -> None:
        counts = self._refusals.get(router)
        if counts is None:
            if len(self._refusals) >= REFUSALS_KEPT:  # a router id is any text: keep the table bounded
                del self._refusals[next(iter(self._refusals))]
            counts = self._refusals[router] = {"reports": 0, "rows": 0, "last": None}
        counts["reports"] += reports
        counts["rows"] += rows
        counts["last"] = reason

    # -- what the reconciler and the admin read ---------------------------------------------------------

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
        removed = self._removed_at.get(replica_id)
        if removed is not None:
            if any(not self._caught_up(state.report, removed) for state in fresh):
                return max(count, 1)
            if count == 0:
                del self._removed_at[replica_id]  # every router has seen it gone and has nothing left on it
        return count

    def routers(self) -> list[dict]:
        """The routers that report to this control plane, for operators: id, seconds since the last
        report, the snapshot version it routes with (and whether that is the current one), whether
        it went silent past the staleness limit, and its requests in flight."""
        now, current = self._clock(), self.current()
        out = []
        for router_id, state in sorted(self._routers.items()):
            snapshot = state.report.snapshot
            out.append({
                "router": router_id, "reported_ago": max(0.0, now - state.heard),
                "stale": now - state.heard > STALE_SECONDS,
                "snapshot": None if snapshot is None else {"epoch": snapshot[0], "version": snapshot[1]},
                "current": (current is not None and snapshot is not None
                            and snapshot == (current.epoch, current.version)),
                "in_flight": sum(state.report.inflight.values()),
                "refused": self._refused_of(router_id),
            })
        for router_id in sorted(self._refusals.keys() - self._routers.keys()):  # every report refused
            out.append({"router": router_id, "reported_ago": None, "stale": True, "snapshot": None, "current": False,
                        "in_flight": None, "refused": self._refused_of(router_id)})
        return out

    def _refused_of(self, router: str) -> dict | None:
        counts = self._refusals.get(router)
        return None if counts is None else dict(counts)

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

    async def close(self) -> None:
        self._closed = True
        for task in (self._refresh, self._lease_task):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._refresh = self._lease_task = None
        for listener in list(self._listeners):
            listener.close()

    # -- inside ------------------------------------------------------------------------------------------

    def _fresh(self) -> list[_RouterState]:
        limit = self._clock() - STALE_SECONDS
        return [state for state in self._routers.values() if state.heard >= limit]

    def _caught_up(self, report: Report, version: int) -> bool:
        if report.snapshot is None:
            return True  # a router with no snapshot routes nothing
        epoch, seen = report.snapshot
        return epoch == self.epoch and seen >= version

    def _remember_loop(self) -> None:
        if self._loop is None:
            try:
                self._loop = asyncio.get_running_loop()
                self._loop_thread = threading.get_ident()
            except RuntimeError:
                pass

    def _on_loop(self, fn: Callable[[], None]) -> None:
        self._remember_loop()
        loop = self._loop
        if loop is not None and threading.get_ident() != self._loop_thread and not loop.is_closed():
            loop.call_soon_threadsafe(fn)
        else:
            fn()

    def _merged(self) -> dict[str, tuple[Endpoint, ...]]:
        return {**self._pushed, **self._static}

    def _set_pushed(self, pushed: dict[str, tuple[Endpoint, ...]]) -> None:
        before = self._merged()
        self._pushed = pushed
        self._emit(endpoints=_diff(before, self._merged()))

    def _set_gateway(self, settings: GatewaySettings) -> None:
        if settings != self._gateway:
            self._gateway = settings
            self._emit(gateway=settings)

    def _catalog_changed(self, catalog: Catalog) -> None:
        models = routed_models(catalog)
        static = _lists(static_endpoints(catalog))
        self._on_loop(lambda: self._swap_catalog(models, static))

    def _swap_catalog(self, models: Mapping[str, RoutedModel], static: dict[str, tuple[Endpoint, ...]]) -> None:
        before = self._merged()
        self._static = static
        changed_models = None
        if dict(models) != dict(self._models):
            self._models = changed_models = models
        self._emit(models=changed_models, endpoints=_diff(before, self._merged()))

    def _emit(self, *, models=None, endpoints=None, keys=None, gateway=None, abandon=(), leases=None,
              homes=None) -> None:
        """One Change with what is not None (or nothing when all is); before ready, only remembered."""
        if not endpoints:
            endpoints = None
        if models is None and endpoints is None and keys is None and gateway is None and not abandon \
                and leases is None and not homes:
            return
        snapshot = self._snapshot
        if snapshot is None:
            return  # version 1, when it is made, holds it all
        change = Change(epoch=self.epoch, version=snapshot.version + 1, models=models,
                        endpoints=None if endpoints is None else MappingProxyType(endpoints),
                        keys=keys, gateway=gateway, abandon=tuple(abandon), leases=leases,
                        homes=MappingProxyType(homes) if homes else None)
        new = snapshot.apply(change)
        if endpoints is not None:
            self._note_removed(snapshot, new)
        self._snapshot = new
        for listener in list(self._listeners):
            listener._push(change)

    def _note_removed(self, old: Snapshot, new: Snapshot) -> None:
        had = {e.replica_id for members in old.endpoints.values() for e in members}
        has = {e.replica_id for members in new.endpoints.values() for e in members}
        for replica_id in had - has:
            self._removed_at[replica_id] = new.version
        for replica_id in has:
            self._removed_at.pop(replica_id, None)

    def _take_homes(self, reported: Mapping[str, Mapping[int, str]], now: float) -> None:
        """Homes a router reports (R-6.5d): the first home reported for a key stays while the key
        is live and its replica serves the model; a router that homed it elsewhere meanwhile is
        told the table's again. One Change for what is new, moved or told again."""
        changed: dict[str, dict[int, str | None]] = {}
        horizon = now - HOME_IDLE_SECONDS
        merged = self._merged()
        for model, entries in reported.items():
            members = {e.replica_id for e in merged.get(model, ())}
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
            self._emit(homes=changed)

    def expire_homes(self) -> None:
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
            self._emit(homes=forgotten)

    async def _rebalance_forever(self) -> None:
        while True:
            await asyncio.sleep(LEASE_SECONDS)
            try:
                self.rebalance()
            except Exception:
                log.exception("splitting the keys' limits among the routers failed; the last split stands")
            try:
                self.expire_homes()
            except Exception:
                log.exception("forgetting the homes gone idle failed; they stay until the next pass")

    def rebalance(self) -> None:
        """Split every limited key's limits among the routers heard recently; a Change with
        `leases` when the split differs from the last one."""
        leases = self._split()
        if leases != self._leases:
            self._leases = leases
            self._emit(leases=leases)
        for demand in self._demand.values():
            for key_id in list(demand):
                demand[key_id] /= 2 ** (1 / DEMAND_HALF_LIFE)
                if demand[key_id] < 0.01:
                    del demand[key_id]

    def _split(self) -> Mapping[str, Mapping[str, Lease]]:
        limit = self._clock() - STALE_SECONDS
        routers = sorted(r for r, state in self._routers.items() if state.heard >= limit)
        for gone in set(self._demand) - set(routers):
            del self._demand[gone]
        if len(routers) < 2:
            return MappingProxyType({})  # one router (or none): it holds every limit whole
        floor = min(LEASE_FLOOR, 1 / len(routers))
        out: dict[str, dict[str, Lease]] = {r: {} for r in routers}
        for key in self._keys:
            if key.limits is None and not key.model_limits:
                continue
            wants = [self._demand.get(r, {}).get(key.id, 0.0) for r in routers]
            total = sum(wants)
            for router, want in zip(routers, wants):
                share = 1 / len(routers) if total <= 0 else floor + (1 - floor * len(routers)) * want / total
                out[router][key.id] = Lease(max(math.floor(share * 100) / 100, 0.01))
        return MappingProxyType({r: MappingProxyType(per_key) for r, per_key in out.items()})

    async def _refresh_keys_forever(self) -> None:
        while True:
            await asyncio.sleep(KEY_REFRESH_SECONDS)
            await self.refresh_keys()

    async def refresh_keys(self) -> None:
        """Read the keys in force off the loop; a Change with `keys` when they differ."""
        try:
            keys = await self.store.read(key_entries)
        except Exception as exc:  # a locked or briefly unreadable database: keep the keys we have
            log.warning("could not reload API keys (keeping the %d loaded): %s", len(self._keys), exc)
            return
        self.set_keys(keys)

    def set_keys(self, keys: tuple[KeyEntry, ...]) -> None:
        """These are the keys in force now: a Change with `keys` when they differ from the last."""
        if keys != self._keys:
            self._keys = keys
            self._emit(keys=keys)


def _lists(table: Mapping[str, Sequence[Endpoint]]) -> dict[str, tuple[Endpoint, ...]]:
    return {model: tuple(members) for model, members in table.items()}


def _diff(before: Mapping[str, tuple[Endpoint, ...]],
          after: Mapping[str, tuple[Endpoint, ...]]) -> dict[str, tuple[Endpoint, ...] | None]:
    """The lists that changed: the new list, or None for a model that has none any more."""
    out: dict[str, tuple[Endpoint, ...] | None] = {}
    for model in before.keys() | after.keys():
        old, new = before.get(model), after.get(model)
        if old != new:
            out[model] = new
    return out
