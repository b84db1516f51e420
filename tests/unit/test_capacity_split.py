"""A model's places divided among the routers that share its replicas (R-6.17, R-6.16).

Each router has its own fair queue. With several routers (workers of one supervisor, or routers on
other hosts) each must hold only its part of what a replica accepts, or together they would give a
replica the profile's concurrency once per router.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from llmgw.catalog import Catalog, CatalogHolder
from llmgw.config import GatewayConfig, ModelConfig, ProfileConfig
from llmgw.contracts.endpoints import Endpoint
from llmgw.contracts.feed import Change, GatewaySettings, Lease, Report, RoutedModel, Snapshot
from llmgw.control.feed import FeedPublisher
from llmgw.router.app import Router
from llmgw.router.fairqueue import DEFAULT_REPLICA_CONCURRENCY
from llmgw.router.feedstate import router_share
from llmgw.store import Store

GATEWAY = GatewaySettings(max_body=1 << 20, request_timeout=60.0, on_demand_wait=5.0)


def endpoints(count: int) -> tuple[Endpoint, ...]:
    return tuple(Endpoint(f"r{i}", "m", f"http://127.0.0.1:{20000 + i}", None) for i in range(count))


def snapshot(concurrency: int | None, replicas: int, leases: dict) -> Snapshot:
    models = {"m": RoutedModel("m", "vllm", None, "least-outstanding", False, concurrency=concurrency),
              "idle": RoutedModel("idle", "vllm", None, "least-outstanding", False, concurrency=4)}
    return Snapshot("e", 1, models, {"m": endpoints(replicas)}, (), GATEWAY, leases=leases)


def router(router_id: str) -> Router:
    made = Router(registry=CollectorRegistry())
    made.feed.router_id = router_id
    return made


def capacities(routers: list[Router], model: str = "m") -> list[int]:
    return [r.fairqueue.models[model].capacity for r in routers]


def test_parts_add_up_to_the_places_and_each_router_gets_one():
    assert [router_share(5, 2, i) for i in (0, 1)] == [3, 2]
    assert [router_share(6, 3, i) for i in (0, 1, 2)] == [2, 2, 2]
    assert [router_share(1, 2, i) for i in (0, 1)] == [1, 1]  # fewer places than routers: one each
    assert router_share(7, 1, None) == 7 and router_share(7, 0, None) == 7  # alone: every place
    assert router_share(7, 2, None) == 3  # not in the split yet: the smaller part
    assert router_share(0, 2, 0) == 0  # no endpoints: nothing is held back
    assert [router_share(1, 2, i, at_least=0) for i in (0, 1)] == [1, 0]  # a headroom: a router may get none


def test_two_routers_together_hold_a_replicas_concurrency_not_twice_it():
    ra, rb = router("ra"), router("rb")
    both = {"ra": {}, "rb": {}}  # the split names every router heard recently, limited keys or not
    for r in (ra, rb):
        r.apply(snapshot(3, 1, both))
    print("concurrency 3, one replica, two routers:", capacities([ra, rb]))
    assert capacities([ra, rb]) == [2, 1]
    assert capacities([ra, rb], "idle") == [0, 0]  # no endpoints
    first = snapshot(3, 1, both)
    for r in (ra, rb):  # a change of endpoints alone: the parts follow
        r.apply(first)
        r.apply(Change("e", 2, endpoints={"m": endpoints(2)}))
    assert capacities([ra, rb]) == [3, 3]
    for r in (ra, rb):  # a change of the split alone
        r.apply(Change("e", 3, leases={}))
    assert capacities([ra, rb]) == [6, 6]  # fewer than two routers heard: one holds every place
    for r in (ra, rb):
        r.apply(Change("e", 4, leases={"ra": {"k": Lease(0.5)}, "rb": {"k": Lease(0.5)}, "rc": {"k": Lease(0.5)}}))
    assert capacities([ra, rb]) == [2, 2]
    newcomer = router("rd")  # not in the split yet: the smaller part, until the next split names it
    newcomer.apply(snapshot(None, 1, both))
    assert capacities([newcomer]) == [DEFAULT_REPLICA_CONCURRENCY // 2]


async def test_the_publisher_names_every_recent_router_in_the_split_without_limited_keys(tmp_path):
    store = Store.open(tmp_path / "state.db")
    catalog = Catalog.build(file_models=[ModelConfig(name="m", profile="p")],
                            profiles={"p": ProfileConfig(engine="vllm", concurrency=2)})
    publisher = FeedPublisher(CatalogHolder(catalog), store, GatewayConfig(), epoch="e")
    try:
        publisher.mark_ready()
        await publisher.apply_report(Report("ra", 1, 1.0))
        await publisher.apply_report(Report("rb", 1, 1.0))
        publisher.rebalance()
        assert dict(publisher.current().leases) == {"ra": {}, "rb": {}}
    finally:
        await publisher.close()
        store.close()
