"""Each limited key's budget split among the routers: leases on the feed, demand in reports (R-6.16)."""

from __future__ import annotations

import json

import pytest

from llmgw.catalog import Catalog, CatalogHolder
from llmgw.config import GatewayConfig, ModelConfig, ProfileConfig
from llmgw.contracts.feed import (Change, FeedError, GatewaySettings, KeyEntry, Lease, Limits, Report, Snapshot, from_wire,
                                  to_wire)
from llmgw.control.feed import LEASE_FLOOR, FeedPublisher, split_leases
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


LIMITED = KeyEntry("k1", "limited", "1" * 64, "sk-llmgw-1", None, limits=Limits(rpm=600))
PER_MODEL = KeyEntry("k2", "per model", "2" * 64, "sk-llmgw-2", None, model_limits={"m": Limits(tpm=1000)})
FREE = KeyEntry("k3", "free", "3" * 64, "sk-llmgw-3", None)


@pytest.mark.parametrize("routers,demand,expected", [
    pytest.param([], {}, {}, id="no-router"),
    pytest.param(["ra"], {"ra": {"k1": 50.0}}, {}, id="one-router-holds-every-limit-whole"),
    pytest.param(["ra", "rb"], {}, {"ra": {"k1": 0.5, "k2": 0.5}, "rb": {"k1": 0.5, "k2": 0.5}},
                 id="nobody-asked-split-evenly"),
    pytest.param(["ra", "rb"], {"ra": {"k1": 90.0}}, {"ra": {"k1": 1 - LEASE_FLOOR, "k2": 0.5},
                                                      "rb": {"k1": LEASE_FLOOR, "k2": 0.5}},
                 id="one-that-has-not-asked-keeps-the-floor"),
    pytest.param(["ra", "rb", "rc"], {"ra": {"k1": 1.0}, "rb": {"k1": 2.0}, "gone": {"k1": 1000.0}},
                 {"ra": {"k1": 0.33, "k2": 0.33}, "rb": {"k1": 0.61, "k2": 0.33}, "rc": {"k1": 0.05, "k2": 0.33}},
                 id="in-proportion-above-the-floor-rounded-down"),
])
def test_r6_16_split_leases_is_a_function_of_routers_keys_and_demand(routers, demand, expected):
    leases = split_leases(routers, (LIMITED, PER_MODEL, FREE), demand)
    assert {r: {k: lease.share for k, lease in per_key.items()} for r, per_key in leases.items()} == expected
    for key_id in ("k1", "k2"):  # together the routers hold no more than the limit
        assert sum(per_key[key_id].share for per_key in leases.values()) <= 1


def test_r6_16_the_floor_is_at_most_an_even_share_and_a_share_at_least_a_hundredth():
    leases = split_leases([f"r{i}" for i in range(40)], (LIMITED,), {"r0": {"k1": 1e9}})
    assert leases["r1"]["k1"] == Lease(0.02)  # the floor is 1/40 here, rounded down to hundredths
    assert sum(per_key["k1"].share for per_key in leases.values()) <= 1
    assert split_leases(["ra", "rb"], (LIMITED,), {"ra": {"k1": 5.0}}, floor=0.9)["rb"]["k1"] == Lease(0.5)
    crowd = split_leases([f"r{i:03}" for i in range(150)], (LIMITED,), {})
    assert {per_key["k1"] for per_key in crowd.values()} == {Lease(0.01)}


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
