"""The control plane's router feed publisher (R-10.1): what it publishes, and how it takes reports."""

from __future__ import annotations

import asyncio

import pytest

from llmgw.catalog import Catalog, CatalogHolder
from llmgw.config import EngineConfig, GatewayConfig, ModelConfig, ProfileConfig, ScalingConfig, StaticEndpoint
from llmgw.contracts.endpoints import Endpoint
from llmgw.contracts.feed import ABANDONED_KEPT, HOME_IDLE_SECONDS, Change, EngineLoad, Report, Snapshot, UsageRow
from llmgw.control import feed as feed_module
from llmgw.control.feed import LISTENER_QUEUE, FeedPublisher
from llmgw.keys import create_key, revoke_key
from llmgw.store import Store

PROFILES = {"p": ProfileConfig(engine="vllm"), "s": ProfileConfig(engine="sglang"), "c": ProfileConfig(engine="custom")}
ENGINES = {"custom": EngineConfig(command=["my-engine", "--port", "{port}"])}
MODELS = [ModelConfig(name="m", profile="p", served_name="m-upstream", routing="prefix", fallback="s"),
          ModelConfig(name="s", profile="s", fallback="c"),
          ModelConfig(name="c", profile="c", scaling=ScalingConfig(min=0, max=1)),
          ModelConfig(name="fixed", endpoints=[StaticEndpoint(url="http://10.0.0.9:8000/")])]


def endpoint(replica: str, model: str = "m") -> Endpoint:
    return Endpoint(replica_id=replica, model=model, url=f"http://10.0.0.1:{abs(hash(replica)) % 1000 + 20000}",
                    api_key=f"engine-key-{replica}")


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def store(tmp_path):
    store = Store.open(tmp_path / "state.db")
    yield store
    store.close()


@pytest.fixture
async def publisher(store):
    store.write_sync(lambda db: create_key(db, "alice", ["m"]))
    store.write_sync(lambda db: create_key(db, "gone"))
    store.write_sync(lambda db: revoke_key(db, "gone"))
    holder = CatalogHolder(Catalog.build(file_models=MODELS, profiles=PROFILES, engines=ENGINES))
    asked: list[str] = []
    clock = Clock()
    publisher = FeedPublisher(holder, store, GatewayConfig(max_body=1000, request_timeout=30, on_demand_wait=5),
                              epoch="e", note_demand=asked.append, clock=clock)
    publisher.asked, publisher.clock = asked, clock
    yield publisher
    await publisher.close()


def pending(listener) -> list:
    out = []
    while (message := listener.next_nowait()) is not None:
        out.append(message)
    return out


async def test_r10_1_the_snapshot_holds_models_endpoints_keys_and_settings(publisher):
    listener = publisher.listen()
    publisher.set_endpoints({"m": [endpoint("r1")]})
    assert publisher.current() is None and pending(listener) == []  # nothing before ready
    waiting = asyncio.ensure_future(listener.__anext__())
    publisher.mark_ready()
    await publisher.ready()
    first = await asyncio.wait_for(waiting, 5)
    assert isinstance(first, Snapshot) and first is publisher.current()
    assert (first.epoch, first.version) == ("e", 1)
    models = first.models
    assert {name: m.engine for name, m in models.items()} == {"m": "vllm", "s": "sglang", "c": None, "fixed": None}
    assert models["m"].served_name == "m-upstream" and models["m"].routing == "prefix"
    assert models["m"].fallbacks == ("s", "c") and models["c"].on_demand and not models["m"].on_demand
    assert first.endpoints["m"] == (endpoint("r1"),)
    assert [e.url for e in first.endpoints["fixed"]] == ["http://10.0.0.9:8000"]  # static ones, like any other
    assert [(k.name, k.models) for k in first.keys] == [("alice", frozenset({"m"}))]  # the revoked key is absent
    assert (first.gateway.max_body, first.gateway.request_timeout, first.gateway.on_demand_wait) == (1000, 30.0, 5.0)


async def test_r10_1_an_endpoint_push_changes_only_the_models_whose_lists_changed(publisher):
    publisher.set_endpoints({"m": [endpoint("r1")], "s": [endpoint("r2", "s")]})
    publisher.mark_ready()
    listener = publisher.listen()
    assert isinstance(pending(listener)[0], Snapshot)
    publisher.set_endpoints({"m": [endpoint("r1")], "s": [endpoint("r2", "s")]})
    assert pending(listener) == []  # nothing changed: no change
    publisher.set_endpoints({"m": [endpoint("r1"), endpoint("r3")], "s": [endpoint("r2", "s")]})
    publisher.set_endpoints({"m": [endpoint("r1"), endpoint("r3")], "fixed": []})  # a push leaves static lists alone
    first, second = pending(listener)
    assert isinstance(first, Change) and (first.version, dict(first.endpoints)) == \
        (2, {"m": (endpoint("r1"), endpoint("r3"))})
    assert first.models is None and first.keys is None and first.gateway is None
    assert (second.version, dict(second.endpoints)) == (3, {"s": None})
    current = publisher.current()
    assert current.version == 3 and "s" not in current.endpoints and len(current.endpoints["fixed"]) == 1


async def test_r10_1_a_catalog_swap_is_a_change_with_models_and_changed_static_lists(publisher):
    publisher.mark_ready()
    listener = publisher.listen()
    pending(listener)
    models = [*MODELS[:3], ModelConfig(name="fixed", endpoints=[StaticEndpoint(url="http://10.0.0.8:8000")]),
              ModelConfig(name="new", profile="p")]
    publisher.holder.swap(Catalog.build(file_models=models, profiles=PROFILES, engines=ENGINES))
    (swapped,) = pending(listener)
    assert set(swapped.models) == {"m", "s", "c", "fixed", "new"}
    assert [e.url for e in swapped.endpoints["fixed"]] == ["http://10.0.0.8:8000"] and set(swapped.endpoints) == {"fixed"}
    publisher.holder.swap(Catalog.build(file_models=models, profiles=PROFILES, engines=ENGINES))
    assert pending(listener) == []  # the same catalog again: no change


async def test_r10_1_keys_are_reread_and_a_change_carries_them(publisher, store):
    publisher.mark_ready()
    listener = publisher.listen()
    pending(listener)
    await publisher.refresh_keys()
    assert pending(listener) == []
    store.write_sync(lambda db: create_key(db, "bob"))
    store.write_sync(lambda db: revoke_key(db, "alice"))
    await publisher.refresh_keys()
    (changed,) = pending(listener)
    assert [k.name for k in changed.keys] == ["bob"] and changed.endpoints is None and changed.models is None


async def test_r10_1_a_listener_that_falls_behind_gets_a_snapshot_instead_of_the_backlog(publisher):
    publisher.mark_ready()
    slow, quick = publisher.listen(), publisher.listen()
    pending(slow)
    pending(quick)
    for i in range(LISTENER_QUEUE + 5):
        publisher.set_endpoints({"m": [endpoint(f"r{i}")]})
        assert len(pending(quick)) == 1
    messages = pending(slow)
    assert len(messages) == 1 and isinstance(messages[0], Snapshot)
    assert messages[0].version == LISTENER_QUEUE + 6 and slow.resyncs == 1
    publisher.set_endpoints({"m": [endpoint("last")]})
    (after,) = pending(slow)
    assert isinstance(after, Change) and after.version == LISTENER_QUEUE + 7  # in step again
    slow.close()
    assert slow not in publisher._changes.listeners


def usage_rows(store) -> list[tuple]:
    return store.read_sync(lambda db: [(r["key_id"], r["model"], r["requests"], r["prompt_tokens"])
                                       for r in db["usage"].rows])


def report(seq: int, router: str = "ra", **kw) -> Report:
    return Report(router=router, seq=seq, sent_at=0.0, **kw)


async def test_r10_1_a_report_is_counted_once_per_router_and_seq_across_a_reopen(publisher, store, tmp_path):
    usage = (UsageRow(3600, "k1", "m", 2, 10, 20),)
    first = report(1, usage=usage, key_use={"k1": 123.0})
    assert (await publisher.apply_report(first)).seq == 1
    ack = await publisher.apply_report(first)  # sent again: the ack was lost
    assert (ack.router, ack.seq) == ("ra", 1)
    assert usage_rows(store) == [("k1", "m", 2, 10)]
    await publisher.apply_report(report(1, router="rb", usage=usage))  # another router's seq 1 is its own
    assert usage_rows(store) == [("k1", "m", 4, 20)]
    store.close()

    reopened = Store.open(tmp_path / "state.db")
    try:
        again = FeedPublisher(publisher.holder, reopened, GatewayConfig(), epoch="e2")
        await again.apply_report(first)  # the seq was recorded with the counts: still not counted twice
        assert usage_rows(reopened) == [("k1", "m", 4, 20)]
        await again.apply_report(report(2, usage=usage))
        assert usage_rows(reopened) == [("k1", "m", 6, 30)]
        await again.close()
    finally:
        reopened.close()


async def test_router_seqs_of_routers_not_heard_from_for_a_week_are_pruned(publisher, store):
    store.write_sync(lambda db: db["router_seq"].insert({"router": "old", "seq": 9, "updated_at": 1.0}))
    await publisher.apply_report(report(1, usage=(UsageRow(0, "k", "m", 1, 1, 1),)))
    assert store.read_sync(lambda db: sorted(r["router"] for r in db["router_seq"].rows)) == ["ra"]


async def test_r10_1_state_parts_replace_the_routers_last_and_go_stale(publisher):
    load = EngineLoad(source="vllm", waiting=1, running=2, at=50.0)
    await publisher.apply_report(report(1, inflight={"r1": 2}, last_used={"r1": 100.0}, engine_load={"r1": load}))
    await publisher.apply_report(report(1, router="rb", inflight={"r1": 1}, last_used={"r1": 90.0, "r2": 95.0}))
    assert publisher.outstanding("r1") == 3 and publisher.outstanding("r2") == 0
    assert publisher.take_last_used() == {"r1": 100.0, "r2": 95.0} and publisher.engine_load("r1") == load
    await publisher.apply_report(report(3, inflight={"r1": 1}))
    await publisher.apply_report(report(2, inflight={"r1": 7}))  # a late repeat does not set the state back
    assert publisher.outstanding("r1") == 2 and publisher.engine_load("r1") is None
    publisher.clock.now += feed_module.STALE_SECONDS + 1
    await publisher.apply_report(report(4, router="rb", inflight={"r1": 1}, last_used={"r2": 95.0}))
    assert publisher.outstanding("r1") == 1  # ra has gone silent: its requests no longer count
    assert publisher.take_last_used() == {"r2": 95.0}  # each router's latest report: ra's named none
    publisher.clock.now += feed_module.FORGET_SECONDS + 1
    await publisher.apply_report(report(1, router="rc"))
    assert publisher.take_last_used() == {}  # silent for an hour: forgotten once another router reports
    print("stale after", feed_module.STALE_SECONDS, "s")


async def test_r10_1_requests_in_flight_are_unknown_until_a_router_reports(publisher):
    assert publisher.reported_in_flight("r1") is None  # no router heard: unknown, not 0
    await publisher.apply_report(report(1, inflight={"r1": 2}))
    assert publisher.reported_in_flight("r1") == 2 and publisher.reported_in_flight("r2") == 0
    publisher.clock.now += feed_module.STALE_SECONDS + 1
    assert publisher.reported_in_flight("r1") is None  # the only router went silent


async def test_r10_1_operators_see_which_routers_report_and_with_which_snapshot(publisher):
    from llmgw.admin import render
    from rich.console import Console
    publisher.mark_ready()
    current = publisher.current()
    await publisher.apply_report(report(1, snapshot=(current.epoch, current.version), inflight={"r1": 2}))
    await publisher.apply_report(report(1, router="rb", snapshot=("an-earlier-run", 40)))
    publisher.clock.now += 3
    await publisher.apply_report(report(1, router="rc"))
    routers = {r["router"]: r for r in publisher.routers()}
    assert routers["ra"]["current"] and routers["ra"]["in_flight"] == 2 and routers["ra"]["reported_ago"] == 3
    assert not routers["rb"]["current"] and routers["rb"]["snapshot"] == {"epoch": "an-earlier-run", "version": 40}
    assert routers["rc"]["snapshot"] is None and not routers["rc"]["current"] and not routers["rc"]["stale"]
    publisher.clock.now += feed_module.STALE_SECONDS
    assert {r["router"] for r in publisher.routers() if r["stale"]} == {"ra", "rb"}
    status = {"capacity": [], "gpus_unknown": [], "free_whole_nodes": {}, "unplaceable": [], "idle": [],
              "fabrics": [], "nodes": {"total": 0, "by_state": {}, "by_admin": {}},
              "replicas": {"total": 0, "by_state": {}, "failed_recently": 0}, "models": {"total": 0, "by_state": {}},
              "routers": publisher.routers()}
    console = Console(width=160, record=True)
    console.print(render.status(status))
    text = console.export_text()
    print(text)
    assert f"version {current.version} (current)" in text and "version 40 (behind)" in text
    assert "s ago, silent" in text


async def test_r6_8_demand_in_a_report_reaches_the_reconciler(publisher):
    await publisher.apply_report(report(1, demand=("c",)))
    await publisher.apply_report(report(1, demand=("c",)))  # a repeat is not a new demand
    assert publisher.asked == ["c"]


async def test_r4_2_a_drained_replica_is_not_idle_before_every_router_saw_it_go(publisher):
    publisher.set_endpoints({"m": [endpoint("r1"), endpoint("r2")]})
    publisher.mark_ready()
    v1 = ("e", 1)
    await publisher.apply_report(report(1, snapshot=v1))
    await publisher.apply_report(report(1, router="rb", snapshot=v1))
    await publisher.apply_report(report(1, router="old", snapshot=("an-earlier-run", 40)))
    publisher.clock.now += feed_module.STALE_SECONDS + 1  # "old" is not heard from any more
    await publisher.apply_report(report(2, snapshot=v1))
    await publisher.apply_report(report(2, router="rb", snapshot=v1))
    assert publisher.outstanding("r1") == 0

    publisher.set_endpoints({"m": [endpoint("r2")]})  # version 2 takes r1 away
    assert publisher.current().version == 2
    # Both routers last reported with version 1: a request they sent r1 since is not in it.
    assert publisher.outstanding("r1") == 1 and publisher.outstanding("r2") == 0
    await publisher.apply_report(report(3, snapshot=("e", 2)))
    assert publisher.outstanding("r1") == 1  # rb has not caught up yet
    await publisher.apply_report(report(3, router="rb", snapshot=("e", 2), inflight={"r1": 2}))
    assert publisher.outstanding("r1") == 2  # caught up, and it still has two on r1
    await publisher.apply_report(report(4, router="rb", snapshot=("e", 2)))
    assert publisher.outstanding("r1") == 0  # every router saw it go, none has a request left on it


async def test_r10_1_a_listener_that_fell_behind_still_learns_which_replicas_were_abandoned(publisher):
    publisher.mark_ready()
    slow = publisher.listen()
    pending(slow)
    publisher.abandon("lost")
    for i in range(LISTENER_QUEUE + 5):
        publisher.set_endpoints({"m": [endpoint(f"r{i}")]})
    (resync,) = pending(slow)
    assert isinstance(resync, Snapshot) and resync.abandoned == ("lost",)
    for i in range(ABANDONED_KEPT + 3):
        publisher.abandon(f"later-{i}")
    kept = publisher.listen()
    (fresh,) = pending(kept)
    assert len(fresh.abandoned) == ABANDONED_KEPT and fresh.abandoned[-1] == f"later-{ABANDONED_KEPT + 2}"


async def test_r10_1_abandon_is_a_change_and_answers_the_last_known_count(publisher):
    publisher.set_endpoints({"m": [endpoint("r1")]})
    publisher.mark_ready()
    listener = publisher.listen()
    pending(listener)
    assert publisher.abandon("r1") == -1  # no router has reported: unknown
    await publisher.apply_report(report(1, inflight={"r1": 2}))
    assert publisher.abandon("r1") == 2
    first, second = pending(listener)
    assert (first.version, first.abandon, first.endpoints) == (2, ("r1",), None) and second.abandon == ("r1",)


async def test_r6_5d_the_first_home_reported_for_a_key_is_every_routers(publisher):
    """Routers agree on homes through the publisher: the first reported stays, a router that homed
    the key elsewhere is told it again, a home whose replica left is replaced, and one nobody
    reported for HOME_IDLE_SECONDS is forgotten (the snapshot no longer names it)."""
    publisher.set_endpoints({"m": [endpoint("r1"), endpoint("r2")]})
    publisher.mark_ready()
    listener = publisher.listen()
    pending(listener)
    await publisher.apply_report(report(1, homes={"m": {7: "r1", 9: "r2"}, "s": {7: "r1"}}))
    [change] = pending(listener)
    assert dict(change.homes["m"]) == {7: "r1", 9: "r2"} and "s" not in change.homes  # s has no such replica
    assert dict(publisher.current().homes["m"]) == {7: "r1", 9: "r2"}

    await publisher.apply_report(report(1, router="rb", homes={"m": {7: "r2", 11: "r1"}}))
    [change] = pending(listener)
    assert dict(change.homes["m"]) == {7: "r1", 11: "r1"}  # 7 told again as the table has it
    assert dict(publisher.current().homes["m"]) == {7: "r1", 9: "r2", 11: "r1"}
    await publisher.apply_report(report(1, router="rb", homes={"m": {7: "r2"}}))  # a repeat of seq 1
    assert pending(listener) == []
    await publisher.apply_report(report(2, homes={"m": {9: "r2"}}))  # the same home again: a touch, no change
    assert pending(listener) == []

    publisher.set_endpoints({"m": [endpoint("r2"), endpoint("r3")]})
    pending(listener)
    await publisher.apply_report(report(3, homes={"m": {7: "r3"}}))  # r1 left: its key placed again
    [change] = pending(listener)
    assert dict(change.homes["m"]) == {7: "r3"}

    publisher.clock.now += HOME_IDLE_SECONDS - 1
    await publisher.apply_report(report(4, homes={"m": {9: "r2"}}))
    publisher.clock.now += 2
    publisher.expire_homes()
    [change] = pending(listener)
    assert dict(change.homes["m"]) == {7: None, 11: None}
    assert dict(publisher.current().homes["m"]) == {9: "r2"}
    fresh = publisher.listen()
    [snapshot] = pending(fresh)
    assert dict(snapshot.homes["m"]) == {9: "r2"}


async def test_r6_5d_homes_reported_before_the_first_snapshot_are_in_it(publisher):
    publisher.set_endpoints({"m": [endpoint("r1")]})
    await publisher.apply_report(report(1, homes={"m": {5: "r1"}}))
    publisher.mark_ready()
    assert dict(publisher.current().homes["m"]) == {5: "r1"}
