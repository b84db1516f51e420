"""`FeedPublisher`: the router feed's source (R-10.1..R-10.4), as the rest of the control plane sees it.

It holds the feed's parts and hands each call to the one that owns it: the change log
(`changelog`), the reports taken in (`reports`), the routers' table (`routers`), the key refresh
(`keyrefresh`), the lease split (`leases`), the affinity homes (`homes`), the request log's
pruning (`requestlog`), and the event loop they all run on, with the one crossing into it from other threads (`loop.FeedLoop.call`).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Mapping, Sequence

from llmgw.catalog import Catalog, CatalogHolder
from llmgw.config import GatewayConfig
from llmgw.contracts.endpoints import Endpoint
from llmgw.contracts.feed import Ack, EngineLoad, KeyEntry, Refusal, Report, RouterCounters, Snapshot
from llmgw.control.feed.changelog import ChangeLog, FeedListener
from llmgw.control.feed.homes import HomeTable
from llmgw.control.feed.keyrefresh import KeyRefresh
from llmgw.control.feed.leases import LeaseBook
from llmgw.control.feed.loop import FeedLoop
from llmgw.control.feed.reports import ReportIntake
from llmgw.control.feed.requestlog import RequestLogPruner
from llmgw.control.feed.routers import RouterTable
from llmgw.control.feed.routing import endpoint_lists, gateway_settings, routed_models, static_endpoints
from llmgw.keys import key_entries
from llmgw.store import Store


class FeedPublisher:
    """The router feed's source of truth, on the control plane's event loop."""

    def __init__(self, holder: CatalogHolder, store: Store, gateway: GatewayConfig, *, epoch: str | None = None,
                 note_demand: Callable[[str], None] | None = None, clock: Callable[[], float] = time.monotonic,
                 response_secret: str | None = None):
        self.holder = holder
        self.store = store
        self.epoch = epoch or secrets.token_hex(8)
        self.note_demand = note_demand  # the reconciler's: an on-demand model was asked for
        self._loop = FeedLoop()
        # The response secret seals the Responses ids routers hand out: the state
        # directory's, so ids outlive a restart; without one (tests), one for this publisher's life.
        self._changes = ChangeLog(self.epoch, models=routed_models(holder.current),
                                  static=endpoint_lists(static_endpoints(holder.current)),
                                  keys=store.read_sync(key_entries), gateway=gateway_settings(gateway),
                                  response_secret=response_secret or secrets.token_hex(32))
        self._routers = RouterTable(self._changes, clock)  # `clock`: when reports arrive, for staleness
        self._homes = HomeTable(self._changes, clock)
        self._leases = LeaseBook(self._changes, self._routers)
        self._intake = ReportIntake(store, self._routers, self._homes, self._leases, note_demand)
        self._keys = KeyRefresh(store, self._changes)
        self._request_log = RequestLogPruner(store, gateway.request_log.keep)
        holder.subscribe(self._catalog_changed)

    # -- what the control plane calls (from any thread) -------------------------------------------

    def set_endpoints(self, table: Mapping[str, Sequence[Endpoint]]) -> None:
        """Replace every pushed endpoint list (static ones stay, R-6.10): a Change with only the
        models whose lists changed, or nothing when none did."""
        self._loop.call(self._changes.set_pushed, endpoint_lists(table))

    def set_gateway(self, gateway: GatewayConfig) -> None:
        """New gateway settings: a Change with `gateway` when what routers read changed, and the
        request log's `keep` from the next pruning on."""
        self._request_log.keep = gateway.request_log.keep
        self._loop.call(self._changes.set_gateway, gateway_settings(gateway))

    def abandon(self, replica_id: str) -> int:
        """Routers stop waiting on a replica the control plane gave up. Returns the requests in
        flight to it as last reported, -1 when no router has reported recently (unknown)."""
        in_flight = self._routers.reported_in_flight(replica_id)
        self._loop.call(self._changes.abandon, replica_id)
        return -1 if in_flight is None else in_flight

    def _catalog_changed(self, catalog: Catalog) -> None:
        self._loop.call(self._changes.swap_catalog, routed_models(catalog), endpoint_lists(static_endpoints(catalog)))

    # -- the change log -----------------------------------------------------------------------------

    def mark_ready(self) -> None:
        """The first endpoints are in (adoption has pushed them): publish version 1, with the homes
        reported so far, and start the key refresh, the lease split, the homes' expiry and the
        request log's pruning."""
        self._loop.bind()
        if self._changes.publish_first(self._homes.published()):
            self._loop.start(self._keys.refresh_forever, "feed-keys")
            self._loop.start(self._leases.rebalance_forever, "feed-leases")
            self._loop.start(self._homes.expire_forever, "feed-homes")
            self._loop.start(self._request_log.prune_forever, "feed-request-log")

    async def ready(self) -> None:
        await self._changes.ready()

    def current(self) -> Snapshot | None:
        return self._changes.current()

    def listen(self) -> FeedListener:
        return self._changes.listen()

    def set_keys(self, keys: tuple[KeyEntry, ...]) -> None:
        """These are the keys in force now: a Change with `keys` when they differ from the last."""
        self._changes.set_keys(keys)

    async def refresh_keys(self) -> None:
        """Read the keys in force off the loop; a Change with `keys` when they differ."""
        await self._keys.refresh()

    def rebalance(self) -> None:
        """Split every limited key's limits among the routers heard recently (R-6.16)."""
        self._leases.rebalance()

    def expire_homes(self) -> None:
        """Forget the homes no router has reported for HOME_IDLE_SECONDS (R-6.5d)."""
        self._homes.expire()

    # -- reports ------------------------------------------------------------------------------------

    async def apply_report(self, report: Report, refused: tuple[Refusal, ...] = ()) -> Ack:
        """Count a report's usage once per (router, seq) and take its state (see `reports`)."""
        return await self._intake.apply_report(report, refused)

    def report_refused(self, router: str | None, reason: str) -> None:
        """A report refused as a whole (R-10.8): counted for its router, when it names one."""
        self._intake.report_refused(router, reason)

    async def prune_request_log(self) -> int:
        """Delete the request records `gateway.request_log.keep` no longer keeps now (it runs every
        few seconds by itself once the feed is ready); returns how many went."""
        return await self._request_log.prune()

    # -- what the reconciler and the admin read -------------------------------------------------------

    def take_last_used(self) -> dict[str, float]:
        return self._routers.take_last_used()

    def outstanding(self, replica_id: str) -> int:
        return self._routers.outstanding(replica_id)

    def reported_in_flight(self, replica_id: str) -> int | None:
        return self._routers.reported_in_flight(replica_id)

    def engine_load(self, replica_id: str) -> EngineLoad | None:
        return self._routers.engine_load(replica_id)

    def adapter_use(self):
        return self._routers.adapter_use()

    def adapter_quiet(self, replica_id: str, adapter: str, version: int | None) -> bool:
        return self._routers.adapter_quiet(replica_id, adapter, version)

    def version(self) -> int | None:
        """The version of the latest change published (endpoint tables included), None before the first."""
        current = self._changes.current()
        return None if current is None else current.version

    def router_counters(self) -> list[RouterCounters]:
        return self._routers.counters()

    def routers(self) -> list[dict]:
        """The routers that report to this control plane, for operators (`RouterTable.listing`)."""
        return self._routers.listing(self._intake.refusals())

    async def close(self) -> None:
        await self._loop.close()
        self._changes.close()
