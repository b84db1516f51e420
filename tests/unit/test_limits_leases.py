"""Each limited key's budget split among the routers: leases on the feed, demand in reports (R-6.16)."""

from __future__ import annotations

import json

import pytest

from llmgw.catalog import Catalog, CatalogHolder
from llmgw.config import GatewayConfig, ModelConfig, ProfileConfig
from llmgw.contracts.feed import Change, FeedError, GatewaySettings, Lease, Limits, Report, Snapshot, from_wire, to_wire
from llmgw.control.feed import LEASE_FLOOR, FeedPublisher
from llmgw.keys import KeySettings, create_key, key_entries
from llmgw.store import Store


def roundtrip(message):
    return from_wire(json.loads(json.dumps(to_wire(message))))


def test_r6_16_leases_and_demand_travel_on_the_wire():
    leases = {"ra": {"k1": Lease(0.75)}, "rb": {"k1": Lease(0.25)}}
    snapshot = Snapshot("e", 1, {}, {}, (), GatewaySettings(1000, 30.0, 5.0), leases=leases)
    back = roundtrip(snapshot)
    assert back.leases == leases
    assert "leases" not in to_wire(Snapshot("e", 1, {}, {}, (), GatewaySettings(1000, 30.0, 5.0)))
    change = roundtrip(Change("e", 2, leases={"ra": {"k1": Lease(0.5)}}))
    assert change.leases == {"ra": {"k1": Lease(0.5)}}
    assert back.apply(change).leases == {"ra": {"k1": Lease(0.5)}}
    assert back.apply(Change("e", 2)).leases == leases  # a change without leases keeps them
    assert roundtrip(Change("e", 2)).leases is None
    report = roundtrip(Report("ra", 1, 1.0, asked={"k1": 40}))
    assert report.asked == {"k1": 40} and roundtrip(Report("ra", 1, 1.0)).asked == {}
    wire = to_wire(Change("e", 2, leases={"ra": {"k1": Lease(0.5)}}))
    for bad, message in [({"ra": {"k1": 0}}, r"change.leases\['ra'\]\['k1'\]: a share must be above 0"),
                         ({"ra": {"k1": 1.5}}, "at most 1, got 1.5"),
                         ({"ra": {"k1": "half"}}, r"expected int or float, got str"),
                         ({"ra": [0.5]}, r"change.leases\['ra'\]: expected dict")]:
        with pytest.raises(FeedError, match=message):
            from_wire({**wire, "leases": bad})
    with pytest.raises(FeedError, match=r"report.asked\['k1'\]: must be at least 0"):
        from_wire({**to_wire(Report("ra", 1, 1.0)), "asked": {"k1": -1}})


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_r6_16_publisher_splits_each_limited_key_by_demand_with_a_floor(tmp_path):
    store = Store.open(tmp_path / "state.db")
    store.write_sync(lambda db: create_key(db, "limited", settings=KeySettings(limits=Limits(rpm=600))))
    store.write_sync(lambda db: create_key(db, "free"))
    limited, _ = store.read_sync(key_entries)
    catalog = Catalog.build(file_models=[ModelConfig(name="m", profile="p")], profiles={"p": ProfileConfig(engine="vllm")})
    clock = Clock()
    publisher = FeedPublisher(CatalogHolder(catalog), store, GatewayConfig(), epoch="e", clock=clock)
    try:
        publisher.mark_ready()
        await publisher.apply_report(Report("ra", 1, 1.0))
        publisher.rebalance()
        assert publisher.current().leases == {}  # one router holds every limit whole: nothing to send

        await publisher.apply_report(Report("rb", 1, 1.0))
        publisher.rebalance()
        assert publisher.current().leases == {"ra": {limited.id: Lease(0.5)}, "rb": {limited.id: Lease(0.5)}}

        await publisher.apply_report(Report("ra", 2, 2.0, asked={limited.id: 90}))
        publisher.rebalance()
        leases = publisher.current().leases
        print("after ra asked 90, rb nothing:", dict(leases))
        assert leases["rb"][limited.id] == Lease(LEASE_FLOOR)  # one that has not asked keeps a few
        assert leases["ra"][limited.id] == Lease(1 - LEASE_FLOOR)
        assert sum(per_key[limited.id].share for per_key in leases.values()) <= 1

        await publisher.apply_report(Report("rb", 2, 2.0, asked={limited.id: 135}))
        publisher.rebalance()  # ra's 90 now counts half: 45 against 135
        leases = publisher.current().leases
        assert leases["rb"][limited.id].share > 0.7 > leases["ra"][limited.id].share
        version = publisher.current().version
        publisher.rebalance()  # no new demand: the past halves for both, the split stays, no Change
        assert publisher.current().version == version
        await publisher.apply_report(Report("ra", 3, 3.0, asked={limited.id: 400}))
        publisher.rebalance()
        assert publisher.current().version == version + 1
        assert publisher.current().leases["ra"][limited.id].share > 0.7

        clock.now += 60  # both silent: no router heard recently, no leases
        publisher.rebalance()
        assert publisher.current().leases == {}
    finally:
        await publisher.close()
        store.close()
