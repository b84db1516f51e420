"""The router's state as its feed sets it, and what its reports carry (R-10.1).

The router is fed only by the router feed (llmgw.contracts.feed): `FeedState.apply()` takes the
control plane's Snapshot and then each Change (models, endpoint lists, keys, gateway settings —
the traces' collector among them, R-6.21 —, replicas given up), and `report_fields()` gives what
the router's next Report carries: usage and key use counted since the last report (handed over
once), and its state as of now (last use per replica for R-7.1, requests in flight for drains
(R-4.2), engine loads (R-6.5), on-demand models asked for with no replica (R-6.8)), and the
request log's records kept since the last report (R-6.20, handed over once). It reads no catalog,
configuration or database: whoever feeds it (in process, or over a socket) decides where those
come from.

A feed is given a `FedRouter`, what it needs of the router and no more: `FeedState` is one,
and the feeds' tests give their own.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import Protocol

from llmgw.contracts.feed import Change, FeedError, GatewaySettings, RoutedModel, Snapshot
from llmgw.router import limits, response_ids
from llmgw.router.balancer import Balancer
from llmgw.router.errors import ModelLoading
from llmgw.router.fairqueue import FairQueue, replica_places
from llmgw.router.keys import KeyRing
from llmgw.router.metrics import RouterMetrics
from llmgw.router.proxy import DEFAULT_MAX_ANSWER, Forwarder
from llmgw.router.requestlog import RequestLog
from llmgw.router.tracing import Tracing
from llmgw.router.usage import UsageMeter

log = logging.getLogger(__name__)

DEFAULT_REQUEST_TIMEOUT = 600.0  # until the first snapshot says otherwise
# Until the first snapshot: no request is served before it (each gets a 503), so no body is taken.
NO_GATEWAY = GatewaySettings(max_body=0, request_timeout=DEFAULT_REQUEST_TIMEOUT, on_demand_wait=0.0,
                             queue_wait=0.0, max_answer=DEFAULT_MAX_ANSWER)


class FedRouter(Protocol):
    """What a feed (FeedClient over a socket, LocalFeed in one process) needs of the router it feeds."""

    router_id: str | None  # set by the feed: which of the snapshot's leases are this router's
    # Set by the feed: called on the loop when an on-demand model is asked for with no replica,
    # so that the feed reports at once. None: nobody starts replicas on demand.
    on_demand: Callable[[], None] | None
    feed_status: dict | None  # set by the feed: its state, which /healthz shows to a valid key
    snapshot_age: Callable[[], float | None] | None  # set by the feed: seconds since it last confirmed the snapshot

    @property
    def snapshot(self) -> Snapshot | None: ...

    def apply(self, message: Snapshot | Change) -> None: ...

    def report_fields(self) -> dict: ...


class FeedState:
    """What the feed has set in the router (the snapshot, its models, gateway settings, keys,
    capacities, leases, homes), and what the router counts for its reports."""

    def __init__(self, *, balancer: Balancer, fairqueue: FairQueue, limiter: limits.Limiter, usage: UsageMeter,
                 metrics: RouterMetrics):
        self.keys = KeyRing()
        self.balancer = balancer
        self.fairqueue = fairqueue
        self.limiter = limiter
        self.usage = usage
        self.metrics = metrics
        self.request_log = RequestLog()  # the records this router keeps for its reports
        self.tracing: Tracing | None = None  # set by the router: told each gateway settings' collector (R-6.21)
        self.router_id: str | None = None
        # A request for an on-demand model with no replica does not wait for one while this is None.
        self.on_demand: Callable[[], None] | None = None
        self.feed_status: dict | None = None
        self.snapshot_age: Callable[[], float | None] | None = None
        self.snapshot: Snapshot | None = None  # routed with now, None before the first one; set by apply only
        self.models: Mapping[str, RoutedModel] = {}
        self.gateway = NO_GATEWAY
        self.response_ids: response_ids.ResponseIds | None = None  # from the snapshot's secret
        self._demand: dict[str, None] = {}  # on-demand models asked for since the last report, in order
        self._arrivals: dict[str, asyncio.Event] = {}  # on-demand models someone is waiting for
        self._forwarder: Forwarder | None = None

    def attach(self, forwarder: Forwarder) -> None:
        """The forwarder of the running app: it is given the gateway settings and the response-id
        secret now and as they change, and told of replicas given up."""
        self._forwarder = forwarder
        forwarder.response_ids = self.response_ids
        forwarder.max_answer = self.gateway.max_answer

    def apply(self, message: Snapshot | Change) -> None:
        """Apply a Snapshot (replaces everything) or the Change that follows the current version.

        A Change that does not follow (a gap, another epoch, none before a snapshot) raises
        FeedError and changes nothing: the caller asks for a snapshot again. Call on the loop."""
        old = self.snapshot
        if isinstance(message, Snapshot):
            new = message
        elif isinstance(message, Change):
            if old is None:
                raise FeedError(f"change {message.epoch}/{message.version} before any snapshot")
            new = old.apply(message)
        else:
            raise TypeError(f"not a snapshot or a change: {type(message).__name__}")
        self.snapshot = new
        if old is None or new.response_secret != old.response_secret:
            self.response_ids = response_ids.ResponseIds(new.response_secret)
            if self._forwarder is not None:
                self._forwarder.response_ids = self.response_ids
        if old is None or new.keys is not old.keys:
            self.keys.replace(new.keys)
            self.limiter.keep({k.id for k in new.keys if k.limits is not None or k.model_limits})
        if old is None or new.gateway is not old.gateway:
            self._set_gateway(new.gateway)
        if old is None or new.leases is not old.leases:
            self.limiter.set_leases({router: {key_id: lease.share for key_id, lease in per_key.items()}
                                     for router, per_key in new.leases.items()}, self.router_id, time.monotonic())
        installed = old is None or new.models is not old.models or new.endpoints is not old.endpoints
        if installed:
            self.models = new.models
            self._install(new)
        elif new.leases is not old.leases:  # the routers sharing the replicas changed
            self.set_capacities()
        # The control plane's homes replace this router's own (R-6.5d): all of them with a snapshot
        # or new lists (a pool made anew starts from them), else what the change sets.
        if installed or isinstance(message, Snapshot):
            if new.homes:
                self.balancer.set_homes(new.homes, time.monotonic())
        elif message.homes:
            self.balancer.set_homes(message.homes, time.monotonic())
        if self._forwarder is not None:
            if isinstance(message, Change):
                abandon = message.abandon
            else:  # in place of changes this router missed: those it has not acted on yet
                seen = set(old.abandoned) if old is not None and old.epoch == new.epoch else ()
                abandon = [replica_id for replica_id in new.abandoned if replica_id not in seen]
            for replica_id in abandon:
                self._forwarder.abandon(replica_id)

    def report_fields(self) -> dict:
        """Keyword arguments for a contracts.feed.Report, less router, seq and sent_at.

        Usage, key use, demand and the request log's records are handed over once (the next call
        has only what came after); the rest is the router's state as of now."""
        usage, key_use = self.usage.drain()
        demand, self._demand = tuple(self._demand), {}
        inflight: dict[str, int] = {}
        for up in self.balancer.counted():
            if up.outstanding > 0:
                inflight[up.replica_id] = inflight.get(up.replica_id, 0) + up.outstanding
        loads = {}
        for up in self.balancer.upstreams():
            if up.engine is not None and up.replica_id not in loads:
                loads[up.replica_id] = up.engine
        snapshot = self.snapshot
        return {"usage": usage, "key_use": key_use, "last_used": self.balancer.last_used(), "inflight": inflight,
                "engine_load": loads, "demand": demand,
                "snapshot": None if snapshot is None else (snapshot.epoch, snapshot.version),
                "counters": self.metrics.counters(), "asked": self.limiter.take_asked(),
                "homes": self.balancer.take_homes(), "requests": self.request_log.take(),
                "adapter_use": self.balancer.adapter_use()}

    def outstanding(self, replica_id: str) -> int:
        """Requests this router has in flight to a replica, still counted after it left the lists."""
        return self.balancer.outstanding(replica_id)

    def engine_load(self, replica_id: str):
        """The replica's engine load as this router last polled it (EngineLoad), None when unknown."""
        return self.balancer.engine_load(replica_id)

    def set_capacities(self) -> None:
        """This router's places of each model and their headroom (R-6.17). A model's places are
        the sum over its endpoints of replica_places (the profile's `concurrency`, else the slots
        the engine reported, else the default), divided among the routers of the last leases
        (every router the control plane heard recently), so that routers together give a replica
        no more than that. Called with each snapshot, when the routers sharing them change, and
        after a poll in which an engine's slot count changed."""
        snapshot = self.snapshot
        routers = sorted(snapshot.leases) if snapshot is not None else []
        index = routers.index(self.router_id) if self.router_id in routers else None
        capacities, headrooms = {}, {}
        balancer = self.balancer
        for name, model in self.models.items():
            places = headroom = 0
            for up in balancer.endpoints(name):
                more, spare = replica_places(model.concurrency, up.slots)
                places += more
                headroom += spare
            capacities[name] = router_share(places, len(routers), index)
            headrooms[name] = router_share(headroom, len(routers), index, at_least=0)
        self.fairqueue.set_capacities(capacities, headrooms)

    # -- on-demand models asked for with no replica (R-6.8) -------------------------------------------

    def note_demand(self, model: str) -> None:
        """An on-demand model was asked for with no replica: in the next report, and the feed told now."""
        self._demand[model] = None
        if self.on_demand is not None:
            try:
                self.on_demand()
            except Exception:
                log.exception("telling the feed about demand for on-demand model %s failed", model)

    async def await_arrival(self, model: str, since: float, what: str = "is starting on demand") -> None:
        """Until the feed brings `model` an endpoint (or, for a LoRA adapter, word that its load
        failed), at most gateway.on_demand_wait from `since`; then ModelLoading."""
        wait = self.gateway.on_demand_wait
        remaining = since + wait - time.monotonic()
        event = self._arrivals.get(model)
        if event is None:
            event = self._arrivals[model] = asyncio.Event()
        if remaining > 0:
            try:
                await asyncio.wait_for(event.wait(), remaining)
                return
            except asyncio.TimeoutError:
                pass
        raise ModelLoading(f"model {model!r} {what} and was not ready within {wait:.0f} s; retry later")

    # -- applying a snapshot ----------------------------------------------------------------------

    def _set_gateway(self, gateway: GatewaySettings) -> None:
        self.gateway = gateway
        self.fairqueue.max_waiting_per_key = gateway.max_waiting_per_key
        self.request_log.configure(gateway)
        if self.tracing is not None:
            self.tracing.configure(gateway.otlp_endpoint, self.router_id)
        if self._forwarder is not None:
            self._forwarder.set_read_timeout(gateway.request_timeout)
            self._forwarder.max_answer = gateway.max_answer

    def _install(self, snapshot: Snapshot) -> None:
        endpoints = snapshot.endpoints
        self.balancer.loading_bases = frozenset(m.adapter_of for m in snapshot.models.values()
                                                if m.loadable and m.adapter_of is not None)
        self.balancer.replace(endpoints, {name: model.routing for name, model in snapshot.models.items()})
        self.set_capacities()
        for model, members in endpoints.items():
            if members:
                event = self._arrivals.pop(model, None)
                if event is not None:
                    event.set()
        balancer = self.balancer
        for model in [m for m in self._arrivals if balancer.has_endpoints(m) or balancer.adapter_error(m)]:
            self._arrivals.pop(model).set()  # a LoRA adapter loaded, or its load failed


def router_share(places: int, routers: int, index: int | None, at_least: int = 1) -> int:
    """One router's part of `places` shared by `routers` routers: `index` is its place among them
    in the order of their ids (None: not among them yet, the smaller part). The parts add up to
    `places`, each at least `at_least`: one for a model's places, so every router can serve (with
    more routers than places they together exceed it); none for the headroom, which is room above
    the places. 0 stays 0 (no endpoints: nothing is held back)."""
    if places <= 0 or routers <= 1:
        return places
    part, rest = divmod(places, routers)
    return max(at_least, part + (1 if index is not None and index < rest else 0))
